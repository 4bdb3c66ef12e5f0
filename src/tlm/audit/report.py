"""One audit of a trained model (J&M §10.10), as `tlm audit` prints it and records it beside
the run: extraction on both splits, extraction by duplication bucket, and each canary's
exposure.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from tlm.audit.canaries import exposure, extracted
from tlm.audit.duplication import by_bucket, occurrences
from tlm.audit.extraction import extraction
from tlm.data.tokens import TokenData
from tlm.io import write_text_atomic
from tlm.train.privacy import privacy_section, rewrite_section


def audit(
    model,
    tokenizer,
    data: TokenData,
    samples: int = 500,
    prefix: int = 32,
    suffix: int = 32,
    batch_size: int = 64,
    seed: int = 0,
    epochs: float | None = None,
    progress: bool = False,
) -> dict:
    """The report: `extraction` per split, `duplication` per bucket, `canaries` (never their
    secrets), and `epochs` where the passes over the training split are known."""
    found = {
        split: extraction(
            model, data.split(split), samples, prefix, suffix, batch_size, seed, progress
        )
        for split in ("train", "val")
    }
    train, length = data.split("train"), prefix + suffix
    windows = np.stack([np.asarray(train[s : s + length]) for s in found["train"].starts])
    report = {
        "extraction": {split: f.summary() for split, f in found.items()},
        "duplication": by_bucket(occurrences(train, windows), found["train"].exact),
        "canaries": [
            _canary(model, tokenizer, canary, epochs) for canary in data.meta.get("canaries", [])
        ],
    }
    return report if epochs is None else report | {"epochs": epochs}


def _canary(model, tokenizer, canary: dict, epochs: float | None) -> dict:
    """A canary's line of the report: never its secret."""
    found = exposure(model, tokenizer, canary["text"])
    row = {
        "repeats": canary["repeats"],
        "exposure": found.exposure,
        "max_exposure": found.max_exposure,
        "extracted": extracted(model, tokenizer, canary["text"]),
    }
    return row if epochs is None else row | {"seen": canary["repeats"] * epochs}


def passes(run: str | Path, train_tokens: int) -> float | None:
    """Passes over the training split the run's training made (its metrics' last token
    count), or None for a directory without them (a Hugging Face model)."""
    metrics = Path(run) / "metrics.jsonl"
    if not metrics.is_file() or not train_tokens:
        return None
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    tokens = max((row.get("tokens", 0) for row in rows), default=0)
    return tokens / train_tokens if tokens else None


def record(run: str | Path, meta: dict, report: dict) -> Path | None:
    """Write the report to RUN/audit.json and rewrite the model card's §10.10 section; the
    card's path, or None where RUN has no card (not a run of ours)."""
    card = Path(run) / "MODEL_CARD.md"
    if not card.is_file():
        return None
    write_text_atomic(card.parent / "audit.json", json.dumps(report, indent=2) + "\n")
    rewrite_section(card, privacy_section(meta, report.get("epochs"), report))
    return card
