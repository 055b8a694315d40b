"""The decision: reroute or reparallelize, whichever scores best under Eq. 8."""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Callable, Optional

from odyssey_megatron.cluster import ClusterState
from odyssey_megatron.estimator import PlanEstimate, ScheduleDeadlock, estimate_plan, transfer_time
from odyssey_megatron.estimator.memory import held_profile
from odyssey_megatron.plan import ExecutionPlan
from odyssey_megatron.planner.normalize import normalize_failures, refill_failed_stages
from odyssey_megatron.planner.policy import fatal_share, policy_score, sole_holders
from odyssey_megatron.planner.reparallelize import ReparallelizeSearch, describe_layout, place_layout
from odyssey_megatron.planner.reroute import reroute_plan
from odyssey_megatron.planner.reroute_pricing import RerouteCost
from odyssey_megatron.planner.shrink import BatchTarget, shrunk_plan
from odyssey_megatron.profile import ModelProfile
from odyssey_megatron.restorer import check_transfers, live_holdings, plan_transfers, with_sync
from odyssey_megatron.settings import SearchSettings
from odyssey_megatron.snapshot.restore import Restore

PLACED_LAYOUTS = 3
"""Fastest layouts (as priced) that get a Kuhn-Munkres placement, so transition cost can still
change the winner; the fastest symmetric layout is placed beside them where they do not hold it."""


class UnrecoverableFailure(RuntimeError):
    """No plan can continue on the survivors; the message says why."""


class PricingInterrupted(Exception):
    """``draft_candidates``' ``interrupted()`` turned true between two pricings: whoever
    asked (``DecisionCenter.prepare``) no longer needs the drafts."""


@dataclass(frozen=True)
class Candidate:
    policy: str
    plan: ExecutionPlan
    estimate: PlanEstimate
    transition_s: float
    score: float
    """Eq. 8: samples/s times the effective-time ratio."""
    layout: str
    restore: Optional[Restore] = None
    """A rollback's: where every block comes back from (``Draft.restore``)."""
    dropped_micro_batches: int = 0
    """Micro-batches of the recipe's batch the plan trains nowhere each step (``planner.shrink``)."""
    dropped_samples_per_step: int = 0
    """Their samples: what each step trains fewer than the recipe's batch."""
    batch_score: Optional[float] = None
    """Where a candidate drops micro-batches: Eq. 8 over ``Decision.batch_horizon_s``, for it
    and for the best candidate of the whole batch, which it is chosen over where higher."""


@dataclass(frozen=True)
class Decision:
    chosen: Candidate
    alternatives: tuple[Candidate, ...]
    """Other placed candidates, best score first."""
    candidates_considered: int
    """Strategies estimated (plus the reroute plan)."""
    search_time_s: float
    expected_interval_s: float
    """The expected seconds to the next failure (``DecisionCenter`` fills it in; ``choose``
    sets the horizon it weighed over)."""
    note: str = ""
    source: str = "cold"
    """Where its candidates were priced: "cold" (at the failure), "prepared" (in advance,
    for this failure) or "renamed" (in advance, for an equivalent failure on a symmetric
    plan: ``planner.symmetry``)."""
    horizon_s: float = 0.0
    """Eq. 8's horizon: the seconds it weighed each candidate over (``DecisionCenter`` fills
    it in): the expected interval, cut at the run's end where no worker comes back
    (``policy.eq8_horizon_s``)."""
    interval_source: str = ""
    """Where ``expected_interval_s`` came from (``DecisionCenter`` fills it in): the prior
    ``odyssey.device_mtbf_hours``, the failures seen (``FailureRateModel.source``), or the
    caller's hindsight."""
    replaced: Optional[ExecutionPlan] = None
    """The plan the job ran before it (``DecisionCenter`` fills it in): what the chosen
    plan's transfers move weights from."""
    from_start: bool = False
    """No survivor holds some block and no snapshot restores it: the job goes back to its
    start (every block drawn again from the seed, or the checkpoint it resumed from) and
    trains the steps since again; the chosen plan moves nothing."""
    batch_horizon_s: float = 0.0
    """Where some candidate drops micro-batches: the seconds it and the best candidate of
    the whole batch were weighed over (``planner.shrink.batch_horizon_s``); 0 otherwise."""

    @property
    def rollback(self) -> Optional[Restore]:
        """Where no survivor holds some block: the snapshot every block comes back from, the
        job rolling back to its step (the chosen plan's transfers move them from where it is
        read)."""
        return self.chosen.restore


