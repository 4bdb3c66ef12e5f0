"""q6_k: llama.cpp's Q6_K weights (GGUF's k-quant of 6 bits), which `tlm export-gguf --type
q4_k_m` writes where llama.cpp's Q4_K_M mix gives a tensor more bits (the head, and the
feed-forward's down-projection of some layers).

A row is cut into super-blocks of 256 weights, each of 16 sub-blocks of 16. A sub-block
holds 16 values q in [0, 63] and stands for w = d sc (q - 32), with sc a signed 8-bit
integer of its own and d fp16 of the super-block: 210 bytes a super-block, 6.5625 bits a
weight. The rounding is llama.cpp's `quantize_row_q6_K_ref` (without an importance
matrix), step for step:

1. each sub-block's scale by `make_qx_quants(16, 32, x, L, 1)`: levels of -32 / (its value
   of largest magnitude), clamped to [-32, 31], and 18 more trial scales (32 + 0.1 k) for k
   = -9..9 but 0, each scored by its least-squares fit weighted by x^2; the best fit's scale
   kept;
2. d = -(the scale of largest magnitude) / 128 in fp16, sc = min(127, round(scale / d));
3. each q again from those: round(x / (d sc)) + 32 in [0, 63] (a sub-block whose d sc is 0
   keeps the levels of step 1).

As in `q4k`, rounding to nearest is half to even and sums are fp32 in another order than
llama.cpp's loops, so a trial's score may differ in its last bits; a test holds the
rounding to a scalar port of those loops, and `gguf`'s dequantization of `to_gguf`'s bytes
to `dequantize`.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

SUPER, SUB = 256, 16  # weights a super-block and a sub-block hold
EPS = 1e-15  # llama.cpp's GROUP_MAX_EPS: a smaller largest magnitude is all zeros


def quantize(rows: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Rows [n, in] (in a multiple of 256) as Q6_K: q uint8 [n, in] in [0, 63], sc int8
    [n, in/16], d fp16 [n, in/256]."""
    n, k = rows.shape
    x = rows.float().reshape(-1, SUB)  # every sub-block
    levels, scale = _fit(x)
    scales = scale.view(-1, SUPER // SUB)  # [super-blocks, 16]
    top = scales.gather(-1, scales.abs().argmax(-1, keepdim=True))  # signed, the first
    zero = top.abs() < EPS
    iscale = torch.where(zero, torch.zeros_like(top), -128 / torch.where(zero, 1, top))
    d = torch.where(zero, torch.zeros_like(top), 1 / torch.where(zero, 1, iscale)).half()
    sc = torch.round(iscale * scales).clamp(max=127)  # in [-128, 127]
    step = (d.float() * sc).view(-1, 1)  # [sub-blocks, 1]
    again = torch.round(x / torch.where(step != 0, step, 1)).clamp(-32, 31) + 32
    q = torch.where(step != 0, again, levels)
    q = torch.where(zero.repeat_interleave(SUPER // SUB, 0).view(-1, 1), 0, q)
    return q.to(torch.uint8).view(n, k), sc.to(torch.int8).view(n, -1), d.view(n, -1)


def _fit(x: Tensor) -> tuple[Tensor, Tensor]:
    """`make_qx_quants(16, 32, x, L, 1, NULL)` for every row of x [S, 16]: (levels [S, 16] in
    [0, 63], scale [S])."""
    most = x.gather(-1, x.abs().argmax(-1, keepdim=True))  # signed, the first
    empty = most.abs() < EPS
    safe = torch.where(empty, torch.ones_like(most), most)
    w = x * x

    def trial(top: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        levels = torch.round(-top / safe * x).clamp(-32, 31)
        return (
            levels,
            (w * x * levels).sum(-1, keepdim=True),
            (w * levels * levels).sum(-1, keepdim=True),
        )

    levels, sumlx, suml2 = trial(torch.tensor(32.0))
    scale = torch.where(suml2 > 0, sumlx / torch.where(suml2 > 0, suml2, 1), 0)
    best = scale * sumlx
    for k in [*range(-9, 0), *range(1, 10)]:
        top = torch.tensor(32.0) + torch.tensor(0.1) * k  # fp32, as llama.cpp's nmax + 0.1f*is
        guess, lx, l2 = trial(top)
        better = (l2 > 0) & (lx * lx > best * l2)
        levels = torch.where(better, guess, levels)
        scale = torch.where(better, lx / torch.where(l2 > 0, l2, 1), scale)
        best = torch.where(better, scale * lx, best)
    levels = torch.where(empty, torch.full_like(levels, -32), levels)
    return levels + 32, torch.where(empty, 0, scale).squeeze(-1)


def dequantize(q: Tensor, sc: Tensor, d: Tensor) -> Tensor:
    """W [n, in] fp32: d sc (q - 32), as llama.cpp's dequantize_row_q6_K."""
    n, k = q.shape
    step = d.float().repeat_interleave(SUPER // SUB, dim=1) * sc.float()  # [n, in/16]
    return (step[..., None] * (q.float().view(n, -1, SUB) - 32)).view(n, k)


def to_gguf(q: Tensor, sc: Tensor, d: Tensor) -> np.ndarray:
    """GGUF's Q6_K bytes [n, in/256 * 210]: 128 bytes of low nibbles (in each 128 values,
    byte l holds value l and l + 64, byte l + 32 values l + 32 and l + 96), 64 bytes of high
    pairs of bits (byte l of each 128: values l, l + 32, l + 64, l + 96 from bit 0 up), the
    16 sc, then d (fp16)."""
    n = q.shape[0]
    v = q.view(-1, 2, 4, 32).numpy()  # [super-blocks, 128s, quarter, l]
    low = (v & 0x0F).astype(np.uint8)
    ql = np.concatenate(
        [low[:, :, 0] | (low[:, :, 2] << 4), low[:, :, 1] | (low[:, :, 3] << 4)], axis=2
    )
    high = (v >> 4).astype(np.uint8)
    qh = high[:, :, 0] | (high[:, :, 1] << 2) | (high[:, :, 2] << 4) | (high[:, :, 3] << 6)
    scales = sc.view(-1, 16).numpy().view(np.uint8)
    halves = d.reshape(-1, 1).numpy().view(np.uint8).reshape(-1, 2)
    blocks = np.concatenate([ql.reshape(-1, 128), qh.reshape(-1, 64), scales, halves], axis=1)
    return blocks.reshape(n, -1)
