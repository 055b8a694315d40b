"""The measured profile of a recipe's model on this machine (``odyssey profile``).

One stage of each kind (first with the embedding, middle, last with the output head),
each holding the recipe's layers per stage (at most ``LAYERS_PER_STAGE``), is measured
on the actual device
(``profiler.stages``), and a middle stage of one layer beside them: the two middle stages
give a layer's cost (their difference per layer) and the fixed cost of an op (what the
one-layer stage costs beyond its layer), the embedding and output head cost what the
first and last stages cost beyond the middle one. The optimizer step is the middle
stage's, per byte of its parameters.
Parameter, gradient and optimizer bytes are counted per block. P2P and all-reduce
bandwidth and latency come from two ranks of this machine (``profiler.links``); the
inter-node bandwidth, which one machine cannot measure, and the memory budget come from
the recipe (``cluster.device``, ``odyssey.memory_budget_gib``), as in the analytic profile.
The result is the profile file ``profile_file`` reads.
"""

from __future__ import annotations

import datetime
import platform
import statistics
import time
from dataclasses import replace

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.process_groups_config import ProcessGroupCollection

from odyssey_megatron.blocks import EMBEDDING, OUTPUT, StageSpec
from odyssey_megatron.config import RecipeConfig
from odyssey_megatron.errors import ConfigError
from odyssey_megatron.hooks.accelerator import Accelerator, select_accelerator
from odyssey_megatron.hooks.cpu_shim import CpuShim
from odyssey_megatron.profile import BlockCost
from odyssey_megatron.profile_file import ProfileFile, analytic_recipe_profile, recipe_measured_for
from odyssey_megatron.profiler.links import measure_links
from odyssey_megatron.profiler.snapshot_rates import measure_snapshot_rates
from odyssey_megatron.profiler.stages import StageMeasurement, measure_stages

__all__ = ["WARMUP", "measure_profile"]

WARMUP = 3
"""Passes run and discarded before timing: allocator, caches and kernel selection settle."""
LAYERS_PER_STAGE = 2
"""Layers of each measured stage (fewer if the recipe's stages hold fewer): three stages
of them are alive at once, and a Llama-2 7B layer with its activations takes about
5 GB. A stage's fixed costs (RoPE tables, the P2P buffers) are spread over its layers."""
LARGE_MESSAGE_BYTES = 8 * 2**20
"""The large message of the link measurement, unless a P2P activation is larger (then four of them)."""
HOST_COPY_BYTES = 64 * 2**20
"""The device-to-host copy timed for the host bandwidth."""


