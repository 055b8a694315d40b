"""When a training step counts: one counter per step in the store, decided exactly once.

A rank counts itself into step ``s`` (``count_in``) once its gradients are final (synced
across its DP peers and clipped by the global norm) and its ``StepReport`` is in the
store, and only then applies its optimizer step. The step commits when the counter reaches
the generation's training ranks. Applying it needs no other rank (the global norm is known
by then), so a failure after the commit loses nothing: the failed rank's DP replicas apply
the same step, and the next generation starts after it. A failure before the commit
freezes the counter (``freeze``: the controller adds ``FROZEN``), so no rank applies the
step; nothing ever has to be rolled back, and no rank keeps a copy of its state for that.

The atomic ``add`` on the counter is the one decision: a rank whose add brings it to the
world size, or the controller whose freezing add finds it there, knows the step
committed; whoever knows writes the decision key, which wakes the ranks waiting for it
without polling. ``freeze`` walks every step from the first one the controller has not
collected yet, so a controller that lags behind the ranks commits what they committed.

A generation can also end at a step boundary, with nothing frozen (workers join: the next
plan uses them): the controller sets the generation's handover key, and the rank whose
add commits the next step decides it ``LAST``, committed and the generation's last. Every
rank reads that one decision, applies the step and leaves; the key may come at any
moment, since only the one decision reads it.

Both sides of the runtime use it (the rank side to count in and wait, the control side to
collect and freeze); it knows nothing but a store (``dist.Store``'s ``add``, ``set``,
``get``, ``check``, ``wait``), so the rules are unit-tested over a dict.
"""

from __future__ import annotations

import datetime
from enum import Enum
from typing import Optional, Protocol

from odyssey_megatron.runtime.protocol.keys import FROZEN, applied_key, decided_key, handover_key

__all__ = ["Outcome", "StepLedger", "StepStore"]


class Outcome(bytes, Enum):
    """How a step was decided, as its decision key holds it."""

    COMMITTED = b"committed"
    LAST = b"committed, last"
    """Committed, and the generation ends after it (a handover)."""
    FROZEN = b"frozen"
    """Not committed: applied nowhere."""

    @property
    def committed(self) -> bool:
        return self is not Outcome.FROZEN


class StepStore(Protocol):
    def add(self, key: str, amount: int) -> int: ...
    def append(self, key: str, value: str | bytes) -> None: ...
    def set(self, key: str, value: str | bytes) -> None: ...
    def get(self, key: str) -> bytes: ...
    def check(self, keys: list[str]) -> bool: ...
    def wait(self, keys: list[str], timeout: datetime.timedelta) -> None: ...


class StepLedger:
    """The steps of one plan generation, trained by ``training_ranks`` ranks."""

    def __init__(self, store: StepStore, *, generation: int, training_ranks: int):
        self.store, self.generation, self.training_ranks = store, generation, training_ranks

    # -- the rank side ------------------------------------------------------------------

    def count_in(self, step: int, *, amount: int = 1) -> Optional[Outcome]:
        """Count ``amount`` ranks (this one, or a node's: ``runtime.rank.node_ledger``) into
        ``step``: its outcome if this add decided it (COMMITTED or LAST) or it was frozen
        already (FROZEN), None if others are still to come (``wait_decided``)."""
        count = self.store.add(applied_key(self.generation, step), amount)
        if count == self.training_ranks:
            outcome = Outcome.LAST if self.store.check([handover_key(self.generation)]) else Outcome.COMMITTED
            self.store.set(decided_key(self.generation, step), outcome.value)
            return outcome
        return Outcome.FROZEN if count < 0 else None

    def wait_decided(self, step: int, *, timeout: datetime.timedelta) -> Outcome:
        """``step``'s outcome, once it is decided; a store error (the controller gone, or
        ``timeout`` passed) propagates."""
        key = decided_key(self.generation, step)
        self.store.wait([key], timeout)
        return Outcome(self.store.get(key))

    def decided(self, step: int) -> Optional[Outcome]:
        """``step``'s outcome if it is decided, else None."""
        key = decided_key(self.generation, step)
        return Outcome(self.store.get(key)) if self.store.check([key]) else None

    # -- the control side ---------------------------------------------------------------

    def committed(self, step: int) -> bool:
        """Whether every training rank counted into ``step`` (it is not frozen)."""
        return self.store.add(applied_key(self.generation, step), 0) == self.training_ranks

    def hand_over(self) -> None:
        """End the generation after the next step to commit (``Outcome.LAST``)."""
        self.store.set(handover_key(self.generation), "1")

    def freeze(self, first: int, last: int) -> list[int]:
        """End the generation's counting from step ``first`` on: each step that every rank
        had counted into by now is committed (returned, in order); the first that was not
        is frozen, so no rank applies it (or any later one). ``last``: the last step of the
        run, beyond which nothing is frozen."""
        committed = []
        for step in range(first, last + 1):
            outcome = self.decided(step)
            if outcome is not None and outcome.committed:
                committed.append(step)  # its last rank decided it already
                self.store.add(applied_key(self.generation, step), FROZEN)
                continue
            before = self.store.add(applied_key(self.generation, step), FROZEN) - FROZEN
            if before == self.training_ranks:
                self.store.set(decided_key(self.generation, step), Outcome.COMMITTED.value)
                committed.append(step)
                continue
            self.store.set(decided_key(self.generation, step), Outcome.FROZEN.value)
            break
        return committed
