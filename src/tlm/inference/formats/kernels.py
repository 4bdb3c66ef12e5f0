"""Weights prepared for fast inference: the same linear maps, in the layouts CPU kernels like.

Decoding one token reads every weight once, so on a CPU its speed is set by how fast the
weights stream from memory and how well the kernel handles a few rows. PyTorch's default
fp32 path (MKL) is slow for the few-row products of decoding on some CPUs; these formats run
the same x W + b through better kernels:

| format   | weights held as                | kernel (CPU)                    | arithmetic      |
|----------|--------------------------------|---------------------------------|-----------------|
| float32  | the parameters themselves      | one row: tlm's loops (or        | fp32 (exact)    |
|          | (+ a copy in blocks of 16 rows | numpy's BLAS, `blas.py`); a     |                 |
|          | with AVX2/512, else a oneDNN   | decoding step of more rows:     |                 |
|          | layout, made at the first      | tlm's (`blocked.py`) or         |                 |
|          | decoding step of several rows) | `mkldnn._linear_pointwise`; a   |                 |
|          |                                | prompt: tlm's panels (AVX2) or  |                 |
|          |                                | torch's product                 |                 |
| float16  | fp16 in blocks of 16 rows      | tlm's (`blocked.py`) with       | fp32            |
|          | (AVX2/512), else prepacked for | AVX2 or AVX-512, else fbgemm's  |                 |
|          | fbgemm                         | `quantized.linear_dynamic_fp16` |                 |
| bfloat16 | bf16, [out, in]                | `F.linear` in bf16              | bf16 products,  |
|          |                                |                                 | fp32 elsewhere  |
| int8     | int8, one scale per output     | tlm's (`blocked.py`) with       | int8 products   |
|          | row: in blocks of 16 rows      | AVX2 or AVX-512 VNNI, else      | (activations    |
|          | (AVX2/512), else for fbgemm    | fbgemm's `quantized.linear_dyn.`| quantized/row)  |
| q8_0     | int8, a scale per 32 (`q8.py`) | tlm's (`q4.c`, AVX2; AVX-512    | int8 products   |
| q4_0     | 4 bits, a scale per 32 (`q4`)  | builds run it too), else the    | (activations    |
| q4_k     | 4 bits, scales and mins per 32 | PyTorch reference; embeddings   | quantized per   |
|          | under fp16 ones per 256        | and head in q8_0 (`WIDER`)      | 32, q4_k: 256)  |

Everything between the products (LayerNorm, attention, the residual stream, the KV cache)
stays fp32. Memory follows the format: float16, bfloat16 and int8 keep the weight
matrices and the token embeddings only in their own format (the embedding rows a step looks
up are widened to fp32), and the fp32 parameters they came from are released, so such a
model can be neither trained nor read as fp32 again; load it anew for that. On a GPU,
`bfloat16` and `float16` cast the whole model instead (`prepare.for_inference`). A test
holds each format against the plain fp32 model.

`modules.py` holds the model's modules that run these, and `prepare.py` builds them: from
a loaded model (`for_inference`) or while reading the weights (`tlm.load_model(path,
dtype=...)`).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from tlm.device import CPU_ONLY
from tlm.inference.formats import blas, blocked, q4, q8
from tlm.interop.q4k import WIDER, rows_of
from tlm.model.functional import linear
from tlm.tensor_files import LazyMatrix

FORMATS = ("float32", "float16", "bfloat16", "int8", "q8_0", "q4_0", "q4_k")


# bytes a weight of a matrix in each format, its scales included (q8_0: 34 bytes a block of
# 32, q4_0: 18, q4_k: 144 a super-block of 256; int8's one scale a row is left out)
BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "int8": 1, "q8_0": 34 / 32}
BYTES |= {"q4_0": 18 / 32, "q4_k": 144 / 256}


def wider(fmt: str) -> str:
    """The format the token embeddings and the head take in weight format `fmt`
    (`interop.q4k.WIDER`)."""
    return WIDER.get(fmt, fmt)


CHUNK = 1024  # rows quantized or converted at a time: the temporaries stay a few MB


class PackedLinear:
    """y = x W + b for weight W_t [out, in] prepared in `fmt`; x [..., in] -> y [..., out].

    With `splits`, y is cut along its last dimension into outputs of those widths. W_t may
    be a matrix left in its file (`LazyMatrix`): bfloat16 and int8 then read it a block of
    rows at a time, so that it is never whole in fp32 (float16's kernel packs only from a
    whole fp32 matrix).
    """

    def __init__(
        self,
        W_t: Tensor | LazyMatrix,
        b: Tensor | None,
        fmt: str,
        splits: list[int] | None = None,
    ) -> None:
        if isinstance(W_t, LazyMatrix):
            read, shape = W_t.rows, W_t.shape
        else:
            read, shape = (lambda lo, hi: W_t[lo:hi].detach().float()), W_t.shape
        self.b = None if b is None else b.detach().float()
        self.out_features, self.splits = shape[0], splits
        fmt = rows_of(fmt, shape[1])  # q4_k's rows not whole super-blocks: q4_0
        if fmt == "q4_k":  # tlm's own kernels, or their references
            self.weight = self.kernel = q4.Q4KBlocks(read, shape, self.b)
        elif fmt == "q4_0":
            self.weight = self.kernel = q4.Q4Blocks(read, shape, self.b)
        elif fmt == "q8_0":
            self.weight = self.kernel = q8.Q8Blocks(read, shape, self.b)
        elif fmt in ("float16", "int8") and blocked.here(fmt):  # tlm's own kernels
            if fmt == "float16":
                self.weight = self.kernel = blocked.FloatBlocks(read, shape, self.b)
            else:
                self.weight = self.kernel = blocked.Int8Blocks(*_int8(read, shape), self.b)
        elif fmt == "float16":
            whole = read(0, shape[0]).contiguous()
            self.weight = torch.ops.quantized.linear_prepack_fp16(whole, self.b)
            self.kernel = self._fbgemm_fp16
        elif fmt == "bfloat16":
            self.weight = _converted(read, shape, torch.bfloat16)  # [out, in]: the fast way
            self.b = None if b is None else self.b.to(torch.bfloat16)
            self.kernel = self._bf16
        elif fmt == "int8":
            self.weight = torch.ops.quantized.linear_prepack(_qint8(*_int8(read, shape)), self.b)
            self.kernel = self._fbgemm_int8
        else:
            raise ValueError(f"no packed format {fmt!r}; choose one of {', '.join(FORMATS)}")

    @classmethod
    def side_by_side(
        cls,
        maps: list[tuple[Tensor, Tensor | None]],
        fmt: str,
        route: Route | None = None,
        layout: bool = True,
    ) -> PackedLinear | Float32Linear:
        """The maps x W_i + b_i (W_i [in, out_i], as the model stores them) as one product
        (`route` and `layout`: see `Float32Linear`)."""
        if fmt == "float32":
            return Float32Linear(maps, route or Route(), layout)
        W_t = _stacked(maps)  # [sum out_i, in]
        biases = [b for _, b in maps]
        b = None if biases[0] is None else torch.cat([b.detach() for b in biases])
        splits = [W.shape[1] for W, _ in maps] if len(maps) > 1 else None
        return cls(W_t, b, fmt, splits)

    def __call__(self, x: Tensor) -> Tensor | tuple[Tensor, ...]:
        y = self.kernel(x.reshape(-1, x.shape[-1]))  # [..., in] -> [N, in] -> [N, out]
        y = y.view(*x.shape[:-1], self.out_features)
        return y if self.splits is None else y.split(self.splits, dim=-1)

    step = __call__  # a decoding step's rows take the same kernel as any others

    def _bf16(self, x: Tensor) -> Tensor:
        return F.linear(x.to(torch.bfloat16), self.weight, self.b).to(x.dtype)

    def _fbgemm_fp16(self, x: Tensor) -> Tensor:
        return torch.ops.quantized.linear_dynamic_fp16(x, self.weight)

    def _fbgemm_int8(self, x: Tensor) -> Tensor:
        return torch.ops.quantized.linear_dynamic(x, self.weight, True)


class Route:
    """Which kernel a float32 product takes in the forward pass under way: `rows` is set
    by `InferenceLM.forward`, for the length of a pass that feeds one token to each of that
    many sequences (their products take `Float32Linear.step`), and is 0 otherwise (a
    prompt, a score)."""

    rows = 0


class Float32Linear:
    """The fp32 maps x W_i + b_i on the parameters themselves. A decoding step of one row
    reads them in place (`blas.py`), and a prompt (read once) through tlm's panels of them
    (`blas.prompt`, AVX2 builds) or torch's product, neither with a copy. With `layout`, a
    decoding step of several rows runs them as one product on a copy of the weights made the
    first time such a step comes and kept from then on: tlm's fp32 blocks (`blocked.py`) where
    the CPU has AVX2 or AVX-512, else oneDNN's layout for 4 rows; without it, torch's product."""

    def __init__(
        self, maps: list[tuple[Tensor, Tensor | None]], route: Route, layout: bool = True
    ) -> None:
        self.maps, self.route, self.use_layout = maps, route, layout
        self.layout, self.b = None, None
        self.splits = [W.shape[1] for W, _ in maps]

    def __call__(self, x: Tensor) -> Tensor | tuple[Tensor, ...]:
        if torch.is_grad_enabled():
            y = tuple(linear(x, W, b) for W, b in self.maps)
        elif self.route.rows:
            return self.step(x)
        else:
            y = tuple(self._prompt(x, W, b) for W, b in self.maps)
        return y if len(y) > 1 else y[0]

    @staticmethod
    def _prompt(x: Tensor, W: Tensor, b: Tensor | None) -> Tensor:
        """A prompt's rows: tlm's loops where they apply (`blas.prompt`), else torch's."""
        y = blas.prompt(x, W, b)
        return linear(x, W, b) if y is None else y

    def step(self, x: Tensor) -> Tensor | tuple[Tensor, ...]:
        """The maps for the rows of a decoding step (one token of each sequence; no
        autograd): one row in place (`blas.py`), several on the layout where kept."""
        rows = x.reshape(-1, x.shape[-1])
        if len(rows) == 1:
            y = tuple(blas.product(x, W, b) for W, b in self.maps)
        elif self.use_layout:
            y = self._batched(rows).view(*x.shape[:-1], sum(self.splits))
            y = y.split(self.splits, dim=-1)
        else:
            y = tuple(linear(x, W, b) for W, b in self.maps)
        return y if len(y) > 1 else y[0]

    def _batched(self, x: Tensor) -> Tensor:
        if isinstance(self.made_layout(), blocked.FloatBlocks):
            return self.layout(x)
        return torch.ops.mkldnn._linear_pointwise(x, self.layout, self.b, "none", [], "")

    def made_layout(self):
        """The copy of the weights that steps of several rows read, made now if not yet."""
        if self.layout is None:
            W_t = _stacked(self.maps)  # [sum out_i, in]
            if self.maps[0][1] is not None:
                self.b = torch.cat([b.detach() for _, b in self.maps])
            if blocked.here("float32"):
                rows = lambda lo, hi: W_t[lo:hi].detach()  # noqa: E731
                self.layout = blocked.FloatBlocks(rows, W_t.shape, self.b, torch.float32)
            else:
                self.layout = torch.ops.mkldnn._reorder_linear_weight(W_t, 4)
        return self.layout


