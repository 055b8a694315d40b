"""Who writes which block of a checkpoint saved without a collective (a stop, a failed
owner, a lost controller): one rule both sides of the runtime follow, so a worker that
lost the controller picks the writers the controller would have picked.

Each block is written once: by one of the workers of the plan that hold it, each of that
worker's TP ranks its own shard, so each (block, TP rank) has one writer. The blocks are
spread over the data-parallel replicas that hold them, heaviest first onto the replica
with the fewest bytes so far (``blocks.block_bytes``; ties by worker number), so each
rank writes about its stage's share divided by its DP degree, instead of every replica
writing the whole stage (at Llama-2 7B PP2, 42 GB a rank) inside SLURM's KillWait.

The choice is deterministic from the plan and the set of live workers alone. The
controller knows who is alive; a worker that lost the controller does not, and takes
every worker of the plan as alive: a chosen writer that died with the controller leaves
its blocks out of that step's checkpoint, and ``--resume`` takes the newest checkpoint
whose parts hold every block (an older one, or none: then the run starts again). So do
replicas that took different numbers of steps (the controller died while they read a
step's decision): each writes its blocks at the step it took.
"""

from __future__ import annotations

from typing import Iterable, Optional

from odyssey_megatron.blocks import Block, block_bytes, block_sort_key, worker_blocks
from odyssey_megatron.config import ModelConfig
from odyssey_megatron.plan import ExecutionPlan

__all__ = ["checkpoint_writers"]


def checkpoint_writers(plan: ExecutionPlan, *, model: ModelConfig,
                       alive: Optional[Iterable[int]] = None) -> dict[Block, int]:
    """Block -> the worker of ``plan`` that writes it (its TP ranks each their shard),
    balanced by bytes over the workers that hold it; ``alive``: the workers that may write
    (None: every worker of the plan). A block no such worker holds is left out."""
    live = set(plan.workers) if alive is None else set(alive)
    holders: dict[Block, list[int]] = {}
    for worker in plan.workers:
        if worker in live:
            for block in worker_blocks(plan, worker, tied=model.tie_embeddings):
                holders.setdefault(block, []).append(worker)
    tp = plan.tensor_parallel_size
    weight = {block: block_bytes(model, block, tp) for block in holders}
    written = {worker: 0 for worker in plan.workers}
    writers = {}
    for block in sorted(holders, key=lambda b: (-weight[b], block_sort_key(b))):
        writer = min(holders[block], key=lambda w: (written[w], w))
        writers[block] = writer
        written[writer] += weight[block]
    return dict(sorted(writers.items(), key=lambda item: block_sort_key(item[0])))
