"""Seconds per step when optimizer steps are staggered (``odyssey.staggered_optimizer``).

The runtime then runs each worker's op list step after step, and a worker starts the
next step as soon as every worker it shares a layer with (its DP sync partners) has
finished this one: nothing waits for the whole world. Stages that finish early (a 1F1B
pipeline's last stages, a rerouting peer's deferred weight gradients at the end) move
on, so a step costs the steady-state period, which can be shorter than one step's
makespan. Steps are replayed back to back over the same Eq. 11 recurrence, each op
after its worker's previous op and after its dependency plus the transfer.

A staggered step is speculative, and a rank learns whether it must be retaken only when
the global norm is in, so its next step runs ahead only as far as it can go back: up to
the first op that would overwrite the step's gradients (a backward or weight gradient)
or send a result computed on the speculative weights (a forward's output to the next
stage). That op waits for the norm: until every worker finished the step. Its
gradients so stay in place, costing no memory, and nothing a retake invalidates leaves
the rank. Its weights and Adam state are snapshotted to host memory as the worker
starts the next step, on a side stream, since nothing changes them until the
optimizer step, which waits for the copy: a worker's step ends at its last op or its
snapshot's end, whichever is later. Where the copy cannot run beside compute (CPU) it
delays the step's first op instead. Every step is charged the snapshot: Llama recipes
clip gradients, and the runtime snapshots whenever they do.
"""

from __future__ import annotations

from collections import defaultdict, deque
from typing import AbstractSet

from odyssey_megatron.cluster import ClusterState
from odyssey_megatron.estimator.pipeline import LegacyOpGraph, PipelineTiming, legacy_op_graph
from odyssey_megatron.estimator.replay import WEIGHT_GRAD_SHARE, OpGraph, ScheduleDeadlock, op_graph, replay
from odyssey_megatron.plan import ExecutionPlan
from odyssey_megatron.profile import ModelProfile
from odyssey_megatron.schedules.ops import FORWARD, WEIGHT_GRAD, Op, settle_point

ITERATIONS = 2
"""Steps replayed back to back: the period is the time from the first step's end to the
second's, once the first absorbed the start-up (more steps gave the same period on every
case tried, and each costs a full replay)."""


def sync_groups(plan: ExecutionPlan, profile: ModelProfile, workers: AbstractSet[int]) -> list[frozenset[int]]:
    """The distinct sets of ``workers`` that hold a block together: each is a DP
    all-reduce that its members' next step waits for."""
    holders: dict[object, set[int]] = defaultdict(set)
    for worker, blocks in plan.holdings(profile).items():
        if worker in workers:
            for block in blocks:
                holders[block].add(worker)
    return sorted({frozenset(group) for group in holders.values()}, key=sorted)


def retake_snapshot_s(plan: ExecutionPlan, profile: ModelProfile) -> dict[int, float]:
    """Seconds each stage owner spends copying its optimizer state (master weights, Adam
    moments) to host memory for a staggered step's retake."""
    return {
        worker: sum(profile.block(b).optimizer_bytes for b in blocks) / profile.host_bandwidth
        for worker, blocks in plan.holdings(profile).items()
    }


def staggered_period(
    plan: ExecutionPlan,
    profile: ModelProfile,
    cluster: ClusterState | None,
    schedule: dict[int, list[Op]],
    *,
    iterations: int = ITERATIONS,
    graph: OpGraph | None = None,
) -> float:
    """Steady-state seconds per step of ``schedule`` (each worker's op list, F, B and W,
    as ``step_schedule`` returns it) under staggered optimizer steps, retake snapshots
    included; raises ScheduleDeadlock. ``graph``: the plan's ``op_graph``, if the caller
    has it."""
    playing = {worker for worker, ops in schedule.items() if ops}
    ends = replay(graph or op_graph(plan, profile, cluster), schedule, iterations=iterations,
                  optimizer_groups=sync_groups(plan, profile, playing), speculative=True,
                  snapshot_s=retake_snapshot_s(plan, profile), snapshot_in_line=not profile.host_copy_async).step_end_s
    return ends[0] if iterations == 1 else (ends[-1] - ends[0]) / (iterations - 1)


