"""One training step as a live worker takes it, commit included: shared by the worker
(``runtime.rank.training_loop``) and the benchmark that times it (``benchmarks/executor_overhead.py``),
so what is timed is what trains.

``train_step`` runs the runner's forward and backward over the loaded micro-batches
(recording which samples each held), then ``finish_step`` with ``commit``: once this
rank's gradients are final (synced and clipped) and before its optimizer step is applied.
``commit_step`` is that commit (``runtime.rank.node_ledger``): the rank's ``StepReport``
(its losses, samples, the step's learning rate and its op times since the last step, from
the op timers) is reported and the rank counts into the step with its node's ranks, waits
for the decision, and returns the step's outcome. A wait that runs out (``AfterStall``) is
reported as a stall, which the controller blames on the rank late to count in
(``runtime.control.blame``), and the rank then waits for the decision the controller makes
as it ends the generation: it takes the step where the late rank counted in first, as every
other rank does, and leaves without it otherwise, so a step is never applied by some ranks
and not by others.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.distributed as dist

from odyssey_megatron.runtime.protocol.messages import StepReport
from odyssey_megatron.runtime.rank import op_timers as timed
from odyssey_megatron.runtime.rank.op_timers import OpTimers
from odyssey_megatron.runtime.rank.plan_runner import PlanRunner
from odyssey_megatron.runtime.rank.node_ledger import NodeLedger
from odyssey_megatron.runtime.step_ledger import Outcome, StepStore

__all__ = ["AfterStall", "commit_step", "train_step"]

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


@dataclass(frozen=True)
class AfterStall:
    """What a rank does when its wait for a step's decision runs out (``commit_step``)."""

    report: Callable[[str], None]
    """Tell the controller, with where the rank is (``ControllerLink.report_stall``): it
    blames the rank behind and ends the generation, deciding the step."""
    reconnect: Callable[[], StepStore]
    """A fresh connection to the controller's store (the wait that ran out leaves its late
    answer to be read by the next request on the old one)."""
    timeout: datetime.timedelta
    """How long the controller's decision is then waited for (the recovery timeout)."""


def commit_step(*, ledger: NodeLedger, rank: int, step: int, losses: dict[int, float],
                samples: dict[int, list[int]], lr: float, op_timers: OpTimers | None,
                timeout: datetime.timedelta, after_stall: Optional[AfterStall] = None) -> Outcome:
    """Report ``step`` (taken at learning rate ``lr``) for launch rank ``rank`` and count in,
    with its node's ranks (``ledger``, whose waits last at most ``timeout``); return the
    step's outcome, once it is decided. Where no decision came within ``timeout``: with
    ``after_stall``, report the stall and return the controller's decision; without it,
    ``DistStoreError``."""
    order = sorted(losses)
    times = op_timers.take() if op_timers is not None else dict.fromkeys(timed.TIMED, (0.0, 0))
    report = StepReport(rank, tuple(order), tuple(losses[m] for m in order),
                        tuple(i for m in order for i in samples[m]), *times[timed.FORWARD],
                        *times[timed.BACKWARD], *times[timed.WEIGHT_GRAD], times[timed.OPTIMIZER][0], lr)
    if op_timers is not None:
        op_timers.counting_in()
    try:
        outcome = ledger.count_in(step, report.to_json() + "\n", timeout=timeout)
        return outcome if outcome is not None else ledger.wait_decided(step, timeout=timeout)
    except dist.DistStoreError:  # a wait that ran out (a closed connection is another error)
        if after_stall is None:
            raise
    after_stall.report(f"step {step} not decided within the collective timeout ({timeout.total_seconds():g} s): "
                       "a rank has not counted in")
    return ledger.decided_after_stall(step, after_stall.reconnect(), timeout=after_stall.timeout)