class HeadBlocks:
    """x [..., d] -> [..., V]: a head packed in blocks of vocabulary rows, the logits of
    each block side by side (as one product would give them)."""

    def __init__(self, blocks: list[PackedLinear]) -> None:
        self.blocks = blocks

    def __call__(self, x: Tensor) -> Tensor:
        return torch.cat([block(x) for block in self.blocks], dim=-1)

    step = __call__


class PackedRows:
    """Token embeddings held in `fmt`, looked up and widened to fp32: E[ids] -> [..., d].
    int8 keeps one scale a row (`scale` [V, 1]), q8_0 one a block of 32 ([V, ceil(d/32)])."""

    def __init__(self, E: Tensor | LazyMatrix, fmt: str) -> None:
        self.fmt = fmt
        if fmt == "q8_0":  # E may be left in its file: read a chunk of rows at a time
            read = E.rows if isinstance(E, LazyMatrix) else (lambda lo, hi: E[lo:hi].detach())
            self.rows, self.scale = q8.rows(read, E.shape)
            return
        E = E.detach()
        if fmt == "int8":  # one scale per row, as the products' weights
            self.rows, scale = _int8(lambda lo, hi: E[lo:hi], E.shape)
            self.scale = scale[:, None]
        else:
            self.scale, self.rows = None, E.to(getattr(torch, fmt))

    def __call__(self, ids: Tensor) -> Tensor:
        x = F.embedding(ids, self.rows).float()  # [..., d]
        if self.scale is None:
            return x
        scale = F.embedding(ids, self.scale)
        if self.fmt == "q8_0":
            scale = scale.repeat_interleave(q4.BLOCK, dim=-1)[..., : x.shape[-1]]
        return x * scale


