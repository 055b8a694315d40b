"""Pipeline time by dynamic programming over op lists (paper 001, Eq. 10-11).

The start of an op is the later of the end of the previous op on its worker and the end
of its dependency on another stage plus the point-to-point transfer between them:

    t_start(op) = max(t_end(prev op on worker), t_end(dependency) + t_p2p)

Ops are visited in a topological order (each has at most two predecessors), so the
programme is linear in the number of ops. Step time is the latest end (Eq. 10).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from odyssey_megatron.cluster import ClusterState
from odyssey_megatron.plan import ExecutionPlan
from odyssey_megatron.profile import ModelProfile
from odyssey_megatron.schedules.ops import FORWARD, Op, compile_schedule, dependency


class ScheduleDeadlock(RuntimeError):
    """The op lists wait on each other in a cycle: the plan cannot run as compiled."""


@dataclass(frozen=True)
class PipelineTiming:
    makespan_s: float
    """Time from the first op to the last over all pipelines (Eq. 10)."""
    pipeline_end_s: tuple[float, ...]
    """When each pipeline's last op ends."""
    worker_busy_s: dict[int, float]
    """Compute time per worker, for utilisation and bubble reports."""


def p2p_time(profile: ModelProfile, *, same_node: bool) -> float:
    if profile.p2p_bytes == 0:
        return 0.0
    return profile.link_latency_s + profile.p2p_bytes / profile.bandwidth(same_node)


def simulate_pipelines(
    plan: ExecutionPlan,
    profile: ModelProfile,
    cluster: ClusterState | None = None,
    *,
    schedule: dict[int, list[Op]] | None = None,
) -> PipelineTiming:
    """Run the Eq. 11 programme over ``plan``'s op lists; raises ScheduleDeadlock."""
    schedule = schedule if schedule is not None else compile_schedule(plan)
    num_stages = [p.num_stages for p in plan.pipelines]
    compute: dict[tuple[int, int], tuple[float, float]] = {}
    for pi, si, stage in plan.stage_positions():
        start, end = stage.layers
        compute[pi, si] = profile.stage_compute(start, end, first=si == 0, last=si == num_stages[pi] - 1)
    location: dict[Op, int] = {op: worker for worker, ops in schedule.items() for op in ops}

    end_time: dict[Op, float] = {}
    cursor = {worker: 0 for worker in schedule}
    clock = {worker: 0.0 for worker in schedule}
    busy = {worker: 0.0 for worker in schedule}
    waiting: dict[Op, list[int]] = defaultdict(list)
    ready = list(schedule)
    while ready:
        worker = ready.pop()
        ops = schedule[worker]
        while cursor[worker] < len(ops):
            op = ops[cursor[worker]]
            dep = dependency(op, num_stages=num_stages[op.pipeline])
            start = clock[worker]
            if dep is not None and location.get(dep) != worker:
                if dep not in end_time:
                    waiting[dep].append(worker)
                    break
                dep_worker = location[dep]
                same_node = cluster is None or cluster.same_node(dep_worker, worker)
                start = max(start, end_time[dep] + p2p_time(profile, same_node=same_node))
            elif dep is not None and dep not in end_time:
                raise ScheduleDeadlock(f"worker {worker} runs {op} before its own {dep}")
            forward_s, backward_s = compute[op.pipeline, op.stage]
            duration = forward_s if op.kind == FORWARD else backward_s
            end_time[op] = clock[worker] = start + duration
            busy[worker] += duration
            cursor[worker] += 1
            ready.extend(waiting.pop(op, ()))
    stuck = {w: schedule[w][cursor[w]] for w in schedule if cursor[w] < len(schedule[w])}
    if stuck:
        raise ScheduleDeadlock(f"ops wait on each other in a cycle: {sorted(stuck.items())[:4]}")

    pipeline_end = [0.0] * len(plan.pipelines)
    for op, t in end_time.items():
        pipeline_end[op.pipeline] = max(pipeline_end[op.pipeline], t)
    return PipelineTiming(
        makespan_s=max(pipeline_end, default=0.0),
        pipeline_end_s=tuple(pipeline_end),
        worker_busy_s=busy,
    )
