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

from collections import defaultdict
from typing import AbstractSet

from odyssey_megatron.cluster import ClusterState
from odyssey_megatron.estimator.replay import OpGraph, op_graph, op_kinds, replay
from odyssey_megatron.plan import ExecutionPlan
from odyssey_megatron.profile import ModelProfile
from odyssey_megatron.schedules.ops import Op

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


def retake_copy_s(plan: ExecutionPlan, profile: ModelProfile) -> dict[int, float]:
    """Seconds each stage owner spends copying its optimizer state (master weights, Adam
    moments) to host memory for a staggered step's retake."""
    holdings = {worker: tuple(blocks) for worker, blocks in plan.holdings(profile).items()}
    seconds: dict[tuple, float] = {}  # per set of blocks: thousands of owners hold a few sets
    for blocks in holdings.values():
        if blocks not in seconds:
            seconds[blocks] = sum(profile.block(b).optimizer_bytes for b in blocks) / profile.host_bandwidth
    return {worker: seconds[blocks] for worker, blocks in holdings.items()}


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
    as ``step_schedule`` returns it) under staggered optimizer steps, retake copies
    included; raises ScheduleDeadlock. ``graph``: the plan's ``op_graph``, if the caller
    has it."""
    playing = {worker for worker in schedule if len(op_kinds(schedule, worker))}
    ends = replay(graph or op_graph(plan, profile, cluster), schedule, iterations=iterations,
                  optimizer_groups=sync_groups(plan, profile, playing), speculative=True,
                  snapshot_s=retake_copy_s(plan, profile), snapshot_in_line=not profile.host_copy_async).step_end_s
    return ends[0] if iterations == 1 else (ends[-1] - ends[0]) / (iterations - 1)
