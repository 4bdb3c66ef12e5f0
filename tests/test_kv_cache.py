"""The KV cache, left padding and packed weights change nothing but speed."""

import pytest
import torch

from conftest import NORMS, POSITIONS, written_out
from tlm.inference import for_inference
from tlm.inference.formats import blas, blocked, q4, q8
from tlm.model.kv_cache import KVCache

pytestmark = pytest.mark.usefixtures("kernel_build")  # each instruction set this host runs

# every position and norm on the fused path; the written-out path (which test_attention.py
# holds equal to it without a cache) once, for its masks through a cache
CASES = [(p, n, "fused") for p in POSITIONS for n in NORMS] + [("rope", "pre", "reference")]


@pytest.mark.parametrize("position, norm, impl", CASES)
def test_cached_equals_uncached_at_every_step(make_model, position, norm, impl):
    model = make_model(position=position, norm=norm)
    if impl == "reference":
        written_out(model)
    ids = torch.randint(0, 97, (2, 20))
    full = model(ids)  # [B,T,V]: position t predicts token t+1
    cache = KVCache(model.config, batch_size=2)
    steps = [model(ids[:, :6], cache)]  # prefill six positions at once
    steps.append(model(ids[:, 6:10], cache))  # a chunk after cached keys
    steps += [model(ids[:, t : t + 1], cache) for t in range(10, 20)]  # then one at a time
    assert cache.length == 20
    assert torch.allclose(torch.cat(steps, dim=1), full, atol=1e-5)


@pytest.mark.parametrize("position", POSITIONS)
def test_left_padding_changes_no_logit(make_model, position):
    model = make_model(position=position)
    short, long = torch.randint(1, 97, (1, 5)), torch.randint(1, 97, (1, 9))
    batch = torch.zeros(2, 9, dtype=torch.long)  # pad id 0, on the left
    batch[0, 4:], batch[1] = short[0], long[0]
    mask = (torch.arange(9) >= torch.tensor([[4], [0]])).long()  # [B,9]
    padded = model(batch, attention_mask=mask)
    assert torch.allclose(padded[0, 4:], model(short)[0], atol=1e-5)
    assert torch.allclose(padded[1], model(long)[0], atol=1e-5)
    cache = KVCache(model.config, batch_size=2)  # and through the cache, one step after
    model(batch, cache, attention_mask=mask)
    nxt = torch.randint(1, 97, (2, 1))
    step = model(nxt, cache, attention_mask=torch.cat([mask, torch.ones(2, 1).long()], 1))
    assert torch.allclose(step[0], model(torch.cat([short, nxt[:1]], 1))[0, -1:], atol=1e-5)
    assert torch.allclose(step[1], model(torch.cat([long, nxt[1:]], 1))[0, -1:], atol=1e-5)


def test_last_only_is_the_last_row(make_model):
    model = make_model()
    ids = torch.randint(0, 97, (3, 11))
    assert torch.allclose(model(ids, last_only=True), model(ids)[:, -1:], atol=1e-6)


def test_cache_bounds_and_reorder(make_model):
    model = make_model(context_length=32)
    cache = KVCache(model.config, batch_size=2, capacity=8)
    model(torch.randint(0, 97, (2, 8)), cache)
    with pytest.raises(ValueError, match="holds 8 positions"):
        model(torch.randint(0, 97, (2, 1)), cache)
    keys = cache.k.clone()
    cache.reorder(torch.tensor([1, 1]))
    assert torch.equal(cache.k[:, 0], keys[:, 1]) and torch.equal(cache.k[:, 1], keys[:, 1])


# max |Δ log p| (nats) against fp32, measured on this setting over 5 seeds: float32 1e-6,
# float16 1.3e-4, bfloat16 2.1e-3, int8 1.1e-2, q4_0 2.6e-2 (int8's 5e-3 in that run). Each
# format must stay within ~3x its own error, and a lossy one must show at least some error:
# it really ran in that format.
FORMAT_ERROR = {
    "float32": (0, 1e-5),
    "float16": (1e-5, 5e-4),
    "bfloat16": (2e-4, 6e-3),
    "int8": (1e-3, 3e-2),
    "q8_0": (1e-4, 3e-2),
    "q4_0": (5e-3, 0.1),
    "q4_k": (5e-3, 0.1),  # here q4_0 but for W_2 (rows of 256)
}
KERNEL = {  # the op each product runs through once packed (none of them is aten::mm)
    "float32": "mkldnn::_linear_pointwise",
    "float16": "quantized::linear_dynamic_fp16",
    "bfloat16": "aten::linear",
    "int8": "quantized::linear_dynamic",
    "q8_0": "aten::einsum",  # its PyTorch reference (`q8.reference`)
    "q4_0": "aten::einsum",  # its PyTorch reference (`q4.reference`)
    "q4_k": "aten::einsum",
}


