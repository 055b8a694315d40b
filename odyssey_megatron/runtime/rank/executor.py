"""Run one worker's op list for one training step on Megatron-Core.

Each op is Megatron's ``forward_step`` or ``backward_step`` on this rank's stage model.
Activations and their gradients travel point-to-point between *global* ranks: the
executor of (pipeline, stage - 1, micro-batch) may sit in another pipeline (a rerouting
peer), so the partner of every message is looked up in the plan, never derived from a
fixed pipeline group. Sends are asynchronous and receives block, which is deadlock-free
for op lists the estimator produced (it checked them). TP rank k talks to TP rank k.

A worker whose op list has W ops (split backwards, ``estimator.decoupled``) runs its
backwards with the weight GEMMs held back (``hooks.weight_grad``) and the W op of a
micro-batch computes them later, where the estimator put it.

After a staggered optimizer step (``runtime.rank.staggered_step``) the next step runs on
speculative weights until the step settles, so the executor settles it at the op list's
settle point (``ops.settle_point``): before the first gradient is written or the first
result leaves the rank. If the step was retaken, the forwards run so far are run again
on the retaken weights, from the inputs they had; nothing else has to be undone.
"""

from __future__ import annotations

import itertools
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from functools import partial
from typing import Callable

import torch
import torch.distributed as dist
from megatron.core.enums import ModelType
from megatron.core.pipeline_parallel.schedules import backward_step, forward_step

from odyssey_megatron.hooks.op_clock import OpClock
from odyssey_megatron.hooks.process_groups import RankMap
from odyssey_megatron.hooks.stage_step import MicroBatch, stage_forward
from odyssey_megatron.hooks.weight_grad import WeightGradStore
from odyssey_megatron.plan import ExecutionPlan
from odyssey_megatron.runtime.rank.op_timers import WEIGHT_GRAD as WEIGHT_GRAD_TIMER
from odyssey_megatron.schedules.ops import FORWARD, WEIGHT_GRAD, Op, settle_point

@contextmanager
def _megatron_timer(config, name: str):
    """Megatron's timer hook (``config.timers``), called as its schedules call it, around
    an op Megatron does not run itself."""
    if config.timers is None:
        yield
        return
    config.timers(name).start()
    yield
    config.timers(name).stop()


