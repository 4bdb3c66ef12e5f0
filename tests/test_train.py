import hashlib
import json
import math

import pytest
import torch

from conftest import tiny_config
from tlm import load_model
from tlm.checkpoint import latest_checkpoint
from tlm.cli import main
from tlm.config import ConfigError, TrainConfig
from tlm.data import batch_generator, prepare, random_windows
from tlm.evaluate import evaluate_tokens
from tlm.generate import GenerationConfig, complete
from tlm.model import TransformerLM
from tlm.model.loss import cross_entropy, cross_entropy_reference
from tlm.tokenizer import load_tokenizer
from tlm.train import Diverged, Trainer, new_run_configs, open_run
from tlm.train.optim import learning_rate, parameter_groups

TINY = ["--n-layers", "2", "--d-model", "32", "--n-heads", "2", "--context-length", "32"]
TINY += ["--batch-size", "8", "--warmup-steps", "5", "--log-interval", "5", "--quiet"]


def train(docs_chars, out, *extra):
    return main(["train", "--data", str(docs_chars), "--out", str(out), *TINY, *extra])


def test_cross_entropy_is_eq_10_51():
    torch.manual_seed(0)
    logits, targets = torch.randn(2, 5, 11), torch.randint(0, 11, (2, 5))
    assert torch.allclose(
        cross_entropy(logits, targets).double(), cross_entropy_reference(logits, targets)
    )


def test_schedule_warms_up_then_follows_a_cosine():
    c = TrainConfig(lr=1e-3, min_lr=1e-4, warmup_steps=10, max_steps=110)
    for step in range(10):  # linear warmup: lr·(s+1)/warmup
        assert learning_rate(step, c) == pytest.approx(1e-3 * (step + 1) / 10, rel=1e-12)
    # cosine from lr to min_lr over the 100 steps after warmup: at a quarter of the way it
    # has fallen by (1 - cos(π/4))/2 = 14.6% of the range, not the 25% a straight line falls
    for progress, kept in [(0, 1.0), (0.25, 0.8535534), (0.5, 0.5), (0.75, 0.1464466), (1, 0)]:
        expected = 1e-4 + kept * (1e-3 - 1e-4)
        assert learning_rate(10 + round(100 * progress), c) == pytest.approx(expected, rel=1e-6)
    assert learning_rate(500, c) == pytest.approx(1e-4)  # past max_steps it stays at min_lr


def test_no_weight_decay_on_biases_norms_and_embeddings():
    model = TransformerLM(tiny_config(tie_embeddings=False))
    decay, no_decay = parameter_groups(model, 0.1)
    names = {id(p): n for n, p in model.named_parameters()}
    decayed = {names[id(p)].rsplit(".", 1)[-1] for p in decay["params"]}
    kept = {names[id(p)].rsplit(".", 1)[-1] for p in no_decay["params"]}
    assert decayed == {"W_Q", "W_K", "W_V", "W_O", "W_1", "W_2", "W_U"}
    assert kept == {"E", "P", "gamma", "beta", "b_Q", "b_K", "b_V", "b_O", "b_1", "b_2"}
    assert no_decay["weight_decay"] == 0.0


@pytest.mark.slow
def test_train_writes_the_run_directory(docs_chars, tmp_path):
    run = tmp_path / "run"
    assert train(docs_chars, run, "--max-steps", "40", "--eval-interval", "20") == 0
    for name in ("config.json", "model.safetensors", "tokenizer.json", "metrics.jsonl"):
        assert (run / name).is_file(), name
    assert (run / "plots" / "loss.png").read_bytes()[:4] == b"\x89PNG"
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    train_losses = [r["train_loss"] for r in rows if "train_loss" in r]
    assert train_losses[-1] < train_losses[0] - 0.5  # it learns
    assert [r["step"] for r in rows if "val_loss" in r] == [20, 40]
    card = (run / "MODEL_CARD.md").read_text()
    for needle in ("Hallucination", "Memorisation", "tlm generate", "passes over", "not scanned"):
        assert needle in card
    assert "## Memorization and privacy (§10.10)" in card and "Not audited yet" in card
    from pydoc_data.topics import topics  # the corpus's own hash, computed here

    corpus = b"".join(topics[name].encode() for name in sorted(topics))
    assert f"| `python-docs` | {len(corpus):,} | `{hashlib.sha256(corpus).hexdigest()}` |" in card
    val_loss = [r["val_loss"] for r in rows if "val_loss" in r][-1]
    assert f"| final train loss (nats/token) | {train_losses[-1]:.4f} |" in card
    assert f"| final validation loss (nats/token) | {val_loss:.4f} |" in card
    model = load_model(run)
    assert f"{sum(p.numel() for p in model.parameters()):,} parameters" in card
    assert latest_checkpoint(run).name == "step-000040"
    assert (
        model.config.vocab_size == json.loads((docs_chars / "meta.json").read_text())["vocab_size"]
    )


