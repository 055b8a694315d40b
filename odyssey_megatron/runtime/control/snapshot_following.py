"""Following the in-memory snapshots the ranks take: which one is the last complete one,
which ranks' keeper slots (and the shards in them) are gone, and what a decision needs to roll
back to it.

When no survivor holds some block, the decision rolls back to the last complete snapshot
(``snapshot.restore``): ``samples.jsonl`` forgets the steps after it, and they are trained
again on the same global batches. Before the first snapshot (or with snapshots off) it
rolls back to the run's start instead, which every rank can rebuild (the seed's initial
state, drawn deterministically, the checkpoint the run resumed from, or the save the
survivors a restarted controller took back wrote of the step they held), unless a disk
checkpoint newer than that start holds more of the run: then, as when two losses in one
parity group leave nothing to roll back to, the run fails, for ``--resume`` from it.

A lost node's keeper takes along the shards of every snapshot taken up to then. A node
that registers again comes with a fresh keeper, empty: the shards of those snapshots stay
lost, while those its ranks write there once a later generation admits them are there, so
a keeper is lost to a snapshot only where it went in or after the snapshot's generation.
"""

from __future__ import annotations

import logging
from typing import Optional

from odyssey_megatron.runtime.checkpoint_index import latest_checkpoint
from odyssey_megatron.runtime.control.detector import Failure
from odyssey_megatron.runtime.control.run_state import SAMPLES, RunState, forget_steps_from
from odyssey_megatron.runtime.protocol.keys import snapshot_done_key
from odyssey_megatron.snapshot.restore import Restore, SnapshotRecord, SnapshotSource
from odyssey_megatron.snapshot.shards import snapshot_groups

__all__ = ["SnapshotFollowing"]

log = logging.getLogger(__name__)


class SnapshotFollowing:
    def __init__(self, run: RunState):
        self.run = run
        self.interval = self._interval()
        """Steps between in-memory snapshots (``odyssey.snapshot_interval``; 0: none)."""
        self.last: Optional[SnapshotRecord] = None
        """The last complete snapshot."""
        self.lost_keepers: dict[int, int] = {}
        """Launch rank -> the newest generation published when its keeper slot last went
        (its node lost), with the shards of every snapshot taken up to that generation."""

    def _interval(self) -> int:
        """``odyssey.snapshot_interval``, or Young's interval for the starting plan."""
        odyssey = self.run.config.odyssey
        if odyssey.snapshot_interval is not None:
            return odyssey.snapshot_interval
        return self.run.center.snapshot_interval(nodes_per_group=odyssey.snapshot_parity_nodes)

    @property
    def kept(self) -> Optional[tuple[int, int]]:
        """(step, generation) of the last complete snapshot, as a plan is published with it."""
        return (self.last.step, self.last.generation) if self.last is not None else None

    def failed(self, failure: Failure) -> None:
        """A lost node takes its keeper along: the slots of every rank it ran."""
        self.lost_keepers.update(dict.fromkeys(failure.node_ranks, self.run.plan.generation))

    def lost_since(self, record: SnapshotRecord) -> frozenset[int]:
        """Ranks whose keeper slot went since ``record`` was taken: its shards there are gone
        (a slot that went before belongs to a node registered again since, whose fresh
        keeper holds what its ranks wrote from a later generation on)."""
        return frozenset(rank for rank, generation in self.lost_keepers.items() if generation >= record.generation)

    def collect(self) -> None:
        """Take in the newest snapshot of the running generation whose every part is in.
        It is one of the last three due: ranks are in step ``committed`` at most, start a
        snapshot only once the one before it is done, and have each written their part of
        one before that step's successor commits. A rank starts no snapshot once the
        generation is aborted, so after the abort this finds the one whose buffers the
        ranks keep."""
        run = self.run
        interval, generation = self.interval, run.plan.generation
        if not interval or not run.settled:
            return
        newest = run.committed - run.committed % interval
        for step in (newest, newest - interval, newest - 2 * interval):
            if step <= run.start_steps[generation]:
                return
            if self.last is not None and (self.last.generation, self.last.step) >= (generation, step):
                return
            if run.store.check([snapshot_done_key(generation, step)]):
                odyssey = run.config.odyssey
                groups = snapshot_groups(run.plan, cluster=run.center.cluster,
                                         nodes_per_group=odyssey.snapshot_parity_nodes)
                self.last = SnapshotRecord(step, generation, run.plan, groups)
                run.controller.record.event("snapshot", step=step, generation=generation)
                return

    def source(self, committed_before: int) -> Optional[SnapshotSource]:
        """The last snapshot as the decision center sees it (``DecisionCenter.on_failure``),
        rolling back from ``committed_before`` steps; None where there is none, or where no
        step committed yet (every block is drawn again from the seed or checkpoint)."""
        if self.last is None or self.run.fresh:
            return None
        return SnapshotSource(self.last, self.lost_since(self.last), self.run.config.model,
                              replayed_steps=committed_before - self.last.step)

    def start_replay_steps(self, committed_before: int) -> Optional[int]:
        """Where no snapshot can restore a lost block (``source`` is None): the steps a
        rollback to the run's start trains again, rolling back from ``committed_before``;
        None where a disk checkpoint newer than the start holds more (``--resume`` from
        it loses fewer steps), or where no rank can rebuild the start (the memory of
        survivors a restarted controller took back, where their save of it is incomplete)."""
        run = self.run
        checkpoint = latest_checkpoint(run.run_dir)
        if not run.start_rebuildable or (checkpoint is not None and checkpoint[0] > run.first_step):
            return None
        return committed_before - run.first_step

    def roll_back(self, restore: Restore) -> None:
        """The run goes back to the snapshot's step: the steps since are trained again."""
        self._back_to(restore.step, generation=restore.generation, what=f"the snapshot of step {restore.step}")

    def roll_back_to_start(self) -> None:
        """The run goes back to its start (``DecisionCenter.on_failure``'s ``from_start``):
        the steps since are trained again, from the seed or the checkpoint it resumed from
        (survivors taken back from memory: their own save of the step they held), which
        the next plan has every rank load (``PlanPublished.fresh``)."""
        run = self.run
        run.in_memory_at_start = False
        self._back_to(run.first_step, generation=None, what=f"the run's start (step {run.first_step})")

    def _back_to(self, step: int, *, generation: Optional[int], what: str) -> None:
        run = self.run
        replayed = run.committed - step
        forget_steps_from(run.run_dir / SAMPLES, step)
        run.controller.record.event("rollback", step=step, generation=generation, replayed=replayed)
        log.info("run: rolled back to %s (%d committed steps to train again)", what, replayed)
        run.committed = step
        run.progress.rolled_back()
