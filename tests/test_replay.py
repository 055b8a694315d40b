"""The one replay engine (``estimator.replay``) prices op lists exactly as the three loops
it replaced: list scheduling (``simulate_pipelines``), split backwards over several
steps (``decoupled_pipelines``), and fixed lists, one step or staggered steps
(``fixed_order_step``, ``staggered_period``).

Exact equality, not approximate: every time is the same max-plus expression over the
same floats, so any difference is a changed rule, not rounding. Random cases cover
symmetric and uneven layouts, uneven micro-batch counts, reroutes after random failures,
tied embeddings (workers in several optimizer groups), links that differ across nodes,
memory budgets that force weight gradients early, retake snapshots beside compute or in
line, one to four steps, and fixed lists that mix split and plain workers or are
shuffled into deadlock.

Two checks. The old loops' results on 404 seeded cases are frozen as fingerprints
(``replay_golden.json``: ``record`` with the old functions passed in, at commit 916a829;
the case digests were renewed when the plan JSON dropped launch-time ranks and when the
profile gained measured fields, each time with every result fingerprint unchanged; beside
the engine, a hypothesis test over random seeds compared the two live before the old
loops went). And a brute-force reference, a fixed point of the recurrence, times
fixed lists independently of the engine.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from helpers import asymmetric_plan, symmetric_plan
from odyssey_megatron.cluster import ClusterState
from odyssey_megatron.estimator.decoupled import decoupled_pipelines
from odyssey_megatron.estimator.pipeline import (
    PipelineTiming, fixed_order_step, makespan_lower_bound, simulate_pipelines,
)
from odyssey_megatron.estimator.replay import ScheduleDeadlock, op_graph, p2p_time
from odyssey_megatron.estimator.staggered import staggered_period
from odyssey_megatron.estimator.wakeup_loop import run_wakeup_loop, warm_up
from odyssey_megatron.estimator.step_schedule import ROUNDING, _choose_split, _fits_memory, step_time
from odyssey_megatron.planner.reroute import reroute_plan
from odyssey_megatron.profile import BlockCost, uniform_profile
from odyssey_megatron.schedules.ops import BACKWARD, FORWARD, WEIGHT_GRAD, Op, dependency, one_f_one_b, stream_sources

GOLDEN = json.loads(Path(__file__).with_name("replay_golden.json").read_text())
"""Per seed: fingerprints of the case and of each entry point's results under the old loops."""


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
    """A short fingerprint of times (exact, as float.hex), op orders and the order workers
    are listed in."""
    def plain(v):
        if isinstance(v, float):
            return v.hex()
        if isinstance(v, Op):
            return f"{v.kind}{v.pipeline}.{v.stage}.{v.micro_batch}"
        if isinstance(v, Mapping):  # a dict, or a replay's op orders (``OpLists``)
            return [[plain(k), plain(x)] for k, x in v.items()]
        if isinstance(v, (list, tuple)):
            return [plain(x) for x in v]
        return v
    return hashlib.sha256(json.dumps(plain(value)).encode()).hexdigest()[:12]


def _golden_repr(profile) -> str:
    """The profile's repr as the golden file recorded it: before profile format version 2
    added the fixed cost per op and the optimizer's cost, and the measured snapshot copy and
    parity XOR rates, nil in these cases."""
    assert profile.op_overhead_s == profile.optimizer_s_per_param_byte == 0.0
    assert profile.snapshot_copy_bandwidth is profile.parity_xor_bandwidth is None
    return repr(profile).replace(", op_overhead_s=0.0, optimizer_s_per_param_byte=0.0, snapshot_copy_bandwidth=None, "
                                 "parity_xor_bandwidth=None", "")


def _timing(t: PipelineTiming) -> list:
    return [t.makespan_s, t.pipeline_end_s, t.worker_busy_s, t.schedule]


def _or_deadlock(price):
    try:
        return price()
    except ScheduleDeadlock:
        return "deadlock"


def record(seed: int, simulate, decouple, fixed, period) -> dict[str, str]:
    """Fingerprints of what the four entry points (``simulate_pipelines``,
    ``decoupled_pipelines``, ``fixed_order_step``, ``staggered_period``, or the old loops)
    give on random case ``seed``, and of the case itself. Fixed lists are the plain and
    split ones, a mix per worker, and one with a shuffled worker (a deadlock, mostly)."""
    rng = random.Random(seed)
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
        "case": _digest([plan.to_json(), _golden_repr(profile), repr(cluster), iterations]),
        "plain": _digest(_timing(plain)),
        "split": _digest([_timing(split.first), split.period_s, split.last]),
        "fixed": _digest({name: _or_deadlock(lambda: _timing(fixed(plan, profile, cluster, ops)))
                          for name, ops in lists.items()}),
        "staggered": _digest({name: _or_deadlock(lambda: period(plan, profile, cluster, ops, iterations=iterations))
                              for name, ops in lists.items()}),
    }


