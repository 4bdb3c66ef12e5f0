"""Causal attention for training on a CPU: tlm's C kernels (`attention.c`, `attention32.c`).

Under CPU autocast, `attention_fused` runs PyTorch's CPU kernel in fp32 on the bf16-rounded
q, k, v (its bf16 kernel is slower still): ~56 GFLOP/s, a sixth of the bf16 products' rate,
and a quarter of nanoGPT's 6-layer step (docs/benchmarks-history.md). `attention.c` computes the
same equations with AVX512_BF16's dot products, adding in fp32: the scores, the softmax, the
output and every gradient stay fp32, and only the pattern α and its gradient are rounded to
bf16 to enter their products. `attention32.c` computes them all in fp32 with the vector
width the compiler has (AVX2, AVX-512, NEON): an fp32 run, what `--precision auto` trains on
a CPU without bf16 units. `causal_attention` takes the place of `attention_fused`
(`model.attention.use_attention_kernel`; `train/opening.py` sets it for training on a CPU)
and runs a kernel where one applies: a CPU under bf16 autocast (a library built with
AVX512_BF16) or fp32 q, k, v without autocast, the whole causal window (T == S, no mask, no
dropout; an attention window W is the kernel's own: each query's keys start at i - W + 1),
d_head a multiple of 32, T <= 2048, not inside torch.compile. Everything else
goes to `attention_fused`. `tests/test_attention_kernel.py` holds both equal to
`attention_reference`."""

from __future__ import annotations

import torch
from torch import Tensor

from tlm.inference.native import library
from tlm.model.attention import attention_fused

LONGEST = 2048  # positions: a head's T x T buffers stay within 24 MB (bf16: three, fp32: one)


def kernel_here(dtype: torch.dtype = torch.bfloat16) -> bool:
    """Whether this host's library has the attention kernel for `dtype`: fp32 wherever it
    was compiled, bf16 with AVX512_BF16."""
    lib = library()
    return lib is not None and (dtype == torch.float32 or lib.attention_here() == 1)


def causal_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    window: int | None = None,
) -> Tensor:
    """`attention_fused`'s arguments and result [B,H,T,d_head]: tlm's kernel where it
    applies (see the module's docstring; with an attention window too), `attention_fused`
    elsewhere."""
    dtype = _precision(q)
    if dtype is not None and _applies(q, k, mask, dropout_p, is_causal, dtype):
        return torch.ops.tlm.causal_attention(*_alike(q, k, v, dtype), window or 0)[0]
    return attention_fused(q, k, v, mask, dropout_p, is_causal, window)


def _precision(q: Tensor) -> torch.dtype | None:
    """The kernel's precision for q: bf16 under CPU bf16 autocast, fp32 for fp32 q without
    autocast, else None (no kernel)."""
    if torch.is_autocast_enabled("cpu"):
        return torch.bfloat16 if torch.get_autocast_dtype("cpu") == torch.bfloat16 else None
    return torch.float32 if q.dtype == torch.float32 else None


def _applies(
    q: Tensor, k: Tensor, mask: Tensor | None, dropout_p: float, causal: bool, dtype: torch.dtype
) -> bool:
    T, d_head = q.shape[-2], q.shape[-1]
    return (
        causal
        and mask is None
        and dropout_p == 0.0
        and q.device.type == "cpu"
        and q.dim() == 4
        and q.shape == k.shape
        and d_head % 32 == 0
        and 1 < T <= LONGEST
        and not torch.compiler.is_compiling()
        and kernel_here(dtype)
    )