@dataclass(frozen=True)
class Draft:
    """A priced candidate before Eq. 8 scores it."""

    policy: str
    plan: ExecutionPlan
    estimate: PlanEstimate
    moving_s: float
    """Moving weights and optimizer state into the plan (``transfer_time``)."""
    restart_s: float
    """Rebuilding groups and stages (``odyssey.*_restart_s``)."""
    sole_holders: int
    """Workers that alone hold some block of the plan (``policy.sole_holders``)."""
    layout: str
    """The plan's layout in words (``describe_layout``)."""
    restore: Optional[Restore] = None
    """Where the plan is a rollback (``DecisionCenter``): the snapshot its transfers move
    every block from."""


@dataclass(frozen=True)
class Drafts:
    """Every candidate of one decision, priced, before Eq. 8 weighs them (``choose``)."""

    current: ExecutionPlan
    drafts: tuple[Draft, ...]
    considered: int
    """Strategies estimated (plus the reroute plan)."""
    notes: tuple[str, ...]
    affected: bool
    """A stage owner failed: training is paused while the decision is made."""
    unchanged: bool
    """Nothing failed that the plan uses and no worker is idle: the plan goes on."""
    alive_workers: int
    pricing_s: float
    """Seconds spent pricing."""
    target_micro_batches: int
    """The recipe's batch in micro-batches: what every reparallelized candidate trains, and
    what a plan that trains fewer drops (``planner.shrink``)."""


def _faster(kept: Draft | None, rival: Draft | None) -> Draft | None:
    """``rival`` where it trains faster than ``kept``. A normalization swap or a refill
    lasts as long as the failure it works around, well past the next failure that Eq. 8
    weighs its copy against, and is never revisited once declined; so, as in ReCycle, it
    is taken whenever it makes the step faster, and Eq. 8 weighs the result against
    reparallelizing."""
    if kept is None or rival is None:
        return rival or kept
    return rival if rival.estimate.samples_per_s > kept.estimate.samples_per_s else kept


def _draft(policy: str, plan: ExecutionPlan, estimate: PlanEstimate, moving_s: float, restart_s: float, *,
           profile: ModelProfile) -> Draft:
    """A priced candidate with what Eq. 8 weighs it by beside its estimate, computed once:
    a decision prepared in advance scores the same drafts again at the failure."""
    return Draft(policy, plan, estimate, moving_s, restart_s, sole_holders=sole_holders(plan.holdings(profile)),
                 layout=describe_layout([p.layer_counts for p in plan.pipelines]))


def kept_draft(current: ExecutionPlan, estimate: PlanEstimate, *, profile: ModelProfile) -> Draft:
    """``current`` going on as it runs, priced at ``estimate``: nothing moves, nothing restarts."""
    return _draft(current.policy, current, estimate, 0.0, 0.0, profile=profile)


