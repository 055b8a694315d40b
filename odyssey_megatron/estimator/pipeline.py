"""Pipeline time by dynamic programming over op lists (paper 001, Eq. 10-11).

The start of an op is the later of the end of the previous op on its worker and the end
of its dependency on another stage plus the point-to-point transfer between them:

    t_start(op) = max(t_end(prev op on worker), t_end(dependency) + t_p2p)

A worker with one stream (every worker of a plan without rerouting) runs it in order, so
this is exactly Eq. 11. A rerouting peer has several streams; whenever it is free it runs
the ready stream head that comes earliest in its stream's 1F1B order (own stream first
on ties), which is list scheduling over the same recurrence. Ops are processed in time
order with a heap, so the programme costs O(ops log ops); the order each worker ended up
with is returned as the schedule to execute. Step time is the latest end (Eq. 10).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Callable, Sequence

from odyssey_megatron.cluster import ClusterState
from odyssey_megatron.plan import ExecutionPlan
from odyssey_megatron.profile import ModelProfile
from odyssey_megatron.estimator.replay import OpGraph, ScheduleDeadlock, op_graph, p2p_time, replay
from odyssey_megatron.schedules.ops import FORWARD, Op, compile_streams, dependency, one_f_one_b


@dataclass(frozen=True)
class PipelineTiming:
    makespan_s: float
    """Time from the first op to the last over all pipelines (Eq. 10)."""
    pipeline_end_s: tuple[float, ...]
    """When each pipeline's last op ends."""
    worker_busy_s: dict[int, float]
    """Compute time per worker, for utilisation and bubble reports."""
    schedule: dict[int, list[Op]]
    """Each worker's ops in the order they ran: what the executor runs."""


@dataclass(frozen=True)
class LegacyOpGraph:
    """What a list scheduler over a plan's streams needs. Every schedule of one plan runs
    each op on the same worker, so one graph serves them all (plain, split, replayed)."""

    streams: dict[int, list[list[Op]]]
    """``compile_streams``: each worker's own stream, then the streams it adopts."""
    compute: dict[tuple[int, int], tuple[float, float]]
    """(forward, backward) seconds per (pipeline, stage)."""
    location: dict[Op, int]
    """The worker running each op."""
    needs: dict[Op, tuple[Op | None, float]]
    """Each op's dependency and the transfer time from the dependency's worker."""
    consumer: dict[Op, Op]
    """The op consuming each op's output."""


def legacy_op_graph(
    plan: ExecutionPlan, profile: ModelProfile, cluster: ClusterState | None,
    streams: dict[int, list[list[Op]]] | None = None,
) -> LegacyOpGraph:
    """The ``OpGraph`` of ``streams`` (by default the plan's ``compile_streams``)."""
    if streams is None:
        streams = compile_streams(plan)
    num_stages = [p.num_stages for p in plan.pipelines]
    compute: dict[tuple[int, int], tuple[float, float]] = {}
    for pi, si, stage in plan.stage_positions():
        start, end = stage.layers
        compute[pi, si] = profile.stage_compute(start, end, first=si == 0, last=si == num_stages[pi] - 1)
    location = {op: worker for worker, lists in streams.items() for ops in lists for op in ops}
    link_cache: dict[tuple[int, int], float] = {}

    def link_s(a: int, b: int) -> float:
        if (a, b) not in link_cache:
            same_node = cluster is None or cluster.same_node(a, b)
            link_cache[a, b] = 0.0 if a == b else p2p_time(profile, same_node=same_node)
        return link_cache[a, b]

    needs: dict[Op, tuple[Op | None, float]] = {}
    consumer: dict[Op, Op] = {}
    for op, worker in location.items():
        dep = dependency(op, num_stages=num_stages[op.pipeline])
        if dep is None:
            needs[op] = (None, 0.0)
            continue
        dep_worker = location.get(dep)
        needs[op] = (dep, 0.0 if dep_worker is None else link_s(dep_worker, worker))
        consumer[dep] = op
    return LegacyOpGraph(streams, compute, location, needs, consumer)


def simulate_pipelines(
    plan: ExecutionPlan, profile: ModelProfile, cluster: ClusterState | None = None, *, graph: OpGraph | None = None
) -> PipelineTiming:
    """Run the Eq. 11 programme over ``plan``, rerouting peers interleaving their streams
    by list scheduling. ``graph``: the plan's ``op_graph``, if the caller has it. Raises
    ScheduleDeadlock."""
    run = replay(graph or op_graph(plan, profile, cluster))
    return PipelineTiming(makespan_s=max(run.pipeline_end_s, default=0.0), pipeline_end_s=run.pipeline_end_s,
                          worker_busy_s=run.busy_s, schedule=run.first)


