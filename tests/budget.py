"""The suite's time budget, reported at the end of every run (a pytest plugin: conftest.py
names it).

`make test` must stay under BUDGET seconds on the slower host kind (2 cores, AVX2 only),
far inside CI's 90 minutes. Speed is never a test's verdict (a test that fails on a slow
host is wrong), so the budget is a report: the seconds spent, the share of the budget, the
host's kernels beside them, and the files that cost the most. Past WARN of the budget it
says so in a line that names the first files to make cheaper.

`make test` runs the suite on one pytest-xdist worker a core (`-n auto --dist loadfile`:
a file's tests stay together, so its fixtures are made once), each worker on its share of
torch's threads (`worker_threads`), as are the processes its tests start: on two cores two
workers of one thread, which take the suite's files two at a time where two threads on one
file left the second core idle through most of a small model's step.
"""

from __future__ import annotations

import os
import time
from collections import defaultdict

import pytest
import torch

BUDGET = 600.0  # seconds of tests on the slower host kind (issue 61)
WARN = 0.75  # the share of BUDGET past which the report asks for cheaper tests
SHOWN = 8  # the costliest files listed

_spent: dict[str, float] = defaultdict(float)  # test file -> seconds (setup + call + teardown)
_started = time.perf_counter()


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    _spent[report.nodeid.split("::")[0]] += report.duration


def worker_threads(workers: int) -> int:
    """The threads of each of `workers` workers: torch's count for the host, shared out."""
    return max(1, torch.get_num_threads() // workers)


def share_out_threads() -> None:
    """In a pytest-xdist worker, run torch (and the processes tests start) on its share."""
    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if workers is not None:
        threads = worker_threads(int(workers))
        torch.set_num_threads(threads)
        os.environ["OMP_NUM_THREADS"] = str(threads)


def host(config: pytest.Config) -> str:
    """The kernels this host runs: PyTorch's CPU capability, the workers and their threads."""
    workers = getattr(config.option, "numprocesses", None) or 0
    threads = worker_threads(workers) if workers else torch.get_num_threads()
    return f"{torch.backends.cpu.get_cpu_capability()}, {max(workers, 1)} x {threads} threads"


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:
    if not _spent:
        return
    tests, wall = sum(_spent.values()), time.perf_counter() - _started
    share = wall / BUDGET
    write = terminalreporter.write_line
    terminalreporter.section("time budget")
    write(
        f"{wall:.0f} s in all ({tests:.0f} s in tests) of the suite's {BUDGET:.0f} s "
        f"budget on the slower host kind: {share:.0%} (this host: {host(config)})"
    )
    costliest = sorted(_spent.items(), key=lambda item: -item[1])[:SHOWN]
    write("costliest files: " + ", ".join(f"{name} {s:.0f} s" for name, s in costliest))
    if share > WARN and len(_spent) > SHOWN:  # a whole run, not a file or two
        write(f"past {WARN:.0%} of the budget: make the costliest files cheaper (issue 61)")
