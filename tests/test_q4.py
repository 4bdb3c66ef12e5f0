"""q4_0 and q4_k (`tlm.inference.formats.q4`, `q4.c`'s kernels): llama.cpp's rounding, each
kernel held to its PyTorch reference (exact integers where the numbers allow), and a model in
each format end to end."""

import gguf
import numpy as np
import pytest
import torch

from tlm.inference import for_inference
from tlm.inference.formats import q4, q8

# each instruction set this host runs, at one thread and at two
pytestmark = pytest.mark.usefixtures("kernel_build", "each_thread_count")


def needs_kernel() -> None:
    if not q4.here():
        pytest.skip("no q4_0 kernel in this host's library (no AVX2, or no OpenMP)")


def weights(rows: int, inputs: int) -> torch.Tensor:
    """Random rows with the cases the rounding must get right: a block of zeros, a block
    whose largest magnitude is taken by +m and -m (the first wins), a block of one value."""
    torch.manual_seed(0)
    W = torch.randn(rows, inputs)
    W[0, :32] = 0
    W[1, :32] = torch.linspace(-1, 1, 32)  # -1 first, then 1: d = -1 / -8
    W[1, 5] = 3.0
    W[1, 9] = -3.0
    W[2, 32:64] = 0.25
    return W


def test_quantize_writes_ggufs_bytes():
    """q and d as llama.cpp lays them out (d in fp16, then q[j] | q[j + 16] << 4) are the
    `gguf` package's Q4_0 bytes, block for block."""
    W = weights(8, 96)
    q, d = q4.quantize(W)
    blocks = q.view(8, 3, 2, 16)
    nibbles = (blocks[:, :, 0] | (blocks[:, :, 1] << 4)).numpy()  # [8, 3, 16]
    ours = np.concatenate([d.numpy().view(np.uint8).reshape(8, 3, 2), nibbles], axis=-1)
    theirs = gguf.quants.quantize(W.numpy(), gguf.GGMLQuantizationType.Q4_0)
    assert np.array_equal(ours.reshape(8, -1), theirs)
    back = gguf.quants.dequantize(theirs, gguf.GGMLQuantizationType.Q4_0)
    assert np.array_equal(q4.dequantize(q, d).numpy(), back)


BLOCKS = {"q4_0": (q4, q4.Q4Blocks), "q8_0": (q8, q8.Q8Blocks)}  # a scale a block of 32


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 9])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("fmt", BLOCKS)
def test_the_kernel_is_the_reference(rows, bias, fmt):
    """37 outputs (a last block of 5), 80 inputs (a last input block of 16, padded): the
    kernel's product is the reference's to fp32 rounding, for 1 to 9 rows (q4_0 and q8_0)."""
    needs_kernel()
    module, blocks = BLOCKS[fmt]
    W, b = weights(37, 80), torch.randn(37) if bias else None
    kernel = blocks(lambda lo, hi: W[lo:hi], W.shape, b)
    x = torch.randn(rows, 80) * 3
    expected = module.reference(x, *kernel.unpacked(), b)
    got = kernel(x)
    assert torch.allclose(got, expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())


@pytest.mark.parametrize("fmt", BLOCKS)
def test_the_layout_keeps_every_weight(fmt):
    """The kernel's layout unpacks to what `quantize` made (rows past 16, inputs past 32:
    the last block padded with zeros)."""
    module, blocks = BLOCKS[fmt]
    W = weights(37, 80)
    q, d = blocks(lambda lo, hi: W[lo:hi], W.shape, None).unpacked()
    q_expected, d_expected = module.quantize(torch.nn.functional.pad(W, (0, 16)))
    assert torch.equal(q, q_expected) and torch.equal(d, d_expected)


def test_exact_integers():
    """Weights that are levels of d = 1/2 (each block's largest -4, so that d comes back
    exactly) and activations that are integers up to 127 (dx = 1): every sum is an
    integer or a half, and the kernel's product is exact."""
    needs_kernel()
    torch.manual_seed(1)
    levels = torch.randint(0, 16, (40, 64))
    levels[:, ::32] = 0  # -8: each block's largest magnitude
    W = (levels.float() - 8) / 2
    x = torch.randint(-127, 128, (3, 64)).float()
    x[:, ::32] = 127  # each block's max |x|: dx = 1 exactly
    kernel = q4.Q4Blocks(lambda lo, hi: W[lo:hi], W.shape, None)
    assert torch.equal(kernel(x), x @ W.t())
    assert torch.equal(q4.reference(x, *kernel.unpacked(), None), x @ W.t())


