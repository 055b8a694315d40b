"""Check a plan's transfers against what the survivors hold before it starts.

The runtime runs a plan's transfers in one phase: every rank sends what it holds and
receives what it lacks, all at once, and only then builds its new stage. That is safe
exactly when each source holds its block *before* the phase (no relays; a block sent
between two workers that both lack it, the cycle a stale layout produces, is refused)
and each stage owner ends with every block of its stage, one TP shard per rank. A plan
that breaks this would train on missing or garbage weights, or hang waiting for a send
that never comes, so the decision center checks every plan it returns.
"""

from __future__ import annotations

from collections import Counter
from typing import Mapping, Sequence

from odyssey_megatron.blocks import Block
from odyssey_megatron.cluster import ClusterState
from odyssey_megatron.plan import ExecutionPlan
from odyssey_megatron.profile import ModelProfile


class TransferError(ValueError):
    """A plan's transfers would leave a stage without its weights or move garbage."""


def check_transfers(
    plan: ExecutionPlan,
    *,
    holdings: Mapping[int, Sequence[Block]],
    profile: ModelProfile,
    cluster: ClusterState,
) -> None:
    """Raise TransferError unless ``plan.transfers``, run at once over ``holdings`` (the
    blocks each live worker holds before the plan), give every stage owner of ``plan``
    each block of its stage exactly once, on each of its TP ranks, from a rank of a
    worker that holds it (from the checkpoint only when no survivor does), and send
    nothing else. Rerouting peers must hold the blocks of the stage they stand in for."""
    held = {worker: set(blocks) for worker, blocks in holdings.items()}
    first_holder: dict[Block, int] = {}
    for worker in sorted(held, reverse=True):
        first_holder.update(dict.fromkeys(held[worker], worker))
    tp = cluster.tensor_parallel_size
    received: Counter[tuple[Block, int]] = Counter()
    for t in plan.transfers:
        if cluster.worker_of(t.dst) not in held:
            raise TransferError(f"block {t.layer!r} goes to rank {t.dst}, which is not alive")
        if t.bytes != profile.block(t.layer).state_bytes:
            raise TransferError(f"block {t.layer!r} to rank {t.dst} moves {t.bytes} bytes, "
                                f"not its {profile.block(t.layer).state_bytes}")
        if t.src is None:
            if t.layer in first_holder:
                raise TransferError(f"block {t.layer!r} for rank {t.dst} is read from the checkpoint "
                                    f"though worker {first_holder[t.layer]} holds it")
        else:
            if t.layer not in held.get(cluster.worker_of(t.src), ()):
                raise TransferError(f"rank {t.src} sends block {t.layer!r} to rank {t.dst} but does not hold it")
            if t.src % tp != t.dst % tp:
                raise TransferError(f"block {t.layer!r}: TP rank {t.src % tp} (rank {t.src}) sends to "
                                    f"TP rank {t.dst % tp} (rank {t.dst})")
        received[t.layer, t.dst] += 1

    for pi, si, stage in plan.stage_positions():
        if stage.worker is None:
            continue
        if stage.worker not in held:
            raise TransferError(f"stage {si} of pipeline {pi} belongs to worker {stage.worker}, which is not alive")
        for block in plan.blocks_of_stage(pi, si, profile):
            for rank in cluster.worker_ranks(stage.worker):
                count = received.pop((block, rank), 0)
                if block in held[stage.worker]:
                    if count:
                        raise TransferError(f"rank {rank} receives block {block!r}, which its worker already holds")
                elif count != 1:
                    raise TransferError(f"rank {rank} (stage {si} of pipeline {pi}) receives block {block!r} "
                                        f"{count} times; it needs it once")
    if received:
        (block, rank), _ = min(received.items(), key=lambda item: item[0][1])
        raise TransferError(f"rank {rank} receives block {block!r}, which its stage does not hold")

    slot_of = {stage.worker: (pi, si) for pi, si, stage in plan.stage_positions() if stage.worker is not None}
    for r in plan.reroutes:
        owned = slot_of.get(r.worker)
        if owned is None or plan.blocks_of_stage(*owned, profile) != plan.blocks_of_stage(r.pipeline, r.stage,
                                                                                            profile):
            raise TransferError(f"worker {r.worker} runs stage {r.stage} of pipeline {r.pipeline} "
                                "but does not hold that stage's blocks")