@dataclass
class StepExecutor:
    """Executes op lists of one rank; one instance per plan generation."""

    plan: ExecutionPlan
    ranks: RankMap
    tp_rank: int
    model: torch.nn.Module
    activation_shape: tuple[int, int, int]
    """[seq_length, micro_batch_size, hidden_size], Megatron's sequence-first layout."""
    dtype: torch.dtype
    device: torch.device
    ops: list[Op]
    """This worker's op list, in the order the estimator ran it."""
    weight_grads: WeightGradStore | None = None
    """Where the model's split backwards leave their weight GEMMs; needed when ``ops`` has W ops."""
    clock: OpClock = field(default_factory=OpClock)
    """Real time, or device-time emulation (``runtime.rank.emulation``)."""
    _step: itertools.count = field(default_factory=itertools.count)

    def _rank(self, pipeline: int, stage: int, micro_batch: int) -> int:
        return self.ranks.rank(self.plan.executor(pipeline, stage, micro_batch), self.tp_rank)

    def _tag(self, step: int, micro_batch: int, kind: str) -> int:
        return ((step % 4) * self.plan.num_micro_batches + micro_batch) * 2 + (kind == FORWARD)

    def run(self, *, batches: Callable[[int], MicroBatch], settle: Callable[[], bool] | None = None
            ) -> dict[int, float]:
        """Run one step of the op list; returns the loss of each micro-batch whose last stage ran here.

        ``batches(micro_batch_id)`` gives that global micro-batch's data; only first and
        last stages read it. ``settle``, when the last optimizer step is still
        speculative, settles it at the settle point and says whether it was retaken.
        """
        step = next(self._step)
        config = self.model.config
        stages = [p.num_stages for p in self.plan.pipelines]
        total = self.plan.num_micro_batches
        saved: dict[tuple[int, int], tuple[torch.Tensor | None, torch.Tensor]] = {}
        sends: list[tuple[dist.Work, torch.Tensor]] = []
        losses: dict[int, float] = {}
        settle_at = len(self.ops) if settle is None else settle_point(self.ops, stages)

        def send(tensor: torch.Tensor, dst: int, tag: int) -> None:
            tensor = tensor.detach().contiguous()
            sends.append((dist.isend(tensor, dst, tag=tag), tensor))
            sends.extend(self.clock.sent(dst, tag))

        def receive(src: int, tag: int) -> torch.Tensor:
            buffer = torch.empty(self.activation_shape, dtype=self.dtype, device=self.device, requires_grad=True)
            with torch.no_grad(), self.clock.receiving(src, tag):
                dist.recv(buffer, src, tag=tag)
            return buffer

        def forward(op: Op, input_tensor: torch.Tensor | None) -> torch.Tensor:
            first, last = op.stage == 0, op.stage == stages[op.pipeline] - 1
            store: list[dict[str, torch.Tensor]] = []
            with self.clock.compute(op):
                output, _ = forward_step(
                    partial(stage_forward, first=first, last=last),
                    iter([batches(op.micro_batch)]) if first or last else None, self.model, total, input_tensor, store,
                    config, cp_group_size=1, is_last_stage=last,
                )
            if last:
                losses[op.micro_batch] = float(store[0]["lm loss"])
            saved[op.pipeline, op.micro_batch] = (input_tensor, output)
            return output

        def settle_and_rerun(forwards: list[Op]) -> None:
            retaken = settle()
            self.clock.resume()
            if retaken:
                for op in forwards:
                    forward(op, saved[op.pipeline, op.micro_batch][0])

        self.clock.resume()
        for index, op in enumerate(self.ops):
            first, last = op.stage == 0, op.stage == stages[op.pipeline] - 1
            if index == settle_at and op.kind != FORWARD:
                settle_and_rerun(self.ops[:index])
            if op.kind == FORWARD:
                input_tensor = None if first else receive(
                    self._rank(op.pipeline, op.stage - 1, op.micro_batch), self._tag(step, op.micro_batch, FORWARD)
                )
                output = forward(op, input_tensor)
                if index == settle_at:
                    settle_and_rerun(self.ops[:index + 1])
                    output = saved[op.pipeline, op.micro_batch][1]
                if not last:
                    send(output, self._rank(op.pipeline, op.stage + 1, op.micro_batch),
                         self._tag(step, op.micro_batch, FORWARD))
            elif op.kind == WEIGHT_GRAD:
                with self.clock.compute(op), _megatron_timer(config, WEIGHT_GRAD_TIMER):
                    self.weight_grads.run((op.pipeline, op.micro_batch))
            else:
                input_tensor, output = saved.pop((op.pipeline, op.micro_batch))
                grad = None if last else receive(
                    self._rank(op.pipeline, op.stage + 1, op.micro_batch), self._tag(step, op.micro_batch, "B")
                )
                split = nullcontext() if self.weight_grads is None else self.weight_grads.deferring(
                    (op.pipeline, op.micro_batch))
                with split, self.clock.compute(op):
                    input_grad = backward_step(input_tensor, output, grad, ModelType.encoder_or_decoder, config)
                if not first:
                    send(input_grad, self._rank(op.pipeline, op.stage - 1, op.micro_batch),
                         self._tag(step, op.micro_batch, "B"))
        for work, _ in sends:
            work.wait()
        unfinished = 0 if self.weight_grads is None else self.weight_grads.held
        if saved or unfinished:
            raise RuntimeError(f"op list left {len(saved)} forwards without a backward and "
                               f"{unfinished} backwards without their weight gradients")
        return losses
