"""The device check: what a first GPU (or NPU) machine must show before a run trusts it,
each figure one JSON line, the process exiting 1 when any check fails.

``python -m odyssey_megatron.device_check [--recipe FILE] [--repeats N] [--dry-run]``
(``scripts/device_check.sh`` installs the matching torch first). The checks:

- ``stage_step_time``: a Llama-2 7B layer stage measured on the device by the profiler
  (``profiler.measure_profile``, as ``odyssey profile``), against what the estimator
  prices from the device's spec (``profile_file.analytic_recipe_profile``): one layer's
  forward plus backward, and the recipe's step (``DecisionCenter``'s estimate) priced with
  each profile. Fails when the spec's layer is off by more than ``ESTIMATE_TOLERANCE``.
- ``snapshot_copy``: a layer's weights and Adam moments copied from device memory into
  pinned host memory (``Accelerator.host_buffer``) on a side stream, alone and beside
  as long a compute on the default stream (matmuls): the copy's bandwidth against the price the estimator
  uses (``host_bandwidth``), and how much of the shorter of the two the overlap hid.
  Fails below ``OVERLAP_FLOOR``.
- ``recovery_memory``: a 2-rank world that recovers in-process ``RECOVERIES`` times (a step,
  an all-reduce one rank never joins, the guard's abort, ``abandon``, the groups destroyed,
  a new world on a fresh store prefix; ``hooks.collective_guard``): device bytes allocated,
  live tensors and live process groups after each. Gloo with device tensors, both ranks on
  one device; NCCL, one device each, where two exist. Fails if the last recovery holds
  more than the first.
- ``nccl_abort_in_flight``: in the NCCL world above, how long each abort of an all-reduce
  in flight took to end it. Fails past ``ABORT_LIMIT_S``; skipped with fewer than two
  devices (NCCL cannot put two ranks on one device).
- ``nccl_shrink``: a world of every device (four at most) that loses its last rank and takes
  the survivors' world from a real ``dist.shrink_group`` of the healthy NCCL communicator,
  through the call a generation's entry makes (``survivor_groups.next_world``): the
  shrink's seconds, and an all-reduce on the new default group. Fails if the survivors'
  group is not the default one or its sum is wrong; skipped with fewer than two devices,
  or on an NCCL that cannot shrink (the runtime meets afresh there).

On a CPU machine every check runs on gloo and the CPU (small figures; the recipe's layer
is large), which is what tests use; ``--dry-run`` lists the checks and exits 0.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import multiprocessing as mp
import sys
import threading
import time
import weakref
from pathlib import Path
from typing import Any, Callable, Optional

__all__ = ["CHECKS", "main"]

REPO = Path(__file__).resolve().parents[1]
DEFAULT_RECIPE = REPO / "recipes" / "llama2_7b" / "gpu_h100_8.yaml"
ESTIMATE_TOLERANCE = 0.5
"""How far (as a fraction of the measured time) the spec's layer may be from the device's."""
OVERLAP_FLOOR = 0.5
"""The least share of the shorter of copy and compute that running them together must hide."""
RECOVERIES = 10
ABORT_AFTER_S = 0.2
"""How long the survivor's all-reduce waits for the rank that never joins before the abort."""
ABORT_LIMIT_S = 1.0
"""How long an abort may take to end an NCCL all-reduce in flight."""
WORLD_TIMEOUT_S = 30.0


def _emit(check: str, status: str, **figures) -> bool:
    """Print one check's figures as a JSON line; whether it passed (a skip passes)."""
    print(json.dumps({"check": check, "status": status, **figures}), flush=True)
    return status != "failed"


def _accelerator():
    from odyssey_megatron.hooks.accelerator import select_accelerator

    return select_accelerator("auto")


# -- stage step time --------------------------------------------------------------------

def check_stage_step_time(args: argparse.Namespace) -> bool:
    from odyssey_megatron.config import load_config
    from odyssey_megatron.decision_center import DecisionCenter
    from odyssey_megatron.profile_file import analytic_recipe_profile
    from odyssey_megatron.profiler import measure_profile

    config = load_config(args.recipe)
    measured = measure_profile(config, repeats=args.repeats).profile
    priced = analytic_recipe_profile(config, device=config.cluster.device)
    layer_s, priced_s = (p.layers[0].forward_s + p.layers[0].backward_s for p in (measured, priced))
    error = priced_s / layer_s - 1
    step_measured, step_priced = (DecisionCenter.from_recipe(config, profile=p).estimate.step_time_s
                                  for p in (measured, priced))
    return _emit("stage_step_time", "ok" if abs(error) <= ESTIMATE_TOLERANCE else "failed",
                 recipe=str(args.recipe), device=config.cluster.device, layer_measured_s=layer_s,
                 layer_estimated_s=priced_s, layer_error=error, step_from_measured_s=step_measured,
                 step_from_spec_s=step_priced, tolerance=ESTIMATE_TOLERANCE)


