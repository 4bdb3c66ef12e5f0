"""Hugging Face GPT-2 checkpoints <-> tlm: the config fields and the weight names.

GPT-2 is the pre-norm transformer of §9.2 with learned positions, tanh-approximated GELU,
biases and a tied head, so its weights map one to one onto ours. Its `Conv1D` layers store
weights as [in, out] and right-multiply, as the book (and tlm) does: no transposes, except
an untied `lm_head` ([V, d], an `nn.Linear`), which is W_U transposed.

    GPT-2 name (prefix `transformer.`)   tlm name                         shape
    wte.weight                           embedding.E                      [V, d]
    wpe.weight                           embedding.P                      [N, d]
    h.{l}.ln_1.weight / .bias            blocks.{l}.ln1.gamma / .beta     [d]
    h.{l}.attn.c_attn.weight             W_Q | W_K | W_V (side by side)   [d, 3·H·d_head]
    h.{l}.attn.c_attn.bias               b_Q | b_K | b_V                  [3·H·d_head]
    h.{l}.attn.c_proj.weight / .bias     blocks.{l}.attn.W_O / b_O        [H·d_head, d]
    h.{l}.ln_2.weight / .bias            blocks.{l}.ln2.gamma / .beta     [d]
    h.{l}.mlp.c_fc.weight / .bias        blocks.{l}.ffn.W_1 / b_1         [d, d_ff]
    h.{l}.mlp.c_proj.weight / .bias      blocks.{l}.ffn.W_2 / b_2         [d_ff, d]
    ln_f.weight / .bias                  ln_f.gamma / .beta               [d]
    lm_head.weight (untied only)         W_U transposed                   [V, d]
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from tlm.config import ConfigError, ModelConfig
from tlm.errors import UserError
from tlm.model.positions import sinusoidal_table
from tlm.tensor_files import LazyMatrix, TensorFiles

# GPT-2's activation_function -> tlm's activation, and back
ACTIVATIONS_IN = {
    "gelu_new": "gelu_tanh",
    "gelu_pytorch_tanh": "gelu_tanh",
    "gelu": "gelu",
    "relu": "relu",
    "relu2": "relu2",
}
ACTIVATIONS_OUT = {"gelu_tanh": "gelu_new", "gelu": "gelu", "relu": "relu", "relu2": "relu2"}
# buffers older GPT-2 checkpoints store beside the weights (the causal mask): not weights
BUFFER_SUFFIXES = (".attn.bias", ".attn.masked_bias")


class HFFormatError(UserError):
    """A Hugging Face directory tlm cannot read, or a tlm model GPT-2 cannot express."""


def read_hf_config(path: str | Path) -> dict[str, Any]:
    file = Path(path) / "config.json"
    try:
        return json.loads(file.read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise HFFormatError(f"cannot read {file}: {exc}") from None


def config_from_gpt2(hf: dict[str, Any]) -> ModelConfig:
    """GPT2Config fields -> the ModelConfig that computes the same function."""
    if hf.get("model_type") != "gpt2":
        raise HFFormatError(f"model_type {hf.get('model_type')!r}: tlm reads gpt2 checkpoints only")
    unsupported = {
        "add_cross_attention": True,  # an encoder-decoder variant
        "scale_attn_weights": False,  # scores without the 1/√d_k of eq. 9.11
        "scale_attn_by_inverse_layer_idx": True,  # an extra 1/(l+1) on the scores
    }
    for field, value in unsupported.items():
        if hf.get(field, not value) == value:
            raise HFFormatError(f"{field}={value} has no equivalent in tlm")
    try:
        return ModelConfig(
            vocab_size=hf.get("vocab_size", 50257),
            d_model=hf.get("n_embd", 768),
            n_layers=hf.get("n_layer", 12),
            n_heads=hf.get("n_head", 12),
            d_ff=hf.get("n_inner"),  # None: ModelConfig's 4·d_model, as GPT-2's
            context_length=hf.get("n_positions", hf.get("n_ctx", 1024)),
            norm="pre",
            position="learned",
            activation=activation_in(hf, "activation_function", "gelu_new"),
            tie_embeddings=hf.get("tie_word_embeddings", True),
            bias=True,
            **dropouts_from_gpt2(hf),
            layer_norm_eps=float(hf.get("layer_norm_epsilon", 1e-5)),
        )
    except ConfigError as exc:
        raise HFFormatError(f"config.json: {exc}") from None


def activation_in(hf: dict[str, Any], field: str, default: str) -> str:
    """A Hugging Face config's activation (`field`, transformers' ACT2FN name) -> tlm's."""
    activation = hf.get(field, default)
    if activation not in ACTIVATIONS_IN:
        raise HFFormatError(
            f"{field} {activation!r} has no equivalent in tlm (known: {', '.join(ACTIVATIONS_IN)})"
        )
    return ACTIVATIONS_IN[activation]


