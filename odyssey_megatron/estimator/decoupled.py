"""Op lists with decoupled weight gradients (paper 003's Decoupled BackProp).

Splitting each backward into the input-gradient part (*B*: the previous stage waits for
it) and the weight-gradient part (*W*: nothing waits for it) lets a worker hand the
input gradient on early and run the W later, when no forward or backward is ready,
which moves work into the pipeline's bubbles. It matters most to a rerouting peer: it
does the work of two stages, so it is on the critical path of every pipeline it serves,
while the pipeline's other stages sit in cool-down bubbles. Every worker splits: a plan
is priced and run with one choice of schedule options, so a failure-free plan gets the
same help as a rerouted one and losing a worker never looks like a speed-up.

A deferred W keeps its micro-batch's activations alive (the runtime holds the linear
layers' inputs and output gradients until the W runs), so a peer whose memory holds no
more micro-batches runs a queued W before its next forward.

With ``iterations`` > 1 several steps are list-scheduled back to back and each stage's DP
peers step their optimizer as soon as they all finished, not after the whole pipeline
(paper 003's Staggered Optimizer). A runtime repeats one step's op lists: the first
step's, or, with staggered steps, the last one's, which the list scheduler ordered for
the staggered start of a steady state (``step_schedule`` picks; ``estimator.staggered``
prices them).
"""

from __future__ import annotations

import heapq
from collections import defaultdict, deque
from dataclasses import dataclass

from odyssey_megatron.cluster import ClusterState
from odyssey_megatron.estimator.memory import stage_memory
from odyssey_megatron.estimator.pipeline import LegacyOpGraph, PipelineTiming, legacy_op_graph, ready_head
from odyssey_megatron.estimator.replay import WEIGHT_GRAD_SHARE, OpGraph, ScheduleDeadlock, op_graph, replay
from odyssey_megatron.plan import ExecutionPlan
from odyssey_megatron.profile import ModelProfile
from odyssey_megatron.schedules.ops import FORWARD, WEIGHT_GRAD, Op

@dataclass(frozen=True)
class DecoupledTiming:
    first: PipelineTiming
    """The first step: its makespan and each worker's ops (F, B and W) in the order they ran."""
    period_s: float
    """Steady-state seconds per step over the iterations; the first step's makespan for one."""
    last: dict[int, list[Op]]
    """Each worker's ops (F, B and W) in the order the last step ran them."""


def decoupled_pipelines(
    plan: ExecutionPlan, profile: ModelProfile, cluster: ClusterState | None = None, *, iterations: int = 1,
    graph: OpGraph | None = None,
) -> DecoupledTiming:
    """List-schedule ``plan`` with every backward decoupled; raises ScheduleDeadlock.
    ``graph``: the plan's ``op_graph``, if the caller has it."""
    room = {}  # micro-batches whose activations fit beside a stage owner's weights
    stage_peers: dict[int, set[int]] = defaultdict(set)  # optimizer barrier: the stage's DP group
    for pi, si, stage in plan.stage_positions():
        if stage.worker is not None:
            static, activation = stage_memory(profile, *stage.layers, first=si == 0,
                                              last=si == plan.pipelines[pi].num_stages - 1)
            room[stage.worker] = (profile.memory_budget_bytes - static) // activation if activation else float("inf")
            stage_peers[si].add(stage.worker)
    run = replay(graph or op_graph(plan, profile, cluster), split_backward=True, room=room, iterations=iterations,
                 optimizer_groups=[frozenset(peers) for peers in stage_peers.values()])
    ends = run.step_end_s
    first = PipelineTiming(makespan_s=ends[0], pipeline_end_s=run.pipeline_end_s, worker_busy_s=run.busy_s,
                           schedule=run.first)
    period = ends[0] if iterations == 1 else (ends[-1] - ends[0]) / (iterations - 1)
    return DecoupledTiming(first, period, run.last)


