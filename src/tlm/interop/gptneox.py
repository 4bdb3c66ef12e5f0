"""Hugging Face GPT-NeoX checkpoints <-> tlm: the rotary model `transformers` computes exactly.

tlm's `--position rope` decoder is `GPTNeoXForCausalLM` with full rotary (partial rotary
factor 1, base `rope_base`, the same rotate-half pairing as `model/positions.py`), the
sequential block of eq. 9.26-9.31 (`use_parallel_residual=False`), LayerNorm with bias and
a head tied or not. Its `nn.Linear` layers store weights as [out, in], so each of ours is
transposed; the fused query/key/value rows go head by head (q, k, v of head 0, then of
head 1, ...), where ours are three matrices side by side.

    GPT-NeoX name (prefix `gpt_neox.`)              tlm name                       shape
    embed_in.weight                                 embedding.E                    [V, d]
    layers.{l}.input_layernorm.weight / .bias       blocks.{l}.ln1.gamma / .beta   [d]
    layers.{l}.attention.query_key_value.weight     W_Q, W_K, W_V (by head)        [3·H·dh, d]
    layers.{l}.attention.query_key_value.bias       b_Q, b_K, b_V (by head)        [3·H·dh]
    layers.{l}.attention.dense.weight / .bias       W_O transposed / b_O           [d, H·dh]
    layers.{l}.post_attention_layernorm...          blocks.{l}.ln2.gamma / .beta   [d]
    layers.{l}.mlp.dense_h_to_4h.weight / .bias     W_1 transposed / b_1           [d_ff, d]
    layers.{l}.mlp.dense_4h_to_h.weight / .bias     W_2 transposed / b_2           [d, d_ff]
    final_layer_norm.weight / .bias                 ln_f.gamma / .beta             [d]
    embed_out.weight (no prefix)                    W_U transposed, or E if tied   [V, d]
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import Tensor

from tlm.config import ConfigError, ModelConfig
from tlm.interop.gpt2 import (
    ACTIVATIONS_OUT,
    HFFormatError,
    activation_in,
    refuse_unless_plain,
)
from tlm.tensor_files import LazyMatrix, TensorFiles


def rope(hf: dict[str, Any]) -> dict[str, Any]:
    """The rotary settings of a GPT-NeoX config, old names (rotary_pct, rotary_emb_base) or
    new (rope_parameters), with transformers' defaults (a quarter of each head, 10000)."""
    given = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    return {
        **given,
        "rope_type": given.get("rope_type", given.get("type", "default")),
        "rope_theta": float(given.get("rope_theta", hf.get("rotary_emb_base", 10000.0))),
        "partial_rotary_factor": float(
            given.get("partial_rotary_factor", hf.get("rotary_pct", 0.25))
        ),
    }


def scaling_from_gptneox(settings: dict[str, Any], positions: int) -> dict[str, Any]:
    """`rope_parameters` and max_position_embeddings -> ModelConfig's scaling fields
    (context_length included). transformers reads max_position_embeddings as the trained
    context for "dynamic", as the context for the others; YaRN's trained context is its
    original_max_position_embeddings."""
    kind = settings["rope_type"]
    if kind == "default":
        return {"context_length": positions}
    if kind not in ("linear", "dynamic", "yarn"):
        raise HFFormatError(f"rope_type {kind!r} has no equivalent in tlm")
    unknown = {"attention_factor", "mscale", "mscale_all_dim", "low_freq_factor"} & set(settings)
    if unknown or settings.get("truncate", True) is not True:
        named = ", ".join(sorted(unknown)) or "truncate=False"
        raise HFFormatError(f"rope_parameters {named}: tlm computes YaRN's defaults only")
    factor = float(settings["factor"])
    if kind == "dynamic":
        trained, context = positions, int(positions * factor)
    else:
        trained = settings.get("original_max_position_embeddings") or int(positions / factor)
        context = positions
    betas = {}
    if kind == "yarn":
        betas = {
            "yarn_beta_fast": float(settings.get("beta_fast") or 32.0),
            "yarn_beta_slow": float(settings.get("beta_slow") or 1.0),
        }
    return {
        "context_length": context,
        "rope_scaling": kind,
        "rope_factor": factor,
        "rope_original_context": int(trained),
        **betas,
    }


def gptneox_rope(config: ModelConfig) -> tuple[dict[str, Any], int]:
    """(`rope_parameters`, max_position_embeddings) of a rotary ModelConfig: "ntk" is the
    default rotation at its raised base, "dynamic" names the trained context, the others
    the whole one."""
    plain = {"rope_type": "default", "rope_theta": config.rope_base, "partial_rotary_factor": 1.0}
    method, s, d = config.rope_scaling, config.rope_factor, config.d_head
    if method is None:
        return plain, config.context_length
    if method == "ntk":
        return {**plain, "rope_theta": config.rope_base * s ** (d / (d - 2))}, config.context_length
    scaled = {**plain, "rope_type": method, "factor": s}
    if method == "dynamic":
        return scaled, config.trained_context
    if method == "yarn":
        scaled.update(
            original_max_position_embeddings=config.trained_context,
            beta_fast=config.yarn_beta_fast,
            beta_slow=config.yarn_beta_slow,
        )
    return scaled, config.context_length