def dropouts_from_gpt2(hf: dict[str, Any]) -> dict[str, float | None]:
    """GPT-2's three dropout rates (0.1 each unless given) -> `dropout` (resid_pdrop) and
    `attn_dropout` / `embd_dropout` only where they differ from it, so that a model whose
    rates are equal has the textbook's one `dropout`, as before the split."""
    resid = float(hf.get("resid_pdrop", 0.1))
    attn, embd = float(hf.get("attn_pdrop", 0.1)), float(hf.get("embd_pdrop", 0.1))
    return {
        "dropout": resid,
        "attn_dropout": None if attn == resid else attn,
        "embd_dropout": None if embd == resid else embd,
    }


def gpt2_config(config: ModelConfig, eot_id: int | None) -> dict[str, Any]:
    """ModelConfig -> GPT2Config fields; refuses (naming the field) what GPT-2 cannot express."""
    refuse_unless_plain(
        config,
        "GPT-2",
        config.position in ("learned", "sinusoidal"),
        "adds absolute positions (train with --position learned or sinusoidal)",
    )
    return {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": config.vocab_size,
        "n_positions": config.context_length,
        "n_embd": config.d_model,
        "n_layer": config.n_layers,
        "n_head": config.n_heads,
        "n_inner": config.d_ff,
        "activation_function": ACTIVATIONS_OUT[config.activation],
        "resid_pdrop": config.resid_dropout_p,
        "embd_pdrop": config.embd_dropout_p,
        "attn_pdrop": config.attn_dropout_p,
        "layer_norm_epsilon": config.layer_norm_eps,
        "initializer_range": 0.02,
        "scale_attn_weights": True,
        "tie_word_embeddings": config.tie_embeddings,
        "bos_token_id": eot_id,
        "eos_token_id": eot_id,
        "use_cache": True,
        "dtype": "float32",
    }


def refuse_unless_plain(config: ModelConfig, target: str, position_ok: bool, position: str):
    """Refuse, naming the field, what a Hugging Face decoder class does not compute: post-norm,
    another position scheme than `target`'s (which "is/adds ..." `position`), a d_head other
    than d_model / n_heads, a query/key norm, an attention window."""
    refusals = [
        (config.norm != "pre", f"norm={config.norm!r}: {target} is pre-norm (--norm pre)"),
        (not position_ok, f"position={config.position!r}: {target} {position}"),
        (
            config.d_attn != config.d_model,
            f"d_head={config.d_head}: {target} needs d_head = d_model / n_heads "
            f"= {config.d_model / config.n_heads:g} (leave --d-head unset)",
        ),
        (config.qk_norm, f"qk_norm: {target}'s attention has no query/key norm"),
        (
            config.attention_window is not None,
            f"attention_window={config.attention_window}: {target} attends to every earlier "
            "position",
        ),
    ]
    for refused, message in refusals:
        if refused:
            raise HFFormatError(f"cannot export to {target}: {message}")


def read_hf_weights(path: str | Path) -> Mapping[str, Tensor]:
    """The tensors of a Hugging Face directory: safetensors (one file or shards), each read
    when it is looked up, or a `pytorch_model.bin` read whole with `weights_only=True`
    (never arbitrary pickle)."""
    folder = Path(path)
    index = folder / "model.safetensors.index.json"
    try:
        if (folder / "model.safetensors").is_file():
            return TensorFiles([folder / "model.safetensors"])
        if index.is_file():
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
            return TensorFiles([folder / shard for shard in shards])
        if (folder / "pytorch_model.bin").is_file():
            return torch.load(folder / "pytorch_model.bin", map_location="cpu", weights_only=True)
    except Exception as exc:  # safetensors, json or the weights-only unpickler refusing
        raise HFFormatError(f"cannot read the weights in {folder}: {exc}") from None
    raise HFFormatError(f"{folder} has no model.safetensors or pytorch_model.bin")


