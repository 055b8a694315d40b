"""Ending the run with its committed state on disk: a stop on purpose
(``Controller.request_stop``: a signal, or a node's launcher told to stop), and an owner
that failed (``save_committed``, from ``runtime.train``). The owner ends the generation as
on a failure, then orders the workers to write the blocks of the settled plan as of the
last committed step, each (block, TP rank) once, shared out over the live replicas that
hold it as the in-memory snapshots are (``snapshot.shards.owners``), and marks that checkpoint the one to resume from once
its parts hold every block (``RunStopped``)."""

from __future__ import annotations

import logging
import time

from odyssey_megatron.blocks import model_blocks
from odyssey_megatron.runtime.checkpoint_index import checkpoint_directory, mark_latest, parts_complete
from odyssey_megatron.runtime.control.run_state import RunState
from odyssey_megatron.runtime.protocol.keys import RUN_STOP, stopped_key
from odyssey_megatron.runtime.protocol.messages import StopOrder
from odyssey_megatron.snapshot.shards import owners

__all__ = ["RunStopped", "StopWriter"]

log = logging.getLogger(__name__)


class RunStopped(Exception):
    """The run stopped on purpose after ``step`` committed steps; ``saved``: they are in a
    checkpoint ``odyssey train --resume`` continues from."""

    def __init__(self, reason: str, *, status: int, step: int, saved: bool):
        super().__init__(reason)
        self.reason, self.status, self.step, self.saved = reason, status, step, saved


class StopWriter:
    def __init__(self, run: RunState):
        self.run = run

    def stop_if_asked(self) -> None:
        """Stop the run (raising RunStopped) if the controller was asked to."""
        request = self.run.controller.stop_request
        if request is None:
            return
        reason, status = request
        raise RunStopped(reason, status=status, step=self.run.committed, saved=self.save_committed(reason))

    def save_committed(self, reason: str) -> bool:
        """End the run with a checkpoint of the steps committed: end the generation, order
        the workers to write it (``StopOrder`` under ``RUN_STOP``), wait until every writer
        is done or gone, and mark it the latest if its parts hold every block. Whether they
        do; False too where no step committed since the start (nothing to save)."""
        run = self.run
        run.stop_preparing()
        if run.plan is not None:
            run.end_generation()
        run.controller.record.event("stop", reason=reason, step=run.committed)
        if run.fresh or run.plan is None:
            run.controller.end_run(RUN_STOP, StopOrder(run.committed, reason, {}).to_json())
            return False
        writers = self._writers()
        run.controller.end_run(RUN_STOP, StopOrder(run.committed, reason,
                                                   {str(b): w for b, w in writers.items()}).to_json())
        cluster = run.center.cluster
        writing = {r for w in set(writers.values()) for r in cluster.worker_ranks(w)}
        deadline = time.monotonic() + run.timeouts.recovery_timeout
        while time.monotonic() < deadline:  # every writer done, or gone (then its blocks are missing)
            live = set(run.controller.detector.live_ranks())
            if all(r not in live or run.store.check([stopped_key(r)]) for r in writing):
                break
            time.sleep(run.timeouts.poll_interval)
        # A block no live worker holds is missing; so is one whose writer's part never came.
        missing = [str(b) for b in model_blocks(run.config.model) if b not in writers] or parts_complete(
            checkpoint_directory(run.run_dir, run.committed), list(writers), tp_size=cluster.tensor_parallel_size)
        if missing:
            log.error("run: the checkpoint of step %d lacks blocks %s", run.committed, missing)
            return False
        mark_latest(run.run_dir, run.committed)
        return True

    def _writers(self) -> dict:
        """Block -> the worker of the settled plan that writes it, among those alive
        (every rank of the worker): one per block, spread over its live replicas."""
        run = self.run
        live = set(run.controller.detector.live_ranks())
        settled, cluster = run.center.settled, run.center.cluster
        alive = [w for w in settled.workers if all(r in live for r in cluster.worker_ranks(w))]
        return owners(settled, run.config.model, workers=alive)
