"""Serve a model over HTTP: the OpenAI API shape, continuous batching, streaming, metrics."""

from tlm.serve.app import create_app
from tlm.serve.engine import Engine, Event, Job, QueueFull
from tlm.serve.metrics import Metrics
from tlm.serve.requests import ApiError

__all__ = ["ApiError", "Engine", "Event", "Job", "Metrics", "QueueFull", "create_app"]
