"""scaling.png: the sweep's losses against N, D and C on log-log axes, with the fitted laws."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from tlm.io import atomic_path
from tlm.model.counts import training_compute
from tlm.scaling.fit import Fits, best_per, frontier


def plot_scaling(
    N: np.ndarray,
    D: np.ndarray,
    L: np.ndarray,
    fits: Fits,
    path: Path,
    held_out: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None,
) -> None:
    """Three panels: L(N), L(D) and L(C) (eq. 10.52-10.54); `held_out` = (N, D, loss) of runs
    left out of the fit, drawn as stars where they landed and crosses where L(N, D) put them."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    C = training_compute(N, D)
    n, d, loss = held_out if held_out is not None else (np.array([]),) * 3
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5), constrained_layout=True)
    panels = [
        (axes[0], N, n, best_per(N, L), fits.N, "N (non-embedding parameters)", "α_N"),
        (axes[1], D, d, best_per(D, L), fits.D, "D (training tokens)", "α_D"),
        (axes[2], C, training_compute(n, d), frontier(C, L), fits.C, "C = 6ND (FLOPs)", "α_C"),
    ]
    for ax, X, X_held, (xs, ls), law, label, name in panels:
        ax.scatter(X, L, s=14, color="0.65", label="every run")
        ax.scatter(xs, ls, s=28, color="C0", label="fitted points")
        reach = np.concatenate([X, X_held])
        grid = np.geomspace(reach.min() / 1.5, reach.max() * 1.5, 100)
        ax.plot(grid, law(grid), color="C1", label=f"{name} = {law.alpha:.3f}")
        if len(X_held):
            ax.scatter(X_held, loss, marker="*", s=160, color="C3", label="held out")
            ax.scatter(
                X_held, fits.joint(n, d), marker="x", s=80, color="C3", label="L(N, D) predicted"
            )
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel(label)
        ax.set_ylabel("validation loss (nats/token)")
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=8)
    fig.suptitle("scaling laws (eq. 10.52-10.54) fitted to this sweep")
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=100, format="png")
    plt.close(fig)
