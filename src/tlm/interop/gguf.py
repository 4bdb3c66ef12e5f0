"""GGUF, llama.cpp's file: a tlm decoder as its `gpt2` (absolute positions) or `gptneox`
(rotary) architecture, written and read with the `gguf` package (the optional `gguf`
extra).

Both architectures are the pre-norm block of eq. 9.26-9.31 with biases and one fused
query/key/value product whose rows are all queries, then all keys, then all values. GGUF
stores a matrix as [out, in] (ggml's [in, out] read backwards), so each of ours, which
right-multiplies, is transposed.

    GGUF name                        tlm name                          shape
    token_embd.weight                embedding.E                       [V, d]
    position_embd.weight (gpt2)      embedding.P (or the sinusoid)     [N, d]
    blk.{l}.attn_norm.weight / bias  blocks.{l}.ln1.gamma / .beta      [d]
    blk.{l}.attn_qkv.weight / bias   W_Q, W_K, W_V transposed, stacked [3d, d]
    blk.{l}.attn_output.weight/bias  W_O transposed / b_O              [d, d]
    blk.{l}.ffn_norm.weight / bias   blocks.{l}.ln2.gamma / .beta      [d]
    blk.{l}.ffn_up.weight / bias     W_1 transposed / b_1              [d_ff, d]
    blk.{l}.ffn_down.weight / bias   W_2 transposed / b_2              [d, d_ff]
    output_norm.weight / bias        ln_f.gamma / .beta                [d]
    output.weight                    W_U transposed, or E when tied    [V, d]

llama.cpp computes GELU with the tanh approximation in both architectures; tlm's exact
GELU is written as it is (`tlm.activation` records it, and a reader here rebuilds it), and
llama.cpp's result differs from tlm's by that approximation (docs/export.md measures it).
ReLU and ReLU² have no equivalent there and are refused.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from tlm.chat import JINJA_PLAIN
from tlm.config import ConfigError, ModelConfig
from tlm.interop import q4k, q6k
from tlm.interop.gguf_tokens import (
    GGUFError,
    _gguf,
    open_gguf,
    read_gguf_tokenizer,
    vocab_fields,
)
from tlm.interop.gpt2 import refuse_unless_plain
from tlm.io import atomic_path
from tlm.model import TransformerLM
from tlm.model.positions import sinusoidal_table
from tlm.tokenizer import Tokenizer, TokenizerError

TYPES = ("f32", "f16", "q8_0", "q4_0", "q4_k", "q4_k_m")
ARCHITECTURES = ("gpt2", "gptneox")
BLOCK = [  # GGUF name after `blk.{l}.`, tlm name after `blocks.{l}.`
    ("attn_norm.weight", "ln1.gamma"),
    ("attn_norm.bias", "ln1.beta"),
    ("attn_qkv.weight", "attn.W_QKV"),
    ("attn_qkv.bias", "attn.b_QKV"),
    ("attn_output.weight", "attn.W_O"),
    ("attn_output.bias", "attn.b_O"),
    ("ffn_norm.weight", "ln2.gamma"),
    ("ffn_norm.bias", "ln2.beta"),
    ("ffn_up.weight", "ffn.W_1"),
    ("ffn_up.bias", "ffn.b_1"),
    ("ffn_down.weight", "ffn.W_2"),
    ("ffn_down.bias", "ffn.b_2"),
]


def export_gguf(
    model: TransformerLM, tokenizer: Tokenizer, out: str | Path, kind: str = "f32"
) -> Path:
    """Write `model` and `tokenizer` as one GGUF file at `out`, its matrices in `kind`
    ("f32", "f16", "q8_0", "q4_0" or "q4_k": the blocks' matrices in Q4_0 or Q4_K, the token
    embeddings and the head in Q8_0, as tlm runs them; vectors stay f32, a matrix whose rows
    are not a whole number of Q4_K's 256-value super-blocks is written Q4_0, and one whose
    rows are not a whole number of 32-value blocks f16; "q4_k_m": llama.cpp's Q4_K_M mix,
    `mixed`, with its fallbacks). The file appears whole or not at all, and an existing one
    is never replaced."""
    gguf = _gguf()
    if not isinstance(model, TransformerLM):
        raise GGUFError("llama.cpp's gpt2 and gptneox are decoders: a translation run has no GGUF")
    if kind not in TYPES:
        raise GGUFError(f"unknown GGUF type {kind!r}; choose one of {', '.join(TYPES)}")
    config = model.config
    arch = _architecture(config)
    if tokenizer.vocab_size > config.vocab_size:
        raise GGUFError(
            f"the tokenizer has {tokenizer.vocab_size} tokens, the model {config.vocab_size}"
        )
    try:
        vocab = vocab_fields(tokenizer, config.vocab_size)
    except TokenizerError as exc:
        raise GGUFError(str(exc)) from None
    out = Path(out)
    if out.exists():
        raise GGUFError(f"{out} already exists; choose a new name")
    out.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(out) as tmp:
        writer = gguf.GGUFWriter(tmp, arch)
        _write_fields(writer, gguf, config, vocab, kind)
        tensors = gguf_tensors(model.state_dict(), config)
        mix = (config.n_layers, "output.weight" in tensors)  # what q4_k_m's types depend on
        for name, tensor in tensors.items():
            _add_tensor(writer, gguf, name, tensor, kind, mix)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
    return out


def _architecture(config: ModelConfig) -> str:
    absolute = config.position in ("learned", "sinusoidal")
    arch = "gpt2" if absolute else "gptneox"
    refuse_unless_plain(
        config, f"GGUF ({arch})", absolute or config.position == "rope", "needs positions"
    )
    if config.activation not in ("gelu", "gelu_tanh"):
        raise GGUFError(
            f"cannot export to GGUF: activation={config.activation!r}: llama.cpp's gpt2 and "
            "gptneox compute GELU"
        )
    if config.rope_scaling == "dynamic":
        raise GGUFError(
            "cannot export to GGUF: rope_scaling='dynamic': llama.cpp has no dynamic NTK "
            "(linear and yarn go to rope.scaling.*, ntk to a raised rope.freq_base)"
        )
    return arch


def _write_fields(writer, gguf, config: ModelConfig, vocab: dict[str, Any], kind: str) -> None:
    writer.add_name("tlm model")
    writer.add_context_length(config.context_length)
    writer.add_embedding_length(config.d_model)
    writer.add_block_count(config.n_layers)
    writer.add_feed_forward_length(config.d_ff)
    writer.add_head_count(config.n_heads)
    writer.add_layer_norm_eps(config.layer_norm_eps)
    if config.position == "rope":
        writer.add_rope_dimension_count(config.d_head)  # every dimension of a head rotates
        s, d = config.rope_factor, config.d_head
        ntk = s ** (d / (d - 2)) if config.rope_scaling == "ntk" else 1.0
        writer.add_rope_freq_base(config.rope_base * ntk)
        if config.rope_scaling in ("linear", "yarn"):  # llama.cpp's names for the same
            writer.add_rope_scaling_type(gguf.RopeScalingType(config.rope_scaling))
            writer.add_rope_scaling_factor(config.rope_factor)
            writer.add_rope_scaling_orig_ctx_len(config.trained_context)
        if config.rope_scaling == "yarn":
            writer.add_rope_scaling_yarn_beta_fast(config.yarn_beta_fast)
            writer.add_rope_scaling_yarn_beta_slow(config.yarn_beta_slow)
        writer.add_parallel_residual(False)  # the sequential block
    file_types = {"f32": "ALL_F32", "f16": "MOSTLY_F16", "q8_0": "MOSTLY_Q8_0"}
    file_types |= {"q4_0": "MOSTLY_Q4_0", "q4_k": "MOSTLY_Q4_K_S", "q4_k_m": "MOSTLY_Q4_K_M"}
    writer.add_file_type(gguf.LlamaFileType[file_types[kind].upper()])
    if kind not in ("f32", "f16"):
        writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list(vocab["tokens"])
    writer.add_token_types(vocab["types"])
    writer.add_token_merges(vocab["merges"])
    writer.add_bos_token_id(vocab["eot_id"])
    if vocab["end_id"] is not None:  # an assistant ends its turn, and its text, at <|end|>
        writer.add_eos_token_id(vocab["end_id"])
        writer.add_eot_token_id(vocab["end_id"])
        writer.add_chat_template(JINJA_PLAIN)
    else:
        writer.add_eos_token_id(vocab["eot_id"])
    writer.add_add_bos_token(False)  # tlm's conditioning puts no token before a prompt
    writer.add_string("tlm.activation", config.activation)
    writer.add_string("tlm.tokenizer", vocab["kind"])


def gguf_tensors(state: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, np.ndarray]:
    """A tlm state dict -> GGUF's tensors (float32, [out, in]); missing biases as zeros, a
    sinusoidal table as position_embd, a tied head written out where gptneox needs it."""
    weights = {k: v.detach().float() for k, v in state.items()}
    tensors = {"token_embd.weight": weights["embedding.E"]}
    if config.position == "learned":
        tensors["position_embd.weight"] = weights["embedding.P"]
    elif config.position == "sinusoidal":
        tensors["position_embd.weight"] = sinusoidal_table(config.context_length, config.d_model)
    for layer in range(config.n_layers):
        block = f"blocks.{layer}."
        for gguf_name, name in BLOCK:
            if name.endswith("QKV"):
                parts = [weights.get(block + name.replace("QKV", p)) for p in "QKV"]
                tensor = None if parts[0] is None else torch.cat(parts, dim=-1)  # [d, 3d]
            else:
                tensor = weights.get(block + name)
            if tensor is None:  # bias=False (no biases, no LayerNorm betas): llama.cpp adds zeros
                tensor = torch.zeros(tensors[f"blk.{layer}.{gguf_name[:-5]}.weight"].shape[0])
            tensors[f"blk.{layer}.{gguf_name}"] = tensor.t() if tensor.dim() == 2 else tensor
    tensors["output_norm.weight"] = weights["ln_f.gamma"]
    tensors["output_norm.bias"] = weights.get("ln_f.beta", torch.zeros(config.d_model))
    if not config.tie_embeddings:
        tensors["output.weight"] = weights["W_U"].t()
    elif config.position == "rope":  # llama.cpp's gptneox reads its head from output.weight
        tensors["output.weight"] = weights["embedding.E"]
    return {name: t.contiguous().numpy() for name, t in tensors.items()}


def mixed(name: str, n_layers: int, head: bool) -> str:
    """The GGUF type of matrix `name` in llama.cpp's Q4_K_M mix: Q4_K, and Q6_K for the head
    and, in a layer that `use_more_bits` (the first and last eighth, and every third between),
    for attn_qkv and ffn_down; the token embeddings are the head where the file has no
    output.weight. Measured: llama.cpp's own quantizer (llama-cpp-python 0.3.36) gives every
    tensor of tlm's gpt2 and gptneox files these types (`bench/gguf.py`)."""
    if name == "output.weight" or (name == "token_embd.weight" and not head):
        return "q6_k"
    if ".attn_qkv." in name or ".ffn_down." in name:
        i = int(name.split(".")[1])
        more = i < n_layers // 8 or i >= 7 * n_layers // 8 or (i - n_layers // 8) % 3 == 2
        return "q6_k" if more else "q4_k"
    return "q4_k"