class _Pricer:
    """What pricing one decision's candidates shares: the current plan and the cluster after
    the failure, the live holdings before anything moves, the settings, one memo (it spares
    pricing a reroute twice), and what the decision notes and how many strategies it
    considered."""

    def __init__(self, *, current: ExecutionPlan, cluster: ClusterState, profile: ModelProfile,
                 settings: SearchSettings, interrupted: Callable[[], bool], target: BatchTarget):
        self.current = current
        self.target = target
        self.cluster = cluster
        self.profile = profile
        self.settings = settings
        self.interrupted = interrupted
        self.failed = cluster.failed_workers
        self.memo: dict = {}
        self._reroute_cost = RerouteCost(profile, cluster, pricing=settings.pricing, memo=self.memo)
        self.holdings = live_holdings(current, cluster=cluster, profile=profile)  # before anything moves
        self.notes: list[str] = []
        self.considered = 0

    def checkpoint(self) -> None:
        if self.interrupted():
            raise PricingInterrupted

    def estimate(self, plan: ExecutionPlan) -> PlanEstimate:
        """``plan`` priced as the runtime runs it."""
        return estimate_plan(plan, self.profile, self.cluster, pricing=self.settings.pricing, memo=self.memo)

    def moving_s(self, plan: ExecutionPlan) -> float:
        return transfer_time(plan.transfers, profile=self.profile, cluster=self.cluster,
                             storage_bandwidth=self.settings.storage_bandwidth_gb_s * 1e9)

    def reroute_cost(self, plan: ExecutionPlan) -> float | None:
        """What rerouting ``plan`` costs (``RerouteCost``): normalization and refills compare by it."""
        self.checkpoint()
        return self._reroute_cost(plan)

    def held(self, plan: ExecutionPlan) -> ModelProfile:
        """The profile of what each rank of ``plan`` keeps (``held_profile``): what a block
        moved to a new holder carries, its weights and its share of the optimizer state."""
        return held_profile(plan, self.profile, pricing=self.settings.pricing)

    def reroute(self, plan: ExecutionPlan) -> Draft | None:
        """A rerouted plan priced, with the stage copies its swapped-in or idle workers need;
        None (and a note) where it deadlocks or exceeds the memory budget."""
        self.checkpoint()
        plan = with_sync(replace(plan, transfers=plan_transfers(plan, holdings=self.holdings, profile=self.held(plan),
                                                                cluster=self.cluster)), self.profile)
        try:
            estimate = self.estimate(plan)
        except ScheduleDeadlock as exc:  # never seen in tests; refuse the plan rather than hang
            self.notes.append(f"reroute schedule deadlocks: {exc}")
            return None
        if not estimate.fits_memory:
            self.notes.append("reroute exceeds the memory budget on a peer")
            return None
        return _draft("reroute", plan, estimate, self.moving_s(plan), self.settings.reroute_restart_s,
                      profile=self.profile)


def draft_candidates(
    *,
    current: ExecutionPlan,
    cluster: ClusterState,
    profile: ModelProfile,
    settings: SearchSettings,
    search: ReparallelizeSearch | None = None,
    interrupted: Callable[[], bool] = lambda: False,
    target: BatchTarget | None = None,
) -> Drafts:
    """Every candidate successor of ``current`` on ``cluster``, priced and its transfers
    checked, before Eq. 8 weighs them (the costly part of a decision, and what a decision
    prepared in advance keeps); raises UnrecoverableFailure when there is none.

    After a failure the candidates are the reroute, after failure normalization
    (``planner.normalize``) where that makes the step faster (``_faster`` says why), and
    the best reparallelized ones.
    When no stage owner failed but idle workers are alive (repaired or spare), the current
    plan, or idle workers taking over rerouted stages (``refill_failed_stages``) where that
    is faster, competes with reparallelizing onto all of them; the current plan trains
    while that search runs, so its time is not part of a transition, and by default (see
    ``odyssey.length_sweep``) it sweeps every pipeline length. A ``search`` kept by the
    caller carries its pipeline cost caches from one decision to the next (same profile
    and settings). When no layout near the current DP degree fits in memory, the search
    sweeps every pipeline length before giving up on reparallelizing.
    Every plan is priced as the runtime runs it (``settings.pricing``). ``interrupted`` is
    asked before each pricing (a second at most on a 70B plan of 4,096 ranks) and raises
    PricingInterrupted when true: a decision prepared in advance gives way to the failure
    that makes it stale.
    With ``odyssey.batch_on_failure: shrink``, a failure also drafts two plans of a smaller
    batch (``planner.shrink``): the whole pipelines going on with their own micro-batches,
    and whole pipelines of the job's shape re-formed from every survivor, each with its
    share. ``target``: the recipe's batch, which every reparallelized candidate trains
    (default: ``current``'s, where it is the job's plan).
    """
    started = time.perf_counter()
    target = BatchTarget.of(current) if target is None else target
    pricer = _Pricer(current=current, cluster=cluster, profile=profile, settings=settings, interrupted=interrupted,
                     target=target)
    affected = bool(pricer.failed & set(current.workers))
    idle = set(cluster.alive_workers) - set(current.workers)
    want_reroute = settings.policy in ("auto", "reroute")
    want_reparallelize = settings.policy in ("auto", "reparallelize")
    drafts: list[Draft] = []
    if not affected:
        kept = kept_draft(current, pricer.estimate(current), profile=profile)
        if not idle:
            return Drafts(current, (kept,), 0, ("no stage owner failed",), affected=False, unchanged=True,
                          alive_workers=len(cluster.alive_workers), pricing_s=time.perf_counter() - started,
                          target_micro_batches=target.micro_batches)
        pricer.notes.append(f"{len(idle)} idle worker(s) alive")
        drafts.append(_refilled(pricer, kept, idle) if want_reroute else kept)
    reroute = _rerouted(pricer) if affected and want_reroute else None
    if reroute is not None:
        drafts.append(reroute)
    if want_reparallelize or not drafts:
        if not want_reparallelize:
            pricer.notes.append("falling back to reparallelize")
        sweep = settings.length_sweep == "always" or (settings.length_sweep == "joins" and not affected)
        drafts.extend(_reparallelized(pricer, search, sweep=sweep))
    if affected and settings.batch_on_failure == "shrink":
        shrunk = _shrunk(pricer)
        drafts.extend(d for d in (shrunk, _reformed(pricer, search, shrunk)) if d is not None)
    if not drafts:
        raise UnrecoverableFailure("; ".join(pricer.notes) or "no candidate plan")
    for draft in drafts:
        if draft.plan is not current:
            check_transfers(draft.plan, holdings=pricer.holdings, profile=pricer.held(draft.plan), cluster=cluster)
    return Drafts(current, tuple(drafts), pricer.considered, tuple(pricer.notes), affected=affected,
                  unchanged=False, alive_workers=len(cluster.alive_workers), pricing_s=time.perf_counter() - started,
                  target_micro_batches=target.micro_batches)