def legacy_simulate_pipelines(
    plan: ExecutionPlan,
    profile: ModelProfile,
    cluster: ClusterState | None = None,
    *,
    schedule: dict[int, list[Op]] | None = None,
    graph: LegacyOpGraph | None = None,
) -> PipelineTiming:
    """Run the Eq. 11 programme over ``plan``; a given ``schedule`` fixes each worker's
    order, otherwise streams are interleaved by list scheduling. ``graph``: the plan's
    ``op_graph``, if the caller has it. Raises ScheduleDeadlock."""
    if schedule is not None:
        streams = {worker: [list(ops)] for worker, ops in schedule.items()}
        graph = legacy_op_graph(plan, profile, cluster, streams)
    elif graph is None:
        graph = legacy_op_graph(plan, profile, cluster)
    streams, compute, location, needs, consumer = (
        graph.streams, graph.compute, graph.location, graph.needs, graph.consumer)

    end_time: dict[Op, float] = {}
    cursor = {worker: [0] * len(lists) for worker, lists in streams.items()}
    free_at = {worker: 0.0 for worker in streams}
    busy = {worker: 0.0 for worker in streams}
    order: dict[int, list[Op]] = {worker: [] for worker in streams}
    wakeups = [(0.0, worker) for worker in streams]
    heapq.heapify(wakeups)
    remaining = len(location)
    while wakeups:
        now, worker = heapq.heappop(wakeups)
        if now < free_at[worker]:
            continue  # busy; its own completion wakes it
        ready = ready_head(streams[worker], cursor[worker], needs, end_time.get, now)
        if ready is None:
            continue  # a completion elsewhere will wake this worker
        k, op = ready
        forward_s, backward_s = compute[op.pipeline, op.stage]
        duration = forward_s if op.kind == FORWARD else backward_s
        end_time[op] = free_at[worker] = now + duration
        busy[worker] += duration
        cursor[worker][k] += 1
        order[worker].append(op)
        remaining -= 1
        heapq.heappush(wakeups, (free_at[worker], worker))
        successor = consumer.get(op)
        if successor is not None and location[successor] != worker:
            heapq.heappush(wakeups, (free_at[worker] + needs[successor][1], location[successor]))
    if remaining:
        stuck = {w: lists for w, lists in streams.items() if any(c < len(o) for c, o in zip(cursor[w], lists))}
        heads = sorted((w, ops[c]) for w, lists in stuck.items() for c, ops in zip(cursor[w], lists) if c < len(ops))
        raise ScheduleDeadlock(f"ops wait on each other in a cycle: {heads[:4]}")

    pipeline_end = [0.0] * len(plan.pipelines)
    for op, t in end_time.items():
        pipeline_end[op.pipeline] = max(pipeline_end[op.pipeline], t)
    return PipelineTiming(
        makespan_s=max(pipeline_end, default=0.0),
        pipeline_end_s=tuple(pipeline_end),
        worker_busy_s=busy,
        schedule=order,
    )


def ready_head(
    streams: list[list[Op]],
    positions: list[int],
    needs: dict[Op, tuple[Op | None, float]],
    end_of: Callable[[Op], float | None],
    now: float,
) -> tuple[int, Op] | None:
    """(stream index, op): of one worker's stream heads, the one whose dependency's output
    has arrived by ``now`` and that comes earliest in its stream's 1F1B order, own stream
    first on ties (the list-scheduling rule). ``end_of`` is None for an op not yet run."""
    best = None
    for k, ops in enumerate(streams):
        position = positions[k]
        if position == len(ops):
            continue
        op = ops[position]
        dep, link = needs[op]
        if dep is not None:
            dep_end = end_of(dep)
            if dep_end is None or dep_end + link > now:
                continue
        if best is None or (position, k) < best[:2]:
            best = (position, k, op)
    return None if best is None else best[1:]


def lone_pipeline_time(
    stage_times: Sequence[tuple[float, float]], num_micro_batches: int, *, link_s: float
) -> float:
    """Eq. 11 for one pipeline whose stages each run plain 1F1B on their own worker.

    The same recurrence as ``simulate_pipelines`` (equal results, tested), without its
    general machinery: the planner prices thousands of candidate layer splits per
    decision. Stages are swept down then up, each running ops while their dependency
    has ended, until every op has run. ``stage_times`` is (forward, backward) per stage.
    """
    num_stages = len(stage_times)
    orders = [one_f_one_b(range(num_micro_batches), stage=s, num_stages=num_stages) for s in range(num_stages)]
    forward_end = [[None] * num_micro_batches for _ in range(num_stages)]
    backward_end = [[None] * num_micro_batches for _ in range(num_stages)]
    position = [0] * num_stages
    free_at = [0.0] * num_stages
    remaining = 2 * num_stages * num_micro_batches
    sweep = [*range(num_stages), *range(num_stages - 1, -1, -1)]
    while remaining:
        progressed = False
        for s in sweep:
            order, (forward_s, backward_s) = orders[s], stage_times[s]
            while position[s] < len(order):
                kind, mb = order[position[s]]
                if kind == FORWARD:
                    ready = free_at[s] if s == 0 else _after(forward_end[s - 1][mb], link_s, free_at[s])
                    if ready is None:
                        break
                    forward_end[s][mb] = free_at[s] = ready + forward_s
                else:
                    if s == num_stages - 1:
                        ready = _after(forward_end[s][mb], 0.0, free_at[s])
                    else:
                        ready = _after(backward_end[s + 1][mb], link_s, free_at[s])
                    if ready is None:
                        break
                    backward_end[s][mb] = free_at[s] = ready + backward_s
                position[s] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            raise ScheduleDeadlock("a lone 1F1B pipeline cannot deadlock; the op orders are corrupt")
    return max(free_at, default=0.0)


def _after(dependency_end: float | None, link_s: float, free_at: float) -> float | None:
    """Start of an op: after its worker is free and its dependency's output has arrived."""
    if dependency_end is None:
        return None
    return max(free_at, dependency_end + link_s)

