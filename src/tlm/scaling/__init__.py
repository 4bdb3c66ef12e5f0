"""Scaling laws fitted to your own runs (§10.9.3): a sweep of models, and the fits."""

from tlm.scaling.fit import FitError, Fits, Joint, PowerLaw, bootstrap, fit_all
from tlm.scaling.plot import plot_scaling
from tlm.scaling.report import describe, fit_sweep
from tlm.scaling.sweep import Plan, SweepError, plan_budgets, plan_grid, read_rows, run_sweep

__all__ = [
    "FitError",
    "Fits",
    "Joint",
    "Plan",
    "PowerLaw",
    "SweepError",
    "bootstrap",
    "describe",
    "fit_all",
    "fit_sweep",
    "plan_budgets",
    "plan_grid",
    "plot_scaling",
    "read_rows",
    "run_sweep",
]
