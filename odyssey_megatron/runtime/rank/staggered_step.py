"""Optimizer steps that do not wait for the whole world (paper 003's Staggered Optimizer), exactly.

With the global norm all-reduced before every step, no rank starts step i+1 before the
last rank finished step i, so the stages that finish early (the last stages of 1F1B,
the peers that run deferred weight gradients at the end) leave their next warm-up
bubble unused. A stage's step needs only its own, DP-synced gradients; the one thing
that couples stages is global-norm clipping.

So a rank starts the norm's all-reduce asynchronously and steps at once, as if the
step were not clipped. Its next step runs ahead on the speculative weights up to its
settle point (``schedules.ops.settle_point``): before its first gradient is written or
its first result is sent, it waits for the norm, which by then every rank has nearly
contributed. If clipping did engage, the step is retaken: the parameters and optimizer
state are restored, the kept gradients are scaled as clipping scales them, the
optimizer steps again, and the few forwards the next step ran before its settle point
run again. Every rank sees the same norm and decides the same, and nothing computed on
speculative weights has left any rank, so the result equals the unstaggered run bit for
bit. Without clipping nothing is copied and nothing is ever retaken. ReCycle validates
after the step the same way (section 4, "Bypassing Optimizer Synchronizations") but
checks overflow only, and rolls back by reversing AdamW's arithmetic.

What a retake starts from costs no device memory: the gradients stay where the step
left them, since nothing writes a gradient before the settle point, and the weights and
optimizer state are a host copy taken while the step's forward and backward ran
(``runtime.rank.retake_copy``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from odyssey_megatron.hooks.grad_sync import clip_scale
from odyssey_megatron.hooks.stage_optimizer import StageOptimizer
from odyssey_megatron.runtime.rank.retake_copy import RetakeCopy


class StaggeredStep:
    """One speculative optimizer step whose global norm is still in flight."""

    def __init__(self, optimizer: StageOptimizer, *, group: dist.ProcessGroup | None,
                 retake_copy: RetakeCopy | None):
        """Starts the all-reduce of this rank's share of the squared norm over ``group``,
        keeps the gradients, waits for ``retake_copy`` (the weights and optimizer state
        before this step; None with clipping off, when no step is ever retaken) and steps
        with the gradients unclipped."""
        self.optimizer, self.retake_copy = optimizer, retake_copy
        self.max_norm = optimizer.megatron.config.clip_grad
        self.square = optimizer.local_norm_square()
        self.work = dist.all_reduce(self.square, op=dist.ReduceOp.SUM, group=group, async_op=True)
        self.grads: list[tuple[torch.nn.Parameter, torch.Tensor | None]] = []
        if retake_copy is not None:
            self.grads = [(p, p.grad) for group in optimizer.adam.param_groups for p in group["params"]]
            retake_copy.wait()
        optimizer.step()

    def settle(self, pending: RetakeCopy | None = None) -> tuple[float, bool]:
        """Wait for the global norm: (norm, whether the step had to be retaken clipped).
        A retake leaves ``param.grad`` as it found it (the next step's gradients, if it
        has begun). ``pending``: the next step's retake copy, whose copy of the weights a
        retake must not overwrite before it is done."""
        self.work.wait()
        norm = self.square.item() ** 0.5  # as Megatron's get_grad_norm_fp32
        scale = clip_scale(norm, self.max_norm)
        if scale is not None:
            if pending is not None:
                pending.wait()
            self.retake_copy.restore(self.optimizer.adam)
            current = [param.grad for param, _ in self.grads]
            for param, grad in self.grads:
                param.grad = grad
            self.optimizer.scale_grads(scale)
            self.optimizer.step()
            for (param, _), grad in zip(self.grads, current):
                param.grad = grad
        if self.retake_copy is not None:
            self.retake_copy.release()
            self.grads = []
        return norm, scale is not None