K_FALLBACK = {"q4_k": "q5_0", "q6_k": "q8_0"}  # llama.cpp's, for rows not whole super-blocks


def _add_tensor(writer, gguf, name: str, tensor: np.ndarray, kind: str, mix) -> None:
    matrix = tensor.ndim == 2 and name != "position_embd.weight"
    if kind == "q4_k_m" and matrix:
        kind = mixed(name, *mix)
        kind = K_FALLBACK[kind] if tensor.shape[1] % q4k.SUPER else kind
    elif not name.startswith("blk."):
        kind = q4k.WIDER.get(kind, kind)
    kind = q4k.rows_of(kind, tensor.shape[1]) if matrix else kind
    rows = torch.from_numpy(tensor)
    if kind in ("q4_k", "q6_k") and matrix:
        ours = q4k if kind == "q4_k" else q6k
        quantized = ours.to_gguf(*ours.quantize(rows))
        writer.add_tensor(name, quantized, raw_dtype=gguf.GGMLQuantizationType[kind.upper()])
    elif kind in ("q8_0", "q4_0", "q5_0") and matrix and tensor.shape[1] % 32 == 0:
        quantization = gguf.GGMLQuantizationType[kind.upper()]
        writer.add_tensor(name, gguf.quants.quantize(tensor, quantization), raw_dtype=quantization)
    elif kind != "f32" and matrix:
        writer.add_tensor(name, tensor.astype(np.float16))
    else:
        writer.add_tensor(name, tensor)


