"""Scaling laws (eq. 10.52-10.54, Hoffmann et al. 2022): fits that recover what made the
data, and a sweep that resumes without repeating a run."""

import csv
import json
import subprocess
import sys
import time

import numpy as np
import pytest

from tlm.cli import main
from tlm.scaling import bootstrap, fit_all, plan_budgets
from tlm.scaling.fit import Joint, best_per, frontier, power_law
from tlm.scaling.sweep import non_embedding


def test_a_power_law_is_recovered_from_noisy_points():
    rng = np.random.default_rng(0)
    X = np.geomspace(1e4, 1e7, 8)
    L = (2.3e5 / X) ** 0.076 * np.exp(rng.normal(0, 0.003, 8))  # Kaplan's α_N
    law = power_law(X, L)
    assert law.alpha == pytest.approx(0.076, abs=0.005)
    assert np.allclose(law(X), (2.3e5 / X) ** 0.076, rtol=0.01)


def test_each_law_sees_the_runs_kaplan_et_al_measure():
    N = np.array([1e4, 1e4, 2e4, 2e4, 4e4])
    D = np.array([1e5, 4e5, 1e5, 4e5, 1e5])
    L = np.array([3.0, 2.6, 2.8, 2.4, 2.7])
    xs, best = best_per(N, L)  # each size at its lowest loss
    assert xs.tolist() == [1e4, 2e4, 4e4] and best.tolist() == [2.6, 2.4, 2.7]
    xs, best = best_per(D, L)
    assert xs.tolist() == [1e5, 4e5] and best.tolist() == [2.7, 2.4]
    C, best = frontier(6 * N * D, L)  # C: 6e9, 2.4e10, 1.2e10, 4.8e10, 2.4e10
    assert (C / 6e9).tolist() == [1, 2, 4, 8] and best.tolist() == [3.0, 2.8, 2.6, 2.4]
    near = frontier(np.array([1.0, 1.01, 1.02, 2.0]), np.array([2.3, 2.2, 2.1, 2.0]))
    assert [x.tolist() for x in near] == [[1.02, 2.0], [2.1, 2.0]]  # one budget, one point
    fits = fit_all(N, D, L)
    assert fits.C.alpha == pytest.approx(-np.polyfit(np.log(C), np.log(best), 1)[0])


TRUTH = Joint(1.5, 40.0, 300.0, 0.35, 0.4)


def synthetic(seed, noise=0.01, truth=TRUTH):
    rng = np.random.default_rng(seed)
    N, D = np.meshgrid(np.geomspace(1e4, 1e6, 5), np.geomspace(1e5, 1e7, 5))
    N, D = N.ravel(), D.ravel()
    return N, D, truth(N, D) * np.exp(rng.normal(0, noise, N.size)), truth


@pytest.mark.slow
def test_the_joint_law_is_recovered_and_the_bootstrap_covers_it():
    N, D, L, truth = synthetic(seed=1, noise=0.0)
    exact = fit_all(N, D, L).joint  # without noise: the constants themselves
    for name in ("E", "A", "B", "alpha", "beta"):
        assert getattr(exact, name) == pytest.approx(getattr(truth, name), rel=1e-4)
    N, D, L, truth = synthetic(seed=1)
    fits = fit_all(N, D, L)
    assert fits.joint.alpha == pytest.approx(0.35, abs=0.05)
    assert fits.joint.beta == pytest.approx(0.40, abs=0.03)
    assert fits.joint.E == pytest.approx(1.5, abs=0.15)
    intervals = bootstrap(N, D, L, rounds=40, seed=0)
    for name in ("E", "alpha", "beta"):
        low, high = intervals[f"joint_{name}"]
        assert low <= getattr(truth, name) <= high, name
    n_opt, d_opt = fits.joint.optimal(1e15)
    assert 6 * n_opt * d_opt == pytest.approx(1e15)
    grid = np.geomspace(n_opt / 3, n_opt * 3, 41)  # the optimum is the lowest loss at that C
    assert abs(np.argmin(fits.joint(grid, 1e15 / (6 * grid))) - 20) <= 1


def test_budgets_plan_iso_flop_families():
    plans = plan_budgets([1e12, 3e12], vocab=66, context=64, batch=16)
    assert len(plans) >= 4
    for plan in plans:
        N = non_embedding(plan.n_layers, plan.d_model, 66, 64)
        C = 6 * N * plan.steps * 16 * 64
        assert any(abs(C / budget - 1) < 0.02 for budget in (1e12, 3e12)), plan
    with pytest.raises(ValueError, match="fewer than two model sizes"):
        plan_budgets([1e6], vocab=66, context=64, batch=16)


