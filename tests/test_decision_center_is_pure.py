"""The decision center is pure Python: planning, pricing, restoring, simulating and
compiling op lists import neither torch nor Megatron, so the controller and the simulator
run without an accelerator stack and every decision is unit-testable (DESIGN.md).

Importing is not the whole of it: a module may import inside a function, so the probe
also drives the center's public methods through every kind of decision (reroute,
reparallelize, a rollback to an in-memory snapshot, a join, prepared decisions, a
straggler priced, the published program and the snapshot interval) and looks at what they loaded."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

PURE_MODULES = [
    "odyssey_megatron.blocks",
    "odyssey_megatron.decision_center",
    "odyssey_megatron.planner",
    "odyssey_megatron.estimator",
    "odyssey_megatron.restorer",
    "odyssey_megatron.simulator.run",
    "odyssey_megatron.schedules.ops",
    "odyssey_megatron.schedules.program",
    "odyssey_megatron.snapshot.restore",
    "odyssey_megatron.snapshot.shards",
]

TINY = Path(__file__).resolve().parents[1] / "recipes" / "llama2_7b" / "tiny_cpu.yaml"

_LOADED = "sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'megatron'))"


def _loaded_after(probe: str) -> str:
    """What of torch and Megatron ``probe`` left in ``sys.modules`` of a fresh interpreter."""
    script = f"{textwrap.dedent(probe)}\nimport sys\nprint({_LOADED})"
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    return result.stdout.strip().splitlines()[-1]


def test_the_decision_center_imports_no_torch():
    assert _loaded_after("\n".join(f"import {m}" for m in PURE_MODULES)) == "[]"


def test_no_decision_of_the_center_loads_torch():
    """Tiny recipe on 4 nodes of 2 ranks (DP 2 x PP 4): a lost rank is rerouted or its
    pipeline reparallelized (both are priced), a lost node's blocks live on no survivor
    and come back from the in-memory snapshot (parity rebuilds across the other nodes),
    and a repaired node joins again."""
    probe = f"""
        from odyssey_megatron.config import load_config
        from odyssey_megatron.decision_center import DecisionCenter
        from odyssey_megatron.snapshot.restore import SnapshotRecord, SnapshotSource

        config = load_config({str(TINY)!r}, ["cluster.devices_per_node=2"])
        center = DecisionCenter.from_recipe(config)
        center.published()
        center.snapshot_interval(nodes_per_group=config.odyssey.snapshot_parity_nodes)
        center.prepare()
        center.on_straggler(rank=5, slowdown=2.0)
        record = SnapshotRecord(4, center.plan.generation, center.plan, ((0, 2, 4, 6), (1, 3, 5, 7)))
        lost_rank = center.on_failure(ranks=[5])
        policies = {{c.policy for c in (lost_rank.chosen, *lost_rank.alternatives)}}
        assert policies == {{"reroute", "reparallelize"}}, policies
        center.published()

        center = DecisionCenter.from_recipe(config)
        rolled = center.on_failure(nodes=[1], in_memory=True,
                                   snapshot=SnapshotSource(record, frozenset({{2, 3}}), config.model, replayed_steps=1))
        assert rolled.rollback is not None and rolled.rollback.rebuilds
        center.published()
        center.on_join(ranks=[2, 3])
    """
    assert _loaded_after(probe) == "[]"
