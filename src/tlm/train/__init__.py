"""Training: optimizer and schedule, the loop, checkpoints, reports."""

from tlm.train.distributed import Runtime
from tlm.train.loop import Diverged, Interrupted, Trainer
from tlm.train.opening import open_run
from tlm.train.run import (
    RunError,
    check_new_run,
    new_run_configs,
    resume_run_configs,
    run_tokenizer,
)

__all__ = [
    "Diverged",
    "Interrupted",
    "RunError",
    "Runtime",
    "Trainer",
    "check_new_run",
    "new_run_configs",
    "open_run",
    "resume_run_configs",
    "run_tokenizer",
]
