"""q8_0: llama.cpp's 8-bit weights (Q8_0), for tlm's own product (`q4.c`, `blocks_q4.h`).

A weight row is cut into blocks of 32; a block keeps one scale d = max|w| / 127 (fp16) and
32 values q = round(w / d) in [-127, 127] (halves away from zero, 1 / d in fp32): 8.5 bits
a weight. tlm's `int8` keeps one scale a row instead (8 bits and a little); q8_0 is what a
GGUF file's Q8_0 tensors hold, and what the 4-bit formats keep their embeddings and head in
(`kernels.WIDER`), so that tlm computes with the values llama.cpp reads from the same file.

The product quantizes x as Q8_0 too (as `q4.reference` does), sums each block's q xq exactly
in integers and adds the blocks' sums times d dx in fp32: `reference` is that in PyTorch,
`Q8Blocks` the kernel's layout (16 output rows together, `blocks_q4.h` says how).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from tlm.inference import native
from tlm.inference.formats import q4
from tlm.inference.formats.blocked import _operands, _padded_vector
from tlm.inference.formats.q4 import BLOCK, _bias, _by_16, _chunks, _of_rows, _product, _q8_0


def quantize(rows: Tensor) -> tuple[Tensor, Tensor]:
    """Rows [n, in] (in a multiple of 32) as Q8_0: q int8 [n, in], d fp16 [n, in/32]."""
    xq, d = _q8_0(rows, rows.shape[1], weights=True)
    return xq.to(torch.int8).view(len(rows), -1), d.half()


def dequantize(q: Tensor, d: Tensor) -> Tensor:
    """W [n, in] fp32 from q [n, in] and d [n, in/32]: q d."""
    n, k = q.shape
    return (q.float().view(n, k // BLOCK, BLOCK) * d.float()[..., None]).view(n, k)


def reference(x: Tensor, q: Tensor, d: Tensor, b: Tensor | None) -> Tensor:
    """The q8_0 product in PyTorch: x [N, in] fp32 against q [out, in_pad], d [out, in_pad/32]
    (padding 0), as the kernel computes it; [N, out]."""
    out, in_pad = q.shape
    xq, dx = _q8_0(x, in_pad)
    sums = torch.einsum("nbk,obk->nob", xq, q.view(out, -1, BLOCK).float())  # exact
    y = (sums * (d.float()[None] * dx[:, None, :])).sum(-1)
    return y if b is None else y + b


class Q8Blocks:
    """y = x W^T + b with W [out, in] held as Q8_0 in the kernel's layout: blocks
    [out_pad/16, in_pad/32, 8, 64] int8 (group g of four inputs: rows 0-7's four bytes each,
    then rows 8-15's) and scales [out_pad/16, in_pad/32, 16] fp16. `read(lo, hi)` gives
    rows lo:hi of W in fp32. Where the library has no kernel, `reference` runs instead."""

    def __init__(self, read, shape: tuple[int, int], b: Tensor | None) -> None:
        (self.out, self.inputs), self.native = shape, q4.here()
        self.lib = native.library() if self.native else None
        self.in_pad = -(-self.inputs // BLOCK) * BLOCK
        out_pad, nb = -(-self.out // 16) * 16, self.in_pad // BLOCK
        self.blocks = torch.empty(out_pad // 16, nb, 8, 64, dtype=torch.int8)
        self.scales = torch.zeros(out_pad // 16, nb, 16, dtype=torch.float16)
        for at, rows in _chunks(read, self.out, out_pad, self.in_pad):
            q, d = quantize(rows)
            # [16J, in] -> [J, 2, 8, nb, 8, 4] (half, row r, block, group g, input t)
            v = q.view(-1, 2, 8, nb, 8, 4).permute(0, 3, 4, 1, 2, 5)  # [J, nb, g, half, r, t]
            self.blocks[at] = v.reshape(-1, nb, 8, 64)
            self.scales[at] = _by_16(d)
        self.b = None if b is None else _padded_vector(b.float(), out_pad)

    def unpacked(self) -> tuple[Tensor, Tensor]:
        """(q [out, in_pad], d [out, in_pad/32]) from the layout."""
        J, nb = self.blocks.shape[:2]
        v = self.blocks.view(J, nb, 8, 2, 8, 4).permute(0, 3, 4, 1, 2, 5)  # [J, half, r, nb, g, t]
        return v.reshape(J * 16, -1)[: self.out], _of_rows(self.scales)[: self.out]

    def __call__(self, x: Tensor) -> Tensor:
        if not self.native:
            return reference(_operands(x, self.inputs, self.out)[0], *self.unpacked(), _bias(self))
        return _product(self, "q8_0_product", (self.blocks, self.scales), x)


def rows(read, shape: tuple[int, int]) -> tuple[Tensor, Tensor]:
    """Token embeddings E [V, d] (rows lo:hi from `read`) as Q8_0 rows (blocks of 32 along
    d, the last zero-padded), for `kernels.PackedRows`: q int8 [V, d] and the scales widened
    to fp32 [V, ceil(d/32)]."""
    n, d = shape
    d_pad = -(-d // BLOCK) * BLOCK
    q, scale = torch.empty(n, d, dtype=torch.int8), torch.empty(n, d_pad // BLOCK)
    for lo in range(0, n, q4.CHUNK):
        part, s = quantize(F.pad(read(lo, min(lo + q4.CHUNK, n)).float(), (0, d_pad - d)))
        q[lo : lo + len(part)], scale[lo : lo + len(part)] = part[:, :d], s.float()
    return q, scale
