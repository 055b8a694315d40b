"""Accelerator backends: the one place that decides device type and collective backend.

cuda pairs with NCCL, Ascend npu with HCCL (torch_npu, imported only when an NPU is
asked for or probed), cpu with gloo. Nothing else in the project names a device or a
backend, so tests select CPU here and nowhere else.

Device placement is owned here too: a worker binds its device once (``Accelerator.bind``:
the current device, which Megatron-Core's P2P buffers and DCP's object collectives use, is
device 0 on every rank of a node until it is set), joins each generation's default group
with it (``Accelerator.group_options``: ``device_id`` for NCCL/HCCL), and every tensor it
hands a collective is on the device the group's backend moves (``required_device``: gloo
moves host tensors, NCCL cuda ones, HCCL npu ones).
"""

from __future__ import annotations

import importlib
import time
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

ACCELERATOR_KINDS = ("auto", "cuda", "npu", "cpu")
_BACKEND = {"cuda": "nccl", "npu": "hccl", "cpu": "gloo"}
_BINDS_GROUPS = ("nccl", "hccl")
"""Backends whose groups are bound to one device (``device_id``): they move that device's tensors only."""


@dataclass(frozen=True)
class Accelerator:
    device_type: str
    """torch device type: cuda, npu or cpu."""
    backend: str
    """torch.distributed backend: nccl, hccl or gloo."""
    device_count: int
    """Devices visible to this process (1 for cpu)."""

    def device(self, local_rank: int) -> torch.device:
        """The device a rank with ``local_rank`` on its node should use."""
        if self.device_type == "cpu":
            return torch.device("cpu")
        return torch.device(self.device_type, local_rank % self.device_count)

    def bind(self, local_rank: int) -> torch.device:
        """Make ``device(local_rank)`` this process's current device and return it: call once,
        as the worker starts, before any group or model exists. Nothing to bind on cpu."""
        device = self.device(local_rank)
        if self.device_type != "cpu":
            torch.get_device_module(self.device_type).set_device(device)
        return device

    def group_options(self, device: torch.device) -> dict[str, torch.device]:
        """What ``init_process_group`` needs besides rank, world and store for a group on
        ``device``: its ``device_id`` where the backend binds groups to a device (NCCL, HCCL),
        so that each rank's communicator uses its own device; nothing for gloo."""
        return {"device_id": device} if self.backend in _BINDS_GROUPS else {}

    def synchronize(self) -> None:
        """Wait for the work queued on this process's device (CPU work runs in line)."""
        if self.device_type != "cpu":
            getattr(torch, self.device_type).synchronize()

    def host_buffer(self, like: torch.Tensor) -> torch.Tensor:
        """An empty host tensor of ``like``'s shape and dtype to copy it into: pinned on cuda,
        so the copy from the device runs at full link speed without a staging copy; plain
        memory on cpu (nothing to pin for) and on npu (torch_npu pins through its own API)."""
        return torch.empty(like.shape, dtype=like.dtype, device="cpu", pin_memory=self.device_type == "cuda")

    def time(self, work: Callable[[], object]) -> float:
        """Seconds the device spends on ``work``: between device events recorded around it
        on an accelerator (the host only queues it); on CPU, this process's CPU time, which
        is what the work costs a core of its own (the wall clock also counts the turns of
        every other process sharing the cores) and equals the wall time when one thread
        computes (``torch.set_num_threads(1)``) on an idle core."""
        if self.device_type == "cpu":
            start = time.process_time()
            work()
            return time.process_time() - start
        backend = getattr(torch, self.device_type)
        start, end = backend.Event(enable_timing=True), backend.Event(enable_timing=True)
        start.record()
        work()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3


def _npu_count() -> int:
    """NPUs visible, importing torch_npu (which registers torch.npu); 0 if it is absent."""
    try:
        importlib.import_module("torch_npu")
    except ImportError:
        return 0
    return torch.npu.device_count() if torch.npu.is_available() else 0


def select_accelerator(kind: str = "auto") -> Accelerator:
    """The accelerator for ``kind``; ``auto`` prefers cuda, then npu, then cpu.

    Raises ValueError for an unknown kind and RuntimeError, saying what is missing, when
    the requested accelerator is not usable in this process.
    """
    if kind not in ACCELERATOR_KINDS:
        raise ValueError(f"accelerator must be one of {', '.join(ACCELERATOR_KINDS)}; got {kind!r}")
    if kind in ("auto", "cuda") and torch.cuda.is_available():
        return Accelerator("cuda", _BACKEND["cuda"], torch.cuda.device_count())
    if kind == "cuda":
        raise RuntimeError("accelerator cuda requested but torch.cuda.is_available() is False in this build/process")
    if kind in ("auto", "npu"):
        count = _npu_count()
        if count:
            return Accelerator("npu", _BACKEND["npu"], count)
        if kind == "npu":
            raise RuntimeError(
                "accelerator npu requested but no Ascend NPU is usable: install torch_npu "
                "(pip install 'odyssey-megatron[npu]') on a machine with the CANN driver"
            )
    return Accelerator("cpu", _BACKEND["cpu"], 1)


def required_device(group: dist.ProcessGroup | None = None) -> torch.device:
    """The device whose tensors ``group`` (default: the default group) moves: host memory
    for gloo, else the current device of the device type its backend serves (cuda for NCCL,
    npu for HCCL). A tensor on another device fails there with an error that is no lost peer."""
    backend = dist.get_backend(group)
    if backend == dist.Backend.GLOO:
        return torch.device("cpu")
    device_type = next(device for device, served in dist.Backend.default_device_backend_map.items()
                       if served == backend)
    return torch.device(device_type, torch.get_device_module(device_type).current_device())
