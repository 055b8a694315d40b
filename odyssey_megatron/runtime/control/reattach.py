"""Whom a restarted controller takes back after the controller was lost, and from which step.

When node 0's controller is lost, the other nodes' workers save what they hold (the
deduplicated stop save, ``runtime.rank.stopping``), then wait
``odyssey.controller_reattach_s`` for a restarted controller, each announcing itself with a
``RankReattached`` (``runtime.control.reattaching`` waits for them and answers). This module
is the pure judgement of those announcements against the lost controller's last plan:
training goes on from the survivors' memory only where every block of the model is held by
a whole reattached worker (all its TP ranks) and every accepted survivor holds one and the
same committed step. Otherwise the run resumes from the disk checkpoint
as before, and every survivor is refused: a refused survivor must exit (it is fenced),
never be left running beside ranks that load the checkpoint.

A survivor is refused by itself when it followed a different controller start (a
survivor of an earlier start), ran a different generation than the last plan, holds
blocks though not a participant of that plan (or none though one), or announced itself
twice from two processes. A survivor idle in that plan, holding nothing, is taken back as
a joiner where the others are: the run offers it back like any returning worker.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Optional

from odyssey_megatron.blocks import model_blocks, worker_blocks
from odyssey_megatron.cluster import ClusterState
from odyssey_megatron.config import ModelConfig
from odyssey_megatron.plan import ExecutionPlan
from odyssey_megatron.runtime.protocol.messages import RankReattached

__all__ = ["Reattachment", "judge_reattachments"]


@dataclass(frozen=True)
class Reattachment:
    """What the restarted controller does with the survivors that announced themselves."""

    step: Optional[int]
    """The committed step training goes on from, from the survivors' memory; None: resume
    from the disk checkpoint."""
    accepted: tuple[int, ...]
    """The ranks taken back (empty where the run resumes from disk)."""
    refused: dict[int, str] = field(default_factory=dict)
    """Rank -> why it is refused; each must exit."""
    why: str = ""
    """Where the run resumes from disk, why; else empty."""
    joiners: tuple[int, ...] = ()
    """Ranks idle in the lost plan, holding nothing, taken back beside ``accepted`` to be
    offered back to the decision center as returning workers."""

    @property
    def from_memory(self) -> bool:
        return self.step is not None


def judge_reattachments(reports: Iterable[RankReattached], *, plan: ExecutionPlan, epoch: int,
                        cluster: ClusterState, model: ModelConfig) -> Reattachment:
    """Judge ``reports`` against ``plan``, the lost controller's last plan, and ``epoch``,
    the lost controller's start."""
    by_rank: dict[int, list[RankReattached]] = {}
    for report in reports:
        by_rank.setdefault(report.rank, []).append(report)
    participants = set(plan.participants)
    refused: dict[int, str] = {}
    accepted: dict[int, RankReattached] = {}
    joiners: list[int] = []
    for rank, seen in sorted(by_rank.items()):
        pids = sorted({report.pid for report in seen})
        report = seen[-1]
        participant = 0 <= rank < cluster.world_size and cluster.worker_of(rank) in participants
        if len(pids) > 1:
            refused[rank] = f"announced by two processes (pids {', '.join(map(str, pids))})"
        elif report.epoch != epoch:
            refused[rank] = f"followed controller start {report.epoch}, not the lost one ({epoch})"
        elif not 0 <= rank < cluster.world_size:
            refused[rank] = f"not a rank of this run ({cluster.world_size} ranks)"
        elif report.generation != plan.generation:
            refused[rank] = f"ran generation {report.generation}, not the last plan's ({plan.generation})"
        elif participant != (report.committed_step is not None):
            refused[rank] = (f"holds no block of generation {plan.generation}'s plan, which it is in" if participant
                             else f"holds blocks, though not in generation {plan.generation}'s plan")
        elif participant:
            accepted[rank] = report
        else:
            joiners.append(rank)
    fallback = _why_not_from_memory(accepted, plan=plan, cluster=cluster, model=model)
    if fallback is not None:
        refused.update({rank: f"the run resumes from disk: {fallback}" for rank in (*accepted, *joiners)})
        return Reattachment(step=None, accepted=(), refused=refused, why=fallback)
    step = next(iter(accepted.values())).committed_step
    return Reattachment(step=step, accepted=tuple(sorted(accepted)), refused=refused, joiners=tuple(joiners))


def _why_not_from_memory(accepted: dict[int, RankReattached], *, plan: ExecutionPlan, cluster: ClusterState,
                         model: ModelConfig) -> Optional[str]:
    """Why the accepted survivors cannot carry the run on from memory, or None where they can."""
    if not accepted:
        return "no survivor reattached"
    steps = sorted({report.committed_step for report in accepted.values()})
    if len(steps) > 1:
        return f"the survivors hold different committed steps ({', '.join(map(str, steps))})"
    whole = {w for w in plan.workers if all(r in accepted for r in cluster.worker_ranks(w))}
    held = {block for w in whole for block in worker_blocks(plan, w, tied=model.tie_embeddings)}
    missing = [str(block) for block in model_blocks(model) if block not in held]
    if missing:
        return f"no whole reattached worker holds {', '.join(missing)}"
    return None