# -- snapshot copy ----------------------------------------------------------------------

def check_snapshot_copy(args: argparse.Namespace) -> bool:
    import torch

    from odyssey_megatron.config import load_config
    from odyssey_megatron.profile_file import analytic_recipe_profile

    accelerator = _accelerator()
    config = load_config(args.recipe)
    priced = analytic_recipe_profile(config, device=config.cluster.device)
    on_device = accelerator.device_type != "cpu"
    share = priced.layers[0].state_bytes if on_device else min(priced.layers[0].state_bytes, 256 * 2**20)
    device = accelerator.device(0)
    state = torch.ones(share // 4, dtype=torch.float32, device=device)
    host = accelerator.host_buffer(state)
    square = torch.ones(2048, 2048, device=device)
    repeats = 10

    def copy() -> None:
        if not on_device:
            host.copy_(state)
            return
        backend = getattr(torch, accelerator.device_type)
        with backend.stream(side):
            host.copy_(state, non_blocking=True)

    def compute() -> None:
        for _ in range(repeats):
            square.matmul(square)

    def timed(*works: Callable[[], None]) -> float:
        accelerator.synchronize()
        start = time.perf_counter()
        for work in works:  # queued: on a device the copy's stream runs beside the default one
            work()
        accelerator.synchronize()
        return time.perf_counter() - start

    side = getattr(torch, accelerator.device_type).Stream() if on_device else None
    timed(copy, compute)  # warm-up: pinning, kernels, caches
    copy_s = timed(copy)
    repeats = max(1, round(repeats * copy_s / timed(compute)))  # compute as long as the copy: the most to hide
    compute_s, both_s = timed(compute), timed(copy, compute)
    hidden = (copy_s + compute_s - both_s) / min(copy_s, compute_s)
    status = ("ok" if hidden >= OVERLAP_FLOOR else "failed") if on_device else "skipped"
    return _emit("snapshot_copy", status, bytes=share, copy_bandwidth=share / copy_s,
                 priced_bandwidth=priced.host_bandwidth, copy_s=copy_s, compute_s=compute_s, together_s=both_s,
                 overlap=hidden, overlap_floor=OVERLAP_FLOOR,
                 **({} if on_device else {"reason": "the CPU has no side stream: overlap is a device's figure"}))


# -- recovery memory and the abort in flight ----------------------------------------------

def _live_tensors() -> int:
    import torch

    return sum(1 for obj in gc.get_objects() if issubclass(type(obj), torch.Tensor))  # no __instancecheck__ hooks


def _recovering_rank(rank: int, port: int, results, backend: str, device_type: str) -> None:
    """One rank of a 2-rank world that recovers ``RECOVERIES`` times: per recovery, the
    seconds the abort took to end rank 0's all-reduce (which rank 1 never joins; it leaves
    once rank 0 was aborted), and what this rank holds once both left: device bytes, live
    tensors, earlier worlds' groups still alive, and groups the guard still holds."""
    try:
        import torch
        import torch.distributed as dist

        from odyssey_megatron.hooks.collective_guard import CollectiveGuard, PeerLost, prepare_backend

        device = torch.device(device_type, rank if backend == "nccl" else 0) if device_type != "cpu" \
            else torch.device("cpu")
        if device_type != "cpu":
            getattr(torch, device_type).set_device(device)
        prepare_backend(backend, timeout_s=WORLD_TIMEOUT_S)
        guard = CollectiveGuard(backend=backend, timeout_s=WORLD_TIMEOUT_S, device=device)
        guard.install()
        store = dist.TCPStore("127.0.0.1", port, 3, is_master=False,
                              timeout=datetime.timedelta(seconds=WORLD_TIMEOUT_S))
        figures, worlds = [], []
        for generation in range(RECOVERIES):
            guard.reopen(generation)
            dist.init_process_group(backend, rank=rank, world_size=2, store=dist.PrefixStore(f"gen{generation}", store),
                                    timeout=datetime.timedelta(seconds=WORLD_TIMEOUT_S),
                                    device_id=device if backend == "nccl" else None)
            worlds.append(weakref.ref(dist.distributed_c10d._get_default_group()))
            guard.track([dist.distributed_c10d._get_default_group()])
            model = torch.nn.Linear(512, 512, device=device)
            optimizer = torch.optim.Adam(model.parameters())
            model(torch.ones(8, 512, device=device)).sum().backward()
            for param in model.parameters():
                dist.all_reduce(param.grad)
            optimizer.step()
            abort_s = None
            if rank == 0:
                threading.Timer(ABORT_AFTER_S, guard.abort, args=("the check's fault",),
                                kwargs={"generation": generation}).start()
                began = time.monotonic()
                try:
                    dist.all_reduce(torch.ones(4, device=device))
                except PeerLost:
                    abort_s = time.monotonic() - began - ABORT_AFTER_S
                store.set(f"aborted {generation}", "1")
            else:
                store.wait([f"aborted {generation}"])
                guard.abort("the check's fault", generation=generation)
            guard.abandon()
            dist.destroy_process_group()
            del model, optimizer, param
            guard.done_leaving()
            deadline = time.monotonic() + 5.0
            while guard.kept and time.monotonic() < deadline:  # rank 1's closed sockets end rank 0's operation
                time.sleep(0.01)
            gc.collect()
            allocated = getattr(torch, device_type).memory_allocated(device) if device_type != "cpu" else 0
            figures.append({"abort_s": abort_s, "allocated": allocated, "tensors": _live_tensors(),
                            "groups": sum(1 for world in worlds if world() is not None), "held": guard.kept})
            store.add(f"left {generation}", 1)  # the next world starts once both left this one
            while int(store.add(f"left {generation}", 0)) < 2:
                time.sleep(0.01)
        results.put((rank, "ok", figures))
    except BaseException as exc:  # noqa: BLE001 - the parent reports it as the check's failure
        results.put((rank, "error", f"{type(exc).__name__}: {exc}"))


def _spawned_world(target: Callable, world: int, *args, timeout_s: float) -> dict[int, Any]:
    """Run ``target(rank, port, results, *args)`` on ``world`` spawned ranks around a store
    hosted here: each rank's figures, or RuntimeError with a rank's error."""
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, world + 1, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=WORLD_TIMEOUT_S))
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=target, args=(r, store.port, results, *args)) for r in range(world)]
    for proc in procs:
        proc.start()
    try:
        got = {}
        while len(got) < world:
            rank, status, payload = results.get(timeout=timeout_s)
            if status == "error":
                raise RuntimeError(f"rank {rank}: {payload}")
            got[rank] = payload
        return got
    finally:
        for proc in procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()


