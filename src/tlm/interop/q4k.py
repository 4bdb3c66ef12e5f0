"""q4_k: llama.cpp's Q4_K weights (GGUF's k-quant of 4 bits), as `tlm export-gguf --type q4_k`
writes them (here, beside the GGUF writer: a format of the file, below the inference layer
that may decode in it).

A row is cut into super-blocks of 256 weights, each of 8 sub-blocks of 32. A sub-block
holds 32 values q in [0, 15] and stands for w = d sc q - dmin m, with sc and m 6-bit
integers of its own and d, dmin fp16 of the super-block: 144 bytes a super-block, 4.5 bits
a weight. The rounding is llama.cpp's `quantize_row_q4_K_ref` (without an importance
matrix), step for step:

1. each sub-block's scale and min by `make_qkx2_quants`: weights w_i = rms(x) + |x_i|; the
   min clamped to <= 0; the levels of 15 / (max - min) as a first guess, then 21 trial
   scales (14 + 0.1 k) / (max - min), each refitted by weighted least squares (scale and
   min; the min 0 where it comes out positive), the one of least weighted squared error
   kept;
   (a better trial's min is the origin of the trials after it, as in llama.cpp's loop);
2. the 8 scales and mins as 6-bit integers of the super-block's largest over 63 (d and
   dmin, kept in fp16), rounded to nearest;
3. each q again from those: round((x + dmin m) / (d sc)), in [0, 15] (a sub-block whose
   d sc is 0 keeps its first levels).

Rounding to nearest is half to even, as llama.cpp's `nearest_int`; sums are fp32 in
another order than its loops, so a trial's error may differ in its last bits and, very
rarely, another trial win (`bench/gguf.py` counts the blocks whose bytes differ from
llama.cpp's own quantizer). `to_gguf` lays the blocks out as GGUF stores them, and a test
holds `gguf`'s dequantization of those bytes to `dequantize`.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

SUPER, SUB = 256, 32  # weights a super-block and a sub-block hold
# The 4-bit formats keep the token embeddings and the head in Q8_0 (llama.cpp's own mixes keep
# the output matrix at 6 bits or more): one place for tlm's kernels (`kernels.wider`) and the
# GGUF files it writes, so that both hold the same values.
WIDER = {"q4_0": "q8_0", "q4_k": "q8_0"}


def rows_of(kind: str, inputs: int) -> str:
    """The format a matrix of rows `inputs` long takes in `kind`: q4_k's rows must be whole
    super-blocks, and shorter ones take q4_0's blocks (the same bits a weight), in tlm's
    kernels and in the GGUF files it writes alike (llama.cpp's own quantizer takes Q5_0)."""
    return "q4_0" if kind == "q4_k" and inputs % SUPER else kind


STEPS = 20  # make_qkx2_quants's trial scales after its first guess: 21 in all


def quantize(rows: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Rows [n, in] (in a multiple of 256) as Q4_K: q uint8 [n, in] in [0, 15], sc and m
    uint8 [n, in/32] in [0, 63], d and dmin fp16 [n, in/256]."""
    n, k = rows.shape
    x = rows.float().reshape(-1, SUB)  # every sub-block
    levels, scale, least = _fit(x)
    per = lambda t: t.view(n * k // SUPER, SUPER // SUB)  # noqa: E731  [super-blocks, 8]
    scales, mins = per(scale), per(-least)
    top_scale = scales.amax(-1, keepdim=True).clamp(min=0)
    top_min = mins.amax(-1, keepdim=True).clamp(min=0)
    sc = _nearest(scales * _inverse(top_scale)).clamp(0, 63)
    m = _nearest(mins * _inverse(top_min)).clamp(0, 63)
    d, dmin = (top_scale / 63).half(), (top_min / 63).half()
    step = (d.float() * sc).view(-1, 1)  # [sub-blocks, 1]
    shift = (dmin.float() * m).view(-1, 1)
    again = _nearest((x + shift) / step).clamp(0, 15)
    q = torch.where(step != 0, again, levels)
    as_bytes = lambda t: t.to(torch.uint8).view(n, -1)  # noqa: E731
    return as_bytes(q), as_bytes(sc), as_bytes(m), d.view(n, -1), dmin.view(n, -1)


def _fit(x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """`make_qkx2_quants(32, 15, x, w, L, &min, Laux, -1, 0.1, 20, false)` for every row of
    x [S, 32]: (levels [S, 32], scale [S], min [S], the min <= 0)."""
    w = (x.square().sum(-1, keepdim=True) / SUB).sqrt() + x.abs()
    lo = x.amin(-1, keepdim=True).clamp(max=0)
    hi = x.amax(-1, keepdim=True)
    flat = hi == lo
    span = torch.where(flat, torch.ones_like(hi), hi - lo)
    sum_w, sum_x = w.sum(-1, keepdim=True), (w * x).sum(-1, keepdim=True)
    first = 15 / span
    levels = _nearest(first * (x - lo)).clamp(0, 15)
    scale, least = 1 / first, lo
    best = (w * (scale * levels + least - x).square()).sum(-1, keepdim=True)
    for trial in range(STEPS + 1):  # the min kept so far moves each trial's levels
        width = torch.where(flat, torch.ones_like(hi), hi - least)
        top = torch.tensor(-1.0) + torch.tensor(0.1) * trial + 15  # in fp32, as llama.cpp's
        guess = _nearest(top / width * (x - least)).clamp(0, 15)
        sum_l, sum_l2 = (w * guess).sum(-1, keepdim=True), (w * guess * guess).sum(-1, keepdim=True)
        sum_xl = (w * guess * x).sum(-1, keepdim=True)
        D = sum_w * sum_l2 - sum_l * sum_l
        safe = torch.where(D > 0, D, torch.ones_like(D))
        this_scale = (sum_w * sum_xl - sum_x * sum_l) / safe
        this_min = (sum_l2 * sum_x - sum_l * sum_xl) / safe
        positive = this_min > 0
        this_scale = torch.where(positive, sum_xl / sum_l2.clamp(min=1e-30), this_scale)
        this_min = torch.where(positive, torch.zeros_like(this_min), this_min)
        error = (w * (this_scale * guess + this_min - x).square()).sum(-1, keepdim=True)
        better = (D > 0) & (error < best) & ~flat
        levels = torch.where(better, guess, levels)
        best = torch.where(better, error, best)
        scale = torch.where(better, this_scale, scale)
        least = torch.where(better, this_min, least)
    levels = torch.where(flat, torch.zeros_like(levels), levels)
    scale = torch.where(flat, torch.zeros_like(scale), scale)
    return levels, scale.squeeze(-1), least.squeeze(-1)


def _nearest(t: Tensor) -> Tensor:
    return torch.round(t)  # half to even, as nearest_int's 1.5 * 2^23 trick


def _inverse(top: Tensor) -> Tensor:
    return torch.where(top > 0, 63 / top.clamp(min=1e-30), torch.zeros_like(top))


def dequantize(q: Tensor, sc: Tensor, m: Tensor, d: Tensor, dmin: Tensor) -> Tensor:
    """W [n, in] fp32: d sc q - dmin m, as llama.cpp's dequantize_row_q4_K."""
    n, k = q.shape
    step = d.float().repeat_interleave(SUPER // SUB, dim=1) * sc.float()  # [n, in/32]
    shift = dmin.float().repeat_interleave(SUPER // SUB, dim=1) * m.float()
    w = step[..., None] * q.float().view(n, -1, SUB) - shift[..., None]
    return w.view(n, k)


def to_gguf(q: Tensor, sc: Tensor, m: Tensor, d: Tensor, dmin: Tensor) -> np.ndarray:
    """GGUF's Q4_K bytes [n, in/256 * 144]: d, dmin (fp16), the 6-bit sc and m packed in 12
    bytes, then 128 bytes of q (in each 64 values, the first 32 in the low nibbles and the
    next 32 in the high)."""
    n = q.shape[0]
    sc, m = sc.view(-1, 8).numpy().astype(np.uint8), m.view(-1, 8).numpy().astype(np.uint8)
    packed = np.zeros((len(sc), 12), dtype=np.uint8)
    packed[:, 0:4] = sc[:, :4] | ((sc[:, 4:] >> 4) << 6)
    packed[:, 4:8] = m[:, :4] | ((m[:, 4:] >> 4) << 6)
    packed[:, 8:12] = (sc[:, 4:] & 0x0F) | ((m[:, 4:] & 0x0F) << 4)
    values = q.view(-1, 4, 2, 32).numpy()  # [super-blocks, 64s, first/next 32, 32]
    nibbles = (values[:, :, 0] | (values[:, :, 1] << 4)).reshape(-1, 128)
    halves = lambda t: t.reshape(-1, 1).numpy().view(np.uint8).reshape(-1, 2)  # noqa: E731
    blocks = np.concatenate([halves(d), halves(dmin), packed, nibbles], axis=1)
    return blocks.reshape(n, -1)