def read_gguf(path: str | Path) -> tuple[TransformerLM, Tokenizer]:
    """A GGUF file of llama.cpp's gpt2 or gptneox architecture -> (TransformerLM in eval
    mode, float32, quantized matrices expanded; its tokenizer). A file written by tlm comes
    back as the model that wrote it; another computes GELU as llama.cpp does (tanh)."""
    config = gguf_config(path)
    model = TransformerLM(config, init=False)
    model.load_state_dict(gguf_weights(path, config), assign=True)
    return model.eval(), read_gguf_tokenizer(path)


def gguf_config(path: str | Path) -> ModelConfig:
    """The ModelConfig of a GGUF file; of its tensors only the head and E are read (a head
    equal to E is a tied one, which gptneox writes out)."""
    gguf, reader, fields = open_gguf(path)
    ends = {t.name: t for t in reader.tensors if t.name in ("output.weight", "token_embd.weight")}
    head, embedding = (ends.get(name) for name in ("output.weight", "token_embd.weight"))
    tied = head is None or (
        embedding is not None and torch.equal(_expand(gguf, head), _expand(gguf, embedding))
    )
    return _config(fields, tied, path)


def gguf_weights(path: str | Path, config: ModelConfig) -> dict[str, torch.Tensor]:
    """A GGUF file's tensors as the state dict of `config`'s model (float32, expanded)."""
    gguf, reader, _ = open_gguf(path)
    return _state({t.name: _expand(gguf, t) for t in reader.tensors}, config, path)


