"""int8 and float16 weights in blocks of 16 output rows, for tlm's own products (`products.c`).

At batch 1 a product reads every weight once and does two operations per weight, so it is
as fast as the weights stream from memory. fbgemm's kernels (what `kernels.PackedLinear`
runs otherwise) are built for larger batches: on the GPT-2 124M shape at batch 1 they read
the small matrices of a layer at a third to a half of the memory's speed, and cost ~12 µs
a call whatever the size (docs/benchmarks-history.md, "Decoding without per-token overhead").
Here each matrix W [out, in] is laid out in the order the product reads it:

    int8:    [out/16, in/4, 16, 4]   block j, inputs 4g..4g+3: the 16 rows' 4 bytes each
    float16: [out/16, in, 16]        block j, input i: the 16 rows' values

so that one vector instruction multiplies an input (int8: four) by 16 rows' weights and
adds into those 16 outputs, and the weights stream front to back. Rows and inputs are
padded with zeros to multiples of 16; the outputs are exactly `out` wide.

The int8 format is `kernels.py`'s (symmetric, one scale per output row). Each row of x is
quantized here as the weights are, x ~ sx * xq with sx = max|x| / 127 and xq in
[-127, 127], and the integer sums are exact, so the product equals
sx * scale[o] * sum_i xq_i q_oi + b[o] to fp32 rounding (a test holds it to that
reference; fbgemm quantizes x to 256 levels with one zero point per call instead, and
both stay within the format's error of the fp32 product). float16 is fp32 arithmetic on
fp16 weights, as fbgemm's fp16 kernel.

They run where the library was built with OpenMP for a CPU with AVX-512 (int8: with VNNI)
or AVX2 with FMA and F16C (`here`; `products.c` and its two block headers), on torch's
threads; elsewhere `kernels.PackedLinear` uses fbgemm's kernels.
"""

from __future__ import annotations

import torch
from torch import Tensor

from tlm.inference import native

INT8, FLOAT = 1, 2  # bits of products.c's `products_here`: int8, float16 and float32 blocks
ROWS = 1024  # rows converted at a time (a multiple of 16): the temporaries stay a few MB


def here(fmt: str) -> bool:
    """Whether this host runs `fmt`'s products through the blocked kernels."""
    if not native.threaded():
        return False
    kernels = {"int8": INT8, "float16": FLOAT, "float32": FLOAT}.get(fmt, 0)
    return bool(native.library().products_here() & kernels)


class Int8Blocks:
    """y = x W^T + b, W ~ scale[o] * q[o, i] (q int8 [out, in], scale [out]): x [N, in] ->
    y [N, out] fp32."""

    def __init__(self, q: Tensor, scale: Tensor, b: Tensor | None) -> None:
        self.lib, (self.out, self.inputs) = native.library(), q.shape
        self.in_pad = _padded(self.inputs)
        self.blocks = _blocks(lambda lo, hi: q[lo:hi], q.shape, self.in_pad, torch.int8, 4)
        self.wsum = _padded_vector(q.sum(1, dtype=torch.int32), len(self.blocks) * 16)
        self.scale = _padded_vector(scale.float(), len(self.blocks) * 16)
        self.b = None if b is None else _padded_vector(b.float(), len(self.blocks) * 16)

    def __call__(self, x: Tensor) -> Tensor:
        x, y = _operands(x, self.inputs, self.out)
        done = self.lib.int8_product(
            self.blocks.data_ptr(), self.scale.data_ptr(), self.wsum.data_ptr(),
            native.address(self.b), x.data_ptr(), len(x), self.inputs, self.in_pad, self.out,
            y.data_ptr(),
        )  # fmt: skip
        if done != 0:
            raise MemoryError(f"int8 product of {len(x)} rows: no memory for its operands")
        return y


class FloatBlocks:
    """y = x W^T + b with W [out, in] held in `dtype` (float16, widened as it is read, or a
    float32 copy), fp32 arithmetic: x [N, in] -> y [N, out]. `read(lo, hi)` gives rows lo:hi
    of W in fp32; they are converted a block at a time."""

    scale = wsum = None  # int8's, not float's

    def __init__(self, read, shape: tuple[int, int], b: Tensor | None, dtype=torch.float16):
        self.lib, (self.out, self.inputs) = native.library(), shape
        self.in_pad = self.inputs
        self.blocks = _blocks(read, shape, self.inputs, dtype, 1)
        self.b = None if b is None else _padded_vector(b.float(), len(self.blocks) * 16)
        fp32 = dtype == torch.float32
        self.kernel = self.lib.float32_product if fp32 else self.lib.float16_product

    def __call__(self, x: Tensor) -> Tensor:
        x, y = _operands(x, self.inputs, self.out)
        self.kernel(
            self.blocks.data_ptr(), native.address(self.b), x.data_ptr(), len(x),
            self.inputs, self.out, y.data_ptr(),
        )  # fmt: skip
        return y


def _blocks(read, shape: tuple[int, int], in_pad: int, dtype: torch.dtype, group: int) -> Tensor:
    """W [out, in] (rows lo:hi from `read`) as [out_pad/16, in_pad/group, 16, group]: block
    j, inputs g*group.., the 16 rows' `group` values each side by side; zero padding."""
    out, inputs = shape
    blocks = torch.zeros(_padded(out) // 16, in_pad // group, 16, group, dtype=dtype)
    for lo in range(0, out, ROWS):
        part = read(lo, min(lo + ROWS, out))
        rows = torch.zeros(_padded(len(part)), in_pad, dtype=dtype)
        rows[: len(part), :inputs] = part
        # [rows, in] -> [rows/16, 16, in/group, group] -> [rows/16, in/group, 16, group]
        grouped = rows.view(-1, 16, in_pad // group, group).transpose(1, 2)
        blocks[lo // 16 : (lo + len(rows)) // 16] = grouped
    return blocks


def _operands(x: Tensor, inputs: int, out: int) -> tuple[Tensor, Tensor]:
    """x as the kernels read it (fp32, contiguous [N, in]) and a new y [N, out]."""
    if x.dim() != 2 or x.shape[1] != inputs:
        raise ValueError(f"expected x [N, {inputs}], got {list(x.shape)}")
    x = x if x.dtype == torch.float32 and x.is_contiguous() else x.float().contiguous()
    return x, x.new_empty(len(x), out)


def _padded(n: int) -> int:
    return -(-n // 16) * 16


def _padded_vector(v: Tensor, n: int) -> Tensor:
    out = torch.zeros(n, dtype=v.dtype)
    out[: len(v)] = v.detach()
    return out
