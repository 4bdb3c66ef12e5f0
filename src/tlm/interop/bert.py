"""Hugging Face BERT checkpoints <-> tlm's encoder: the config fields and the weight names.

BERT (Devlin et al. 2019) is the post-norm encoder of `model/encoder.py`: learned positions,
segment embeddings, a LayerNorm on the input, exact GELU, biases everywhere and an MLM head
tied to the embeddings. Its layers are `nn.Linear`s, which store weights as [out, in]: each
matrix is transposed on the way (tlm right-multiplies, as the book does).

    BERT name (prefix `bert.`)                          tlm name                 shape (tlm)
    embeddings.word_embeddings.weight                   embedding.E              [V, d]
    embeddings.position_embeddings.weight               embedding.P              [N, d]
    embeddings.token_type_embeddings.weight             S                        [2, d]
    embeddings.LayerNorm.weight / .bias                 ln_embed.gamma / .beta   [d]
    encoder.layer.{l}.attention.self.query / key / value   blocks.{l}.attn.W_Q / K / V (b_)
    encoder.layer.{l}.attention.output.dense            blocks.{l}.attn.W_O, b_O [d, d]
    encoder.layer.{l}.attention.output.LayerNorm        blocks.{l}.ln1           [d]
    encoder.layer.{l}.intermediate.dense                blocks.{l}.ffn.W_1, b_1  [d, d_ff]
    encoder.layer.{l}.output.dense                      blocks.{l}.ffn.W_2, b_2  [d_ff, d]
    encoder.layer.{l}.output.LayerNorm                  blocks.{l}.ln2           [d]
    cls.predictions.transform.dense (no `bert.`)        W_T, b_T                 [d, d]
    cls.predictions.transform.LayerNorm                 ln_T                     [d]
    cls.predictions.bias                                b_U                      [V]
    cls.predictions.decoder.weight (untied only)        W_U transposed           [V, d]

An encoder pretrained with next-sentence prediction (`nsp`) is BertForPreTraining: the MLM
head, the pooler `bert.pooler.dense` (W_P, b_P) and `cls.seq_relationship` (W_N, b_N; output 0
IsNext, 1 NotNext in both). A BertForMaskedLM checkpoint that
still holds a pooler and an NSP head (as Google's released ones do) reads as the MLM model.

A fine-tuned encoder is BertForSequenceClassification (the pooler `bert.pooler.dense` is
W_P, b_P; `classifier` is W_C, b_C) or BertForTokenClassification (`classifier` alone), its
labels config.json's `id2label`; neither has the MLM head.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import Tensor

from tlm.config import ConfigError, ModelConfig
from tlm.interop.gpt2 import ACTIVATIONS_IN, HFFormatError
from tlm.interop.gptneox import shape_fields
from tlm.model.positions import sinusoidal_table

ARCHITECTURES = {
    None: "BertForMaskedLM",
    "classify": "BertForSequenceClassification",
    "tag": "BertForTokenClassification",
    "nsp": "BertForPreTraining",  # the MLM head and the NSP head
}
# one block's tensors: BERT name after `encoder.layer.{l}.`, tlm name after `blocks.{l}.`
BLOCK_NAMES = [
    ("attention.self.query", "attn.W_Q", "attn.b_Q"),
    ("attention.self.key", "attn.W_K", "attn.b_K"),
    ("attention.self.value", "attn.W_V", "attn.b_V"),
    ("attention.output.dense", "attn.W_O", "attn.b_O"),
    ("attention.output.LayerNorm", "ln1.gamma", "ln1.beta"),
    ("intermediate.dense", "ffn.W_1", "ffn.b_1"),
    ("output.dense", "ffn.W_2", "ffn.b_2"),
    ("output.LayerNorm", "ln2.gamma", "ln2.beta"),
]


def bert_config(config: ModelConfig, eot_id: int | None) -> dict[str, Any]:
    """ModelConfig -> BertConfig fields; refuses (naming the field) what BERT cannot express."""
    refusals = [
        (config.model_type != "encoder", "BERT is an encoder (tlm train --objective mlm)"),
        (config.norm != "post", f"norm={config.norm!r}: BERT's blocks are post-norm (--norm post)"),
        (config.position not in ("learned", "sinusoidal"),
         f"position={config.position!r}: BERT adds absolute positions (--position learned)"),
        (config.d_attn != config.d_model,
         f"d_head={config.d_head}: BERT needs d_head = d_model / n_heads (leave --d-head unset)"),
        (config.qk_norm, "qk_norm: BERT's attention has no query/key norm"),
    ]  # fmt: skip
    for refused, message in refusals:
        if refused:
            raise HFFormatError(f"cannot export to BERT: {message}")
    labels = {}
    if config.task is not None:
        id2label = dict(enumerate(config.labels))
        labels = {"id2label": id2label, "label2id": {v: k for k, v in id2label.items()}}
    return {
        "architectures": [ARCHITECTURES["nsp" if config.nsp else config.task]],
        "model_type": "bert",
        **shape_fields(config),
        "hidden_dropout_prob": config.resid_dropout_p,
        "attention_probs_dropout_prob": config.attn_dropout_p,
        "max_position_embeddings": config.context_length,
        "type_vocab_size": 2,
        "layer_norm_eps": config.layer_norm_eps,
        "initializer_range": 0.02,
        "position_embedding_type": "absolute",
        "tie_word_embeddings": config.tie_embeddings,
        "dtype": "float32",
        **labels,
    }


def config_from_bert(hf: dict[str, Any]) -> ModelConfig:
    """BertConfig fields -> ModelConfig (refusing, naming the field, what tlm does not compute)."""
    if hf.get("model_type") != "bert":
        raise HFFormatError(f"model_type {hf.get('model_type')!r}: not a BERT checkpoint")
    if hf.get("position_embedding_type", "absolute") != "absolute":
        raise HFFormatError(f"position_embedding_type {hf['position_embedding_type']!r}: tlm "
                            "reads BERT's absolute positions")  # fmt: skip
    if hf.get("type_vocab_size", 2) != 2:
        raise HFFormatError(
            f"type_vocab_size {hf['type_vocab_size']}: tlm's encoder has 2 segments"
        )
    task = {v: k for k, v in ARCHITECTURES.items()}.get((hf.get("architectures") or [None])[0])
    nsp, labels = task == "nsp", None
    if task == "nsp":
        task = None
    elif task is not None:
        id2label = hf.get("id2label") or {}
        labels = tuple(id2label[k] for k in sorted(id2label, key=int))
    activation = ACTIVATIONS_IN.get(hf.get("hidden_act", "gelu"))
    if activation is None:
        raise HFFormatError(
            f"hidden_act {hf.get('hidden_act')!r}: tlm computes {sorted(ACTIVATIONS_IN)}"
        )
    try:
        return ModelConfig(
            vocab_size=hf["vocab_size"],
            d_model=hf["hidden_size"],
            n_layers=hf["num_hidden_layers"],
            n_heads=hf["num_attention_heads"],
            d_ff=hf["intermediate_size"],
            context_length=hf["max_position_embeddings"],
            norm="post",
            position="learned",
            activation=activation,
            tie_embeddings=hf.get("tie_word_embeddings", True),
            layer_norm_eps=hf.get("layer_norm_eps", 1e-12),
            model_type="encoder",
            task=task,
            labels=labels,
            nsp=nsp,
        )
    except (KeyError, ConfigError) as exc:
        raise HFFormatError(f"BERT config: {exc}") from None


def _pairs(config: ModelConfig) -> list[tuple[str, str, bool]]:
    """(BERT name, tlm name, transposed?) of every tensor, in the model's order."""
    e = "bert.embeddings."
    pairs = [(f"{e}word_embeddings.weight", "embedding.E", False)]
    pairs.append((f"{e}position_embeddings.weight", "embedding.P", False))
    pairs += [(f"{e}token_type_embeddings.weight", "S", False)]
    pairs += [
        (f"{e}LayerNorm.weight", "ln_embed.gamma", False),
        (f"{e}LayerNorm.bias", "ln_embed.beta", False),
    ]
    for layer in range(config.n_layers):
        hf, ours = f"bert.encoder.layer.{layer}.", f"blocks.{layer}."
        for part, weight, bias in BLOCK_NAMES:
            matrix = weight.split(".")[-1].startswith("W_")  # a Linear's [out, in]; not a gamma
            pairs.append((f"{hf}{part}.weight", ours + weight, matrix))
            pairs.append((f"{hf}{part}.bias", ours + bias, False))
    if config.task == "classify" or config.nsp:  # BERT's pooler, then its head
        pairs.append(("bert.pooler.dense.weight", "W_P", True))
        pairs.append(("bert.pooler.dense.bias", "b_P", False))
    if config.nsp:
        pairs.append(("cls.seq_relationship.weight", "W_N", True))
        pairs.append(("cls.seq_relationship.bias", "b_N", False))
    if config.task is not None:
        return [*pairs, ("classifier.weight", "W_C", True), ("classifier.bias", "b_C", False)]
    t = "cls.predictions.transform."
    pairs += [(f"{t}dense.weight", "W_T", True), (f"{t}dense.bias", "b_T", False)]
    pairs += [
        (f"{t}LayerNorm.weight", "ln_T.gamma", False),
        (f"{t}LayerNorm.bias", "ln_T.beta", False),
    ]
    pairs.append(("cls.predictions.bias", "b_U", False))
    if not config.tie_embeddings:
        pairs.append(("cls.predictions.decoder.weight", "W_U", True))
    return pairs


