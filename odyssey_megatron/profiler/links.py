"""Point-to-point and all-reduce bandwidth and latency between two ranks of this machine.

Two processes join a world on the accelerator's backend (gloo on CPU), one device each,
and time messages of a small and a large size: a P2P message by ping-pong (half the round
trip), an all-reduce as both ranks see it. Each figure is the fastest of the timed repeats
after a warm-up: on a shared host a rank that is descheduled mid-message only adds time
(a 1 KiB message's median was seen at 4 ms, above an 8 MiB one's, on 2 busy cores). The
small message gives the latency, the difference to the large one the bandwidth, in the
estimator's models: ``latency + bytes / bandwidth`` for a message, ``2 (n-1) latency +
2 (n-1)/n bytes / bandwidth`` for a ring all-reduce (n = 2 here).

On CPU the ranks are forked, so they start without importing torch again; an accelerator
needs spawned ranks (a forked process cannot initialise CUDA) and two devices.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import queue
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from odyssey_megatron.hooks.accelerator import Accelerator

SMALL_BYTES = 1024
"""A message this size costs its latency and nothing else worth counting."""


@dataclass(frozen=True)
class LinkFit:
    bandwidth: float
    """Bytes/s."""
    latency_s: float


@dataclass(frozen=True)
class Links:
    p2p: LinkFit
    allreduce: LinkFit
    """The ring all-reduce model's parameters (``estimator.communication.allreduce_time``)."""


def measure_links(accelerator: Accelerator, *, large_bytes: int, repeats: int, warmup: int,
                  timeout_s: float = 120.0) -> Links:
    """P2P and all-reduce fits from a 2-rank world; raises RuntimeError if a rank fails."""
    context = mp.get_context("fork" if accelerator.device_type == "cpu" else "spawn")
    store = dist.TCPStore("127.0.0.1", 0, 3, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=timeout_s))
    results = context.Queue()
    ranks = [context.Process(target=_rank, args=(rank, store.port, accelerator, large_bytes, repeats, warmup, results),
                             daemon=True) for rank in range(2)]
    for process in ranks:
        process.start()
    try:
        status, payload = results.get(timeout=timeout_s)
    except queue.Empty:
        raise RuntimeError(f"the link measurement did not finish in {timeout_s:.0f} s") from None
    finally:
        for process in ranks:
            process.join(timeout=10)
            if process.is_alive():
                process.kill()
    if status != "ok":
        raise RuntimeError(f"the link measurement failed: {payload}")
    (p2p_small, p2p_large), (reduce_small, reduce_large) = payload
    return Links(
        p2p=LinkFit(bandwidth=_bandwidth(large_bytes, p2p_small, p2p_large), latency_s=p2p_small),
        allreduce=LinkFit(bandwidth=_bandwidth(large_bytes, reduce_small, reduce_large), latency_s=reduce_small / 2),
    )


def _bandwidth(large_bytes: int, small_s: float, large_s: float) -> float:
    if large_s <= small_s:
        raise RuntimeError(f"a {large_bytes}-byte message took no longer than a {SMALL_BYTES}-byte one "
                           f"({large_s:.2e} s vs {small_s:.2e} s); the link timing is unusable")
    return (large_bytes - SMALL_BYTES) / (large_s - small_s)


def _rank(rank: int, port: int, accelerator: Accelerator, large_bytes: int, repeats: int, warmup: int,
          results: mp.Queue) -> None:
    try:
        torch.set_num_threads(1)
        store = dist.TCPStore("127.0.0.1", port, 3, is_master=False, timeout=datetime.timedelta(seconds=60))
        dist.init_process_group(accelerator.backend, store=store, rank=rank, world_size=2)
        device = accelerator.device(rank)
        timings = []
        for measure in (_ping_pong, _all_reduce):
            pair = []
            for size in (SMALL_BYTES, large_bytes):
                buffer = torch.zeros(size // 4, dtype=torch.float32, device=device)
                pair.append(_fastest(lambda: measure(rank, buffer, accelerator), repeats, warmup))
            timings.append(pair)
        dist.barrier()
        dist.destroy_process_group()
        if rank == 0:
            results.put(("ok", timings))
    except BaseException as exc:  # report everything: the parent must not wait out its timeout
        results.put(("error", f"rank {rank}: {type(exc).__name__}: {exc}"))


def _fastest(timed, repeats: int, warmup: int) -> float:
    for _ in range(warmup):
        timed()
    return min(timed() for _ in range(repeats))


def _ping_pong(rank: int, buffer: torch.Tensor, accelerator: Accelerator) -> float:
    """One-way seconds of a message: half a round trip from rank 0 to 1 and back."""
    dist.barrier()
    start = time.perf_counter()
    if rank == 0:
        dist.send(buffer, 1)
        dist.recv(buffer, 1)
    else:
        dist.recv(buffer, 0)
        dist.send(buffer, 0)
    accelerator.synchronize()
    return (time.perf_counter() - start) / 2


def _all_reduce(rank: int, buffer: torch.Tensor, accelerator: Accelerator) -> float:
    dist.barrier()
    start = time.perf_counter()
    dist.all_reduce(buffer)
    accelerator.synchronize()
    return time.perf_counter() - start
