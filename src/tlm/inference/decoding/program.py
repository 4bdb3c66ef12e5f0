"""The whole decoding step as one C call: the model described once as C structures.

Where every product of a model has a kernel in `products.c` (int8 and float16 blocks where
`blocked.here`; fp32 on the parameters themselves where the library has OpenMP, or, for a
prepared model's steps of more than FLOAT32_ROWS rows, on fp32 blocks), `step.c`'s
decode_step runs the whole step, products included, in one call: no Python between the
products at all. `program(model, layers, rows)` describes the model for it (a `Block` per
layer: its products, norms, rope and qk-norm; the head; the first norm), or says None where
some product has no such kernel (bfloat16, fbgemm's kernels, fp32 without OpenMP), and
`step.py` then runs its own loop.

A description holds addresses. It is made once per model (and fp32 row kind): for a model
whose weights were
packed (`for_inference`), the buffers it points to belong to the kernels and never change;
for an fp32 model on its own parameters, whose parameters may be replaced by assignment,
the addresses are checked at each step and the description made anew when one moved.
"""

from __future__ import annotations

import ctypes

import torch
from torch import Tensor

from tlm.inference import native
from tlm.inference.formats import blocked, q4, q8
from tlm.inference.formats.kernels import Float32Linear, PackedLinear, PackedRows
from tlm.tensor_files import FileRows

i64, f32, ptr = ctypes.c_int64, ctypes.c_float, ctypes.c_void_p


class Product(ctypes.Structure):
    _fields_ = [
        ("kind", i64),
        ("w", ptr),
        ("scale", ptr),
        ("wsum", ptr),
        ("bias", ptr),
        ("inputs", i64),
        ("in_pad", i64),
        ("out", i64),
        ("ld", i64),
        ("offset", i64),
    ]


class Norm(ctypes.Structure):
    _fields_ = [("gamma", ptr), ("beta", ptr), ("eps", f32)]


class Rope(ctypes.Structure):
    """step.c's Rope: a rotary model's cos and sin tables [n, d_head/2], and θ (float64
    [d_head/2]) and the factor for positions past them (`step.layers` makes it)."""

    _fields_ = [("cos", ptr), ("sin", ptr), ("n", i64), ("theta", ptr), ("factor", ctypes.c_double)]


class Block(ctypes.Structure):
    _fields_ = [
        ("qkv", Product * 3),
        ("n_qkv", i64),
        ("out", Product),
        ("up", Product),
        ("down", Product),
        ("inside", Norm),
        ("after", Norm),
        ("rope", ptr),
        ("qk_eps", f32),
    ]


INT8, FLOAT16, ROWS, DOTS, FLOAT32, Q4_0, Q4_K, Q8_0 = range(8)  # Product.kind: step.c's `product`


class Rows(ctypes.Structure):
    """Where the token embeddings come from, as step.c's look_up reads them."""

    _fields_ = [
        ("kind", i64),
        ("table", ptr),
        ("scale", ptr),
        ("fd", i64),
        ("start", i64),
        ("n", i64),
        ("times", f32),
    ]


ROW_KINDS = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2, torch.int8: 3}
Q8_ROWS = 4  # int8 with a scale a block of 32 (`PackedRows` in q8_0)


class Program:
    """What decode_step reads: the blocks, the head, the first norm, the token embeddings
    (`rows`, or None where step.py looks them up), and the tensors and lookup whose
    addresses and file they hold (kept alive here)."""

    def __init__(
        self,
        blocks: list[Block],
        head: Product,
        first: Norm,
        rows: tuple[Rows | None, object],
        keep: list[Tensor],
        watch: bool,
    ) -> None:
        self.blocks = (Block * len(blocks))(*blocks)
        self.head, self.first, self.keep = head, first, keep
        self.rows, self.lookup = rows
        self.addresses = [t.data_ptr() for t in keep] if watch else None

    def current(self, embedding) -> bool:
        """Whether every address still holds (always, for packed weights: not watched),
        and the model's token lookup is the one described."""
        if getattr(embedding, "lookup", None) is not self.lookup:
            return False
        if self.addresses is None:
            return True
        return all(t.data_ptr() == a for t, a in zip(self.keep, self.addresses, strict=True))


FLOAT32_ROWS = 2  # most rows a prepared fp32 step reads the parameters in place for


def program(model, layers, rows: int, made: dict[str, Program | None]) -> Program | None:
    """The description of `model` for decode_step with `rows` rows, or None where a
    product has no C kernel for them. `layers` is step.py's `layers(model)`; `made` holds
    the descriptions made so far, one per route (a `Decoder`'s), each remade where the
    weights it describes moved.

    An fp32 model reads fp32 blocks for several rows where it may keep a copy of its
    weights (`for_inference(model, "float32")`: `kernels.Float32Linear`, made at the first
    such step), and its parameters in place otherwise: a model that may keep a copy, for up
    to FLOAT32_ROWS rows (those loops read each line of weights once for all rows but keep
    every row's partial sums in the cache, and an 8-row GPT-2 step took 38-40 ms that way
    against 25.5 through oneDNN's product and 23-24 through the blocks:
    docs/benchmarks-history.md); a plain model (no copy), for any rows, since torch's
    product of a few rows is slower still (GPT-2 124M shape, 8 rows: 182 tok/s against 97,
    and a step checking 3-8 tokens 1.3-2.0 times one token's against 3.5-4.4)."""
    route = "packed"
    if model.inference_format == "float32":
        copies = getattr(model.blocks[0].attn.qkv_kernel, "use_layout", False)
        if rows > 1 and copies and blocked.here("float32"):
            route = "blocks"
        elif rows <= FLOAT32_ROWS or not copies:
            route = "parameters"
        else:
            return None
    found = made.get(route, False)
    if found is False or (found is not None and not found.current(model.embedding)):
        try:
            found = _described(model, layers, route == "blocks")
        except _NoKernel:
            found = None
        made[route] = found
    return found


