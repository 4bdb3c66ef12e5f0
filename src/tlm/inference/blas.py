"""One row's fp32 products through numpy's BLAS, with torch's ops on one thread meanwhile.

A decoding step multiplies one row per sequence by every weight matrix, so its speed is
set by how fast the weights stream from memory. On the CPUs we measured, numpy's BLAS
(OpenBLAS in numpy's wheels) reads an fp32 matrix in the model's own [in, out] layout at
about 90% of the machine's read bandwidth, where PyTorch's few-row product (MKL) reaches
50-60% and oneDNN's prepacked one 70-75% and a second copy of the weights
(docs/benchmarks.md, "Decoding"). numpy reads the parameters' own memory: nothing is
copied, and a model that trains on afterwards is still right at the next step.

The two libraries keep separate thread pools, and on a machine with few cores a pool that
waits for work while the other one runs slows both by up to 4x. So while a one-row pass
runs its products through numpy, torch's ops (LayerNorm, attention over one query, the
residual adds) run on one thread (`torch_on_one_thread`); they are small, and the BLAS
uses every core for the products. `kernels.Float32Linear` chooses this route for one row;
the result is the same product, and tests hold the paths equal.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import Tensor


def product(x: Tensor, W: Tensor, b: Tensor | None) -> Tensor:
    """x @ W + b in numpy: x [..., in] fp32, W [in, out] (any strides) -> [..., out]."""
    y = x.detach().reshape(-1, x.shape[-1]).numpy() @ W.detach().numpy()  # [N,in] @ [in,out]
    if b is not None:
        y += b.detach().numpy()
    return torch.from_numpy(y).view(*x.shape[:-1], W.shape[1])


@contextmanager
def torch_on_one_thread() -> Iterator[None]:
    """torch's pool at one thread for the block (numpy's BLAS has the cores), then back."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