def _refilled(pricer: _Pricer, kept: Draft, idle: set[int]) -> Draft:
    """No stage owner failed and ``idle`` workers are alive: the current plan (``kept``), or
    idle workers taking over its rerouted stages (``refill_failed_stages``) where faster."""
    current = pricer.current
    refilled = refill_failed_stages(current, idle_workers=idle, cluster=pricer.cluster, profile=pricer.profile,
                                    cost=pricer.reroute_cost)
    if refilled is current:
        return kept
    pricer.considered += 1
    return _faster(kept, pricer.reroute(reroute_plan(refilled, failed_workers=pricer.failed, profile=pricer.profile)))


def _rerouted(pricer: _Pricer) -> Draft | None:
    """The reroute after a stage owner failed, after failure normalization where that makes
    the step faster (``_faster``); None where no reroute is possible or none fits."""
    current, failed, profile = pricer.current, pricer.failed, pricer.profile
    pricer.considered += 1
    rerouted = reroute_plan(current, failed_workers=failed, profile=profile)
    if rerouted is None:
        pricer.notes.append("reroute impossible: a stage lost every replica")
        return None
    reroute = pricer.reroute(rerouted)
    normalized = normalize_failures(current, new_failures=failed & set(current.workers), cluster=pricer.cluster,
                                    profile=profile, cost=pricer.reroute_cost)
    if normalized is not current:  # a survivor takes over a failed stage where rerouting costs less
        pricer.considered += 1
        reroute = _faster(reroute, pricer.reroute(reroute_plan(normalized, failed_workers=failed, profile=profile)))
    return reroute


def _shrunk(pricer: _Pricer) -> Draft | None:
    """The whole pipelines going on with their own micro-batches, the broken ones' dropped
    (``planner.shrink``); None where no pipeline is whole."""
    plan = shrunk_plan(pricer.current, failed_workers=pricer.failed)
    if plan is None:
        pricer.notes.append("no pipeline is whole: nothing to shrink onto")
        return None
    pricer.checkpoint()
    pricer.considered += 1
    plan = with_sync(plan, pricer.profile)
    estimate = pricer.estimate(plan)
    if not estimate.fits_memory:
        pricer.notes.append("the shrunk plan exceeds the memory budget")
        return None
    return _draft("shrink", plan, estimate, 0.0, pricer.settings.reroute_restart_s, profile=pricer.profile)


