"""Every benchmark in ``benchmarks/`` still runs (issue 41): its ``--smoke`` mode, the real
code path at its smallest size, as a subprocess that must exit 0 and print its figure line.
The benchmarks are run by hand for their figures, not by CI; without this they drift off
the package's API unnoticed (two once crashed on it in one stop)."""

from __future__ import annotations

import importlib.util
import itertools
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = ROOT / "benchmarks"
SMOKE_TIMEOUT_S = 300
"""A smoke run takes seconds to about half a minute alone; the margin is for a loaded machine."""

FIGURE_LINES = {
    "checkpoint_cost.py": r'^\{"checkpoint_cost_pct": -?[\d.]+, "target_pct": 1.0, "interval": \d+',
    "control_plane.py": r'^\{"rows": \[\{"ranks": 32, "nodes": 4, "plan_bytes": \d+',
    "controller_loss_save.py": r'^\{"controller_loss_save": \{"model": "llama2-7b", "dp": 4, "pp": 2, ',
    "estimator_accuracy.py": r'^\{"emulated": \[\{"plan": "a DP2xPP4", "predicted_s": ',
    "executor_overhead.py": r"^  overhead +[+-]\d+\.\d\d % \(median of 1 paired ratios",
    "plan_search.py": r"^7B +32 +1x4x8 +two +\d+ ms",
    "recovery.py": r"^reparallelize +\d+\.\d{3}s +\d+\.\d{3}s +\d+\.\d{3}s",
    "simulate_goodput.py": r"^\| 70B \| 128 \| paper \| device \| no \| [\d.]+ \| \d+ \| [\d,]+ \|",
    "simulate_grid.py": r"^ +8 +0\.2 +(False|True) +[\d.]+ +[\d. ]+ [\d.]+ +\w+ +[\d.]+",
    "snapshot_overhead.py": r'^\{"snapshot_overhead_pct": -?[\d.]+, .*"rebuild_s": [\d.]+',
    "store_auth.py": r'^\{"store_auth": \{"small_message_us": [\d.]+, "small_message_bytes": \d+, "ranks": 64',
}
"""Per benchmark, a line its smoke run prints: the figure it exists for, or its JSON summary."""


def test_every_benchmark_has_a_smoke_run():
    assert sorted(p.name for p in BENCHMARKS.glob("*.py")) == sorted(FIGURE_LINES)


@pytest.mark.timeout(SMOKE_TIMEOUT_S + 30)
@pytest.mark.parametrize("name", sorted(FIGURE_LINES))
def test_each_benchmark_runs_at_its_smallest_size_and_prints_its_figure(name, tmp_path):
    extra = ["--out", str(tmp_path)] if name == "simulate_goodput.py" else []
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, str(BENCHMARKS / name), "--smoke", *extra], capture_output=True,
                          text=True, timeout=SMOKE_TIMEOUT_S, cwd=ROOT, env=env)
    assert done.returncode == 0, done.stderr[-4000:]
    assert re.search(FIGURE_LINES[name], done.stdout, re.M), done.stdout[-4000:]
    if name == "simulate_goodput.py":  # the grid's figure, drawn from its smallest grid
        assert (tmp_path / "goodput.png").read_bytes().startswith(b"\x89PNG")


def test_every_goodput_cell_is_the_shortest_that_holds_several_failures_and_repairs():
    """At every rate and size a cell of the goodput grid is the shortest that holds 4
    expected failures and 4 expected completed repairs, or a week: its length scales with
    the rate. Paper 001's rate once made the 16,384-device cells 9 s long, inside the first
    pause; then a fixed 3 mean repair times (6 h) made its cells live through 600 to 10,000
    failures, too long to run (now 25 min at 1,024 devices, 6 min at 16,384)."""
    spec = importlib.util.spec_from_file_location("simulate_goodput", BENCHMARKS / "simulate_goodput.py")
    grid = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(grid)
    for devices, rate in itertools.product((1024, 16384), (grid.LLAMA3_RATE, grid.PAPER_RATE)):
        hours = grid.cell_hours(devices, rate, failures=4, repairs=4)

        def holds(h: float) -> bool:
            return devices * rate * h >= 4 and grid.expected_repairs(h, devices * rate) >= 4 - 1e-9

        assert hours == grid.WEEK_H or (holds(hours) and not holds(hours * 0.99))
    assert grid.cell_hours(1024, grid.LLAMA3_RATE, failures=4, repairs=4) == grid.WEEK_H
    assert grid.cell_hours(1024, grid.PAPER_RATE, failures=4, repairs=4) == pytest.approx(0.409, abs=1e-3)
    assert grid.cell_hours(16384, grid.PAPER_RATE, failures=4, repairs=4) == pytest.approx(0.0996, abs=1e-3)


def test_a_goodput_cell_past_the_simulation_size_limit_is_reported_not_simulated():
    """Paper 001's rate on 7B's 16,384 workers: the shortest cell holding 4 repairs holds
    163 node failures, 2.7 M worker-events, past the simulator's bound; the grid names it
    and goes on with the others (it once ended the whole grid in a traceback)."""
    spec = importlib.util.spec_from_file_location("simulate_goodput", BENCHMARKS / "simulate_goodput.py")
    grid = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(grid)
    big, small = ("7B", 16384, grid.PAPER_RATE, "node", False), ("7B", 1024, grid.PAPER_RATE, "node", False)
    same_as, refused = grid.distinct_cells([big, small], failures=4, expected_repairs=4, seed=0)
    assert same_as == {small: small}
    assert list(refused) == [big] and "163 events on 16,384 workers" in refused[big]
