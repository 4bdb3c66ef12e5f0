"""Data: corpora read as streams of documents, tokenized and packed into token files
(`prepare`, `pairs`), which `tokens` reads back, memory-mapped."""

from pathlib import Path

from tlm.data.chat import prepare_chat
from tlm.data.corpus import CorpusError, Source, documents, resolve_sources
from tlm.data.pairs import prepare_pairs
from tlm.data.preference import prepare_preference
from tlm.data.prepare import prepare
from tlm.data.prompts import prepare_prompts
from tlm.data.tokens import ChatData, PairData, PreferenceData, PromptData, TokenData, read_meta

__all__ = [
    "ChatData",
    "CorpusError",
    "PairData",
    "PreferenceData",
    "PromptData",
    "Source",
    "TokenData",
    "batch_generator",
    "count_eval_chunks",
    "document_starts",
    "documents",
    "eval_windows",
    "open_data",
    "prepare",
    "prepare_chat",
    "prepare_pairs",
    "prepare_preference",
    "prepare_prompts",
    "random_windows",
    "resolve_sources",
    "step_starts",
    "strided_windows",
    "windows_at",
]


def open_data(folder: str | Path) -> TokenData | PairData:
    """A prepared folder: a token stream (`TokenData`), conversations (`ChatData`, a token
    stream with its loss mask), preference pairs (`PreferenceData`: conversations in twos),
    prompts with answers (`PromptData`) or translation pairs (`PairData`)."""
    meta = read_meta(Path(folder))
    if meta.get("task") == "translate":
        return PairData(folder, meta)
    kinds = {"chat": ChatData, "preference": PreferenceData, "prompts": PromptData}
    return kinds.get(meta.get("task"), TokenData)(folder)


BATCHES = (  # tlm.data.batches needs PyTorch: imported when one of these is first asked for
    "batch_generator",
    "count_eval_chunks",
    "document_starts",
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