@pytest.mark.parametrize("seed", list(GOLDEN), ids=str)
def test_the_engine_prices_like_the_old_loops(seed):
    got = record(int(seed), simulate_pipelines, decoupled_pipelines, fixed_order_step, staggered_period)
    assert got["case"] == GOLDEN[seed]["case"], "the generator builds another case now (planner or helpers changed)"
    assert got == GOLDEN[seed]


def brute_force_step(plan, profile, cluster, schedule) -> tuple[float, tuple[float, ...]] | str:
    """(makespan, end per pipeline) of one step of fixed op lists, or "deadlock": sweep
    every worker's list, timing each op whose predecessor on its worker and whose
    dependency are timed, at max(predecessor's end, dependency's end + transfer), until
    a sweep times nothing."""
    num_stages = [p.num_stages for p in plan.pipelines]
    location = {op: worker for worker, ops in schedule.items() for op in ops}
    end: dict[Op, float] = {}
    progress = True
    while progress:
        progress = False
        for worker, ops in schedule.items():
            split = any(op.kind == WEIGHT_GRAD for op in ops)
            for i, op in enumerate(ops):
                if op in end:
                    continue
                if i and ops[i - 1] not in end:
                    break
                start = end[ops[i - 1]] if i else 0.0
                dep = None if op.kind == WEIGHT_GRAD else dependency(op, num_stages=num_stages[op.pipeline])
                if dep is not None:
                    if dep not in end:
                        break
                    same_node = cluster is None or cluster.same_node(location[dep], worker)
                    link_s = 0.0 if location[dep] == worker else p2p_time(profile, same_node=same_node)
                    start = max(start, end[dep] + link_s)
                stage = plan.pipelines[op.pipeline].stages[op.stage]
                times = profile.stage_times(*stage.layers, first=op.stage == 0,
                                            last=op.stage == num_stages[op.pipeline] - 1)
                seconds = {FORWARD: times.forward_s, WEIGHT_GRAD: times.weight_grad_s,
                           BACKWARD: times.input_grad_s if split else times.backward_s}[op.kind]
                end[op] = start + seconds
                progress = True
    if len(end) < sum(len(ops) for ops in schedule.values()):
        return "deadlock"
    pipeline_end = [0.0] * len(plan.pipelines)
    for op, t in end.items():
        pipeline_end[op.pipeline] = max(pipeline_end[op.pipeline], t)
    return max(end.values(), default=0.0), tuple(pipeline_end)


@settings(max_examples=100, deadline=None)
@given(seed=st.integers(0, 2**32))
def test_fixed_lists_time_like_a_brute_force_fixed_point(seed):
    """Fixed lists (the plain and split ones the list scheduler chose, a mix, a shuffle)
    replay to the brute-force times, and the chosen lists to the times the list
    scheduler reported for them."""
    rng = random.Random(seed)
    plan, profile, cluster, iterations = random_case(rng)
    plain = simulate_pipelines(plan, profile, cluster)
    split = decoupled_pipelines(plan, profile, cluster, iterations=iterations)
    shuffled = dict(plain.schedule)
    victim = rng.choice(sorted(shuffled))
    shuffled[victim] = rng.sample(shuffled[victim], len(shuffled[victim]))
    mixed = {w: (split.last if rng.random() < 0.5 else plain.schedule)[w] for w in plain.schedule}
    for ops in (plain.schedule, split.first.schedule, split.last, mixed, shuffled):
        expected = brute_force_step(plan, profile, cluster, ops)
        got = _or_deadlock(lambda: fixed_order_step(plan, profile, cluster, ops))
        assert got == expected if got == "deadlock" else (got.makespan_s, got.pipeline_end_s) == expected
    for listed in (plain, split.first):
        again = fixed_order_step(plan, profile, cluster, listed.schedule)
        assert (again.makespan_s, again.pipeline_end_s, again.worker_busy_s) == (
            listed.makespan_s, listed.pipeline_end_s, listed.worker_busy_s)


