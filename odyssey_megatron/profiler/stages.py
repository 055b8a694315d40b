"""Time and memory of one pipeline stage on this process's device: the profiler's compute half.

A stage is measured as the executor runs it (``runtime.rank.executor``): Megatron's
``forward_step`` and ``backward_step`` on a real stage model, a middle or last stage fed
a random activation, a non-last stage given a random output gradient. Each pass is timed
by ``Accelerator.time`` (device events, or CPU time on CPU); passes after the warm-up
are kept and their median taken. The coupled backward is timed first, then the
model's linear layers are split (``hooks.weight_grad``) and the input- and
weight-gradient halves are timed apart. The optimizer step (the gradient norm's local
square and Adam, as ``runtime.rank.plan_runner`` runs them) is timed over the stage's
parameters after that. Activation memory is what autograd saves during
one forward (a saved-tensors hook counts each storage once, parameters excluded) plus the
stage's input and output, which the executor keeps until the backward.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from functools import partial
from typing import Sequence

import torch
from megatron.core.enums import ModelType
from megatron.core.pipeline_parallel.schedules import backward_step, forward_step
from megatron.core.process_groups_config import ProcessGroupCollection

from odyssey_megatron.blocks import Block, StageSpec
from odyssey_megatron.config import ModelConfig
from odyssey_megatron.data import SyntheticTokens
from odyssey_megatron.hooks.accelerator import Accelerator
from odyssey_megatron.hooks.grad_sync import parameters_by_block
from odyssey_megatron.hooks.model import build_stage_model
from odyssey_megatron.hooks.stage_step import stage_forward
from odyssey_megatron.hooks.weight_grad import WeightGradStore, split_linear_backward

_KEY = "profile"
"""The one micro-batch key the split backward holds its weight GEMMs under."""


@dataclass(frozen=True)
class BlockBytes:
    param_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    """Adam's state for the block's parameters, as the runtime's optimizer keeps it."""


@dataclass(frozen=True)
class StageMeasurement:
    """Medians over the timed passes of one micro-batch through one stage."""

    forward_s: float
    backward_s: float
    """The coupled backward (input and weight gradients together)."""
    input_grad_s: float
    """The split backward's input-gradient half."""
    weight_grad_s: float
    """The split backward's weight-gradient half (the W op)."""
    activation_bytes: int
    blocks: dict[Block, BlockBytes]
    """Bytes of every block the stage holds."""
    optimizer_s: float
    """One optimizer step over the stage's parameters."""


def measure_stages(
    model: ModelConfig,
    stages: Sequence[StageSpec],
    *,
    pg_collection: ProcessGroupCollection,
    accelerator: Accelerator,
    device: torch.device,
    micro_batch_size: int,
    seed: int,
    repeats: int,
    warmup: int,
) -> list[StageMeasurement]:
    """Build each of ``stages`` on ``device`` and measure it; ``pg_collection`` holds
    singleton groups. The stages' passes alternate, so a drift in the machine's speed
    (another process, the clock frequency) shifts them alike and their differences hold."""
    benches = [_StageBench(model, stage, pg_collection=pg_collection, accelerator=accelerator, device=device,
                           micro_batch_size=micro_batch_size, seed=seed) for stage in stages]
    activation_bytes = [bench.activation_bytes() for bench in benches]
    coupled = _interleaved(benches, repeats=repeats, warmup=warmup)
    blocks = [bench.block_bytes() for bench in benches]
    optimizer_s = [bench.optimizer_s(repeats=repeats, warmup=warmup) for bench in benches]
    for bench in benches:
        bench.split_backward()
    split = _interleaved(benches, repeats=repeats, warmup=warmup)
    return [
        StageMeasurement(forward_s=f, backward_s=b, input_grad_s=b_input, weight_grad_s=w, activation_bytes=a,
                         blocks=held, optimizer_s=adam)
        for (f, b, _), (_, b_input, w), a, held, adam in zip(coupled, split, activation_bytes, blocks, optimizer_s)
    ]


def _interleaved(benches: list["_StageBench"], *, repeats: int, warmup: int) -> list[tuple[float, float, float]]:
    """Per bench, the medians of (forward, backward or its input half, weight half)."""
    for _ in range(warmup):
        for bench in benches:
            bench.timed_pass()
    passes = [[] for _ in benches]
    for _ in range(repeats):
        for bench, kept in zip(benches, passes):
            kept.append(bench.timed_pass())
    return [tuple(statistics.median(column) for column in zip(*kept)) for kept in passes]


