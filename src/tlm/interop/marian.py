"""tlm's encoder-decoder in Hugging Face's `MarianMTModel` layout (the paper's model).

Marian's layers are the post-norm blocks of Vaswani et al.: scaled embeddings shared by
both languages and the head, sinusoidal positions, LayerNorm after each residual add, no
final norm. Two things differ in layout only:

- **Products:** `nn.Linear` stores W^T, so W_Q [d, H·d_head] becomes `q_proj.weight`
  [H·d_head, d].
- **Sinusoids:** Marian lays them out as [sin | cos] halves; the paper and tlm interleave
  them (sin at 2i, cos at 2i+1). Every operation on the model dimension (sums, products,
  LayerNorm's mean and variance) treats its coordinates alike. So permuting that dimension
  in every weight, `perm` = [0, 2, 4, …, 1, 3, 5, …], gives a model whose residual stream
  is tlm's, permuted: Marian's sinusoids exactly, and the same logits (tested).

What Marian cannot express is refused: pre-norm (its layers are post-norm), learned or no
positions, d_head·H ≠ d_model, a LayerNorm ε other than 1e-5.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from tlm.config import ModelConfig
from tlm.interop.gpt2 import HFFormatError

ACTIVATIONS = {"relu": "relu", "gelu": "gelu", "gelu_tanh": "gelu_pytorch_tanh"}
PROJECTIONS = {"Q": "q_proj", "K": "k_proj", "V": "v_proj", "O": "out_proj"}


def check_marian(config: ModelConfig) -> None:
    """A one-line error naming what Marian's layout cannot hold."""
    problems = []
    if config.norm != "post":
        problems.append("pre-norm (Marian's layers are post-norm)")
    if config.position != "sinusoidal":
        problems.append(f"{config.position} positions (Marian's are sinusoidal)")
    if config.d_head * config.n_heads != config.d_model:
        problems.append("d_head x n_heads != d_model")
    if config.layer_norm_eps != 1e-5:
        problems.append(f"layer_norm_eps {config.layer_norm_eps} (Marian's is 1e-5)")
    if config.qk_norm:
        problems.append("qk_norm (Marian's attention has none)")
    if problems:
        raise HFFormatError(f"MarianMTModel cannot express {'; '.join(problems)}")


def marian_config(config: ModelConfig, eot_id: int) -> dict[str, Any]:
    """MarianConfig fields for `config`; <|endoftext|> starts, ends and pads."""
    check_marian(config)
    return {
        "model_type": "marian",
        "architectures": ["MarianMTModel"],
        "vocab_size": config.vocab_size,
        "decoder_vocab_size": config.vocab_size,
        "d_model": config.d_model,
        "encoder_layers": config.n_encoder_layers,
        "decoder_layers": config.n_layers,
        "encoder_attention_heads": config.n_heads,
        "decoder_attention_heads": config.n_heads,
        "encoder_ffn_dim": config.d_ff,
        "decoder_ffn_dim": config.d_ff,
        "activation_function": ACTIVATIONS[config.activation],
        "max_position_embeddings": config.context_length,
        "scale_embedding": True,
        "share_encoder_decoder_embeddings": True,
        "tie_word_embeddings": config.tie_embeddings,
        "dropout": config.resid_dropout_p,  # Marian's one rate for residuals and embeddings
        "attention_dropout": config.attn_dropout_p,
        "activation_dropout": 0.0,
        "is_encoder_decoder": True,
        "pad_token_id": eot_id,
        "eos_token_id": eot_id,
        "decoder_start_token_id": eot_id,
        "forced_eos_token_id": eot_id,
    }


def interleaved_to_halves(d: int) -> Tensor:
    """The permutation of the model dimension that takes tlm's sinusoids to Marian's."""
    return torch.cat([torch.arange(0, d, 2), torch.arange(1, d, 2)])


def state_to_marian(state: dict[str, Tensor], config: ModelConfig) -> dict[str, Tensor]:
    """tlm's EncoderDecoder state dict -> MarianMTModel's names, layouts and permutation."""
    check_marian(config)
    perm = interleaved_to_halves(config.d_model)
    out: dict[str, Tensor] = {}

    def vector(name: str) -> Tensor:  # along the model dimension
        return state[name][perm].contiguous()

    def bias(name: str, size: int, along_d: bool) -> Tensor:
        if name not in state:  # bias=False: Marian's biases are zeros
            return torch.zeros(size)
        return vector(name) if along_d else state[name].clone()

    for side, n_layers in (("encoder", config.n_encoder_layers), ("decoder", config.n_layers)):
        attentions = [("attn", "self_attn")] + (
            [("cross", "encoder_attn")] if side == "decoder" else []
        )
        norms = [("ln1", "self_attn_layer_norm"), ("ln2", "final_layer_norm")]
        if side == "decoder":
            norms.append(("ln_cross", "encoder_attn_layer_norm"))
        for i in range(n_layers):
            ours, theirs = f"{side}.{i}", f"model.{side}.layers.{i}"
            for mine, hf in attentions:
                for letter, proj in PROJECTIONS.items():
                    W = state[f"{ours}.{mine}.W_{letter}"]
                    W = W[:, perm] if letter == "O" else W[perm, :]  # W_O writes to d
                    out[f"{theirs}.{hf}.{proj}.weight"] = W.t().contiguous()
                    size = config.d_model if letter == "O" else config.d_attn
                    key = f"{ours}.{mine}.b_{letter}"
                    out[f"{theirs}.{hf}.{proj}.bias"] = bias(key, size, letter == "O")
            for mine, hf in norms:
                out[f"{theirs}.{hf}.weight"] = vector(f"{ours}.{mine}.gamma")
                key = f"{ours}.{mine}.beta"
                out[f"{theirs}.{hf}.bias"] = bias(key, config.d_model, along_d=True)
            out[f"{theirs}.fc1.weight"] = state[f"{ours}.ffn.W_1"][perm, :].t().contiguous()
            out[f"{theirs}.fc1.bias"] = bias(f"{ours}.ffn.b_1", config.d_ff, along_d=False)
            out[f"{theirs}.fc2.weight"] = state[f"{ours}.ffn.W_2"][:, perm].t().contiguous()
            out[f"{theirs}.fc2.bias"] = bias(f"{ours}.ffn.b_2", config.d_model, along_d=True)
    E = state["embedding.E"][:, perm]
    for name in ("model.shared", "model.encoder.embed_tokens", "model.decoder.embed_tokens"):
        out[f"{name}.weight"] = E.clone()
    head = E if config.tie_embeddings else state["W_U"][perm, :].t()
    out["lm_head.weight"] = head.contiguous().clone()
    out["final_logits_bias"] = torch.zeros(1, config.vocab_size)
    return out
