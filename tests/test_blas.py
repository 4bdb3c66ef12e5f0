"""The CPU decoding route (`tlm.inference.formats.blas`): one row's fp32 products, through tlm's own
loops (products.c) or numpy's BLAS, equal torch's."""

import pytest
import torch
import torch.nn.functional as F

from tlm import ModelConfig, TransformerLM
from tlm.inference import InferenceLM, for_decoding, for_inference, native
from tlm.inference.decoding.program import FLOAT32_ROWS
from tlm.inference.formats import blas
from tlm.model.kv_cache import KVCache

# each instruction set this host runs, at one thread and at two
pytestmark = pytest.mark.usefixtures("kernel_build", "each_thread_count")


def make_model(**overrides) -> TransformerLM:
    torch.manual_seed(0)
    shape = {"vocab_size": 97, "d_model": 64, "n_layers": 2, "n_heads": 4, "context_length": 32}
    return TransformerLM(ModelConfig(**{**shape, **overrides})).eval()


def count_products(monkeypatch) -> list[int]:
    """The number of rows of every product numpy's BLAS computes from now on."""
    routed, product = [], blas.product
    monkeypatch.setattr(blas, "product", lambda x, *a: routed.append(len(x)) or product(x, *a))
    return routed


@pytest.fixture(params=["own", "numpy"])
def route(request, monkeypatch):
    """Each route of one row's products: tlm's own loops where this host has them, and
    numpy's BLAS (forced)."""
    if request.param == "numpy":
        monkeypatch.setattr(native, "threaded", lambda: False)
    elif not native.threaded():
        pytest.skip("no C library with OpenMP here: numpy's BLAS only")
    return request.param


@pytest.mark.parametrize("rows", [(1,), (3,), (2, 5), (1, 1)])
def test_product_is_torchs_linear(route, rows):
    torch.manual_seed(0)
    x, W, b = torch.randn(*rows, 51), torch.randn(51, 83), torch.randn(83)
    E = torch.randn(83, 51)  # a tied head reads E^T: a transposed view, not a copy
    assert torch.allclose(blas.product(x, W, b), F.linear(x, W.t(), b), atol=1e-5)
    assert torch.allclose(blas.product(x, E.t(), None), x @ E.t(), atol=1e-5)
    assert torch.allclose(blas.product(x, E.t(), b), x @ E.t() + b, atol=1e-5)
    wide = torch.randn(51, 2 * 83)  # rows further apart than their width (a slice)
    assert torch.allclose(blas.product(x, wide[:, :83], b), x @ wide[:, :83] + b, atol=1e-5)
    assert torch.allclose(blas.product(x, wide[:, ::2], b), x @ wide[:, ::2] + b, atol=1e-5)
    assert blas.product(x, W, None).shape == (*rows, 83)


@pytest.mark.parametrize("tie", [True, False])
def test_decoding_route_equals_the_plain_model(monkeypatch, route, tie):
    model, ids = make_model(tie_embeddings=tie), torch.randint(0, 97, (1, 9))
    with torch.no_grad():
        plain, cache = model(ids), KVCache(model.config, 1)
        plain_steps = [model(ids[:, :5], cache), model(ids[:, 5:6], cache)]
    fast, routed = for_decoding(model), count_products(monkeypatch)
    cache = KVCache(model.config, 1)
    with torch.no_grad():
        steps = [fast(ids[:, :5], cache)]
        steps.append(fast(ids[:, 5:6], cache))  # a decoding step: one token, a cache
    assert len(routed) == 2 * 6 + 1  # only the step: Q, K, V, O, W_1, W_2 a layer, the head
    for got, expected in zip(steps, plain_steps, strict=True):
        assert torch.allclose(got, expected, atol=1e-5)
    with torch.no_grad():
        assert torch.allclose(fast(ids), plain, atol=1e-5)


def test_the_model_for_decoding_shares_the_parameters_and_leaves_the_model_alone():
    model = make_model()
    fast = for_decoding(model)
    assert isinstance(fast, InferenceLM) and type(model) is TransformerLM
    assert type(model.blocks[0].attn).__name__ == "MultiHeadAttention"
    assert fast.blocks[0].attn.W_Q is model.blocks[0].attn.W_Q
    assert fast.blocks[0].ln1 is model.blocks[0].ln1  # untouched modules are shared
    assert fast.blocks[0].attn.pattern is model.blocks[0].attn.pattern  # and hook points
    assert for_decoding(fast) is fast
    model.train()  # the trained model trains on
    with pytest.raises(RuntimeError, match="built for inference"):
        fast.train()


