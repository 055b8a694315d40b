"""Following the periodic disk checkpoints the ranks write in the background: how often
they come (``decision_center.checkpoint_interval``: ``odyssey.checkpoint_interval`` or Young's
interval for the starting plan, said once as the run starts) and which is the latest.

Each rank writes its part of a checkpoint on a thread of its own and counts in once it is
durable (``runtime.rank.checkpoint_writer``). Once every writer of the running generation
counted into a step and its parts hold every block, the owner names it in ``latest.json``
(``mark_latest``, after fsyncing the directories that list the parts). A checkpoint whose
write a failure cut short never completes and is never marked: the one before it stays the
latest (``latest_checkpoint`` never picks an incomplete one either).
"""

from __future__ import annotations

import logging

from odyssey_megatron.blocks import model_blocks
from odyssey_megatron.runtime.checkpoint_index import checkpoint_directory, mark_latest, parts_complete
from odyssey_megatron.runtime.control.run_state import RunState
from odyssey_megatron.runtime.protocol.keys import checkpoint_parts_key
from odyssey_megatron.snapshot.shards import owners

__all__ = ["CheckpointFollowing"]

log = logging.getLogger(__name__)


class CheckpointFollowing:
    def __init__(self, run: RunState):
        self.run = run
        self.interval = run.config.odyssey.checkpoint_interval or 0
        """Steps between disk checkpoints (resolved as the run starts: ``decision_center.checkpoint_interval``; 0: none)."""
        self.latest = run.first_step
        """The step of the latest checkpoint: marked, or the one this invocation resumed from."""
        self._writers: tuple[int, int] = (-1, 0)
        """(generation, ranks that write a part of each of its checkpoints)."""

    def collect(self) -> None:
        """Mark the newest checkpoint of the running generation whose every part is in. It
        is one of the last two due: a rank starts a checkpoint only once its previous one
        is written, so an older one still incomplete was cut short."""
        run, interval = self.run, self.interval
        if not interval or run.plan is None or not run.settled:
            return
        generation = run.plan.generation
        newest = run.committed - run.committed % interval
        for step in (newest, newest - interval):
            if step <= max(self.latest, run.start_steps[generation]):
                return
            if run.store.add(checkpoint_parts_key(generation, step), 0) < self._writer_count(generation):
                continue
            directory = checkpoint_directory(run.run_dir, step)
            model = run.config.model
            missing = parts_complete(directory, model_blocks(model), tp_size=run.center.cluster.tensor_parallel_size)
            if missing:  # every writer counted in: no part can still come
                log.error("run: the checkpoint of step %d lacks blocks %s", step, [str(b) for b in missing])
                continue
            mark_latest(run.run_dir, step)
            self.latest = step
            run.controller.record.event("checkpoint", step=step, generation=generation)
            log.info("run: checkpoint of step %d written (checkpoint/step-%d)", step, step)
            return

    def _writer_count(self, generation: int) -> int:
        if self._writers[0] != generation:
            workers = set(owners(self.run.plan, self.run.config.model).values())
            self._writers = generation, len(workers) * self.run.center.cluster.tensor_parallel_size
        return self._writers[1]
