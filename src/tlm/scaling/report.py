"""Fitting a sweep's runs: its CSV in, the fits, the held-out predictions and the report
out (fit.json, scaling.png, a text summary beside the published laws)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from tlm.io import write_text_atomic
from tlm.model.counts import training_compute
from tlm.scaling.fit import FitError, bootstrap, fit_all
from tlm.scaling.plot import plot_scaling
from tlm.scaling.sweep import read_rows

KAPLAN = {"alpha_N": 0.076, "alpha_D": 0.095, "alpha_C": 0.050}  # Kaplan et al. 2020
CHINCHILLA = {"E": 1.69, "A": 406.4, "B": 410.7, "alpha": 0.34, "beta": 0.28}  # Hoffmann 2022


def fit_sweep(
    csv: str,
    out: str | Path | None = None,
    holdout: list[str] | None = None,
    holdout_from: float | None = None,
    rounds: int = 200,
) -> dict:
    """Fit L(N), L(D), L(C) and L(N, D) to the runs of `csv` but the held-out ones (see
    `held_out`), predict those, and write scaling.png and fit.json to `out` (the CSV's
    folder); returns the report."""
    names, N, D, L = load_csv(csv)
    held = held_out(names, training_compute(N, D), holdout, holdout_from, csv)
    keep = ~held
    fits = fit_all(N[keep], D[keep], L[keep])
    fits.intervals = bootstrap(N[keep], D[keep], L[keep], rounds)
    report = summary(fits, int(keep.sum()))
    report["held_out"] = [
        _prediction(fits, names[i], N[i], D[i], L[i]) for i in np.flatnonzero(held)
    ]
    out = Path(out or Path(csv).parent)
    plot_scaling(N[keep], D[keep], L[keep], fits, out / "scaling.png", (N[held], D[held], L[held]))
    write_text_atomic(out / "fit.json", json.dumps(report, indent=2) + "\n")
    return report


def _prediction(fits, name: str, N: float, D: float, loss: float) -> dict:
    predicted, C = float(fits.joint(N, D)), training_compute(N, D)
    return {
        "name": name, "N": N, "D": D, "C": C, "loss": loss, "predicted": predicted,
        "error": predicted / loss - 1, "frontier": float(fits.C(C)),
    }  # fmt: skip


def load_csv(path: str) -> tuple[list[str], np.ndarray, np.ndarray, np.ndarray]:
    if not Path(path).is_file():
        raise FitError(f"{path}: no such file")
    rows = read_rows(Path(path))
    try:
        names = [row["name"] for row in rows]
        N, D, L = (np.array([float(row[k]) for row in rows]) for k in ("N", "D", "val_loss"))
    except (KeyError, TypeError, ValueError):
        raise FitError(f"{path}: every row needs numeric N, D and val_loss (and a name)") from None
    return names, N, D, L


def held_out(
    names: list[str],
    C: np.ndarray,
    holdout: list[str] | None,
    holdout_from: float | None,
    csv: str,
) -> np.ndarray:
    """Which runs the fit leaves out, to predict them: those of at least `holdout_from`
    FLOPs, the named ones (["none"]: none), or by default the one of largest C (of four or
    more)."""
    if holdout_from is not None:
        if holdout:
            raise FitError("give --holdout or --holdout-from, not both")
        return C >= holdout_from * 0.98  # planned runs land within 2% of their budget
    if holdout == ["none"]:
        return np.zeros(len(names), dtype=bool)
    if holdout:
        unknown = [name for name in holdout if name not in names]
        if unknown:
            raise FitError(f"--holdout {unknown[0]!r} is not a run of {csv}")
        return np.isin(names, holdout)
    held = np.zeros(len(names), dtype=bool)
    if len(names) > 3:
        held[np.argmax(C)] = True
    return held


def summary(fits, n: int) -> dict:
    j = fits.joint
    return {
        "runs": n,
        "alpha_N": fits.N.alpha,
        "N_c": fits.N.X_c,
        "alpha_D": fits.D.alpha,
        "D_c": fits.D.X_c,
        "alpha_C": fits.C.alpha,
        "C_c": fits.C.X_c,
        "joint": {"E": j.E, "A": j.A, "B": j.B, "alpha": j.alpha, "beta": j.beta},
        "optimal": {
            f"{C:.0e}": dict(zip(("N", "D"), j.optimal(C), strict=True))
            for C in (1e13, 1e15, 1e18, 1e21)
        },
        "intervals": fits.intervals,
        "kaplan": KAPLAN,
        "chinchilla": CHINCHILLA,
    }


def describe(r: dict) -> str:
    ci = r["intervals"]

    def interval(name):
        return f"[{ci[name][0]:.3f}, {ci[name][1]:.3f}]" if name in ci else ""

    j = r["joint"]
    lines = [f"fitted to {r['runs']} runs (95% bootstrap intervals)"]
    for x in ("N", "D", "C"):
        name = f"alpha_{x}"
        lines.append(
            f"  L({x}) = ({x}_c/{x})^α: α_{x} = {r[name]:.3f} {interval(name)}, "
            f"{x}_c = {r[x + '_c']:.3g}   (Kaplan et al.: {KAPLAN[name]})"
        )
    lines.append(
        f"  L(N, D) = E + A/N^α + B/D^β: E = {j['E']:.3f} {interval('joint_E')}, "
        f"A = {j['A']:.3g}, B = {j['B']:.3g}, α = {j['alpha']:.3f} "
        f"{interval('joint_alpha')}, β = {j['beta']:.3f} {interval('joint_beta')}"
    )
    lines.append("    (Chinchilla: E = 1.69, α = 0.34, β = 0.28)")
    for C, nd in r["optimal"].items():
        lines.append(f"  compute-optimal at C = {C}: N = {nd['N']:.3g}, D = {nd['D']:.3g}")
    for h in r["held_out"]:
        lines.append(
            f"  held out {h['name']} (C = {h['C']:.3g}): measured {h['loss']:.4f}, "
            f"L(N, D) predicts {h['predicted']:.4f} ({h['error']:+.1%}); "
            f"the L(C) frontier there: {h['frontier']:.4f}"
        )
    return "\n".join(lines)