def ops_called(model, ids, cache=None) -> tuple[dict[str, int], torch.Tensor]:
    """The ops of one forward pass and its logits; with a cache and one token a row, those
    of a decoding step of len(ids) rows."""
    from torch.profiler import ProfilerActivity, profile

    with torch.no_grad(), profile(activities=[ProfilerActivity.CPU]) as prof:
        logits = model(ids, cache)
    return {e.key: e.count for e in prof.key_averages()}, logits


class BlockedCalls:
    """Counts the products run by tlm's own kernels (`blocked.py`: C code, which the
    profiler does not see)."""

    def __init__(self, monkeypatch) -> None:
        self.count = 0
        kinds = (blocked.Int8Blocks, blocked.FloatBlocks, q4.Q4Blocks, q4.Q4KBlocks, q8.Q8Blocks)
        for kind in kinds:
            monkeypatch.setattr(kind, "__call__", self.counted(kind.__call__))

    def counted(self, call):
        def run(kernel, x):
            self.count += 1
            return call(kernel, x)

        return run


def kernels_of(dtype: str, kernels: str) -> str:
    """The kernels a format's products run on this host: tlm's own ("blocked"), or those
    `KERNEL` names (with `kernels="torch"`, the blocked ones are switched off)."""
    if dtype in ("q8_0", "q4_0", "q4_k"):  # its blocks and its head (q8_0) tlm's
        return "blocked" if q4.here() else pytest.skip("no kernel of blocks of 32")
    return "blocked" if kernels == "own" and blocked.here(dtype) else KERNEL[dtype]


@pytest.mark.parametrize(
    "dtype, kernels",
    [(fmt, "own") for fmt in FORMAT_ERROR]
    + [("float32", "torch"), ("float16", "torch"), ("int8", "torch")],
)
def test_packed_weights_compute_the_same_log_probabilities(make_model, monkeypatch, dtype, kernels):
    if kernels == "torch":
        monkeypatch.setattr(blocked, "here", lambda fmt: False)
        monkeypatch.setattr(blas, "_panels_here", lambda: False)
    kernel, spy = kernels_of(dtype, kernels), BlockedCalls(monkeypatch)
    model = make_model(position="rope", bias=True)
    for p in model.parameters():  # weights of the size a trained model has
        torch.nn.init.normal_(p, std=0.1)
    ids = torch.randint(0, 97, (2, 16))
    with torch.no_grad():
        expected = model(ids).log_softmax(-1)
    packed = make_model(position="rope", bias=True)
    packed.load_state_dict(model.state_dict())
    packed = for_inference(packed, dtype)
    products = 4 * model.config.n_layers + 1  # QKV and W_O, W_1 and W_2 per layer, the head
    with torch.no_grad():
        got = packed(ids).float().log_softmax(-1)
        cache = KVCache(packed.config, 2, dtype=next(packed.parameters()).dtype)
        stepped = torch.cat([packed(ids[:, :8], cache), packed(ids[:, 8:15], cache)], 1)
    spy.count = 0
    calls, last = ops_called(packed, ids[:, 15:], cache)  # a decoding step of 2 rows
    stepped = torch.cat([stepped, last], 1)
    step_calls, spy.count = spy.count, 0
    prompt = ops_called(packed, ids)[0]
    if kernel == "blocked":  # every product in C, none through torch's kernels
        assert step_calls == products  # an fp32 prompt reads the parameters, below
        assert spy.count == (0 if dtype == "float32" else products)
        assert KERNEL[dtype] not in calls and KERNEL[dtype] not in prompt
    else:
        assert calls.get(kernel) == products and step_calls == spy.count == 0
    if dtype == "float32":  # a prompt is read once: on the parameters, not on a layout
        Q_K_V = 2 * model.config.n_layers  # three products where the layout has one
        torchs = 1 if blas._panels_here() else products + Q_K_V  # tlm's panels: all but E^T
        assert KERNEL[dtype] not in prompt and prompt["aten::linear"] == torchs
    elif kernel != "blocked":
        assert prompt.get(kernel) == products
    if dtype == "bfloat16":  # aten::linear as unpacked, but on bf16 weights
        assert packed.blocks[0].ffn.up_kernel.weight.dtype == torch.bfloat16
    else:  # the unpacked model's products run as aten::addmm / aten::mm
        assert "aten::addmm" not in calls and "aten::mm" not in calls
    least, most = FORMAT_ERROR[dtype]
    error = (got - expected).abs().max().item()
    assert least <= error <= most
    assert (stepped.float().log_softmax(-1) - expected).abs().max().item() <= most
    with pytest.raises(RuntimeError, match="built for inference"):
        packed.train()


