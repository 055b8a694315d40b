"""Recovery after a real SIGKILL, on the tiny recipe with 8 CPU ranks (DP 2 x PP 4).

1. For rerouting and for reparallelizing (``odyssey.policy`` forced), one ``odyssey
   train`` run that kills rank 5 in the backward pass of step 2: the time from the kill to
   its detection, to the published plan and to the first step completed on the new plan
   (all from the run's own recovery record), and the bytes per rank the plan's
   survivor-to-stage mapping moves, Kuhn-Munkres against a naive mapping (survivors in id
   order). Targets on this machine: detection under 0.5 s, back to training under 1 s after
   rerouting and under 3 s after reparallelizing.
2. The decision latency on the 1024-rank Llama-2 70B config (configs/llama2_70b_h100_1024.yaml)
   after one rank fails: decided cold, and decided from the drafts ``DecisionCenter.prepare``
   priced in advance (what the live controller does between failures).

Run: .venv/bin/python benchmarks/recovery.py [--repeats N]
Absolute times on a shared 2-core machine are noisy; the run prints each repeat.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes" / "llama2_7b" / "tiny_cpu.yaml"
LARGE = ROOT / "configs" / "llama2_70b_h100_1024.yaml"
FAULT = "odyssey.faults=[{rank: 5, step: 2, phase: backward, action: kill}]"


def recovery_record(policy: str, work: Path, data_cache: Path) -> dict:
    run_dir = work / f"{policy}-{time.monotonic_ns()}"
    command = [sys.executable, "-m", "odyssey_megatron.cli", "train", "--config", str(RECIPE), "--run-dir",
               str(run_dir), "training.train_iters=4", f"data.cache_dir={data_cache}", f"odyssey.policy={policy}",
               FAULT]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=ROOT)
    if done.returncode != 0:
        raise SystemExit(f"odyssey train ({policy}) exited {done.returncode}:\n{done.stderr[-3000:]}")
    from odyssey_megatron.run_dir import read_jsonl

    events = read_jsonl(run_dir / "events.jsonl", key="--run-dir")
    (record,) = [e for e in events if e["event"] == "recovery"]
    return record


def decision_latency(repeats: int) -> tuple[list[float], list[float]]:
    from odyssey_megatron.config import load_config
    from odyssey_megatron.decision_center import DecisionCenter

    config = load_config(LARGE)
    cold, prepared = [], []
    for _ in range(repeats):
        center = DecisionCenter.from_recipe(config)
        started = time.perf_counter()
        center.on_failure(ranks=[5])
        cold.append(time.perf_counter() - started)
        center = DecisionCenter.from_recipe(config)
        center.prepare(cases=[frozenset([center.cluster.worker_of(5)])])
        started = time.perf_counter()
        center.on_failure(ranks=[5])
        prepared.append(time.perf_counter() - started)
    return cold, prepared


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=1, help="runs per policy (default 1)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as work:
        work, data_cache = Path(work), Path(work) / "data-cache"
        print("recovery after SIGKILL of rank 5 in backward of step 2, tiny recipe, 8 ranks")
        print(f"{'policy':<14}{'detected':>10}{'planned':>10}{'first step':>12}{'KM MiB':>9}{'naive MiB':>11}")
        for policy in ("reroute", "reparallelize"):
            for _ in range(args.repeats):
                r = recovery_record(policy, work, data_cache)
                print(f"{r['policy']:<14}{r['detection_s']:>9.3f}s{r['to_plan_s']:>9.3f}s{r['to_first_step_s']:>11.3f}s"
                      f"{r['mapping_bytes'] / 2**20:>9.2f}{r['naive_mapping_bytes'] / 2**20:>11.2f}")
    cold, prepared = decision_latency(args.repeats)
    print(f"decision after one failed rank, {LARGE.name}: cold {statistics.median(cold):.3f} s, "
          f"prepared {statistics.median(prepared) * 1e3:.1f} ms "
          f"({statistics.median(cold) / statistics.median(prepared):.0f}x)")


if __name__ == "__main__":
    main()
