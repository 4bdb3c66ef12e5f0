"""What a run leaves for people: its progress as it trains, metrics.jsonl, plots/loss.png
and MODEL_CARD.md."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import IO, Any

from tqdm import tqdm

from tlm.config import ModelConfig, TrainConfig
from tlm.io import atomic_path, write_text_atomic
from tlm.model.counts import parameter_counts
from tlm.train.privacy import privacy_section


class ProgressReport:
    """Training progress: a bar on a terminal; in a file or a pipe (`tlm train > log.txt`) a
    line per logging interval, since a log wants lines, not carriage-return refreshes."""

    def __init__(self, total: int, initial: int, shown: bool, stream: IO[str] | None = None):
        self.stream, self.total, self.shown = stream or sys.stderr, total, shown
        self.terminal = self.stream.isatty()
        self.bar = tqdm(
            total=total, initial=initial, unit="step", file=self.stream,
            disable=not (shown and self.terminal),
        )  # fmt: skip

    def step(self) -> None:
        self.bar.update(1)

    def log(self, step: int, loss: float, tokens_per_s: int) -> None:
        if self.terminal:
            self.bar.set_postfix(loss=f"{loss:.4f}", tok_s=f"{tokens_per_s:,}")
        elif self.shown:
            line = f"step {step}/{self.total}: train loss {loss:.4f}, {tokens_per_s:,} tok/s"
            print(line, file=self.stream, flush=True)

    def close(self) -> None:
        self.bar.close()


class Metrics:
    """Append-only JSON lines; on resume, rows after the checkpoint's step are dropped."""

    def __init__(self, path: Path, keep_until_step: int | None = None) -> None:
        self.path = path
        self.rows = read_metrics(path)
        if keep_until_step is not None:
            self.rows = [r for r in self.rows if r["step"] <= keep_until_step]
            write_text_atomic(path, "".join(json.dumps(r) + "\n" for r in self.rows))
        elif path.exists():
            path.unlink()
            self.rows = []

    def log(self, row: dict[str, Any]) -> None:
        self.rows.append(row)
        with open(self.path, "a") as f:
            f.write(json.dumps(row) + "\n")


def read_metrics(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def plot_losses(rows: list[dict[str, Any]], path: Path) -> None:
    """Train and validation loss against tokens seen and against wall time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train = [r for r in rows if "train_loss" in r]
    val = [r for r in rows if "val_loss" in r]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4), constrained_layout=True)
    for ax, x, label in (
        (axes[0], "tokens", "tokens seen"),
        (axes[1], "time", "training time (s)"),
    ):
        ax.plot([r[x] for r in train], [r["train_loss"] for r in train], label="train", lw=1)
        ax.plot([r[x] for r in val], [r["val_loss"] for r in val], "o-", label="validation")
        ax.set_xlabel(label)
        ax.set_ylabel("cross-entropy (nats/token)")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle("loss (eq. 10.51)")
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=100, format="png")
    plt.close(fig)


def write_model_card(
    run: Path,
    model_config: ModelConfig,
    train_config: TrainConfig,
    data_meta: dict[str, Any],
    results: dict[str, Any],
) -> None:
    counts = parameter_counts(model_config)
    sources = "\n".join(
        f"| `{s['name']}` | {s['bytes']:,} | `{s['sha256']}` |" for s in data_meta["sources"]
    )
    splits = data_meta["splits"]
    model_json = json.dumps(model_config.to_dict(), indent=2)
    train_json = json.dumps(train_config.to_dict(), indent=2)
    val_loss = results.get("val_loss")
    val = f"{val_loss:.4f}" if val_loss is not None else "n/a (no validation split)"
    epochs = results["tokens"] / max(1, splits["train"]["tokens"])
    card = f"""# Model card: `{run.name}`

A causal transformer language model trained with tlm (J&M ch. 9-10) by next-token
prediction on the data below.

## Data

| source | bytes | sha256 |
|---|---|---|
{sources}

Tokenizer: {data_meta["tokenizer"]}, vocabulary {data_meta["vocab_size"]}. Documents:
{data_meta["documents"]:,}. Tokens: {splits["train"]["tokens"]:,} train,
{splits["val"]["tokens"]:,} validation (the last {data_meta["val_fraction"]:.0%} of the stream).
{_cleaning(data_meta.get("cleaning"))}
## Model

{counts["total"]:,} parameters ({counts["non_embedding"]:,} non-embedding;
12·L·d² = {counts["estimate_12Ld2"]:,}).

```json
{model_json}
```

## Training

Precision: {results.get("precision", "not recorded")}.

```json
{train_json}
```

## Results

| | |
|---|---|
| steps | {results["step"]:,} |
| tokens seen | {results["tokens"]:,} ({epochs:.1f} passes over the training split) |
| wall time | {results["elapsed"]:.1f} s |
| final train loss (nats/token) | {results["train_loss"]:.4f} |
| final validation loss (nats/token) | {val} |{best_row(results)}

## How to use

```
tlm generate {run} --prompt "..." --max-new-tokens 200
tlm eval {run} --data {train_config.data} --split val{best_usage(f"tlm generate {run}", results)}
```

{privacy_section(data_meta, epochs)}
## Limits (J&M §10.10)

- **Hallucination.** The model continues text with what is probable under its training
  data, not with what is true; fluent output can be false.
- **Bias and toxicity.** It reproduces the patterns of its data, including stereotypes and
  offensive language; nothing here filters them.
- **Memorisation.** Small corpora and many epochs make a model repeat its training text
  verbatim; do not train on data you may not republish, or on private information.
- **Scope.** It was trained only on the sources above; it knows nothing else, and its
  validation loss says how well it predicts held-out text from the same sources only.
"""
    write_text_atomic(run / "MODEL_CARD.md", card)


def model_section(trainer, results: dict[str, Any]) -> str:
    """A fine-tuning card's "Model and training": the size, the precision and every
    setting of the run, as JSON."""
    settings = {"model": trainer.model_config.to_dict(), "train": trainer.config.to_dict()}
    return f"""## Model and training

{trainer.model.num_parameters():,} parameters. Precision: {results.get("precision")}.

```json
{json.dumps(settings, indent=2)}
```"""


def best_row(results: dict[str, Any], unit: str = "nats/token") -> str:
    """The card's row for best.safetensors (a run trained with --keep-best), else ""."""
    if "best_step" not in results:
        return ""
    if results["best_step"] is None:
        return "\n| best validation loss | n/a (no evaluation yet; no best.safetensors) |"
    loss, step = results["best_val_loss"], results["best_step"]
    return f"\n| best validation loss ({unit}) | {loss:.4f} at step {step:,} (best.safetensors) |"


def best_usage(command: str, results: dict[str, Any]) -> str:
    """`command` with the best weights, for the card's usage, when the run kept them."""
    if results.get("best_step") is None:
        return ""
    return f"\n{command} --weights best   # the weights of the lowest validation loss"


def _cleaning(cleaning: dict[str, Any] | None) -> str:
    """What `tlm prepare`'s cleaning removed (J&M §10.9.2), for the card; "" without it."""
    if cleaning is None:
        return ""
    c = cleaning["counts"]
    removed = ", ".join(
        f"{k.replace('_', ' ')} {n:,}" for k, n in c.items() if k not in ("documents", "kept")
    )
    return f"\nCleaning: {c['kept']:,} of {c['documents']:,} documents kept; removed: {removed}.\n"
