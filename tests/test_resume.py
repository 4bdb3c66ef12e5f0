"""A run that is killed (or stopped with Ctrl-C) and resumed ends exactly where an
uninterrupted run ends: same data order, optimizer state, schedule and random state."""

import json
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file

from tlm.checkpoint import latest_checkpoint
from tlm.cli import main
from tlm.data import prepare

STEPS = 120
ARGS = ["--n-layers", "2", "--d-model", "32", "--n-heads", "2", "--context-length", "32"]
ARGS += ["--batch-size", "8", "--warmup-steps", "20", "--max-steps", str(STEPS)]
ARGS += ["--checkpoint-interval", "10", "--eval-interval", "50", "--dropout", "0.1", "--quiet"]


@pytest.fixture(scope="module")
def uninterrupted(docs_chars, tmp_path_factory):
    run = tmp_path_factory.mktemp("runs") / "whole"
    assert main(["train", "--data", str(docs_chars), "--out", str(run), *ARGS]) == 0
    return run


def start(docs_chars, run):
    command = [sys.executable, "-m", "tlm", "train", "--data", str(docs_chars), "--out", str(run)]
    return subprocess.Popen([*command, *ARGS], stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def wait_for_checkpoint(run, proc, at_least: int, timeout: float = 120) -> int:
    """The step `latest` names once it reaches `at_least` (the pointer is replaced in one
    rename, so reading it never fails half-way)."""
    pointer = run / "train_state" / "latest"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, "the run ended before it could be interrupted"
        if pointer.is_file() and int(pointer.read_text().split("-")[1]) >= at_least:
            return int(pointer.read_text().split("-")[1])
        time.sleep(0.005)
    raise AssertionError("no checkpoint appeared in time")


def final(run):
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    last_train = [r["train_loss"] for r in rows if "train_loss" in r][-1]
    vals = [(r["step"], r["val_loss"]) for r in rows if "val_loss" in r]
    return last_train, vals, load_file(str(run / "model.safetensors"))


def assert_same_end(run, reference):
    loss, vals, weights = final(run)
    ref_loss, ref_vals, ref_weights = final(reference)
    assert loss == ref_loss and vals == ref_vals
    assert weights.keys() == ref_weights.keys()
    assert all(torch.equal(weights[k], ref_weights[k]) for k in weights)


@pytest.mark.slow
def test_killed_run_resumes_to_the_same_final_loss(docs_chars, uninterrupted, tmp_path):
    run = tmp_path / "killed"
    proc = start(docs_chars, run)
    step = wait_for_checkpoint(run, proc, at_least=40)
    proc.kill()  # SIGKILL: no chance to save anything more
    proc.wait()
    assert step < STEPS
    assert int(latest_checkpoint(run).name.split("-")[1]) >= step  # complete, or this raises
    assert main(["train", "--out", str(run), "--resume", "--quiet"]) == 0
    assert_same_end(run, uninterrupted)


@pytest.mark.slow
def test_ctrl_c_saves_and_resumes_to_the_same_final_loss(docs_chars, uninterrupted, tmp_path):
    run = tmp_path / "interrupted"
    proc = start(docs_chars, run)
    wait_for_checkpoint(run, proc, at_least=30)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130
    saved = int(latest_checkpoint(run).name.split("-")[1])
    assert f"saved step {saved}" in err.decode() and "--resume" in err.decode()
    assert main(["train", "--out", str(run), "--resume", "--quiet"]) == 0
    assert_same_end(run, uninterrupted)


@pytest.mark.slow
def test_fine_tune_from_a_run(docs_chars, uninterrupted, tmp_path, capsys):
    text = tmp_path / "more.txt"
    text.write_text("def f(x):\n    return x + 1\n" * 200)
    tuned_data = tmp_path / "more"
    prepare([str(text)], tuned_data, tokenizer=str(uninterrupted), progress=False)
    run = tmp_path / "tuned"
    args = [
        "train",
        "--data",
        str(tuned_data),
        "--out",
        str(run),
        "--init-from",
        str(uninterrupted),
    ]
    assert main([*args, "--max-steps", "1", "--warmup-steps", "0", "--batch-size", "4"]) == 0
    assert json.loads((run / "config.json").read_text())["model"]["d_model"] == 32
    start_weights = load_file(str(uninterrupted / "model.safetensors"))
    after = load_file(str(run / "model.safetensors"))
    moved = max((after[k] - start_weights[k]).abs().max().item() for k in after)
    assert 0 < moved < 0.01  # one small step away from the pretrained weights

    other = tmp_path / "other"
    prepare([str(text)], other, tokenizer="char", progress=False)
    bad = ["train", "--data", str(other), "--out", str(tmp_path / "x"), "--init-from"]
    assert main([*bad, str(uninterrupted), "--quiet"]) == 2
    assert "not tokenized with the tokenizer of" in capsys.readouterr().err
    bad = ["train", "--data", str(tuned_data), "--out", str(tmp_path / "y"), "--init-from"]
    assert main([*bad, str(uninterrupted), "--d-model", "64", "--quiet"]) == 2
    assert "fixes the model; d_model" in capsys.readouterr().err
