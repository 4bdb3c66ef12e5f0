"""Run directories: what `train` writes and everything else reads.

    RUN/config.json          {"model": ModelConfig, "train": TrainConfig, "tlm": version}
    RUN/model.safetensors    the latest weights (a tied E is stored once)
    RUN/best.safetensors     with --keep-best: the weights of the lowest validation loss
    RUN/tokenizer.json
    RUN/train_state/latest   names the newest complete checkpoint, e.g. "step-000500"
    RUN/train_state/step-000500/{model,optimizer}.safetensors, state.json

A checkpoint folder is written in full under a temporary name and renamed to a name no
other folder has (a second save of one step gets `step-000500-1`); only then does `latest`
(rewritten atomically) point to it, and only then are older ones removed. A crash at any
moment leaves `latest` naming a complete checkpoint. Weights that are not finite are never
saved. Nothing is loaded through pickle: tensors go through safetensors, everything else
through JSON.

One process writes a run at a time: `lock_run` holds an OS lock on RUN/.lock (released
when the process ends, however it ends); readers need no lock, since every file they read
is replaced in one rename.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from tlm._version import __version__
from tlm.config import ModelConfig
from tlm.errors import UserError
from tlm.io import atomic_path, write_text_atomic
from tlm.tensor_files import LazyMatrix, TensorFiles

STATE_DIR = "train_state"
BEST = "best.safetensors"  # written by a run trained with --keep-best
WEIGHTS = {"latest": "model.safetensors", "best": BEST}  # what `load_model(weights=...)` reads
LOCK = ".lock"  # held by the one process writing the run (`lock_run`)
# everything a run directory holds (and the demo's marker): `io.check_replaceable` reads it
FILES = (
    "config.json",
    "model.safetensors",
    BEST,
    "tokenizer.json",
    "metrics.jsonl",
    "MODEL_CARD.md",
    "plots/*.png",
    f"{STATE_DIR}/latest",
    f"{STATE_DIR}/step-*/*",
    LOCK,
    ".tlm-demo",
)


class CheckpointError(UserError):
    """A run directory or checkpoint that cannot be read or written."""


class NonFiniteWeights(CheckpointError):
    """Weights holding NaN or inf, which are never saved."""


def save_weights(
    path: str | Path,
    model: nn.Module | dict[str, torch.Tensor],
    metadata: dict[str, str] | None = None,
) -> None:
    """Write a model's weights (or a state dict of them) to safetensors, atomically, with
    `metadata` (strings) beside tlm's version in the file's header."""
    weights = model.state_dict() if isinstance(model, nn.Module) else model
    tensors = {k: v.detach().contiguous().cpu() for k, v in weights.items()}
    bad = next((k for k, v in tensors.items() if not torch.isfinite(v).all()), None)
    if bad is not None:
        raise NonFiniteWeights(f"{bad} holds NaN or inf; not saved over the last good weights")
    with atomic_path(path) as tmp:
        header = {**(metadata or {}), "format": "pt", "tlm": __version__}
        save_file(tensors, str(tmp), metadata=header)


def load_weights(path: str | Path, model: nn.Module) -> None:
    try:
        tensors = load_file(str(path))
    except Exception as exc:
        raise CheckpointError(f"cannot read weights {path}: {exc}") from None
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    _check_fit(path, missing, unexpected)


def run_weights(
    run: str | Path, weights: str, names: list[str], lazy: tuple[str, ...] = ()
) -> Iterator[tuple[str, torch.Tensor | LazyMatrix]]:
    """A run's latest or best weights one tensor at a time, each read when it is reached,
    in the order of `names` (a model's state dict, which the file must fit); the names in
    `lazy` come as a `LazyMatrix` left in the file."""
    path = weights_file(run, weights)
    try:
        tensors = TensorFiles([path])
    except Exception as exc:
        raise CheckpointError(f"cannot read weights {path}: {exc}") from None
    _check_fit(path, sorted(set(names) - set(tensors)), sorted(set(tensors) - set(names)))
    return ((name, tensors.lazy(name) if name in lazy else tensors[name]) for name in names)


def _check_fit(path: Path, missing: list[str], unexpected: list[str]) -> None:
    if missing or unexpected:
        raise CheckpointError(
            f"{path} does not fit the config: missing {missing[:3]}, unexpected {unexpected[:3]}"
        )


def write_config(
    run: Path,
    model_config: ModelConfig,
    train: dict[str, Any],
    data: dict[str, Any] | None = None,
    precision: dict[str, str] | None = None,
) -> None:
    """config.json: the model, the training settings, what the data was made of, and the
    precision `--dtype` came to on this machine (`train.precision.Precision`)."""
    payload = {"model": model_config.to_dict(), "train": train, "tlm": __version__}
    if data is not None:
        payload["data"] = data
    if precision is not None:
        payload["precision"] = precision
    write_text_atomic(run / "config.json", json.dumps(payload, indent=2) + "\n")


def read_config(run: str | Path) -> dict[str, Any]:
    path = Path(run) / "config.json"
    if not path.is_file():
        raise CheckpointError(f"{run} is not a run directory (no config.json)")
    try:
        payload = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{path} is not valid JSON: {exc}") from None
    if "model" not in payload:
        raise CheckpointError(f"{path} has no 'model' section")
    return payload


def run_model_config(run: str | Path) -> ModelConfig:
    return ModelConfig.from_dict(read_config(run)["model"])


def weights_file(run: str | Path, weights: str = "latest") -> Path:
    """The file of a run's latest weights or (`weights="best"`) of its best ones."""
    if weights not in WEIGHTS:
        raise CheckpointError(f"weights must be one of {', '.join(WEIGHTS)}; got {weights!r}")
    path = Path(run) / WEIGHTS[weights]
    if not path.is_file() and weights == "best":
        raise CheckpointError(
            f"{run} has no {BEST}: only a run trained with --keep-best keeps the weights of "
            "its lowest validation loss (from its first evaluation on)"
        )
    if not path.is_file():
        raise CheckpointError(f"{run} has no {path.name} yet")
    return path


def latest_checkpoint(run: str | Path) -> Path | None:
    pointer = Path(run) / STATE_DIR / "latest"
    if not pointer.is_file():
        return None
    folder = pointer.parent / pointer.read_text().strip()
    if not (folder / "state.json").is_file():
        raise CheckpointError(f"{pointer} names {folder.name}, which is incomplete")
    return folder


def save_checkpoint(
    run: Path,
    model: nn.Module | dict[str, torch.Tensor],
    optimizer: torch.optim.Optimizer | dict[str, Any],
    state: dict[str, Any],
) -> Path:
    """Write train_state/step-N atomically, point `latest` at it, refresh model.safetensors.
    The model and optimizer may be given as their (full) state dicts, as FSDP gathers them."""
    root = run / STATE_DIR
    root.mkdir(parents=True, exist_ok=True)
    folder = _unused_name(root, f"step-{state['step']:06d}")
    with atomic_path(folder) as tmp:
        tmp.mkdir()
        save_weights(tmp / "model.safetensors", model)
        tensors, groups = _flatten_optimizer(optimizer)
        tensors["rng.cpu"] = torch.get_rng_state()
        if torch.cuda.is_available():
            tensors["rng.cuda"] = torch.cuda.get_rng_state()
        save_file(tensors, str(tmp / "optimizer.safetensors"))
        (tmp / "state.json").write_text(json.dumps({**state, "param_groups": groups}, indent=2))
    write_text_atomic(root / "latest", folder.name + "\n")
    _link_or_copy(folder / "model.safetensors", run / "model.safetensors")
    for old in [*root.glob("step-*"), *root.glob(".step-*")]:  # and what a crash left
        if old != folder:
            shutil.rmtree(old, ignore_errors=True)
    return folder


def _unused_name(root: Path, name: str) -> Path:
    """`name`, or `name-1`, `name-2`, ... if a folder of that name exists (a second save of
    one step): a save never deletes or overwrites the folder `latest` may name."""
    folder, n = root / name, 0
    while folder.exists():
        n += 1
        folder = root / f"{name}-{n}"
    return folder


def load_checkpoint(
    folder: Path, model: nn.Module, optimizer: torch.optim.Optimizer | None
) -> dict[str, Any]:
    """Restore weights, optimizer and RNG from a checkpoint folder; returns its state.json,
    with the optimizer's state dict under "optimizer" when no optimizer is given (a sharded
    model's optimizer is built after its weights are loaded, and loads it then)."""
    load_weights(folder / "model.safetensors", model)
    state = json.loads((folder / "state.json").read_text())
    tensors = load_file(str(folder / "optimizer.safetensors"))
    torch.set_rng_state(tensors.pop("rng.cpu"))
    cuda_rng = tensors.pop("rng.cuda", None)
    if cuda_rng is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(cuda_rng)
    optimizer_state = _unflatten_optimizer(tensors, state.pop("param_groups"))
    if optimizer is None:
        state["optimizer"] = optimizer_state
    else:
        optimizer.load_state_dict(optimizer_state)
    return state


@contextlib.contextmanager
def lock_run(run: Path) -> Iterator[None]:
    """Hold RUN/.lock while writing the run; a second writer gets a CheckpointError that
    names the holder's pid. The OS releases the lock when the process ends, even by SIGKILL."""
    run.mkdir(parents=True, exist_ok=True)
    with open(run / LOCK, "a+") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise CheckpointError(_locked_message(run, f)) from None
        f.truncate(0)
        f.write(f"{os.getpid()}\n")
        f.flush()
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def check_unlocked(run: Path) -> None:
    """Refuse at once if another process is writing `run` (before any work starts)."""
    if not (run / LOCK).is_file():
        return
    with open(run / LOCK, "a+") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            raise CheckpointError(_locked_message(run, f)) from None
        fcntl.flock(f, fcntl.LOCK_UN)


def _locked_message(run: Path, f) -> str:
    """Name the holder: its pid, written just after it took the lock (so wait a moment)."""
    for _ in range(100):
        f.seek(0)
        pid = f.read().strip()
        if pid:
            break
        time.sleep(0.01)
    holder = pid or "?"
    return f"{run} is being written by process {holder}; wait for it to end or choose another --out"


def _flatten_optimizer(optimizer: torch.optim.Optimizer | dict[str, Any]) -> tuple[dict, list]:
    sd = optimizer if isinstance(optimizer, dict) else optimizer.state_dict()
    tensors = {
        f"state.{index}.{key}": value.detach().contiguous().cpu()
        for index, slots in sd["state"].items()
        for key, value in slots.items()
    }
    return tensors, sd["param_groups"]


def _unflatten_optimizer(tensors: dict[str, torch.Tensor], groups: list) -> dict:
    state: dict[int, dict[str, torch.Tensor]] = {}
    for name, value in tensors.items():
        _, index, key = name.split(".", 2)
        state.setdefault(int(index), {})[key] = value
    for group in groups:
        if "betas" in group:
            group["betas"] = tuple(group["betas"])
    return {"state": state, "param_groups": groups}


def _link_or_copy(src: Path, dst: Path) -> None:
    """Make `dst` the same file as `src` in one atomic rename (a hard link, else a copy)."""
    with atomic_path(dst) as tmp:
        try:
            os.link(src, tmp)
        except OSError:
            shutil.copyfile(src, tmp)
