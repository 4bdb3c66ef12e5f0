"""Hook points chosen at forward time: reading changes nothing, writing changes what it says,
and the activations equal `transformers`' own on a GPT-2 checkpoint."""

import pytest
import torch
import transformers  # a dev dependency: missing, it must fail, not skip

from conftest import V
from tlm import load_model
from tlm.interpret import HookError, ablate_head, hooks, run_with_cache
from tlm.model.hooks import hook_names

READING_ALPHA = ("attn.scores", "attn.pattern")  # listening to these forms α (written out)


def randomised(model, std=0.2):
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, std)
    return model


def test_every_documented_name_exists(make_model):
    names = hook_names(make_model())
    per_layer = ["resid_pre", "attn.q", "attn.k", "attn.v", "attn.scores", "attn.pattern"]
    per_layer += ["attn.z", "attn.out", "resid_mid", "mlp.pre", "mlp.post", "mlp.out", "resid_post"]
    expected = ["embed"] + [f"blocks.{i}.{n}" for i in range(2) for n in per_layer]
    assert names == [*expected, "final", "logits"]  # in the order the forward pass runs them


@pytest.mark.parametrize("norm", ["pre", "post"])
def test_listening_changes_nothing(make_model, norm):
    model = randomised(make_model(norm=norm, position="rope"))
    ids = torch.randint(0, 97, (2, 12))
    with torch.no_grad():
        plain = model(ids)
    fused_names = [n for n in hook_names(model) if not n.endswith(READING_ALPHA)]
    seen = []
    with hooks(model, {n: lambda x, n=n: seen.append(n) for n in fused_names}), torch.no_grad():
        listened = model(ids)
    assert seen == fused_names and torch.equal(listened, plain)  # bit for bit
    with hooks(model, {n: lambda x: None for n in hook_names(model)}), torch.no_grad():
        written_out = model(ids)  # every α formed: the written-out path
    assert torch.allclose(written_out, plain, atol=1e-5)
    assert not any(p.listening for p in model.modules() if hasattr(p, "listening"))  # removed


def attention_kernels(model, ids) -> tuple[int, int]:
    """How many times the fused kernel and a softmax ran in one forward pass."""
    from torch.profiler import ProfilerActivity, profile

    with torch.no_grad(), profile(activities=[ProfilerActivity.CPU]) as prof:
        model(ids)
    counts = {e.key: e.count for e in prof.key_averages()}
    return counts.get("aten::scaled_dot_product_attention", 0), counts.get("aten::softmax", 0)


def test_the_pattern_is_formed_only_when_someone_listens(make_model):
    model = randomised(make_model())
    ids = torch.randint(0, 97, (1, 9))
    assert attention_kernels(model, ids) == (2, 0)  # nobody listens: fused, in both layers
    with hooks(model, {"blocks.1.attn.pattern": lambda x: None}):
        assert attention_kernels(model, ids) == (1, 1)  # layer 1 writes α out, layer 0 not
    logits, cache = run_with_cache(model, ids, lambda n: n.endswith(("pattern", "scores", "q")))
    pattern, scores = cache["blocks.1.attn.pattern"], cache["blocks.1.attn.scores"]
    assert pattern.shape == scores.shape == (1, 4, 9, 9)
    assert torch.allclose(pattern.sum(-1), torch.ones(1, 4, 9), atol=1e-6)
    assert pattern.triu(diagonal=1).abs().max() == 0  # causal: nothing after the query
    assert torch.isinf(scores.triu(diagonal=1)[scores.triu(diagonal=1) != 0]).all()
    q, k = cache["blocks.1.attn.q"], None
    assert q.shape == (1, 4, 9, 16) and k is None
    assert torch.allclose(torch.softmax(scores, -1), pattern)


