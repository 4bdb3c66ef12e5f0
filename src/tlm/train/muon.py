"""Muon (Jordan et al. 2024) with its Newton-Schulz iteration in a dtype the device computes fast.

Muon updates a weight matrix by the orthogonalised momentum of its gradient: with momentum
M = U S Vᵀ, the step is along U Vᵀ, every singular direction moved alike. Five steps of a
quintic Newton-Schulz iteration approximate U Vᵀ (the coefficients push the singular values
towards 1 quickly rather than exactly; Jordan et al.).

`torch.optim.Muon` runs that iteration in bfloat16, which a CPU without bf16 units (AVX2)
computes ~7x slower than fp32: on the 4-layer d = 128 model it made a training step 60%
slower than AdamW's. This class is the same optimizer (its state, groups and arguments) with
the iteration in fp32 on a CPU and in bf16 on a GPU; a test holds it equal to torch's step
for step in bf16.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor


def orthogonalize(
    G: Tensor, coefficients: tuple[float, float, float], steps: int, eps: float, dtype: torch.dtype
) -> Tensor:
    """Approximately U Vᵀ for each G = U S Vᵀ in G [m, n] or [k, m, n], by `steps` quintic
    Newton-Schulz steps (a stack of k matrices runs as one batch of products)."""
    a, b, c = coefficients
    X = G.to(dtype)
    tall = G.size(-2) > G.size(-1)
    if tall:
        X = X.mT  # iterate on the wide side: X Xᵀ is the smaller Gram matrix
    X = X / X.norm(dim=(-2, -1), keepdim=True).clamp(min=eps)  # spectral <= Frobenius = 1
    mul_add = torch.addmm if X.dim() == 2 else torch.baddbmm  # β·input + α·(m1 @ m2)
    for _ in range(steps):
        A = X @ X.mT  # [.., m,n] @ [.., n,m] -> [.., m,m]
        B = mul_add(A, A, A, beta=b, alpha=c)  # b A + c A²
        X = mul_add(X, B, X, beta=a)  # a X + B X: X ← a X + b (XXᵀ) X + c (XXᵀ)² X
    return X.mT if tall else X


def adjusted_lr(lr: float, rule: str | None, shape: torch.Size) -> float:
    """The step size per matrix shape [A, B]: "original" √max(1, A/B) (Jordan et al.), or
    "match_rms_adamw" 0.2 √max(A, B), so that the update's RMS matches AdamW's (Liu et al.
    2025) and AdamW's learning rate suits Muon too."""
    A, B = shape[:2]
    if rule is None or rule == "original":
        return lr * math.sqrt(max(1, A / B))
    return lr * 0.2 * math.sqrt(max(A, B))


class Muon(torch.optim.Muon):
    """`torch.optim.Muon`, Newton-Schulz in `ns_dtype` (default: fp32 on a CPU, bf16 else)."""

    def __init__(self, params, ns_dtype: torch.dtype | None = None, **settings) -> None:
        super().__init__(params, **settings)
        self.ns_dtype = ns_dtype

    @torch.no_grad()
    def step(self, closure=None) -> None:
        """Each matrix as torch's step does it, but matrices of one shape are orthogonalised
        as one stack (a small model's 24 matrices are 2 shapes: 30 products a step instead
        of 360), and the momentum and weight updates are one `_foreach` call per group or
        shape instead of one small kernel per matrix."""
        for group in self.param_groups:
            lr, momentum = group["lr"], group["momentum"]
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            grads = [p.grad for p in params]
            buffers = [self._buffer(p) for p in params]
            torch._foreach_lerp_(buffers, grads, 1 - momentum)  # M ← μ M + (1 - μ) G
            updates = (
                torch._foreach_lerp(grads, buffers, momentum) if group["nesterov"] else buffers
            )
            same_shape: dict[tuple, list[int]] = {}
            for i, p in enumerate(params):
                same_shape.setdefault((p.shape, p.device), []).append(i)
            ns = group["ns_coefficients"], group["ns_steps"], group["eps"]
            for (shape, device), chosen in same_shape.items():
                dtype = self.ns_dtype or (torch.float32 if device.type == "cpu" else torch.bfloat16)
                stack = orthogonalize(torch.stack([updates[i] for i in chosen]), *ns, dtype)
                weights = [params[i] for i in chosen]
                torch._foreach_mul_(weights, 1 - lr * group["weight_decay"])  # decoupled decay
                step = -adjusted_lr(lr, group["adjust_lr_fn"], shape)
                torch._foreach_add_(weights, list(stack.unbind(0)), alpha=step)

    def _buffer(self, p: Tensor) -> Tensor:
        state = self.state[p]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(p.grad)
        return state["momentum_buffer"]