Rows = Callable[[int, int], Tensor]  # read(lo, hi) -> rows lo:hi of a matrix, in fp32


def _int8(read: Rows, shape: tuple[int, int]) -> tuple[Tensor, Tensor]:
    """Symmetric int8 with one scale per row, W ≈ scale_r · q with q in [-127, 127], made a
    chunk of rows at a time (no fp32 temporary of the whole matrix): q [n, in], scale [n]."""
    q, scale = torch.empty(shape, dtype=torch.int8), torch.empty(shape[0])
    for lo in range(0, shape[0], CHUNK):
        rows = read(lo, min(lo + CHUNK, shape[0]))
        least, most = torch.aminmax(rows, dim=1)  # max |w| without a temporary |W|
        part = scale[lo : lo + len(rows)] = (torch.maximum(-least, most) / 127).clamp(min=1e-12)
        q[lo : lo + len(rows)] = torch.div(rows, part[:, None]).round_()
    return q, scale


def _qint8(q: Tensor, scale: Tensor) -> Tensor:
    """int8 rows and their scales as the quantized tensor fbgemm's int8 kernel packs."""
    zero = torch.zeros(len(q), dtype=torch.long)
    with warnings.catch_warnings():  # quantized tensors are the only way into fbgemm's int8
        warnings.simplefilter("ignore", UserWarning)
        return torch._make_per_channel_quantized_tensor(q, scale.double(), zero, 0)