@pytest.mark.parametrize("seed", list(GOLDEN)[:200], ids=str)
def test_the_plain_makespan_bound_holds_and_choices_match_replaying_every_variant(seed):
    """``makespan_lower_bound`` never exceeds what list scheduling gives (where it is
    tight, but for rounding: it sums the same times in another order); and the split-or-plain
    choice, which skips plain 1F1B's replay where split op lists beat that bound, picks
    what replaying plain 1F1B first, then the split first step, then the split later step
    picks, at the same step time and memory verdict."""
    rng = random.Random(int(seed))
    plan, profile, cluster, _ = random_case(rng)
    graph = op_graph(plan, profile, cluster)
    plain = simulate_pipelines(plan, profile, cluster, graph=graph)
    assert makespan_lower_bound(graph) * (1 - ROUNDING) <= plain.makespan_s  # equal but for the sums' order
    for staggered in (False, True):
        split = decoupled_pipelines(plan, profile, cluster, iterations=2 if staggered else 1)
        best = plain, step_time(plan, profile, cluster, plain, staggered=staggered)
        later = (fixed_order_step(plan, profile, cluster, split.last),) if staggered else ()
        for timing in (split.first, *later):  # the later step only where the steady state is faster
            timing_s = step_time(plan, profile, cluster, timing, staggered=staggered)
            if timing is split.first or split.period_s < best[1] * (1 - ROUNDING):
                if timing_s < best[1] and _fits_memory(plan, profile, timing):
                    best = timing, timing_s
        timing, timing_s, fits = _choose_split(plan, profile, cluster, staggered)
        assert (timing.schedule, timing.makespan_s, timing_s) == (best[0].schedule, best[0].makespan_s, best[1])
        assert fits == (best[0] is not plain or _fits_memory(plan, profile, plain))


def test_the_plain_makespan_bound_is_tight_on_a_uniform_pipeline():
    """On one pipeline of equal stages 1F1B is as fast as the bound allows: the last
    stage never waits once its first forward arrives."""
    profile = uniform_profile(num_layers=4, forward_s=1.0, backward_s=2.0, layer_state_bytes=1, activation_bytes=1,
                              memory_budget_bytes=1 << 40)
    plan = symmetric_plan(dp=1, pp=4, num_layers=4, micro_batches_per_pipeline=6)
    graph = op_graph(plan, profile, None)
    assert makespan_lower_bound(graph) == simulate_pipelines(plan, profile, graph=graph).makespan_s


def test_every_replay_runs_the_one_compiled_loop_that_warm_up_loads():
    """List scheduling, split backwards, fixed lists and staggered steps all call the
    compiled loop with the argument types ``warm_up`` compiles, so the decision center's
    warm-up leaves nothing to compile during a decision (numba compiles per type)."""
    warm_up()
    rng = random.Random(7)
    for _ in range(5):
        plan, profile, cluster, iterations = random_case(rng)
        split = decoupled_pipelines(plan, profile, cluster, iterations=iterations)
        fixed_order_step(plan, profile, cluster, simulate_pipelines(plan, profile, cluster).schedule)
        _or_deadlock(lambda: staggered_period(plan, profile, cluster, split.last, iterations=iterations))
    assert len(run_wakeup_loop.signatures) == 1


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32))
def test_the_op_graph_holds_each_stream_as_one_f_one_b_restricted_to_its_micro_batches(seed):
    """The arrays ``op_graph`` builds name, worker by worker, the streams of
    ``stream_sources`` op for op (each the 1F1B order of its stage over its pipeline's
    micro-batches, kept to those the worker runs), then a W per B; each op's dependency
    and consumer are ``dependency``'s, its worker the one running it."""
    plan, profile, cluster, _ = random_case(random.Random(seed))
    graph = op_graph(plan, profile, cluster)
    expected = []
    for worker in sorted(stream_sources(plan)):
        for pi, si, keep in stream_sources(plan)[worker]:
            pipeline = plan.pipelines[pi]
            order = one_f_one_b(list(pipeline.micro_batches), stage=si, num_stages=pipeline.num_stages)
            stream = [Op(kind, pi, si, mb) for kind, mb in order if keep is None or mb in keep]
            expected.append((worker, stream))
    stream_ops = [op for _, stream in expected for op in stream]
    assert list(graph.ops) == stream_ops + [op._replace(kind=WEIGHT_GRAD) for op in stream_ops if op.kind == BACKWARD]
    starts = graph.stream_ops_start.tolist()
    assert [graph.ops[a:b] for a, b in zip(starts, starts[1:])] == [tuple(stream) for _, stream in expected]
    owner = {op: worker for worker, stream in expected for op in stream}
    backward_of = {w: b for b, w in enumerate(graph.weight_grad.tolist()) if w >= 0}
    for i, op in enumerate(graph.ops):
        if op.kind == WEIGHT_GRAD:
            assert graph.dependency[i] == -1 and graph.ops[backward_of[i]] == op._replace(kind=BACKWARD)
            continue
        assert graph.workers[graph.worker[i]] == owner[op]
        wanted = dependency(op, num_stages=plan.pipelines[op.pipeline].num_stages)
        assert (graph.dependency[i] == -1) if wanted is None else graph.ops[graph.dependency[i]] == wanted
        if wanted is not None:
            assert graph.consumer[graph.dependency[i]] == i
