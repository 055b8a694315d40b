"""Rerouting plans (ReCycle-style, paper 001 IV-A): no weights move.

Every stage whose owner failed hands its micro-batches to the live owners of the same
stage in other pipelines, which hold exactly the same blocks. Micro-batches are spread
evenly (Eq. 13's N_m F_i / (N_dp - F_i) per peer) and round-robin, so adopted work is
spread over the whole step rather than piled at its end on one peer. Infeasible when a
stage has no peer.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import replace
from typing import AbstractSet

from odyssey_megatron.plan import ExecutionPlan, Reroute, StagePlan
from odyssey_megatron.profile import ModelProfile


def reroute_plan(
    current: ExecutionPlan,
    *,
    failed_workers: AbstractSet[int],
    profile: ModelProfile,
) -> ExecutionPlan | None:
    """The rerouted successor of ``current`` with ``failed_workers`` gone, or None when
    some failed stage has no live same-stage peer."""
    pipelines = [
        replace(p, stages=tuple(
            StagePlan(None if s.worker is None or s.worker in failed_workers else s.worker, s.layers)
            for s in p.stages
        ))
        for p in current.pipelines
    ]
    draft = replace(current, pipelines=tuple(pipelines), reroutes=(), transfers=())  # current's copies are done
    by_blocks: dict[tuple, list[tuple[int, int, StagePlan]]] = defaultdict(list)
    for pi, si, stage in draft.stage_positions():
        by_blocks[(si, tuple(draft.blocks_of_stage(pi, si, profile)))].append((pi, si, stage))

    reroutes = []
    for group in by_blocks.values():
        orphans = [(pi, si) for pi, si, stage in group if stage.worker is None]
        if not orphans:
            continue
        peers = [stage.worker for _, _, stage in group if stage.worker is not None]
        if not peers:
            return None
        work = [(pi, si, mb) for pi, si in orphans for mb in draft.pipelines[pi].micro_batches]
        for offset, peer in enumerate(peers):
            by_source: dict[tuple[int, int], list[int]] = defaultdict(list)
            for pi, si, mb in work[offset::len(peers)]:
                by_source[pi, si].append(mb)
            reroutes.extend(Reroute(pi, si, peer, tuple(mbs)) for (pi, si), mbs in by_source.items())
    return replace(draft, policy="reroute", generation=current.generation + 1, reroutes=tuple(reroutes))
