"""Accelerator specifications: what an analytic profile needs to know about a device.

Figures are vendor peak numbers for dense BF16/FP16 matmuls and typical cluster links;
``mfu`` is the fraction of peak a well-tuned Megatron layer reaches. Measured profiles
(the profiler) replace these where a real device is at hand.
"""

from __future__ import annotations

from dataclasses import dataclass

from odyssey_megatron.units import GIB

GB = 1e9


@dataclass(frozen=True)
class DeviceSpec:
    """One accelerator and the links around it."""

    name: str
    peak_flops: float
    """Dense BF16/FP16 peak, FLOP/s."""
    memory_bytes: int
    """Device memory (HBM)."""
    memory_bandwidth: float
    """Bytes/s of device memory: what a memory-bound optimizer step streams at."""
    reserved_bytes: int
    """Memory the framework keeps for itself (allocator slack, workspaces, comm buffers)."""
    intra_node_bandwidth: float
    """Bytes/s one device can push to a peer in the same node (one direction)."""
    inter_node_bandwidth: float
    """Bytes/s one device can push to a peer in another node (one direction)."""
    link_latency_s: float
    """Fixed cost of one message or collective step."""
    host_bandwidth: float
    """Bytes/s one device copies to pinned host memory (its PCIe link)."""
    host_copy_async: bool
    """Whether that copy runs beside compute (a DMA engine fed from a side stream), or
    in line with it (CPU: the side stream is the one stream)."""
    mfu: float
    """Model FLOP utilisation a transformer layer reaches on this device."""


DEVICE_SPECS: dict[str, DeviceSpec] = {
    spec.name: spec
    for spec in (
        DeviceSpec(
            name="ascend-910b",
            peak_flops=313e12,
            memory_bytes=64 * GIB,
            memory_bandwidth=1600 * GB,
            reserved_bytes=4 * GIB,
            intra_node_bandwidth=56 * GB,
            inter_node_bandwidth=25 * GB,
            link_latency_s=20e-6,
            host_bandwidth=25 * GB,
            host_copy_async=True,
            mfu=0.45,
        ),
        DeviceSpec(
            name="a100-80gb",
            peak_flops=312e12,
            memory_bytes=80 * GIB,
            memory_bandwidth=2039 * GB,
            reserved_bytes=4 * GIB,
            intra_node_bandwidth=300 * GB,
            inter_node_bandwidth=25 * GB,
            link_latency_s=10e-6,
            host_bandwidth=25 * GB,
            host_copy_async=True,
            mfu=0.5,
        ),
        DeviceSpec(
            name="h100-80gb",
            peak_flops=989e12,
            memory_bytes=80 * GIB,
            memory_bandwidth=3350 * GB,
            reserved_bytes=4 * GIB,
            intra_node_bandwidth=450 * GB,
            inter_node_bandwidth=50 * GB,
            link_latency_s=8e-6,
            host_bandwidth=50 * GB,
            host_copy_async=True,
            mfu=0.45,
        ),
        DeviceSpec(
            name="cpu",
            peak_flops=50e9,
            memory_bytes=8 * GIB,
            memory_bandwidth=20 * GB,
            reserved_bytes=512 * 1024**2,
            intra_node_bandwidth=2 * GB,
            inter_node_bandwidth=1 * GB,
            link_latency_s=50e-6,
            host_bandwidth=10 * GB,
            host_copy_async=False,
            mfu=0.3,
        ),
    )
}


def device_spec(name: str) -> DeviceSpec:
    """The shipped spec called ``name``; a KeyError names the known ones."""
    try:
        return DEVICE_SPECS[name]
    except KeyError:
        raise KeyError(f"unknown device {name!r}; known: {', '.join(sorted(DEVICE_SPECS))}") from None
