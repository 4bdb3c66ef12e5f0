"""tlm's own int8 and float16 products (inference/formats/blocked.py, products.c) against exact
references: the same quantized or rounded weights multiplied in torch."""

import pytest
import torch

from tlm.inference import native
from tlm.inference.formats import blocked
from tlm.inference.formats.kernels import PackedLinear, _int8

# each instruction set this host runs, at one thread and at two
pytestmark = pytest.mark.usefixtures("kernel_build", "each_thread_count")

SHAPES = [(7, 5), (33, 70), (40, 33), (48, 64), (300, 768)]  # [out, in]: padded, odd, whole
ROWS = [1, 2, 3, 4, 5, 9]  # one row, each group size of products.c, and groups with a rest


def needs(fmt: str) -> None:
    """Skip where this build has no blocked kernel for `fmt` (every x86 build with AVX2 has)."""
    if not blocked.here(fmt):
        pytest.skip(f"this build ({native.kernels()}) runs {fmt} through fbgemm's kernels")


def operands(shape: tuple[int, int], rows: int, seed: int):
    """W [out, in] of a trained model's size, b [out], x [rows, in]."""
    torch.manual_seed(seed)
    return torch.randn(shape) * 0.05, torch.randn(shape[0]), torch.randn(rows, shape[1])


def int8_reference(x, q, scale, b):
    """sx * scale[o] * sum_i xq_i q_oi + b[o], the integer sums exact (int64), each row of x
    quantized as products.c does: xq = round(x * (127 / max|x|)) in fp32."""
    most = x.abs().amax(dim=1, keepdim=True)
    inv = torch.where(most > 0, torch.tensor(127.0) / most, torch.zeros(()))
    xq = (x * inv).round().long()
    sums = (xq[:, None, :] * q.long()[None]).sum(-1)  # [N, out], exact
    return (most / 127) * scale * sums.float() + b


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("rows", ROWS)
def test_int8_blocks_are_the_exact_integer_product(shape, rows):
    needs("int8")
    W, b, x = operands(shape, rows, seed=rows)
    q, scale = _int8(lambda lo, hi: W[lo:hi], W.shape)
    x = x * 3
    x[0, 1] = 0.0
    got = blocked.Int8Blocks(q, scale, b)(x)
    expected = int8_reference(x, q, scale, b)
    assert got.shape == (rows, shape[0])
    assert torch.allclose(got, expected, rtol=1e-5, atol=1e-5)
    assert (got - x @ W.T - b).abs().max() < 0.05 * (x @ W.T).abs().max()  # the format's error


def test_int8_blocks_of_a_zero_row_give_the_bias():
    needs("int8")
    q, scale = torch.ones(20, 40, dtype=torch.int8), torch.full((20,), 0.5)
    b = torch.arange(20.0)
    got = blocked.Int8Blocks(q, scale, b)(torch.zeros(2, 40))
    assert torch.equal(got, b.expand(2, 20))


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("rows", ROWS)
def test_float_blocks_are_fp32_arithmetic_on_their_weights(dtype, shape, rows):
    needs("float16")  # float16's kernel, reading fp16 or fp32 blocks
    W, b, x = operands(shape, rows, seed=rows)
    got = blocked.FloatBlocks(lambda lo, hi: W[lo:hi], W.shape, b, dtype)(x)
    expected = x.double() @ W.to(dtype).double().T + b.double()
    assert got.shape == (rows, shape[0])
    assert (got.double() - expected).abs().max() < 1e-5
    if dtype == torch.float16:  # fp16 weights, not fp32 ones
        assert (got.double() - (x @ W.T + b).double()).abs().max() > 1e-6


@pytest.mark.skipif(not native.threaded(), reason="the fp32 kernels run where OpenMP does")
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("rows", [1, 2, 3])
def test_fp32_on_the_parameters_is_fp32_arithmetic(shape, rows):
    """products.c's products on the model's own fp32 layouts (the whole step's products
    for up to two rows): x W + b for W [in, out] rows `ld` apart (float32_rows: eight
    inputs a pass and the rest one by one), and for E [out, in] (float32_dots), each
    written into wider rows of y."""
    W, b, x = operands(shape, rows, seed=rows)
    out, inputs = shape
    expected = x.double() @ W.double().T + b.double()
    lib, ld, ldy = native.library(), out + 3, out + 5
    wide = torch.zeros(inputs, ld)
    wide[:, :out] = W.T  # W [in, out] in rows ld apart, as Q inside a joined Q, K, V
    for kernel, weights, stride in ((lib.float32_rows, wide, ld), (lib.float32_dots, W, inputs)):
        y = torch.full((rows, ldy), 7.0)
        kernel(weights.data_ptr(), stride, b.data_ptr(), x.data_ptr(), rows, inputs, out,
               y.data_ptr(), ldy)  # fmt: skip
        assert (y[:, :out].double() - expected).abs().max() < 1e-5
        assert (y[:, out:] == 7.0).all()  # nothing written past each row's outputs


@pytest.mark.parametrize("fmt", ["int8", "float16"])
def test_rows_together_equal_rows_alone(fmt):
    """A batch's rows do not change each other's outputs (the C kernels reuse each line of
    weights for up to four rows)."""
    needs(fmt)
    torch.manual_seed(0)
    W = torch.randn(100, 96) * 0.05
    kernel = PackedLinear(W, torch.randn(100), fmt)
    x = torch.randn(11, 96)
    together = kernel(x)
    alone = torch.cat([kernel(x[i : i + 1]) for i in range(len(x))])
    assert torch.allclose(together, alone, atol=1e-6)


def test_packed_linear_takes_the_blocked_kernels_where_they_run():
    W = torch.randn(32, 16)
    for fmt, kind in (("int8", blocked.Int8Blocks), ("float16", blocked.FloatBlocks)):
        assert isinstance(PackedLinear(W, None, fmt).kernel, kind) == blocked.here(fmt)


def test_a_wrong_input_width_is_refused():
    needs("float16")
    kernel = blocked.FloatBlocks(lambda lo, hi: torch.ones(hi - lo, 8), (4, 8), None)
    with pytest.raises(ValueError, match=r"expected x \[N, 8\]"):
        kernel(torch.ones(2, 9))
