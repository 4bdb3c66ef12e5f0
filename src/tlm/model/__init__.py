"""The transformers of J&M ch. 9 and Vaswani et al. 2017: attention, layers, the models."""

from torch import nn

from tlm.config import ModelConfig
from tlm.model.encoder import Encoder
from tlm.model.encoder_decoder import EncoderDecoder
from tlm.model.transformer import TransformerLM

MODELS: dict[str, type[nn.Module]] = {
    "decoder": TransformerLM,
    "encoder-decoder": EncoderDecoder,
    "encoder": Encoder,
}


def build_model(config: ModelConfig, init: bool = True) -> TransformerLM | EncoderDecoder | Encoder:
    """The model `config.model_type` names (config.json's "model" section says which)."""
    return MODELS[config.model_type](config, init=init)


__all__ = ["MODELS", "Encoder", "EncoderDecoder", "TransformerLM", "build_model"]
