"""tlm's C attention for training on a CPU (`inference/native/attention.c` for bf16,
`attention32.c` for fp32): the same equations as `attention_reference`, forward and
backward, wherever it applies; everything else goes to `attention_fused`; `open_run` puts
it in a CPU run's model."""

import json

import pytest
import torch

from tlm.inference import native
from tlm.model.attention import attention_fused, attention_reference, causal_mask
from tlm.model.window import window_causal_mask
from tlm.train import attention_kernel as kernel
from tlm.train import new_run_configs, open_run
from tlm.train.attention_kernel import causal_attention, kernel_here

HERE = kernel_here()
needs_kernel = pytest.mark.skipif(not HERE, reason="no AVX512_BF16 on this host")
needs_kernel32 = pytest.mark.skipif(not kernel_here(torch.float32), reason="no C compiler")
pytestmark = pytest.mark.usefixtures("each_thread_count")  # at one thread and at two
# the fp32 kernel's tests run on each build this host runs (AVX-512's and AVX2's vectors);
# the bf16 kernel is AVX512_BF16's only
FP32_BUILDS = [pytest.param(b, marks=needs_kernel32, id=b) for b in native.builds_here()]


def heads(B, H, T, d_head, seed=0, strided=True, dtype=torch.bfloat16):
    """q, k, v [B,H,T,d_head], by default bf16 views of one [B,T,3,H*d_head] tensor as a
    model's three products and `split_heads` make them."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(B, T, 3, H * d_head, generator=generator).to(dtype)
    split = [x[:, :, i].view(B, T, H, d_head).transpose(1, 2) for i in range(3)]
    return split if strided else [t.contiguous() for t in split]


def relative(a, b):
    return ((a.float() - b).abs().max() / b.abs().max()).item()


def band(T: int, window: int | None) -> torch.Tensor:
    """The causal mask, or with an attention window its band (model/window.py)."""
    return causal_mask(T, T) if window is None else window_causal_mask(T, T, window)


SHAPES = [(2, 3, 37, 32, True), (2, 1, 5, 64, False), (1, 1, 100, 128, True)]
WINDOWS = [None, 7, 40]  # none; a window of 7 (the 8-row tiles cut); 40 (past a 32-key tile)


@needs_kernel
@pytest.mark.parametrize("B,H,T,d_head,strided", [*SHAPES, (1, 2, 256, 64, True)])
@pytest.mark.parametrize("window", WINDOWS)
def test_the_kernel_is_attention_reference_forward_and_backward(B, H, T, d_head, strided, window):
    """Against the equations in fp32 on the same bf16 q, k, v: the kernel rounds α and its
    gradient to bf16 to enter their products (each ~0.4% at most), so outputs and gradients
    agree within 1.5% of their largest value (seen: 0.13-0.52%); a dropped term is 10-100%.
    With an attention window, each query's keys start at i - W + 1."""
    q, k, v = heads(B, H, T, d_head, strided=strided)
    grad = torch.randn(B, H, T, d_head, generator=torch.Generator().manual_seed(1))
    exact = [t.float().requires_grad_() for t in (q, k, v)]
    expected, _ = attention_reference(*exact, band(T, window))
    expected.backward(grad)
    given = [t.detach().requires_grad_() for t in (q, k, v)]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = causal_attention(*given, is_causal=True, window=window)
    out.backward(grad)
    assert out.dtype == torch.float32 and out.shape == expected.shape
    assert relative(out, expected) < 0.015
    for mine, exact_one in zip(given, exact, strict=True):
        assert mine.grad.dtype == torch.bfloat16  # as the input was
        assert relative(mine.grad, exact_one.grad) < 0.015