def config_from_gptneox(hf: dict[str, Any]) -> ModelConfig:
    """GPTNeoXConfig fields -> the ModelConfig that computes the same function; a field tlm
    does not compute is refused, named."""
    settings = rope(hf)
    if hf.get("use_parallel_residual", True):
        raise HFFormatError(
            "use_parallel_residual=True (attention and MLP side by side) has no equivalent "
            "in tlm, whose block is sequential (eq. 9.26-9.31)"
        )
    if settings["partial_rotary_factor"] != 1.0:
        raise HFFormatError(
            f"partial_rotary_factor={settings['partial_rotary_factor']:g} (rotary_pct): tlm "
            "rotates every dimension of a head"
        )
    scaling = scaling_from_gptneox(settings, hf.get("max_position_embeddings", 2048))
    try:
        d, heads = hf.get("hidden_size", 6144), hf.get("num_attention_heads", 64)
        return ModelConfig(
            vocab_size=hf.get("vocab_size", 50432),
            d_model=d,
            n_layers=hf.get("num_hidden_layers", 44),
            n_heads=heads,
            d_ff=hf.get("intermediate_size", 4 * d),
            norm="pre",
            position="rope",
            activation=activation_in(hf, "hidden_act", "gelu"),
            tie_embeddings=hf.get("tie_word_embeddings", False),
            bias=True,  # attention_bias=False reads as zero biases
            dropout=float(hf.get("hidden_dropout", 0.0)),
            attn_dropout=float(hf.get("attention_dropout", 0.0)),
            layer_norm_eps=float(hf.get("layer_norm_eps", 1e-5)),
            rope_base=settings["rope_theta"],
            **scaling,
        )
    except ConfigError as exc:
        raise HFFormatError(f"config.json: {exc}") from None


def shape_fields(config: ModelConfig) -> dict[str, Any]:
    """The config.json fields of a model's shape, as GPT-NeoX and BERT both name them."""
    return {
        "vocab_size": config.vocab_size,
        "hidden_size": config.d_model,
        "num_hidden_layers": config.n_layers,
        "num_attention_heads": config.n_heads,
        "intermediate_size": config.d_ff,
        "hidden_act": ACTIVATIONS_OUT[config.activation],
    }


def gptneox_config(config: ModelConfig, eot_id: int | None) -> dict[str, Any]:
    """ModelConfig (rotary) -> GPTNeoXConfig fields; refuses (naming the field) what
    GPT-NeoX cannot express."""
    rotary = config.position == "rope"
    refuse_unless_plain(config, "GPT-NeoX", rotary, "is rotary (--position rope)")
    rope_parameters, positions = gptneox_rope(config)
    return {
        "architectures": ["GPTNeoXForCausalLM"],
        "model_type": "gpt_neox",
        **shape_fields(config),
        "max_position_embeddings": positions,
        "rope_parameters": rope_parameters,
        "rotary_pct": 1.0,  # the same, under the names older readers know
        "rotary_emb_base": rope_parameters["rope_theta"],
        "use_parallel_residual": False,
        "attention_bias": True,
        "layer_norm_eps": config.layer_norm_eps,
        "hidden_dropout": config.resid_dropout_p,
        "attention_dropout": config.attn_dropout_p,
        "initializer_range": 0.02,
        "tie_word_embeddings": config.tie_embeddings,
        "bos_token_id": eot_id,
        "eos_token_id": eot_id,
        "use_cache": True,
        "dtype": "float32",
    }