class _StageBench:
    """One stage model and one micro-batch for it, run as the executor runs its ops."""

    def __init__(self, model: ModelConfig, stage: StageSpec, *, pg_collection: ProcessGroupCollection,
                 accelerator: Accelerator, device: torch.device, micro_batch_size: int, seed: int):
        self.stage, self.accelerator, self.device = stage, accelerator, device
        self.gpt = build_stage_model(model, stage, pg_collection=pg_collection, seed=seed).to(device)
        self.config = self.gpt.config
        tokens = SyntheticTokens(model.vocab_size, model.seq_length, micro_batch_size, seed=seed)
        self.batch = {name: tensor.to(device) for name, tensor in tokens.micro_batch(0, 0).items()}
        self.shape = (model.seq_length, micro_batch_size, model.hidden_size)
        self.output_grad = None if stage.last else torch.randn(self.shape, dtype=self.config.params_dtype,
                                                                device=device)
        self.step = partial(stage_forward, first=stage.first, last=stage.last)
        self.weight_grads: WeightGradStore | None = None

    def fresh_input(self) -> torch.Tensor | None:
        """A received activation (middle and last stages), a leaf that wants its gradient."""
        if self.stage.first:
            return None
        return torch.randn(self.shape, dtype=self.config.params_dtype, device=self.device).requires_grad_()

    def forward(self, input_tensor: torch.Tensor | None) -> torch.Tensor:
        reads = iter([self.batch]) if self.stage.first or self.stage.last else None
        output, _ = forward_step(self.step, reads, self.gpt, 1, input_tensor, [], self.config, cp_group_size=1,
                                 is_last_stage=self.stage.last)
        return output

    def backward(self, input_tensor: torch.Tensor | None, output: torch.Tensor) -> None:
        backward_step(input_tensor, output, self.output_grad, ModelType.encoder_or_decoder, self.config)

    def timed_pass(self) -> tuple[float, float, float]:
        """(forward, backward or its input half, weight half) seconds of one micro-batch."""
        input_tensor, out = self.fresh_input(), []
        forward_s = self.accelerator.time(lambda: out.append(self.forward(input_tensor)))
        if self.weight_grads is None:
            return forward_s, self.accelerator.time(lambda: self.backward(input_tensor, out[0])), 0.0
        with self.weight_grads.deferring(_KEY):
            input_grad_s = self.accelerator.time(lambda: self.backward(input_tensor, out[0]))
        return forward_s, input_grad_s, self.accelerator.time(lambda: self.weight_grads.run(_KEY))

    def split_backward(self) -> None:
        """From now on backwards leave their weight GEMMs to a W op (``hooks.weight_grad``)."""
        self.weight_grads = split_linear_backward(self.gpt)

    def activation_bytes(self) -> int:
        """Bytes one micro-batch keeps from its forward to its backward: storages autograd
        saves (each once, parameters excluded) and the stage's input and output."""
        parameters = {p.untyped_storage().data_ptr() for p in self.gpt.parameters()}
        kept: dict[int, int] = {}

        def keep(tensor: torch.Tensor) -> torch.Tensor:
            storage = tensor.untyped_storage()
            if storage.data_ptr() not in parameters:
                kept[storage.data_ptr()] = storage.nbytes()
            return tensor

        input_tensor = self.fresh_input()
        with torch.autograd.graph.saved_tensors_hooks(keep, lambda tensor: tensor):
            output = self.forward(input_tensor)
        for tensor in (input_tensor, output):
            if tensor is not None:
                keep(tensor)
        self.backward(input_tensor, output)
        return sum(kept.values())

    def optimizer_s(self, *, repeats: int, warmup: int) -> float:
        """Median seconds of an optimizer step on the gradients the timed backwards left:
        the local square of the gradient norm, then Adam."""
        params = list(self.gpt.parameters())
        optimizer = torch.optim.Adam(params)

        def step() -> None:
            square = sum(p.grad.double().pow(2).sum() for p in params if p.grad is not None)
            float(square)
            optimizer.step()

        for _ in range(warmup):
            step()
        return statistics.median(self.accelerator.time(step) for _ in range(repeats))

    def block_bytes(self) -> dict[Block, BlockBytes]:
        """Parameter, gradient and Adam state bytes per block, after one optimizer step on
        the gradients the timed backwards left."""
        optimizer = torch.optim.Adam(self.gpt.parameters())
        optimizer.step()
        sizes = {}
        for block, params in parameters_by_block(self.gpt, self.stage).items():
            sizes[block] = BlockBytes(
                param_bytes=sum(p.numel() * p.element_size() for p in params),
                grad_bytes=sum(p.grad.numel() * p.grad.element_size() for p in params if p.grad is not None),
                optimizer_bytes=sum(state.numel() * state.element_size() for p in params
                                    for state in optimizer.state[p].values() if isinstance(state, torch.Tensor)),
            )
        return sizes
