"""Training: optimizer and schedule, the loop, checkpoints, reports."""

from tlm.train.loop import Diverged, Interrupted, Trainer
from tlm.train.run import RunError, new_run_configs, resume_run_configs

__all__ = [
    "Diverged",
    "Interrupted",
    "RunError",
    "Trainer",
    "new_run_configs",
    "resume_run_configs",
]
