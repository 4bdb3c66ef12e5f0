"""`tlm scaling sweep` and `tlm scaling fit`: scaling laws fitted to your own runs (§10.9.3)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from tlm.checkpoint import lock_run
from tlm.cli.args import add_command, fail
from tlm.data import TokenData
from tlm.scaling import plan_budgets, plan_grid
from tlm.scaling.report import describe, fit_sweep
from tlm.scaling.sweep import check_budgets, run_sweep
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


def run_fit_command(args: argparse.Namespace) -> int:
    report = fit_sweep(args.csv, args.out, args.holdout, args.holdout_from, args.rounds)
    print(json.dumps(report) if args.json else describe(report))
    return 0