def _converted(read: Rows, shape: tuple[int, int], dtype: torch.dtype) -> Tensor:
    """The matrix in `dtype`, converted a chunk of rows at a time."""
    out = torch.empty(shape, dtype=dtype)
    for lo in range(0, shape[0], CHUNK):
        out[lo : lo + CHUNK] = read(lo, min(lo + CHUNK, shape[0]))
    return out


def _stacked(maps: list[tuple[Tensor, Tensor | None]]) -> Tensor:
    """W_i [in, out_i] -> [sum out_i, in]; one map's W^T without a copy when it is contiguous
    so (a tied head's E^T is E)."""
    if len(maps) == 1:
        return maps[0][0].detach().t()
    return torch.cat([W.detach().t() for W, _ in maps])


def check_format(fmt: str, device: torch.device) -> None:
    """A one-line reason when `fmt` cannot run here."""
    if fmt not in FORMATS:
        raise ValueError(f"dtype must be one of {', '.join(FORMATS)}; got {fmt!r}")
    if fmt in CPU_ONLY and device.type != "cpu":
        raise ValueError(f"{fmt} inference runs on the CPU only")
    fbgemm = "fbgemm" in torch.backends.quantized.supported_engines
    if device.type == "cpu" and wider(fmt) in ("float16", "int8") and not fbgemm:
        raise ValueError(f"{fmt} inference needs PyTorch's fbgemm kernels (x86 CPUs)")


def can_prepack_float32(device: torch.device) -> bool:
    return device.type == "cpu" and torch.backends.mkldnn.is_available()
