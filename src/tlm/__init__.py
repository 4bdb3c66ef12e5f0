"""tlm: transformer language models as the textbook describes them."""

from tlm._version import __version__
from tlm.config import ModelConfig, TrainConfig
from tlm.load import load_model
from tlm.model import TransformerLM
from tlm.tokenizer import load_tokenizer

__all__ = [
    "ModelConfig",
    "TrainConfig",
    "TransformerLM",
    "__version__",
    "load_model",
    "load_tokenizer",
]