def check_recovery_memory(args: argparse.Namespace) -> bool:
    accelerator = _accelerator()
    worlds = [("gloo", accelerator.device_type)]
    if accelerator.backend == "nccl" and accelerator.device_count >= 2:
        worlds.append(("nccl", "cuda"))
    passed = True
    for backend, device_type in worlds:
        got = _spawned_world(_recovering_rank, 2, backend, device_type, timeout_s=RECOVERIES * WORLD_TIMEOUT_S)
        grew = {rank: {key: figures[-1][key] - figures[0][key] for key in ("allocated", "tensors", "groups", "held")}
                for rank, figures in got.items()}
        ok = all(change <= 0 for changes in grew.values() for change in changes.values())
        passed &= _emit("recovery_memory", "ok" if ok else "failed", backend=backend, device=device_type,
                        recoveries=RECOVERIES, growth_first_to_last=grew,
                        after_each={rank: figures for rank, figures in got.items()})
        if backend == "nccl":
            aborts = [f["abort_s"] for f in got[0]]
            ok = all(a is not None and a <= ABORT_LIMIT_S for a in aborts)
            passed &= _emit("nccl_abort_in_flight", "ok" if ok else "failed", abort_s=aborts, limit_s=ABORT_LIMIT_S)
    if len(worlds) == 1:
        passed &= _emit("nccl_abort_in_flight", "skipped",
                        reason=f"{accelerator.device_count} {accelerator.device_type} device(s): NCCL needs two")
    return passed


SHRINK_WORLD = 4
"""The most devices the shrink check's world takes."""


