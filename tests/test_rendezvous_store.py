"""The rendezvous store: survivors building a process group whose third member died
before it wrote its address leave the setup at once when the generation is aborted, or
after the collective timeout on their own, with ``PeerLost`` (a plain store waits out its
whole timeout); and groups built through it work."""

from __future__ import annotations

import datetime
import multiprocessing as mp
import threading
import time

import pytest
import torch
import torch.distributed as dist

from spawned_ranks import run_three_ranks

from odyssey_megatron.hooks.collective_guard import CollectiveGuard, PeerLost
from odyssey_megatron.hooks.rendezvous_store import RendezvousStore

pytestmark = pytest.mark.timeout(120)

STORE_TIMEOUT_S = 30.0
"""The underlying store's own timeout: what a survivor would wait without the guard."""


def _member(rank: int, port: int, results: mp.Queue) -> None:
    """Ranks 0-2 form a world through a ``RendezvousStore`` and all-reduce in it; rank 2
    then dies, and 0 and 1 build a group with it twice: another thread aborts the first
    setup after 0.5 s; the second runs into the guard's timeout, cut to 1 s."""
    try:
        store = dist.TCPStore("127.0.0.1", port, 4, is_master=False,
                              timeout=datetime.timedelta(seconds=STORE_TIMEOUT_S))
        guard = CollectiveGuard(backend="gloo", timeout_s=STORE_TIMEOUT_S)
        rendezvous = RendezvousStore(store, guard=guard)
        dist.init_process_group("gloo", rank=rank, world_size=3, store=dist.PrefixStore("gen0", rendezvous),
                                timeout=datetime.timedelta(seconds=STORE_TIMEOUT_S))
        tensor = torch.ones(2)
        dist.all_reduce(tensor)
        if rank == 2:
            results.put((rank, "ok", float(tensor[0])))
            return  # dies before the next group's setup
        threading.Timer(0.5, guard.abort, args=("test",)).start()
        setups = []
        for _ in ("abort", "timeout"):
            started = time.monotonic()
            try:
                dist.new_group([0, 1, 2], timeout=datetime.timedelta(seconds=STORE_TIMEOUT_S))
                results.put((rank, "error", "the group with a dead member was built"))
                return
            except PeerLost as exc:
                setups.append((time.monotonic() - started, exc.timed_out))
            guard.reopen()
            guard.timeout_s = 1.0
        results.put((rank, "ok", (float(tensor[0]), setups)))
    except BaseException as exc:  # noqa: BLE001
        results.put((rank, "error", repr(exc)))


def test_a_group_setup_waiting_for_a_dead_member_ends_with_peer_lost_on_abort_or_timeout():
    got = run_three_ranks(_member, answers=3)
    assert got[2] == 3.0  # the world built through the rendezvous store all-reduced
    for rank in (0, 1):
        reduced, ((aborted_after, abort_timed_out), (timed_out_after, timed_out)) = got[rank]
        assert reduced == 3.0
        assert not abort_timed_out and 0.5 <= aborted_after < 5, aborted_after  # not the store's 30 s
        assert timed_out and 1.0 <= timed_out_after < 6, timed_out_after
