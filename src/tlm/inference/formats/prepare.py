"""Building a model for inference from a trained one, or while its weights are read.

`for_inference(model, fmt)` builds an `InferenceLM` (`modules.py`) from a loaded model and
sets every product's kernel (`kernels.py`): Q, K and V become one product. Except in
float32, the token lookup is packed too, and each fp32 matrix is released as soon as its
packed form exists: the model given is used up, and the peak is the fp32 model's.
`for_decoding(model)` is what `tlm.generate` steps: a plain fp32 model on a CPU gets an
`InferenceLM` on its own parameters (nothing copied, nothing released), so a decoding step
of one row reads them through numpy's BLAS.

`load_prepared` packs while the weights are read (`tlm.load_model(path, dtype=...)`): each
product of a block is packed as soon as its weights are in, so no more than one product is
held in fp32 (and the next matrix, read to see the part end). It leaves the token
embeddings in the file (`tensor_files.FileRows`: a lookup reads its rows, in fp32 as
stored) and reads a tied head a chunk of rows at a time into one int8 or bf16 product, or,
in float16, whose kernel packs only whole fp32 matrices, into blocks of 4,096 rows
(`HeadBlocks`), packed last. After each part the freed memory goes back to the system
(`free_to_system`).
"""

from __future__ import annotations

from collections.abc import Iterable
from itertools import groupby

import torch
from torch import Tensor, nn

from tlm.device import placement
from tlm.inference.devices.heap import free_to_system
from tlm.inference.formats import blocked
from tlm.inference.formats.kernels import (
    HeadBlocks,
    PackedLinear,
    PackedRows,
    Route,
    can_prepack_float32,
    check_format,
    wider,
)
from tlm.inference.formats.modules import SWAP, InferenceLM, Kernel, swapped
from tlm.model.transformer import TransformerLM
from tlm.tensor_files import FileRows, LazyMatrix

HEAD_ROWS = 4096  # vocabulary rows of a float16 head block packed while loading (12 MB fp32)


def for_inference(model: TransformerLM, fmt: str = "float32") -> TransformerLM:
    """The model prepared for fast generation and scoring; no training after.

    On a CPU every weight matrix is prepared for a faster kernel: "float32" adds a oneDNN
    layout, made at the first product of 2 to 32 rows (one row already reads the weights at
    the memory bandwidth, `blas.py`); "float16" and "int8" are compressed for fbgemm and
    "bfloat16" halved, and these release the fp32 matrices of `model`, so memory follows
    the format (`model` is used up). The activations stay fp32. On a GPU "bfloat16" and
    "float16" cast the model and "float32" changes nothing. `tlm.load_model(path,
    dtype=...)` does the same while reading, with a lower peak.
    """
    device = placement(model)[0]
    check_format(fmt, device)
    model.eval()
    if device.type != "cpu" and fmt in ("bfloat16", "float16"):
        return model.to(getattr(torch, fmt))
    if fmt == "float32" and not can_prepack_float32(device):
        return model
    return _built(model, fmt, layout=True)


def for_decoding(model: nn.Module) -> nn.Module:
    """What a decoding loop steps: a model built for inference as it is; a plain fp32
    language model on a CPU as an `InferenceLM` on its own parameters (numpy's BLAS for one
    row; its training goes on unaffected); any other model as it is."""
    weight = next(model.parameters())
    cpu32 = weight.device.type == "cpu" and weight.dtype == torch.float32
    if type(model) is TransformerLM and cpu32:
        return _built(model, "float32", layout=False)
    return model


def _built(model: TransformerLM, fmt: str, layout: bool) -> InferenceLM:
    """An `InferenceLM` of the model with every product packed in `fmt`, the largest last,
    when the rest is freed."""
    fast = swapped(model, SWAP)
    fast.inference_format, fast.route = fmt, Route()
    products = ["attn.project_qkv", "attn.project_out", "ffn.up", "ffn.down"]
    blocks = [f"blocks.{i}.{product}" for i in range(len(fast.blocks)) for product in products]
    for part in [*blocks, "W_U", "embedding"]:
        pack_part(fast, part, fmt, layout)
        free_to_system()  # the fp32 matrices just released
    return fast


def load_prepared(
    model: TransformerLM, weights: Iterable[tuple[str, Tensor]], fmt: str
) -> InferenceLM:
    """The `InferenceLM` of `model` (built with init=False) filled from (name, tensor) pairs
    given in the model's order, each part packed as soon as its last weight is in: only one
    part's fp32 weights are ever held, so the peak follows the format. E may come as a
    `LazyMatrix` left in its file (`_pack_embedding_from_file`); float16 packs it last,
    when the other parts' fp32 weights are gone, since its head needs fp32 blocks."""
    fast = swapped(model.eval(), SWAP)
    fast.inference_format, fast.route = fmt, Route()
    left, deferred, seen = set(fast.state_dict()), None, set()
    for part, pairs in groupby(weights, key=lambda pair: part_of(pair[0])):
        if part in seen:  # it was packed without these: the order must keep parts together
            raise ValueError(f"the weights of {part} come apart; order them with in_parts")
        seen.add(part)
        state, lazy = dict(pairs), None
        left -= state.keys()
        if isinstance(state.get("embedding.E"), LazyMatrix):
            lazy = state.pop("embedding.E")
            if fmt == "float32":  # kept whole: it is the parameter the products read
                state["embedding.E"], lazy = lazy.rows(0, len(lazy)), None
        unexpected = fast.load_state_dict(state, strict=False, assign=True).unexpected_keys
        if unexpected:
            raise ValueError(f"no place in the model for {', '.join(unexpected[:3])}")
        if lazy is None:
            pack_part(fast, part, fmt)
        elif fmt == "float16":
            deferred = lazy
        else:
            _pack_embedding_from_file(fast, lazy, fmt)
        del state
        free_to_system()
    if deferred is not None:
        _pack_embedding_from_file(fast, deferred, fmt)
    if left:
        raise ValueError(f"no weights for {', '.join(sorted(left)[:3])}")
    return fast