def threads_inside(model, fail: bool = False) -> int:
    """torch's thread count while a decoding step's forward pass runs (read by a hook on
    its last block, which fails the pass if `fail`)."""
    seen = []

    def hook(module, inputs):
        seen.append(torch.get_num_threads())
        if fail:
            raise RuntimeError("inside")

    handle = model.blocks[-1].register_forward_pre_hook(hook)
    try:
        with torch.no_grad():
            model(torch.randint(0, 97, (1, 1)), KVCache(model.config, 1))
    finally:
        handle.remove()
    return seen[0]


def test_threads_are_restored_when_the_step_fails(route):
    """torch keeps one thread while numpy's pool has the cores, and all of them for tlm's
    own loops (which run on them); the caller's count and the route come back even when
    the pass fails."""
    fast, threads = for_decoding(make_model()), torch.get_num_threads()
    assert threads_inside(fast) == (1 if route == "numpy" else threads)
    with pytest.raises(RuntimeError, match="inside"):
        threads_inside(fast, fail=True)
    assert torch.get_num_threads() == threads and fast.route.rows == 0


def test_gradients_inside_take_torchs_path(monkeypatch):
    """A decoding step run with autograd on takes torch's products: its logits have a
    graph back to the parameters."""
    model, ids = make_model(), torch.randint(0, 97, (1, 1))
    fast, routed = for_decoding(model), count_products(monkeypatch)
    logits = fast(ids, KVCache(model.config, 1))
    assert routed == [] and logits.requires_grad


