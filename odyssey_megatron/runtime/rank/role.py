"""What a worker does in one plan generation, decided once as it enters the generation."""

from __future__ import annotations

from enum import Enum

from odyssey_megatron.runtime.protocol.plan_frame import PlanPublished

__all__ = ["Role"]


class Role(Enum):
    idle = "idle"
    """Sits the generation out: the plan does not name it, or it joins the run and no
    generation has admitted it yet. It waits for the next plan, its blocks set aside."""
    send_only = "send_only"
    """Enters the generation to send the blocks its transfers name (or to read a snapshot
    shard) but trains nothing: holds the plan's groups (their creation is collective) and
    waits for the generation's end."""
    train = "train"
    """Trains a stage of the plan."""

    @classmethod
    def of(cls, published: PlanPublished, *, worker: int, admitted: bool) -> Role:
        """``worker``'s role in the generation ``published``; ``admitted``: it holds a place in
        the run (a joiner is admitted by the first generation that names it)."""
        if worker not in published.participants() or not admitted:
            return cls.idle
        return cls.train if worker in published.plan.workers else cls.send_only
