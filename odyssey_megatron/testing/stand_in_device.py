"""A stand-in accelerator for the CPU device check: a device that is not the host, and a
default group that, like NCCL, moves that device's tensors only.

Every CPU run hides a misplaced tensor: host and "device" are one. The check runs the
paths that move or restore state (block transfers, a snapshot's restore, a checkpoint's
load) with the blocks on torch's ``lazy`` device (its TorchScript backend computes on the
CPU, so every op really runs) and the generation's default group on ``StandInGroup``: it
refuses a tensor on any device but the bound one, saying so, as NCCL refuses a host tensor
(an error that is no lost peer), and carries the rest over gloo. Groups built with
``backend="gloo"`` (snapshot parity) stay gloo, which refuses anything but host tensors.
``install`` registers both once per process; ``STAND_IN`` is the accelerator a check binds
and joins with, through the same ``Accelerator`` methods a worker uses.
"""

from __future__ import annotations

import datetime
import types
from collections.abc import Callable, Sequence
from typing import Optional

import torch
import torch.distributed as dist

from odyssey_megatron.hooks.accelerator import Accelerator

__all__ = ["STAND_IN", "StandInGroup", "install"]

DEVICE_TYPE = "lazy"
BACKEND = "standin"
STAND_IN = Accelerator(DEVICE_TYPE, BACKEND, 1)
"""The accelerator a device check selects: one stand-in device, its collectives on ``StandInGroup``."""


class _StandInDevices(types.ModuleType):
    """``torch.lazy`` as ``torch.cuda`` is to a GPU: which device this process bound (none
    until ``set_device``), and a device that runs its work in line."""

    def __init__(self):
        super().__init__(f"torch.{DEVICE_TYPE}")
        self.bound: Optional[torch.device] = None

    def set_device(self, device: torch.device) -> None:
        self.bound = torch.device(device)

    def current_device(self) -> int:
        if self.bound is None:
            raise RuntimeError(f"no {DEVICE_TYPE} device is bound in this process: nothing called set_device "
                               "(Accelerator.bind), so every rank of a node would use device 0")
        return self.bound.index or 0

    def device_count(self) -> int:
        return 1

    def is_available(self) -> bool:
        return True

    def synchronize(self, device: object = None) -> None:
        import torch._lazy

        torch._lazy.mark_step()


def install() -> None:
    """Make the stand-in device and its backend usable in this process (idempotent)."""
    if dist.Backend.default_device_backend_map.get(DEVICE_TYPE) == BACKEND:
        return
    import torch._lazy.ts_backend

    torch._lazy.ts_backend.init()
    torch._register_device_module(DEVICE_TYPE, _StandInDevices())
    dist.Backend.register_backend(BACKEND, StandInGroup, devices=[DEVICE_TYPE])


class StandInGroup(dist.ProcessGroup):
    """A default group standing in for NCCL: every tensor it is handed must be on this
    process's bound stand-in device; each op then runs over gloo on host copies, which are
    copied back into the device tensors the op writes."""

    def __init__(self, store: dist.Store, rank: int, size: int, timeout: datetime.timedelta):
        super().__init__(rank, size)
        self._gloo = dist.ProcessGroupGloo(dist.PrefixStore("stand-in", store), rank, size, timeout)
        self.checked = 0
        """Tensors checked so far: a check that passes must have seen some."""

    def getBackendName(self) -> str:  # noqa: N802 - torch's name
        return BACKEND

    def _on_device(self, tensors: Sequence[torch.Tensor], op: str) -> list[torch.Tensor]:
        """Host copies of ``tensors``, once each is found on the bound device; RuntimeError naming the op if not."""
        bound = torch.device(DEVICE_TYPE, torch.get_device_module(DEVICE_TYPE).current_device())
        for tensor in tensors:
            if tensor.device != bound:
                raise RuntimeError(f"{op}: a {tuple(tensor.shape)} {tensor.dtype} tensor on {tensor.device}; this "
                                   f"group (standing in for NCCL) moves tensors on {bound} only")
        self.checked += len(tensors)
        # Cloned: the lazy device's own host copy may hold no memory of its own (gloo then reads address 0).
        return [tensor.cpu().clone() for tensor in tensors]

    def _run(self, op: str, tensors: list[torch.Tensor], start: Callable[[list[torch.Tensor]], dist.Work],
             *, writes: bool) -> dist.Work:
        host = self._on_device(tensors, op)
        work = start(host)

        def finish(_timeout: object = None) -> bool:
            work.wait()
            if writes:
                for tensor, copy in zip(tensors, host):
                    tensor.copy_(copy)
            return True

        return torch._C._distributed_c10d.PythonCallbackWork(finish)

    def allreduce(self, tensors, opts):
        return self._run("all_reduce", tensors, lambda host: self._gloo.allreduce(host, opts), writes=True)

    def broadcast(self, tensors, opts):
        return self._run("broadcast", tensors, lambda host: self._gloo.broadcast(host, opts), writes=True)

    def send(self, tensors, dst, tag):
        return self._run("send", tensors, lambda host: self._gloo.send(host, dst, tag), writes=False)

    def recv(self, tensors, src, tag):
        return self._run("recv", tensors, lambda host: self._gloo.recv(host, src, tag), writes=True)

    def barrier(self, opts=None):
        return self._gloo.barrier()
