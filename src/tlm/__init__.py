"""tlm: transformer language models as the textbook describes them."""

from tlm import upcalls
from tlm._version import __version__
from tlm.config import ModelConfig, TrainConfig
from tlm.errors import UserError

__all__ = [
    "ModelConfig",
    "TrainConfig",
    "TransformerLM",
    "UserError",
    "__version__",
    "load_model",
    "load_tokenizer",
]


def __getattr__(name: str):
    """The model's names (and `load_tokenizer`, which also reads GGUF files through the
    model's loaders) load PyTorch (about 1.2 s) when first asked for, so that a process that
    only tokenizes (a `tlm prepare --workers` worker, which uses `tlm.tokenizer`) never
    imports it."""
    if name == "TransformerLM":
        from tlm.model import TransformerLM

        return TransformerLM
    if name in ("load_model", "load_tokenizer"):
        import tlm.load

        return getattr(tlm.load, name)
    raise AttributeError(f"module 'tlm' has no attribute {name!r}")


def _generate_sequences(model, input_ids, attention_mask=None, **settings):
    """`TransformerLM.generate`'s decoding policy (`tlm/upcalls.py`), imported at its first
    call: a model exists by then, so PyTorch is loaded already."""
    from tlm.generate.sequences import generate_sequences

    return generate_sequences(model, input_ids, attention_mask, **settings)


upcalls.provide(generate_sequences=_generate_sequences)  # before any module can call it
