"""Packing a model for inference: each product replaced by its packed form (`packed.py`).

`pack_for_inference` packs a model already loaded in fp32 (`for_inference`), releasing
each fp32 matrix as its packed form exists; its peak is the fp32 model's. `load_packed`
packs while the weights are read (`tlm.load_model(path, dtype=...)`): each product of a
block is packed as soon as its weights are in, so no more than one product is held in
fp32 (and the next matrix, read to see the part end). It leaves the token embeddings in
the file (`tensor_files.FileRows`: a lookup reads its rows, in fp32 as stored) and reads a
tied head a chunk of rows at a time into one int8 or bf16 product, or, in float16, whose
kernel packs only whole fp32 matrices, into blocks of 4,096 rows (`HeadBlocks`), packed
last. After each part the freed memory goes back to the system (`free_to_system`).
"""

from __future__ import annotations

import ctypes
from collections.abc import Iterable
from itertools import groupby

import torch
from torch import Tensor, nn

from tlm.model.packed import HeadBlocks, PackedLinear, PackedRows
from tlm.tensor_files import FileRows, LazyMatrix

try:
    _libc = ctypes.CDLL("libc.so.6")
    _libc.malloc_trim.argtypes = [ctypes.c_size_t]
except (OSError, AttributeError):  # not glibc
    _libc = None

HEAD_ROWS = 4096  # vocabulary rows of a float16 head block packed while loading (12 MB fp32)


def pack_for_inference(model: nn.Module, fmt: str) -> None:
    """Replace every product of `model` (a TransformerLM) by its packed form in `fmt`.

    Each module's product methods (`project_qkv` and `project_out` of attention, `up` and
    `down` of the FFN, the model's `unembed`) are replaced on that instance by the same map
    in `fmt`; Q, K and V become one product. Except in float32, the token lookup is packed
    too, and each fp32 matrix is released as soon as its packed form exists. The caller
    refuses further training. A loader that packs each part as it reads it
    (`tlm.load_model(path, dtype=...)`) never holds the whole fp32 model.
    """
    products = ["attn.project_qkv", "attn.project_out", "ffn.up", "ffn.down"]
    blocks = [f"blocks.{i}.{product}" for i in range(len(model.blocks)) for product in products]
    for part in [*blocks, "W_U", "embedding"]:  # the largest last, when the rest is freed
        pack_part(model, part, fmt)
        free_to_system()  # the fp32 matrices just released


def load_packed(model: nn.Module, weights: Iterable[tuple[str, Tensor]], fmt: str) -> None:
    """Fill `model` (a TransformerLM built with init=False) from (name, tensor) pairs given
    in the model's order, and pack each part as soon as its last weight is in: only one
    part's fp32 weights are ever held, so the peak follows the format. E may come as a
    `LazyMatrix` left in its file (`_pack_embedding_from_file`); float16 packs it last,
    when the other parts' fp32 weights are gone, since its head needs fp32 blocks."""
    left, deferred, seen = set(model.state_dict()), None, set()
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
        unexpected = model.load_state_dict(state, strict=False, assign=True).unexpected_keys
        if unexpected:
            raise ValueError(f"no place in the model for {', '.join(unexpected[:3])}")
        if lazy is None:
            pack_part(model, part, fmt)
        elif fmt == "float16":
            deferred = lazy
        else:
            _pack_embedding_from_file(model, lazy, fmt)
        del state
        free_to_system()
    if deferred is not None:
        _pack_embedding_from_file(model, deferred, fmt)
    if left:
        raise ValueError(f"no weights for {', '.join(sorted(left)[:3])}")


def _pack_embedding_from_file(model: nn.Module, E: LazyMatrix, fmt: str) -> None:
    """The token lookup from the file (each lookup reads its rows, as stored) and a tied
    head read a block of rows at a time: E is never whole in memory."""
    _release(model.embedding.E)
    model.embedding.tokens = FileRows(E)
    if model.W_U is None and fmt != "float16":  # the tied head is E^T: [V, d] is [out, in]
        model.unembed = PackedLinear(E, None, fmt)  # one product, E read a chunk at a time
    elif model.W_U is None:  # fbgemm packs fp16 only from whole fp32 matrices: in blocks
        blocks = []
        for lo in range(0, len(E), HEAD_ROWS):
            blocks.append(PackedLinear(E.rows(lo, lo + HEAD_ROWS), None, fmt))
            free_to_system()  # the fp32 rows just packed
        model.unembed = HeadBlocks(blocks)


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


def pack_part(model: nn.Module, part: str, fmt: str) -> None:
    """Pack the products of one part whose weights are in place (`embedding`: the token
    lookup and a tied head; `blocks.{l}.attn.project_qkv` and the block's other products;
    `W_U`: an untied head; other parts have none)."""
    release = fmt != "float32"
    module, _, product = part.rpartition(".")
    if part.startswith("blocks.") and product in PRODUCTS.values():
        owner = model.get_submodule(module)
        if product == "project_qkv":
            maps = [(owner.W_Q, owner.b_Q), (owner.W_K, owner.b_K), (owner.W_V, owner.b_V)]
        else:
            W = {"project_out": "O", "up": "1", "down": "2"}[product]
            maps = [(getattr(owner, f"W_{W}"), getattr(owner, f"b_{W}"))]
        setattr(owner, product, _packed(maps, fmt, release))
    elif part == "embedding":
        E = model.embedding.E
        if model.W_U is None:  # the tied head is E^T
            model.unembed = PackedLinear.side_by_side([(E.t(), None)], fmt)
        if release:
            model.embedding.tokens = PackedRows(E, fmt)
            _release(E)
    elif part == "W_U" and model.W_U is not None:
        model.unembed = _packed([(model.W_U, None)], fmt, release)


def _packed(maps: list[tuple[Tensor, Tensor | None]], fmt: str, release: bool):
    packed = PackedLinear.side_by_side(maps, fmt)
    if release:
        for W, _ in maps:
            _release(W)
    return packed


def free_to_system() -> None:
    """Hand the memory freed so far back to the system (glibc's malloc_trim). Released
    weights leave holes in the heap that glibc would keep for later use, and that a
    resident-memory figure keeps counting; elsewhere this does nothing."""
    if _libc is not None:
        _libc.malloc_trim(0)


def _release(param: Tensor | None) -> None:
    """Free an fp32 matrix whose packed copy now does its work: it is left empty, so that
    code reading it fails instead of reading stale or made-up numbers."""
    if param is not None:
        param.data = torch.empty(0, dtype=param.dtype)
