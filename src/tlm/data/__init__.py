"""Data: corpora read as streams of documents, tokenized, packed into memmapped token files."""

from tlm.data.corpus import CorpusError, Source, documents, resolve_sources
from tlm.data.prepare import TokenData, prepare

__all__ = [
    "CorpusError",
    "Source",
    "TokenData",
    "batch_generator",
    "count_eval_chunks",
    "documents",
    "eval_windows",
    "prepare",
    "random_windows",
    "resolve_sources",
    "step_starts",
    "strided_windows",
    "windows_at",
]

BATCHES = (  # tlm.data.batches needs PyTorch: imported when one of these is first asked for
    "batch_generator",
    "count_eval_chunks",
    "eval_windows",
    "random_windows",
    "step_starts",
    "strided_windows",
    "windows_at",
)


def __getattr__(name: str):
    if name in BATCHES:
        from tlm.data import batches

        return getattr(batches, name)
    raise AttributeError(f"module 'tlm.data' has no attribute {name!r}")
