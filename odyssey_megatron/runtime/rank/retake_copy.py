"""Host copies of weights and Adam state that a staggered step's exact retake starts from.

Nothing changes a rank's weights or optimizer state between its previous optimizer step
and its next one, so the copy need not sit between the two: it starts as the step's
forward and backward start, on a side stream into (pinned) host buffers, and only the
optimizer step waits for it. On an accelerator the PCIe copy then hides behind compute;
on CPU torch's side stream is the current one and the copy runs in line
(``estimator.staggered`` prices both). Two buffer sets suffice: the step in flight
holds one until it settles while the next step fills the other.
"""

from __future__ import annotations

import torch


class RetakeCopy:
    """One step's copy: waited for before the step, restored if the step is retaken,
    released when it settles."""

    def __init__(self, pool: RetakeCopyPool, buffers: dict, saved: list[tuple[torch.nn.Parameter, torch.Tensor, dict]],
                 done: object):
        self._pool, self._buffers, self._saved, self._done = pool, buffers, saved, done

    def wait(self) -> None:
        """Make the current stream wait for the copy (before the optimizer overwrites what it reads)."""
        self._pool.current_stream().wait_event(self._done)

    def restore(self, optimizer: torch.optim.Optimizer) -> None:
        """Put every parameter and its optimizer state back as they were copied."""
        for param, weights, state in self._saved:
            with torch.no_grad():
                param.copy_(weights, non_blocking=True)
            if not state:  # the step was this parameter's first
                optimizer.state.pop(param, None)
            for key, value in state.items():
                current = optimizer.state[param]
                if torch.is_tensor(value):
                    current[key].copy_(value, non_blocking=True)
                else:
                    current[key] = value

    def release(self) -> None:
        """Hand the buffers back for a later step's copy."""
        self._pool.give_back(self._buffers)
        self._buffers, self._saved = {}, []


class RetakeCopyPool:
    """Reused host buffers for one rank's optimizer, and the side stream that fills them."""

    def __init__(self, device: torch.device):
        self._module = torch.get_device_module(device)
        self._device = device
        self._pinned = device.type != "cpu"
        self._side = self._module.Stream()
        self._free: list[dict] = []

    def current_stream(self):
        return self._module.current_stream(self._device)

    def take(self, optimizer: torch.optim.Optimizer) -> RetakeCopy:
        """Start copying every parameter of ``optimizer`` and its state to host memory."""
        buffers = self._free.pop() if self._free else {}
        saved = []
        self._side.wait_stream(self.current_stream())  # after the last optimizer step or restore
        with self._module.stream(self._side):
            params = [p for group in optimizer.param_groups for p in group["params"]]
            for index, param in enumerate(params):
                weights = self._copy(buffers, (index, None), param.detach())
                state = {key: self._copy(buffers, (index, key), value) if torch.is_tensor(value) else value
                         for key, value in optimizer.state.get(param, {}).items()}
                saved.append((param, weights, state))
            done = self._module.Event()
            done.record(self._side)
        return RetakeCopy(self, buffers, saved, done)

    def give_back(self, buffers: dict) -> None:
        self._free.append(buffers)

    def _copy(self, buffers: dict, key: tuple, tensor: torch.Tensor) -> torch.Tensor:
        host = buffers.get(key)
        if host is None or host.shape != tensor.shape or host.dtype != tensor.dtype:
            host = buffers[key] = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu", pin_memory=self._pinned)
        return host.copy_(tensor, non_blocking=True)
