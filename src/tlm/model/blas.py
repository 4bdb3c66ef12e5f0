"""Decoding on a CPU: the weight products through numpy's BLAS, torch's own ops on one thread.

A decoding step multiplies one row per sequence by every weight matrix, so its speed is
set by how fast the weights stream from memory. On the CPUs we measured, numpy's BLAS
(OpenBLAS in numpy's wheels) reads an fp32 matrix in the model's own [in, out] layout at
about 90% of the machine's read bandwidth, where PyTorch's few-row product (MKL) reaches
50-60% and oneDNN's prepacked one 70-75% and a second copy of the weights
(docs/benchmarks.md, "Decoding"). numpy reads the parameters' own memory: nothing is
copied, and a model that trains on afterwards is still right at the next step.

The two libraries keep separate thread pools, and on a machine with few cores a pool that
waits for work while the other one runs slows both by up to 4x. So while a step runs
through numpy, torch's ops (LayerNorm, attention over one query, the residual adds) run
on one thread; they are small, and the BLAS uses every core for the products.

`decoding(model, rows)` wraps a step that feeds one new token to each of `rows` sequences.
With one row it switches this on, on the thread that entered it, for a fp32 model on the
CPU; `functional.linear` reads `active()`. A step of several rows stays on torch: numpy's
BLAS repacks the weights for a product of 2 to 32 rows and runs at half the speed of
oneDNN's prepacked kernel there, which a model prepared by `for_inference("float32")`
uses inside such a step (`batched()`; `model/packed.py`). A model packed by
`for_inference` into float16 or int8 runs fbgemm's kernels on torch's threads instead and
is left as it is. The result is the same product: tests hold the paths equal.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import Tensor, nn

_state = threading.local()


def active() -> bool:
    """True inside `decoding` of one row (on this thread) and while autograd is off."""
    return getattr(_state, "on", False) and not torch.is_grad_enabled()


def batched() -> bool:
    """True inside `decoding` of several rows (on this thread) and while autograd is off."""
    return getattr(_state, "batch", False) and not torch.is_grad_enabled()


def applies(model: nn.Module) -> bool:
    """An fp32 model on the CPU, plain or prepared by `for_inference("float32")`."""
    weight = next(model.parameters())
    cpu32 = weight.device.type == "cpu" and weight.dtype == torch.float32
    return cpu32 and getattr(model, "inference_format", None) in (None, "float32")


@contextmanager
def decoding(model: nn.Module, rows: int) -> Iterator[None]:
    """No autograd, for a step that feeds one token to each of `rows` sequences; for a
    model that `applies`, one row's products go through numpy's BLAS, and several rows'
    are `batched()`."""
    with torch.no_grad():
        busy = getattr(_state, "on", False) or getattr(_state, "batch", False)
        if busy or not applies(model):
            yield
            return
        if rows > 1:
            _state.batch = True
            try:
                yield
            finally:
                _state.batch = False
            return
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        _state.on = True
        try:
            yield
        finally:
            _state.on = False
            torch.set_num_threads(threads)


def product(x: Tensor, W: Tensor, b: Tensor | None) -> Tensor:
    """x @ W + b in numpy: x [..., in] fp32, W [in, out] (any strides) -> [..., out]."""
    y = x.detach().reshape(-1, x.shape[-1]).numpy() @ W.detach().numpy()  # [N,in] @ [in,out]
    if b is not None:
        y += b.detach().numpy()
    return torch.from_numpy(y).view(*x.shape[:-1], W.shape[1])
