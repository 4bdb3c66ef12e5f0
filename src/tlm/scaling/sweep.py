"""A scaling sweep (§10.9.3): a family of models trained on one corpus, one CSV row per run.

Each run is a model shape (layers × width) and a token budget D. Given compute budgets C,
the sweep picks, for each C, shapes spread over the sizes whose D = C / 6N stays within
`tokens_per_parameter` (an iso-FLOP family, as Hoffmann et al. 2022 ran); given sizes and
token budgets, it runs every pair. Every run trains with the same recipe (rotary
positions, AdamW, warmup and cosine decay to the run's own end) and is scored on the whole
validation split.

    OUT/sweep.csv      one row per finished run (rewritten whole, atomically, after each)
    OUT/runs/<name>/   each run's directory (checkpoints, metrics, model card)

A sweep that is stopped (Ctrl-C, a crash, SIGKILL) starts again where it was: finished runs
(in the CSV) are never repeated, and a run with a checkpoint resumes from it.
"""

from __future__ import annotations

import csv
import io
import math
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from tlm.checkpoint import latest_checkpoint
from tlm.config import ModelConfig
from tlm.data import TokenData
from tlm.errors import UserError
from tlm.evaluate import evaluate_tokens
from tlm.io import write_text_atomic
from tlm.model.counts import parameter_counts, tokens_for_compute, training_compute
from tlm.tokenizer import load_tokenizer
from tlm.train import new_run_configs, open_run, resume_run_configs

# (layers, d_model), smallest first; heads of width 32 (at least 2)
LADDER = [
    (1, 32),
    (2, 32),
    (2, 48),
    (2, 64),
    (3, 64),
    (3, 96),
    (4, 96),
    (4, 128),
    (6, 128),
    (6, 192),
    (8, 192),
    (8, 256),
]
COLUMNS = [
    "name",
    "n_layers",
    "d_model",
    "n_heads",
    "N",
    "D",
    "C",
    "steps",
    "val_loss",
    "train_loss",
    "seconds",
]
RECIPE = {"position": "rope", "dropout": 0.0}


class SweepError(UserError):
    """A sweep that cannot run as asked; the message says why."""