@needs_kernel
def test_the_kernel_runs_where_it_applies_and_attention_fused_elsewhere(monkeypatch):
    calls = []
    monkeypatch.setattr(kernel, "_alike", lambda *t: calls.append(1) or t[:3])
    q, k, v = heads(1, 2, 16, 32)
    assert torch.equal(
        causal_attention(q, k, v, is_causal=True), attention_fused(q, k, v, None, 0.0, True)
    )
    with torch.autocast("cpu", dtype=torch.bfloat16):
        causal_attention(q, k, v, causal_mask(16, 16))  # a mask instead of is_causal
        causal_attention(q, k, v, causal_mask(16, 16), is_causal=True)  # a mask beside it
        causal_attention(q, k, v, is_causal=True, dropout_p=0.1)  # dropout
        causal_attention(*heads(1, 2, 16, 16), is_causal=True)  # d_head 16
        assert not calls
        causal_attention(q, k, v, is_causal=True)
        assert calls == [1]


@pytest.mark.parametrize(
    "dtype, build",
    [
        pytest.param(torch.bfloat16, "native", marks=needs_kernel, id="bf16-native"),
        *[
            pytest.param(torch.float32, *b.values, marks=b.marks, id=f"fp32-{b.id}")
            for b in FP32_BUILDS
        ],
    ],
)
def test_the_operators_pass_torchs_checks(dtype, build, monkeypatch):
    """Schema, fake tensors (torch.compile) and the autograd registration of both operators,
    on the bf16 kernel's inputs and the fp32 kernel's."""
    monkeypatch.setenv("TLM_NATIVE_ARCH", build)
    q, k, v = (t.contiguous().requires_grad_() for t in heads(1, 2, 40, 32, dtype=dtype))
    for window in (0, 9):  # every key up to the query's, or the 9 up to it
        torch.library.opcheck(torch.ops.tlm.causal_attention.default, (q, k, v, window))


def count_calls(monkeypatch, owner, name: str) -> list:
    """Replace `owner.name` by a wrapper that records each call's last positional argument
    (the window, for the kernel's operator) and calls the real one: a path ran when its
    list is not empty, on every host kind (never judged by two results differing)."""
    calls, real = [], getattr(owner, name)

    def counted(*args, **kwargs):
        calls.append(args[-1] if args else None)
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, name, counted)
    return calls


def train(docs_chars, out, precision, steps=40, **model):
    values = {"data": str(docs_chars), "out": str(out), "max_steps": steps, "lr": 3e-3}
    values |= {"precision": precision, "batch_size": 8, "log_interval": 5}
    shape = {"n_layers": 2, "d_model": 64, "n_heads": 2, "context_length": 48, **model}
    model_config, train_config, data = new_run_configs(shape, values)
    tokenizer = (docs_chars / "tokenizer.json").read_text()
    trainer = open_run(model_config, train_config, data, tokenizer, progress_bar=False)
    trainer.fit()
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return trainer, [r["train_loss"] for r in rows if "train_loss" in r]


@needs_kernel32
@pytest.mark.usefixtures("kernel_build")
@pytest.mark.parametrize("B,H,T,d_head,strided", [*SHAPES, (1, 2, 64, 64, True)])
@pytest.mark.parametrize("window", WINDOWS)
def test_the_fp32_kernel_is_attention_reference_forward_and_backward(
    B, H, T, d_head, strided, window
):
    """In fp32 every step is fp32: outputs and gradients agree with the equations in fp64
    within 2e-5 of their largest value (seen: 1e-7 to 1e-6); a dropped term is 10-100%. T
    64 is read in place, the others through padded copies. With an attention window, each
    query's keys start at i - W + 1."""
    q, k, v = heads(B, H, T, d_head, strided=strided, dtype=torch.float32)
    grad = torch.randn(B, H, T, d_head, generator=torch.Generator().manual_seed(1))
    exact = [t.double().requires_grad_() for t in (q, k, v)]
    expected, _ = attention_reference(*exact, band(T, window))
    expected.backward(grad.double())
    given = [t.detach().requires_grad_() for t in (q, k, v)]
    out = causal_attention(*given, is_causal=True, window=window)
    out.backward(grad)
    assert out.dtype == torch.float32 and out.shape == expected.shape
    assert relative(out, expected) < 2e-5
    for mine, exact_one in zip(given, exact, strict=True):
        assert mine.grad.dtype == torch.float32
        assert relative(mine.grad, exact_one.grad) < 2e-5


