"""Model profile: what each block of the model costs in time and memory on one rank.

A block (``blocks.Block``) is a unit of parameters that moves and syncs as a whole:
transformer layer ``i`` (an int), the input ``"embedding"`` and the ``"output"`` head
(final norm, output projection and loss); which blocks a stage holds is ``blocks``'
geometry. Profiles come from measurement (the profiler) or from model dimensions and a
device spec (``analytic_profile``). Everything is per rank: with TP > 1 a block's bytes
and time are one tensor-parallel shard's.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, replace
from typing import Iterable, Mapping

from odyssey_megatron.blocks import EMBEDDING, OUTPUT, Block, StageSpec, stage_blocks
from odyssey_megatron.config import ModelConfig
from odyssey_megatron.optimizer_shards import fullest_share, owned_share
from odyssey_megatron.specs.devices import DeviceSpec

# Megatron mixed precision with a distributed-optimizer-free Adam: fp32 main grads,
# fp32 master weights plus two fp32 moments.
GRAD_BYTES_PER_PARAM = 4
OPTIMIZER_BYTES_PER_PARAM = 12
ADAM_TRAFFIC_BYTES_PER_PARAM = 28
"""Memory traffic of one Adam step per parameter: it reads the fp32 gradient, master
weight and two moments and writes the weight and moments back; memory-bound everywhere."""
WEIGHT_GRAD_SHARE = 0.5
"""Share of a block's backward spent on weight gradients where the profile did not
measure it: one of the two GEMMs of each linear layer."""


@dataclass(frozen=True)
class BlockCost:
    """Time per micro-batch and memory of one block on one rank."""

    forward_s: float
    backward_s: float
    param_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    activation_bytes: int
    """Activations one micro-batch keeps alive from this block's forward to its backward."""
    weight_grad_s: float | None = None
    """Of ``backward_s``, the weight-gradient half when the backward is split
    (``hooks.weight_grad``), as the profiler measured it; None where unmeasured
    (``WEIGHT_GRAD_SHARE`` of it)."""

    @property
    def split_weight_grad_s(self) -> float:
        """Seconds of the weight-gradient half of a split backward."""
        return self.weight_grad_s if self.weight_grad_s is not None else WEIGHT_GRAD_SHARE * self.backward_s

    @property
    def static_bytes(self) -> int:
        return self.param_bytes + self.grad_bytes + self.optimizer_bytes

    @property
    def state_bytes(self) -> int:
        """What must move when the block changes owner: weights and optimizer state."""
        return self.param_bytes + self.optimizer_bytes


@dataclass(frozen=True)
class StageTimes:
    """Seconds of one micro-batch's ops on a stage, the fixed cost per op included: what
    the estimator prices and device-time emulation pads each op to."""

    forward_s: float
    backward_s: float
    """A whole backward."""
    input_grad_s: float
    """A split backward's input-gradient op (B)."""
    weight_grad_s: float
    """A split backward's weight-gradient op (W)."""


