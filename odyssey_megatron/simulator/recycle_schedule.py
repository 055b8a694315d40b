"""ReCycle's step time after rerouting (paper 003, sections 3.2-3.3), from its op lists.

ReCycle fills pipeline bubbles with rerouted work by two mechanisms the plain 1F1B
programme of the estimator does not have:

- Decoupled BackProp: a rerouting peer splits each backward into the input-gradient
  part, which the previous stage waits for, and the weight-gradient part (a *W* op),
  which nothing waits for. A W runs only when no forward or backward is ready, so the
  peer's adopted work moves into the cool-down bubbles. A deferred W keeps its
  micro-batch's activations alive, so a peer whose activations fill its memory budget
  runs a W before its next forward (ReCycle decouples selectively, as memory allows).
- Staggered Optimizer: a stage steps its optimizer once its own DP peers have finished
  the iteration, not the whole pipeline, so early stages start the next iteration while
  late ones are still in cool-down.

Several iterations are list-scheduled back to back (per-stage barriers instead of a
global one); the step time is the steady-state period between the ends of the first
and last. On a plan with nothing rerouted this is exactly the estimator's pipeline
time. The schedule also reports each worker's allocations and frees, for Eq. 14 peak
memory.
"""

from __future__ import annotations

import heapq
from collections import defaultdict, deque
from dataclasses import dataclass

from odyssey_megatron.cluster import ClusterState
from odyssey_megatron.estimator import ScheduleDeadlock, estimate_plan
from odyssey_megatron.estimator.memory import peak_memory, stage_memory
from odyssey_megatron.estimator.pipeline import op_graph, ready_head
from odyssey_megatron.plan import ExecutionPlan
from odyssey_megatron.profile import ModelProfile
from odyssey_megatron.schedules.ops import FORWARD, Op, compile_streams

WEIGHT_GRAD_SHARE = 0.5
"""Share of a backward spent on weight gradients: one of the two GEMMs of each linear layer."""

ITERATIONS = 3
"""Iterations scheduled back to back; the first absorbs the start-up transient."""


WEIGHT_GRAD = "W"


@dataclass(frozen=True)
class ReCycleTiming:
    period_s: float
    """Steady-state seconds per iteration (DP sync excluded)."""
    memory_order: dict[int, list[Op]]
    """Per worker, the ops that allocate (forwards) and free (a coupled backward or a W)
    activations, in the order they ran: what ``peak_memory`` counts."""


def recycle_pipeline_time(
    plan: ExecutionPlan, profile: ModelProfile, cluster: ClusterState | None, *, floor_s: float
) -> float | None:
    """Seconds per iteration of a rerouted ``plan`` run the way ReCycle runs it (DP sync
    excluded): its schedule where that fits in memory, else plain 1F1B op lists; None when
    neither fits. Decoupling absorbs adopted work but is not credited with beating
    ``floor_s``, the fault-free 1F1B step of the layout every system starts from."""
    timing = recycle_schedule(plan, profile, cluster)
    if max(peak_memory(plan, profile, timing.memory_order).values()) <= profile.memory_budget_bytes:
        return max(timing.period_s, floor_s)
    estimate = estimate_plan(plan, profile, cluster)
    return estimate.pipeline_time_s if estimate.fits_memory else None


def recycle_schedule(plan: ExecutionPlan, profile: ModelProfile, cluster: ClusterState | None = None) -> ReCycleTiming:
    """List-schedule ``plan`` the way ReCycle runs it; raises ScheduleDeadlock."""
    streams = compile_streams(plan)
    compute, location, needs, consumer = op_graph(plan, streams, profile, cluster)
    room = {}  # micro-batches whose activations fit beside a stage owner's weights
    for pi, si, stage in plan.stage_positions():
        if stage.worker is not None:
            start, end = stage.layers
            static, activation = stage_memory(profile, start, end, first=si == 0,
                                              last=si == plan.pipelines[pi].num_stages - 1)
            room[stage.worker] = (profile.memory_budget_bytes - static) // activation if activation else float("inf")
    decoupled = {worker for worker, lists in streams.items() if len(lists) > 1}
    stage_peers: dict[int, list[int]] = defaultdict(list)  # optimizer barrier: the stage's DP group
    for worker, lists in streams.items():
        stage_peers[lists[0][0].stage].append(worker)

    ops_per_iteration = {  # a decoupled worker runs a W per backward besides its stream ops
        worker: sum(len(ops) + (sum(op.kind != FORWARD for op in ops) if worker in decoupled else 0) for ops in lists)
        for worker, lists in streams.items()
    }
    iteration = dict.fromkeys(streams, 0)
    cursor = {worker: [0] * len(lists) for worker, lists in streams.items()}
    weight_grads: dict[int, deque[tuple[float, Op]]] = {worker: deque() for worker in streams}
    memory_order: dict[int, list[Op]] = {worker: [] for worker in streams}
    ran = dict.fromkeys(streams, 0)
    live = dict.fromkeys(streams, 0)  # micro-batches holding activations
    free_at = dict.fromkeys(streams, 0.0)
    finished: dict[int, list[float]] = {worker: [] for worker in streams}
    end_time: dict[tuple[int, Op], float] = {}
    wakeups = [(0.0, worker) for worker in streams]
    heapq.heapify(wakeups)

    while wakeups:
        now, worker = heapq.heappop(wakeups)
        if now < free_at[worker] or iteration[worker] == ITERATIONS or ran[worker] == ops_per_iteration[worker]:
            continue  # busy, done, or waiting for its stage's optimizer step
        k_now = iteration[worker]
        chosen = ready_head(streams[worker], cursor[worker], needs, lambda op: end_time.get((k_now, op)), now)
        if chosen is not None and chosen[1].kind == FORWARD and live[worker] >= room[worker] and weight_grads[worker]:
            chosen = None  # memory is full: a deferred W frees a micro-batch first
        if chosen is not None:
            k, op = chosen
            forward_s, backward_s = compute[op.pipeline, op.stage]
            if op.kind == FORWARD:
                duration = forward_s
                memory_order[worker].append(op)
                live[worker] += 1
            elif worker in decoupled:
                duration = backward_s * (1 - WEIGHT_GRAD_SHARE)
                weight_grads[worker].append((backward_s * WEIGHT_GRAD_SHARE, op._replace(kind=WEIGHT_GRAD)))
            else:
                duration = backward_s
                memory_order[worker].append(op)
                live[worker] -= 1
            cursor[worker][k] += 1
            end_time[iteration[worker], op] = free_at[worker] = now + duration
            successor = consumer.get(op)
            if successor is not None and location[successor] != worker:
                heapq.heappush(wakeups, (free_at[worker] + needs[successor][1], location[successor]))
        elif weight_grads[worker]:
            duration, weight_grad = weight_grads[worker].popleft()
            free_at[worker] = now + duration
            memory_order[worker].append(weight_grad)
            live[worker] -= 1
        else:
            continue  # a completion elsewhere will wake this worker
        ran[worker] += 1
        heapq.heappush(wakeups, (free_at[worker], worker))
        if ran[worker] == ops_per_iteration[worker]:
            finished[worker].append(free_at[worker])
            _step_optimizer(stage_peers[streams[worker][0][0].stage], iteration, cursor, ran, finished,
                            free_at, wakeups)

    if any(k < ITERATIONS for k in iteration.values()):
        raise ScheduleDeadlock("ReCycle's op lists wait on each other in a cycle")
    ends = [max(times[k] for times in finished.values()) for k in range(ITERATIONS)]
    return ReCycleTiming((ends[-1] - ends[0]) / (ITERATIONS - 1), memory_order)


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
