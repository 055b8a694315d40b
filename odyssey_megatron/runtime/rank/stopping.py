"""What a worker writes as it stops, between generations.

A worker ignores SIGINT and SIGTERM (a terminal's Ctrl-C reaches every process of the
group; SLURM signals every process of the job): its launcher passes the request on, and
the controller stops the run with a ``StopOrder``, which the worker carries out between
generations: it writes the blocks the order assigns it, as of the last committed step. A
worker that lost the controller has nobody to assign writers: it picks them as the
controller would (``snapshot.shards.owners``: each block to one of the replicas that hold
it, balanced by bytes, so each rank writes about its stage's share over DP instead of the
whole stage) from the last plan it saw settle, and writes its share of what it holds; a
block that plan gives no one else it writes too. Either way each block is a part of the
checkpoint of the steps it has taken (all committed: a rank applies committed steps
only).

Without the controller a worker cannot know which peers died with it, so it takes every
worker of that plan as alive. A chosen writer that died too leaves its blocks out of that
step's checkpoint, and so do replicas that took different numbers of steps (the
controller died while they read a step's decision: each writes at the step it took);
``--resume`` then takes the newest checkpoint whose parts hold every block, an older one,
or none (the run is started again).
"""

from __future__ import annotations

import logging

from odyssey_megatron.runtime.checkpoint import save_part
from odyssey_megatron.runtime.protocol.keys import stopped_key
from odyssey_megatron.runtime.protocol.messages import StopOrder
from odyssey_megatron.runtime.rank.worker_process import WorkerProcess
from odyssey_megatron.snapshot.shards import owners

__all__ = ["carry_out", "save_held"]

log = logging.getLogger(__name__)


def _save(process: WorkerProcess, blocks: list, *, step: int) -> None:
    """Write ``blocks`` (this rank's TP shard of them) as a part of step ``step``'s checkpoint."""
    save_part(process.run_dir, process.state, blocks, step=step, rank=process.launch.rank, tp_rank=process.tp_rank,
              tp_size=process.tp, model=process.config.model)


def save_held(process: WorkerProcess) -> None:
    """With the controller gone: write this worker's share of the blocks held (every one
    held, where it saw no plan settle), each as of the steps it has taken. ``--resume``
    takes the newest step whose parts hold every block (see the module's docstring for a
    chosen writer that died with the controller)."""
    held = process.state.held() if process.state is not None else []
    if process.settled is not None:
        writers = owners(process.settled, process.config.model)
        held = [block for block in held if writers.get(block, process.worker_id) == process.worker_id]
    by_step: dict[int, list] = {}
    for block in held:
        by_step.setdefault(process.state.blocks[block].step, []).append(block)
    for step, blocks in sorted(by_step.items()):
        _save(process, blocks, step=step)
    log.warning("rank %d: the controller is gone (%s); saved %s", process.launch.rank, process.controller_lost,
                {step: [str(b) for b in blocks] for step, blocks in by_step.items()} or "nothing")


def carry_out(process: WorkerProcess, order: StopOrder) -> None:
    """Write the blocks ``order`` assigns this worker (its TP shard), as of the last
    committed step, then count in: the controller marks the checkpoint once all are in."""
    held = process.state.held() if process.state is not None else []
    mine = [block for block in held if order.writers.get(str(block)) == process.worker_id]
    if mine:
        steps = {process.state.blocks[block].step for block in mine}
        if steps != {order.step}:
            raise RuntimeError(f"asked to save blocks at {order.step} committed steps; they have taken {steps}")
        _save(process, mine, step=order.step)
    process.store.set(stopped_key(process.launch.rank), "1")
    log.info("rank %d: stopped (%s); saved %s as of step %d", process.launch.rank, order.reason,
             [str(b) for b in mine] or "nothing", order.step)