def test_training_on_is_seen_at_the_next_step(route):
    """Both routes read the parameters' own memory: an optimizer step is visible at once."""
    model, ids = make_model(), torch.randint(0, 97, (1, 1))
    fast = for_decoding(model)
    with torch.no_grad():  # a decoding step each: one token into a cache
        before = fast(ids, KVCache(model.config, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    model(torch.randint(0, 97, (1, 6))).logsumexp(-1).mean().backward()
    optimizer.step()
    with torch.no_grad():
        after = fast(ids, KVCache(model.config, 1))
    with torch.no_grad():
        assert torch.allclose(after, model(ids), atol=1e-5)
    assert not torch.allclose(after, before, atol=1e-3)


def test_packed_models_keep_torchs_threads(monkeypatch):
    model, threads = for_inference(make_model(), "int8"), torch.get_num_threads()
    routed = count_products(monkeypatch)
    assert threads_inside(model) == threads
    assert routed == []


def test_the_head_of_a_tied_model_reads_E(route):
    model, h = make_model(), torch.randn(1, 1, 64)
    fast, expected = for_decoding(model), h @ model.embedding.E.t()
    with torch.no_grad():  # the head of a decoding step
        assert torch.allclose(fast.head.step(h), expected, atol=1e-5)
    assert torch.allclose(model.unembed(h), expected, atol=1e-5)


@pytest.mark.parametrize("batch", [1, 2, 4])
def test_generation_takes_the_route_for_few_rows(monkeypatch, route, batch):
    """After the prompt, a plain model's rows decode on its parameters: one row through
    numpy (13 products a step) without tlm's threaded loops, and any number of rows as the
    whole step in one C call with them (`program.py`). The tokens are those of the plain
    model either way."""
    model, ids = make_model(), torch.randint(0, 97, (batch, 5))
    expected = model.generate(ids, max_new_tokens=6, use_cache=False)
    routed, whole = count_products(monkeypatch), []
    if native.library() is not None:
        real = native.library().decode_step
        monkeypatch.setattr(native.library(), "decode_step", lambda *a: whole.append(1) or real(*a))
    assert torch.equal(model.generate(ids, max_new_tokens=6), expected)
    steps = 5  # the prompt runs 5 positions on torch, then 1 a step
    if route == "own":
        assert len(whole) == steps and routed == []
    else:
        assert len(routed) == (steps * 13 if batch == 1 else 0) and whole == []


@pytest.mark.parametrize("settings", [{}, {"num_beams": 2}])
def test_batched_decoding_steps_use_the_layout_and_prompts_do_not(settings):
    """A model prepared in float32 decodes more than FLOAT32_ROWS rows on its oneDNN layout
    (made at the first such step), both in generate's rows and in beam search, with the
    plain model's tokens; one row and prompts read the parameters."""
    ids = torch.randint(0, 97, (FLOAT32_ROWS + 1, 5))
    expected = make_model().generate(ids, max_new_tokens=6, **settings)
    model = for_inference(make_model(), "float32")
    qkv = model.blocks[0].attn.qkv_kernel
    model.generate(ids[:1], max_new_tokens=6)
    assert qkv.layout is None
    assert torch.equal(model.generate(ids, max_new_tokens=6, **settings), expected)
    assert qkv.layout is not None


def test_a_prompt_joining_decoding_rows_takes_their_route(monkeypatch):
    """A pass that feeds a short prompt beside rows that decode (a server's join, a chunk of
    a prefill) runs its float32 products on the decoding route, a lone prompt on torch's;
    every row's tokens are the plain model's."""
    from tlm.generate import GenerationConfig
    from tlm.generate.slots import Slots
    from tlm.inference.formats.kernels import Float32Linear

    model = for_inference(make_model(), "float32")
    routed = []
    real = Float32Linear.step
    record = lambda self, x: routed.append(x.shape[-2]) or real(self, x)  # noqa: E731
    monkeypatch.setattr(Float32Linear, "step", record)
    prompts = [torch.randint(0, 97, (n,)).tolist() for n in (5, 6, 7)]
    config = GenerationConfig(max_new_tokens=6)
    loop = Slots(model, 3)
    rows = [loop.add(p, config) for p in prompts[:2]]
    loop.step()  # two prompts alone: a prompt's route (`blas.prompt`), not the decoding one
    assert routed == []
    loop.step()  # two rows decode (the C step where built, else the route)
    routed.clear()
    rows.append(loop.add(prompts[2], config))
    loop.step()  # a prompt of 7 joins 2 decoding rows: 9 tokens on the route
    assert routed.count(9) == 4 * model.config.n_layers  # every block's four maps
    while not loop.idle():
        loop.step()
    for prompt, row in zip(prompts, rows, strict=True):
        alone = make_model().generate(torch.tensor([prompt]), max_new_tokens=6, use_cache=False)
        assert row.tokens == alone[0, len(prompt) :].tolist()


def panels_here() -> None:
    if not blas._panels_here():
        pytest.skip("no AVX2 build of the panels here (an AVX-512 build keeps torch's product)")


@pytest.mark.parametrize("rows", [2, 5, 6, 7, 13, blas.PANEL_ROWS])
def test_panels_are_torchs_product(rows):
    """A prompt's rows through products.c's panels, W in place: torch's x @ W + b, with a
    last panel of 15 columns, without a bias, and on a slice of a wider matrix."""
    panels_here()
    torch.manual_seed(0)
    x, W, b = torch.randn(rows, 37), torch.randn(37, 1007), torch.randn(1007)
    close = lambda a, e: torch.allclose(a, e, atol=1e-4, rtol=1e-5)  # noqa: E731
    assert close(blas.prompt(x, W, b), x @ W + b)
    assert close(blas.prompt(x, W, None), x @ W)
    wide = torch.randn(37, 1100)
    assert close(blas.prompt(x[None], wide[:, 3:1010], b), (x @ wide[:, 3:1010] + b)[None])


def test_a_prompts_route_leaves_what_it_does_not_serve():
    """One row takes the decoding route's loops (a tied head's E^T too); more than
    PANEL_ROWS rows, several rows on a transposed W, and other dtypes: None (the caller
    takes torch's product)."""
    panels_here()
    torch.manual_seed(0)
    W, E, x = torch.randn(16, 32), torch.randn(32, 16), torch.randn(1, 1, 16)
    assert torch.allclose(blas.prompt(x, W, None), x @ W, atol=1e-5)
    assert torch.allclose(blas.prompt(x, E.t(), None), x @ E.t(), atol=1e-5)
    assert blas.prompt(torch.randn(blas.PANEL_ROWS + 1, 16), W, None) is None
    assert blas.prompt(torch.randn(4, 32), W.t(), None) is None
    assert blas.prompt(torch.randn(4, 16).double(), W.double(), None) is None


def test_a_lone_prompt_takes_the_panels(monkeypatch):
    """A float32 model's prompt runs every map of every block through the panels, and its
    last position's head (E^T) through the decoding route's loops: all counted; its logits
    are the plain model's."""
    from tlm.inference.formats.kernels import Float32Linear

    panels_here()
    model, ids = for_inference(make_model(), "float32"), torch.randint(0, 97, (1, 9))
    kernels = [m for m in vars_of(model) if isinstance(m, Float32Linear)]
    maps = sum(len(m.maps) for m in kernels)  # 6 a block, and the head
    served, real = [], blas.prompt
    monkeypatch.setattr(blas, "prompt", lambda *a: served.append(real(*a)) or served[-1])
    with torch.no_grad():
        logits = model(ids, last_only=True)
    assert sum(y is not None for y in served) == maps == 6 * model.config.n_layers + 1
    with torch.no_grad():
        assert torch.allclose(logits, make_model()(ids)[:, -1:], atol=1e-5)


def vars_of(model: torch.nn.Module) -> list:
    """Every attribute of every module of `model` (the kernels are plain attributes)."""
    return [v for module in model.modules() for v in vars(module).values()]
