"""Per-worker op lists for 1F1B pipelines, rerouted micro-batches included.

An op is the forward or backward of one micro-batch of one pipeline at one stage.
Each worker runs its list in order; an op also waits for its *dependency*: the same
micro-batch's forward on the previous stage, or its backward on the next stage,
wherever that runs (on a rerouting peer in another pipeline, say).

A rerouting peer runs the micro-batches it adopts in the order the failed stage would
have run them, as a second stream beside its own (``stream_sources``). The estimator
interleaves the streams by list scheduling and returns the resulting per-worker op
lists: that order is the schedule the executor runs.
"""

from __future__ import annotations

from collections import defaultdict
from typing import NamedTuple, Optional, Sequence

from odyssey_megatron.plan import ExecutionPlan

FORWARD = "F"
BACKWARD = "B"
WEIGHT_GRAD = "W"
"""The weight-gradient half of a backward that was split (``estimator.decoupled``); its
BACKWARD then computes input gradients only."""


class Op(NamedTuple):
    """Forward ("F"), backward ("B") or weight gradient ("W") of one micro-batch at one stage of one pipeline.
    A named tuple: the estimator hashes hundreds of thousands of them per decision."""

    kind: str
    pipeline: int
    stage: int
    micro_batch: int


def settles(op: Op, *, num_stages: int) -> bool:
    """Whether a worker whose last optimizer step is still speculative
    (``runtime.rank.staggered_step``) may not finish ``op`` before that step settles: it
    writes weight gradients (a backward or weight gradient) or sends its result (a
    forward below its pipeline's last stage; it may compute, not send)."""
    return op.kind != FORWARD or op.stage < num_stages - 1


def settle_point(ops: Sequence[Op], num_stages: Sequence[int]) -> int:
    """Index of the first op in ``ops`` that ``settles``; ``len(ops)`` if none does."""
    return next((i for i, op in enumerate(ops) if settles(op, num_stages=num_stages[op.pipeline])), len(ops))


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


def stream_sources(plan: ExecutionPlan) -> dict[int, list[tuple[int, int, Optional[set[int]]]]]:
    """Every live worker's streams (in the plan's stage order), as where each comes from:
    (pipeline, stage, the micro-batches it runs, None for all) of its own stage first,
    then of each pipeline it adopts from, in pipeline order.

    Each (pipeline, stage) stream follows the 1F1B order (``one_f_one_b``) a dedicated
    worker would run over the pipeline's whole micro-batch list, restricted to the
    micro-batches this worker runs. A stage op then only waits on ops of its stream that
    come earlier in that order, so splitting a stream over peers and interleaving streams
    on one worker in any way can never deadlock. The estimator picks the interleaving
    (``estimator.replay``, whose op graph holds the streams' ops).
    """
    own: dict[int, tuple[int, int]] = {}  # worker -> (pipeline, stage) it owns
    for pi, si, stage in plan.stage_positions():
        if stage.worker is not None:
            own[stage.worker] = (pi, si)
    adopted: dict[int, dict[int, set[int]]] = defaultdict(lambda: defaultdict(set))  # worker -> pipeline -> mbs
    for reroute in plan.reroutes:
        if reroute.worker not in own or own[reroute.worker][1] != reroute.stage:
            raise ValueError(
                f"worker {reroute.worker} adopts stage {reroute.stage} of pipeline {reroute.pipeline} "
                "but does not own that stage of its own pipeline"
            )
        adopted[reroute.worker][reroute.pipeline].update(reroute.micro_batches)
    return {
        worker: [(own_pipeline, stage, None), *((pi, stage, keep) for pi, keep in sorted(adopted[worker].items()))]
        for worker, (own_pipeline, stage) in own.items()
    }


def dependency(op: Op, *, num_stages: int) -> Optional[Op]:
    """The op on another stage that must finish before ``op`` can start (None at the ends)."""
    if op.kind == FORWARD:
        return Op(FORWARD, op.pipeline, op.stage - 1, op.micro_batch) if op.stage > 0 else None
    if op.stage < num_stages - 1:
        return Op(BACKWARD, op.pipeline, op.stage + 1, op.micro_batch)
    return Op(FORWARD, op.pipeline, op.stage, op.micro_batch)
