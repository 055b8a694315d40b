"""Who a stalled collective waited for: the rank that is behind, never the one that waited.

A collective that waits out the collective timeout while every heartbeat goes on (a
stall: a rank hung with its heartbeat thread alive, or one so slow that an op outlasts the
timeout) is reported by the rank that waited, which is the healthy one. Each heartbeat
says where its rank is in its generation (``Heartbeat.step``, ``ops_done``: the index of
the op it computes or waits for), and the generation's step program says what that op
waits for: a forward above the first stage for the same micro-batch's forward on the stage
before, a backward below the last stage for its backward on the stage after, wherever
those run (a rerouting peer included); a weight gradient for nothing outside its rank. A
rank past its op list (gradient sync, clipping) waits for every rank not yet past its own;
one counted into the step's commit (its position one past its op list: it waits for the
step's decision, ``runtime.step_ledger``) waits for every rank not yet counted in, which
may be past its ops too (a rank late between its clipping and its count-in). A rank of
the generation with no position (still entering it, or not beating in it) waits for
nobody anyone can see.

Following those waits from the reporter ends at ranks that wait for nobody: they are
computing (slowly) or hung, and they are the ones behind. Where the chase ends at the
reporter itself (it waits for nothing the positions show, as where a link between two
live ranks broke, or it stalled while entering the generation), the reporter is named, as
before. Plain Python over plain data, unit-tested with made-up positions.
"""

from __future__ import annotations

from typing import Mapping, Optional

from odyssey_megatron.cluster import ClusterState
from odyssey_megatron.plan import ExecutionPlan
from odyssey_megatron.schedules.ops import BACKWARD, FORWARD, Op
from odyssey_megatron.schedules.program import StepProgram

__all__ = ["Position", "WaitGraph"]

Position = tuple[int, int]
"""(step, ops of its op list done) of a training rank (``Heartbeat.position``): one more
than its ops once it counted into the step's commit."""


class WaitGraph:
    """What each worker of one generation waits for, from the plan and its step program."""

    plan: ExecutionPlan
    program: StepProgram
    cluster: ClusterState
    """Which worker each launch rank is (rank ``w * TP + k``)."""

    def __init__(self, plan: ExecutionPlan, program: StepProgram):
        self.plan, self.program = plan, program
        tp = plan.tensor_parallel_size
        self.cluster = ClusterState(world_size=tp * (max(program.ops, default=0) + 1), tensor_parallel_size=tp)
        self._where: dict[Op, tuple[int, int]] = {
            op: (worker, index) for worker, ops in program.ops.items() for index, op in enumerate(ops)}
        """Each op -> (the worker that runs it, its index in that worker's list)."""

    @property
    def generation(self) -> int:
        return self.plan.generation

    def behind(self, reporter: int, positions: Mapping[int, Optional[Position]]) -> tuple[int, ...]:
        """The launch ranks the stall that ``reporter`` (a launch rank) reported is blamed
        on, ascending: every TP rank of the workers its waits end at; ``(reporter,)`` where
        they end at its own worker. ``positions``: launch rank -> where it is (None, or
        absent: no position in this generation)."""
        by_worker = self._worker_positions(positions)
        start = self.cluster.worker_of(reporter)
        seen, frontier, roots = {start}, [start], set()
        while frontier:
            worker = frontier.pop()
            waits = self.waits_for(worker, by_worker)
            if not waits:
                roots.add(worker)
            for other in sorted(waits - seen):
                seen.add(other)
                frontier.append(other)
        if not roots or roots == {start}:
            return (reporter,)
        return tuple(rank for worker in sorted(roots - {start}) for rank in self.cluster.worker_ranks(worker))

    def waits_for(self, worker: int, positions: Mapping[int, Optional[Position]]) -> set[int]:
        """The workers ``worker`` waits for where it is (``positions``: worker -> position)."""
        position = positions.get(worker)
        if position is None or worker not in self.program.ops:
            return set()
        step, done = position
        ops = self.program.ops[worker]
        if done >= len(ops):  # past its ops, or counted in: for every worker's ops, or count-in
            beyond = min(done - len(ops), 1)
            return {other for other, listed in self.program.ops.items()
                    if other != worker and _before(positions.get(other), (step, len(listed) + beyond))}
        dependency = self._dependency(ops[done])
        if dependency is None or dependency not in self._where:
            return set()
        other, index = self._where[dependency]
        return {other} if other != worker and _before(positions.get(other), (step, index + 1)) else set()

    def _dependency(self, op: Op) -> Optional[Op]:
        """The op on another stage whose result ``op`` receives, if any."""
        last = self.plan.pipelines[op.pipeline].num_stages - 1
        if op.kind == FORWARD and op.stage > 0:
            return Op(FORWARD, op.pipeline, op.stage - 1, op.micro_batch)
        if op.kind == BACKWARD and op.stage < last:
            return Op(BACKWARD, op.pipeline, op.stage + 1, op.micro_batch)
        return None

    def _worker_positions(self, positions: Mapping[int, Optional[Position]]) -> dict[int, Optional[Position]]:
        """Each training worker's position: its TP ranks' least, None if one has none."""
        found: dict[int, Optional[Position]] = {}
        for worker in self.program.ops:
            ranks = [positions.get(rank) for rank in self.cluster.worker_ranks(worker)]
            found[worker] = None if any(p is None for p in ranks) else min(ranks)
        return found


def _before(position: Optional[Position], target: Position) -> bool:
    """Whether a worker at ``position`` has not reached ``target`` (no position: it has not)."""
    return position is None or position < target