@needs_kernel32
@pytest.mark.usefixtures("kernel_build")
def test_the_fp32_kernel_runs_where_it_applies_and_attention_fused_elsewhere(monkeypatch):
    calls = []
    monkeypatch.setattr(kernel, "_alike", lambda *t: calls.append(t[3]) or t[:3])
    q, k, v = heads(1, 2, 16, 32, dtype=torch.float32)
    causal_attention(q, k, v, causal_mask(16, 16), is_causal=True)  # a mask
    causal_attention(q, k, v, is_causal=True, dropout_p=0.1)  # dropout
    causal_attention(*heads(1, 2, 16, 16, dtype=torch.float32), is_causal=True)  # d_head 16
    causal_attention(q.double(), k.double(), v.double(), is_causal=True)  # fp64
    with torch.autocast("cpu", dtype=torch.float16):
        causal_attention(q, k, v, is_causal=True)  # autocast to another precision
    assert not calls
    causal_attention(q, k, v, is_causal=True)
    assert calls == [torch.float32]


@pytest.mark.parametrize(
    "precision, tolerance, build",
    [
        pytest.param(
            "bfloat16", 0.005, "native", marks=[needs_kernel, pytest.mark.slow], id="bf16-native"
        ),
        *[
            pytest.param("float32", 1e-4, *b.values, marks=b.marks, id=f"fp32-{b.id}")
            for b in FP32_BUILDS
        ],
    ],
)
def test_training_with_the_kernel_follows_pytorchs_kernel(
    docs_chars, tmp_path, monkeypatch, precision, tolerance, build
):
    """A CPU run's model gets the kernel; 40 steps with it and with PyTorch's kernel (same
    seed, same precision) log losses within `tolerance` nats of each other. bf16 (both
    under autocast): seen 4e-5 on two threads, 4e-4 on one; fp32 (the same sums in another
    order): 2e-7 and 3e-7. The gradients' equations are held by the parity tests above."""
    monkeypatch.setenv("TLM_NATIVE_ARCH", build)
    kernel_calls = count_calls(monkeypatch, torch.ops.tlm, "causal_attention")
    fused_calls = count_calls(monkeypatch, kernel, "attention_fused")
    trainer, ours = train(docs_chars, tmp_path / "ours", precision)
    assert trainer.model.blocks[0].attn.fused is causal_attention
    assert kernel_calls and not fused_calls  # the kernel ran, every call
    kernel_calls.clear()
    monkeypatch.setattr(kernel, "kernel_here", lambda dtype: False)
    _, theirs = train(docs_chars, tmp_path / "theirs", precision)
    assert fused_calls and not kernel_calls  # PyTorch's ran, every call
    assert ours[-1] < ours[0] - 0.5  # it learned
    assert max(abs(a - b) for a, b in zip(ours, theirs, strict=True)) < tolerance, (ours, theirs)


@needs_kernel32
def test_a_windowed_run_trains_with_the_kernel(docs_chars, tmp_path, monkeypatch):
    """A rotary model with an attention window of 12 (context 48): fp32 runs with the
    kernel (the band its own) and with PyTorch's (the band as a mask) log losses within
    1e-4 nats, and the kernel ran with the window."""
    windows = count_calls(monkeypatch, torch.ops.tlm, "causal_attention")
    fused_windows = count_calls(monkeypatch, kernel, "attention_fused")
    shape = {"position": "rope", "attention_window": 12}
    _, ours = train(docs_chars, tmp_path / "ours", "float32", steps=20, **shape)
    assert windows and set(windows) == {12} and not fused_windows
    windows.clear()
    monkeypatch.setattr(kernel, "kernel_here", lambda dtype: False)
    _, theirs = train(docs_chars, tmp_path / "theirs", "float32", steps=20, **shape)
    assert fused_windows and set(fused_windows) == {12} and not windows  # the band as a mask
    assert ours[-1] < ours[0] - 0.3
    assert max(abs(a - b) for a, b in zip(ours, theirs, strict=True)) < 1e-4, (ours, theirs)
