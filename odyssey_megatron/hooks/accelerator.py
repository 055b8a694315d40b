"""Accelerator backends: the one place that decides device type and collective backend.

cuda pairs with NCCL, Ascend npu with HCCL (torch_npu, imported only when an NPU is
asked for or probed), cpu with gloo. Nothing else in the project names a device or a
backend, so tests select CPU here and nowhere else.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

import torch

ACCELERATOR_KINDS = ("auto", "cuda", "npu", "cpu")
_BACKEND = {"cuda": "nccl", "npu": "hccl", "cpu": "gloo"}


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
