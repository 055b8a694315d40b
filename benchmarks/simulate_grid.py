"""Where each system wins: cluster size x failure rate x repairs (Llama-2 7B, 910B).

Every cell runs all systems on the same seeded events (DP x PP4, 8 micro-batches per
pipeline). Large clusters at high rates would see thousands of failures in 9 h; the
duration is cut so a cell expects at most --max-failures failures (printed per cell).
Prints average throughput as a fraction of the fault-scaled ideal, Odyssey's ratio to
the best baseline, and Odyssey's fraction of the hindsight oracle, one row per cell as it
finishes (largest cells start first).
Run: .venv/bin/python benchmarks/simulate_grid.py [--quick] [--jobs 2] [--sizes 512 1024]
"""

from __future__ import annotations

import argparse
import time
from concurrent.futures import ProcessPoolExecutor, as_completed

from odyssey_megatron.simulator.run import simulate
from odyssey_megatron.simulator.scenario import BASELINES, SYSTEMS, load_scenario


def cell(devices: int, rate: float, repairs: bool, *, max_failures: float, seed: int) -> tuple[float, dict, float]:
    dp = devices // 4
    duration = min(9.0, max_failures / (devices * rate))
    scenario = load_scenario("configs/scenarios/paper_32npu.yaml", [
        f"recipe_overrides=[parallel.data_parallel_size={dp},training.global_batch_size={8 * dp}]",
        f"failures.rate_per_device_hour={rate}", f"repairs.enabled={str(repairs).lower()}",
        f"duration_hours={duration}", f"seed={seed}", "wandb_mode=disabled",
        # Oobleck needs (f+1) * n0 workers; n0 = 3 for Llama-2 7B on 910B, so 8 devices allow f = 1.
        f"oobleck_tolerated_failures={1 if devices < 12 else 2}",
        f"systems=[{','.join(SYSTEMS)}]",
    ])
    started = time.perf_counter()
    summaries = simulate(scenario).summaries
    return duration, summaries, time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="8-128 devices, two rates")
    parser.add_argument("--max-failures", type=float, default=60.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--jobs", type=int, default=1, help="cells simulated in parallel processes")
    parser.add_argument("--sizes", type=int, nargs="+", help="cluster sizes (default: 8-1024, or 8-128 with --quick)")
    parser.add_argument("--smoke", action="store_true",
                        help="CI's check that it runs: --quick's rates at 8 devices, at most one failure a cell")
    args = parser.parse_args()
    if args.smoke:
        args.quick, args.sizes, args.max_failures = True, [8], 1.0
    sizes = args.sizes or ([8, 32, 128] if args.quick else [8, 32, 128, 512, 1024])
    rates = [0.01, 0.2] if args.quick else [0.01, 0.05, 0.1, 0.2]
    cells = [(devices, rate, repairs) for devices in sizes for rate in rates for repairs in (False, True)]
    shown = ["odyssey", *BASELINES]
    header = " ".join(f"{s:>12}" for s in shown)
    print(f"{'devices':>7} {'rate/h':>6} {'repair':>6} {'hours':>5}  fraction of fault-scaled ideal: {header}"
          f"  {'ody/best':>8} {'best':>12} {'ody/oracle':>10} {'secs':>5}", flush=True)
    with ProcessPoolExecutor(max_workers=args.jobs) as pool:
        # Largest cells first, so the slowest do not start last; rows print as cells finish.
        futures = {pool.submit(cell, *c, max_failures=args.max_failures, seed=args.seed): c
                   for c in sorted(cells, key=lambda c: (-c[0], -c[1], c[2]))}
        for future in as_completed(futures):
            devices, rate, repairs = futures[future]
            hours, summaries, seconds = future.result()
            fractions = " ".join(f"{summaries[s].fraction_of_ideal:12.3f}" for s in shown)
            best = max(BASELINES, key=lambda s: summaries[s].avg_throughput)
            odyssey = summaries["odyssey"].avg_throughput
            oracle = summaries["oracle"].avg_throughput
            print(f"{devices:>7} {rate:>6} {str(repairs):>6} {hours:5.2f}  {' ' * 32}{fractions}"
                  f"  {odyssey / summaries[best].avg_throughput:8.3f} {best:>12} {odyssey / oracle:10.3f}"
                  f" {seconds:5.0f}", flush=True)


if __name__ == "__main__":
    main()
