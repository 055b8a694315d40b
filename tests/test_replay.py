"""The one replay engine (``estimator.replay``) prices op lists exactly as the three loops
it replaced: list scheduling (``simulate_pipelines``), split backwards over several
steps (``decoupled_pipelines``), and fixed lists, one step or staggered steps
(``fixed_order_step``, ``staggered_period``).

Exact equality, not approximate: every time is the same max-plus expression over the
same floats, so any difference is a changed rule, not rounding. Random plans cover
symmetric and uneven layouts, uneven micro-batch counts, reroutes after random failures,
tied embeddings (workers in several optimizer groups), links that differ across nodes,
memory budgets that force weight gradients early, retake snapshots beside compute or in
line, one to four steps, and fixed lists that mix split and plain workers or are
shuffled into deadlock.
"""

from __future__ import annotations

import hashlib
import json
import random
from dataclasses import replace

from hypothesis import given, settings
from hypothesis import strategies as st

from helpers import asymmetric_plan, symmetric_plan
from odyssey_megatron.cluster import ClusterState
from odyssey_megatron.estimator import decoupled, pipeline, staggered
from odyssey_megatron.estimator.pipeline import PipelineTiming
from odyssey_megatron.estimator.replay import ScheduleDeadlock
from odyssey_megatron.planner.reroute import reroute_plan
from odyssey_megatron.profile import BlockCost, uniform_profile
from odyssey_megatron.schedules.ops import Op


def random_case(rng: random.Random):
    """(plan, profile, cluster, iterations) of one random case."""
    num_layers = rng.randint(2, 8)
    dp = rng.randint(1, 4)
    if rng.random() < 0.4:
        plan = symmetric_plan(dp=dp, pp=rng.randint(1, min(4, num_layers)), num_layers=num_layers,
                              micro_batches_per_pipeline=rng.randint(1, 6))
    else:
        stage_counts = [rng.randint(1, min(4, num_layers))] * dp
        if rng.random() < 0.3:  # pipelines of different lengths
            stage_counts = [rng.randint(1, min(4, num_layers)) for _ in range(dp)]
        splits = []
        for pp in stage_counts:
            cuts = sorted(rng.sample(range(1, num_layers), pp - 1))
            splits.append(tuple(b - a for a, b in zip([0, *cuts], [*cuts, num_layers])))
        plan = asymmetric_plan(splits, [rng.randint(1, 6) for _ in range(dp)])
    base = uniform_profile(num_layers=num_layers, forward_s=rng.uniform(0.1, 3), backward_s=rng.uniform(0.1, 6),
                           layer_state_bytes=100, activation_bytes=rng.randint(1, 5),
                           memory_budget_bytes=rng.choice([1 << 62, rng.randint(100, 1200)]))
    edge = BlockCost(rng.uniform(0, 1), rng.uniform(0, 2), 60, 0, 0, rng.randint(0, 2))
    profile = replace(
        base, embedding=edge, output=edge, tie_embeddings=rng.random() < 0.3,
        layers=tuple(replace(layer, optimizer_bytes=rng.randint(0, 3)) for layer in base.layers),
        p2p_bytes=rng.choice([0, 1]), intra_node_bandwidth=rng.uniform(1, 10), inter_node_bandwidth=rng.uniform(0.1, 1),
        link_latency_s=rng.uniform(0, 0.1), host_bandwidth=rng.uniform(0.05, 10), host_copy_async=rng.random() < 0.5,
    )
    failed = set(rng.sample(plan.workers, rng.randint(0, min(3, len(plan.workers) - 1))))
    plan = (reroute_plan(plan, failed_workers=failed, profile=profile) if failed else None) or plan
    cluster = None if rng.random() < 0.3 else ClusterState(world_size=dp * max(len(p.stages) for p in plan.pipelines),
                                                          devices_per_node=rng.randint(1, 4))
    return plan, profile, cluster, rng.randint(1, 4)


def _digest(value) -> str:
    """A short fingerprint of times (exact, as float.hex), op orders and the order workers are listed in."""
    def plain(v):
        if isinstance(v, float):
            return v.hex()
        if isinstance(v, Op):
            return f"{v.kind}{v.pipeline}.{v.stage}.{v.micro_batch}"
        if isinstance(v, dict):
            return [[plain(k), plain(x)] for k, x in v.items()]
        if isinstance(v, (list, tuple)):
            return [plain(x) for x in v]
        return v
    return hashlib.sha256(json.dumps(plain(value)).encode()).hexdigest()[:16]


def _timing(t: PipelineTiming) -> dict:
    return {"makespan_s": t.makespan_s.hex(),
            "detail": _digest([t.pipeline_end_s, t.worker_busy_s, t.schedule])}


def _or_deadlock(price):
    try:
        return price()
    except ScheduleDeadlock:
        return "deadlock"


def record(rng: random.Random, simulate, decouple, fixed, period) -> dict:
    """What the four entry points (``simulate_pipelines``, ``decoupled_pipelines``,
    ``fixed_order_step``, ``staggered_period`` or their stand-ins) give on one random case:
    times exactly, op orders as digests; fixed lists are the plain and split ones, a mix
    per worker, and one with a shuffled worker."""
    plan, profile, cluster, iterations = random_case(rng)
    plain = simulate(plan, profile, cluster)
    split = decouple(plan, profile, cluster, iterations=iterations)
    lists = {"plain": plain.schedule, "first": split.first.schedule, "last": split.last}
    lists["mixed"] = {w: (split.last if rng.random() < 0.5 else plain.schedule)[w] for w in plain.schedule}
    shuffled = dict(plain.schedule)
    victim = rng.choice(sorted(shuffled))
    shuffled[victim] = rng.sample(shuffled[victim], len(shuffled[victim]))
    lists["shuffled"] = shuffled
    return {
        "plain": _timing(plain),
        "split": {"first": _timing(split.first), "period_s": split.period_s.hex(), "last": _digest(split.last)},
        "fixed": {name: _or_deadlock(lambda: _timing(fixed(plan, profile, cluster, ops)))
                  for name, ops in lists.items()},
        "staggered": {name: _or_deadlock(lambda: period(plan, profile, cluster, ops, iterations=iterations).hex())
                      for name, ops in lists.items()},
    }


@settings(max_examples=300, deadline=None)
@given(seed=st.integers(0, 2**32))
def test_the_engine_prices_like_each_old_loop(seed):
    new = record(random.Random(seed), pipeline.simulate_pipelines, decoupled.decoupled_pipelines,
                 staggered.fixed_order_step, staggered.staggered_period)
    old = record(random.Random(seed), pipeline.legacy_simulate_pipelines, decoupled.legacy_decoupled_pipelines,
                 staggered.legacy_fixed_order_step, staggered.legacy_staggered_period)
    assert new == old
