"""Split a backward into its input-gradient and weight-gradient halves (Decoupled BackProp).

A worker hands the input gradient to the previous stage as soon as it has it and
computes the weight gradients later, in a bubble (``estimator.decoupled`` decides when);
a rerouting peer, doing two stages' work, gains most.
Megatron-Core's linear layers compute both halves in one autograd function, and its own
``delay_wgrad_compute`` exists only for Transformer Engine layers, so ``split_linear_backward``
gives every Column- and RowParallelLinear of a stage model a linear function whose
backward computes only the input gradient and keeps (input, output gradient) for the
weight GEMM, under the micro-batch that ``WeightGradStore.deferring`` names. ``run`` does
those GEMMs and accumulates them through autograd, so gradient hooks (the overlapped DP
sync) fire once per micro-batch, as after a coupled backward. The weight GEMM is the
same product Megatron computes, so the gradients are the same; only when they are
computed changes. Only a worker whose op list has W ops splits its model.

Norms and embeddings keep their gradients in the input-gradient half (they are cheap);
the output layer on a stage with tied embeddings does too, as autograd sums the tied
weight's two uses into one accumulation the DP sync counts on.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from typing import Iterator

import torch
import torch.distributed as dist
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear


@dataclass
class _WeightGEMM:
    weight: torch.nn.Parameter
    input: torch.Tensor
    grad_output: torch.Tensor

    def compute(self) -> torch.Tensor:
        grad_output = self.grad_output.reshape(-1, self.grad_output.size(-1))
        return grad_output.t().matmul(self.input.reshape(-1, self.input.size(-1)))


@dataclass
class WeightGradStore:
    """Weight GEMMs held back by backwards run under ``deferring``, per micro-batch."""

    _open: list[_WeightGEMM] | None = None
    _held: dict[object, list[_WeightGEMM]] = field(default_factory=dict)

    @contextmanager
    def deferring(self, key: object) -> Iterator[None]:
        """Backwards inside hold their linear layers' weight GEMMs under ``key``."""
        if self._open is not None:
            raise RuntimeError("weight gradients are already being deferred")
        self._open = []
        try:
            yield
            self._held[key] = self._open
        finally:
            self._open = None

    def hold(self, gemm: _WeightGEMM) -> None:
        if self._open is None:
            raise RuntimeError("a split backward ran outside WeightGradStore.deferring")
        self._open.append(gemm)

    def run(self, key: object) -> None:
        """The weight gradients held under ``key``, accumulated into ``.grad``."""
        gemms = self._held.pop(key)
        if gemms:
            torch.autograd.backward([g.weight for g in gemms], [g.compute() for g in gemms])

    @property
    def held(self) -> int:
        """Micro-batches whose weight gradients are still to run."""
        return len(self._held)


class _LinearWithDeferredWeightGrad(torch.autograd.Function):
    """Megatron's linear (no sequence parallelism, no fused accumulation): y = x W^T, with
    the input gradient all-reduced over TP when Megatron would (``allreduce_dgrad``). The
    weight comes in detached, so autograd neither computes nor accumulates its gradient:
    the backward holds the GEMM for ``module.weight`` instead."""

    @staticmethod
    def forward(ctx, input, detached_weight, module, allreduce_dgrad, tp_group, store):
        ctx.save_for_backward(input, detached_weight)
        ctx.module, ctx.allreduce_dgrad, ctx.tp_group, ctx.store = module, allreduce_dgrad, tp_group, store
        return torch.matmul(input, detached_weight.t())

    @staticmethod
    def backward(ctx, grad_output):
        input, weight = ctx.saved_tensors
        grad_input = grad_output.contiguous().matmul(weight)  # as Megatron's sees it: bitwise-equal results
        if ctx.allreduce_dgrad:
            dist.all_reduce(grad_input, group=ctx.tp_group)
        ctx.store.hold(_WeightGEMM(ctx.module.weight, input, grad_output))
        return grad_input, None, None, None, None, None


def _deferred_linear(module, store: WeightGradStore, *, input, weight, bias, allreduce_dgrad, tp_group, **kwargs):
    """Replaces ``module._forward_impl``; Megatron calls it with keywords only."""
    if weight is not module.weight or not weight.requires_grad:  # a tied output layer, or frozen
        return type(module)._forward_impl(module, input=input, weight=weight, bias=bias,
                                          allreduce_dgrad=allreduce_dgrad, tp_group=tp_group, **kwargs)
    output = _LinearWithDeferredWeightGrad.apply(input, weight.detach(), module, allreduce_dgrad, tp_group, store)
    return output if bias is None else output + bias


def split_linear_backward(model: torch.nn.Module) -> WeightGradStore:
    """From now on ``model``'s linear layers leave their weight GEMMs to the returned
    store: every backward must run inside its ``deferring``, and ``run`` computes them."""
    config = model.config
    if config.sequence_parallel or config.gradient_accumulation_fusion:
        raise ValueError("odyssey.decoupled_weight_grads needs sequence_parallel and gradient_accumulation_fusion "
                         "off in the model config")
    store = WeightGradStore()
    for module in model.modules():
        if isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
            module._forward_impl = partial(_deferred_linear, module, store)
    return store