@dataclass(frozen=True)
class ModelProfile:
    """Per-block costs plus the links and sizes the estimator needs."""

    layers: tuple[BlockCost, ...]
    embedding: BlockCost
    output: BlockCost
    tie_embeddings: bool
    p2p_bytes: int
    """Bytes of the activation (or its gradient) sent between adjacent stages per micro-batch."""
    intra_node_bandwidth: float
    inter_node_bandwidth: float
    link_latency_s: float
    memory_budget_bytes: int
    """Usable memory per device."""
    samples_per_micro_batch: int
    tokens_per_sample: int
    host_bandwidth: float = float("inf")
    """Bytes/s a device copies to host memory: what a staggered optimizer step's retake
    snapshot costs (``estimator.staggered``)."""
    host_copy_async: bool = True
    """Whether that copy overlaps compute (``DeviceSpec.host_copy_async``)."""
    allreduce_bandwidth: float | None = None
    """Bytes/s of the ring all-reduce model (``estimator.communication.allreduce_time``)
    fitted to all-reduces the profiler timed within a node; None where unmeasured (the
    link bandwidth stands in)."""
    allreduce_latency_s: float | None = None
    """Per-step latency of that fit; None where unmeasured (``link_latency_s`` stands in)."""
    op_overhead_s: float = 0.0
    """Fixed seconds every forward, backward and weight-gradient op costs beside its
    blocks' work (launching it, the schedule's bookkeeping): a split backward pays it twice."""
    optimizer_s_per_param_byte: float = 0.0
    """Seconds an optimizer step (the local gradient norm and Adam) takes per byte of the
    parameters a rank holds."""
    snapshot_copy_bandwidth: float | None = None
    """Bytes/s a rank copies its in-memory snapshot share into keeper memory
    (``snapshot.keeper_copy``), measured by ``odyssey profile``; None in an analytic
    profile (``host_bandwidth`` stands in)."""
    parity_xor_bandwidth: float | None = None
    """Bytes/s a rank XORs host memory in a parity encode or rebuild (``parity.xor_into``),
    measured by ``odyssey profile``; None in an analytic profile (the XOR is taken as free
    beside the network)."""

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def block(self, block: Block) -> BlockCost:
        if block == EMBEDDING:
            return self.embedding
        if block == OUTPUT:
            return self.output
        return self.layers[block]

    def stage_blocks(self, start: int, end: int, *, first: bool, last: bool) -> list[Block]:
        """Blocks held by a stage owning layers [start, end) at the given pipeline position."""
        return stage_blocks(StageSpec((start, end), first=first, last=last), tied=self.tie_embeddings)

    def compute_blocks(self, start: int, end: int, *, first: bool, last: bool) -> list[Block]:
        """Blocks a stage runs per micro-batch: a tied copy of the embedding on the last
        stage is held, not run (the output block uses it): the blocks an untied stage holds."""
        return stage_blocks(StageSpec((start, end), first=first, last=last), tied=False)

    def stage_times(self, start: int, end: int, *, first: bool, last: bool) -> StageTimes:
        """Seconds of one micro-batch's ops on a stage owning layers [start, end)."""
        costs = [self.block(b) for b in self.compute_blocks(start, end, first=first, last=last)]
        backward_s = sum(c.backward_s for c in costs)
        weight_grad_s = sum(c.split_weight_grad_s for c in costs)
        overhead = self.op_overhead_s
        return StageTimes(forward_s=sum(c.forward_s for c in costs) + overhead, backward_s=backward_s + overhead,
                          input_grad_s=backward_s - weight_grad_s + overhead, weight_grad_s=weight_grad_s + overhead)

    def stage_compute(self, start: int, end: int, *, first: bool, last: bool) -> tuple[float, float]:
        """(forward, whole backward) seconds of one micro-batch on a stage."""
        times = self.stage_times(start, end, first=first, last=last)
        return times.forward_s, times.backward_s

    def compute_scaled(self, *, forward: float, backward: float) -> "ModelProfile":
        """This profile with every block's forward time, and its backward time (with the
        weight-gradient half), multiplied by the factors; links, memory and the fixed cost
        per op as they are."""
        def block(cost: BlockCost) -> BlockCost:
            weight_grad_s = None if cost.weight_grad_s is None else cost.weight_grad_s * backward
            return replace(cost, forward_s=cost.forward_s * forward, backward_s=cost.backward_s * backward,
                           weight_grad_s=weight_grad_s)

        return replace(self, layers=tuple(block(b) for b in self.layers), embedding=block(self.embedding),
                       output=block(self.output))

    def held(self, holders: Mapping[Block, int]) -> "ModelProfile":
        """This profile with each block's optimizer state cut to what the fullest of its
        ``holders[block]`` DP holders keeps under the distributed optimizer
        (``optimizer_shards.fullest_share``); a block no one holds keeps all of it. The
        counts are a plan's (``ExecutionPlan.holder_counts``) or a layout's
        (``pipeline_holder_counts``), never the recipe's DP size: a plan that lost a holder
        of a block needs a larger share on each of the others."""
        cut: dict[tuple[BlockCost, int], BlockCost] = {}  # alike layers stay one object, cheap to compare

        def block(b: Block, cost: BlockCost) -> BlockCost:
            key = cost, holders.get(b, 1)
            if key not in cut:
                cut[key] = replace(cost, optimizer_bytes=fullest_share(cost.optimizer_bytes, key[1]))
            return cut[key]

        return replace(self, layers=tuple(block(i, cost) for i, cost in enumerate(self.layers)),
                       embedding=block(EMBEDDING, self.embedding), output=block(OUTPUT, self.output))

    def pipeline_holder_counts(self, lengths: Iterable[int]) -> dict[Block, int]:
        """How many stages hold each block in whole pipelines of ``lengths`` stages, as
        ``ExecutionPlan.holder_counts`` counts a plan of them: where the layers are split
        does not change it (every pipeline holds each block once, a tied embedding on its
        first and last stages)."""
        counts: dict[Block, int] = {}
        for length, pipelines in Counter(lengths).items():
            for s in range(length):
                layers = (s * self.num_layers // length, (s + 1) * self.num_layers // length)
                for b in self.stage_blocks(*layers, first=s == 0, last=s == length - 1):
                    counts[b] = counts.get(b, 0) + pipelines
        return counts

    def optimizer_s(self, blocks: Iterable[Block], holders: Mapping[Block, int] | None = None) -> float:
        """Seconds of an optimizer step over ``blocks`` (the blocks a rank holds). With
        ``holders`` (the distributed optimizer: each block's holder count in the plan,
        ``ExecutionPlan.holder_counts``) a rank steps only its owned ranges of each block,
        ``optimizer_shards.owned_share`` of it."""
        def share(block: Block) -> float:
            return 1.0 if holders is None else owned_share(holders.get(block, 1))

        return sum(self.block(b).param_bytes * share(b) for b in blocks) * self.optimizer_s_per_param_byte

    def allreduce_link(self, *, spans_nodes: bool) -> tuple[float, float]:
        """(bandwidth, latency) of the ring all-reduce model: the profiler's fit within a
        node where it has one, else the links'; across nodes no faster than the
        inter-node link."""
        bandwidth = self.allreduce_bandwidth or self.intra_node_bandwidth
        latency = self.allreduce_latency_s if self.allreduce_latency_s is not None else self.link_latency_s
        return (min(bandwidth, self.inter_node_bandwidth) if spans_nodes else bandwidth), latency

    def bandwidth(self, same_node: bool) -> float:
        return self.intra_node_bandwidth if same_node else self.inter_node_bandwidth


EMBEDDING_GATHER_BYTES_PER_S = 1e12
"""An embedding lookup is a memory-bound gather; HBM-class speed makes it negligible, as it is."""


def _mixed_precision_block(params: int, dtype_bytes: int, *, forward_s: float, activation_bytes: int) -> BlockCost:
    """A block trained in mixed precision: backward costs twice the forward."""
    return BlockCost(
        forward_s=forward_s,
        backward_s=2 * forward_s,
        param_bytes=params * dtype_bytes,
        grad_bytes=params * GRAD_BYTES_PER_PARAM,
        optimizer_bytes=params * OPTIMIZER_BYTES_PER_PARAM,
        activation_bytes=activation_bytes,
    )


def analytic_profile(
    model: ModelConfig,
    *,
    micro_batch_size: int,
    tensor_parallel_size: int,
    device: DeviceSpec,
    memory_budget_bytes: int | None = None,
) -> ModelProfile:
    """Costs of ``model``'s dimensions on a device spec (Llama: SwiGLU MLP, RMSNorm, no biases).

    Compute is matmul FLOPs at the device's MFU (backward = 2x forward); a TP > 1 layer
    adds two activation all-reduces per pass. An optimizer step streams Adam's traffic
    through the device's memory; the fixed cost per op is taken as nil. Activation memory follows Korthikanti et al.
    (2022) with flash attention and no recomputation, adapted to the SwiGLU MLP.
    """
    h, f, s, b, t = model.hidden_size, model.ffn_hidden_size, model.seq_length, micro_batch_size, tensor_parallel_size
    num_layers, vocab_size, tie_embeddings, dtype_bytes = (model.num_layers, model.vocab_size, model.tie_embeddings,
                                                           model.dtype_bytes)
    kv = h // model.num_attention_heads * model.num_query_groups
    flops_rate = device.peak_flops * device.mfu
    tokens = b * s

    layer_params = (2 * h * h + 2 * h * kv + 3 * h * f) // t + 2 * h
    attention_flops = 4 * tokens * s * h // t  # QK^T and AV, causal mask not discounted
    layer_forward_flops = 2 * tokens * (layer_params - 2 * h) + attention_flops
    tp_comm_s = 0.0
    if t > 1:
        message = tokens * h * dtype_bytes
        tp_comm_s = 2 * (2 * (t - 1) / t * message / device.intra_node_bandwidth + device.link_latency_s)
    layer_forward_s = layer_forward_flops / flops_rate + tp_comm_s
    # Tensors autograd keeps per token, in elements: the two RMSNorm inputs (2h), the QKV
    # matmul input (h), Q, K and V ((h + 2kv)/t), the attention output feeding the output
    # projection (h/t), the MLP input (h), gate and up projections (2f/t) and the SwiGLU
    # output feeding the down projection (f/t). Flash attention keeps no score matrix.
    saved_elements = 2 * h + h + (h + 2 * kv) // t + h // t + h + 3 * f // t
    layer = _mixed_precision_block(
        layer_params, dtype_bytes, forward_s=layer_forward_s, activation_bytes=tokens * saved_elements * dtype_bytes
    )
    vocab_params = vocab_size * h // t
    gather_s = tokens * h * dtype_bytes / EMBEDDING_GATHER_BYTES_PER_S
    embedding = _mixed_precision_block(vocab_params, dtype_bytes, forward_s=gather_s, activation_bytes=0)
    head_params = (0 if tie_embeddings else vocab_params) + h
    output = _mixed_precision_block(
        head_params,
        dtype_bytes,
        forward_s=2 * tokens * vocab_params / flops_rate,
        # norm input, head input, fp32 logits for the loss
        activation_bytes=tokens * (2 * h * dtype_bytes + vocab_size // t * 4),
    )
    budget = memory_budget_bytes if memory_budget_bytes is not None else device.memory_bytes - device.reserved_bytes
    return ModelProfile(
        layers=(layer,) * num_layers,
        embedding=embedding,
        output=output,
        tie_embeddings=tie_embeddings,
        p2p_bytes=tokens * h * dtype_bytes,
        intra_node_bandwidth=device.intra_node_bandwidth,
        inter_node_bandwidth=device.inter_node_bandwidth,
        link_latency_s=device.link_latency_s,
        host_bandwidth=device.host_bandwidth,
        host_copy_async=device.host_copy_async,
        memory_budget_bytes=budget,
        samples_per_micro_batch=b,
        tokens_per_sample=s,
        optimizer_s_per_param_byte=ADAM_TRAFFIC_BYTES_PER_PARAM / dtype_bytes / device.memory_bandwidth,
    )


def uniform_profile(
    *,
    num_layers: int,
    forward_s: float = 1.0,
    backward_s: float = 2.0,
    layer_state_bytes: int = 1,
    activation_bytes: int = 0,
    memory_budget_bytes: int = 1 << 62,
    bandwidth: float = float("inf"),
) -> ModelProfile:
    """A textbook profile: identical layers, free embedding/head, free links.

    The paper's closed forms (Eq. 9, 12-14) assume exactly this; worked examples and
    property tests use it. ``layer_state_bytes`` counts as parameter bytes so one
    transferred layer costs that much.
    """
    layer = BlockCost(forward_s, backward_s, layer_state_bytes, 0, 0, activation_bytes)
    free = BlockCost(0.0, 0.0, 0, 0, 0, 0)
    return ModelProfile(
        layers=(layer,) * num_layers,
        embedding=free,
        output=free,
        tie_embeddings=False,
        p2p_bytes=0,
        intra_node_bandwidth=bandwidth,
        inter_node_bandwidth=bandwidth,
        link_latency_s=0.0,
        memory_budget_bytes=memory_budget_bytes,
        samples_per_micro_batch=1,
        tokens_per_sample=1,
    )
