"""The CPU shim maps Megatron's CUDA calls to the CPU and leaves nothing behind."""

from __future__ import annotations

import torch
from megatron.core.tensor_parallel import random as megatron_random

from odyssey_megatron.hooks.cpu_shim import cpu_shim


def _globals():
    return (torch.zeros, torch.ones, torch.empty, torch.tensor, torch.cuda.current_device, torch.Tensor.cuda,
            megatron_random._CUDA_RNG_STATE_TRACKER, megatron_random._CUDA_RNG_STATE_TRACKER_INITIALIZED)


def test_shim_redirects_cuda_and_restores_every_global():
    before = _globals()
    with cpu_shim():
        assert torch.cuda.current_device() == "cpu"
        assert torch.zeros(3, device="cuda").device.type == "cpu"
        assert torch.tensor([1.0], device=torch.device("cuda", 0)).device.type == "cpu"
        t = torch.ones(2)
        assert t.cuda() is t
    assert _globals() == before


def test_model_parallel_rng_is_a_separate_reproducible_stream():
    torch.manual_seed(0)
    plain = torch.rand(4)
    with cpu_shim(seed=5):
        tracker = megatron_random.get_cuda_rng_tracker()
        torch.manual_seed(0)
        with tracker.fork():
            forked = torch.rand(4)
        after_fork = torch.rand(4)
    with cpu_shim(seed=5):
        with megatron_random.get_cuda_rng_tracker().fork():
            again = torch.rand(4)
    assert not torch.equal(forked, plain)  # its own stream, not the default one
    assert torch.equal(after_fork, plain)  # the default stream did not move
    assert torch.equal(forked, again)  # seeded: the same in every run


def test_meta_device_blocks_still_work_when_the_shim_comes_first():
    # torch caches the factories a device block redirects on first use, so only a fresh
    # process where the shim is installed before any device block shows the problem.
    import subprocess
    import sys

    code = (
        "import torch\n"
        "from odyssey_megatron.hooks.cpu_shim import CpuShim\n"
        "CpuShim().install()\n"
        "with torch.device('meta'):\n"
        "    print(torch.empty(2).device.type, torch.nn.Linear(2, 2).weight.device.type)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.split() == ["meta", "meta"]
