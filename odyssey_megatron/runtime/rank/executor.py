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
        step = _Step(self, next(self._step), batches, settle)
        self.clock.resume()
        for index, op in enumerate(self.ops):
            if index == step.settle_at and op.kind != FORWARD:
                step.settle_and_rerun(self.ops[:index])
            if op.kind == FORWARD:
                step.forward(op, settles=index == step.settle_at, ran=self.ops[:index + 1])
            elif op.kind == WEIGHT_GRAD:
                step.weight_grad(op)
            else:
                step.backward(op)
        if settle is not None and step.settle_at == len(self.ops):  # no op here waits for it
            step.settle_and_rerun([])
        return step.finish()


class _Step:
    """One run of a ``StepExecutor``'s op list: its messages in flight, the forwards waiting
    for their backward, and the losses of the micro-batches whose last stage runs here."""

    def __init__(self, executor: StepExecutor, step: int, batches: Callable[[int], MicroBatch],
                 settle: Callable[[], bool] | None):
        self.executor = executor
        self.step = step
        self.batches = batches
        self.settle = settle
        self.config = executor.model.config
        self.stages = [p.num_stages for p in executor.plan.pipelines]
        self.saved: dict[tuple[int, int], tuple[torch.Tensor | None, torch.Tensor]] = {}
        """Per (pipeline, micro-batch): the forward's input and output, until its backward."""
        self.sends: list[tuple[dist.Work, torch.Tensor]] = []
        self.losses: dict[int, float] = {}
        self.settle_at = len(executor.ops) if settle is None else settle_point(executor.ops, self.stages)
        """Where the speculative optimizer step settles (``ops.settle_point``); past the end: none."""

    def _ends(self, op: Op) -> tuple[bool, bool]:
        """Whether ``op``'s stage is its pipeline's first, and its last."""
        return op.stage == 0, op.stage == self.stages[op.pipeline] - 1

    def _peer(self, op: Op, stage: int) -> int:
        """The rank running ``op``'s micro-batch at ``stage`` of its pipeline."""
        return self.executor._rank(op.pipeline, stage, op.micro_batch)

    def _tag(self, op: Op, kind: str) -> int:
        return self.executor._tag(self.step, op.micro_batch, kind)

    def send(self, tensor: torch.Tensor, dst: int, tag: int) -> None:
        tensor = tensor.detach().contiguous()
        self.sends.append((dist.isend(tensor, dst, tag=tag), tensor))
        self.sends.extend(self.executor.clock.sent(dst, tag))

    def receive(self, src: int, tag: int) -> torch.Tensor:
        ex = self.executor
        buffer = torch.empty(ex.activation_shape, dtype=ex.dtype, device=ex.device, requires_grad=True)
        with torch.no_grad(), ex.clock.receiving(src, tag):
            dist.recv(buffer, src, tag=tag)
        return buffer

    def compute_forward(self, op: Op, input_tensor: torch.Tensor | None) -> torch.Tensor:
        """Megatron's forward step of ``op`` on ``input_tensor``, kept for its backward."""
        ex = self.executor
        first, last = self._ends(op)
        store: list[dict[str, torch.Tensor]] = []
        with ex.clock.compute(op):
            output, _ = forward_step(
                partial(stage_forward, first=first, last=last),
                iter([self.batches(op.micro_batch)]) if first or last else None, ex.model,
                ex.plan.num_micro_batches, input_tensor, store, self.config, cp_group_size=1, is_last_stage=last,
            )
        if last:
            self.losses[op.micro_batch] = float(store[0]["lm loss"])
        self.saved[op.pipeline, op.micro_batch] = (input_tensor, output)
        return output

    def settle_and_rerun(self, forwards: list[Op]) -> None:
        """Settle the speculative optimizer step; if it was retaken, run ``forwards`` again
        from the inputs they had."""
        retaken = self.settle()
        self.executor.clock.resume()
        if retaken:
            for op in forwards:
                self.compute_forward(op, self.saved[op.pipeline, op.micro_batch][0])

    def forward(self, op: Op, *, settles: bool, ran: list[Op]) -> None:
        """A forward op: receive its input (but on a first stage), compute, and send the output
        on (but from a last stage); where it ``settles`` the step, the forwards that ``ran``
        so far, itself included, are settled first and its output is the settled one."""
        first, last = self._ends(op)
        input_tensor = None if first else self.receive(self._peer(op, op.stage - 1), self._tag(op, FORWARD))
        output = self.compute_forward(op, input_tensor)
        if settles:
            self.settle_and_rerun(ran)
            output = self.saved[op.pipeline, op.micro_batch][1]
        if not last:
            self.send(output, self._peer(op, op.stage + 1), self._tag(op, FORWARD))

    def weight_grad(self, op: Op) -> None:
        """A W op: the weight GEMMs its micro-batch's split backward held back."""
        ex = self.executor
        with ex.clock.compute(op), _megatron_timer(self.config, WEIGHT_GRAD_TIMER):
            ex.weight_grads.run((op.pipeline, op.micro_batch))

    def backward(self, op: Op) -> None:
        """A backward op: receive the output gradient (but on a last stage), compute (its
        weight GEMMs held back where backwards are split), and send the input gradient back
        (but from a first stage)."""
        ex = self.executor
        first, last = self._ends(op)
        input_tensor, output = self.saved.pop((op.pipeline, op.micro_batch))
        grad = None if last else self.receive(self._peer(op, op.stage + 1), self._tag(op, "B"))
        split = nullcontext() if ex.weight_grads is None else ex.weight_grads.deferring((op.pipeline, op.micro_batch))
        with split, ex.clock.compute(op):
            input_grad = backward_step(input_tensor, output, grad, ModelType.encoder_or_decoder, self.config)
        if not first:
            self.send(input_grad, self._peer(op, op.stage - 1), self._tag(op, "B"))

    def finish(self) -> dict[int, float]:
        """Wait for the sends; every forward must have had its backward and every split
        backward its W op."""
        for work, _ in self.sends:
            work.wait()
        weight_grads = self.executor.weight_grads
        unfinished = 0 if weight_grads is None else weight_grads.held
        if self.saved or unfinished:
            raise RuntimeError(f"op list left {len(self.saved)} forwards without a backward and "
                               f"{unfinished} backwards without their weight gradients")
        return self.losses
