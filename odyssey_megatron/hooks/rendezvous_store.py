"""The store a generation's process groups meet through, made abortable.

Gloo, NCCL and HCCL connect a group's members by waiting in the store for each member's
address (or the communicator's id): gloo as the group's first operation connects a pair,
on the group's own thread (``CollectiveGuard.track``), NCCL and HCCL at the first collective.
A member that died before writing it never will, and a C++ store wait ends only at its
timeout: survivors connecting with a dead peer sat out the whole collective timeout (30 s),
because the controller's abort reaches the collective guard but not a wait inside the
store. ``RendezvousStore`` is a ``torch.distributed.Store`` written in Python (c10d calls
its methods from C++, from any thread), whose blocking reads poll the real store and ask
the guard between polls: an abort ends the wait at once with ``PeerLost``, and a read
that outlasts the collective timeout raises ``PeerLost(timed_out=True)``, as a collective
would.

Polling, rather than the store's own wait, also keeps the connection in step: a TCPStore
wait that times out leaves its answer to be read by the next request. Only the groups
read through it; the step ledger keeps the store's push-style wait.
"""

from __future__ import annotations

import datetime
import time

import torch.distributed as dist

from odyssey_megatron.hooks.collective_guard import CollectiveGuard, PeerLost

__all__ = ["RendezvousStore"]

_FIRST_PAUSE_S, _LONGEST_PAUSE_S = 0.001, 0.05
"""Polls start fast (a member's key usually comes within milliseconds) and back off."""


class RendezvousStore(dist.Store):
    """``store`` (a connection of this process's own), with waits that ``guard`` can end."""

    def __init__(self, store: dist.Store, *, guard: CollectiveGuard):
        super().__init__()
        self._store, self._guard = store, guard

    def set(self, key: str, value) -> None:
        self._store.set(key, value)

    def get(self, key: str) -> bytes:
        self._wait_for([key], timeout=None)
        return self._store.get(key)

    def add(self, key: str, amount: int) -> int:
        return self._store.add(key, amount)

    def compare_set(self, key: str, expected, desired) -> bytes:
        return self._store.compare_set(key, expected, desired)

    def check(self, keys: list[str]) -> bool:
        return self._store.check(keys)

    def wait(self, keys: list[str], timeout: datetime.timedelta | None = None) -> None:
        self._wait_for(keys, timeout=timeout)

    def delete_key(self, key: str) -> bool:
        return self._store.delete_key(key)

    def num_keys(self) -> int:
        return self._store.num_keys()

    def _wait_for(self, keys: list[str], *, timeout: datetime.timedelta | None) -> None:
        limit_s = self._guard.timeout_s if timeout is None else min(timeout.total_seconds(), self._guard.timeout_s)
        deadline = time.monotonic() + limit_s
        pause = _FIRST_PAUSE_S
        while not self._store.check(keys):
            self._guard.check()  # PeerLost once the generation is aborted
            if time.monotonic() > deadline:
                raise PeerLost(f"store keys {keys} did not appear within {limit_s:g} s (a member of the group "
                               "never wrote them)", timed_out=True)
            time.sleep(pause)
            pause = min(2 * pause, _LONGEST_PAUSE_S)