def test_float16_is_fp32_arithmetic_on_fp16_weights(make_model):
    """An independent reference for one format: round every weight matrix to fp16 and run
    the plain fp32 model; the packed fp16 model computes the same to fp32 precision. (The
    head is untied, so that the looked-up rows of E, also held in fp16, are tested apart.)"""
    model = make_model(bias=True, tie_embeddings=False)
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.1)
    matrices = ("W_Q", "W_K", "W_V", "W_O", "W_1", "W_2", "W_U", "E")
    state = model.state_dict()
    rounded = make_model(bias=True, tie_embeddings=False)
    rounded.load_state_dict(
        {k: v.half().float() if k.endswith(matrices) else v for k, v in state.items()}
    )
    packed = make_model(bias=True, tie_embeddings=False)
    packed.load_state_dict(state)
    packed = for_inference(packed, "float16")
    ids = torch.randint(0, 97, (2, 16))
    with torch.no_grad():
        exact, reference, got = model(ids), rounded(ids), packed(ids)
    assert (got - reference).abs().max() < 1e-6  # the fp16 weights, and nothing else
    assert (got - exact).abs().max() > 2e-5


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "int8"])
def test_smaller_formats_release_the_fp32_weights(make_model, dtype):
    """Memory follows the format: no fp32 matrix is kept beside its packed copy."""
    model = for_inference(make_model(bias=True), dtype)
    matrices = [p for name, p in model.named_parameters() if name.rsplit(".", 1)[-1][0] in "WE"]
    assert len(matrices) == 6 * model.config.n_layers + 1
    assert all(p.numel() == 0 for p in matrices)
    assert all(p.numel() > 0 for name, p in model.named_parameters() if "gamma" in name)
    with pytest.raises(RuntimeError, match=f"in {dtype} only"):
        model.unembedding()


def test_float32_packing_copies_nothing_until_a_batch(make_model):
    """One row and a prompt read the parameters themselves; the copy for several rows
    (tlm's fp32 blocks, or oneDNN's layout) comes with the first decoding step of several
    rows."""
    model = for_inference(make_model(), "float32")
    qkv, cache = model.blocks[0].attn.qkv_kernel, KVCache(model.config, 2)
    with torch.no_grad():
        one = model(torch.randint(0, 97, (1, 1)), KVCache(model.config, 1))
    with torch.no_grad():
        model(torch.randint(0, 97, (2, 3)), cache)
    assert qkv.layout is None and one.shape == (1, 1, 97)
    with torch.no_grad():  # a decoding step: one token for each of 2 rows
        model(torch.randint(0, 97, (2, 1)), cache)
    assert qkv.layout is not None


def test_unknown_inference_dtype(make_model):
    with pytest.raises(ValueError, match="dtype must be one of"):
        for_inference(make_model(), "float8")


def test_int8_keeps_one_scale_per_output():
    """Outputs of very different sizes each keep ~1% precision: a scale per output row of
    W (per column of the book's [in, out] W), not one for the whole matrix."""
    from tlm.inference.formats.kernels import PackedLinear

    torch.manual_seed(0)
    sizes = torch.logspace(-3, 0, 32)  # output j is about sizes[j] in size
    W = torch.randn(64, 32) * sizes  # [in, out]
    x = torch.randn(16, 64)
    got = PackedLinear.side_by_side([(W, None)], "int8")(x)
    expected = x @ W
    relative = (got - expected).norm(dim=0) / expected.norm(dim=0)  # per output
    assert relative.max() < 0.03
