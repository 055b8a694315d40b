"""The decision center is pure Python: planning, pricing, restoring, simulating and
compiling op lists import neither torch nor Megatron, so the controller and the simulator
run without an accelerator stack and every decision is unit-testable (DESIGN.md)."""

from __future__ import annotations

import subprocess
import sys

PURE_MODULES = [
    "odyssey_megatron.decision_center",
    "odyssey_megatron.planner",
    "odyssey_megatron.estimator",
    "odyssey_megatron.restorer",
    "odyssey_megatron.simulator.run",
    "odyssey_megatron.schedules.ops",
    "odyssey_megatron.schedules.program",
]


def test_the_decision_center_imports_no_torch():
    probe = "; ".join([*(f"import {m}" for m in PURE_MODULES),
                       "import sys",
                       "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'megatron')))"])
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True)
    assert result.stdout.strip() == "[]"