def test_progress_in_a_log_file_is_a_line_per_interval(docs_chars, tmp_path, capsys):
    """`tlm train > log.txt`: no carriage-return refreshes of a bar, one line a log interval
    (the bar is for terminals)."""
    args = [a for a in TINY if a != "--quiet"]
    run = ["train", "--data", str(docs_chars), "--out", str(tmp_path / "run"), *args]
    assert main([*run, "--max-steps", "15"]) == 0
    err = capsys.readouterr().err
    assert "\r" not in err
    lines = [line for line in err.splitlines() if line.startswith("step ")]
    assert [line.split(":")[0] for line in lines] == ["step 5/15", "step 10/15", "step 15/15"]


@pytest.mark.slow
def test_toml_config_and_overrides(docs_chars, tmp_path, capsys):
    config = tmp_path / "run.toml"
    config.write_text('max_steps = 10\n[model]\nd_ff = 48\nposition = "rope"\n[train]\nlr = 3e-3\n')
    assert train(docs_chars, tmp_path / "run", "--config", str(config), "--lr", "2e-3") == 0
    saved = json.loads((tmp_path / "run" / "config.json").read_text())
    assert saved["model"]["d_ff"] == 48 and saved["model"]["position"] == "rope"
    assert saved["train"]["max_steps"] == 10
    assert saved["train"]["lr"] == 2e-3  # a flag overrides the file
    config.write_text("d_modle = 48\n")
    assert train(docs_chars, tmp_path / "run2", "--config", str(config)) == 2
    assert "unknown config key 'd_modle'" in capsys.readouterr().err


@pytest.mark.slow
def test_bad_runs_are_refused_with_one_line(docs_chars, tmp_path, capsys):
    run = tmp_path / "run"
    assert train(docs_chars, run, "--max-steps", "5") == 0
    assert train(docs_chars, run, "--max-steps", "5") == 2
    assert "already exists; pass --resume" in capsys.readouterr().err
    assert main(["train", "--out", str(run), "--resume", "--lr", "0.5"]) == 2
    err = capsys.readouterr().err
    assert "config differs" in err and "lr" in err and err.count("\n") == 1
    assert train(docs_chars, tmp_path / "r2", "--context-length", "1000000") == 2
    assert "fewer than one context window" in capsys.readouterr().err
    assert main(["train", "--out", str(tmp_path / "nothing"), "--resume"]) == 2
    assert train(tmp_path / "missing", tmp_path / "r3") == 2
    assert "not a prepared data folder" in capsys.readouterr().err


def test_tiny_corpus_shorter_than_a_window(tmp_path, capsys):
    text = tmp_path / "t.txt"
    text.write_text("too short")
    prepare([str(text)], tmp_path / "d", tokenizer="char", val_fraction=0, progress=False)
    assert train(tmp_path / "d", tmp_path / "run") == 2
    assert "fewer than one context window" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_nan_loss_stops_and_keeps_the_last_good_checkpoint(docs_chars, tmp_path):
    values = {
        "data": str(docs_chars),
        "out": str(tmp_path / "run"),
        "max_steps": 10,
        "batch_size": 4,
        "checkpoint_interval": 5,
        "eval_interval": 5,
    }
    model_config, train_config, token_data = new_run_configs(
        {"n_layers": 1, "d_model": 16, "n_heads": 2, "context_length": 16}, values
    )
    tokenizer_json = (docs_chars / "tokenizer.json").read_text()
    trainer = open_run(
        model_config,
        train_config.__class__.from_dict({**values, "max_steps": 5}),
        token_data,
        tokenizer_json,
        progress_bar=False,
    )
    trainer.fit()
    good = load_model(tmp_path / "run").state_dict()
    resumed = open_run(
        model_config, train_config, token_data, tokenizer_json, resume=True, progress_bar=False
    )
    with torch.no_grad():
        resumed.model.blocks[0].attn.W_Q.fill_(float("nan"))
    with pytest.raises(Diverged, match="loss became nan at step 6"):
        resumed.fit()
    assert latest_checkpoint(tmp_path / "run").name == "step-000005"
    after = load_model(tmp_path / "run").state_dict()
    assert all(torch.equal(good[k], after[k]) for k in good)
    assert all(math.isfinite(v.sum().item()) for v in after.values())