def gptneox_weights(
    tensors: Mapping[str, Tensor], config: ModelConfig, lazy_embedding: bool = False
) -> Iterator[tuple[str, Tensor | LazyMatrix]]:
    """GPT-NeoX tensors -> (tlm name, float32 tensor) in the model's order, part by part;
    every weight used exactly once (buffers such as rotary tables are not weights). With
    `lazy_embedding` (and safetensors files), E comes as a `LazyMatrix` left in the file."""
    buffers = ("rotary_emb.inv_freq", ".attention.bias", ".attention.masked_bias")
    names = {k for k in tensors if not k.endswith(buffers)}
    if config.tie_embeddings:
        names.discard("embed_out.weight")  # a tied head is embed_in itself
    pairs = _pairs(config)
    wanted = {hf for hf, _ in pairs}
    optional = {hf for hf in wanted if hf.endswith(".bias") and ".attention." in hf}
    missing = next((hf for hf in sorted(wanted - optional) if hf not in names), None)
    if missing is not None:
        raise HFFormatError(f"the checkpoint has no {missing} ({config.n_layers} layers)")
    unexpected = sorted(names - wanted)
    if unexpected:
        raise HFFormatError(f"unexpected tensors in the checkpoint: {', '.join(unexpected[:3])}")
    H, dh = config.n_heads, config.d_head
    for hf, name in pairs:
        if hf not in names:  # attention_bias=False: zeros
            rows = 3 * H * dh if "query_key_value" in hf else config.d_model
            tensor = torch.zeros(rows)
        elif name == "embedding.E" and lazy_embedding and isinstance(tensors, TensorFiles):
            yield name, tensors.lazy(hf)
            continue
        else:
            tensor = tensors[hf].float()
        if name.endswith("_QKV"):  # head by head [H, 3, dh, (d)] -> three of ours
            by_head = tensor.reshape(H, 3, dh, *tensor.shape[1:])
            for i, part in enumerate("QKV"):
                one = by_head[:, i].reshape(H * dh, *tensor.shape[1:])  # [H·dh, d] or [H·dh]
                yield name.replace("QKV", part), (one.t() if one.dim() == 2 else one).contiguous()
        elif tensor.dim() == 2 and name != "embedding.E":  # nn.Linear [out, in] -> [in, out]
            yield name, tensor.t().contiguous()
        else:
            yield name, tensor


def state_to_gptneox(state: dict[str, Tensor], config: ModelConfig) -> dict[str, Tensor]:
    """A tlm state dict -> GPT-NeoX tensors; missing biases become zeros; a tied head is not
    written (`tie_word_embeddings` makes transformers use embed_in for it)."""
    H, dh = config.n_heads, config.d_head
    out: dict[str, Tensor] = {}
    for hf, name in _pairs(config):
        if name.endswith("_QKV"):
            kind = name.rsplit(".", 1)[1][0]  # W or b
            parts = [state.get(name.replace("QKV", p)) for p in "QKV"]
            if parts[0] is None:  # bias=False
                parts = [torch.zeros(H * dh) for _ in parts]
            if kind == "W":  # three [d, H·dh] -> [H, 3, dh, d] -> [3·H·dh, d]
                stacked = torch.stack([p.t().reshape(H, dh, -1) for p in parts], dim=1)
            else:
                stacked = torch.stack([p.reshape(H, dh) for p in parts], dim=1)
            tensor = stacked.reshape(3 * H * dh, *stacked.shape[3:])
        elif name not in state:  # bias=False: GPT-NeoX adds zeros
            tensor = torch.zeros(out[hf.removesuffix(".bias") + ".weight"].shape[0])
        else:
            tensor = state[name]
            if tensor.dim() == 2 and name != "embedding.E":
                tensor = tensor.t()  # [in, out] -> nn.Linear's [out, in]
        out[hf] = tensor.detach().float().contiguous()
    return out


# one block's tensors: GPT-NeoX name after `gpt_neox.layers.{l}.`, tlm's after `blocks.{l}.`
BLOCK_NAMES = [
    ("input_layernorm.weight", "ln1.gamma"),
    ("input_layernorm.bias", "ln1.beta"),
    ("attention.query_key_value.weight", "attn.W_QKV"),
    ("attention.query_key_value.bias", "attn.b_QKV"),
    ("attention.dense.weight", "attn.W_O"),
    ("attention.dense.bias", "attn.b_O"),
    ("post_attention_layernorm.weight", "ln2.gamma"),
    ("post_attention_layernorm.bias", "ln2.beta"),
    ("mlp.dense_h_to_4h.weight", "ffn.W_1"),
    ("mlp.dense_h_to_4h.bias", "ffn.b_1"),
    ("mlp.dense_4h_to_h.weight", "ffn.W_2"),
    ("mlp.dense_4h_to_h.bias", "ffn.b_2"),
]


def _pairs(config: ModelConfig) -> list[tuple[str, str]]:
    """(GPT-NeoX name, tlm name), in the model's order; the head last, tied or not."""
    pairs = [("gpt_neox.embed_in.weight", "embedding.E")]
    for layer in range(config.n_layers):
        pairs += [
            (f"gpt_neox.layers.{layer}.{hf}", f"blocks.{layer}.{ours}") for hf, ours in BLOCK_NAMES
        ]
    pairs += [
        ("gpt_neox.final_layer_norm.weight", "ln_f.gamma"),
        ("gpt_neox.final_layer_norm.bias", "ln_f.beta"),
    ]
    return pairs if config.tie_embeddings else [*pairs, ("embed_out.weight", "W_U")]
