"""The logit lens, direct logit attribution, activation patching and contextual embeddings."""

import pytest
import torch

from tlm.interpret import (
    HookError,
    Patch,
    cosine_across_contexts,
    direct_logit_attribution,
    logit_lens,
    patching_sweep,
    run_patched,
    run_with_cache,
    word_vectors,
)
from tlm.tokenizer import CharTokenizer


def randomised(model, std=0.3):
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(1.0 if name.endswith("gamma") else 0.0, std)
    return model


@pytest.mark.parametrize("norm", ["pre", "post"])
def test_the_logit_lens_ends_at_the_models_output(make_model, norm):
    model = randomised(make_model(norm=norm))
    ids = torch.randint(0, 97, (1, 11))
    lens = logit_lens(model, ids)
    assert lens.labels == ["embed", "block 0", "block 1"] and lens.logprobs.shape == (3, 11, 97)
    with torch.no_grad():
        expected = model(ids)[0].log_softmax(-1)
    assert torch.allclose(lens.logprobs[-1], expected, atol=1e-5)
    _, cache = run_with_cache(model, ids, ["embed"])
    with torch.no_grad():  # depth 0: the embedding read through the final norm and E^T
        first = model.ln_f(cache["embed"][0]) @ model.embedding.E.T
    assert torch.allclose(lens.logprobs[0], first.log_softmax(-1), atol=1e-5)
    probs, top = lens.top(3)
    assert torch.equal(top[-1, :, 0], expected.argmax(-1))
    assert (probs[:, :, 0] >= probs[:, :, 1]).all() and torch.allclose(
        probs[-1, :, 0], expected.max(-1).values.exp()
    )


def test_direct_logit_attribution_sums_to_the_logit(make_model):
    model = randomised(make_model(position="learned"), std=0.2)
    ids = torch.randint(0, 97, (1, 9))
    target = 5
    attribution = direct_logit_attribution(model, ids, target, position=4)
    labels = attribution.labels
    assert labels[:5] == ["embed", "L0H0", "L0H1", "L0H2", "L0H3"]
    assert labels[5:7] == ["L0 attn bias", "L0 mlp"] and labels[-1] == "final norm bias"
    with torch.no_grad():
        logit = model(ids)[0, 4, target]
    assert attribution.values.sum().item() == pytest.approx(logit.item(), abs=1e-4)
    _, cache = run_with_cache(model, ids, ["embed", "blocks.1.resid_post"])
    x, h = cache["embed"][0, 4], cache["blocks.1.resid_post"][0, 4]
    sigma = torch.sqrt(h.var(unbiased=False) + model.ln_f.eps)
    embed_share = ((x - x.mean()) / sigma * model.ln_f.gamma) @ model.embedding.E[target]
    assert attribution.as_dict()["embed"] == pytest.approx(embed_share.item(), abs=1e-5)
    with pytest.raises(HookError, match="pre-norm"):
        direct_logit_attribution(make_model(norm="post"), ids, target)


def test_a_heads_share_is_what_removing_it_takes_from_the_stream(make_model):
    """Without the final norm's re-scaling (σ fixed), removing L1H2's output from the
    stream lowers the logit by exactly its attributed share."""
    model = randomised(make_model(), std=0.2)
    ids = torch.randint(0, 97, (1, 7))
    share = direct_logit_attribution(model, ids, 3).as_dict()["L1H2"]
    _, cache = run_with_cache(model, ids, ["blocks.1.attn.z", "blocks.1.resid_post"])
    d_head = model.config.d_head
    head_out = (
        cache["blocks.1.attn.z"][0, -1, 2] @ model.blocks[1].attn.W_O[2 * d_head : 3 * d_head]
    )
    h = cache["blocks.1.resid_post"][0, -1]
    sigma = torch.sqrt(h.var(unbiased=False) + model.ln_f.eps)
    ln = lambda v: (v - v.mean()) / sigma * model.ln_f.gamma + model.ln_f.beta  # noqa: E731
    E = model.embedding.E[3]
    assert (ln(h) @ E - ln(h - head_out) @ E).item() == pytest.approx(share, abs=1e-5)


