"""Stragglers: ranks that stay alive and beat but compute slower than their peers.

A slow rank (a throttled or failing device, a noisy neighbour) holds up every step of a
synchronous job without failing any heartbeat. Each committed step's ``StepReport``s
carry the seconds every rank's forwards, backwards and weight gradients took
(``runtime.rank.op_timers``). Set against what the profile predicts for the same ops on
the rank's stage (``ModelProfile.stage_times``), they give each rank's seconds per
predicted second; a rank's slowdown is that over the median of its peers': the other
workers whose stage has the same layers (its DP peers), or every other worker where its
stage has none (a pipeline without replicas), so a stage that is heavier than the profile
says is not taken for slow. A rank slower than ``threshold`` for ``steps`` committed steps
in a row is a straggler, found once until it is fast again.

What the run does with one (``odyssey.straggler``) is the owner's (``training_run``):
report it, or have it failed like any failure where the decision center says removing it
pays (``DecisionCenter.on_straggler``).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Iterable

from odyssey_megatron.plan import ExecutionPlan
from odyssey_megatron.profile import ModelProfile
from odyssey_megatron.runtime.protocol.messages import StepReport

__all__ = ["Straggler", "StragglerWatch", "straggler_line"]


@dataclass(frozen=True)
class Straggler:
    rank: int
    slowdown: float
    """Its seconds per predicted second over its peers' median, averaged over ``steps``."""
    first_step: int
    last_step: int
    """The committed steps it was slow in, in a row."""

    @property
    def detail(self) -> str:
        return (f"its ops took {self.slowdown:.2f}x its peers' time for {self.last_step - self.first_step + 1} "
                f"committed steps ({self.first_step}..{self.last_step})")


def straggler_line(straggler: Straggler, *, removed: bool, why: str = "odyssey.straggler=report") -> str:
    """The console's line for a straggler found: removed or training on, and ``why``."""
    then = "removed" if removed else "it trains on"
    return f"straggler: rank {straggler.rank}: {straggler.detail}; {then} ({why})"


class StragglerWatch:
    """Measures every committed step (not a generation's first: it allocates) with
    ``observe``; ``profile`` predicts each stage's op times (the starting profile: only
    ratios between ranks matter)."""

    threshold: float
    steps: int

    def __init__(self, profile: ModelProfile, *, threshold: float, steps: int):
        self.profile, self.threshold, self.steps = profile, threshold, steps
        self._slow: dict[int, list[tuple[int, float]]] = {}
        """Rank -> (step, slowdown) of the committed steps in a row it has been slow in."""
        self._found: set[int] = set()
        """Ranks found stragglers that have not been fast since."""

    def observe(self, plan: ExecutionPlan, step: int, reports: Iterable[StepReport]) -> list[Straggler]:
        """Fold committed ``step`` of ``plan`` in; the ranks newly found stragglers."""
        slowdowns = self.slowdowns(plan, reports)
        found = []
        for rank in list(self._slow):
            if rank not in slowdowns:
                del self._slow[rank]
        for rank, slowdown in slowdowns.items():
            if slowdown <= self.threshold:
                self._slow.pop(rank, None)
                self._found.discard(rank)
                continue
            run = self._slow.setdefault(rank, [])
            run.append((step, slowdown))
            del run[:-self.steps]
            if len(run) == self.steps and rank not in self._found:
                self._found.add(rank)
                found.append(Straggler(rank, statistics.fmean(s for _, s in run), run[0][0], run[-1][0]))
        return found

    def again(self, rank: int) -> None:
        """Watch ``rank`` afresh: found again once slow for ``steps`` more steps in a row
        (one found while its removal could not be priced)."""
        self._slow.pop(rank, None)
        self._found.discard(rank)

    def slowdowns(self, plan: ExecutionPlan, reports: Iterable[StepReport]) -> dict[int, float]:
        """Each training rank's seconds per predicted second over its peers' median."""
        stages = {stage.worker: (pi, si, stage) for pi, si, stage in plan.stage_positions()
                  if stage.worker is not None}
        ratios: dict[int, tuple[int, tuple, float]] = {}  # rank -> (worker, stage shape, ratio)
        for report in reports:
            worker = report.rank // plan.tensor_parallel_size
            if worker not in stages:
                continue
            pi, si, stage = stages[worker]
            shape = (*stage.layers, si == 0, si == plan.pipelines[pi].num_stages - 1)
            times = self.profile.stage_times(*stage.layers, first=shape[2], last=shape[3])
            predicted = report.forwards * times.forward_s + report.backwards * times.backward_s
            measured = report.forward_s + report.backward_s + report.weight_grad_s
            if predicted > 0 and measured > 0:
                ratios[report.rank] = (worker, shape, measured / predicted)
        slowdowns = {}
        for rank, (worker, shape, ratio) in ratios.items():
            others = [(s, r) for w, s, r in ratios.values() if w != worker]
            peers = [r for s, r in others if s == shape] or [r for _, r in others]
            if peers:
                slowdowns[rank] = ratio / statistics.median(peers)
        return slowdowns
