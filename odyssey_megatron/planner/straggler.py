"""Keep a straggler or remove it: Eq. 8 over the horizon a failure's decision weighs by.

A straggler (``runtime.control.stragglers``: a rank whose ops take some factor of its
peers' time, step after step) can train on or be failed. Kept, the job runs the current
plan with that rank's ops stretched by its measured slowdown (``estimate_plan``'s
``slowdowns``), with no transition. Removed, it runs the plan a failure of that rank
would get (``DecisionCenter.on_failure``'s choice), after that plan's transition (search
while training is paused, moving state, restarting). Both are scored as ``choose`` scores
candidates, over the same horizon, so a rank 1.6x slow on a stage with spare peers is
removed, and one only slightly slow, or whose removal means minutes of reparallelizing
over a short horizon, is kept.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from odyssey_megatron.estimator import PlanEstimate
from odyssey_megatron.plan import ExecutionPlan
from odyssey_megatron.planner.decide import Candidate, Decision, Drafts, choose, kept_draft
from odyssey_megatron.profile import ModelProfile
from odyssey_megatron.settings import SearchSettings

__all__ = ["StragglerDecision", "weigh_straggler"]


@dataclass(frozen=True)
class StragglerDecision:
    rank: int
    slowdown: float
    """Its ops' seconds over its peers' (``Straggler.slowdown``), as priced."""
    kept: Candidate
    """The current plan with the rank at ``slowdown``: no transition."""
    removal: Optional[Decision]
    """What ``on_failure`` would decide without the rank (not committed); None where no
    plan goes on without it (``unrecoverable`` says why)."""
    unrecoverable: str
    horizon_s: float
    """Eq. 8's horizon both were weighed over."""

    @property
    def remove(self) -> bool:
        """Whether removal scores higher by Eq. 8 (a tie keeps the rank: nothing moves)."""
        return self.removal is not None and self.removal.chosen.score > self.kept.score

    @property
    def prices(self) -> dict:
        """Both prices, JSON-ready (the ``straggler`` event's and W&B's fields): seconds per
        step and samples/s kept and removed, the removal's transition seconds and policy,
        each one's Eq. 8 score and the horizon."""
        removed = self.removal.chosen if self.removal is not None else None
        return dict(horizon_s=self.horizon_s,
                    kept_step_s=self.kept.estimate.step_time_s, kept_samples_per_s=self.kept.estimate.samples_per_s,
                    kept_score=self.kept.score,
                    removed_step_s=removed.estimate.step_time_s if removed else None,
                    removed_samples_per_s=removed.estimate.samples_per_s if removed else None,
                    removed_score=removed.score if removed else None,
                    transition_s=removed.transition_s if removed else None,
                    removal_policy=removed.policy if removed else None)

    @property
    def summary(self) -> str:
        """Why, in words: both prices and the horizon."""
        kept = f"kept {self.kept.estimate.step_time_s:.3g} s/step"
        if self.removal is None:
            return f"no plan goes on without it ({self.unrecoverable}); {kept}"
        removed = self.removal.chosen
        pays = "removal pays" if self.remove else "removal does not pay"
        return (f"{pays} over Eq. 8's {self.horizon_s:.4g} s horizon: {kept}, without it "
                f"{removed.estimate.step_time_s:.3g} s/step ({removed.policy}) after a {removed.transition_s:.3g} s "
                "transition")


def weigh_straggler(*, rank: int, slowdown: float, current: ExecutionPlan, kept: PlanEstimate,
                    removal: Optional[Decision], unrecoverable: str = "", alive_workers: int, horizon_s: float,
                    target_micro_batches: int, profile: ModelProfile, settings: SearchSettings) -> StragglerDecision:
    """Score ``current`` at the straggler's speed (``kept``, its estimate with the rank
    slowed) by Eq. 8 over ``horizon_s`` as ``choose`` scores a plan that goes on (no
    transition; the risk of its sole holders among ``alive_workers``), beside ``removal``,
    the decision without the rank over the same horizon; ``target_micro_batches``: the
    recipe's batch, which ``choose`` charges a plan training fewer for (``Drafts``)."""
    going_on = Drafts(current, (kept_draft(current, kept, profile=profile),), 0, (), affected=False, unchanged=False,
                      alive_workers=alive_workers, pricing_s=0.0, target_micro_batches=target_micro_batches)
    scored = choose(going_on, settings=settings, interval_s=horizon_s, search_time_s=0.0).chosen
    return StragglerDecision(rank=rank, slowdown=slowdown, kept=scored, removal=removal,
                             unrecoverable=unrecoverable, horizon_s=horizon_s)
