"""Decoding the encoder-decoder, the paper's loss and schedule, and training on pairs."""

import json
import math
import random

import pytest
import torch

from tlm.cli import main
from tlm.config import ModelConfig, TrainConfig
from tlm.generate.translate import beam_translate, greedy_translate, length_penalty, translate
from tlm.interpret.attention import cross_attention_of
from tlm.load import load_model
from tlm.model.encoder_decoder import EncoderDecoder
from tlm.model.loss import IGNORE, label_smoothed_cross_entropy, label_smoothed_reference
from tlm.tokenizer import load_tokenizer
from tlm.train.optim import learning_rate

EOT = 0


def random_model(seed=0, norm="post") -> EncoderDecoder:
    config = ModelConfig(
        model_type="encoder-decoder",
        vocab_size=12,
        d_model=16,
        n_heads=2,
        n_layers=2,
        n_encoder_layers=1,
        context_length=12,
        position="sinusoidal",
        norm=norm,
    )
    torch.manual_seed(seed)
    model = EncoderDecoder(config).eval()
    with torch.no_grad():
        model.embedding.E[EOT] *= 0.2  # ends are rarer, so the outputs have some length
    return model


def sources():
    src = torch.tensor([[3, 4, 5, 6, 7, EOT], [8, 9, EOT, 0, 0, 0], [5, 5, 2, 1, EOT, 0]])
    mask = (torch.arange(6) < torch.tensor([[6], [3], [5]])).long()
    return src, mask


def greedy_reference(model, src, mask, limit):
    """Greedy without a cache: the whole target so far through the decoder at every step."""
    out = []
    for b in range(len(src)):
        row, n = src[b : b + 1, : int(mask[b].sum())], []
        for _ in range(limit):
            target = torch.tensor([[EOT, *n]])
            t = int(model(row, target)[0, -1].argmax())
            if t == EOT:
                break
            n.append(t)
        out.append(n)
    return out


def beam_reference(model, src, limit, K, alpha):
    """The same beam search for one source, without a cache or batching: every live
    hypothesis is scored from scratch at every step (the rule of `tlm.generate.beam`)."""
    live, finished = [(0.0, [])], []
    for t in range(1, limit + 1):
        candidates = []
        for score, seq in live:
            logp = torch.log_softmax(model(src, torch.tensor([[EOT, *seq]]))[0, -1].double(), -1)
            candidates += [(score + float(lp), seq, t) for t, lp in enumerate(logp)]
        candidates.sort(key=lambda c: -c[0])
        live = []
        for rank, (score, seq, token) in enumerate(candidates[: 2 * K]):
            if len(live) == K:
                break
            if token == EOT:
                if rank < K:  # its length counts the end token
                    finished.append((score / length_penalty(len(seq) + 1, alpha), seq))
            else:
                live.append((score, [*seq, token]))
        finished = sorted(finished, key=lambda h: -h[0])[:K]
        best_live = live[0][0] / length_penalty(t, alpha) if live else float("-inf")
        if len(finished) == K and finished[-1][0] >= best_live:
            break
    else:
        finished += [(s / length_penalty(len(q), alpha), q) for s, q in live]
    return max(finished, key=lambda h: h[0])[1]


@pytest.mark.parametrize("norm", ["pre", "post"])
def test_cached_greedy_equals_the_uncached_reference(norm):
    model = random_model(norm=norm)
    src, mask = sources()
    with torch.no_grad():
        got = greedy_translate(model, src, mask, EOT, max_new_tokens=8)
        expected = greedy_reference(model, src, mask, 8)
    assert got == expected and any(len(x) > 2 for x in got)


def test_beam_one_is_greedy():
    for seed in range(4):
        model = random_model(seed)
        src, mask = sources()
        assert beam_translate(model, src, mask, EOT, beams=1, max_new_tokens=8) == (
            greedy_translate(model, src, mask, EOT, max_new_tokens=8)
        )


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("alpha", [0.6, 2.0])
def test_batched_cached_beam_search_equals_the_reference_per_source(seed, alpha):
    model = random_model(seed)
    src, mask = sources()
    got = beam_translate(model, src, mask, EOT, beams=3, alpha=alpha, max_new_tokens=8)
    with torch.no_grad():
        for b in range(len(src)):
            row = src[b : b + 1, : int(mask[b].sum())]
            assert got[b] == beam_reference(model, row, 8, K=3, alpha=alpha)


def test_beams_find_what_greedy_misses():
    differ = 0
    for seed in range(4):
        model = random_model(seed)
        src, mask = sources()
        beam = beam_translate(model, src, mask, EOT, beams=3, max_new_tokens=8)
        differ += beam != greedy_translate(model, src, mask, EOT, max_new_tokens=8)
    assert differ > 0


