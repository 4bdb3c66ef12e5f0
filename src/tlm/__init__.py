"""tlm: transformer language models as the textbook describes them."""

from tlm.config import ModelConfig
from tlm.model import TransformerLM

__all__ = ["ModelConfig", "TransformerLM"]
__version__ = "0.1.0"
