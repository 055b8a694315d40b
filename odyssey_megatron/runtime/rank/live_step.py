"""One training step as a live worker takes it, commit included: shared by the worker
(``runtime.rank.training_loop``) and the benchmark that times it (``benchmarks/executor_overhead.py``),
so what is timed is what trains.

``train_step`` runs the runner's forward and backward over the loaded micro-batches
(recording which samples each held), then ``finish_step`` with ``commit``: once this
rank's gradients are final (synced and clipped) and before its optimizer step is applied.
``commit_step`` is that commit (``runtime.rank.node_ledger``): the rank's ``StepReport``
(its losses, samples, the step's learning rate and its op times since the last step, from
the op timers) is reported and the rank counts into the step with its node's ranks, waits
for the decision, and returns the step's outcome.
"""

from __future__ import annotations

import datetime
from typing import Callable

import torch

from odyssey_megatron.runtime.protocol.messages import StepReport
from odyssey_megatron.runtime.rank import op_timers as timed
from odyssey_megatron.runtime.rank.op_timers import OpTimers
from odyssey_megatron.runtime.rank.plan_runner import PlanRunner
from odyssey_megatron.runtime.rank.node_ledger import NodeLedger
from odyssey_megatron.runtime.step_ledger import Outcome

__all__ = ["commit_step", "train_step"]

_BATCH_KEYS = ("tokens", "labels", "position_ids")

Commit = Callable[[int, dict[int, float], dict[int, list[int]]], None]
"""``commit(step, losses, samples)``: raises if the step did not commit."""


def train_step(runner: PlanRunner, *, step: int, load: Callable[[int, int], dict[str, torch.Tensor]],
               commit: Commit) -> None:
    """Step ``step``: ``load(step, micro_batch)`` gives a micro-batch with its ``sample_ids``;
    ``commit`` is called with the step's losses and samples once the gradients are final,
    and the optimizer step is applied after it returns."""
    samples: dict[int, list[int]] = {}

    def batch(micro_batch: int) -> dict[str, torch.Tensor]:
        loaded = load(step, micro_batch)
        samples[micro_batch] = loaded["sample_ids"].tolist()
        return {key: loaded[key] for key in _BATCH_KEYS}

    losses = runner.forward_backward(batch)
    runner.finish_step(losses, step=step, commit=lambda: commit(step, losses, samples))


def commit_step(*, ledger: NodeLedger, rank: int, step: int, losses: dict[int, float],
                samples: dict[int, list[int]], lr: float, op_timers: OpTimers | None,
                timeout: datetime.timedelta) -> Outcome:
    """Report ``step`` (taken at learning rate ``lr``) for launch rank ``rank`` and count in,
    with its node's ranks (``ledger``, whose waits last at most ``timeout``); return the
    step's outcome, once it is decided."""
    order = sorted(losses)
    times = op_timers.take() if op_timers is not None else dict.fromkeys(timed.TIMED, (0.0, 0))
    report = StepReport(rank, tuple(order), tuple(losses[m] for m in order),
                        tuple(i for m in order for i in samples[m]), *times[timed.FORWARD],
                        *times[timed.BACKWARD], *times[timed.WEIGHT_GRAD], times[timed.OPTIMIZER][0], lr)
    outcome = ledger.count_in(step, report.to_json() + "\n", timeout=timeout)
    return outcome if outcome is not None else ledger.wait_decided(step, timeout=timeout)
