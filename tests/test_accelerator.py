"""The accelerator layer picks gloo on a CPU-only machine and refuses missing devices clearly."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from odyssey_megatron.hooks import Accelerator, select_accelerator


def test_cpu_is_gloo():
    cpu = select_accelerator("cpu")
    assert cpu == Accelerator("cpu", "gloo", 1)
    assert cpu.device(5) == torch.device("cpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_auto_falls_back_to_cpu_and_cuda_request_explains():
    if importlib.util.find_spec("torch_npu") is None:
        assert select_accelerator("auto").backend == "gloo"
    with pytest.raises(RuntimeError, match="cuda requested"):
        select_accelerator("cuda")


@pytest.mark.skipif(importlib.util.find_spec("torch_npu") is not None, reason="torch_npu installed")
def test_npu_request_without_torch_npu_says_how_to_install():
    with pytest.raises(RuntimeError, match=r"odyssey-megatron\[npu\]"):
        select_accelerator("npu")


def test_unknown_kind_names_the_choices():
    with pytest.raises(ValueError, match="auto, cuda, npu, cpu"):
        select_accelerator("tpu")


def test_device_index_wraps_local_rank():
    assert Accelerator("cuda", "nccl", 4).device(6) == torch.device("cuda", 2)