def _reformed(pricer: _Pricer, search: ReparallelizeSearch | None, shrunk: Draft | None) -> Draft | None:
    """Whole pipelines of the job's shape re-formed from every survivor, each with the job
    plan's share of the batch (what torchft's replica drop trains on them), placed with the
    least weight movement: the broken pipelines' survivors take the stages they lost from
    peers. Where a node failure breaks one stage of several pipelines (the job's plan is
    stage-major), this drops as many pipelines' micro-batches as the survivors lack, where
    ``_shrunk`` drops every broken one. None where that batch is the whole one, no larger
    than ``shrunk``'s or no layout of it fits."""
    target, cluster = pricer.target, pricer.cluster
    micro_batches = target.reformed_micro_batches(len(cluster.alive_workers))
    if micro_batches >= target.micro_batches or micro_batches <= (shrunk.plan.num_micro_batches if shrunk else 0):
        return None
    search = _search_for(pricer, search)
    dp = micro_batches // target.per_pipeline
    pricer.checkpoint()
    layouts = search.layouts(num_workers=len(cluster.alive_workers), num_micro_batches=micro_batches, current_dp=dp,
                             alive_dp=dp, dp_radius=0, pp_radius=pricer.settings.pp_search_radius,
                             pricing=pricer.settings.pricing, checkpoint=pricer.checkpoint)
    if not layouts or layouts[0].step_time_s is None:
        return None
    pricer.considered += 1
    pricer.checkpoint()
    plan = place_layout(layouts[0], current=pricer.current, holdings=pricer.holdings, cluster=cluster,
                        profile=pricer.profile, pricing=pricer.settings.pricing)
    plan = replace(plan, policy="shrink")
    return _draft("shrink", plan, pricer.estimate(plan), pricer.moving_s(plan),
                  pricer.settings.reparallelize_restart_s, profile=pricer.profile)


def _search_for(pricer: _Pricer, search: ReparallelizeSearch | None) -> ReparallelizeSearch:
    """``search`` (the decision center's, whose memo outlives decisions), or a fresh one
    for this decision; ValueError where it was built for another profile than the pricing's."""
    if search is None:
        return ReparallelizeSearch(pricer.profile, max_layer_splits=pricer.settings.max_layer_splits)
    if search.profile is not pricer.profile:
        raise ValueError("the reparallelize search was built for another profile")
    return search


def _alive_dp(current: ExecutionPlan, cluster: ClusterState) -> int | None:
    """Where ``current`` runs broken pipelines (a reroute's), the DP degree the live workers
    give at its mean pipeline length: a second centre of the search's window, as its DP
    degree counts the broken pipelines (after a few node failures the layouts that use
    the survivors lie outside the window around it alone). None for a plan of whole
    pipelines, whose DP degree is that centre."""
    if all(stage.worker is not None for _, _, stage in current.stage_positions()):
        return None
    stages = sum(len(p.stages) for p in current.pipelines)
    return max(1, round(len(cluster.alive_workers) * len(current.pipelines) / stages))


def _reparallelized(pricer: _Pricer, search: ReparallelizeSearch | None, *, sweep: bool) -> list[Draft]:
    """The fastest reparallelized layouts (``PLACED_LAYOUTS`` of them, and the fastest
    symmetric one beside them), as the runtime runs them (``ReparallelizeSearch.layouts``),
    placed and priced. The search's window lies around the current DP degree and, after a
    reroute, the one the workers alive give (``_alive_dp``); it sweeps every pipeline length too where
    ``sweep`` says or when no layout near the current DP degree fits."""
    current, cluster, profile, settings = pricer.current, pricer.cluster, pricer.profile, pricer.settings
    search = _search_for(pricer, search)
    window = dict(
        num_workers=len(cluster.alive_workers),
        num_micro_batches=pricer.target.micro_batches,
        current_dp=len(current.pipelines),
        alive_dp=_alive_dp(current, cluster),
        dp_radius=settings.dp_search_radius,
        pp_radius=settings.pp_search_radius,
        fastest=PLACED_LAYOUTS,
        pricing=settings.pricing,
        checkpoint=pricer.checkpoint,
    )
    pricer.checkpoint()
    layouts = search.layouts(**window, sweep=sweep)
    far = [abs(len(layout.splits) - len(current.pipelines)) > settings.dp_search_radius for layout in layouts]
    if not sweep and all(far):  # Eq. 8 needs a reparallelized rival, and one beats a checkpoint restart
        pricer.notes.append("no layout near the current DP degree fits; swept every pipeline length")
        layouts = search.layouts(**window, sweep=True)
    pricer.considered += len(layouts)
    placed = layouts[:PLACED_LAYOUTS]
    if not any(layout.symmetric for layout in placed):  # ``layouts`` puts the fastest symmetric one next
        placed += [layout for layout in layouts[PLACED_LAYOUTS:PLACED_LAYOUTS + 1]
                   if layout.symmetric and layout.step_time_s is not None]
    drafts = []
    for layout in placed:
        pricer.checkpoint()
        plan = place_layout(layout, current=current, holdings=pricer.holdings, cluster=cluster, profile=profile,
                            pricing=settings.pricing)
        moving = pricer.moving_s(plan)
        drafts.append(_draft("reparallelize", plan, pricer.estimate(plan), moving, settings.reparallelize_restart_s,
                             profile=profile))
    if not layouts:
        pricer.notes.append("no reparallelized layout fits the memory budget")
    return drafts