# Two torch operators (`torch.ops.tlm.*`), so that autograd, torch's profiler and a
# TorchDispatchMode (bench/_anatomy.py) see the kernel as one call each way.
@torch.library.custom_op("tlm::causal_attention", mutates_args=())
def _forward(q: Tensor, k: Tensor, v: Tensor, window: int) -> tuple[Tensor, Tensor]:
    """(O [B,H,T,d_head] fp32, each query's log-sum-exp of its scores [B,H,T]) from q, k, v
    of one layout, all bf16 or all fp32: softmax(mask(QKᵀ/√d_k))V (eq. 9.11-9.13), each
    query seeing the `window` keys up to its own (0: all of them)."""
    B, H, T, d_head = q.shape
    o, lse = _heads(B, H, T, d_head), torch.empty(B, H, T, dtype=torch.float32)
    status = _kernel("forward", q.dtype)(
        q.data_ptr(), k.data_ptr(), v.data_ptr(), B, H, T, d_head, *q.stride()[:3],
        o.data_ptr(), *o.stride()[:3], lse.data_ptr(), window,
    )  # fmt: skip
    _check(status)
    return o, lse


@torch.library.custom_op("tlm::causal_attention_backward", mutates_args=())
def _backward(
    q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, grad: Tensor, window: int
) -> tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv) fp32 from the forward pass's inputs and results and dO, `grad`."""
    if grad.dtype != torch.float32 or grad.stride() != o.stride():
        grad = torch.empty_like(o).copy_(grad)  # dO laid out as O is
    B, H, T, d_head = q.shape
    dq, dk, dv = (_heads(B, H, T, d_head) for _ in range(3))
    status = _kernel("backward", q.dtype)(
        q.data_ptr(), k.data_ptr(), v.data_ptr(), B, H, T, d_head, *q.stride()[:3],
        o.data_ptr(), grad.data_ptr(), *o.stride()[:3], lse.data_ptr(),
        dq.data_ptr(), dk.data_ptr(), dv.data_ptr(), *dq.stride()[:3], window,
    )  # fmt: skip
    _check(status)
    return dq, dk, dv


@_forward.register_fake
def _(q: Tensor, k: Tensor, v: Tensor, window: int) -> tuple[Tensor, Tensor]:
    B, H, T, d_head = q.shape
    return _heads(B, H, T, d_head), q.new_empty(B, H, T, dtype=torch.float32)


@_backward.register_fake
def _(q, k, v, o, lse, grad, window) -> tuple[Tensor, Tensor, Tensor]:
    return tuple(_heads(*q.shape) for _ in range(3))


def _keep(ctx, inputs: tuple, output: tuple) -> None:
    ctx.save_for_backward(*inputs[:3], *output)
    ctx.window = inputs[3]


def _gradients(ctx, grad: Tensor, _lse_grad: Tensor | None) -> tuple:
    dq, dk, dv = torch.ops.tlm.causal_attention_backward(*ctx.saved_tensors, grad, ctx.window)
    return dq, dk, dv, None  # the window has no gradient


_forward.register_autograd(_gradients, setup_context=_keep)


def _alike(q: Tensor, k: Tensor, v: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor]:
    """q, k, v in `dtype` with one set of strides, each row of d_head values contiguous (the
    views `split_heads` makes of three products already are)."""
    q, k, v = (x.to(dtype) for x in (q, k, v))
    if q.stride(-1) != 1 or not q.stride() == k.stride() == v.stride():
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    return q, k, v


def _heads(B: int, H: int, T: int, d_head: int) -> Tensor:
    """An fp32 [B,H,T,d_head] view of a [B,T,H,d_head] tensor: `heads.transpose(1, 2)` in
    the model is then contiguous, and W^O reads it without a copy (eq. 9.19)."""
    return torch.empty(B, T, H, d_head, dtype=torch.float32).transpose(1, 2)


def _kernel(name: str, dtype: torch.dtype):
    """attention.c's function `name` for bf16 q, k, v, attention32.c's for fp32."""
    return getattr(library(), f"attention{'32' if dtype == torch.float32 else ''}_{name}")


def _check(status: int) -> None:
    if status == -2:
        raise MemoryError("attention.c: no memory for a head's buffers")
    if status != 0:
        raise RuntimeError(f"attention.c returned {status}")