def measure_profile(config: RecipeConfig, *, repeats: int, warmup: int = WARMUP) -> ProfileFile:
    """Measure the recipe's model on this machine's accelerator (``hooks.select_accelerator``)
    with ``repeats`` timed passes of each kind after ``warmup``; TP 1 only."""
    if config.parallel.tensor_model_parallel_size != 1:
        raise ConfigError("parallel.tensor_model_parallel_size", "odyssey profile measures TP=1 stages only; got "
                          f"{config.parallel.tensor_model_parallel_size} (use the analytic profile for TP > 1)")
    started = time.perf_counter()
    accelerator = select_accelerator("auto")
    analytic = analytic_recipe_profile(config, device=config.cluster.device)
    model, batch = config.model, config.training.micro_batch_size
    p2p_bytes = model.seq_length * batch * model.hidden_size * model.dtype_bytes
    links = None
    if accelerator.device_type == "cpu" or accelerator.device_count >= 2:
        links = measure_links(accelerator, large_bytes=max(LARGE_MESSAGE_BYTES, 4 * p2p_bytes), repeats=repeats,
                              warmup=warmup)
    per_stage = max(1, min(LAYERS_PER_STAGE, model.num_layers // config.parallel.pipeline_model_parallel_size))
    first, middle, last, *one = _measure_stages(config, accelerator, per_stage=per_stage, repeats=repeats,
                                                warmup=warmup)
    host_bandwidth = _host_bandwidth(accelerator)
    snapshot_copy_bandwidth, parity_xor_bandwidth = measure_snapshot_rates(accelerator)
    overhead_s = _op_overhead(middle, one[0], per_stage) if one else 0.0
    layer, share = _layer_cost(middle, one[0] if one else None, per_stage, overhead_s)
    embedding, output = _edge_cost(EMBEDDING, first, middle), _edge_cost(OUTPUT, last, middle)
    profile = replace(
        analytic,
        layers=(layer,) * model.num_layers,
        embedding=embedding,
        output=output,
        p2p_bytes=p2p_bytes,
        host_bandwidth=host_bandwidth,
        host_copy_async=accelerator.device_type != "cpu",
        snapshot_copy_bandwidth=snapshot_copy_bandwidth,
        parity_xor_bandwidth=parity_xor_bandwidth,
        op_overhead_s=overhead_s,
        optimizer_s_per_param_byte=middle.optimizer_s / sum(b.param_bytes for b in middle.blocks.values()),
    )
    if links is not None:
        profile = replace(
            profile,
            intra_node_bandwidth=links.p2p.bandwidth,
            inter_node_bandwidth=min(links.p2p.bandwidth, analytic.inter_node_bandwidth),
            link_latency_s=links.p2p.latency_s,
            allreduce_bandwidth=links.allreduce.bandwidth,
            allreduce_latency_s=links.allreduce.latency_s,
        )
    source = {
        "device": _device_name(accelerator),
        "timer": "process CPU time, one thread" if accelerator.device_type == "cpu"
        else f"{accelerator.device_type} events",
        "repeats": repeats,
        "warmup": warmup,
        "layers_per_stage": per_stage,
        "weight_grad_share": share,
        "op_overhead_s": "intercept of op time over layers (a one-layer and a "
                         f"{per_stage}-layer middle stage)" if per_stage > 1 else "not measured (one-layer stages)",
        "links": f"measured between 2 ranks over {accelerator.backend}; inter-node at most cluster.device "
                 f"{config.cluster.device}'s (one machine was measured)" if links is not None
        else f"cluster.device {config.cluster.device}'s (one {accelerator.device_type} device: nothing to measure)",
        "memory_budget_bytes": "the recipe's (odyssey.memory_budget_gib or cluster.device)",
        "snapshot_rates": "a share's copy into a keeper buffer and the parity XOR, measured here (profiler."
                          "snapshot_rates); the parity's network part at the inter-node bandwidth",
        "seconds": round(time.perf_counter() - started, 3),
    }
    return ProfileFile(profile=profile, measured_for=recipe_measured_for(config), source=source)


def _op_overhead(middle: StageMeasurement, one: StageMeasurement, per_stage: int) -> float:
    """The fixed cost of an op: the intercept of op time over layers, between the middle
    stage and the one-layer one, for forwards and backwards alike (never below zero)."""
    intercepts = [(per_stage * small - large) / (per_stage - 1)
                  for small, large in ((one.forward_s, middle.forward_s), (one.backward_s, middle.backward_s))]
    return max(0.0, statistics.mean(intercepts))


def _layer_cost(middle: StageMeasurement, one: StageMeasurement | None, per_stage: int,
                overhead_s: float) -> tuple[BlockCost, float]:
    """A layer: the middle stage's work beyond an op's fixed cost, per layer, and the
    weight-gradient share of its split backward."""
    held = middle.blocks[0]
    backward_s = max(0.0, middle.backward_s - overhead_s) / per_stage
    share = _weight_grad_share(middle, one)
    return BlockCost(
        forward_s=max(0.0, middle.forward_s - overhead_s) / per_stage,
        backward_s=backward_s,
        param_bytes=held.param_bytes,
        grad_bytes=held.grad_bytes,
        optimizer_bytes=held.optimizer_bytes,
        activation_bytes=middle.activation_bytes // per_stage,
        weight_grad_s=share * backward_s,
    ), share


def _weight_grad_share(middle: StageMeasurement, one: StageMeasurement | None) -> float:
    """The weight-gradient share of a layer's split backward: from what the middle stage's
    halves take beyond the one-layer stage's (the added layers' work, no op's fixed cost in
    it). Where noise leaves either difference at or below zero (ops of a millisecond on a
    busy machine), the middle stage's own halves give it: biased towards even by the fixed
    cost, but never a layer whose weights take no time."""
    if one is not None:
        added_input_s, added_weight_s = middle.input_grad_s - one.input_grad_s, middle.weight_grad_s - one.weight_grad_s
        if added_input_s > 0 and added_weight_s > 0:
            return added_weight_s / (added_input_s + added_weight_s)
    return _share(middle.input_grad_s, middle.weight_grad_s)


def _edge_cost(block: str, stage: StageMeasurement, middle: StageMeasurement) -> BlockCost:
    """The embedding (``stage`` is the first) or the output head (the last): what the
    stage costs beyond the middle one, never below zero, and the bytes it holds."""
    held = stage.blocks[block]
    backward_s = max(0.0, stage.backward_s - middle.backward_s)
    return BlockCost(
        forward_s=max(0.0, stage.forward_s - middle.forward_s),
        backward_s=backward_s,
        param_bytes=held.param_bytes,
        grad_bytes=held.grad_bytes,
        optimizer_bytes=held.optimizer_bytes,
        activation_bytes=max(0, stage.activation_bytes - middle.activation_bytes),
        # The embedding's gradient stays in the input-gradient half (hooks.weight_grad);
        # the head's weight GEMM is what the last stage's W op does beyond the middle's.
        weight_grad_s=0.0 if block == EMBEDDING
        else min(backward_s, max(0.0, stage.weight_grad_s - middle.weight_grad_s)),
    )


def _measure_stages(config: RecipeConfig, accelerator: Accelerator, *, per_stage: int, repeats: int,
                    warmup: int) -> list[StageMeasurement]:
    """First, middle and last stages, and a one-layer middle stage where those hold more, measured in a one-rank world of this process (the
    CPU shim installed on CPU, everything put back after)."""
    shim, threads = CpuShim(), torch.get_num_threads()
    if accelerator.device_type == "cpu":
        shim.install(seed=config.training.seed)
        torch.set_num_threads(1)  # CPU time is device time with one thread computing
    dist.init_process_group(accelerator.backend, store=dist.HashStore(), rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=60))
    try:
        parallel_state._set_global_memory_buffer()
        one = dist.new_group([0])
        groups = ProcessGroupCollection(tp=one, cp=one, pp=one, ep=one, expt_dp=one, embd=None, pos_embd=None,
                                        dp=one, dp_cp=one)
        stages = [StageSpec((0, per_stage), first=first, last=last)
                  for first, last in ((True, False), (False, False), (False, True))]
        if per_stage > 1:
            stages.append(StageSpec((0, 1), first=False, last=False))
        return measure_stages(config.model, stages, pg_collection=groups, accelerator=accelerator,
                              device=accelerator.device(0), micro_batch_size=config.training.micro_batch_size,
                              seed=config.training.seed, repeats=repeats, warmup=warmup)
    finally:
        parallel_state.destroy_global_memory_buffer()
        dist.destroy_process_group()
        shim.uninstall()
        torch.set_num_threads(threads)


def _share(input_grad_s: float, weight_grad_s: float) -> float:
    """The weight-gradient share of a split backward, within [0, 1]."""
    input_grad_s, weight_grad_s = max(0.0, input_grad_s), max(0.0, weight_grad_s)
    total = input_grad_s + weight_grad_s
    return weight_grad_s / total if total > 0 else 0.0


def _host_bandwidth(accelerator: Accelerator) -> float:
    """Bytes/s of a copy from the device to host memory (pinned on an accelerator), as a
    staggered step's retake snapshot makes: the median of three after one warm-up."""
    size = HOST_COPY_BYTES
    source = torch.ones(size // 4, dtype=torch.float32, device=accelerator.device(0))
    host = torch.empty(size // 4, dtype=torch.float32, pin_memory=accelerator.device_type != "cpu")

    def copy() -> float:
        start = time.perf_counter()
        host.copy_(source)
        accelerator.synchronize()
        return time.perf_counter() - start

    copy()
    return size / statistics.median(copy() for _ in range(3))


def _device_name(accelerator: Accelerator) -> str:
    if accelerator.device_type == "cpu":
        return f"cpu ({platform.processor() or platform.machine()})"
    return f"{accelerator.device_type} ({getattr(torch, accelerator.device_type).get_device_name(0)})"