def choose(drafts: Drafts, *, settings: SearchSettings, interval_s: float,
           search_time_s: float, batch_horizon_s: float | None = None) -> Decision:
    """Score every draft by Eq. 8 and pick the best: throughput, less the transition
    (search time while training is paused, moving state, restarting) and the expected
    cost of a next failure no in-memory recovery survives, over ``interval_s``, the
    expected time to the next failure. Throughput is the samples a plan trains a second,
    so a plan that drops micro-batches is charged for them. Where some drafts drop
    micro-batches (``planner.shrink``), the best of them is chosen over the best plan of the
    whole batch only where it scores higher over ``batch_horizon_s`` (default
    ``interval_s``): how long a smaller batch lasts. Cheap: a decision prepared in advance
    is this call with the interval at the time of the failure."""
    current = drafts.current
    if drafts.unchanged:
        kept = drafts.drafts[0]
        goes_on = Candidate(kept.policy, current, kept.estimate, 0.0, kept.estimate.samples_per_s, kept.layout,
                            **_dropped(drafts, kept))
        return Decision(goes_on, (), 0, search_time_s, interval_s, "; ".join(drafts.notes))
    paused_search_s = search_time_s if drafts.affected else 0.0
    alive = drafts.alive_workers

    def score(draft: Draft, transition: float, horizon_s: float) -> float:
        risk = fatal_share(draft.sole_holders, alive) * settings.checkpoint_restart_penalty_s
        return policy_score(samples_per_s=draft.estimate.samples_per_s, transition_s=transition,
                            interval_s=horizon_s, risk_s=risk)

    priced = []
    for draft in drafts.drafts:
        transition = paused_search_s + draft.moving_s + draft.restart_s if draft.plan is not current else 0.0
        priced.append((draft, transition, score(draft, transition, interval_s)))
    order = sorted(range(len(priced)), key=lambda i: (-priced[i][2], priced[i][0].plan is not current,
                                                      priced[i][0].policy != "reroute"))
    whole = [i for i in order if priced[i][0].plan.num_micro_batches >= drafts.target_micro_batches]
    smaller = [i for i in order if i not in whole]
    batch_horizon = 0.0
    batch_scores: dict[int, float] = {}
    if smaller:
        batch_horizon = interval_s if batch_horizon_s is None else batch_horizon_s
        rivals = smaller + whole[:1]
        batch_scores = {i: score(priced[i][0], priced[i][1], batch_horizon) for i in rivals}
        best = max(rivals, key=lambda i: (batch_scores[i], i in whole[:1]))
        order.remove(best)
        order.insert(0, best)
    candidates = [Candidate(draft.policy, draft.plan, draft.estimate, transition, eq8, draft.layout, draft.restore,
                            batch_score=batch_scores.get(i), **_dropped(drafts, draft))
                  for i, (draft, transition, eq8) in ((i, priced[i]) for i in order)]
    chosen, *others = candidates
    return Decision(chosen, tuple(others), drafts.considered, search_time_s, interval_s, "; ".join(drafts.notes),
                    batch_horizon_s=batch_horizon)


def _dropped(drafts: Drafts, draft: Draft) -> dict:
    """What ``draft``'s plan trains fewer than the recipe's batch each step, as ``Candidate``
    records it."""
    trained = draft.plan.num_micro_batches
    dropped = max(0, drafts.target_micro_batches - trained)
    return dict(dropped_micro_batches=dropped,
                dropped_samples_per_step=dropped * draft.estimate.samples_per_step // trained)
