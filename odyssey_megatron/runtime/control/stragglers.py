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
pays (``DecisionCenter.on_straggler``). One it priced and kept (``kept``) is offered for
pricing again while still slow: once its slowdown has grown by ``REPRICE_SLOWDOWN_GROWTH``
over the one it was priced at, once a new plan (a recovery's or a join's) runs, and once
the decision center prices with a rescaled profile (``profile_rescaled``: both prices
move). A rank fast again, or out of the plan, is forgotten.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, replace
from typing import Iterable

from odyssey_megatron.plan import ExecutionPlan
from odyssey_megatron.profile import ModelProfile
from odyssey_megatron.runtime.control.online_profile import REPRICE_CHANGE
from odyssey_megatron.runtime.protocol.messages import StepReport

__all__ = ["REPRICE_SLOWDOWN_GROWTH", "Straggler", "StragglerWatch", "straggler_line"]

REPRICE_SLOWDOWN_GROWTH = 2 * REPRICE_CHANGE
"""Relative growth of a kept straggler's slowdown (averaged over ``straggler_steps``) over
the one it was priced at that has it priced again: 1.5x is priced again from 1.8x. A
slowdown is the ratio of two measured times (its own and its peers' median), so its noise is
about twice that of one online-profile factor, which re-prices at ``REPRICE_CHANGE``."""


def _slower(slowdown: float, priced: float) -> bool:
    """Whether a kept straggler at ``slowdown`` is priced again for having slowed since ``priced``."""
    return slowdown > priced * (1 + REPRICE_SLOWDOWN_GROWTH)


@dataclass(frozen=True)
class Straggler:
    rank: int
    slowdown: float
    """Its seconds per predicted second over its peers' median, averaged over ``steps``."""
    first_step: int
    last_step: int
    """The committed steps it was slow in, in a row."""
    priced_slowdown: float | None = None
    priced_generation: int | None = None
    """Where it was priced and kept before: the slowdown it was priced at, in which generation."""
    priced_again_because: str | None = None
    """Why it is offered for pricing again: slower since, a new plan, or a rescaled profile."""

    @property
    def detail(self) -> str:
        return (f"its ops took {self.slowdown:.2f}x its peers' time for {self.last_step - self.first_step + 1} "
                f"committed steps ({self.first_step}..{self.last_step})")

    @property
    def repriced(self) -> str | None:
        """Why it is priced again (None the first time)."""
        if self.priced_slowdown is None:
            return None
        return (f"priced again: kept at {self.priced_slowdown:.2f}x in generation {self.priced_generation}, "
                f"{self.priced_again_because}")


def straggler_line(straggler: Straggler, *, removed: bool, why: str = "odyssey.straggler=report") -> str:
    """The console's line for a straggler found or priced again: removed or training on,
    and ``why``."""
    then = "removed" if removed else "it trains on"
    again = f"; {straggler.repriced}" if straggler.repriced else ""
    return f"straggler: rank {straggler.rank}: {straggler.detail}{again}; {then} ({why})"


class StragglerWatch:
    """Measures every committed step (not a generation's first: it allocates) with
    ``observe``; ``profile`` predicts each stage's op times (the starting profile: only
    ratios between ranks matter). Call ``kept`` for each straggler priced and kept."""

    threshold: float
    steps: int

    def __init__(self, profile: ModelProfile, *, threshold: float, steps: int):
        self.profile, self.threshold, self.steps = profile, threshold, steps
        self._slow: dict[int, list[tuple[int, float]]] = {}
        """Rank -> (step, slowdown) of the committed steps in a row it has been slow in."""
        self._found: set[int] = set()
        """Ranks found stragglers that have not been fast since."""
        self._kept: dict[int, tuple[float, int, int]] = {}
        """Rank -> (slowdown, generation, profile) it was last priced and kept at."""
        self._profile = 0
        """How many times the decision center's profile was rescaled (``profile_rescaled``)."""

    def observe(self, plan: ExecutionPlan, step: int, reports: Iterable[StepReport]) -> list[Straggler]:
        """Fold committed ``step`` of ``plan`` in; the ranks newly found stragglers, and the
        kept ones to price again (slower by ``REPRICE_SLOWDOWN_GROWTH``, or under a new plan)."""
        slowdowns = self.slowdowns(plan, reports)
        found = []
        for rank in set(self._slow) | self._found:
            if rank not in slowdowns:
                self.again(rank)
        for rank, slowdown in slowdowns.items():
            if slowdown <= self.threshold:
                self.again(rank)
                continue
            run = self._slow.setdefault(rank, [])
            run.append((step, slowdown))
            del run[:-self.steps]
            if len(run) < self.steps:
                continue
            straggler = Straggler(rank, statistics.fmean(s for _, s in run), run[0][0], run[-1][0])
            if rank not in self._found:
                self._found.add(rank)
                found.append(straggler)
            elif rank in self._kept:
                priced, generation, profile = self._kept[rank]
                because = ("slower since" if _slower(straggler.slowdown, priced) else
                           "a new plan runs" if plan.generation != generation else
                           "the profile was rescaled" if profile != self._profile else None)
                if because is not None:
                    del self._kept[rank]  # until priced and kept again
                    found.append(replace(straggler, priced_slowdown=priced, priced_generation=generation,
                                         priced_again_because=because))
        return found

    def kept(self, straggler: Straggler, *, generation: int) -> None:
        """``straggler`` was priced and kept in ``generation``: priced again once slower by
        ``REPRICE_SLOWDOWN_GROWTH``, under another plan, or with a rescaled profile."""
        self._kept[straggler.rank] = (straggler.slowdown, generation, self._profile)

    def profile_rescaled(self) -> None:
        """The decision center prices with a rescaled profile (``online_profile``): each kept
        straggler's prices have moved, so it is offered for pricing again at its next slow step."""
        self._profile += 1

    def again(self, rank: int) -> None:
        """Watch ``rank`` afresh: found again once slow for ``steps`` more steps in a row
        (one fast again, out of the plan, or found while its removal could not be priced)."""
        self._slow.pop(rank, None)
        self._found.discard(rank)
        self._kept.pop(rank, None)

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