@pytest.mark.slow
def test_generate_and_eval_commands(docs_chars, tmp_path, capsys):
    run = tmp_path / "run"
    assert train(docs_chars, run, "--max-steps", "30") == 0
    capsys.readouterr()
    command = ["generate", str(run), "--prompt", "The", "--max-new-tokens", "20", "--seed", "3"]
    command.append("--do-sample")
    assert main(command) == 0
    first = capsys.readouterr().out
    model, tok = load_model(run), load_tokenizer(run)
    config = GenerationConfig(max_new_tokens=20, do_sample=True, seed=3, eos_token_id=tok.eot_id)
    (expected,) = complete(model, tok, ["The"], config)  # the library, same seed
    assert first == "The" + expected.text + "\n" and len(expected.tokens) > 0
    assert main(command) == 0 and capsys.readouterr().out == first  # a seed fixes the sample
    assert main([*command[:-3], "--seed", "4", "--do-sample"]) == 0
    assert capsys.readouterr().out != first  # and another seed draws another sample

    text = tmp_path / "t.txt"
    text.write_text("The list type.")  # shorter than one window: scored in one forward
    assert main(["eval", str(run), "--text", str(text), "--json"]) == 0
    scores = json.loads(capsys.readouterr().out)
    ids = torch.tensor([[tok.eot_id, *tok.encode("The list type.")]])
    expected = cross_entropy_reference(model(ids[:, :-1]), ids[:, 1:]).item()
    assert scores["loss"] == pytest.approx(expected, rel=1e-5)
    assert scores["perplexity"] == pytest.approx(math.exp(expected), rel=1e-5)
    assert scores["tokens"] == scores["bytes"] == len("The list type.")
    assert scores["bits_per_byte"] == pytest.approx(expected / math.log(2), rel=1e-5)

    assert main(["eval", str(run), "--data", str(docs_chars), "--split", "val", "--json"]) == 0
    scores = json.loads(capsys.readouterr().out)
    assert (
        scores["tokens"]
        == json.loads((docs_chars / "meta.json").read_text())["splits"]["val"]["tokens"] - 1
    )
    assert main(["generate", str(run), "--do-sample", "--top-k", "0"]) == 2
    assert "top_k must be >= 1, got 0" in capsys.readouterr().err


def first_step_gradients(docs_chars, tmp_path, **train):
    """A tiny trainer's gradients as its first optimizer step sees them, its reported norm,
    and a fresh copy of its starting model (to compute the same gradients by hand)."""
    values = {"data": str(docs_chars), "out": str(tmp_path / "run"), "max_steps": 1}
    values |= {"batch_size": 4, "precision": "float32", **train}  # fp32: compared by hand
    shape = {"n_layers": 1, "d_model": 16, "n_heads": 2, "context_length": 16}
    model_config, train_config, token_data = new_run_configs(shape, values)
    tokenizer_json = (docs_chars / "tokenizer.json").read_text()
    trainer = open_run(model_config, train_config, token_data, tokenizer_json, progress_bar=False)
    reference = TransformerLM(model_config)
    reference.load_state_dict(trainer.model.state_dict())
    seen, step = {}, trainer.optimizer.step

    def record_gradients(*args, **kwargs):
        seen.update({n: p.grad.clone() for n, p in trainer.model.named_parameters()})
        return step(*args, **kwargs)

    trainer.optimizer.step = record_gradients
    _, norm = trainer.train_step(0)
    return seen, norm, reference, token_data.split("train")


def test_gradient_accumulation_equals_one_big_batch(docs_chars, tmp_path):
    seen, _, reference, tokens = first_step_gradients(
        docs_chars, tmp_path, grad_accum=2, grad_clip=0.0
    )
    micro = [random_windows(tokens, 4, 16, batch_generator(1337, 0, m)) for m in (0, 1)]
    x, y = torch.cat([b[0] for b in micro]), torch.cat([b[1] for b in micro])
    cross_entropy(reference(x), y).backward()  # one batch of 8 = both micro-batches
    for name, param in reference.named_parameters():
        assert torch.allclose(seen[name], param.grad, atol=1e-6), name


@pytest.mark.slow
def test_eval_refuses_data_from_another_tokenizer(docs_chars, tmp_path, capsys):
    run = tmp_path / "run"
    assert train(docs_chars, run, "--max-steps", "2") == 0
    other = tmp_path / "other"
    prepare(["python-docs"], other, tokenizer="bpe", vocab_size=300, progress=False)
    assert main(["eval", str(run), "--data", str(other)]) == 2
    assert "was not tokenized with the tokenizer of" in capsys.readouterr().err