def _shrinking_rank(rank: int, port: int, results, world: int) -> None:
    """One rank of an NCCL world whose last rank is lost: the survivors shrink the world
    (``next_world``) and all-reduce on it; the lost rank waits for that, then leaves."""
    try:
        import torch
        import torch.distributed as dist

        from odyssey_megatron.hooks.process_groups import RankMap
        from odyssey_megatron.hooks.survivor_groups import KeptWorld, next_world, runtime_nccl_version, torch_offers

        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
        timeout = datetime.timedelta(seconds=WORLD_TIMEOUT_S)
        store = dist.TCPStore("127.0.0.1", port, world + 1, is_master=False, timeout=timeout)
        dist.init_process_group("nccl", rank=rank, world_size=world, store=dist.PrefixStore("shrink", store),
                                timeout=timeout, device_id=device)
        dist.all_reduce(torch.ones(1, device=device))  # the communicator is up and healthy
        torch.cuda.synchronize(device)
        lost = world - 1
        if rank == lost:  # a removed rank takes no part in the shrink, nor tears its communicator down
            store.wait(["shrunk"])
            results.put((rank, "ok", {}))
            return
        began = time.monotonic()
        group = next_world(KeptWorld(dist.distributed_c10d._get_default_group(), RankMap.identity(world, 1)),
                           ranks=RankMap.identity(lost, 1), held_everywhere=True, backend="nccl",
                           nccl_version=runtime_nccl_version(), offered=torch_offers())
        shrink_s = time.monotonic() - began
        if group is None:
            raise RuntimeError("next_world made no group from the healthy NCCL world")
        total = torch.ones(1, device=device)
        dist.all_reduce(total)  # on the new default group
        torch.cuda.synchronize(device)
        figures = {"shrink_s": shrink_s, "rank_after": group.rank(), "size_after": group.size(),
                   "default": group is dist.distributed_c10d._get_default_group(), "sum": total.item()}
        if store.add("survivors", 1) == lost:
            store.set("shrunk", "1")
        dist.destroy_process_group()
        results.put((rank, "ok", figures))
    except BaseException as exc:  # noqa: BLE001 - the parent reports it as the check's failure
        results.put((rank, "error", f"{type(exc).__name__}: {exc}"))


def check_nccl_shrink(args: argparse.Namespace) -> bool:
    from odyssey_megatron.hooks.survivor_groups import keeps_parent, runtime_nccl_version, torch_offers

    accelerator = _accelerator()
    if accelerator.backend != "nccl" or accelerator.device_count < 2:
        return _emit("nccl_shrink", "skipped",
                     reason=f"{accelerator.device_count} {accelerator.device_type} device(s): NCCL needs two")
    version = runtime_nccl_version()
    if not keeps_parent(backend="nccl", nccl_version=version, offered=torch_offers()):
        return _emit("nccl_shrink", "skipped", nccl_version=version,
                     reason="this NCCL or torch cannot shrink a communicator: survivors meet afresh")
    world = min(accelerator.device_count, SHRINK_WORLD)
    try:
        got = _spawned_world(_shrinking_rank, world, world, timeout_s=2 * WORLD_TIMEOUT_S)
    except RuntimeError as exc:
        return _emit("nccl_shrink", "failed", nccl_version=version, error=str(exc))
    survivors = [got[rank] for rank in range(world - 1)]
    ok = all(f["default"] and f["size_after"] == world - 1 and f["rank_after"] == rank and f["sum"] == world - 1
             for rank, f in enumerate(survivors))
    return _emit("nccl_shrink", "ok" if ok else "failed", nccl_version=version, world_before=world,
                 world_after=world - 1, shrink_s=[f["shrink_s"] for f in survivors], survivors=survivors)


CHECKS: dict[str, tuple[str, Callable[[argparse.Namespace], bool]]] = {
    "stage_step_time": ("a Llama-2 7B layer stage on the device: measured vs the estimator's price", check_stage_step_time),
    "snapshot_copy": ("a layer's state copied into pinned host memory on a side stream: bandwidth and overlap",
                      check_snapshot_copy),
    "recovery_memory": (f"device memory, live tensors and groups after {RECOVERIES} in-process recoveries of a "
                        "2-rank world (gloo on one device; NCCL where two exist, with nccl_abort_in_flight)",
                        check_recovery_memory),
    "nccl_shrink": (f"a world of up to {SHRINK_WORLD} GPUs losing its last rank, the survivors' world from a real "
                    "NCCL shrink of the healthy communicator (survivor_groups.next_world)", check_nccl_shrink),
}
"""Each check's name, what it shows, and the function that runs it and prints its lines."""


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="device_check", description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipe", type=Path, default=DEFAULT_RECIPE)
    parser.add_argument("--repeats", type=int, default=5, help="timed passes per profiled stage")
    parser.add_argument("--only", choices=sorted(CHECKS), action="append", help="run this check (repeatable)")
    parser.add_argument("--dry-run", action="store_true", help="list the checks and exit")
    args = parser.parse_args(argv)
    chosen = args.only or list(CHECKS)
    if args.dry_run:
        for name in chosen:
            print(json.dumps({"check": name, "would_check": CHECKS[name][0], "recipe": str(args.recipe)}))
        return 0
    passed = True
    for name in chosen:
        try:
            passed &= CHECKS[name][1](args)
        except Exception as exc:  # noqa: BLE001 - a check that cannot run has failed; the others still run
            passed &= _emit(name, "failed", error=f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