def bert_weights(
    tensors: Mapping[str, Tensor], config: ModelConfig, lazy_embedding: bool = False
) -> Iterator[tuple[str, Tensor]]:
    """BERT tensors -> (tlm name, float32 tensor), every weight used exactly once (a pooler
    but a classifier's or NSP's, an NSP head but a BertForPreTraining's, and the tied
    decoder are not weights of tlm's model)."""
    skip = ("cls.predictions.decoder.bias", "bert.embeddings.position_ids")  # b_U again; a buffer
    pooled = config.task == "classify" or config.nsp
    unused = ("bert.pooler.",) * (not pooled) + ("cls.seq_relationship.",) * (not config.nsp)
    names = {k for k in tensors if k not in skip and not k.startswith(unused)}
    if config.tie_embeddings:
        names.discard("cls.predictions.decoder.weight")  # the tied head is E itself
    pairs = _pairs(config)
    missing = next((hf for hf, _, _ in pairs if hf not in names), None)
    if missing is not None:
        raise HFFormatError(f"the checkpoint has no {missing} ({config.n_layers} layers)")
    unexpected = sorted(names - {hf for hf, _, _ in pairs})
    if unexpected:
        raise HFFormatError(f"unexpected tensors in the checkpoint: {', '.join(unexpected[:3])}")
    for hf, name, transposed in pairs:
        tensor = tensors[hf].float()
        yield name, tensor.t().contiguous() if transposed else tensor


def state_to_bert(state: dict[str, Tensor], config: ModelConfig) -> dict[str, Tensor]:
    """A tlm encoder's state dict -> BertForMaskedLM tensors; missing biases and betas
    become zeros and a sinusoidal table becomes the position embeddings, so transformers
    computes the same function."""
    state = dict(state)
    if config.position == "sinusoidal":
        state["embedding.P"] = sinusoidal_table(config.context_length, config.d_model)
    out: dict[str, Tensor] = {}
    for hf, name, transposed in _pairs(config):
        if name not in state:  # bias=False: BERT adds zeros
            size = out[hf.removesuffix(".bias") + ".weight"].shape[0]  # [out, ...] or [d]
            state[name] = torch.zeros(size)
        tensor = state[name].detach().float()
        out[hf] = (tensor.t() if transposed else tensor).contiguous()
    return out
