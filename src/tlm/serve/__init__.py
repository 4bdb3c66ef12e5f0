"""Serve a model over HTTP in three parts: routes (`routes.py`), the OpenAI API's request
and response shapes (`openai.py`), and the engine that decodes (`engine.py`); metrics."""

from tlm.serve.engine import Engine, Event, Job, QueueFull
from tlm.serve.metrics import Metrics
from tlm.serve.openai import ApiError
from tlm.serve.routes import create_app

__all__ = ["ApiError", "Engine", "Event", "Job", "Metrics", "QueueFull", "create_app"]
