"""q8_0 (`tlm.inference.formats.q8`, `q4.c`'s kernel): llama.cpp's Q8_0 rounding and bytes,
the kernel exact where the numbers allow (test_q4.py holds it, and a model in q8_0, to its
reference beside q4_0's), the embedding rows, and llama.cpp's rounding of activations."""

import gguf
import numpy as np
import pytest
import torch

from tlm.inference.formats import kernels, q4, q8

# each instruction set this host runs, at one thread and at two
pytestmark = pytest.mark.usefixtures("kernel_build", "each_thread_count")


def needs_kernel() -> None:
    if not q4.here():
        pytest.skip("no kernel of blocks of 32 in this host's library (no AVX2, or no OpenMP)")


def weights(rows: int, inputs: int) -> torch.Tensor:
    """Random rows with a block of zeros, a block of one value, a block of halves (rounded
    away from zero), and a large outlier."""
    torch.manual_seed(0)
    W = torch.randn(rows, inputs)
    W[0, :32] = 0
    W[1, 32:64] = 0.25
    W[2, :32] = torch.arange(32) - 15.5  # halves, but d = 15.5 / 127: they fall between levels
    W[3, :32] = 0
    W[3, :4] = torch.tensor([127.0, 2.5, -3.5, 0.5])  # d = 1: halves, rounded away from zero
    W[4, 50] = 9.0
    return W


def test_quantize_writes_ggufs_bytes():
    """d in fp16 then the 32 q of each block are the `gguf` package's Q8_0 bytes, and its
    dequantization is ours."""
    W = weights(8, 96)
    q, d = q8.quantize(W)
    ours = np.concatenate(
        [d.numpy().view(np.uint8).reshape(8, 3, 2), q.numpy().view(np.uint8).reshape(8, 3, 32)],
        axis=-1,
    )
    theirs = gguf.quants.quantize(W.numpy(), gguf.GGMLQuantizationType.Q8_0)
    assert np.array_equal(ours.reshape(8, -1), theirs)
    back = gguf.quants.dequantize(theirs, gguf.GGMLQuantizationType.Q8_0)
    assert np.array_equal(q8.dequantize(q, d).numpy(), back)


def test_exact_integers():
    """Weights that are integers with each block's largest 127 (d = 1) and activations the
    same (dx = 1): every product is an integer, and the kernel's is exact, signs and all,
    for three rows of x and for one (which takes its own path)."""
    needs_kernel()
    torch.manual_seed(1)
    W = torch.randint(-127, 128, (40, 64)).float()
    W[:, ::32] = -127  # each block's max |w|
    x = torch.randint(-127, 128, (3, 64)).float()
    x[:, ::32] = 127
    kernel = q8.Q8Blocks(lambda lo, hi: W[lo:hi], W.shape, None)
    assert torch.equal(kernel(x), x @ W.t())
    assert torch.equal(kernel(x[:1]), x[:1] @ W.t())  # one row: the kernel's own path
    assert torch.equal(q8.reference(x, *kernel.unpacked(), None), x @ W.t())


def test_embedding_rows_are_the_blocks_values():
    """`PackedRows` in q8_0 looks up each row as its blocks dequantize (d = 70: the last
    block of 6 values padded)."""
    E = weights(12, 70)
    rows = kernels.PackedRows(E, "q8_0")
    ids = torch.tensor([[3, 0, 11], [2, 2, 1]])
    q, d = q8.quantize(torch.nn.functional.pad(E, (0, 26)))
    assert torch.equal(rows(ids), q8.dequantize(q, d)[:, :70][ids])


def test_the_activations_are_llama_cpps_x86_q8_0():
    """Activations (the kernels' x) are quantized as llama.cpp's x86 quantize_row_q8_0 does
    (xq = round(x 127 / max|x|), halves to even), weights as its quantize_row_q8_0_ref and
    the gguf package do (xq = round(x / d), halves away from zero): with max|x| = 127 the
    halves tell them apart, and the kernel's product follows the activations' rule."""
    x = torch.zeros(1, 32)
    x[0, :5] = torch.tensor([127.0, 2.5, 3.5, -2.5, 0.5])
    activations, dx = q4._q8_0(x, 32)
    weights, d = q4._q8_0(x, 32, weights=True)
    assert activations[0, 0, :5].tolist() == [127, 2, 4, -2, 0] and dx.item() == 1
    assert weights[0, 0, :5].tolist() == [127, 3, 4, -3, 1] and d.item() == 1
    needs_kernel()
    W = torch.zeros(16, 32)
    W[0, 1], W[0, 0] = 1.0, 127.0  # y = 127 x_0 + x_1 on the quantized x: d = 1
    y = q8.Q8Blocks(lambda lo, hi: W[lo:hi], W.shape, None)(x)
    assert y[0, 0].item() == 127 * 127 + 2