# 62, 125 and 188 steps: the second and third runs keep the process busy for a second or
# more after the first run's row is written, far longer than the 20 ms between looks
ARGS = ["--sizes", "1x32", "--tokens", "4e3", "8e3", "1.2e4", "--context-length", "16"]
ARGS += ["--batch-size", "4"]


def rows(path):
    with open(path) as f:
        return list(csv.DictReader(f))


@pytest.mark.slow
def test_a_killed_sweep_resumes_and_runs_each_run_once(docs_chars, tmp_path):
    out = tmp_path / "sweep"
    command = [sys.executable, "-m", "tlm", "scaling", "sweep", "--data", str(docs_chars)]
    proc = subprocess.Popen([*command, "--out", str(out), *ARGS], stdout=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while not ((out / "sweep.csv").is_file() and len(rows(out / "sweep.csv")) >= 1):
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.02)
    proc.kill()  # SIGKILL after the first finished run
    proc.wait()
    first = rows(out / "sweep.csv")
    assert main(["scaling", "sweep", "--data", str(docs_chars), "--out", str(out), *ARGS]) == 0
    final = rows(out / "sweep.csv")
    names = [r["name"] for r in final]
    assert sorted(names) == sorted(set(names)) and len(names) == 3  # each run once
    assert final[: len(first)] == first  # finished runs were not run again
    for row in final:
        assert float(row["C"]) == pytest.approx(6 * float(row["N"]) * float(row["D"]))
        assert float(row["val_loss"]) > 0


@pytest.mark.parametrize(
    "content, message",
    [
        ("name,N,D,val_loss\na,1e4,1e5,3.0\nb,2e4,1e5,2.9\n", "2 runs are too few"),
        (
            "name,N,D,val_loss\na,1e4,1e5,3.0\nb,2e4,1e5,2.9\nc,-4e4,1e5,2.8\n",
            "every N must be a positive",
        ),
        ("name,N,D\na,1,2\n", "every row needs numeric N, D and val_loss"),
    ],
)
def test_bad_csv_is_one_line_and_exit_2(tmp_path, capsys, content, message):
    path = tmp_path / "sweep.csv"
    path.write_text(content)
    assert main(["scaling", "fit", str(path), "--holdout", "none"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("tlm: error:") and message in err and err.count("\n") == 1


def write_sweep(folder, N, D, L):
    path = folder / "sweep.csv"
    rows = [f"r{i},{n},{d},{x}" for i, (n, d, x) in enumerate(zip(N, D, L, strict=True))]
    path.write_text("\n".join(["name,N,D,val_loss", *rows]) + "\n")
    return path


@pytest.mark.slow
def test_fit_command_writes_the_picture_and_predicts_the_held_out_run(tmp_path, capsys):
    N, D, L, truth = synthetic(seed=2, noise=0.005)
    path = write_sweep(tmp_path, N, D, L)
    # 2 bootstrap rounds: the intervals' coverage is the joint-law test's, not this one's
    assert main(["scaling", "fit", str(path), "--rounds", "2", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    [held] = report["held_out"]
    assert held["name"] == f"r{int(np.argmax(N * D))}"  # the largest C by default
    assert abs(held["error"]) < 0.03
    assert (tmp_path / "scaling.png").read_bytes()[:4] == b"\x89PNG"
    assert json.loads((tmp_path / "fit.json").read_text())["runs"] == len(L) - 1


@pytest.mark.slow
def test_runs_from_a_budget_up_are_held_out_and_predicted(tmp_path, capsys):
    N, D, L, truth = synthetic(seed=3, noise=0.005)
    path = write_sweep(tmp_path, N, D, L)
    C = 6 * N * D
    top = np.sort(C)[-3]
    assert (
        main(["scaling", "fit", str(path), "--rounds", "2", "--holdout-from", str(top), "--json"])
        == 0
    )
    report = json.loads(capsys.readouterr().out)
    assert sorted(h["name"] for h in report["held_out"]) == sorted(
        f"r{i}" for i in np.flatnonzero(C >= top)
    )
    assert report["runs"] == len(L) - 3
    for h in report["held_out"]:
        assert h["predicted"] == pytest.approx(truth(h["N"], h["D"]), rel=0.03)
    assert main(["scaling", "fit", str(path), "--holdout", "r0", "nope"]) == 2
    assert "'nope' is not a run" in capsys.readouterr().err
