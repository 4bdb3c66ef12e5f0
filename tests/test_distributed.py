"""Training on two processes (torchrun, DDP over gloo on CPU) equals one process that used
the same global batch, writes its run once, and resumes across a change of world size."""

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tlm.checkpoint import CheckpointError, check_unlocked
from tlm.cli import main
from tlm.data import TokenData, eval_windows
from tlm.load import load_model
from tlm.model.loss import window_nll
from tlm.train import RunError, Runtime

pytestmark = pytest.mark.slow  # every test here starts processes or a server

STEPS = 40
ARGS = ["--n-layers", "2", "--d-model", "32", "--n-heads", "2", "--context-length", "32"]
ARGS += ["--batch-size", "2", "--grad-accum", "4"]  # a global batch of 8: 2 x 2 a rank
ARGS += ["--warmup-steps", "10", "--lr", "3e-3"]
ARGS += ["--checkpoint-interval", "10", "--eval-interval", "20", "--log-interval", "10"]
ARGS += ["--max-steps", str(STEPS), "--dropout", "0", "--quiet"]
ARGS += ["--precision", "float32"]  # bf16's rounding would tell the all-reduce's order apart
EVAL_TOKENS = 2 * 32 * 32 + 5  # validation: 3 batches (32, 32, 1 windows), uneven over 2 ranks
ARGS += ["--eval-tokens", str(EVAL_TOKENS), "--keep-best"]


