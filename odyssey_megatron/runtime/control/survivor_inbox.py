"""The survivors of a lost controller that announce themselves to a restarted one
(``RankReattached``), kept for the judgement (``runtime.control.reattaching``), which
answers each (``ReattachVerdict``). Survivors are judged together, once: one that
announces itself after the judgement is refused at once, from the polling thread."""

from __future__ import annotations

import threading

from odyssey_megatron.runtime.control.run_record import RunRecord
from odyssey_megatron.runtime.protocol.auth import SignedStore
from odyssey_megatron.runtime.protocol.keys import reattach_verdict_key
from odyssey_megatron.runtime.protocol.messages import RankReattached, ReattachVerdict

__all__ = ["SurvivorInbox"]


class SurvivorInbox:
    def __init__(self, record: RunRecord, *, epoch: int):
        """``epoch``: this controller's start, which a survivor taken back follows."""
        self.record, self.epoch = record, epoch
        self._reports: list[RankReattached] = []
        self._closed = False
        """Judged (``close``): a later announcement is refused."""
        self._lock = threading.Lock()
        """The polling thread adds, the owner judges."""

    def announced(self, store: SignedStore, report: RankReattached) -> None:
        """On the polling thread: keep ``report`` for the judgement, or refuse it if that is done."""
        self.record.event("rank_reattached", rank=report.rank, pid=report.pid, epoch=report.epoch,
                          generation=report.generation, committed_step=report.committed_step)
        with self._lock:
            late = self._closed
            if not late:
                self._reports.append(report)
        if late:
            self.answer(store, ReattachVerdict(report.rank, self.epoch, False,
                                               "announced itself after the survivors were judged"))

    def reports(self) -> list[RankReattached]:
        """The announcements so far, in arrival order."""
        with self._lock:
            return list(self._reports)

    def close(self) -> list[RankReattached]:
        """``reports``, once and for all: every later one is refused."""
        with self._lock:
            self._closed = True
            return list(self._reports)

    def answer(self, store: SignedStore, verdict: ReattachVerdict) -> None:
        """Tell a survivor whether it is taken back."""
        store.set(reattach_verdict_key(verdict.rank), verdict.to_json())
        self.record.event("reattach_verdict", rank=verdict.rank, accepted=verdict.accepted, why=verdict.why)