@pytest.mark.parametrize("clip", [0.05, 0.0])
def test_gradient_clipping_scales_the_whole_gradient_to_the_limit(docs_chars, tmp_path, clip):
    """g <- g · min(1, c/‖g‖) over all parameters together; 0 turns clipping off."""
    seen, norm, reference, tokens = first_step_gradients(docs_chars, tmp_path, grad_clip=clip)
    x, y = random_windows(tokens, 4, 16, batch_generator(1337, 0, 0))
    cross_entropy(reference(x), y).backward()
    raw = {n: p.grad for n, p in reference.named_parameters()}
    total = torch.sqrt(sum((g.double() ** 2).sum() for g in raw.values())).item()
    assert norm == pytest.approx(total, rel=1e-4)  # the norm before clipping is reported
    scale = min(1.0, clip / total) if clip > 0 else 1.0
    assert clip == 0 or scale < 0.5  # the limit really binds in the clipped case
    for name, grad in raw.items():
        assert torch.allclose(seen[name], grad * scale, atol=1e-7, rtol=1e-4), name
    clipped = torch.sqrt(sum((g.double() ** 2).sum() for g in seen.values())).item()
    assert clipped == pytest.approx(clip if clip > 0 else total, rel=1e-4)


def test_eval_tokens_zero_validates_on_the_whole_split(docs_chars, tmp_path):
    """--eval-tokens 0 scores every validation target, as `tlm eval` (tlm.evaluate) does."""
    values = {"data": str(docs_chars), "out": str(tmp_path / "run"), "max_steps": 1}
    values |= {"eval_tokens": 0, "precision": "float32"}  # tlm eval scores in fp32
    shape = {"n_layers": 1, "d_model": 16, "n_heads": 2, "context_length": 16}
    model_config, train_config, token_data = new_run_configs(shape, values)
    tokenizer_json = (docs_chars / "tokenizer.json").read_text()
    trainer = open_run(model_config, train_config, token_data, tokenizer_json, progress_bar=False)
    val = token_data.split("val")
    assert sum(b[:, 1:].numel() for b in trainer.batches.val_batches) == len(val) - 1 > 1 << 15
    whole = evaluate_tokens(trainer.model.eval(), val, load_tokenizer(docs_chars).token_bytes())
    assert trainer.validation_loss() == pytest.approx(whole["loss"], rel=1e-6)
    with pytest.raises(ConfigError, match="eval_tokens must be an integer >= 0"):
        TrainConfig(eval_tokens=-1)


def test_a_trainer_is_built_without_io_and_open_run_does_it(docs_chars, tmp_path):
    """`open_run` seeds and writes the run's files; building a `Trainer` from the parts
    touches neither the disk nor the global random state."""
    values = {"data": str(docs_chars), "out": str(tmp_path / "run"), "max_steps": 1}
    shape = {"n_layers": 1, "d_model": 16, "n_heads": 2, "context_length": 16}
    model_config, train_config, token_data = new_run_configs(shape, values | {"batch_size": 4})
    tokenizer_json = (docs_chars / "tokenizer.json").read_text()
    torch.manual_seed(99)
    opened = open_run(model_config, train_config, token_data, tokenizer_json, progress_bar=False)
    assert torch.initial_seed() == train_config.seed  # open_run seeds
    assert (tmp_path / "run" / "config.json").is_file()
    assert (tmp_path / "run" / "tokenizer.json").is_file()
    files, rng = sorted(tmp_path.rglob("*")), torch.random.get_rng_state()
    parts = (opened.batches, opened.model, opened.wrapped, opened.optimizer, opened.runtime)
    built = Trainer(model_config, train_config, *parts)
    assert sorted(tmp_path.rglob("*")) == files and torch.equal(torch.random.get_rng_state(), rng)
    assert built.model is opened.model and built.state.step == 0


def test_windows_at_documents_begin_with_their_first_token(docs_chars, tmp_path, monkeypatch):
    """`--windows documents`: every training window starts at a document's <|endoftext|>
    (with random windows most do not); a run of conversations refuses the flag."""
    from tlm.train import windows as windows_module

    firsts = []
    real = windows_module.windows_at

    def spied(tokens, starts, T):
        x, y = real(tokens, starts, T)
        firsts.extend(x[:, 0].tolist())
        return x, y

    monkeypatch.setattr(windows_module, "windows_at", spied)
    eot = load_tokenizer(docs_chars).eot_id
    steps = ["--max-steps", "3", "--eval-interval", "3"]
    assert train(docs_chars, tmp_path / "docs", *steps, "--windows", "documents") == 0
    assert len(firsts) == 24 and set(firsts) == {eot}
    firsts.clear()
    assert train(docs_chars, tmp_path / "random", *steps) == 0
    assert firsts.count(eot) < 12
