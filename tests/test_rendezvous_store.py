"""Group setup with a dead member, as a worker sets groups up (``prepare_backend``: gloo
connects a pair at its first operation, through the rendezvous store; ``track`` connects
every pair at once in an operation the guard can leave): survivors of a member that died
before it wrote its address, or as it wrote it (it never connects: the eager mesh held
them five group timeouts inside ``new_group``, then failed them with an error of their
own), make the group at once, and connecting it ends with ``PeerLost`` when the
generation is aborted, or after the collective timeout on their own; they leave the
generation at once and the next world works."""

from __future__ import annotations

import datetime
import gc
import multiprocessing as mp
import os
import signal
import threading
import time

import pytest
import torch
import torch.distributed as dist

from spawned_ranks import run_three_ranks

from odyssey_megatron.hooks.collective_guard import CollectiveGuard, PeerLost, prepare_backend
from odyssey_megatron.hooks.rendezvous_store import RendezvousStore

pytestmark = pytest.mark.timeout(120)

STORE_TIMEOUT_S = 30.0
"""The groups' and the underlying store's own timeout: what a survivor would wait without the guard."""
ABORT_AFTER_S = 0.5


class _DiesPublishing(RendezvousStore):
    """Once ``armed``, SIGKILLs its process as soon as it wrote a key: a member that dies
    having published its address in a group's rendezvous, before connecting to anyone."""

    armed = False

    def set(self, key: str, value) -> None:
        super().set(key, value)
        if self.armed:
            os.kill(os.getpid(), signal.SIGKILL)


def _timeout(seconds: float = STORE_TIMEOUT_S) -> datetime.timedelta:
    return datetime.timedelta(seconds=seconds)


def _member(rank: int, port: int, death: str, results: mp.Queue) -> None:
    """Ranks 0-2 form a world through the rendezvous store and all-reduce in it; rank 2
    then dies, ``before`` the next group's setup or ``publishing`` its address in it. 0
    and 1 make that group and connect it: another thread aborts the generation after
    ABORT_AFTER_S. Then a second group (rank 2 never writes to it), whose connection runs
    into the guard's timeout, cut to 1 s for it. Then they leave and form a world of two."""
    try:
        prepare_backend("gloo")
        store = dist.TCPStore("127.0.0.1", port, 4, is_master=False, timeout=_timeout())
        guard = CollectiveGuard(backend="gloo", timeout_s=STORE_TIMEOUT_S)
        guard.install()
        rendezvous = _DiesPublishing(store, guard=guard)
        dist.init_process_group("gloo", rank=rank, world_size=3, store=dist.PrefixStore("gen0", rendezvous),
                                timeout=_timeout())
        tensor = torch.ones(2)
        dist.all_reduce(tensor)
        if rank == 2:
            results.put((rank, "ok", float(tensor[0])))
            results.close()
            results.join_thread()  # sent before this process kills itself below
            if death == "publishing":
                rendezvous.armed = True
                dist.new_group([0, 1, 2], timeout=_timeout())
            return
        groups = []

        def take_in_a_new_group() -> tuple[float, float, bool]:
            """As a worker makes a group and gives it to the guard, which connects it: (seconds
            to make it, seconds until it was left, timed out)."""
            started = time.monotonic()
            groups.append(dist.new_group([0, 1, 2], timeout=_timeout()))
            made = time.monotonic() - started
            try:
                guard.track(groups[-1:])
            except PeerLost as exc:
                return made, time.monotonic() - started, exc.timed_out
            raise AssertionError("a group with a dead member was connected")

        abort = threading.Timer(ABORT_AFTER_S, guard.abort, args=("test",))
        abort.start()
        attempts = [take_in_a_new_group()]
        abort.join()  # a connection the dead member's closed port refused may have ended it first
        guard.reopen()
        guard.timeout_s = 1.0
        attempts.append(take_in_a_new_group())
        # Leave with the connections' gloo threads still waiting: nothing may block.
        left = time.monotonic()
        guard.abandon()
        for group in groups:
            dist.destroy_process_group(group)
        dist.destroy_process_group()
        groups.clear()
        gc.collect()
        leave_s = time.monotonic() - left
        guard.reopen()
        guard.timeout_s = STORE_TIMEOUT_S
        dist.init_process_group("gloo", rank=rank, world_size=2, store=dist.PrefixStore("gen1", rendezvous),
                                timeout=_timeout())
        tensor = torch.ones(2)
        dist.all_reduce(tensor)
        results.put((rank, "ok", (attempts, leave_s, float(tensor[0]))))
    except BaseException as exc:  # noqa: BLE001
        results.put((rank, "error", repr(exc)))
    # As a worker ends (``os._exit``): interpreter teardown would join the guard's helper
    # threads, still inside the abandoned connections, before the queue's feeder sends the answer.
    results.close()
    results.join_thread()
    os._exit(0)


@pytest.mark.parametrize("death", ["before", "publishing"])
def test_a_member_dead_before_or_as_it_publishes_its_address_holds_no_survivor_longer_than_the_abort(death):
    got = run_three_ranks(_member, death, answers=3)
    assert got[2] == 3.0  # the world built through the rendezvous store all-reduced
    for rank in (0, 1):
        ((made, aborted_after, abort_timed_out), (made_again, timed_out_after, timed_out)), leave_s, reduced = got[rank]
        assert made < 1.0 and made_again < 1.0, (made, made_again)  # making a group waits for nobody
        # The abort, not the groups' 30 s (or five times that for the pair that never connects);
        # a survivor whose connection the dead member's closed port refused may leave sooner.
        assert aborted_after < ABORT_AFTER_S + 1.0 and not abort_timed_out, aborted_after
        assert timed_out and 1.0 <= timed_out_after < 3.0, timed_out_after
        assert leave_s < 1.0 and reduced == 2.0
