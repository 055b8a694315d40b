"""Run a function on N CPU ranks (gloo) in processes forked from a fork server, with the
store hosted here.

The parent hosts the TCPStore (port 0, so concurrent worlds never collide) the way the
fault-tolerant launcher does: it outlives any rank. Every rank installs the CPU shim.
Results come back through a queue; a rank that fails or a world that exceeds
``timeout`` raises. Tests and CPU benchmarks use it.
"""

from __future__ import annotations

import multiprocessing as mp
import queue
import traceback
from typing import Any, Callable


def _portable(value: Any) -> Any:
    """Tensors become numpy arrays: torch would pass them through shared memory, which
    dies with the rank process."""
    import torch

    if isinstance(value, torch.Tensor):
        return value.detach().numpy().copy()
    if isinstance(value, dict):
        return {k: _portable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_portable(v) for v in value)
    return value


_PRELOAD = ["torch", "torch.distributed", "megatron.core", "odyssey_megatron.runtime.rank.plan_runner"]
"""Imported once, by the fork server every rank is forked from: importing them again in each
rank (seconds of CPU each, on cores the ranks share) was most of a small world's run time."""


def _rank_main(fn: Callable, rank: int, world_size: int, port: int, args: tuple, results: mp.Queue) -> None:
    try:
        import datetime

        import os

        import torch
        import torch.distributed as dist

        from odyssey_megatron.hooks.cpu_shim import CpuShim

        # N ranks share the machine's cores; torch's default (all cores each) thrashes.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))

        CpuShim().install()
        from megatron.core import parallel_state

        parallel_state._set_global_memory_buffer()
        store = dist.TCPStore("127.0.0.1", port, world_size + 1, is_master=False, timeout=datetime.timedelta(seconds=120))
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
        out = fn(rank, world_size, *args)
        dist.barrier()
        dist.destroy_process_group()
        results.put((rank, "ok", _portable(out)))
    except BaseException:  # report everything, including KeyboardInterrupt from a kill
        results.put((rank, "error", traceback.format_exc()))


def run_world(fn: Callable, world_size: int, *args: Any, timeout: float = 300) -> list[Any]:
    """``fn(rank, world_size, *args)`` on every rank; returns the results in rank order."""
    import datetime

    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, world_size + 1, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=timeout))
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    results = ctx.Queue()
    procs = [ctx.Process(target=_rank_main, args=(fn, r, world_size, store.port, args, results), daemon=True)
             for r in range(world_size)]
    for p in procs:
        p.start()
    collected: dict[int, Any] = {}
    try:
        while len(collected) < world_size:
            try:
                rank, status, payload = results.get(timeout=timeout)
            except queue.Empty:
                raise TimeoutError(f"ranks {sorted(set(range(world_size)) - set(collected))} did not finish") from None
            if status != "ok":
                raise RuntimeError(f"rank {rank} failed:\n{payload}")
            collected[rank] = payload
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    return [collected[r] for r in range(world_size)]
