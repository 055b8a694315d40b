"""Per-worker op lists for 1F1B pipelines, rerouted micro-batches included.

An op is the forward or backward of one micro-batch of one pipeline at one stage.
Each worker runs its list in order; an op also waits for its *dependency*: the same
micro-batch's forward on the previous stage, or its backward on the next stage,
wherever that runs (on a rerouting peer in another pipeline, say).

A rerouting peer runs the micro-batches it adopts in the order the failed stage would
have run them, interleaved with its own stream (see ``compile_schedule``); the
estimator still checks every compiled schedule for deadlock.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Optional, Sequence

from odyssey_megatron.plan import ExecutionPlan

FORWARD = "F"
BACKWARD = "B"


@dataclass(frozen=True, order=True)
class Op:
    kind: str
    pipeline: int
    stage: int
    micro_batch: int


def one_f_one_b(items: Sequence, *, stage: int, num_stages: int) -> list[tuple[str, object]]:
    """Megatron's non-interleaved 1F1B order for one stage: warm-up forwards, steady
    one-forward-one-backward, cool-down backwards."""
    warmup = min(num_stages - stage - 1, len(items))
    order: list[tuple[str, object]] = [(FORWARD, item) for item in items[:warmup]]
    backward_next = 0
    for item in items[warmup:]:
        order.append((FORWARD, item))
        order.append((BACKWARD, items[backward_next]))
        backward_next += 1
    order.extend((BACKWARD, item) for item in items[backward_next:])
    return order


def compile_schedule(plan: ExecutionPlan) -> dict[int, list[Op]]:
    """The op list of every live worker in ``plan``.

    Each (pipeline, stage) stream follows the 1F1B order a dedicated worker would run over
    the pipeline's whole micro-batch list, restricted to the micro-batches this worker
    runs. A stage op then only waits on ops of its stream that come earlier in that
    order, so splitting a stream over peers and interleaving streams on one worker can
    never deadlock. Streams interleave by their position in that order, own stream first.
    """
    runs: dict[int, list[tuple[int, int, int]]] = defaultdict(list)  # worker -> (priority, pipeline, mb)
    stage_of: dict[int, int] = {}
    for pi, si, stage in plan.stage_positions():
        if stage.worker is not None:
            stage_of[stage.worker] = si
            runs[stage.worker].append((0, pi, -1))  # -1: the whole stream
    for reroute in plan.reroutes:
        if stage_of.get(reroute.worker) != reroute.stage:
            raise ValueError(
                f"worker {reroute.worker} adopts stage {reroute.stage} of pipeline {reroute.pipeline} "
                "but does not own that stage of its own pipeline"
            )
        runs[reroute.worker].extend((1, reroute.pipeline, mb) for mb in reroute.micro_batches)
    schedule: dict[int, list[Op]] = {}
    for worker, entries in runs.items():
        stage = stage_of[worker]
        adopted: dict[int, set[int]] = defaultdict(set)
        own = None
        for priority, pi, mb in entries:
            if priority == 0:
                own = pi
            else:
                adopted[pi].add(mb)
        timed: list[tuple[int, int, Op]] = []
        for rank, (pi, keep) in enumerate([(own, None), *sorted(adopted.items())]):
            pipeline = plan.pipelines[pi]
            order = one_f_one_b(list(pipeline.micro_batches), stage=stage, num_stages=pipeline.num_stages)
            timed.extend(
                (index, rank, Op(kind, pi, stage, mb))
                for index, (kind, mb) in enumerate(order)
                if keep is None or mb in keep
            )
        timed.sort(key=lambda t: (t[0], t[1]))
        schedule[worker] = [op for _, _, op in timed]
    return schedule


def dependency(op: Op, *, num_stages: int) -> Optional[Op]:
    """The op on another stage that must finish before ``op`` can start (None at the ends)."""
    if op.kind == FORWARD:
        return Op(FORWARD, op.pipeline, op.stage - 1, op.micro_batch) if op.stage > 0 else None
    if op.stage < num_stages - 1:
        return Op(BACKWARD, op.pipeline, op.stage + 1, op.micro_batch)
    return Op(FORWARD, op.pipeline, op.stage, op.micro_batch)
