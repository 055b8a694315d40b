"""A profile of a device slower than the one measured: what CPU benchmarks emulate, so
that the real work of ranks sharing a few cores fits inside the padded op times."""

from __future__ import annotations

from dataclasses import replace

from odyssey_megatron.profile import BlockCost, ModelProfile


def slowed(profile: ModelProfile, factor: float) -> ModelProfile:
    """``profile`` on a device ``factor`` times slower in everything it prices: compute,
    the fixed cost per op, Adam, links and host copies."""
    def block(cost: BlockCost) -> BlockCost:
        return replace(cost, forward_s=cost.forward_s * factor, backward_s=cost.backward_s * factor,
                       weight_grad_s=None if cost.weight_grad_s is None else cost.weight_grad_s * factor)

    return replace(
        profile, layers=tuple(block(c) for c in profile.layers), embedding=block(profile.embedding),
        output=block(profile.output), intra_node_bandwidth=profile.intra_node_bandwidth / factor,
        inter_node_bandwidth=profile.inter_node_bandwidth / factor, link_latency_s=profile.link_latency_s * factor,
        host_bandwidth=profile.host_bandwidth / factor,
        allreduce_bandwidth=None if profile.allreduce_bandwidth is None else profile.allreduce_bandwidth / factor,
        allreduce_latency_s=None if profile.allreduce_latency_s is None else profile.allreduce_latency_s * factor,
        op_overhead_s=profile.op_overhead_s * factor,
        optimizer_s_per_param_byte=profile.optimizer_s_per_param_byte * factor,
    )
