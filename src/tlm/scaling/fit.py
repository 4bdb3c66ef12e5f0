"""Scaling laws fitted to a sweep (§10.9.3, eq. 10.52-10.54; Hoffmann et al. 2022).

    L(N) = (N_c / N)^α_N      L(D) = (D_c / D)^α_D      L(C) = (C_c / C)^α_C

Each is a line in log space, log L = α log X_c − α log X, fitted by least squares. Which
runs each law sees, as Kaplan et al. measure them:

- L(N): each size at its best (lowest) loss, the one least limited by data;
- L(D): each token budget at its best loss, the one least limited by size;
- L(C): the compute frontier, the lowest loss reached at or below each run's compute.

The joint law L(N, D) = E + A / N^α + B / D^β is fitted by least squares on log L
(Levenberg-Marquardt from the best point of a grid over the exponents); with C = 6ND it
gives the compute-optimal split, N_opt = G (C/6)^(β/(α+β)) with G = (αA / βB)^(1/(α+β)),
and D_opt = C / (6 N_opt).
Bootstrap intervals refit on rows drawn with replacement.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from tlm.errors import UserError
from tlm.model.counts import tokens_for_compute, training_compute


class FitError(UserError):
    """Data a scaling law cannot be fitted to; the message says why."""


@dataclass
class PowerLaw:
    """L = (X_c / X)^alpha."""

    alpha: float
    X_c: float

    def __call__(self, X: np.ndarray | float) -> np.ndarray | float:
        return (self.X_c / np.asarray(X, dtype=float)) ** self.alpha


@dataclass
class Joint:
    """L = E + A / N^alpha + B / D^beta."""

    E: float
    A: float
    B: float
    alpha: float
    beta: float

    def __call__(self, N, D):
        N, D = np.asarray(N, dtype=float), np.asarray(D, dtype=float)
        return self.E + self.A / N**self.alpha + self.B / D**self.beta

    def optimal(self, C: float) -> tuple[float, float]:
        """The (N, D) with 6ND = C that minimise the loss."""
        a, b = self.alpha, self.beta
        G = (a * self.A / (b * self.B)) ** (1 / (a + b))
        N = G * (C / 6) ** (b / (a + b))
        return N, tokens_for_compute(C, N)


@dataclass
class Fits:
    N: PowerLaw
    D: PowerLaw
    C: PowerLaw
    joint: Joint
    intervals: dict[str, tuple[float, float]] = field(default_factory=dict)


def check_rows(N: np.ndarray, D: np.ndarray, L: np.ndarray) -> None:
    if len(L) < 3:
        raise FitError(f"{len(L)} runs are too few to fit a scaling law; give at least 3")
    for name, values in (("N", N), ("D", D), ("val_loss", L)):
        if not (np.all(np.isfinite(values)) and np.all(values > 0)):
            raise FitError(f"every {name} must be a positive number")


def power_law(X: np.ndarray, L: np.ndarray) -> PowerLaw:
    """Least squares of log L = α log X_c − α log X."""
    if len(np.unique(X)) < 2:
        raise FitError("a power law needs at least two different values to fit")
    slope, intercept = np.polyfit(np.log(X), np.log(L), 1)
    alpha = -slope
    with np.errstate(over="ignore", divide="ignore"):  # α ≤ 0: the loss does not fall
        return PowerLaw(float(alpha), float(np.exp(intercept / alpha)) if alpha else math.inf)


def best_per(X: np.ndarray, L: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The lowest loss at each distinct X."""
    xs = np.unique(X)
    return xs, np.array([L[X == x].min() for x in xs])


def frontier(
    C: np.ndarray, L: np.ndarray, tolerance: float = 0.05
) -> tuple[np.ndarray, np.ndarray]:
    """The lowest loss at each compute, where it is lower than at every smaller compute.

    Runs within `tolerance` of one compute (one budget, after rounding to whole steps)
    count as one point: the best of them.
    """
    order = np.lexsort((L, C))  # by compute; of equal compute, the lower loss first
    groups: list[list[int]] = []
    for i in order:
        if groups and C[i] <= C[groups[-1][0]] * (1 + tolerance):
            groups[-1].append(i)
        else:
            groups.append([i])
    keep, best = [], math.inf
    for group in groups:
        i = min(group, key=lambda j: L[j])
        if L[i] < best:
            keep.append(i)
            best = L[i]
    return C[keep], L[keep]