def fixed_order_step(
    plan: ExecutionPlan,
    profile: ModelProfile,
    cluster: ClusterState | None,
    schedule: dict[int, list[Op]],
    *,
    graph: OpGraph | None = None,
) -> PipelineTiming:
    """One step of ``schedule`` run as given, every worker starting at once and stepping
    its optimizer after the global norm (no staggering, no snapshots): the makespan the
    runtime's executor gets from op lists chosen for another start (Eq. 11 on fixed
    lists); raises ScheduleDeadlock."""
    run = replay(graph or op_graph(plan, profile, cluster), schedule)
    return PipelineTiming(makespan_s=run.step_end_s[0], pipeline_end_s=run.pipeline_end_s, worker_busy_s=run.busy_s,
                          schedule=schedule)


def legacy_staggered_period(
    plan: ExecutionPlan,
    profile: ModelProfile,
    cluster: ClusterState | None,
    schedule: dict[int, list[Op]],
    *,
    iterations: int = ITERATIONS,
    graph: LegacyOpGraph | None = None,
) -> float:
    """Steady-state seconds per step of ``schedule`` (each worker's op list, F, B and W,
    as ``step_schedule`` returns it) under staggered optimizer steps, retake snapshots
    included; raises ScheduleDeadlock. ``graph``: the plan's ``op_graph``, if the caller
    has it."""
    ends = _replay(plan, profile, cluster, schedule, iterations=iterations, fixed_start=False, graph=graph)[0]
    return ends[0] if iterations == 1 else (ends[-1] - ends[0]) / (iterations - 1)


def legacy_fixed_order_step(
    plan: ExecutionPlan,
    profile: ModelProfile,
    cluster: ClusterState | None,
    schedule: dict[int, list[Op]],
    *,
    graph: LegacyOpGraph | None = None,
) -> PipelineTiming:
    """One step of ``schedule`` run as given, every worker starting at once and stepping
    its optimizer after the global norm (no staggering, no snapshots): the makespan the
    runtime's executor gets from op lists chosen for another start (Eq. 11 on fixed
    lists); raises ScheduleDeadlock."""
    ends, pipeline_end, busy = _replay(plan, profile, cluster, schedule, iterations=1, fixed_start=True, graph=graph)
    return PipelineTiming(makespan_s=ends[0], pipeline_end_s=tuple(pipeline_end), worker_busy_s=busy,
                          schedule=schedule)


