"""The encoder-decoder (Vaswani et al. 2017): who sees what, padding, caches, cross-attention."""

import pytest
import torch

from tlm.config import ConfigError, ModelConfig
from tlm.interpret.hooks import run_with_cache
from tlm.model.counts import parameter_counts
from tlm.model.encoder_decoder import EncoderDecoder
from tlm.model.kv_cache import KVCache

V, S, T = 50, 9, 7


def make(norm="pre", **overrides) -> EncoderDecoder:
    values = dict(model_type="encoder-decoder", vocab_size=V, d_model=32, n_heads=4, n_layers=2)
    values |= dict(n_encoder_layers=3, context_length=16, position="sinusoidal", norm=norm)
    config = ModelConfig(**{**values, **overrides})
    torch.manual_seed(0)
    return EncoderDecoder(config).eval()


def ids(*shape, seed=1):
    return torch.randint(1, V, shape, generator=torch.Generator().manual_seed(seed))


@pytest.fixture(params=["pre", "post"])
def model(request):
    return make(request.param)


def test_the_encoder_sees_later_source_tokens(model):
    src = ids(1, S)
    changed = src.clone()
    changed[0, -1] = (src[0, -1] % (V - 1)) + 1  # only the last source token
    with torch.no_grad():
        a, b = model.encode(src), model.encode(changed)
    assert not torch.allclose(a[0, 0], b[0, 0], atol=1e-4)  # position 0 depends on position S-1


def test_the_decoder_never_sees_later_target_tokens(model):
    src, tgt = ids(1, S), ids(1, T, seed=2)
    changed = tgt.clone()
    changed[0, 4:] = (tgt[0, 4:] % (V - 1)) + 1
    with torch.no_grad():
        a, b = model(src, tgt), model(src, changed)
    assert torch.allclose(a[0, :4], b[0, :4], atol=1e-6)  # positions before 4 are unchanged
    assert not torch.allclose(a[0, 4], b[0, 4], atol=1e-4)


def test_source_padding_never_changes_a_result(model):
    """Two sources of different lengths in one right-padded batch give each one's logits
    alone, whatever token the padding holds."""
    short, long = ids(1, 5, seed=3), ids(1, S, seed=4)
    tgt = ids(2, T, seed=5)
    for pad in (0, 17):
        batch = torch.cat([torch.cat([short, torch.full((1, S - 5), pad)], dim=1), long])
        mask = torch.ones(2, S, dtype=torch.long)
        mask[0, 5:] = 0
        with torch.no_grad():
            together = model(batch, tgt, mask)
            alone = [model(short, tgt[:1]), model(long, tgt[1:])]
        assert torch.allclose(together[0], alone[0][0], atol=1e-5)
        assert torch.allclose(together[1], alone[1][0], atol=1e-5)
    with torch.no_grad():  # and the mask matters: unmasked padding is read
        unmasked = model(batch, tgt)
    assert not torch.allclose(unmasked[0], alone[0][0], atol=1e-3)


def test_cached_decoding_equals_the_whole_target_at_once(model):
    src, tgt = ids(2, S), ids(2, T, seed=6)
    mask = torch.ones(2, S, dtype=torch.long)
    mask[1, 6:] = 0
    with torch.no_grad():
        whole = model(src, tgt, mask)
        memory = model.encode(src, mask)
        cache = KVCache(model.config, batch_size=2)
        steps = [model.decode(tgt[:, :3], memory, mask, cache)]  # a prefix, then one at a time
        steps += [model.decode(tgt[:, t : t + 1], memory, mask, cache) for t in range(3, T)]
    assert torch.allclose(torch.cat(steps, dim=1), whole, atol=1e-5)


def test_cross_attention_keys_and_values_are_computed_once_per_source(model):
    calls = []
    for block in model.decoder:
        project = block.cross.project_kv
        block.cross.project_kv = lambda source, project=project: calls.append(1) or project(source)
    src, tgt = ids(1, S), ids(1, T, seed=7)
    with torch.no_grad():
        memory = model.encode(src)
        cache = KVCache(model.config, batch_size=1)
        for t in range(T):
            model.decode(tgt[:, t : t + 1], memory, None, cache)
    assert len(calls) == model.config.n_layers == cache.cross_projections  # not n_layers * T
    cache.reset()  # a new source: projected again
    with torch.no_grad():
        model.decode(tgt[:, :1], model.encode(ids(1, 4, seed=8)), None, cache)
    assert len(calls) == 2 * model.config.n_layers


def test_the_written_out_cross_attention_equals_the_fused_one(model):
    """Listening to `cross.pattern` switches every cross-attention to the written-out path:
    same logits; each target row is a distribution over the source tokens, 0 on padding."""
    src, tgt = ids(1, S), ids(1, T, seed=9)
    mask = torch.ones(1, S, dtype=torch.long)
    mask[0, 6:] = 0
    with torch.no_grad():
        fused = model(src, tgt, mask)
        names = [f"decoder.{layer}.cross.pattern" for layer in range(model.config.n_layers)]
        logits, cache = run_with_cache(model, src, names, target_ids=tgt, source_mask=mask)
    assert torch.allclose(logits, fused, atol=1e-5)
    pattern = cache["decoder.1.cross.pattern"]  # [B,H,T,S]
    assert pattern.shape == (1, 4, T, S)
    assert torch.allclose(pattern.sum(-1), torch.ones(1, 4, T), atol=1e-6)
    assert pattern[..., 6:].abs().max() == 0


def test_embeddings_are_scaled_and_tied(model):
    """X = E[w]·√d + P (§3.4), one E for both languages and the head."""
    src, tgt = ids(1, S), ids(1, T, seed=10)
    assert model.W_U is None and model.num_parameters() == sum(
        p.numel() for p in model.parameters()
    )
    with torch.no_grad():
        logits, cache = run_with_cache(model, src, ["embed_target", "final"], target_ids=tgt)
    E, P = model.embedding.E, model.embedding.P
    assert torch.allclose(cache["embed_target"][0], E[tgt[0]] * 32**0.5 + P[:T], atol=1e-5)
    assert torch.allclose(logits, cache["final"] @ E.t(), atol=1e-5)


def test_config_refuses_what_an_encoder_decoder_cannot_be():
    with pytest.raises(ConfigError, match="not rope"):
        ModelConfig(model_type="encoder-decoder", position="rope")
    with pytest.raises(ConfigError, match="n_encoder_layers applies"):
        ModelConfig(n_encoder_layers=2)
    with pytest.raises(ConfigError, match="model_type must be one of"):
        ModelConfig(model_type="bert")
    assert ModelConfig(model_type="encoder-decoder", n_layers=3).n_encoder_layers == 3


@pytest.mark.parametrize(
    "overrides", [{}, {"norm": "post", "bias": False}, {"position": "learned"}]
)
def test_parameter_counts_match_the_model(overrides):
    model = make(**{"norm": "pre", **overrides})
    assert parameter_counts(model.config)["total"] == model.num_parameters()
