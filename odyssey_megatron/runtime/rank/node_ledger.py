"""A node's ranks commit a step together: the step ledger (``runtime.step_ledger``)
counted once per node, so the controller's store sees a node's requests per step, not
each rank's.

A rank appends its ``StepReport`` to its node's store (its launcher's) and counts in
there. The node's last training rank to count in carries the node's reports to the
controller's store in one append, counts the node's ranks in with one add (the step's
decision stays that one atomic counter: it commits when every rank of the generation is
counted, and a frozen counter still freezes it), waits for the decision if its add did
not make it, and leaves the decision in the node's store, where the others wait for it.
A rank waiting there also looks at the controller's decision key every ``check_s``: a
node whose carrier died (or never counted in) learns the step's fate from the controller,
which freezes what cannot commit. Per step, the controller's store sees from a node one
append, one add and a wait for the decision, whatever its number of ranks.

A wait for the decision that runs out (a rank late to count in) is no decision: the rank
reports the stall, and the controller, ending the generation, decides the step
(``runtime.rank.live_step``); ``decided_after_stall`` waits for that decision, which may
be a commit (the late rank counted in before the freeze), so every rank applies the step
or none does.
"""

from __future__ import annotations

import datetime
import time
from typing import Callable, Optional

import torch.distributed as dist

from odyssey_megatron.runtime.protocol.keys import node_applied_key, node_decided_key, node_report_key, step_report_key
from odyssey_megatron.runtime.protocol.liveness import missed_beat
from odyssey_megatron.runtime.step_ledger import Outcome, StepLedger, StepStore

__all__ = ["NodeLedger"]


class NodeLedger:
    """One rank's view of its node's commits; ``node_ranks``: the node's training ranks in
    the generation (every one of them counts in, each step). ``connect`` opens a
    connection to the node's store: one counts, another waits (and is replaced after a
    wait that timed out, whose late answer must not be read as the next one's)."""

    def __init__(self, ledger: StepLedger, connect: Callable[[], StepStore], *, node_ranks: int, check_s: float):
        self.ledger, self.connect, self.node_ranks, self.check_s = ledger, connect, node_ranks, check_s
        self.node_store = connect()
        self._waiter = connect()

    @property
    def generation(self) -> int:
        return self.ledger.generation

    def decided(self, step: int) -> Optional[Outcome]:
        """``step``'s outcome in the controller's store if it is decided, else None."""
        return self.ledger.decided(step)

    def count_in(self, step: int, report: str, *, timeout: datetime.timedelta) -> Optional[Outcome]:
        """Report and count this rank into ``step``: the step's outcome where this rank
        carried the node's count (it waited for the decision), else None (``wait_decided``)."""
        generation = self.generation
        self.node_store.append(node_report_key(generation, step), report)
        if self.node_store.add(node_applied_key(generation, step), 1) < self.node_ranks:
            return None
        reports = self.node_store.get(node_report_key(generation, step))
        self.ledger.store.append(step_report_key(generation, step), reports)
        outcome = self.ledger.count_in(step, amount=self.node_ranks)
        if outcome is None:
            outcome = self.ledger.wait_decided(step, timeout=timeout)
        self.node_store.set(node_decided_key(generation, step), outcome.value)
        return outcome

    def decided_after_stall(self, step: int, store: StepStore, *, timeout: datetime.timedelta) -> Outcome:
        """``step``'s outcome, after this rank's wait for it ran out and it reported the
        stall, as ``wait_decided`` (up to ``timeout``). ``store``: a fresh connection to the
        controller's store, which the ledger uses from now on: a wait that ran out leaves
        its late answer to be read by the next request on the old one."""
        self.ledger.store = store
        return self.wait_decided(step, timeout=timeout)

    def wait_decided(self, step: int, *, timeout: datetime.timedelta) -> Outcome:
        """``step``'s outcome as the node's carrier left it, or as the controller's store
        has it; a store error, or ``timeout`` passed, raises ``DistStoreError``."""
        key = node_decided_key(self.generation, step)
        deadline = time.monotonic() + timeout.total_seconds()
        while True:
            try:
                self._waiter.wait([key], datetime.timedelta(seconds=self.check_s))
                return Outcome(self._waiter.get(key))
            except dist.DistError as exc:  # missed_beat alone tells a late answer from a lost store
                if not missed_beat(exc):
                    raise
                self._waiter = self.connect()
            outcome = self.ledger.decided(step)
            if outcome is not None:
                return outcome
            if time.monotonic() > deadline:
                raise dist.DistStoreError(f"step {step} of generation {self.generation}: no decision within the "
                                          f"timeout ({timeout.total_seconds()} s)")