def legacy_decoupled_pipelines(
    plan: ExecutionPlan, profile: ModelProfile, cluster: ClusterState | None = None, *, iterations: int = 1,
    graph: LegacyOpGraph | None = None,
) -> DecoupledTiming:
    """List-schedule ``plan`` with every backward decoupled; raises ScheduleDeadlock.
    ``graph``: the plan's ``op_graph``, if the caller has it."""
    graph = graph or legacy_op_graph(plan, profile, cluster)
    streams, compute, location, needs, consumer = (
        graph.streams, graph.compute, graph.location, graph.needs, graph.consumer)
    room = {}  # micro-batches whose activations fit beside a stage owner's weights
    for pi, si, stage in plan.stage_positions():
        if stage.worker is not None:
            static, activation = stage_memory(profile, *stage.layers, first=si == 0,
                                              last=si == plan.pipelines[pi].num_stages - 1)
            room[stage.worker] = (profile.memory_budget_bytes - static) // activation if activation else float("inf")
    stage_peers: dict[int, list[int]] = defaultdict(list)  # optimizer barrier: the stage's DP group
    for worker, lists in streams.items():
        stage_peers[lists[0][0].stage].append(worker)

    ops_per_iteration = {  # a W per backward besides the stream ops
        worker: sum(len(ops) + sum(op.kind != FORWARD for op in ops) for ops in lists)
        for worker, lists in streams.items()
    }
    iteration = dict.fromkeys(streams, 0)
    cursor = {worker: [0] * len(lists) for worker, lists in streams.items()}
    weight_grads: dict[int, deque[tuple[float, Op]]] = {worker: deque() for worker in streams}
    order: dict[int, list[Op]] = {worker: [] for worker in streams}  # first iteration
    last: dict[int, list[Op]] = {worker: [] for worker in streams}
    busy = dict.fromkeys(streams, 0.0)
    pipeline_end = [0.0] * len(plan.pipelines)
    ran = dict.fromkeys(streams, 0)
    live = dict.fromkeys(streams, 0)  # micro-batches holding activations
    free_at = dict.fromkeys(streams, 0.0)
    finished: dict[int, list[float]] = {worker: [] for worker in streams}
    end_time: list[dict[Op, float]] = [{} for _ in range(iterations)]  # per step
    wakeups = [(0.0, worker) for worker in streams]
    heapq.heapify(wakeups)

    while wakeups:
        now, worker = heapq.heappop(wakeups)
        if now < free_at[worker] or iteration[worker] == iterations or ran[worker] == ops_per_iteration[worker]:
            continue  # busy, done, or waiting for its stage's optimizer step
        k_now = iteration[worker]
        chosen = ready_head(streams[worker], cursor[worker], needs, end_time[k_now].get, now)
        if chosen is not None and chosen[1].kind == FORWARD and live[worker] >= room[worker] and weight_grads[worker]:
            chosen = None  # memory is full: a deferred W frees a micro-batch first
        if chosen is not None:
            k, op = chosen
            forward_s, backward_s = compute[op.pipeline, op.stage]
            if op.kind == FORWARD:
                duration = forward_s
                live[worker] += 1
            else:
                duration = backward_s * (1 - WEIGHT_GRAD_SHARE)
                weight_grads[worker].append((backward_s * WEIGHT_GRAD_SHARE, op._replace(kind=WEIGHT_GRAD)))
            cursor[worker][k] += 1
            end_time[k_now][op] = free_at[worker] = now + duration
            successor = consumer.get(op)
            if successor is not None and location[successor] != worker:
                heapq.heappush(wakeups, (free_at[worker] + needs[successor][1], location[successor]))
        elif weight_grads[worker]:
            duration, op = weight_grads[worker].popleft()
            free_at[worker] = now + duration
            live[worker] -= 1
        else:
            continue  # a completion elsewhere will wake this worker
        if k_now == iterations - 1:
            last[worker].append(op)
        if k_now == 0:
            order[worker].append(op)
            busy[worker] += duration
            pipeline_end[op.pipeline] = max(pipeline_end[op.pipeline], free_at[worker])
        ran[worker] += 1
        heapq.heappush(wakeups, (free_at[worker], worker))
        if ran[worker] == ops_per_iteration[worker]:
            finished[worker].append(free_at[worker])
            _step_optimizer(stage_peers[streams[worker][0][0].stage], iteration, cursor, ran, finished,
                            free_at, wakeups)

    if any(k < iterations for k in iteration.values()):
        raise ScheduleDeadlock("decoupled op lists wait on each other in a cycle")
    ends = [max(times[k] for times in finished.values()) for k in range(iterations)]
    first = PipelineTiming(makespan_s=ends[0], pipeline_end_s=tuple(pipeline_end), worker_busy_s=busy, schedule=order)
    period = ends[0] if iterations == 1 else (ends[-1] - ends[0]) / (iterations - 1)
    return DecoupledTiming(first, period, last)


def _step_optimizer(peers, iteration, cursor, ran, finished, free_at, wakeups) -> None:
    """Once every DP peer of a stage finished its iteration, they all start the next."""
    k = iteration[peers[0]]
    if any(len(finished[p]) <= k for p in peers):
        return
    barrier = max(finished[p][k] for p in peers)
    for p in peers:
        iteration[p] += 1
        cursor[p] = [0] * len(cursor[p])
        ran[p] = 0
        free_at[p] = barrier
        heapq.heappush(wakeups, (barrier, p))