def gpt2_weights(
    tensors: Mapping[str, Tensor], config: ModelConfig, lazy_embedding: bool = False
) -> Iterator[tuple[str, Tensor | LazyMatrix]]:
    """GPT-2 tensors -> (tlm name, float32 tensor) in the model's order, one part of the
    model after another, each tensor looked up only when it is reached (so a loader can
    pack a block before the next one is read). The names are checked first: every weight
    must be used exactly once. With `lazy_embedding` (and safetensors files), E comes as a
    `LazyMatrix` left in the file."""
    names = {_strip(k): k for k in tensors if not k.endswith(BUFFER_SUFFIXES)}
    if config.tie_embeddings:
        names.pop("lm_head.weight", None)  # a tied head is wte itself
    pairs = _pairs(config)
    missing = next((hf_name for hf_name, _ in pairs if hf_name not in names), None)
    if missing is not None:
        raise HFFormatError(f"the checkpoint has no {missing} ({config.n_layers} layers)")
    unexpected = sorted(set(names) - {hf_name for hf_name, _ in pairs})
    if unexpected:
        raise HFFormatError(f"unexpected tensors in the checkpoint: {', '.join(unexpected[:3])}")
    for hf_name, name in pairs:
        if name == "embedding.E" and lazy_embedding and isinstance(tensors, TensorFiles):
            yield name, tensors.lazy(names[hf_name])  # wte [V, d] is E as it is
            continue
        tensor = tensors[names[hf_name]].float()
        if name.endswith("_QKV"):  # [d, 3d] -> 3 × [d, d]
            for part, third in zip("QKV", tensor.chunk(3, dim=-1), strict=True):
                yield name.replace("QKV", part), third.contiguous()
        elif name == "W_U":
            yield name, tensor.t().contiguous()  # lm_head [V, d] -> W_U [d, V]
        else:
            yield name, tensor


def state_to_gpt2(state: dict[str, Tensor], config: ModelConfig) -> dict[str, Tensor]:
    """A tlm state dict -> GPT-2 tensors; missing biases become zeros, a sinusoidal table
    becomes `wpe`, so Hugging Face computes the same function."""
    state = dict(state)
    if config.position == "sinusoidal":
        state["embedding.P"] = sinusoidal_table(config.context_length, config.d_model)
    for layer in range(config.n_layers):
        attn = f"blocks.{layer}.attn"
        for kind in ("W", "b"):
            if f"{attn}.{kind}_Q" in state:  # no b_Q with bias=False: zeros below
                parts = [state.pop(f"{attn}.{kind}_{part}") for part in "QKV"]
                state[f"{attn}.{kind}_QKV"] = torch.cat(parts, dim=-1)  # 3 × [d, d] -> [d, 3d]
    if "W_U" in state:
        state["W_U"] = state["W_U"].t()  # W_U [d, V] -> lm_head [V, d]
    out: dict[str, Tensor] = {}
    for hf_name, name in _pairs(config):  # each bias comes right after its weight
        if name not in state and hf_name.endswith(".bias"):  # bias=False: GPT-2 adds zeros
            weight = out[_prefix(hf_name.removesuffix(".bias") + ".weight")]
            state[name] = torch.zeros(weight.shape[-1])  # [.., out] -> [out]
        out[_prefix(hf_name)] = state[name].detach().float().contiguous()
    return out


# one block's tensors: GPT-2 name after `h.{l}.`, tlm name after `blocks.{l}.` (weight, then bias)
BLOCK_NAMES = [
    ("ln_1.weight", "ln1.gamma"),
    ("ln_1.bias", "ln1.beta"),
    ("attn.c_attn.weight", "attn.W_QKV"),  # W_Q | W_K | W_V, split and joined above
    ("attn.c_attn.bias", "attn.b_QKV"),
    ("attn.c_proj.weight", "attn.W_O"),
    ("attn.c_proj.bias", "attn.b_O"),
    ("ln_2.weight", "ln2.gamma"),
    ("ln_2.bias", "ln2.beta"),
    ("mlp.c_fc.weight", "ffn.W_1"),
    ("mlp.c_fc.bias", "ffn.b_1"),
    ("mlp.c_proj.weight", "ffn.W_2"),
    ("mlp.c_proj.bias", "ffn.b_2"),
]


def _pairs(config: ModelConfig) -> list[tuple[str, str]]:
    """(GPT-2 name without the `transformer.` prefix, tlm name), for the fused QKV too."""
    pairs = [("wte.weight", "embedding.E"), ("wpe.weight", "embedding.P")]
    for layer in range(config.n_layers):
        pairs += [(f"h.{layer}.{hf}", f"blocks.{layer}.{ours}") for hf, ours in BLOCK_NAMES]
    pairs += [("ln_f.weight", "ln_f.gamma"), ("ln_f.bias", "ln_f.beta")]
    if not config.tie_embeddings:
        pairs.append(("lm_head.weight", "W_U"))
    return pairs


def _strip(name: str) -> str:
    return name.removeprefix("transformer.")


def _prefix(name: str) -> str:
    return name if name.startswith("lm_head.") else f"transformer.{name}"