def test_label_smoothed_loss_equals_its_formula():
    torch.manual_seed(0)
    logits, labels = torch.randn(2, 5, 11), torch.randint(0, 11, (2, 5))
    labels[1, 3:] = IGNORE
    for eps in (0.0, 0.1, 0.3):
        fast = label_smoothed_cross_entropy(logits, labels, eps)
        assert torch.allclose(
            fast.double(), label_smoothed_reference(logits, labels, eps), atol=1e-6
        )
    by_hand = -torch.log_softmax(logits[0, 0], -1)  # one position, ε = 0.1, V = 11
    one = (0.9 + 0.1 / 11) * by_hand[labels[0, 0]] + 0.1 / 11 * (
        by_hand.sum() - by_hand[labels[0, 0]]
    )
    single = labels.clone().fill_(IGNORE)
    single[0, 0] = labels[0, 0]
    assert torch.allclose(label_smoothed_cross_entropy(logits, single, 0.1), one, atol=1e-6)


def test_the_schedule_is_the_papers_formula():
    config = TrainConfig(schedule="inverse-sqrt", lr=1.0, warmup_steps=4000)
    for step in (0, 1, 99, 3999, 4000, 10000, 99999):
        n = step + 1
        paper = 512**-0.5 * min(n**-0.5, n * 4000**-1.5)  # Vaswani et al. eq. 3
        assert learning_rate(step, config, d_model=512) == pytest.approx(paper, rel=1e-12)
    peak = learning_rate(3999, config, d_model=512)
    assert peak > learning_rate(3000, config, 512) and peak > learning_rate(5000, config, 512)


WORDS = ["cat", "dog", "sun", "red", "big", "run", "sky", "hat", "cup", "pen"]


@pytest.mark.slow
def test_a_small_model_learns_to_translate_a_toy_language(tmp_path, capsys, gpt2_dir):
    """Source: words; target: each word reversed, in reverse order. Trained through
    `tlm prepare --task translate` and `tlm train`, the run translates held-out sentences.
    700 steps in fp32: seeds 0-5 with 1 and 2 threads all translate 4/4 (chrF 100); at 400
    steps one of them fell to chrF 85.8 here and another host saw 60.7. In bf16 autocast
    (`--precision auto` on a CPU with bf16 units) seed 1337 reached chrF 60.7 at 700 steps, 0
    and 1 100: the test pins fp32, where its margin was measured."""
    rng = random.Random(0)
    src, tgt = [], []
    for _ in range(600):
        words = rng.choices(WORDS, k=rng.randint(1, 3))
        src.append(" ".join(words))
        tgt.append(" ".join(w[::-1] for w in reversed(words)))
    (tmp_path / "a.src").write_text("\n".join(src) + "\n")
    (tmp_path / "a.tgt").write_text("\n".join(tgt) + "\n")
    data, run = tmp_path / "data", tmp_path / "run"
    pairs = ["--src", str(tmp_path / "a.src"), "--tgt", str(tmp_path / "a.tgt")]
    prepare = ["prepare", "--task", "translate", *pairs, "--tokenizer", "char", "--out", str(data)]
    assert main(prepare) == 0
    args = ["--d-model", "64", "--n-heads", "4", "--n-layers", "2", "--d-ff", "128"]
    args += ["--context-length", "16", "--batch-tokens", "256", "--lr", "0.3", "--warmup-steps"]
    args += ["60", "--max-steps", "700", "--dropout", "0", "--eval-interval", "350", "--quiet"]
    args += ["--precision", "float32"]
    assert main(["train", "--data", str(data), "--out", str(run), *args]) == 0
    model, tok = load_model(run), load_tokenizer(run)
    held_out = ["sun dog", "cup red pen", "hat", "sky big"]
    expected = [" ".join(w[::-1] for w in reversed(s.split())) for s in held_out]
    for beams in (1, 4):
        got = translate(model, tok, held_out, beams=beams)
        assert sum(g == e for g, e in zip(got, expected, strict=True)) >= 3, got
    capsys.readouterr()
    assert main(["translate", "--beams", "1", str(run), *held_out]) == 0  # the command line
    assert capsys.readouterr().out.splitlines() == translate(model, tok, held_out, beams=1)
    (tmp_path / "test.src").write_text("\n".join(held_out) + "\n")
    (tmp_path / "test.ref").write_text("\n".join(expected) + "\n")
    pairs = ["--src", str(tmp_path / "test.src"), "--ref", str(tmp_path / "test.ref")]
    assert main(["eval", str(run), "--task", "translate", *pairs, "--json"]) == 0
    scores = json.loads(capsys.readouterr().out)
    assert scores["pairs"] == 4 and scores["chrf"] > 80
    assert main(["inspect", str(run), "--prompt", "sun dog", "--out", str(tmp_path / "look")]) == 0
    assert "sun dog -> god nus" in capsys.readouterr().out
    assert (tmp_path / "look" / "cross-attention.png").is_file()
    assert (tmp_path / "look" / "cross-attention-L0.png").is_file()
    patterns, rows, keys = cross_attention_of(model, tok, "sun dog", "god nus")
    assert patterns.shape == (2, 4, len(rows), len(keys)) == (2, 4, 8, 8)
    assert torch.allclose(patterns.sum(-1), torch.ones(2, 4, 8), atol=1e-5)
    check_refusals(run, data, tmp_path, capsys, gpt2_dir)
    assert "val_loss" in (run / "metrics.jsonl").read_text()
    assert "encoder-decoder" in (run / "config.json").read_text()
    assert "target tokens seen" in (run / "MODEL_CARD.md").read_text()
    assert math.isfinite(float((run / "metrics.jsonl").read_text().count("train_loss")))


