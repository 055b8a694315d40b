"""Pipeline time of one step (paper 001, Eq. 10-11), from the op lists ``estimator.replay``
replays: the plan's streams list-scheduled (a rerouting peer interleaves the streams it
adopts; the order each worker ended up with is the schedule to execute), or op lists
fixed beforehand. Step time is the latest end (Eq. 10).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
from numba import njit

from odyssey_megatron.cluster import ClusterState
from odyssey_megatron.estimator.replay import OpGraph, ScheduleDeadlock, op_graph, replay
from odyssey_megatron.estimator.wakeup_loop import warm_up as warm_up_replay
from odyssey_megatron.plan import ExecutionPlan
from odyssey_megatron.profile import ModelProfile
from odyssey_megatron.schedules.ops import Op


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


def simulate_pipelines(
    plan: ExecutionPlan, profile: ModelProfile, cluster: ClusterState | None = None, *, graph: OpGraph | None = None
) -> PipelineTiming:
    """One step of ``plan`` with whole backwards, rerouting peers interleaving their
    streams by list scheduling. ``graph``: the plan's ``op_graph``, if the caller has it.
    Raises ScheduleDeadlock."""
    run = replay(graph or op_graph(plan, profile, cluster))
    return PipelineTiming(makespan_s=max(run.pipeline_end_s, default=0.0), pipeline_end_s=run.pipeline_end_s,
                          worker_busy_s=run.busy_s, schedule=run.first)


def makespan_lower_bound(graph: OpGraph) -> float:
    """Seconds ``simulate_pipelines`` cannot beat on ``graph``, from the graph alone (a
    small share of a replay's cost): a worker runs its ops one at a time, none before its
    micro-batch's chain of dependencies (forwards down the stages, then backwards up,
    with their transfers) could have reached it, and whichever runs last is still
    followed by the rest of its chain."""
    num_stream_ops = int(graph.stream_ops_start[-1])
    earliest = np.zeros(num_stream_ops)  # stream op -> the earliest it can start
    chain_of = np.zeros(num_stream_ops, np.int64)  # stream op -> the chain it is on
    heads = np.flatnonzero(graph.dependency[:num_stream_ops] < 0)  # a chain starts at each first-stage forward
    chain_end = np.zeros(len(heads))  # the earliest each chain can end
    chains, ops, at = np.arange(len(heads)), heads, np.zeros(len(heads))
    while len(ops):  # down the stages and back up, every chain a step at once
        earliest[ops], chain_of[ops] = at, chains
        at = at + graph.whole_s[ops]
        chain_end[chains] = at
        ops = graph.consumer[ops]
        going = ops >= 0
        chains, ops = chains[going], ops[going]
        at = at[going] + graph.link_s[ops]
    after = chain_end[chain_of] - earliest - graph.whole_s[:num_stream_ops]  # the least time from its end on
    starts = graph.stream_ops_start[graph.stream_start]  # each worker's stream ops are consecutive
    whole_s = graph.whole_s.tolist()
    bound = 0.0
    for lo, hi in zip(starts[:-1].tolist(), starts[1:].tolist()):
        if hi > lo:
            busy = sum(whole_s[lo:hi])  # summed in order, as a worker runs them
            bound = max(bound, float(earliest[lo:hi].min()) + busy + float(after[lo:hi].min()))
    return bound


def fixed_order_step(
    plan: ExecutionPlan,
    profile: ModelProfile,
    cluster: ClusterState | None,
    schedule: dict[int, list[Op]],
    *,
    graph: OpGraph | None = None,
) -> PipelineTiming:
    """One step of ``schedule`` run as given (a list holding W ops splits its backwards),
    every worker starting at once and stepping its optimizer after the global norm (no
    staggering, no snapshots): the makespan the runtime's executor gets from op lists
    chosen for another start (Eq. 11 on fixed lists); raises ScheduleDeadlock."""
    run = replay(graph or op_graph(plan, profile, cluster), schedule)
    return PipelineTiming(makespan_s=run.step_end_s[0], pipeline_end_s=run.pipeline_end_s, worker_busy_s=run.busy_s,
                          schedule=schedule)


def lone_pipeline_time(
    stage_times: Sequence[tuple[float, float]], num_micro_batches: int, *, link_s: float
) -> float:
    """Eq. 11 for one pipeline whose stages each run plain 1F1B on their own worker.

    The same recurrence as ``simulate_pipelines`` (equal results, tested), without its
    general machinery and compiled (``_lone_1f1b``): the planner prices thousands of
    candidate layer splits per decision, a sweep of every pipeline length of a 70B model
    some 5,000 splits of up to 80 stages and a hundred micro-batches (interpreted, 0.1 s
    each). ``stage_times`` is (forward, backward) per stage.
    """
    times = np.asarray(stage_times, dtype=np.float64).reshape(-1, 2)
    end = _lone_1f1b(np.ascontiguousarray(times[:, 0]), np.ascontiguousarray(times[:, 1]), num_micro_batches,
                     float(link_s))
    if end < 0:
        raise ScheduleDeadlock("a lone 1F1B pipeline cannot deadlock; the op orders are corrupt")
    return end


@njit(cache=True)
def _lone_1f1b(forward_s, backward_s, num_micro_batches, link_s):
    """The makespan of ``lone_pipeline_time``; -1 if it deadlocks. Stages are swept down
    then up, each running the ops of its 1F1B order (``one_f_one_b``: ``warmup`` forwards,
    then forward and backward in turn, then the rest of the backwards) while their
    dependency has ended, until every op has run; each op starts once its worker is free
    and its dependency's output has arrived, the max-plus expression ``simulate_pipelines``
    evaluates."""
    num_stages, num_mbs = len(forward_s), num_micro_batches
    forward_end = np.full((num_stages, num_mbs), -1.0)
    backward_end = np.full((num_stages, num_mbs), -1.0)
    position = np.zeros(num_stages, np.int64)
    free_at = np.zeros(num_stages)
    remaining = 2 * num_stages * num_mbs
    while remaining:
        progressed = False
        for turn in range(2 * num_stages):
            s = turn if turn < num_stages else 2 * num_stages - 1 - turn
            warmup = min(num_stages - s - 1, num_mbs)
            steady = num_mbs - warmup
            while position[s] < 2 * num_mbs:
                p = position[s]
                q = p - warmup  # ops since the warm-up
                if p < warmup:
                    forward, mb = True, p
                elif q < 2 * steady:
                    forward = q % 2 == 0
                    mb = warmup + q // 2 if forward else q // 2
                else:
                    forward, mb = False, q - steady
                if forward:
                    if s == 0:
                        ready = free_at[s]
                    else:
                        if forward_end[s - 1, mb] < 0:
                            break
                        ready = max(free_at[s], forward_end[s - 1, mb] + link_s)
                    forward_end[s, mb] = free_at[s] = ready + forward_s[s]
                else:
                    if s == num_stages - 1:
                        if forward_end[s, mb] < 0:
                            break
                        ready = max(free_at[s], forward_end[s, mb])
                    else:
                        if backward_end[s + 1, mb] < 0:
                            break
                        ready = max(free_at[s], backward_end[s + 1, mb] + link_s)
                    backward_end[s, mb] = free_at[s] = ready + backward_s[s]
                position[s] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            return -1.0
    return free_at.max() if num_stages else 0.0


def warm_up() -> None:
    """Compile the estimator's loops, or load them from numba's cache (a fraction of a
    second), now rather than in the first decision: the replay's (``wakeup_loop``) and
    ``lone_pipeline_time``'s."""
    warm_up_replay()
    lone_pipeline_time([(1.0, 2.0)], 1, link_s=0.0)