def test_a_hook_replaces_the_activation(make_model):
    model = randomised(make_model())
    ids = torch.randint(0, 97, (1, 6))
    with hooks(model, {"logits": lambda x: torch.zeros_like(x)}), torch.no_grad():
        assert model(ids).abs().max() == 0
    uniform = lambda p: torch.tril(torch.ones_like(p)) / torch.arange(1, 7)[:, None]  # noqa: E731
    _, cache = run_with_cache(model, ids, ["blocks.0.attn.z"])
    with hooks(model, {"blocks.0.attn.pattern": uniform}):
        _, averaged = run_with_cache(model, ids, ["blocks.0.attn.z", "blocks.0.attn.v"])
    v = averaged["blocks.0.attn.v"]  # [1,H,T,dh]
    running_mean = v.cumsum(2) / torch.arange(1, 7)[:, None]  # each position: the mean v so far
    assert torch.allclose(averaged["blocks.0.attn.z"], running_mean.transpose(1, 2), atol=1e-6)
    assert not torch.allclose(averaged["blocks.0.attn.z"], cache["blocks.0.attn.z"])


def test_zero_ablating_a_head_equals_zeroing_its_rows_of_W_O(make_model):
    model = randomised(make_model())
    ids = torch.randint(0, 97, (2, 10))
    d_head = model.config.d_head
    with ablate_head(model, layer=1, head=2), torch.no_grad():
        ablated = model(ids)
    with torch.no_grad():
        reference = model(ids)
        model.blocks[1].attn.W_O[2 * d_head : 3 * d_head] = 0.0
        zeroed = model(ids)
    assert torch.allclose(ablated, zeroed, atol=1e-5)
    assert not torch.allclose(ablated, reference, atol=1e-3)


def test_mean_ablation_replaces_a_head_by_its_average_output(make_model):
    model = randomised(make_model())
    ids = torch.randint(0, 97, (2, 10))
    _, clean = run_with_cache(model, ids, ["blocks.0.attn.z"])
    with ablate_head(model, 0, 1, how="mean"):
        _, ablated = run_with_cache(model, ids, ["blocks.0.attn.z"])
    z, mean = ablated["blocks.0.attn.z"], clean["blocks.0.attn.z"][:, :, 1].mean(dim=(0, 1))
    assert torch.allclose(z[:, :, 1], mean.expand(2, 10, -1), atol=1e-6)
    assert torch.equal(z[:, :, 0], clean["blocks.0.attn.z"][:, :, 0])


def test_hooks_are_removed_on_error(make_model):
    model = make_model()
    with pytest.raises(RuntimeError, match="boom"), hooks(model, {"final": lambda x: None}):
        raise RuntimeError("boom")
    assert not model.final.listening


@pytest.mark.parametrize(
    "call, message",
    [
        (
            lambda m: run_with_cache(m, torch.zeros(1, 2).long(), ["blocks.0.attn.patern"]),
            "no hook point named 'blocks.0.attn.patern' (closest: blocks.0.attn.pattern",
        ),
        (lambda m: ablate_head(m, 2, 0), "layer 2 is out of range: the model has layers 0..1"),
        (lambda m: ablate_head(m, 0, 4), "head 4 is out of range: the model has heads 0..3"),
        (lambda m: ablate_head(m, 0, 0, how="half"), "how must be zero or mean"),
    ],
)
def test_bad_names_and_indices_say_what_exists(make_model, call, message):
    with pytest.raises(HookError) as error:
        call(make_model())
    assert message in str(error.value)


def test_activations_equal_transformers_on_a_gpt2_directory(gpt2_dir):
    """`transformers`' eager attention and hidden states are an oracle nobody here wrote."""
    hf = transformers.GPT2LMHeadModel.from_pretrained(gpt2_dir, attn_implementation="eager")
    hf.eval()
    model = load_model(gpt2_dir)
    ids = torch.randint(0, V, (2, 17), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        out = hf(ids, output_attentions=True, output_hidden_states=True)
    logits, cache = run_with_cache(model, ids)
    L = model.config.n_layers
    for layer in range(L):
        pattern = cache[f"blocks.{layer}.attn.pattern"]
        assert torch.allclose(pattern, out.attentions[layer], atol=1e-5, rtol=0)
        assert torch.allclose(
            cache[f"blocks.{layer}.resid_pre"], out.hidden_states[layer], atol=1e-4
        )
    for layer in range(L - 1):  # transformers' last hidden state is after the final norm
        hidden = out.hidden_states[layer + 1]
        assert torch.allclose(cache[f"blocks.{layer}.resid_post"], hidden, atol=1e-4)
    assert torch.allclose(cache["final"], out.hidden_states[L], atol=1e-4)
    assert torch.allclose(logits, out.logits, atol=1e-4)
