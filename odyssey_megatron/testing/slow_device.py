"""A profile of a device slower than the one measured: what CPU benchmarks emulate, so
that the real work of ranks sharing a few cores fits inside the padded op times."""

from __future__ import annotations

from dataclasses import replace

from odyssey_megatron.profile import ModelProfile


def slowed(profile: ModelProfile, factor: float) -> ModelProfile:
    """``profile`` on a device ``factor`` times slower in everything it prices: compute,
    the fixed cost per op, Adam, links and host copies."""
    return replace(
        profile.compute_scaled(forward=factor, backward=factor),
        intra_node_bandwidth=profile.intra_node_bandwidth / factor,
        inter_node_bandwidth=profile.inter_node_bandwidth / factor, link_latency_s=profile.link_latency_s * factor,
        host_bandwidth=profile.host_bandwidth / factor,
        allreduce_bandwidth=None if profile.allreduce_bandwidth is None else profile.allreduce_bandwidth / factor,
        allreduce_latency_s=None if profile.allreduce_latency_s is None else profile.allreduce_latency_s * factor,
        op_overhead_s=profile.op_overhead_s * factor,
        optimizer_s_per_param_byte=profile.optimizer_s_per_param_byte * factor,
    )
