"""Run Megatron-Core on CPU: map its CUDA calls to the CPU, the way torch_npu's
transfer_to_npu maps them to an NPU.

Megatron-Core assumes CUDA in a handful of places: ``torch.cuda.current_device()`` as a
device for buffers (P2P receive, global memory buffer, RoPE), ``device="cuda"`` in
``torch.zeros/ones/empty/tensor`` (token counters, masks), ``Tensor.cuda()`` (tied
embeddings) and the CUDA RNG tracker. The shim redirects exactly these, installs a
tracker backed by real CPU generator states (so the model-parallel stream is a separate
stream, as on GPU), and restores every patched attribute on ``uninstall``. It is only
ever used with the cpu accelerator; CUDA and NPU runs never install it.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, Iterator

import torch
import torch.utils._device
from megatron.core.tensor_parallel import random as megatron_random

_FACTORIES = ("zeros", "ones", "empty", "tensor", "full", "arange", "randn", "rand")


def _on_cpu(device: Any) -> Any:
    if isinstance(device, torch.device) and device.type == "cuda":
        return torch.device("cpu")
    if isinstance(device, str) and device.startswith("cuda"):
        return "cpu"
    if isinstance(device, int):
        return "cpu"
    return device


def _redirect_device(factory: Callable) -> Callable:
    @functools.wraps(factory)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if "device" in kwargs:
            kwargs["device"] = _on_cpu(kwargs["device"])
        return factory(*args, **kwargs)

    wrapper.__odyssey_shim__ = True
    return wrapper


class CpuRNGStatesTracker(megatron_random.CudaRNGStatesTracker):
    """Megatron's named RNG streams over CPU generator states."""

    def add(self, name: str, seed: int) -> None:
        self._is_initialized = True
        if seed in self.seeds_:
            raise ValueError(f"seed {seed} already exists")
        if name in self.states_:
            raise ValueError(f"rng state {name} already exists")
        self.seeds_.add(seed)
        self.states_[name] = torch.Generator().manual_seed(seed).get_state()

    @contextlib.contextmanager
    def fork(self, name: str = megatron_random._MODEL_PARALLEL_RNG_TRACKER_NAME) -> Iterator[None]:
        if name not in self.states_:
            raise KeyError(f"rng state {name} is not added")
        outer = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(outer)


class CpuShim:
    """Install with ``install()``; ``uninstall()`` puts every patched attribute back."""

    def __init__(self) -> None:
        self._saved: list[tuple[Any, str, Any]] = []

    @property
    def installed(self) -> bool:
        return bool(self._saved)

    def _patch(self, owner: Any, name: str, value: Any) -> None:
        self._saved.append((owner, name, getattr(owner, name)))
        setattr(owner, name, value)

    def install(self, *, seed: int = 1234) -> None:
        if self.installed:
            raise RuntimeError("the CPU shim is already installed")
        self._patch(torch.cuda, "current_device", lambda: "cpu")
        self._patch(torch.Tensor, "cuda", lambda self, *args, **kwargs: self)
        # A ``with torch.device("meta")`` block recognises factories by identity in a set
        # torch builds once, on first use; built after patching, it would hold our
        # wrappers and miss the real factories they call, so build it first.
        torch.utils._device._device_constructors()
        for name in _FACTORIES:
            self._patch(torch, name, _redirect_device(getattr(torch, name)))
        tracker = CpuRNGStatesTracker()
        tracker.add(megatron_random._MODEL_PARALLEL_RNG_TRACKER_NAME, seed + 2718)
        tracker.add(megatron_random._DATA_PARALLEL_RNG_TRACKER_NAME, seed)
        tracker.add(megatron_random._EXPERT_PARALLEL_RNG_TRACKER_NAME, seed + 1000)
        self._patch(megatron_random, "_CUDA_RNG_STATE_TRACKER", tracker)
        self._patch(megatron_random, "_CUDA_RNG_STATE_TRACKER_INITIALIZED", True)

    def uninstall(self) -> None:
        while self._saved:
            owner, name, value = self._saved.pop()
            setattr(owner, name, value)


@contextlib.contextmanager
def cpu_shim(*, seed: int = 1234) -> Iterator[CpuShim]:
    """The shim for the duration of a block (tests, the single-process reference)."""
    shim = CpuShim()
    shim.install(seed=seed)
    try:
        yield shim
    finally:
        shim.uninstall()
