"""Using a model as §10.7 does: scoring continuations, classification by label probability,
multiple choice, question answering and summarising as continuations."""

from tlm.tasks.choose import (
    Classified,
    accuracy,
    classify,
    confusion_matrix,
    multiple_choice,
)
from tlm.tasks.prompts import answer, qa_prompt, summarize, summary_prompt
from tlm.tasks.score import Scored, TaskError, encode_pair, score, split_at_context

__all__ = [
    "Classified",
    "Scored",
    "TaskError",
    "accuracy",
    "answer",
    "classify",
    "confusion_matrix",
    "encode_pair",
    "multiple_choice",
    "qa_prompt",
    "score",
    "split_at_context",
    "summarize",
    "summary_prompt",
]