@dataclass(frozen=True)
class Plan:
    n_layers: int
    d_model: int
    steps: int

    @property
    def name(self) -> str:
        return f"L{self.n_layers}-d{self.d_model}-s{self.steps}"

    def heads(self) -> int:
        return max(2, self.d_model // 32)


def shape(spec: str) -> tuple[int, int]:
    """ "4x128" -> (4 layers, d_model 128)."""
    try:
        layers, width = (int(part) for part in spec.lower().split("x"))
    except ValueError:
        raise SweepError(f"size {spec!r} is not LAYERSxWIDTH (e.g. 4x128)") from None
    if layers < 1 or width < 2 or width % 2:
        raise SweepError(f"size {spec!r}: layers >= 1 and an even width >= 2")
    return layers, width


def non_embedding(layers: int, width: int, vocab: int, context: int) -> int:
    config = ModelConfig(
        vocab_size=vocab,
        d_model=width,
        n_layers=layers,
        n_heads=max(2, width // 32),
        context_length=context,
        **RECIPE,
    )
    return parameter_counts(config)["non_embedding"]


def plan_budgets(
    budgets: list[float],
    vocab: int,
    context: int,
    batch: int,
    per_budget: int = 4,
    tokens_per_parameter: tuple[float, float] = (2.0, 200.0),
) -> list[Plan]:
    """For each compute budget C, up to `per_budget` shapes (spread over the ladder) whose
    D = C / 6N gives between the given tokens per parameter."""
    low, high = tokens_per_parameter
    plans = []
    for C in budgets:
        fitting = []
        for layers, width in LADDER:
            N = non_embedding(layers, width, vocab, context)
            if low <= tokens_for_compute(C, N) / N <= high:
                fitting.append((layers, width, N))
        if len(fitting) < 2:
            raise SweepError(
                f"budget {C:.3g} FLOPs fits fewer than two model sizes; choose another"
            )
        k = min(per_budget, len(fitting))  # spread evenly over the sizes that fit
        picks = [
            fitting[i] for i in sorted({round(j * (len(fitting) - 1) / (k - 1)) for j in range(k)})
        ]
        for layers, width, N in picks:
            steps = max(1, round(tokens_for_compute(C, N) / (batch * context)))
            plans.append(Plan(layers, width, steps))
    return list(dict.fromkeys(plans))


def plan_grid(sizes: list[str], tokens: list[float], context: int, batch: int) -> list[Plan]:
    return [Plan(*shape(s), max(1, round(D / (batch * context)))) for s in sizes for D in tokens]


def read_rows(path: Path) -> list[dict[str, str]]:
    if not path.is_file():
        return []
    return list(csv.DictReader(io.StringIO(path.read_text())))


def write_rows(path: Path, rows: list[dict]) -> None:
    out = io.StringIO()
    writer = csv.DictWriter(out, COLUMNS)
    writer.writeheader()
    writer.writerows(rows)
    write_text_atomic(path, out.getvalue())


def run_sweep(
    data: str,
    out: Path,
    plans: list[Plan],
    context: int = 64,
    batch: int = 16,
    lr: float = 2e-3,
    seed: int = 1337,
    say: Callable[[str], None] = print,
) -> list[dict]:
    """Train every planned run not yet in OUT/sweep.csv; returns all rows."""
    token_data = TokenData(data)
    out.mkdir(parents=True, exist_ok=True)
    rows = read_rows(out / "sweep.csv")
    done = {row["name"] for row in rows}
    todo = [p for p in plans if p.name not in done]
    say(f"{len(plans)} runs planned, {len(plans) - len(todo)} finished before, {len(todo)} to go")
    for i, plan in enumerate(todo, 1):
        started = time.perf_counter()
        row = _train_one(token_data, out / "runs" / plan.name, plan, context, batch, lr, seed)
        row["seconds"] = round(time.perf_counter() - started, 1)
        rows.append(row)
        write_rows(out / "sweep.csv", rows)
        say(
            f"[{i}/{len(todo)}] {plan.name}: N {row['N']:,}, D {row['D']:,}, C {row['C']:.3g}, "
            f"val loss {row['val_loss']:.4f}, {row['seconds']} s"
        )
    return rows


def _train_one(
    data: TokenData, run: Path, plan: Plan, context: int, batch: int, lr: float, seed: int
) -> dict:
    model_values = {
        "n_layers": plan.n_layers,
        "d_model": plan.d_model,
        "n_heads": plan.heads(),
        "context_length": context,
        **RECIPE,
    }
    train_values = {
        "data": str(data.folder),
        "out": str(run),
        "batch_size": batch,
        "max_steps": plan.steps,
        "lr": lr,
        "warmup_steps": max(1, plan.steps // 20),
        "eval_interval": plan.steps,
        "checkpoint_interval": max(1, plan.steps // 5),
        "log_interval": max(1, plan.steps // 10),
        "seed": seed,
    }
    resume = latest_checkpoint(run) is not None if run.exists() else False
    if run.exists() and not resume:  # started, never saved: start it again
        shutil.rmtree(run)
    if resume:
        model_config, train_config, data = resume_run_configs(str(run), {}, {})
    else:
        model_config, train_config, data = new_run_configs(model_values, train_values)
    tokenizer = load_tokenizer(data.folder)
    trainer = open_run(
        model_config, train_config, data, tokenizer.to_json(), resume=resume, progress_bar=False
    )
    results = trainer.fit()
    val = evaluate_tokens(trainer.model.eval(), data.split("val"), tokenizer.token_bytes())
    N = trainer.model.num_parameters(non_embedding=True)
    D = results["tokens"]
    return {
        "name": plan.name,
        "n_layers": plan.n_layers,
        "d_model": plan.d_model,
        "n_heads": plan.heads(),
        "N": N,
        "D": D,
        "C": training_compute(N, D),
        "steps": plan.steps,
        "val_loss": val["loss"],
        "train_loss": results["train_loss"],
    }


def check_budgets(budgets: list[float]) -> None:
    if any(not (math.isfinite(c) and c > 0) for c in budgets):
        raise SweepError(f"budgets must be positive numbers of FLOPs, got {budgets}")
