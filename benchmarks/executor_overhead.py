"""Executor overhead and coloured DP sync, measured on CPU ranks (gloo, real compute).

1. Step time of the Odyssey op-list executor against Megatron-Core's own 1F1B schedule on
   the same symmetric DP2 x PP2 plan, same world, steps alternated so all see the same
   machine noise. Target: overhead under 2 %. Also Megatron's schedule with the DP sync
   overlapped with backward.
2. What staggered optimizer steps cost on the same plan rerouted after a last stage
   failed (3 ranks): the host snapshot, run in line on CPU, and the settle wait. On 2
   cores the ranks share the CPU, so the bubbles staggering fills are not idle time and
   no gain can show; the estimator's predicted gain is printed beside it.
3. Gradient-sync time on an asymmetric plan ([4,4] and [3,3,2] over 5 ranks): the
   restorer's coloured rounds (blocks with the same holders fused, disjoint units
   concurrent) against one all-reduce per layer, one after another.

Prints medians and the ratios. Run: .venv/bin/python benchmarks/executor_overhead.py
Absolute times on a shared 2-core machine are noise; read the ratios.
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import replace

from megatron.core.optimizer import OptimizerConfig

from odyssey_megatron.config import ModelConfig
from odyssey_megatron.data import SyntheticTokens
from odyssey_megatron.hooks.process_groups import RankMap
from odyssey_megatron.plan import ExecutionPlan, PipelinePlan, StagePlan, SyncUnit
from odyssey_megatron.estimator.program import step_program
from odyssey_megatron.estimator.step_schedule import step_schedule, step_time
from odyssey_megatron.planner.layers import stage_ranges
from odyssey_megatron.planner.reroute import reroute_plan
from odyssey_megatron.profile import uniform_profile
from odyssey_megatron.restorer import with_sync
from odyssey_megatron.testing.local_world import run_world

MODEL = ModelConfig(num_layers=8, hidden_size=256, ffn_hidden_size=688, num_attention_heads=8, num_query_groups=8,
                    vocab_size=1024, seq_length=128, params_dtype="fp32")
MICRO_BATCH_SIZE = 2


def _plan(splits, micro_batches, workers_of=None) -> ExecutionPlan:
    pipelines, worker, start = [], 0, 0
    for d, (split, count) in enumerate(zip(splits, micro_batches)):
        stages = []
        for s, layers in enumerate(stage_ranges(split)):
            stages.append(StagePlan(workers_of(d, s) if workers_of else worker, layers))
            worker += 1
        pipelines.append(PipelinePlan(tuple(stages), tuple(range(start, start + count))))
        start += count
    plan = ExecutionPlan(0, "reparallelize", MODEL.num_layers, 1, tuple(pipelines))
    return with_sync(plan, uniform_profile(num_layers=MODEL.num_layers))


def one_layer_at_a_time(plan: ExecutionPlan) -> ExecutionPlan:
    """Every block its own unit, each all-reduce in a round of its own, in model order."""
    units = tuple(SyncUnit((b,), u.workers) for u in plan.sync_units for b in u.blocks)
    rounds = tuple((i,) for i, u in enumerate(units) if len(u.workers) > 1)
    return replace(plan, sync_units=units, comm_rounds=rounds)


def _runner(plan, rank, world, schedule="auto", overlap=False, staggered=False):
    """A rank of ``plan`` running the step program the decision center would publish
    (split backwards where they pay; never for Megatron's 1F1B), from the seed's state."""
    from odyssey_megatron.runtime.rank.plan_runner import PlanRunner, initial_state

    program = step_program(plan, uniform_profile(num_layers=MODEL.num_layers), decouple=schedule != "megatron",
                           staggered=staggered)
    ranks = RankMap.identity(world, 1)
    return PlanRunner(plan=plan, program=program, rank=rank, ranks=ranks, model=MODEL,
                      micro_batch_size=MICRO_BATCH_SIZE,
                      state=initial_state(plan=plan, rank=rank, ranks=ranks, model=MODEL, seed=1),
                      optimizer=OptimizerConfig(lr=1e-4),
                      schedule=schedule, overlap_grad_sync=overlap)


def executor_vs_megatron(rank: int, world: int, plan_json: str, steps: int) -> dict[str, list[float]]:
    plan = ExecutionPlan.from_json(plan_json)
    runners = {
        "megatron": _runner(plan, rank, world, "megatron"),
        "odyssey": _runner(plan, rank, world, "odyssey"),
        "megatron+overlap": _runner(plan, rank, world, "megatron", overlap=True),
    }
    return _alternate(runners, steps)


def staggered_vs_synchronous(rank: int, world: int, plan_json: str, steps: int) -> dict[str, list[float]]:
    plan = ExecutionPlan.from_json(plan_json)
    runners = {
        "synchronous": _runner(plan, rank, world, "odyssey"),
        "staggered": _runner(plan, rank, world, "odyssey", staggered=True),
    }
    times = _alternate(runners, steps)
    runners["staggered"].settle()
    return times


def _alternate(runners: dict, steps: int) -> dict[str, list[float]]:
    """Seconds per step of each runner, their steps alternated."""
    import torch.distributed as dist

    data = SyntheticTokens(MODEL.vocab_size, MODEL.seq_length, MICRO_BATCH_SIZE)
    times: dict[str, list[float]] = {name: [] for name in runners}
    for step in range(steps + 1):
        for name, runner in runners.items():
            dist.barrier()
            started = time.perf_counter()
            runner.train_step(lambda m, step=step: data.micro_batch(step, m))
            dist.barrier()
            if step:  # the first step warms up allocators and gloo connections
                times[name].append(time.perf_counter() - started)
    return times


def sync_rounds(rank: int, world: int, plan_json: str, repeats: int) -> dict[str, list[float]]:
    import torch.distributed as dist

    plan = ExecutionPlan.from_json(plan_json)
    variants = {"coloured": plan, "per-layer": one_layer_at_a_time(plan)}
    data = SyntheticTokens(MODEL.vocab_size, MODEL.seq_length, MICRO_BATCH_SIZE)
    times: dict[str, list[float]] = {name: [] for name in variants}
    runners = {name: _runner(p, rank, world, "odyssey") for name, p in variants.items()}
    for runner in runners.values():
        runner.train_step(lambda m: data.micro_batch(0, m), apply=False)
    for _ in range(repeats):
        for name, runner in runners.items():
            dist.barrier()
            started = time.perf_counter()
            runner.grad_sync.sync()
            dist.barrier()
            times[name].append(time.perf_counter() - started)
    return times


def _medians(per_rank: list[dict[str, list[float]]]) -> dict[str, float]:
    names = per_rank[0].keys()
    return {name: statistics.median(max(r[name][i] for r in per_rank) for i in range(len(per_rank[0][name])))
            for name in names}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()

    symmetric = _plan([(4, 4)] * 2, [8, 8], workers_of=lambda d, s: s * 2 + d)
    step = _medians(run_world(executor_vs_megatron, 4, symmetric.to_json(), args.steps, timeout=900))
    print(f"DP2xPP2, 8 layers h{MODEL.hidden_size}, 16 micro-batches, {args.steps} steps (median of slowest rank):")
    print(f"  Megatron 1F1B   {step['megatron'] * 1e3:8.1f} ms/step")
    print(f"  Odyssey ops     {step['odyssey'] * 1e3:8.1f} ms/step")
    print(f"  overhead        {(step['odyssey'] / step['megatron'] - 1) * 100:+8.2f} %")
    print(f"  Megatron 1F1B with DP sync overlapped: {step['megatron+overlap'] * 1e3:.1f} ms/step "
          f"({(step['megatron+overlap'] / step['megatron'] - 1) * 100:+.2f} %)")

    profile = uniform_profile(num_layers=MODEL.num_layers)
    rerouted = with_sync(reroute_plan(symmetric, failed_workers={3}, profile=profile), profile)
    timing = step_schedule(rerouted, profile, decouple=True, staggered=True)
    predicted = step_time(rerouted, profile, None, timing, staggered=True) / timing.makespan_s - 1
    stagger = _medians(run_world(staggered_vs_synchronous, 3, rerouted.to_json(), args.steps, timeout=900))
    print("The same plan, its last stage of pipeline 1 failed and rerouted, 3 ranks, split backwards:")
    print(f"  synchronous steps {stagger['synchronous'] * 1e3:8.1f} ms/step")
    print(f"  staggered steps   {stagger['staggered'] * 1e3:8.1f} ms/step "
          f"({(stagger['staggered'] / stagger['synchronous'] - 1) * 100:+.2f} %; the estimator predicts "
          f"{predicted * 100:+.2f} % for these op lists on dedicated devices, uniform layer times)")

    asymmetric = _plan([(4, 4), (3, 3, 2)], [6, 4])
    per_layer = one_layer_at_a_time(asymmetric)
    sync = _medians(run_world(sync_rounds, 5, asymmetric.to_json(), args.repeats, timeout=900))
    print(f"[4,4] + [3,3,2] over 5 ranks, DP gradient sync ({args.repeats} repeats):")
    print(f"  coloured rounds {sync['coloured'] * 1e3:8.1f} ms  ({len(asymmetric.comm_rounds)} rounds, "
          f"{sum(len(u.workers) > 1 for u in asymmetric.sync_units)} all-reduces)")
    print(f"  per layer       {sync['per-layer'] * 1e3:8.1f} ms  ({len(per_layer.comm_rounds)} all-reduces in a row)")
    print(f"  speed-up        {sync['per-layer'] / sync['coloured']:8.2f} x")


if __name__ == "__main__":
    main()
