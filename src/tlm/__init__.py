"""tlm: transformer language models as the textbook describes them."""

from tlm._version import __version__
from tlm.config import ModelConfig, TrainConfig
from tlm.errors import UserError
from tlm.tokenizer import load_tokenizer

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
    """The model's names load PyTorch (about 1.2 s) when first asked for, so that a process
    that only tokenizes (a `tlm prepare --workers` worker) never imports it."""
    if name == "TransformerLM":
        from tlm.model import TransformerLM

        return TransformerLM
    if name == "load_model":
        from tlm.load import load_model

        return load_model
    raise AttributeError(f"module 'tlm' has no attribute {name!r}")
