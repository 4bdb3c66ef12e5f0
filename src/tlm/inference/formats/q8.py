"""q8_0: llama.cpp's 8-bit weights (Q8_0), for tlm's own product (`q4.c`, `blocks_q4.h`).

A weight row is cut into blocks of 32; a block keeps one scale d = max|w| / 127 (fp16) and
32 values q = round(w / d) in [-127, 127] (halves away from zero, 1 / d in fp32): 8.5 bits
a weight. tlm's `int8` keeps one scale a row instead (8 bits and a little); q8_0 is what a
GGUF file's Q8_0 tensors hold, and what the 4-bit formats keep their embeddings and head in
(`kernels.wider`), so that tlm computes with the values llama.cpp reads from the same file.

The product quantizes x as Q8_0 too (as `q4.reference` does), sums each block's q xq exactly
in integers and adds the blocks' sums times d dx in fp32: `reference` is that in PyTorch,
`Q8Blocks` the kernel's layout (16 output rows together, `blocks_q4.h` says how).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from tlm.inference.formats import q4
from tlm.inference.formats.q4 import BLOCK, _q8_0


def quantize(rows: Tensor) -> tuple[Tensor, Tensor]:
    """Rows [n, in] (in a multiple of 32) as Q8_0: q int8 [n, in], d fp16 [n, in/32]."""
    xq, d = _q8_0(rows, rows.shape[1], weights=True)
    return xq.to(torch.int8).view(len(rows), -1), d.half()


def dequantize(q: Tensor, d: Tensor) -> Tensor:
    """W [n, in] fp32 from q [n, in] and d [n, in/32]: q d."""
    return q4.scaled(q.float(), d)


def reference(x: Tensor, q: Tensor, d: Tensor, b: Tensor | None) -> Tensor:
    """The q8_0 product in PyTorch: x [N, in] fp32 against q [out, in_pad], d [out, in_pad/32]
    (padding 0), as the kernel computes it; [N, out]."""
    return q4.scaled_product(x, q.float(), d, b)


class Q8Blocks(q4.ScaledBlocks):
    """q8_0: a line is 64 bytes, rows 0-7's four bytes each, then rows 8-15's."""

    FUNCTION, LINE, DTYPE = "q8_0_product", 64, torch.int8
    quantize, reference = staticmethod(quantize), staticmethod(reference)

    @staticmethod
    def laid_out(q: Tensor) -> Tensor:
        """q [16J, in_pad] -> [J, in_pad/32, 8, 64]: block b, group g, half h, row r, input t."""
        nb = q.shape[1] // BLOCK
        v = q.view(-1, 2, 8, nb, 8, 4).permute(0, 3, 4, 1, 2, 5)  # [J, nb, g, half, r, t]
        return v.reshape(-1, nb, 8, 64)

    @staticmethod
    def read_back(lines: Tensor) -> Tensor:
        J, nb = lines.shape[:2]
        v = lines.view(J, nb, 8, 2, 8, 4).permute(0, 3, 4, 1, 2, 5)  # [J, half, r, nb, g, t]
        return v.reshape(J * 16, -1)


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
