"""One layer's training attention, forward and backward, four ways side by side (issue 33).

tlm's kernels through `causal_attention`: in bf16 (`inference/native/attention.c`, under bf16
autocast, as a bf16 training step runs it; hosts with AVX512_BF16 only) and in fp32
(`attention32.c`, as an fp32 step runs it); PyTorch's CPU kernel in fp32 on the same
bf16-rounded q, k, v (what `attention_fused` runs in an fp32 step and under CPU autocast,
and tlm ran before), and PyTorch's kernel in bf16. q, k and v are views of one
[B,T,3,H*d_head] tensor, as a model's three products and `split_heads` make them. The four
alternate in rounds; each figure is the best of `repeats` calls in a round, and every round
is printed (the host's speed moves between minutes). FLOPs: the causal half of the four
T×T×d_head products of the backward pass, the two of the forward pass, and the scores
computed again in the backward pass.
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from tlm.train.attention_kernel import causal_attention, kernel_here

SHAPES = {  # name: (B, H, T, d_head)
    "nanoGPT's 6-layer shape": (16, 6, 256, 64),
    "nanoGPT's recipe shape": (12, 4, 64, 32),
    "budget25's shape": (12, 2, 64, 64),
    "GPT-2's heads, T 1024": (2, 12, 1024, 64),
}


def timed(kind: str, q, k, v, grad) -> tuple[float, float]:
    """(forward, backward) seconds of one call of `kind`: "tlm bf16", "tlm fp32", "fp32"
    or "bf16" (PyTorch's kernel)."""
    dtype = torch.float32 if kind.endswith("fp32") else torch.bfloat16
    inputs = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
    started = time.perf_counter()
    if kind == "tlm bf16":
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = causal_attention(*inputs, is_causal=True)
    elif kind == "tlm fp32":
        out = causal_attention(*inputs, is_causal=True)
    else:
        out = F.scaled_dot_product_attention(*inputs, is_causal=True)
    middle = time.perf_counter()
    out.backward(grad.to(out.dtype))
    return middle - started, time.perf_counter() - middle


def compare(rounds: int = 3, repeats: int = 5) -> None:
    if not kernel_here(torch.float32):
        print("attention: no C compiler, so no tlm kernel; nothing to compare")
        return
    kinds = ("tlm bf16", "tlm fp32", "fp32", "bf16") if kernel_here() else ("tlm fp32", "fp32")
    for name, (B, H, T, d_head) in SHAPES.items():
        x = torch.randn(B, T, 3, H * d_head).bfloat16()
        q, k, v = (x[:, :, i].view(B, T, H, d_head).transpose(1, 2) for i in range(3))
        grad = torch.randn(B, H, T, d_head)
        gflop = B * H * T * (T + 1) / 2 * d_head * 2 * 7 / 1e9  # 7 causal products
        for kind in kinds:
            timed(kind, q, k, v, grad)  # warm up (and compile the library)
        for round_ in range(rounds):
            figures = []
            for kind in kinds:
                calls = [timed(kind, q, k, v, grad) for _ in range(repeats)]
                forward, backward = min(c[0] for c in calls), min(c[1] for c in calls)
                rate = gflop / (forward + backward)
                figures.append(
                    f"{kind} {forward * 1e3:.1f} + {backward * 1e3:.1f} ms ({rate:.0f} GFLOP/s)"
                )
            print(f"{name} (B {B}, H {H}, T {T}, d_head {d_head}), round {round_ + 1}: "
                  + "; ".join(figures))  # fmt: skip
