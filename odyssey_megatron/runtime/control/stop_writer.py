"""Stopping on purpose (``Controller.request_stop``: a signal, or a node's launcher told to
stop): the owner ends the generation as on a failure, then orders every worker to write
the blocks it is the first live holder of in the settled plan, as of the last committed
step, and marks that checkpoint the one to resume from once its parts hold every block
(``RunStopped``)."""

from __future__ import annotations

import logging
import time

from odyssey_megatron.blocks import StageSpec, stage_blocks, worker_blocks
from odyssey_megatron.runtime.checkpoint_index import checkpoint_directory, mark_latest, parts_complete
from odyssey_megatron.runtime.control.run_state import RunState
from odyssey_megatron.runtime.protocol.keys import RUN_STOP, stopped_key
from odyssey_megatron.runtime.protocol.messages import StopOrder

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
        run = self.run
        request = run.controller.stop_request
        if request is None:
            return
        reason, status = request
        run.stop_preparing()
        run.end_generation()
        run.controller.record.event("stop", reason=reason, step=run.committed)
        if run.fresh:
            run.controller.end_run(RUN_STOP, StopOrder(run.committed, reason, {}).to_json())
            raise RunStopped(reason, status=status, step=run.committed, saved=False)
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
        missing = [str(b) for b in self._all_blocks() if b not in writers] or parts_complete(
            checkpoint_directory(run.run_dir, run.committed), list(writers), tp_size=cluster.tensor_parallel_size)
        if not missing:
            mark_latest(run.run_dir, run.committed)
            raise RunStopped(reason, status=status, step=run.committed, saved=True)
        log.error("run: the stop's checkpoint lacks blocks %s", missing)
        raise RunStopped(reason, status=status, step=run.committed, saved=False)

    def _all_blocks(self) -> list:
        model = self.run.config.model
        return stage_blocks(StageSpec((0, model.num_layers), first=True, last=True), tied=model.tie_embeddings)

    def _writers(self) -> dict:
        """Block -> the first worker of the settled plan that holds it and is alive."""
        run = self.run
        live = set(run.controller.detector.live_ranks())
        settled, cluster = run.center.settled, run.center.cluster
        writers = {}
        for worker in settled.workers:
            if all(r in live for r in cluster.worker_ranks(worker)):
                for block in worker_blocks(settled, worker, tied=run.config.model.tie_embeddings):
                    writers.setdefault(block, worker)
        return writers