@pytest.mark.parametrize(
    "fmt, position, worst",
    [("q4_0", "rope", 0.3), ("q4_0", "learned", 0.3), ("q8_0", "learned", 0.03)],
)
def test_a_model_in_the_format_is_its_reference(make_model, monkeypatch, fmt, position, worst):
    """A model for inference in q4_0 or q8_0: its block products are the format's blocks, and
    its head and token lookup q8_0 (`kernels.wider`); its logits and greedy tokens (the C step
    where it runs) are those of the same model whose products run the PyTorch references;
    and its logits stay near fp32's (8.5 or 4.5 bits a weight)."""
    needs_kernel()
    model = make_model(position=position, bias=True)
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.1)
    state, ids = model.state_dict(), torch.randint(0, 97, (2, 12))
    with torch.no_grad():
        plain = model(ids)
    fast = for_inference(model, fmt)
    assert isinstance(fast.blocks[0].ffn.up_kernel.kernel, BLOCKS[fmt][1])
    assert isinstance(fast.head.kernel, q8.Q8Blocks) and fast.embedding.lookup.fmt == "q8_0"
    monkeypatch.setattr(q4, "here", lambda: False)
    slow = make_model(position=position, bias=True)
    slow.load_state_dict(state)
    slow = for_inference(slow, fmt)
    assert not slow.blocks[0].ffn.up_kernel.kernel.native and not slow.head.kernel.native
    with torch.no_grad():
        got, expected = fast(ids), slow(ids)
    assert torch.allclose(got, expected, atol=1e-4)
    assert 1e-4 < (got - plain).abs().max() < worst
    start, settings = ids[:, :4], {"max_new_tokens": 8}
    assert torch.equal(fast.generate(start, **settings), slow.generate(start, **settings))


@pytest.mark.parametrize("rows", [1, 2, 4, 5, 9])
@pytest.mark.parametrize("bias", [True, False])
def test_the_q4_k_kernel_is_its_reference(rows, bias):
    """37 outputs (a last block of 5), 512 inputs (two super-blocks): the q4_k kernel's
    product is `reference_k`'s to fp32 rounding; the layout unpacks to the quantizer's."""
    from tlm.interop import q4k

    needs_kernel()
    W, b = weights(37, 512) * 0.1, torch.randn(37) if bias else None
    kernel = q4.Q4KBlocks(lambda lo, hi: W[lo:hi], W.shape, b)
    assert all(torch.equal(a, e) for a, e in zip(kernel.unpacked(), q4k.quantize(W), strict=True))
    x = torch.randn(rows, 512) * 3
    expected = q4.reference_k(x, kernel.unpacked(), b)
    got = kernel(x)
    assert torch.allclose(got, expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())


def test_a_model_in_q4_k_takes_q4_0_where_rows_are_short(make_model, monkeypatch):
    """d_model 256: every product's rows are whole super-blocks of 256 (all Q4_K); d_model 64:
    only W_2's (d_ff 256), the rest q4_0, as llama.cpp falls back; either way the logits are
    those of the PyTorch references, and the greedy tokens the same."""
    needs_kernel()
    for d_model, d_ff in ((256, 1024), (64, 256)):
        model = make_model(d_model=d_model, d_ff=d_ff, bias=True)
        for p in model.parameters():
            torch.nn.init.normal_(p, std=0.1)
        state, ids = model.state_dict(), torch.randint(0, 97, (2, 10))
        fast = for_inference(model, "q4_k")
        kinds = {
            type(fast.blocks[0].attn.qkv_kernel.kernel),
            type(fast.blocks[0].ffn.down_kernel.kernel),
        }
        assert kinds == ({q4.Q4KBlocks} if d_model == 256 else {q4.Q4Blocks, q4.Q4KBlocks})
        with monkeypatch.context() as m:
            m.setattr(q4, "here", lambda: False)
            slow = make_model(d_model=d_model, d_ff=d_ff, bias=True)
            slow.load_state_dict(state)
            slow = for_inference(slow, "q4_k")
        with torch.no_grad():
            assert torch.allclose(fast(ids), slow(ids), atol=1e-4)
        start, settings = ids[:, :3], {"max_new_tokens": 6}
        assert torch.equal(fast.generate(start, **settings), slow.generate(start, **settings))


def test_the_block_formats_run_on_the_cpu_only():
    """q8_0, q4_0 and q4_k: decided from the device (no GPU needed), in one line; `--device
    auto` keeps them on the CPU on a machine with a GPU (`device.CPU_ONLY`)."""
    from tlm.device import CPU_ONLY
    from tlm.inference import check_format

    for fmt in ("q8_0", "q4_0", "q4_k"):
        assert fmt in CPU_ONLY
        with pytest.raises(ValueError, match=f"^{fmt} inference runs on the CPU only$"):
            check_format(fmt, torch.device("cuda"))
        check_format(fmt, torch.device("cpu"))
