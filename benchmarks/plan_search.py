"""Decision latency: search + estimate + transfer plan + colouring, after one failed rank.

Prints, per model and cluster size, the wall time of DecisionCenter.on_failure (median of
--repeats, each on a fresh decision center), the candidates it estimated and what it
chose. Targets (issue): 32 ranks under 50 ms, 1024 ranks under 1 s. Also the decision
when the rank comes back (on_join: off the critical path, with the pipeline-length sweep).
Run: .venv/bin/python benchmarks/plan_search.py
"""

from __future__ import annotations

import argparse
import statistics
import time

from odyssey_megatron.config import load_config
from odyssey_megatron.decision_center import DecisionCenter

# (model spec, device, ranks, TP, PP): Megatron-typical layouts, 8 micro-batches per pipeline.
SCENARIOS = [
    ("llama2-7b", "ascend-910b", 32, 1, 4),
    ("llama2-7b", "ascend-910b", 256, 1, 4),
    ("llama2-7b", "ascend-910b", 1024, 1, 4),
    ("llama2-7b", "ascend-910b", 4096, 1, 4),
    ("llama2-70b", "h100-80gb", 32, 8, 4),
    ("llama2-70b", "h100-80gb", 256, 8, 8),
    ("llama2-70b", "h100-80gb", 1024, 8, 8),
    ("llama2-70b", "h100-80gb", 4096, 8, 8),
]


def measure(spec: str, device: str, ranks: int, tp: int, pp: int, repeats: int) -> tuple[float, float, str]:
    dp = ranks // (tp * pp)
    config = load_config(None, [
        f"model.spec={spec}", f"cluster.device={device}",
        f"parallel.tensor_model_parallel_size={tp}", f"parallel.pipeline_model_parallel_size={pp}",
        f"parallel.data_parallel_size={dp}", f"training.global_batch_size={8 * dp}",
    ])
    times, join_times, summary = [], [], ""
    for _ in range(repeats):
        center = DecisionCenter.from_recipe(config)
        started = time.perf_counter()
        decision = center.on_failure(ranks=[ranks // 2 + 1])
        times.append(time.perf_counter() - started)
        started = time.perf_counter()
        center.on_join(ranks=[ranks // 2 + 1])
        join_times.append(time.perf_counter() - started)
        c = decision.chosen
        alt = {a.policy: a for a in decision.alternatives}
        other = alt.get("reparallelize" if c.policy == "reroute" else "reroute")
        summary = (
            f"{c.policy:<13} step {c.estimate.step_time_s:7.3f} s  transition {c.transition_s:6.2f} s  "
            f"{decision.candidates_considered:3d} candidates"
            + (f"  (best {other.policy}: step {other.estimate.step_time_s:.3f} s)" if other else "")
        )
    return statistics.median(times), statistics.median(join_times), summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-ranks", type=int, default=4096)
    args = parser.parse_args()
    print(f"{'model':<11} {'ranks':>5} {'TPxPPxDP':>10} {'failure':>10} {'join':>10}  chosen after the failure")
    for spec, device, ranks, tp, pp in SCENARIOS:
        if ranks > args.max_ranks:
            continue
        seconds, join_seconds, summary = measure(spec, device, ranks, tp, pp, args.repeats)
        layout = f"{tp}x{pp}x{ranks // (tp * pp)}"
        print(f"{spec:<11} {ranks:>5} {layout:>10} {seconds * 1e3:7.1f} ms {join_seconds * 1e3:7.1f} ms  {summary}",
              flush=True)


if __name__ == "__main__":
    main()
