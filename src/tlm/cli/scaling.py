"""`tlm scaling sweep` and `tlm scaling fit`: scaling laws fitted to your own runs (§10.9.3)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from tlm.checkpoint import lock_run
from tlm.cli.args import add_command, fail
from tlm.data import TokenData
from tlm.io import write_text_atomic
from tlm.scaling import FitError, bootstrap, fit_all, plan_budgets, plan_grid, plot_scaling
from tlm.scaling.sweep import check_budgets, read_rows, run_sweep
from tlm.train import Interrupted

EXAMPLE = """examples:
  tlm prepare tinyshakespeare --tokenizer char --out data/shakespeare_char
  tlm scaling sweep --data data/shakespeare_char --out runs/scaling --budget-flops 3e12 1e13 3e13
  tlm scaling sweep --data data/shakespeare_char --out runs/grid --sizes 2x64 4x128 \\
      --tokens 2e5 1e6
  tlm scaling fit runs/scaling/sweep.csv        # writes scaling.png and fit.json beside it
  tlm scaling fit runs/scaling/sweep.csv --holdout-from 1e13   # predict the 1e13 runs

A sweep stopped for any reason continues when the same command is run again: finished runs
(rows of sweep.csv) are never repeated; a run with a checkpoint resumes from it.
"""
KAPLAN = {"alpha_N": 0.076, "alpha_D": 0.095, "alpha_C": 0.050}  # Kaplan et al. 2020
CHINCHILLA = {"E": 1.69, "A": 406.4, "B": 410.7, "alpha": 0.34, "beta": 0.28}  # Hoffmann 2022


def register(sub: argparse._SubParsersAction) -> None:
    parser = add_command(sub, "scaling", "scaling laws: a sweep of runs, and fits", EXAMPLE)
    verbs = parser.add_subparsers(dest="verb", required=True, metavar="sweep|fit")
    sweep = verbs.add_parser("sweep", help="train a family of models, one CSV row each")
    sweep.add_argument("--data", required=True, help="a folder written by tlm prepare")
    sweep.add_argument("--out", required=True, help="folder for sweep.csv and the runs")
    sweep.add_argument("--budget-flops", type=float, nargs="+", metavar="C")
    sweep.add_argument("--per-budget", type=int, default=4, help="model sizes per budget (4)")
    sweep.add_argument("--sizes", nargs="+", metavar="LxD", help="shapes, e.g. 2x64 4x128")
    sweep.add_argument("--tokens", type=float, nargs="+", metavar="D", help="token budgets")
    sweep.add_argument("--context-length", type=int, default=64)
    sweep.add_argument("--batch-size", type=int, default=16)
    sweep.add_argument("--lr", type=float, default=2e-3)
    sweep.add_argument("--seed", type=int, default=1337)
    sweep.set_defaults(handler=run_sweep_command)
    fit = verbs.add_parser("fit", help="fit L(N), L(D), L(C) and L(N, D) to a sweep's CSV")
    fit.add_argument("csv", help="sweep.csv (columns name, N, D, val_loss)")
    fit.add_argument(
        "--holdout",
        nargs="+",
        metavar="NAME",
        help="runs to leave out and predict (default: the one of largest C; 'none': none)",
    )
    fit.add_argument(
        "--holdout-from",
        type=float,
        metavar="C",
        help="leave out and predict every run of at least C FLOPs (within 2%%)",
    )
    fit.add_argument("--rounds", type=int, default=200, help="bootstrap rounds (200)")
    fit.add_argument("--out", help="folder for scaling.png and fit.json (the CSV's)")
    fit.add_argument("--json", action="store_true", help="print one JSON object")
    fit.set_defaults(handler=run_fit_command)


def run_sweep_command(args: argparse.Namespace) -> int:
    vocab = TokenData(args.data).vocab_size
    if args.budget_flops and not (args.sizes or args.tokens):
        check_budgets(args.budget_flops)
        plans = plan_budgets(
            args.budget_flops, vocab, args.context_length, args.batch_size, args.per_budget
        )
    elif args.sizes and args.tokens and not args.budget_flops:
        plans = plan_grid(args.sizes, args.tokens, args.context_length, args.batch_size)
    else:
        fail("give --budget-flops C ..., or --sizes LxD ... with --tokens D ...")
    out = Path(args.out)
    with lock_run(out):
        try:
            run_sweep(
                args.data,
                out,
                plans,
                args.context_length,
                args.batch_size,
                args.lr,
                args.seed,
                say=lambda line: print(line, flush=True),
            )
        except Interrupted:
            print("tlm: interrupted; run the same command to continue the sweep", file=sys.stderr)
            return 130
    print(f"done: {out / 'sweep.csv'}; fit it with: tlm scaling fit {out / 'sweep.csv'}")
    return 0


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


def held_out(names: list[str], C: np.ndarray, args: argparse.Namespace) -> np.ndarray:
    """Which runs the fit leaves out, to predict them."""
    if args.holdout_from is not None:
        if args.holdout:
            fail("give --holdout or --holdout-from, not both")
        return C >= args.holdout_from * 0.98  # planned runs land within 2% of their budget
    if args.holdout == ["none"]:
        return np.zeros(len(names), dtype=bool)
    if args.holdout:
        unknown = [name for name in args.holdout if name not in names]
        if unknown:
            fail(f"--holdout {unknown[0]!r} is not a run of {args.csv}")
        return np.isin(names, args.holdout)
    held = np.zeros(len(names), dtype=bool)
    if len(names) > 3:
        held[np.argmax(C)] = True
    return held


def run_fit_command(args: argparse.Namespace) -> int:
    names, N, D, L = load_csv(args.csv)
    held = held_out(names, 6 * N * D, args)
    keep = ~held
    fits = fit_all(N[keep], D[keep], L[keep])
    fits.intervals = bootstrap(N[keep], D[keep], L[keep], args.rounds)
    report = summary(fits, int(keep.sum()))
    report["held_out"] = [
        {
            "name": names[i],
            "N": N[i],
            "D": D[i],
            "C": 6 * N[i] * D[i],
            "loss": L[i],
            "predicted": float(fits.joint(N[i], D[i])),
            "error": float(fits.joint(N[i], D[i])) / L[i] - 1,
            "frontier": float(fits.C(6 * N[i] * D[i])),
        }
        for i in np.flatnonzero(held)
    ]
    out = Path(args.out or Path(args.csv).parent)
    plot_scaling(N[keep], D[keep], L[keep], fits, out / "scaling.png", (N[held], D[held], L[held]))
    write_text_atomic(out / "fit.json", json.dumps(report, indent=2) + "\n")
    print(json.dumps(report) if args.json else describe(report))
    return 0


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