def joint_law(N: np.ndarray, D: np.ndarray, L: np.ndarray, start: Joint | None = None) -> Joint:
    """L(N, D) = E + A/N^α + B/D^β by least squares on log L: Levenberg-Marquardt from the
    best point of a grid over (α, β), or from `start` (the full data's fit, when
    bootstrapping)."""
    start = start or _grid_start(N, D, L)
    logs = [math.log(v) for v in (start.E, start.A, start.B)]
    p = _minimise(np.array([*logs, start.alpha, start.beta]), np.log(N), np.log(D), np.log(L))
    if p is None or not (p[3] > 0 and p[4] > 0):
        raise FitError("the joint law L(N, D) could not be fitted to these runs")
    logE, logA, logB, alpha, beta = p.tolist()
    return Joint(math.exp(logE), math.exp(logA), math.exp(logB), alpha, beta)


def _grid_start(N: np.ndarray, D: np.ndarray, L: np.ndarray) -> Joint:
    """For fixed α and β the law is linear in E, A, B: solve it (relative errors, close to
    the log-space objective) on a grid of exponents and keep the best positive solution."""
    best, best_err = None, math.inf
    grid = np.linspace(0.025, 1.5, 60)
    for alpha in grid:
        x = N**-alpha
        for beta in grid:
            M = np.stack([np.ones_like(L), x, D**-beta], axis=1) / L[:, None]
            coef = np.linalg.lstsq(M, np.ones_like(L), rcond=None)[0]
            err = float(((M @ coef - 1) ** 2).mean())
            if np.all(coef > 0) and err < best_err:
                best, best_err = Joint(*coef.tolist(), float(alpha), float(beta)), err
    if best is None:
        raise FitError("the joint law L(N, D) could not be fitted to these runs")
    return best


def _minimise(p: np.ndarray, logN, logD, logL) -> np.ndarray | None:
    """The parameters p = (log E, log A, log B, α, β) that minimise Σ r², r = log(E + A/N^α
    + B/D^β) − log L, with the residuals' exact Jacobian; None if no finite fit was found."""
    from scipy.optimize import least_squares  # imported here: only the fit needs it

    def terms(p):  # log E, log A/N^α, log B/D^β: one row per term
        return np.stack([np.full_like(logN, p[0]), p[1] - p[3] * logN, p[2] - p[4] * logD])

    def residuals(p):
        t = terms(p)
        top = t.max(axis=0)  # log Σ exp, kept finite
        return top + np.log(np.exp(t - top).sum(axis=0)) - logL

    def jacobian(p):
        t = terms(p)
        w = np.exp(t - t.max(axis=0))
        w /= w.sum(axis=0)  # each term's share of the sum: ∂r/∂(its log)
        return np.stack([w[0], w[1], w[2], -w[1] * logN, -w[2] * logD], axis=1)

    with np.errstate(over="ignore", invalid="ignore"):
        found = least_squares(
            residuals, p, jac=jacobian, method="lm", xtol=1e-15, ftol=1e-15, gtol=1e-15
        )
    return found.x if np.all(np.isfinite(found.x)) and np.isfinite(found.cost) else None


def fit_all(N: np.ndarray, D: np.ndarray, L: np.ndarray, start: Joint | None = None) -> Fits:
    check_rows(N, D, L)
    C = training_compute(N, D)
    return Fits(
        N=power_law(*best_per(N, L)),
        D=power_law(*best_per(D, L)),
        C=power_law(*frontier(C, L)),
        joint=joint_law(N, D, L, start),
    )


def bootstrap(
    N: np.ndarray, D: np.ndarray, L: np.ndarray, rounds: int = 200, seed: int = 0
) -> dict[str, tuple[float, float]]:
    """95% intervals (2.5th, 97.5th percentiles) of each exponent and of the joint law's
    constants, refitting on rows drawn with replacement; draws that cannot be fitted (too
    few distinct values) are skipped."""
    rng = np.random.default_rng(seed)
    start = joint_law(N, D, L)
    samples: dict[str, list[float]] = {}
    for _ in range(rounds):
        i = rng.integers(0, len(L), len(L))
        try:
            fits = fit_all(N[i], D[i], L[i], start)
        except FitError:
            continue
        values = {"alpha_N": fits.N.alpha, "alpha_D": fits.D.alpha, "alpha_C": fits.C.alpha}
        values |= {f"joint_{k}": getattr(fits.joint, k) for k in ("E", "A", "B", "alpha", "beta")}
        for name, value in values.items():
            samples.setdefault(name, []).append(value)
    return {
        k: (float(np.percentile(v, 2.5)), float(np.percentile(v, 97.5))) for k, v in samples.items()
    }