def _config(fields: dict[str, Any], tied: bool, path: str | Path) -> ModelConfig:
    arch = fields.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise GGUFError(f"{path}: architecture {arch!r}: tlm reads {' and '.join(ARCHITECTURES)}")

    def need(key: str) -> Any:
        if f"{arch}.{key}" not in fields:
            raise GGUFError(f"{path} has no {arch}.{key}")
        return fields[f"{arch}.{key}"]

    d, heads = need("embedding_length"), need("attention.head_count")
    if arch == "gptneox":
        if fields.get("gptneox.use_parallel_residual", True):
            raise GGUFError(
                f"{path}: gptneox.use_parallel_residual is true (attention and MLP side by "
                "side): tlm's block is sequential (eq. 9.26-9.31)"
            )
        if need("rope.dimension_count") != d // heads:
            raise GGUFError(
                f"{path}: gptneox.rope.dimension_count={need('rope.dimension_count')} rotates "
                f"part of a head of {d // heads}: tlm rotates all of it"
            )
    try:
        return ModelConfig(
            vocab_size=len(fields["tokenizer.ggml.tokens"]),
            d_model=d,
            n_layers=need("block_count"),
            n_heads=heads,
            d_ff=need("feed_forward_length"),
            context_length=need("context_length"),
            norm="pre",
            position="learned" if arch == "gpt2" else "rope",
            activation=fields.get("tlm.activation", "gelu_tanh"),
            tie_embeddings=tied,  # gptneox writes a tied head out: the same values
            bias=True,
            dropout=0.0,
            layer_norm_eps=float(need("attention.layer_norm_epsilon")),
            rope_base=float(fields.get(f"{arch}.rope.freq_base", 10000.0)),
            **_scaling(fields, arch, path),
        )
    except (ConfigError, KeyError) as exc:
        raise GGUFError(f"{path}: {exc}") from None


def _scaling(fields: dict[str, Any], arch: str, path: str | Path) -> dict[str, Any]:
    """ModelConfig's scaling fields of `{arch}.rope.scaling.*` (none, linear or yarn)."""
    kind = fields.get(f"{arch}.rope.scaling.type", "none")
    if kind == "none":
        return {}
    if kind not in ("linear", "yarn"):
        raise GGUFError(f"{path}: {arch}.rope.scaling.type={kind!r}: tlm reads linear and yarn")
    values = {
        "rope_scaling": kind,
        "rope_factor": float(fields[f"{arch}.rope.scaling.factor"]),
        "rope_original_context": int(fields[f"{arch}.rope.scaling.original_context_length"]),
    }
    for key in ("beta_fast", "beta_slow"):
        if f"{arch}.rope.scaling.yarn_{key}" in fields:
            values[f"yarn_{key}"] = float(fields[f"{arch}.rope.scaling.yarn_{key}"])
    return values


def _expand(gguf, tensor) -> torch.Tensor:
    """A GGUF tensor as float32, in its [out, in] (numpy) shape."""
    shape = [int(n) for n in reversed(tensor.shape)]
    values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    return torch.from_numpy(np.array(values, dtype=np.float32)).reshape(
        shape
    )  # a copy: the file is read-only


def _state(tensors: dict[str, torch.Tensor], config: ModelConfig, path) -> dict[str, torch.Tensor]:
    """GGUF's tensors -> a tlm state dict; every tensor used once, each one there."""
    d = config.d_model
    taken: set[str] = set()

    def take(name: str) -> torch.Tensor:
        if name not in tensors:
            raise GGUFError(f"{path} has no tensor {name} ({config.n_layers} layers)")
        taken.add(name)
        return tensors[name]

    state = {"embedding.E": take("token_embd.weight")}
    if config.position == "learned":
        state["embedding.P"] = take("position_embd.weight")
    for layer in range(config.n_layers):
        for gguf_name, name in BLOCK:
            tensor = take(f"blk.{layer}.{gguf_name}")
            tensor = tensor.t() if tensor.dim() == 2 else tensor
            if name.endswith("QKV"):
                for part, piece in zip("QKV", tensor.split(d, dim=-1), strict=True):
                    state[f"blocks.{layer}.{name.replace('QKV', part)}"] = piece.contiguous()
            else:
                state[f"blocks.{layer}.{name}"] = tensor.contiguous()
    state["ln_f.gamma"], state["ln_f.beta"] = take("output_norm.weight"), take("output_norm.bias")
    head = tensors.get("output.weight")
    if not config.tie_embeddings:
        state["W_U"] = take("output.weight").t().contiguous()
    elif head is not None:
        taken.add("output.weight")
    unexpected = sorted(set(tensors) - taken)
    if unexpected:
        raise GGUFError(f"{path}: unexpected tensors {', '.join(unexpected[:3])}")
    return state
