"""fp32 products on the parameters themselves: one row's (tlm's own loops, else numpy's BLAS),
and a prompt's rows (tlm's panels where the library has them, else torch's product).

A decoding step multiplies one row per sequence by every weight matrix, so its speed is
set by how fast the weights stream from memory. Both routes here read the model's own
parameters in their own [in, out] layout (a tied head's E^T as E's rows): nothing is
copied, and a model that trains on afterwards is still right at the next step.

- `products.c` (`float32_rows`, `float32_dots`), where the library is built with OpenMP:
  each of torch's threads streams its share of W's rows front to back into a partial sum.
  It reads at 31 GB/s where numpy's BLAS reads at 26 on the GPT-2 124M shape
  (docs/benchmarks-history.md, "Decoding without per-token overhead"), and runs on torch's own
  threads, so torch keeps them for everything else.
- numpy's BLAS (OpenBLAS in numpy's wheels) otherwise; PyTorch's few-row product (MKL)
  reaches 50-60% of the read bandwidth on the CPUs we measured. numpy keeps a thread pool
  of its own, and on a machine with few cores a pool that waits for work while the other
  one runs slows both by up to 4x; so while a one-row pass runs its products through
  numpy, torch's ops run on one thread (`threads.on_threads(1)`, which the forward pass
  and the decoder's step apply where `needs_one_thread()`).

A prompt's rows (2 to `PANEL_ROWS` of them) take `products.c`'s `float32_panels` where
the library is an AVX2 build (and the one row of its last position's head, the loops
above): each thread copies 16 columns of W at a time into its cache
and runs every row against them six rows at a time: every product of a 60-token prefill
of the GPT-2 124M shape in 104-124 ms against torch's 130-163 (2-core AVX2 host; equal at
512 rows, docs/benchmarks-history.md). An AVX-512 build keeps torch's product, whose kernels use the
wider registers.

`kernels.Float32Linear` chooses these routes; tests hold each equal to torch's product.
"""

from __future__ import annotations

import torch
from torch import Tensor

from tlm.inference import native

PANEL_ROWS = 256  # rows a product takes the panels for (512: no faster than torch's)
PANELS = 8  # products.c's `products_here` bit for float32_panels


def product(x: Tensor, W: Tensor, b: Tensor | None) -> Tensor:
    """x @ W + b: x [..., in] fp32, W [in, out] (any strides) -> [..., out]."""
    rows = x.detach().reshape(-1, x.shape[-1])
    if len(rows) == 1 and native.threaded() and W.dtype == torch.float32:
        y = _own(rows.contiguous(), W.detach(), None if b is None else b.detach())
        if y is not None:
            return y.view(*x.shape[:-1], W.shape[1])
    y = rows.numpy() @ W.detach().numpy()  # [N,in] @ [in,out]
    if b is not None:
        y += b.detach().numpy()
    return torch.from_numpy(y).view(*x.shape[:-1], W.shape[1])


def prompt(x: Tensor, W: Tensor, b: Tensor | None) -> Tensor | None:
    """x @ W + b for a prompt's rows of fp32 on the CPU, W [in, out] in place: one row (the
    last position's head) through the decoding route's loops (`_own`), 2 to `PANEL_ROWS`
    rows through `float32_panels` (W's rows contiguous); None where neither applies (the
    caller then takes torch's product)."""
    rows = x.reshape(-1, x.shape[-1])
    if x.device.type != "cpu" or x.dtype != torch.float32 or W.dtype != torch.float32:
        return None
    rows, W = rows.detach().contiguous(), W.detach()
    b = None if b is None else b.detach().contiguous()
    if len(rows) == 1:
        y = _own(rows, W, b) if native.threaded() else None
    elif len(rows) <= PANEL_ROWS and W.stride(1) == 1 and _panels_here():
        y = _panels(rows, W, b)
    else:
        return None
    return None if y is None else y.view(*x.shape[:-1], W.shape[1])


def _panels(x: Tensor, W: Tensor, b: Tensor | None) -> Tensor:
    (inputs, out), y = W.shape, x.new_empty(len(x), W.shape[1])
    done = native.library().float32_panels(
        W.data_ptr(), W.stride(0), native.address(b), x.data_ptr(), len(x), inputs, out,
        y.data_ptr(),
    )  # fmt: skip
    if done:
        raise MemoryError(f"no memory for the panels of a [{inputs}, {out}] product")
    return y


def _panels_here() -> bool:
    return native.threaded() and bool(native.library().products_here() & PANELS)


def _own(x: Tensor, W: Tensor, b: Tensor | None) -> Tensor | None:
    """One row through products.c: W's rows (stride(1) == 1) or, for a transposed view,
    the rows of the matrix it views (a tied head's E); None for other strides."""
    (inputs, out), lib, y = W.shape, native.library(), x.new_empty(1, W.shape[1])
    if b is not None and not b.is_contiguous():
        b = b.contiguous()
    if W.stride(1) == 1:
        kernel, ld = lib.float32_rows, W.stride(0)
    elif W.stride(0) == 1:
        kernel, ld = lib.float32_dots, W.stride(1)
    else:
        return None
    if kernel(W.data_ptr(), ld, native.address(b), x.data_ptr(), 1, inputs, out, y.data_ptr(), out):
        raise MemoryError(f"no memory for the partial sums of a [{inputs}, {out}] product")
    return y


def needs_one_thread() -> bool:
    """Whether one row's products go through numpy (whose pool then has the cores)."""
    return not native.threaded()
