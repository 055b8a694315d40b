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

Without the controller a worker cannot know which peers died with it: it claims its share
before it writes it, and then waits for the other writers of what it holds, writing what a
writer that died too never claimed (``fill_in``), so that step's checkpoint still holds
every block a survivor holds. Replicas that took different numbers of steps (the
controller died while they read a step's decision) each write at the step they took, and
fill in there. ``--resume`` takes the newest checkpoint whose parts hold every block, an
older one, or none (the run is started again).
"""

from __future__ import annotations

import logging
import time

from odyssey_megatron.blocks import worker_blocks
from odyssey_megatron.runtime.checkpoint import save_part
from odyssey_megatron.runtime.protocol.keys import stopped_key
from odyssey_megatron.runtime.protocol.messages import StopOrder
from odyssey_megatron.runtime.rank.fill_in import Replica, claim, fill_in
from odyssey_megatron.runtime.rank.worker_process import WorkerProcess
from odyssey_megatron.snapshot.shards import owners

__all__ = ["carry_out", "save_held"]

log = logging.getLogger(__name__)


def _save(process: WorkerProcess, blocks: list, *, step: int, part: str | None = None) -> None:
    """Write ``blocks`` (this rank's TP shard of them) as a part of step ``step``'s checkpoint
    (``rank-<rank>``, unless ``part`` names it)."""
    save_part(process.run_dir, process.state, blocks, step=step, rank=process.launch.rank, tp_rank=process.tp_rank,
              tp_size=process.tp, model=process.config.model, part=part)


def save_held(process: WorkerProcess) -> None:
    """With the controller gone: write this worker's share of the blocks held (every one
    held, where it saw no plan settle), each as of the steps it has taken. ``--resume``
    takes the newest step whose parts hold every block (see the module's docstring for a
    chosen writer that died with the controller)."""
    held = process.state.held() if process.state is not None else []
    me, replicas = process.worker_id, []
    if process.settled is not None:
        plan, tied = process.settled, process.config.model.tie_embeddings
        writers = owners(plan, process.config.model)
        holders = {w: set(worker_blocks(plan, w, tied=tied)) for w in plan.workers}
        for block in held:
            chosen = writers.get(block, me)
            if chosen != me:
                order = [chosen, *sorted(w for w, blocks in holders.items() if block in blocks and w != chosen)]
                turn = order.index(me) if me in order else len(order)  # a block it holds beyond its stage
                replicas.append(Replica(block, process.state.blocks[block].step, turn))
        held = [block for block in held if writers.get(block, me) == me]
    by_step: dict[int, list] = {}
    for block in held:
        by_step.setdefault(process.state.blocks[block].step, []).append(block)
    rank, began = process.launch.rank, time.monotonic()
    for step, blocks in sorted(by_step.items()):
        claim(process.run_dir, step=step, part=f"rank-{rank}", blocks=blocks, tp_rank=process.tp_rank)
        _save(process, blocks, step=step)
    log.warning("rank %d: the controller is gone (%s); saved %s", rank, process.controller_lost,
                {step: [str(b) for b in blocks] for step, blocks in by_step.items()} or "nothing")
    timeouts = process.timeouts
    filled = fill_in(process.run_dir, replicas, part=f"rank-{rank}-fill", tp_rank=process.tp_rank,
                     write=lambda blocks, step, part: _save(process, blocks, step=step, part=part),
                     grace_s=timeouts.collective_timeout / 3, stagger_s=timeouts.heartbeat_timeout,
                     claim_wait_s=timeouts.collective_timeout / 3 + 4 * (time.monotonic() - began))
    if filled:
        log.warning("rank %d: wrote %s for writers that never claimed or finished them", rank,
                    {r.step: [str(x.block) for x in filled if x.step == r.step] for r in filled})


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