def clean_and_corrupted(T=8, changed=5):
    clean = torch.randint(0, 97, (1, T), generator=torch.Generator().manual_seed(1))
    corrupted = clean.clone()
    corrupted[0, changed] = (clean[0, changed] + 7) % 97
    return clean, corrupted


def test_patching_the_whole_last_stream_restores_the_clean_logits(make_model):
    model = randomised(make_model())
    clean, corrupted = clean_and_corrupted()
    clean_logits, cache = run_with_cache(
        model, clean, ["blocks.1.resid_post", "blocks.0.resid_pre"]
    )
    restored = run_patched(model, corrupted, cache, [Patch(1, "resid_post")])
    assert torch.equal(restored, clean_logits)  # exactly: the same numbers go through ln_f, E^T
    with torch.no_grad():
        corrupted_logits = model(corrupted)
    same = run_patched(model, corrupted, cache, [Patch(0, "resid_pre", position=0)])
    assert torch.equal(same, corrupted_logits)  # position 0 is the same token in both: nothing
    assert not torch.allclose(clean_logits, corrupted_logits, atol=1e-3)


def test_a_patching_sweep_finds_where_the_difference_lives(make_model):
    model = randomised(make_model())
    clean, corrupted = clean_and_corrupted(T=8, changed=5)
    target = int(model(clean)[0, -1].argmax())
    sweep = patching_sweep(model, clean, corrupted, target)
    assert sweep.recovery.shape == (2, 8) and sweep.rows == ["block 0", "block 1"]
    assert sweep.clean != sweep.corrupted
    # entering block 0 the stream at position 5 *is* the changed token: patching it restores
    # the clean prompt; positions the prompts share restore nothing
    assert sweep.recovery[0, 5].item() == pytest.approx(1.0, abs=1e-4)
    assert torch.allclose(sweep.recovery[0, [0, 1, 2, 3, 4, 6, 7]], torch.zeros(7), atol=1e-4)
    one_by_one = []
    _, cache = run_with_cache(model, clean, ["blocks.1.resid_pre"])
    for t in range(8):  # the batched sweep equals patching one copy at a time
        logits = run_patched(model, corrupted, cache, [Patch(1, position=t)])
        one_by_one.append(logits[0, -1, target].item())
    expected = (torch.tensor(one_by_one) - sweep.corrupted) / (sweep.clean - sweep.corrupted)
    assert torch.allclose(sweep.recovery[1], expected, atol=1e-4)
    heads = patching_sweep(model, clean, corrupted, target, foil=0, over="heads")
    assert heads.recovery.shape == (2, 4) and heads.columns == ["H0", "H1", "H2", "H3"]


def test_patching_refuses_prompts_of_different_lengths(make_model):
    model = make_model()
    with pytest.raises(HookError, match="the corrupted prompt has 6 tokens and the clean one 5"):
        patching_sweep(model, torch.zeros(1, 5).long(), torch.zeros(1, 6).long(), target=1)


def test_a_word_drifts_apart_across_contexts(make_model):
    tok = CharTokenizer("abcdefghijklmnopqrstuvwxyz .")
    model = randomised(make_model(vocab_size=tok.vocab_size, position="rope"), std=0.2)
    contexts = ["the bank of the river", "a bank lends money", "bank"]
    cosine = cosine_across_contexts(model, tok, "bank", contexts)
    assert cosine.shape == (3, 3, 3)
    assert torch.allclose(cosine[0], torch.ones(3, 3), atol=1e-5)  # E[k] alone: no positions
    assert (cosine[-1] < 0.999).sum() == 6  # after the blocks the contexts differ
    assert torch.allclose(cosine[-1].diagonal(), torch.ones(3), atol=1e-5)
    vectors = word_vectors(model, tok, "the bank of the river", "bank")
    _, cache = run_with_cache(model, torch.tensor([[tok.eot_id, *tok.encode("the bank")]]))
    assert torch.allclose(vectors[-1], cache["blocks.1.resid_post"][0, -1], atol=1e-5)
    with pytest.raises(HookError, match="'mole' does not occur"):
        word_vectors(model, tok, "the bank", "mole")
