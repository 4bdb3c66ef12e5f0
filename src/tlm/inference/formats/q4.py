"""q4_0: llama.cpp's 4-bit weights (Q4_0), for tlm's own product (`q4.c`, `blocks_q4.h`).

A weight row is cut into blocks of 32; a block keeps one scale d (fp16) and 32 values q in
[0, 15], the weight being (q - 8) d: 4.5 bits a weight, 0.5625 bytes (int8 takes 1 and a
scale a row). The rounding is llama.cpp's (`quantize_row_q4_0_ref`, and the `gguf`
package's): d = m / -8 for the block's value m of largest magnitude (the first of equal
ones), q = min(15, trunc(w / d + 8.5)); so the largest weight is exactly -8 d and the
others round to the nearest of 16 levels. A test holds `quantize` to `gguf`'s bytes.

The product quantizes each row of x as llama.cpp's Q8_0 does on x86 (blocks of 32, xq =
round(x 127 / max|x|) to the nearest even, dx = max|x| / 127 kept in fp16), sums each
block's (q - 8) xq exactly in integers, and adds the blocks' sums times d dx in fp32:
`reference` is that in PyTorch (the test's slow side, and the route where the library has
no q4_0 kernel); `Q4Blocks` holds the weights in the kernel's layout (16 output rows
together, `blocks_q4.h` says how) and runs it. q4_k (`Q4KBlocks`, `reference_k`) quantizes
x as llama.cpp's Q8_K instead (one fp32 dx a super-block of 256), the activations llama.cpp
pairs with Q4_K. The embeddings and the head stay q8_0 (`kernels.wider`, `q8.py`):
llama.cpp's own mixes keep the output matrix at 6 bits or more, as the logits are where 4
bits cost the most.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from tlm.inference import native
from tlm.inference.formats.blocked import _operands, _padded_vector
from tlm.interop import q4k

BLOCK = 32  # weights a scale covers
CHUNK = 1024  # rows quantized at a time: the temporaries stay a few MB


def quantize(rows: Tensor) -> tuple[Tensor, Tensor]:
    """Rows [n, in] (in a multiple of 32) as Q4_0: q uint8 [n, in] in [0, 15], d fp16 [n, in/32]."""
    n, k = rows.shape
    blocks = rows.float().reshape(n, k // BLOCK, BLOCK)
    most = blocks.gather(-1, blocks.abs().argmax(-1, keepdim=True))  # signed, the first
    d = most / -8
    inverse = torch.where(d == 0, torch.zeros_like(d), 1 / d)
    q = (blocks * inverse + 8.5).trunc_().clamp_(0, 15).to(torch.uint8)
    return q.reshape(n, k), d.squeeze(-1).half()


def dequantize(q: Tensor, d: Tensor) -> Tensor:
    """W [n, in] fp32 from q [n, in] and d [n, in/32]: (q - 8) d."""
    return scaled(q.float() - 8, d)


def scaled(levels: Tensor, d: Tensor) -> Tensor:
    """Weights [n, in] fp32 of integer levels [n, in] (fp32) and a scale d [n, in/32] a block."""
    n, k = levels.shape
    return (levels.view(n, k // BLOCK, BLOCK) * d.float()[..., None]).view(n, k)


def reference(x: Tensor, q: Tensor, d: Tensor, b: Tensor | None) -> Tensor:
    """The q4_0 product in PyTorch: x [N, in] fp32 against q [out, in_pad], d [out, in_pad/32]
    (padding q 8, the weight 0), as the kernel computes it; [N, out]."""
    return scaled_product(x, q.float() - 8, d, b)


def scaled_product(x: Tensor, levels: Tensor, d: Tensor, b: Tensor | None) -> Tensor:
    """x [N, in] fp32 against weights levels [out, in_pad] (integers, fp32) times d [out,
    in_pad/32], as the kernels compute it: Q8_0 activations, exact block sums, fp32 scales."""
    out, in_pad = levels.shape
    xq, dx = _q8_0(x, in_pad)
    sums = torch.einsum("nbk,obk->nob", xq, levels.view(out, -1, BLOCK))  # exact
    y = (sums * (d.float()[None] * dx[:, None, :])).sum(-1)
    return y if b is None else y + b


def reference_k(x: Tensor, parts: tuple[Tensor, ...], b: Tensor | None) -> Tensor:
    """The q4_k product in PyTorch, as the kernel computes it: `parts` (q [out, in], sc and m
    [out, in/32], d and dmin [out, in/256], `interop.q4k.quantize`'s) stand for d sc q - dmin
    m; x is quantized as Q8_K (`_q8_k`), and each sub-block adds S d sc dx - dmin m dx
    sum(xq), S its exact sum of q xq."""
    q, sc, m, d, dmin = parts
    out, inputs = q.shape
    xq, dx = _q8_k(x)
    sums = torch.einsum("nbk,obk->nob", xq, q.view(out, -1, BLOCK).float())  # exact
    step = d.float().repeat_interleave(8, dim=1) * sc.float()  # [out, in/32]
    shift = dmin.float().repeat_interleave(8, dim=1) * m.float()
    y = sums * (step[None] * dx[:, None, :]) - shift[None] * (dx * xq.sum(-1))[:, None, :]
    y = y.sum(-1)
    return y if b is None else y + b


def _q8_0(x: Tensor, in_pad: int, weights: bool = False) -> tuple[Tensor, Tensor]:
    """x [N, in] as llama.cpp's Q8_0, padded to in_pad: xq [N, in_pad/32, 32] (integers, in
    fp32) and dx [N, in_pad/32] (its fp16 value), dx = max|x| / 127. As activations (the
    kernel's), xq = round(x 127 / max|x|) to the nearest even, as llama.cpp's x86
    quantize_row_q8_0 computes them; as `weights`, xq = round(x / dx) with halves away from
    zero, as its quantize_row_q8_0_ref (and the gguf package) write them."""
    xb = F.pad(x.float(), (0, in_pad - x.shape[1])).view(len(x), -1, BLOCK)
    most = xb.abs().amax(-1)
    scale = most / 127
    if not weights:
        inverse = torch.where(most != 0, 127 / most, torch.zeros_like(most))
        return (xb * inverse[..., None]).round(), scale.half().float()
    inverse = torch.where(scale != 0, 1 / scale, torch.zeros_like(scale))
    v = xb * inverse[..., None]
    whole = v.trunc()
    xq = torch.where((v - whole).abs() == 0.5, whole + v.sign(), v.round())  # halves away
    return xq, scale.half().float()


def _q8_k(x: Tensor) -> tuple[Tensor, Tensor]:
    """x [N, in] (in a multiple of 256) as llama.cpp's Q8_K, the activations it pairs with
    Q4_K: per super-block of 256, iscale = -127 / (its value of largest magnitude, the first),
    xq = min(127, round(iscale x)) (halves to even), dx = 1 / iscale in fp32. As `_q8_0`
    gives them: xq [N, in/32, 32] and dx [N, in/32], each super-block's dx eight times."""
    xs = x.float().view(len(x), -1, q4k.SUPER)
    most = xs.gather(-1, xs.abs().argmax(-1, keepdim=True))  # signed, the first
    iscale = torch.where(most != 0, -127 / most, torch.zeros_like(most))
    xq = (xs * iscale).round().clamp_(max=127)
    dx = torch.where(most != 0, 1 / iscale, torch.zeros_like(most))
    return xq.view(len(x), -1, BLOCK), dx.expand(-1, -1, 8).reshape(len(x), -1)


def here() -> bool:
    """Whether this host's library has the q4_0 kernel (an AVX2 or AVX-512 build)."""
    return native.library() is not None and bool(native.library().q4_here())


class ScaledBlocks:
    """y = x W^T + b with W [out, in] held in blocks of 32 inputs with one fp16 scale d a row
    and block, in the kernel's layout: `blocks` [out_pad/16, in_pad/32, 8, LINE] (a line a
    group of four inputs, `laid_out` says how) and `scales` [out_pad/16, in_pad/32, 16] fp16.
    `read(lo, hi)` gives rows lo:hi of W in fp32; they are quantized CHUNK rows at a time.
    Where the library has no kernel (`native` False), the format's `reference` runs. q4_0
    (`Q4Blocks`) and q8_0 (`q8.Q8Blocks`) are its two formats."""

    FUNCTION, LINE, DTYPE = "", 0, torch.uint8  # q4.c's product, bytes a line, their type

    def __init__(self, read, shape: tuple[int, int], b: Tensor | None) -> None:
        (self.out, self.inputs), self.native = shape, here()
        self.lib = native.library() if self.native else None
        self.in_pad = -(-self.inputs // BLOCK) * BLOCK
        out_pad, nb = -(-self.out // 16) * 16, self.in_pad // BLOCK
        self.blocks = torch.empty(out_pad // 16, nb, 8, self.LINE, dtype=self.DTYPE)
        self.scales = torch.zeros(out_pad // 16, nb, 16, dtype=torch.float16)
        for at, rows in _chunks(read, self.out, out_pad, self.in_pad):
            q, d = self.quantize(rows)
            self.blocks[at] = self.laid_out(q)
            self.scales[at] = _by_16(d)
        self.b = None if b is None else _padded_vector(b.float(), out_pad)

    def unpacked(self) -> tuple[Tensor, Tensor]:
        """(q [out, in_pad], d [out, in_pad/32]) from the layout."""
        return self.read_back(self.blocks)[: self.out], _of_rows(self.scales)[: self.out]

    def __call__(self, x: Tensor) -> Tensor:
        if not self.native:
            x = _operands(x, self.inputs, self.out)[0]
            return self.reference(x, *self.unpacked(), _bias(self))
        return _product(self, self.FUNCTION, (self.blocks, self.scales), x)


class Q4Blocks(ScaledBlocks):
    """q4_0: two rows' nibbles a byte (`_interleaved`)."""

    FUNCTION, LINE = "q4_0_product", 32
    quantize, reference = staticmethod(quantize), staticmethod(reference)

    @staticmethod
    def laid_out(q: Tensor) -> Tensor:
        return _interleaved(q)

    @staticmethod
    def read_back(lines: Tensor) -> Tensor:
        return _nibbles(lines)


def _bias(kernel) -> Tensor | None:
    """A block kernel's bias, its padding cut off (for a reference)."""
    return None if kernel.b is None else kernel.b[: kernel.out]


def _product(kernel, function: str, tensors: tuple[Tensor, ...], x: Tensor) -> Tensor:
    """y = x W^T + b by q4.c's `function` on `kernel`'s tensors (then its bias), as the three
    block kinds take their arguments."""
    x, y = _operands(x, kernel.inputs, kernel.out)
    done = getattr(kernel.lib, function)(
        *(t.data_ptr() for t in tensors), native.address(kernel.b), x.data_ptr(), len(x),
        kernel.inputs, kernel.in_pad, kernel.out, y.data_ptr(),
    )  # fmt: skip
    if done != 0:
        raise MemoryError(f"{function} of {len(x)} rows: no memory for its operands")
    return y


def _interleaved(q: Tensor) -> Tensor:
    """q [16J, in_pad] as the kernel's lines [J, in_pad/32, 8, 32]: in group g of block b, byte
    4r + t holds row r's q of input 4g + t (low nibble) and row r + 8's (high nibble)."""
    rows, in_pad = q.shape
    v = q.view(rows // 16, 2, 8, in_pad // BLOCK, 8, 4)  # [J, half, r, b, g, t]
    lines = v[:, 0] | (v[:, 1] << 4)  # [J, r, b, g, t]
    return lines.permute(0, 2, 3, 1, 4).reshape(rows // 16, in_pad // BLOCK, 8, 32)


class Q4KBlocks:
    """y = x W^T + b with W [out, in] (in a multiple of 256) held as Q4_K (`interop.q4k`'s
    rounding) in the kernel's layout: the q4_0 lines of nibbles, scm [out_pad/16, in/32, 32]
    (the 16 rows' 6-bit sc, then their m) and dd [out_pad/16, in/256, 32] fp16 (their d,
    then their dmin). Where the library has no kernel, `reference_k` runs instead."""

    def __init__(self, read, shape: tuple[int, int], b: Tensor | None) -> None:
        (self.out, self.inputs), self.native = shape, here()
        if self.inputs % q4k.SUPER:
            raise ValueError(f"q4_k needs rows of whole 256-blocks; these have {self.inputs}")
        self.lib, self.in_pad = native.library() if self.native else None, self.inputs
        out_pad, nb = -(-self.out // 16) * 16, self.inputs // BLOCK
        self.blocks = torch.empty(out_pad // 16, nb, 8, 32, dtype=torch.uint8)
        self.scm = torch.zeros(out_pad // 16, nb, 32, dtype=torch.uint8)
        self.dd = torch.zeros(out_pad // 16, nb // 8, 32, dtype=torch.float16)
        for at, rows in _chunks(read, self.out, out_pad, self.inputs):
            q, sc, m, d, dmin = q4k.quantize(rows)
            self.blocks[at] = _interleaved(q)
            self.scm[at] = torch.cat([_by_16(sc), _by_16(m)], dim=-1)
            self.dd[at] = torch.cat([_by_16(d), _by_16(dmin)], dim=-1)
        self.b = None if b is None else _padded_vector(b.float(), out_pad)

    def unpacked(self) -> tuple[Tensor, ...]:
        """(q, sc, m, d, dmin) as `interop.q4k.quantize` gives them, from the layout."""
        rows = lambda t: _of_rows(t)[: self.out]  # noqa: E731
        sc, m, d, dmin = (rows(t) for t in (self.scm[..., :16], self.scm[..., 16:],
                                             self.dd[..., :16], self.dd[..., 16:]))  # fmt: skip
        return _nibbles(self.blocks)[: self.out], sc, m, d, dmin

    def __call__(self, x: Tensor) -> Tensor:
        if not self.native:
            return reference_k(_operands(x, self.inputs, self.out)[0], self.unpacked(), _bias(self))
        return _product(self, "q4_k_product", (self.blocks, self.dd, self.scm), x)


def _by_16(t: Tensor) -> Tensor:
    """[16J, k] per-row values as [J, k, 16]: the 16 rows of a block side by side."""
    return t.view(-1, 16, t.shape[1]).transpose(1, 2)


def _of_rows(t: Tensor) -> Tensor:
    """[J, k, 16] -> [16J, k]: `_by_16` undone."""
    return t.transpose(1, 2).reshape(-1, t.shape[1])


def _nibbles(lines: Tensor) -> Tensor:
    """The kernel's lines [J, in_pad/32, 8, 32] -> q [16J, in_pad]: `_interleaved` undone."""
    J, nb = lines.shape[:2]
    both = lines.view(J, nb, 8, 8, 4)  # [J, b, g, r, t]
    return torch.cat([both & 0x0F, both >> 4], dim=3).permute(0, 3, 1, 2, 4).reshape(J * 16, -1)


def _chunks(read, out: int, out_pad: int, width: int):
    """(rows of blocks, rows [n, width] fp32) of W, CHUNK rows at a time, zero past `out`
    (and past read's columns): what a format quantizes while its matrix is read."""
    for lo in range(0, out_pad, CHUNK):
        hi = min(lo + CHUNK, out_pad)
        rows = torch.zeros(hi - lo, width)
        real = read(lo, min(hi, out)) if lo < out else rows[:0]
        rows[: len(real), : real.shape[1]] = real
        yield slice(lo // 16, hi // 16), rows