def _replay(
    plan: ExecutionPlan,
    profile: ModelProfile,
    cluster: ClusterState | None,
    schedule: dict[int, list[Op]],
    *,
    iterations: int,
    fixed_start: bool,
    graph: LegacyOpGraph | None,
) -> tuple[list[float], list[float], dict[int, float]]:
    """When each of ``iterations`` staggered steps' last worker ended; with
    ``fixed_start`` (one step, no snapshots) also when each pipeline's last op ended and
    each worker's compute seconds."""
    graph = graph or legacy_op_graph(plan, profile, cluster)
    compute, needs = graph.compute, graph.needs
    schedule = {worker: ops for worker, ops in schedule.items() if ops}
    groups = sync_groups(plan, profile, schedule.keys())
    member_of: dict[int, list[int]] = defaultdict(list)
    for g, group in enumerate(groups):
        for worker in group:
            member_of[worker].append(g)
    group_done = [[0] * iterations for _ in groups]  # members finished, per step
    group_end = [[0.0] * iterations for _ in groups]  # when the last of them finished
    split = {worker for worker, ops in schedule.items() if any(op.kind == WEIGHT_GRAD for op in ops)}

    def timed(worker: int, op: Op) -> tuple[Op, Op | None, float, float]:
        """(op, its dependency, the transfer after it, the op's seconds)."""
        forward_s, backward_s = compute[op.pipeline, op.stage]
        if op.kind == WEIGHT_GRAD:
            return op, None, 0.0, backward_s * WEIGHT_GRAD_SHARE
        dep, link_s = needs[op]
        if op.kind == FORWARD:
            return op, dep, link_s, forward_s
        return op, dep, link_s, backward_s * (1 - WEIGHT_GRAD_SHARE) if worker in split else backward_s

    runs = {worker: [timed(worker, op) for op in ops] for worker, ops in schedule.items()}
    num_stages = [p.num_stages for p in plan.pipelines]
    settles_at = {worker: settle_point(ops, num_stages) for worker, ops in schedule.items()}
    snapshot_s = dict.fromkeys(schedule, 0.0) if fixed_start else retake_snapshot_s(plan, profile)
    in_line = not profile.host_copy_async
    end: list[dict[Op, float]] = [{} for _ in range(iterations)]  # per step
    waiting_op: list[dict[Op, list[int]]] = [defaultdict(list) for _ in range(iterations)]
    waiting_group: list[dict[int, list[int]]] = [defaultdict(list) for _ in range(iterations)]
    finished: dict[int, list[float]] = {worker: [] for worker in schedule}
    all_done = [0] * iterations  # workers finished, per step
    norm_at = [0.0] * iterations  # when the last of them finished: the global norm is in
    waiting_norm: list[list[int]] = [[] for _ in range(iterations)]
    started = dict.fromkeys(schedule, -1)
    position = dict.fromkeys(schedule, 0)
    step = dict.fromkeys(schedule, 0)
    free_at = dict.fromkeys(schedule, 0.0)
    snapshot_end = dict.fromkeys(schedule, 0.0)
    pipeline_end = [0.0] * len(plan.pipelines)
    busy = {worker: sum(timed_op[3] for timed_op in run) for worker, run in runs.items()} if fixed_start else {}
    queue = deque(schedule)
    while queue:
        worker = queue.popleft()
        run, k, pos, now = runs[worker], step[worker], position[worker], free_at[worker]
        while k < iterations:
            if pos == 0 and started[worker] < k:
                if k > 0:
                    late = next((g for g in member_of[worker] if group_done[g][k - 1] < len(groups[g])), None)
                    if late is not None:
                        waiting_group[k - 1][late].append(worker)
                        break
                    now = max([now, *(group_end[g][k - 1] for g in member_of[worker])])
                started[worker] = k
                snapshot_end[worker] = now + snapshot_s[worker]
                if in_line:
                    now = snapshot_end[worker]
            op, dep, link_s, seconds = run[pos]
            if dep is not None:
                dep_end = end[k].get(dep)
                if dep_end is None:
                    waiting_op[k][dep].append(worker)
                    break
                now = max(now, dep_end + link_s)
            if k > 0 and pos == settles_at[worker]:
                if all_done[k - 1] < len(schedule):
                    waiting_norm[k - 1].append(worker)
                    break
                if op.kind == FORWARD:  # computes, then holds its output until the norm is in
                    now = max(now + seconds, norm_at[k - 1])
                else:
                    now = max(now, norm_at[k - 1]) + seconds
            else:
                now += seconds
            end[k][op] = now
            if fixed_start:
                pipeline_end[op.pipeline] = max(pipeline_end[op.pipeline], now)
            woken = waiting_op[k].pop(op, None)
            if woken:
                queue.extend(woken)
            pos += 1
            if pos == len(run):
                for g in member_of[worker]:  # the DP all-reduce needs the gradients only
                    group_done[g][k] += 1
                    group_end[g][k] = max(group_end[g][k], now)
                    if group_done[g][k] == len(groups[g]):
                        queue.extend(waiting_group[k].pop(g, ()))
                all_done[k] += 1
                norm_at[k] = max(norm_at[k], now)
                if all_done[k] == len(schedule):
                    queue.extend(waiting_norm[k])
                now = max(now, snapshot_end[worker])  # the optimizer step waits for the snapshot
                finished[worker].append(now)
                pos, k = 0, k + 1
        step[worker], position[worker], free_at[worker] = k, pos, now
    if any(s < iterations for s in step.values()):
        raise ScheduleDeadlock("staggered op lists wait on each other in a cycle")
    ends = [max((times[k] for times in finished.values()), default=0.0) for k in range(iterations)]
    return ends, pipeline_end, busy