def _pack_embedding_from_file(model: InferenceLM, E: LazyMatrix, fmt: str) -> None:
    """The token lookup from the file (each lookup reads its rows, as stored; in q8_0, rows
    of Q8_0 blocks made a chunk at a time, so that a lookup gives the values llama.cpp's
    does) and a tied head read a block of rows at a time: E is never whole in memory."""
    _release(model.embedding.E)
    fmt = wider(fmt)  # the lookup's and the head's format
    model.embedding.lookup = PackedRows(E, fmt) if fmt == "q8_0" else FileRows(E)
    if model.W_U is None and (fmt != "float16" or blocked.here(fmt)):  # E^T: [V,d] is [out,in]
        model.head = PackedLinear(E, None, fmt)  # one product, E read a chunk at a time
    elif model.W_U is None:  # fbgemm packs fp16 only from whole fp32 matrices: in blocks
        blocks = []
        for lo in range(0, len(E), HEAD_ROWS):
            blocks.append(PackedLinear(E.rows(lo, lo + HEAD_ROWS), None, fmt))
            free_to_system()  # the fp32 rows just packed
        model.head = HeadBlocks(blocks)


# the product each block parameter belongs to: a loader packs one product at a time
PRODUCTS = {
    **dict.fromkeys(["W_Q", "W_K", "W_V", "b_Q", "b_K", "b_V"], "project_qkv"),
    **dict.fromkeys(["W_O", "b_O"], "project_out"),
    **dict.fromkeys(["W_1", "b_1"], "up"),
    **dict.fromkeys(["W_2", "b_2"], "down"),
}


def in_parts(names: Iterable[str]) -> list[str]:
    """`names` with each part's together, parts in the order they first appear."""
    names = list(names)
    first = {}
    for name in names:
        first.setdefault(part_of(name), len(first))
    return sorted(names, key=lambda name: first[part_of(name)])


def part_of(name: str) -> str:
    """The part of the model a parameter belongs to, the unit a loader packs at once: one
    product of a block (`blocks.3.attn.W_Q` -> `blocks.3.attn.project_qkv`), or a module
    (`blocks.3.ln1.gamma` -> `blocks.3.ln1`, `embedding.E` -> `embedding`, `W_U`)."""
    parts = name.split(".")
    if parts[0] != "blocks":
        return parts[0]
    product = PRODUCTS.get(parts[-1]) if parts[2] in ("attn", "ffn") else None
    return ".".join(parts[:3] + ([product] if product else []))


def pack_part(model: InferenceLM, part: str, fmt: str, layout: bool = True) -> None:
    """Set the kernels of one part whose weights are in place (`embedding`: the token
    lookup and a tied head; `blocks.{l}.attn.project_qkv` and the block's other products;
    `W_U`: an untied head; other parts have none). Except in float32, the fp32 matrices
    are released."""
    release = fmt != "float32"

    def packed(maps: list[tuple[Tensor, Tensor | None]], kind: str = fmt) -> Kernel:
        kernel = PackedLinear.side_by_side(maps, kind, model.route, layout)
        if release:
            for W, _ in maps:
                _release(W)
        return kernel

    module, _, product = part.rpartition(".")
    if part.startswith("blocks.") and product in PRODUCTS.values():
        owner = model.get_submodule(module)
        if product == "project_qkv":
            maps = [(owner.W_Q, owner.b_Q), (owner.W_K, owner.b_K), (owner.W_V, owner.b_V)]
            owner.qkv_kernel = packed(maps)
        elif product == "project_out":
            owner.out_kernel = packed([(owner.W_O, owner.b_O)])
        elif product == "up":
            owner.up_kernel = packed([(owner.W_1, owner.b_1)])
        else:
            owner.down_kernel = packed([(owner.W_2, owner.b_2)])
    elif part == "embedding":  # the lookup and the head in `wider(fmt)`
        E, fmt = model.embedding.E, wider(fmt)
        if model.W_U is None:  # the tied head is E^T
            model.head = PackedLinear.side_by_side([(E.t(), None)], fmt, model.route, layout)
        if release:
            model.embedding.lookup = PackedRows(E, fmt)
            _release(E)
    elif part == "W_U" and model.W_U is not None:
        model.head = packed([(model.W_U, None)], wider(fmt))


def _release(param: Tensor | None) -> None:
    """Free an fp32 matrix whose packed copy now does its work: it is left empty, so that
    code reading it fails instead of reading stale or made-up numbers."""
    if param is not None:
        param.data = torch.empty(0, dtype=param.dtype)
