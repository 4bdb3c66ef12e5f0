"""A run always keeps a complete, finite checkpoint: bad gradients, crashes mid-save and
re-prepared data never cost the last good state."""

import json
import math
import os
import shutil

import pytest
import torch

from tlm.checkpoint import (
    CheckpointError,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
)
from tlm.cli import main
from tlm.data import prepare
from tlm.train import Diverged, new_run_configs, open_run

SHAPE = {"n_layers": 1, "d_model": 16, "n_heads": 2, "context_length": 16}


def trainer_for(docs_chars, run, **train):
    values = {"data": str(docs_chars), "out": str(run), "batch_size": 4, "max_steps": 6}
    values |= {"checkpoint_interval": 1, "eval_interval": 100, "log_interval": 1, **train}
    model_config, train_config, data = new_run_configs(SHAPE, values)
    tokenizer_json = (docs_chars / "tokenizer.json").read_text()
    return open_run(model_config, train_config, data, tokenizer_json, progress_bar=False)


def poison_gradient_at(trainer, bad_step):
    """At step `bad_step` (0-based) only, W_Q's gradient becomes inf; the loss stays finite."""
    calls = {"step": None}
    trainer.model.blocks[0].attn.W_Q.register_hook(
        lambda g: g * math.inf if calls["step"] == bad_step else g
    )
    step = trainer.train_step

    def counting(s):
        calls["step"] = s
        return step(s)

    trainer.train_step = counting


def weights(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def same(a, b):
    return all(torch.equal(a[k], b[k]) for k in a)


def metrics(run):
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_a_nonfinite_gradient_is_skipped_counted_and_never_saved(docs_chars, tmp_path):
    trainer = trainer_for(docs_chars, tmp_path / "run")
    poison_gradient_at(trainer, bad_step=3)
    before = {}
    step = trainer.optimizer.step

    def remember(*args, **kwargs):  # the weights after every real update
        out = step(*args, **kwargs)
        before[trainer.state.step] = weights(trainer.model)
        return out

    trainer.optimizer.step = remember
    trainer.fit()  # finishes: the bad step made no update
    assert sorted(before) == [0, 1, 2, 4, 5]  # no optimizer step at step index 3
    rows = {r["step"]: r for r in metrics(tmp_path / "run") if "train_loss" in r}
    assert [rows[s]["skipped_steps"] for s in range(1, 7)] == [0, 0, 0, 1, 1, 1]
    assert rows[4]["grad_norm"] is None and math.isfinite(rows[5]["grad_norm"])
    assert math.isfinite(rows[4]["train_loss"])
    folder = latest_checkpoint(tmp_path / "run")
    assert json.loads((folder / "state.json").read_text())["skipped"] == 1
    saved = trainer_for(docs_chars, tmp_path / "other").model
    load_checkpoint(folder, saved, trainer.optimizer)
    assert all(torch.isfinite(v).all() for v in saved.state_dict().values())


def test_a_nonfinite_gradient_can_stop_the_run_instead(docs_chars, tmp_path):
    trainer = trainer_for(docs_chars, tmp_path / "run", nonfinite_grad="stop")
    poison_gradient_at(trainer, bad_step=3)
    with pytest.raises(Diverged, match="gradient norm became inf at step 4"):
        trainer.fit()
    assert latest_checkpoint(tmp_path / "run").name == "step-000003"


def test_grad_clip_zero_still_skips_a_nonfinite_gradient(docs_chars, tmp_path):
    trainer = trainer_for(docs_chars, tmp_path / "run", grad_clip=0.0, max_steps=2)
    poison_gradient_at(trainer, bad_step=0)
    start = weights(trainer.model)
    loss, norm = trainer.train_step(0)
    assert math.isfinite(loss) and norm == math.inf
    assert all(torch.equal(start[k], v) for k, v in weights(trainer.model).items())


def test_nonfinite_weights_are_never_saved(make_model, tmp_path):
    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters())
    good = save_checkpoint(tmp_path, model, optimizer, {"step": 1})
    with torch.no_grad():
        model.blocks[1].ffn.W_2[0, 0] = float("nan")
    with pytest.raises(CheckpointError, match="blocks.1.ffn.W_2 holds NaN or inf"):
        save_checkpoint(tmp_path, model, optimizer, {"step": 2})
    assert latest_checkpoint(tmp_path) == good
    assert sorted(p.name for p in (tmp_path / "train_state").iterdir()) == ["latest", good.name]


class Crash(Exception):
    pass


def crash_on_call(monkeypatch, n):
    """The n-th rename, hard link or folder removal from now on raises Crash."""
    calls = [0]

    def failing(real):
        def call(*args, **kwargs):
            calls[0] += 1
            if calls[0] == n:
                raise Crash(real.__name__)
            return real(*args, **kwargs)

        return call

    monkeypatch.setattr(os, "replace", failing(os.replace))
    monkeypatch.setattr(os, "link", failing(os.link))
    monkeypatch.setattr(shutil, "rmtree", failing(shutil.rmtree))


@pytest.mark.parametrize("next_step", [1, 2], ids=["same step again", "next step"])
def test_a_crash_at_any_point_of_a_save_leaves_a_complete_checkpoint(
    make_model, tmp_path, monkeypatch, next_step
):
    """Crash at the 1st, 2nd, ... rename, link or removal of a save: `latest` always names a
    complete checkpoint holding either the old or the new weights."""
    model, fresh = make_model(seed=0), make_model(seed=1)
    optimizer = torch.optim.AdamW(model.parameters())
    save_checkpoint(tmp_path, model, optimizer, {"step": 1})
    old = weights(model)
    crash_at, completed = 0, False
    while not completed:
        crash_at += 1
        with torch.no_grad():
            model.embedding.E.add_(1.0)  # a new version to save
        new = weights(model)
        crash_on_call(monkeypatch, crash_at)
        try:
            save_checkpoint(tmp_path, model, optimizer, {"step": next_step})
            completed = True
        except Crash:
            pass
        finally:
            monkeypatch.undo()
        folder = latest_checkpoint(tmp_path)  # never names a missing or partial folder
        state = load_checkpoint(folder, fresh, torch.optim.AdamW(fresh.parameters()))
        now = weights(fresh)
        assert state["step"] in (1, next_step)
        assert same(now, old) or same(now, new)
        old = now  # what the run holds now is the version the next crash may fall back to
    assert crash_at > 3  # the loop did crash the save at several points


@pytest.mark.slow
def test_resume_refuses_data_prepared_again_from_other_text(tmp_path, capsys):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("the quick brown fox jumps over the lazy dog\n" * 200)
    data, run = tmp_path / "data", tmp_path / "run"
    prepare([str(corpus)], data, tokenizer="char", progress=False)
    args = ["train", "--data", str(data), "--out", str(run), "--n-layers", "1", "--d-model", "16"]
    args += ["--n-heads", "2", "--context-length", "16", "--batch-size", "2", "--quiet"]
    assert main([*args, "--max-steps", "4", "--checkpoint-interval", "2"]) == 0
    resume = ["train", "--out", str(run), "--resume", "--quiet"]

    other = tmp_path / "other.txt"  # the same characters, so the same vocabulary
    other.write_text("the lazy dog jumps over the quick brown fox\n" * 180)
    prepare([str(other)], data, tokenizer=str(data), force=True, progress=False)
    capsys.readouterr()
    assert main(resume) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "is not the data this run was trained on" in err
    assert "source 1 (" in err and "sha256" in err and "tokens" in err

    prepare([str(corpus)], data, tokenizer=str(data), force=True, progress=False)
    assert main(resume) == 0  # the same text prepared again is the same data
