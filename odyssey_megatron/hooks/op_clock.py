"""The hooks a rank's step calls around each op, message and collective (``OpClock``).

The executor (``runtime.rank.executor``), the gradient sync (``hooks.grad_sync``) and the
runner's optimizer phase call them; this base class is real time, its hooks doing
nothing and costing nothing. Device-time emulation (``runtime.rank.emulation``) overrides
them to pad each op to a profile's time.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import ContextManager

import torch
import torch.distributed as dist

from odyssey_megatron.schedules.ops import Op

__all__ = ["OpClock"]


class OpClock:
    """Real time: every op takes what its work takes. The hooks' calling contract, which
    ``EmulatedClock`` relies on: ``resume`` when the rank starts a step's op list and
    after it waited for something no hook sees (a staggered step's settling); ``compute``
    around an op's work, its inputs received; ``sent`` right after a message's send is
    posted, its works waited on with the message's; ``receiving`` around a message's
    receive; ``collective_started`` right before a sync unit's all-reduce is started, in
    the same order on every member, and ``collective_finished`` with its result once the
    all-reduce is waited on."""

    def resume(self) -> None:
        pass

    def compute(self, op: Op) -> ContextManager[None]:
        return nullcontext()

    def sent(self, dst: int, tag: int) -> list[tuple[dist.Work, torch.Tensor]]:
        return []

    def receiving(self, src: int, tag: int) -> ContextManager[None]:
        return nullcontext()

    def collective_started(self, unit: int, group: dist.ProcessGroup) -> object:
        return None

    def collective_finished(self, started: object) -> None:
        pass

    def optimizer_step(self, norm_group: dist.ProcessGroup | None) -> ContextManager[None]:
        return nullcontext()
