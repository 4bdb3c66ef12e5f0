"""One process writes a run at a time; readers never see a half-written checkpoint."""

import json
import os
import subprocess
import sys
import time

import pytest
import torch

from tlm import load_model, load_tokenizer
from tlm.checkpoint import CheckpointError, latest_checkpoint, lock_run
from tlm.cli import main

ARGS = ["--n-layers", "1", "--d-model", "16", "--n-heads", "2", "--context-length", "16"]
ARGS += ["--batch-size", "2", "--eval-interval", "1000", "--quiet"]


def command(docs_chars, run, *extra):
    return [*ARGS, "--data", str(docs_chars), "--out", str(run), *extra]


def start(docs_chars, run, *extra):
    args = [sys.executable, "-m", "tlm", "train", *command(docs_chars, run, *extra)]
    return subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_for(condition, proc, timeout=120):
    deadline = time.monotonic() + timeout
    while not condition():
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


@pytest.mark.slow
def test_a_second_writer_is_refused_naming_the_holder(docs_chars, tmp_path, capsys):
    run = tmp_path / "run"
    proc = start(
        docs_chars,
        run,
        "--max-steps",
        "100000",
        "--checkpoint-interval",
        "5",
        "--log-interval",
        "1",
    )
    try:
        wait_for(lambda: (run / "train_state" / "latest").is_file(), proc)
        for extra in ([], ["--resume"]):
            args = ["train", *command(docs_chars, run, "--max-steps", "100000")]
            args += ["--checkpoint-interval", "5", *extra]
            assert main(args) == 2
            err = capsys.readouterr().err
            assert err.count("\n") == 1 and f"being written by process {proc.pid}" in err
        with pytest.raises(CheckpointError, match=str(proc.pid)), lock_run(run):
            pass
    finally:
        proc.kill()  # SIGKILL: the OS releases the lock
        proc.wait()
    latest_checkpoint(run)  # complete
    with lock_run(run):  # free again
        pass
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in rows]
    assert steps == sorted(set(steps))  # one writer: no line written twice


@pytest.mark.slow
def test_two_runs_started_together_one_wins(docs_chars, tmp_path):
    run = tmp_path / "run"
    procs = [start(docs_chars, run, "--max-steps", "30") for _ in range(2)]
    results = [p.communicate(timeout=300) for p in procs]
    codes = sorted(p.returncode for p in procs)
    assert codes == [0, 2], results
    loser = next(err for p, (_, err) in zip(procs, results, strict=True) if p.returncode == 2)
    winner = next(p.pid for p in procs if p.returncode == 0)
    assert loser.count("\n") == 1
    assert f"being written by process {winner}" in loser or "already exists" in loser
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "train_loss" in r] == list(range(10, 31, 10))


@pytest.mark.slow
def test_readers_see_only_complete_checkpoints_while_a_run_trains(docs_chars, tmp_path):
    run = tmp_path / "run"
    proc = start(docs_chars, run, "--max-steps", "3000", "--checkpoint-interval", "1")
    loads = 0
    try:
        wait_for(lambda: (run / "model.safetensors").exists(), proc)
        while proc.poll() is None and loads < 200:
            model = load_model(run)  # config.json, model.safetensors: each replaced whole
            assert all(torch.isfinite(p).all() for p in model.parameters())
            assert load_tokenizer(run).vocab_size == model.config.vocab_size
            loads += 1
    finally:
        proc.kill()
        proc.wait()
    assert loads > 20, f"only {loads} reads happened while the run trained"
    assert os.path.exists(run / "config.json")
