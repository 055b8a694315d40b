"""The copy of a snapshot's tensors into keeper memory, off the training's critical path.

The training step may change the snapshotted tensors only in its optimizer step, so the
copy has until then; the parity encode that follows it reads keeper memory alone and may
outlast the step. On an accelerator the copy runs on a side stream of its own, after the
work queued so far on the training stream, into the keeper's mapping registered as pinned
host memory (a device-to-host copy overlaps compute only into pinned memory); the mapping
is registered once and kept registered across snapshots while the copier holds it (the
keeper reuses a buffer's mapping while its size stays), and let go in ``close``. Only the
optimizer step waits for the copy, on the device (``KeeperCopy.wait_on_device``); the host
thread that encodes the parity waits for it on the host (``KeeperCopy.wait_on_host``).
On CPU there is no device to overlap with: the copy is a plain copy, run by the thread
that encodes the parity next (``KeeperCopy.run``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Optional

import torch

from odyssey_megatron.snapshot.keeper import PayloadEntry, pack

__all__ = ["KeeperCopier", "KeeperCopy"]

_HOST_REGISTER_PORTABLE = 1
"""``cudaHostRegisterPortable``: the memory counts as pinned in every CUDA context."""


class KeeperCopy:
    """One snapshot's copy into keeper memory: started on an accelerator's side stream, or
    left for the CPU thread that runs it."""

    def __init__(self, *, cpu_copy: Optional[Callable[[], None]], done: Optional[object],
                 module: Optional[object]):
        """``cpu_copy``: the copy the encoding thread runs (None on an accelerator); ``done``:
        the side stream's event after the copy, of the device ``module``."""
        self._cpu_copy, self._done, self._module = cpu_copy, done, module
        self._copied = threading.Event()

    def run(self) -> None:
        """On the encoding thread: run a CPU copy (nothing for one on the side stream). The
        copy counts as over when it raised too: the caller hands the error on."""
        if self._cpu_copy is not None:
            try:
                self._cpu_copy()
            finally:
                self._cpu_copy = None
                self._copied.set()

    def wait_on_device(self) -> None:
        """Before the optimizer step, on the training thread: the training stream waits for
        the side stream's copy (the host goes on), or the host for the CPU copy."""
        if self._done is not None:
            self._module.current_stream().wait_event(self._done)
        else:
            self._copied.wait()

    def wait_on_host(self) -> None:
        """Before reading the payload (the parity encode): the copy is in keeper memory."""
        if self._done is not None:
            self._done.synchronize()
        else:
            self._copied.wait()


class KeeperCopier:
    """One generation's copies of a rank's snapshot shares into its keeper buffers."""

    def __init__(self):
        self._side: dict[torch.device, object] = {}
        self._registered: dict[int, torch.Tensor] = {}
        """Address of each keeper mapping registered as pinned -> the payload view that keeps it mapped."""

    def start(self, tensors: Mapping[str, torch.Tensor], entries: Sequence[PayloadEntry],
              payload: torch.Tensor) -> KeeperCopy:
        """Copy ``tensors`` into their places in ``payload`` (a keeper buffer's payload): on the
        training thread, as the step starts; the copy is started on an accelerator's side
        stream, or left for the encoding thread (``KeeperCopy.run``) where every tensor is on
        the CPU."""
        device = next((t.device for t in tensors.values() if t.device.type != "cpu"), None)
        if device is None:
            return KeeperCopy(cpu_copy=lambda: pack(tensors, entries, payload), done=None, module=None)
        module = torch.get_device_module(device)
        side = self._side.setdefault(device, module.Stream(device))
        self._register(device, payload)
        side.wait_stream(module.current_stream(device))  # after the step's work queued so far
        with module.stream(side):
            pack(tensors, entries, payload, non_blocking=True)
            for tensor in tensors.values():
                if tensor.device.type != "cpu":
                    tensor.record_stream(side)  # the allocator keeps it until the side stream copied it
            done = module.Event()
            done.record(side)
        return KeeperCopy(cpu_copy=None, done=done, module=module)

    def _register(self, device: torch.device, payload: torch.Tensor) -> None:
        """Register the keeper mapping under ``payload`` as pinned host memory, once while this
        copier lives (CUDA's ``cudaHostRegister``; other accelerators copy from it as it is)."""
        address = payload.data_ptr()
        if device.type != "cuda" or payload.numel() == 0 or address in self._registered:
            return
        error = int(torch.cuda.cudart().cudaHostRegister(address, payload.numel(), _HOST_REGISTER_PORTABLE))
        if error:
            raise RuntimeError(f"registering {payload.numel()} bytes of keeper memory as pinned failed "
                               f"(cudaError {error}); the snapshot copy needs pinned memory to overlap the step")
        self._registered[address] = payload

    def close(self) -> None:
        """Unregister every mapping this copier pinned (the keeper may then unmap them)."""
        errors = [int(torch.cuda.cudart().cudaHostUnregister(address)) for address in self._registered]
        self._registered.clear()
        if any(errors):
            raise RuntimeError(f"unregistering keeper memory failed (cudaError {max(errors)})")