class _NoKernel(Exception):
    pass


def _described(model, layers, copies: bool) -> Program:
    keep: list[Tensor] = []

    def norm(gamma: Tensor, beta: Tensor | None, eps: float) -> Norm:
        keep.extend(t for t in (gamma, beta) if t is not None)
        return Norm(gamma.data_ptr(), native.address(beta), eps)

    def in_blocks(kind: int, kernel, scale: Tensor | None, wsum: Tensor | None) -> list[Product]:
        """A kernel of products.c's or q4.c's blocks: its tensors' addresses (kept alive)."""
        tensors = (kernel.blocks, scale, wsum, kernel.b)  # as Product's w, scale, wsum, bias
        keep.extend(t for t in tensors if t is not None)
        addresses = (native.address(t) for t in tensors)
        return [Product(kind, *addresses, kernel.inputs, kernel.in_pad, kernel.out)]

    def products(kernel) -> list[Product]:
        if isinstance(kernel, Float32Linear) and copies:  # fp32 blocks, a copy
            kernel = kernel.made_layout()
        elif isinstance(kernel, PackedLinear):
            kernel = kernel.kernel
        if isinstance(kernel, blocked.Int8Blocks | blocked.FloatBlocks):
            kind = FLOAT32 if kernel.blocks.dtype == torch.float32 else FLOAT16
            kind = INT8 if isinstance(kernel, blocked.Int8Blocks) else kind
            return in_blocks(kind, kernel, kernel.scale, kernel.wsum)
        if isinstance(kernel, q4.Q4Blocks) and kernel.native:
            return in_blocks(Q4_0, kernel, kernel.scales, None)
        if isinstance(kernel, q4.Q4KBlocks) and kernel.native:
            return in_blocks(Q4_K, kernel, kernel.dd, kernel.scm)
        if isinstance(kernel, q8.Q8Blocks) and kernel.native:
            return in_blocks(Q8_0, kernel, kernel.scales, None)
        if isinstance(kernel, Float32Linear) and native.threaded():
            parts, offset = [], 0
            for W, b in kernel.maps:
                W, b = W.detach(), None if b is None else b.detach()
                if W.dtype != torch.float32 or (b is not None and not b.is_contiguous()):
                    raise _NoKernel
                if W.stride(1) == 1:
                    kind, ld = ROWS, W.stride(0)
                elif W.stride(0) == 1:
                    kind, ld = DOTS, W.stride(1)
                else:
                    raise _NoKernel
                keep.extend(t for t in (W, b) if t is not None)
                w, bias, (inputs, out) = W.data_ptr(), native.address(b), W.shape
                parts.append(Product(kind, w, None, None, bias, inputs, inputs, out, ld, offset))
                offset += W.shape[1]
            return parts
        raise _NoKernel

    def one(kernel) -> Product:
        parts = products(kernel)
        if len(parts) != 1:
            raise _NoKernel
        return parts[0]

    first, described = layers
    blocks = []
    for attn, inside, ffn, after, (rope, qk_eps) in described:
        qkv = products(attn.qkv_kernel)
        if len(qkv) > 3:
            raise _NoKernel
        block = Block(n_qkv=len(qkv), out=one(attn.out_kernel), up=one(ffn.up_kernel))
        block.down, block.inside, block.after = one(ffn.down_kernel), norm(*inside), norm(*after)
        for i, part in enumerate(qkv):
            block.qkv[i] = part
        block.rope, block.qk_eps = None if rope is None else ctypes.addressof(rope), qk_eps
        blocks.append(block)
    rows = _rows(model.embedding, keep)
    watch = model.inference_format == "float32"  # the parameters of a model that may train
    return Program(blocks, one(model.head), norm(*first), rows, keep, watch)


def _rows(embedding, keep: list[Tensor]) -> tuple[Rows | None, object]:
    """The token embeddings for look_up, and the lookup they belong to: E's own rows
    (lookup None), a `PackedRows`, or a `FileRows` (its file stays open while the lookup
    lives: the Program keeps it). (None, lookup) for any other lookup, or rows look_up
    cannot read: step.py looks those up itself."""
    lookup, times = getattr(embedding, "lookup", None), float(embedding.scale)
    if isinstance(lookup, FileRows):
        if lookup.dtype not in ROW_KINDS:
            return None, lookup
        kind = ROW_KINDS[lookup.dtype]
        return Rows(kind, None, None, lookup.fd, lookup.start, lookup.n, times), lookup
    if lookup is None:
        table, scale = embedding.E.detach(), None
    elif isinstance(lookup, PackedRows):
        table, scale = lookup.rows, lookup.scale
    else:
        return None, lookup
    if table.dim() != 2 or table.dtype not in ROW_KINDS or not table.is_contiguous():
        return None, lookup
    if (table.dtype == torch.int8) != (scale is not None):
        return None, lookup
    if scale is not None:
        if scale.dtype != torch.float32 or not scale.is_contiguous():
            return None, lookup
        keep.append(scale)
    keep.append(table)
    kind, address = ROW_KINDS[table.dtype], native.address(scale)
    kind = Q8_ROWS if getattr(lookup, "fmt", None) == "q8_0" else kind
    return Rows(kind, table.data_ptr(), address, -1, 0, len(table), times), lookup