def torchrun(*args, nproc=2):
    """`torchrun --standalone --nproc_per_node=nproc -m tlm ...`."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command += [f"--nproc_per_node={nproc}", "-m", "tlm", *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)


def finish(proc, timeout=240):
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, err.decode()[-3000:]
    return out.decode(), err.decode()


@pytest.fixture(scope="module")
def single(docs_chars, tmp_path_factory):
    run = tmp_path_factory.mktemp("runs") / "single"
    assert main(["train", "--data", str(docs_chars), "--out", str(run), *ARGS]) == 0
    return run


MODES = {"ddp": [], "fsdp": ["--fsdp"]}  # FSDP2 also shards weights and optimizer state


@pytest.fixture(scope="module", params=list(MODES))
def double(request, docs_chars, tmp_path_factory):
    run = tmp_path_factory.mktemp("runs") / request.param
    args = ["train", "--data", str(docs_chars), "--out", str(run), *ARGS, *MODES[request.param]]
    out, _ = finish(torchrun(*args))
    assert out.count("done: step") == 1  # one rank reports
    return run


def rows(run):
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def assert_close_weights(run, reference, atol=1e-5, file="model.safetensors"):
    """Every weight within atol, except the key bias b_K: its gradient is 0 in exact
    arithmetic (q·b_K is added to every score of a query, and softmax ignores a constant),
    so Adam turns rounding noise into steps of ~lr, different for any order of summation."""
    weights, expected = (load_file(str(r / file)) for r in (run, reference))
    assert weights.keys() == expected.keys()
    for name in weights:
        if not name.endswith("b_K"):
            assert torch.allclose(weights[name], expected[name], atol=atol), name


def test_two_processes_equal_one_with_the_same_global_batch(single, double):
    assert_close_weights(double, single)
    train = [r for r in rows(double) if "train_loss" in r]
    assert [r["step"] for r in train] == list(range(10, STEPS + 1, 10))  # written once
    expected = [r["train_loss"] for r in rows(single) if "train_loss" in r]
    assert [r["train_loss"] for r in train] == pytest.approx(expected, abs=1e-4)  # all ranks'
    assert train[-1]["train_loss"] < train[0]["train_loss"] - 0.5
    assert train[0]["tokens"] == 10 * 8 * 32  # the tokens of every rank
    assert [p.name for p in (double / "train_state").glob("step-*")] == [f"step-{STEPS:06d}"]
    assert (double / "MODEL_CARD.md").is_file() and (double / "plots" / "loss.png").is_file()


def test_a_sharded_runs_checkpoint_loads_in_one_process(docs_chars, double):
    """The last validation loss, computed by the (sharded) model of the run with its
    batches split over the ranks, equals the loss of the saved weights loaded in one
    process."""
    model = load_model(double).eval()
    windows = eval_windows(TokenData(docs_chars).split("val"), 32, EVAL_TOKENS)
    with torch.no_grad():
        loss = torch.cat([window_nll(model, w).flatten() for w in windows]).mean().item()
    logged = [r["val_loss"] for r in rows(double) if "val_loss" in r][-1]
    assert loss == pytest.approx(logged, abs=1e-6)


def test_the_best_weights_are_gathered_and_written_once(single, double):
    """--keep-best on two processes (DDP, or FSDP's shards gathered): the best weights equal
    one process's, at the step of the lowest logged validation loss."""
    assert_close_weights(double, single, file="best.safetensors")
    logged = {r["step"]: r["val_loss"] for r in rows(double) if "val_loss" in r}
    state = json.loads((double / "train_state" / f"step-{STEPS:06d}" / "state.json").read_text())
    assert state["best_loss"] == min(logged.values()) == logged[state["best_step"]]


def kill_at_a_checkpoint(proc, run, at_least, timeout=120):
    """SIGKILL the run (torchrun and its ranks) once a checkpoint at or after `at_least`
    exists: nothing gets a chance to save more."""
    pointer = run / "train_state" / "latest"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, "the run ended before it could be killed"
        if pointer.is_file() and int(pointer.read_text().split("-")[1]) >= at_least:
            pids = [proc.pid, *descendants(proc.pid)]  # torchrun's ranks have sessions
            for pid in pids:  # of their own
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            proc.wait()
            while locked(run):  # until the last thread of each rank has closed its files
                assert time.monotonic() < deadline, "the killed run still holds its lock"
                time.sleep(0.01)
            step = int(pointer.read_text().split("-")[1])
            assert step < STEPS
            return step
        time.sleep(0.005)
    raise AssertionError("no checkpoint appeared in time")


def descendants(pid: int) -> list[int]:
    """Every process below `pid`, from the parent ids in /proc."""
    parents = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            parents.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        children = parents.get(todo.pop(), [])
        found += children
        todo += children
    return found


def locked(run) -> bool:
    try:
        check_unlocked(run)
        return False
    except CheckpointError:
        return True


def assert_continues(run, reference, killed_at):
    """The resumed run's curve goes on from the checkpoint to the reference's end."""
    train = [r for r in rows(run) if "train_loss" in r]
    assert [r["step"] for r in train] == list(range(10, STEPS + 1, 10))
    expected = [r["train_loss"] for r in rows(reference) if "train_loss" in r]
    assert [r["train_loss"] for r in train] == pytest.approx(expected, abs=1e-4)
    assert_close_weights(run, reference)
    assert killed_at < STEPS


@pytest.mark.parametrize("mode", list(MODES))
def test_a_run_resumes_across_changes_of_world_size(docs_chars, single, tmp_path, mode):
    """One process, killed; resumed on two, killed again; resumed in one to the end: both
    changes of world size in one run, whose curve and weights are the uninterrupted one's."""
    run = tmp_path / "one-two-one"
    command = [sys.executable, "-m", "tlm", "train", "--data", str(docs_chars), "--out", str(run)]
    first = kill_at_a_checkpoint(subprocess.Popen([*command, *ARGS]), run, at_least=10)
    resumed = torchrun("train", "--out", str(run), "--resume", "--quiet", *MODES[mode])
    second = kill_at_a_checkpoint(resumed, run, at_least=first + 10)
    assert main(["train", "--out", str(run), "--resume", "--quiet"]) == 0
    assert_continues(run, single, second)


def test_bad_distributed_runs_are_refused_with_one_line(docs_chars, tmp_path, capsys):
    run = tmp_path / "run"
    assert main(["train", "--data", str(docs_chars), "--out", str(run), *ARGS, "--fsdp"]) == 2
    assert "--fsdp shards a model over several processes" in capsys.readouterr().err
    assert not run.exists()
    odd = [*ARGS, "--batch-size", "3", "--grad-accum", "1"]  # 3 windows do not split in two
    proc = torchrun("train", "--data", str(docs_chars), "--out", str(run), *odd)
    _, err = proc.communicate()
    assert proc.returncode != 0 and "does not split evenly over 2 processes" in err.decode()
    assert not (run / "train_state").exists()


def test_a_rank_that_cannot_join_says_so_in_one_line(docs_chars, tmp_path, monkeypatch, capsys):
    """Processes started without torchrun's agent: a missing or out-of-range rank, and a
    rank whose master never answers, are one-line errors, not tracebacks."""
    run = tmp_path / "run"
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.delenv("RANK", raising=False)
    assert main(["train", "--data", str(docs_chars), "--out", str(run), *ARGS]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        "tlm: error: WORLD_SIZE=2 but RANK=(unset): start the processes with "
        "torchrun --nproc_per_node=K -m tlm train ..."
    )
    monkeypatch.setenv("RANK", "2")
    assert main(["train", "--data", str(docs_chars), "--out", str(run), *ARGS]) == 2
    assert "WORLD_SIZE=2 but RANK=2" in capsys.readouterr().err
    assert not run.exists()
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for name, value in {"RANK": "1", "LOCAL_RANK": "1", "MASTER_ADDR": "127.0.0.1"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("MASTER_PORT", str(port))
    with pytest.raises(RunError, match=rf"^rank 1 of 2 could not join at 127.0.0.1:{port}: "):
        Runtime.from_env(timeout_s=1)
