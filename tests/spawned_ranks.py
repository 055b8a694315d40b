"""Three spawned processes around a store the test process hosts, for tests of what a
rank does when a peer dies or freezes (``test_collective_guard``, ``test_rendezvous_store``)."""

from __future__ import annotations

import datetime
import multiprocessing as mp
from typing import Callable

import torch.distributed as dist


def run_three_ranks(target: Callable, *args, answers: int) -> dict[int, object]:
    """``target(rank, port, *args, results)`` in three spawned processes around a store
    this process hosts, until ``answers`` of them put (rank, status, payload) in
    ``results``: rank -> payload; an "error" status fails the test."""
    store = dist.TCPStore("127.0.0.1", 0, 4, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=60))
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=target, args=(r, store.port, *args, results)) for r in range(3)]
    for p in procs:
        p.start()
    got = {}
    try:
        while len(got) < answers:
            rank, status, payload = results.get(timeout=90)
            assert status != "error", f"rank {rank}: {payload}"
            got[rank] = payload
    finally:
        for p in procs:
            p.kill()
            p.join()
    return got
