"""Optimizer steps that do not wait for the whole world (paper 003's Staggered Optimizer), exactly.

With the global norm all-reduced before every step, no rank starts step i+1 before the
last rank finished step i, so the stages that finish early (the last stages of 1F1B,
the peers that run deferred weight gradients at the end) leave their next warm-up
bubble unused. A stage's step needs only its own, DP-synced gradients; the one thing
that couples stages is global-norm clipping.

So a rank starts the norm's all-reduce asynchronously and steps at once, as if the
step were not clipped. The norm is settled after the rank's next forward and backward,
when every rank has long contributed. If clipping did engage, the step is retaken: the
parameters and optimizer state are restored from a copy taken before it, the kept
gradients are scaled as clipping scales them, the optimizer steps again, and the next
step's forward and backward, which ran on the speculative weights, run again. Every
rank sees the same norm and decides the same, so the schedule stays matched, and the
result equals the unstaggered run bit for bit. Without clipping nothing is copied and
nothing is ever retaken. ReCycle validates after the step the same way (section 4,
"Bypassing Optimizer Synchronizations") but checks overflow only.

The copy (parameters, gradients and optimizer state) lives in host memory.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from odyssey_megatron.hooks.grad_sync import clip_scale


class StaggeredStep:
    """One speculative optimizer step whose global norm is still in flight."""

    def __init__(self, optimizer: torch.optim.Optimizer, square: torch.Tensor, *, max_norm: float,
                 group: dist.ProcessGroup | None):
        """Starts the all-reduce of ``square`` (this rank's ``local_grad_square``) over
        ``group``, copies what a retake needs when clipping is on, and steps."""
        self.optimizer, self.square, self.max_norm = optimizer, square, max_norm
        self.work = dist.all_reduce(square, op=dist.ReduceOp.SUM, group=group, async_op=True)
        self.saved: list[tuple[torch.nn.Parameter, torch.Tensor, torch.Tensor | None, dict]] = []
        if max_norm > 0:
            for param in self._params():
                self.saved.append((
                    param,
                    _to_host(param.detach()),
                    None if param.grad is None else _to_host(param.grad),
                    {key: _to_host(value) if torch.is_tensor(value) else value
                     for key, value in optimizer.state.get(param, {}).items()},
                ))
        optimizer.step()

    def _params(self) -> list[torch.nn.Parameter]:
        return [p for group in self.optimizer.param_groups for p in group["params"]]

    def settle(self) -> tuple[float, bool]:
        """Wait for the global norm: (norm, whether the step had to be retaken clipped).
        After a retake every gradient holds the clipped gradient of the retaken step."""
        self.work.wait()
        norm = float(self.square.sqrt())
        scale = clip_scale(norm, self.max_norm)
        if scale is None:
            return norm, False
        for param, data, grad, state in self.saved:
            with torch.no_grad():
                param.copy_(data)
            param.grad = None if grad is None else grad.to(param.device).mul_(scale)
            if not state:  # the speculative step was this parameter's first
                self.optimizer.state.pop(param, None)
            for key, value in state.items():
                current = self.optimizer.state[param]
                if torch.is_tensor(value):
                    current[key].copy_(value)
                else:
                    current[key] = value
        self.optimizer.step()
        return norm, True


def _to_host(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().to("cpu", copy=True)