def check_refusals(run, data, tmp_path, capsys, language_model):
    """Bad input to the translation commands is one line and exit 2."""
    capsys.readouterr()
    cases = [
        (
            ["translate", str(run), "cat " * 20],
            "sentence 1 has 80 tokens; the model reads at most 16",
        ),
        (["generate", str(run), "--prompt", "cat"], "is an encoder-decoder (translation) model"),
        (["eval", str(run), "--data", str(data)], "is an encoder-decoder (translation) model"),
        (["translate", str(run)], "give sentences to translate, or --file FILE"),
        (["eval", str(run), "--task", "translate"], "needs --src FILE and --ref FILE"),
    ]
    pairs = ["--src", str(tmp_path / "test.src"), "--ref", str(tmp_path / "test.ref")]
    cases += [
        (["translate", str(language_model), "cat"], "is a language model: translation needs"),
        (["eval", str(language_model), "--task", "translate", *pairs], "is a language model"),
    ]
    (tmp_path / "short.tgt").write_text("one\n")
    pairs = ["--src", str(tmp_path / "a.src"), "--tgt", str(tmp_path / "short.tgt")]
    out = ["--out", str(tmp_path / "bad")]
    cases.append((["prepare", "--task", "translate", *pairs, *out], "the files diverge at line 2"))
    for argv, message in cases:
        assert main(argv) == 2, argv
        err = capsys.readouterr().err.strip()
        assert err.startswith("tlm: error:") and message in err and "\n" not in err, err
    assert not (tmp_path / "bad").exists()


@pytest.mark.slow
def test_a_resumed_translation_run_equals_an_uninterrupted_one(tmp_path):
    """Token-count batches are found again after a resume, across a pass over the data:
    6 steps, a resume, 6 more give the weights of 12 steps in one go."""
    import dataclasses

    from tlm.data import prepare_pairs
    from tlm.train import open_run
    from tlm.train.run import new_run_configs

    rng = random.Random(1)
    src = [" ".join(rng.choices(WORDS, k=rng.randint(1, 3))) for _ in range(200)]
    (tmp_path / "a.src").write_text("\n".join(src) + "\n")
    (tmp_path / "a.tgt").write_text("\n".join(s[::-1] for s in src) + "\n")
    data = tmp_path / "data"
    prepare_pairs(str(tmp_path / "a.src"), str(tmp_path / "a.tgt"), data, tokenizer="char")
    shape = {"d_model": 32, "n_heads": 2, "n_layers": 1, "d_ff": 64, "context_length": 16}
    shape["dropout"] = 0.0

    def configs(run):
        values = {"data": str(data), "out": str(run), "max_steps": 12, "batch_tokens": 128}
        values |= {"grad_accum": 4, "warmup_steps": 4, "checkpoint_interval": 1}
        return new_run_configs(shape, values)

    def trainer(made, steps, resume=False):
        model_config, config, pairs = made
        config = dataclasses.replace(config, max_steps=steps)
        tok = (data / "tokenizer.json").read_text()
        return open_run(model_config, config, pairs, tok, resume, progress_bar=False)

    whole = trainer(configs(tmp_path / "whole"), 12)
    whole.fit()
    assert whole.batches.epoch >= 1  # the 48 micro-batches went past one pass over the data
    parts = configs(tmp_path / "parts")
    trainer(parts, 6).fit()
    second = trainer(parts, 12, resume=True)
    assert second.state.step == 6
    second.fit()
    for name, value in whole.model.state_dict().items():
        assert torch.equal(value, second.model.state_dict()[name]), name
