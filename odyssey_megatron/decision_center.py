"""The decision center: a job's profile, cluster and current plan, updated on failures.

The live controller and the simulator both drive this object: build it from a recipe
(``DecisionCenter.from_recipe``) or around a running plan, call ``on_failure`` with what
the fault detector saw, and publish the plan it returns with its step program
(``published``): the op lists and flags the plan was priced with, which ranks run as they
are. Between failures, ``prepare`` prices the decisions for the likely next ones, so the
next decision is Eq. 8 over candidates already priced.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Callable, Iterable

from odyssey_megatron.blocks import block_sort_key
from odyssey_megatron.cluster import ClusterState
from odyssey_megatron.config import ModelConfig, RecipeConfig
from odyssey_megatron.estimator import PlanEstimate, estimate_plan
from odyssey_megatron.estimator.checkpoint import checkpoint_time_s
from odyssey_megatron.estimator.program import step_program
from odyssey_megatron.estimator.snapshot import restore_time, snapshot_time_s, young_interval_steps
from odyssey_megatron.estimator.pipeline import warm_up
from odyssey_megatron.plan import ExecutionPlan
from odyssey_megatron.planner import (
    Decision,
    Drafts,
    FailureRateModel,
    PricingInterrupted,
    UnrecoverableFailure,
    choose,
    draft_candidates,
    eq8_horizon_s,
    initial_plan,
)
from odyssey_megatron.planner.reparallelize import ReparallelizeSearch
from odyssey_megatron.planner.shrink import BatchTarget, batch_horizon_s
from odyssey_megatron.planner.straggler import StragglerDecision, weigh_straggler
from odyssey_megatron.planner.symmetry import Symmetry, rename_drafts, symmetry
from odyssey_megatron.profile import ModelProfile
from odyssey_megatron.profile_file import recipe_profile
from odyssey_megatron.schedules.program import StepProgram, publish
from odyssey_megatron.settings import DecisionSettings
from odyssey_megatron.snapshot.restore import SnapshotLost, SnapshotSource
from odyssey_megatron.units import MIB, SECONDS_PER_HOUR

PREPARED_BYTES_PER_RANK = 1200
"""What one prepared decision keeps per rank of the plan, at most: a few candidate plans
over every worker and their stage copies per TP shard (1,126 B for Llama-2 7B, 271 B for
70B at 16,384 ranks, ``benchmarks/plan_search.py --memory``). ``odyssey.prepared_decisions_mib``
divided by it and by the ranks bounds how many are kept: 150 MiB keep 8 at 16,384 ranks."""


class DecisionCenter:
    """The one stateful entry to planning: the job's current plan, cluster state and
    failure-rate model, updated on every failure and join. The CLI, the simulator and the
    live controller all drive this object, so what the simulator measures is what the
    runtime decides."""

    def __init__(
        self,
        *,
        plan: ExecutionPlan,
        cluster: ClusterState,
        profile: ModelProfile,
        settings: DecisionSettings,
        search_time_s: float | None = None,
        settles_at_once: bool = True,
        model: ModelConfig | None = None,
        failure_model: FailureRateModel | None = None,
        batch_target: BatchTarget | None = None,
    ):
        """A job running ``plan`` on ``cluster``. ``search_time_s`` replaces the measured
        search time in every transition (the simulator needs determinism).
        ``settles_at_once``: each decision's plan is taken as carried out when it is
        committed (the simulator, ``odyssey plan``); False: the caller says when a plan
        settles (``settle``): the live run, where a recovery can fail before its first step.
        ``model``: the job's model, whose blocks its in-memory snapshots share out
        (``snapshot_interval``); a recipe's center has it. ``failure_model``: where Eq. 8's
        failure rate comes from; default ``settings``' prior MTBF, learned from the failures
        seen where ``settings.learn_failure_rate`` (the simulator gives the scenario's rate).
        ``batch_target``: the recipe's batch, which every decision's reparallelized
        candidates train (``planner.shrink``); default ``plan``'s, the job's plan."""
        self.plan = plan
        """The plan committed last: what the job runs, or is about to."""
        self.settled = plan
        """The plan whose blocks the ranks hold (``settle``): a decision starts from it."""
        self.settles_at_once = settles_at_once
        self._rolling_back = False
        """The plan committed last rolls back to a snapshot and has not settled."""
        self.cluster = cluster
        self.profile = profile
        self.settings = settings
        self.model = model
        self.search_time_s = search_time_s
        self.batch_target = BatchTarget.of(plan) if batch_target is None else batch_target
        """The recipe's batch: a plan that trains fewer drops the rest (``odyssey.batch_on_failure``)."""
        self.failure_model = failure_model or FailureRateModel(device_mtbf_hours=settings.device_mtbf_hours,
                                                               learn=settings.learn_failure_rate)
        self.search = ReparallelizeSearch(profile, max_layer_splits=settings.search.max_layer_splits)
        self._last_event_s = 0.0
        self._prepared: tuple[ExecutionPlan, ClusterState, dict[frozenset[int], Drafts]] | None = None
        """Decisions priced in advance (``prepare``): for this plan on this cluster, per set
        of failed workers after the next failure."""
        self._symmetry: tuple[ExecutionPlan, ClusterState, Symmetry | None] | None = None
        """The symmetry of this plan on this cluster (``planner.symmetry``), found once."""
        self._cases: tuple[ExecutionPlan, ClusterState, list[frozenset[int]]] | None = None
        """Every likely failure of this plan on this cluster (``_every_case_of``)."""
        self._prepare_search = ReparallelizeSearch(profile, max_layer_splits=settings.search.max_layer_splits)
        """``prepare``'s own caches: it may run in a thread beside ``on_failure``."""
        self._program: tuple[ExecutionPlan, StepProgram] | None = None
        """The plan the program was last computed for, and the program."""
        self._estimate: tuple[tuple[ExecutionPlan, ClusterState, ModelProfile], PlanEstimate] | None = None
        """What the estimate was last computed for, and the estimate."""
        warm_up()  # the replay engine is compiled before the first failure, not during it

    @classmethod
    def from_recipe(cls, config: RecipeConfig, *, profile: ModelProfile | None = None,
                    settles_at_once: bool = True) -> "DecisionCenter":
        """The recipe's job before any failure: its profile (``recipe_profile``, or ``profile``), the
        whole cluster and Megatron's symmetric DP x PP plan; ``settles_at_once`` as in the
        constructor."""
        profile = profile if profile is not None else recipe_profile(config)
        par = config.parallel
        plan = initial_plan(
            data_parallel_size=par.data_parallel_size,
            pipeline_parallel_size=par.pipeline_model_parallel_size,
            tensor_parallel_size=par.tensor_model_parallel_size,
            num_micro_batches=config.training.num_micro_batches,
            profile=profile,
            max_layer_splits=config.odyssey.max_layer_splits,
            pricing=config.odyssey.pricing,
        )
        cluster = ClusterState(
            world_size=par.num_ranks,
            tensor_parallel_size=par.tensor_model_parallel_size,
            devices_per_node=config.cluster.devices_per_node,
        )
        return cls(plan=plan, cluster=cluster, profile=profile, settings=config.odyssey.decisions,
                   settles_at_once=settles_at_once, model=config.model)

    def on_failure(
        self, *, ranks: Iterable[int] = (), workers: Iterable[int] = (), nodes: Iterable[int] = (),
        at_s: float | None = None, interval_s: float | None = None, time_left_s: float | None = None,
        in_memory: bool = False, snapshot: SnapshotSource | None = None, start_replay_steps: int | None = None,
        removed: bool = False,
    ) -> Decision:
        """Mark ``ranks`` and every rank of ``workers`` and ``nodes`` failed, decide, and
        commit the chosen plan. ``removed``: they are stragglers the run takes out, alive
        (``on_straggler`` priced it): no failure for the learned failure rate, only the
        device-hours.

        The decision starts from what the ranks hold: the settled plan (``settle``). Where
        the plan committed last has not settled (a recovery that failed before its first
        step), they still hold the settled plan's blocks, and the decision starts from that
        layout under the unsettled plan's generation number (it was published); where that
        plan was a rollback, the decision rolls back again, whatever the survivors hold
        (they hold the snapshot's blocks).

        ``at_s`` is the job's clock at the failure (seconds since start); given, the failure
        and the device-hours since the previous event feed the learned failure rate.
        ``interval_s`` replaces the expected time to the next failure in Eq. 8 (hindsight:
        the simulator's oracle knows it). ``time_left_s``: the run's seconds left, given
        where no worker comes back (no repairs): Eq. 8's horizon is then cut there
        (``policy.eq8_horizon_s``; ``Decision.horizon_s``). ``in_memory``: the job goes on from what the
        survivors hold, so a plan that needs a block no survivor holds is no plan: raises
        UnrecoverableFailure naming the blocks, and commits nothing, unless ``snapshot``
        restores them: it says where each candidate plan gets every block back from as of
        the last in-memory snapshot (``snapshot.restore.SnapshotSource``), Eq. 8 weighs each
        with that move and the steps trained again, and the decision rolls back to it
        (``Decision.rollback``). Without a snapshot, ``start_replay_steps`` (the steps
        committed since the job's start) lets it go back to the start instead: every block
        drawn again, those steps trained again, priced in Eq. 8 (``Decision.from_start``).
        Raises UnrecoverableFailure when no candidate exists either. The plan chosen is always a new generation, the current layout too where it
        goes on (a failure that touched none of its workers; its transfers were made when it
        started): the runtime ended the generation that ran.
        """
        self._observe(failures=0 if removed else 1, at_s=at_s)
        roll_back = self._rolling_back
        if self.plan is not self.settled:
            self.plan = replace(self.settled, generation=self.plan.generation, transfers=())
        before = self.cluster
        self.cluster = self.cluster.fail_ranks([*ranks, *self.cluster.ranks_of(workers)]).fail_nodes(nodes)
        decision = self._decide(interval_s, time_left_s, prepared=lambda: self._prepared_drafts(before),
                                in_memory=in_memory,
                                snapshot=snapshot, roll_back=roll_back, start_replay_steps=start_replay_steps)
        if decision.chosen.plan is decision.replaced:  # what runs goes on, with nothing left to move
            plan = replace(self.plan, generation=self.plan.generation + 1, transfers=())
            decision = replace(decision, chosen=replace(decision.chosen, plan=plan))
        self._commit(decision)
        return decision

    def on_idle_failure(self, *, ranks: Iterable[int], at_s: float | None = None) -> None:
        """Mark ``ranks`` failed where the running plan does not use them (an idle worker, a
        joiner not taken back yet): it goes on, no decision is needed, and the failure
        counts for the failure rate."""
        self._observe(failures=1, at_s=at_s)
        self.cluster = self.cluster.fail_ranks(ranks)

    def settle(self, plan: ExecutionPlan) -> None:
        """The job runs ``plan`` and its ranks hold its blocks: the first step of its
        generation committed, or it is the plan a decision committed after it falls back to
        (a join dropped before its step boundary), or the one a restart from a checkpoint
        goes onto. The one way to set the running plan from outside: decisions start from
        it."""
        self.plan = self.settled = plan
        self._rolling_back = False

    def continue_from(self, plan: ExecutionPlan, *, away: Iterable[int] = ()) -> None:
        """A restarted controller's job: ``plan`` (the lost controller's last) is what the
        ranks it took back hold, and ``away`` are ranks it did not take back outside that
        plan: failed here, so they are offered back once they return (``on_join``). The
        plan's own ranks that did not come back are failed by a decision (``on_failure``)."""
        away = set(away)
        used = set(self.cluster.ranks_of(plan.workers))
        if away & used:
            raise ValueError(f"ranks {sorted(away & used)} are in the plan continued from: fail them by a decision")
        self.settle(plan)
        self.cluster = self.cluster.fail_ranks(away)

    def on_join(self, *, ranks: Iterable[int] = (), workers: Iterable[int] = (), at_s: float | None = None,
                interval_s: float | None = None, time_left_s: float | None = None) -> Decision:
        """Mark repaired or replacement ``ranks`` (and every rank of ``workers``) alive,
        decide whether to use them (the current plan keeps training meanwhile), and commit
        the chosen plan. ``at_s``, ``interval_s`` and ``time_left_s`` as in ``on_failure``; a join adds
        exposure, not a failure. Where Eq. 8 keeps the current plan, the decision's plan is
        the current one itself (``Decision.replaced``)."""
        self._observe(failures=0, at_s=at_s)
        self.cluster = self.cluster.repair_ranks([*ranks, *self.cluster.ranks_of(workers)])
        decision = self._decide(interval_s, time_left_s)
        self._commit(decision)
        return decision

    def on_straggler(self, *, rank: int, slowdown: float, interval_s: float | None = None,
                     time_left_s: float | None = None, in_memory: bool = False,
                     snapshot: SnapshotSource | None = None,
                     start_replay_steps: int | None = None) -> StragglerDecision:
        """Whether removing ``rank``, whose ops take ``slowdown`` times its peers'
        (``runtime.control.stragglers``), pays: the current plan with its worker's ops
        stretched by ``slowdown`` and no transition, against the plan ``on_failure`` would
        choose without that worker (its transition: search, moves, restart), both weighed
        by Eq. 8 over the horizon of that decision (``planner.straggler``). The other
        arguments as in ``on_failure``; a removal no plan survives (``UnrecoverableFailure``)
        keeps the rank. Commits nothing and counts no failure: where removal pays, the
        caller fails the rank and ``on_failure`` decides it as any failure."""
        before = self.cluster
        worker = before.worker_of(rank)
        after = before.fail_ranks(before.worker_ranks(worker))
        kept = estimate_plan(self.plan, self.profile, before, pricing=self.settings.search.pricing,
                             slowdowns={worker: slowdown})
        removal, unrecoverable = None, ""
        try:
            removal = self._decide(interval_s, time_left_s, cluster=after,
                                   prepared=lambda: self._prepared_drafts(before, after), in_memory=in_memory,
                                   snapshot=snapshot, start_replay_steps=start_replay_steps)
        except UnrecoverableFailure as exc:
            unrecoverable = str(exc)
        return weigh_straggler(rank=rank, slowdown=slowdown, current=self.plan, kept=kept, removal=removal,
                               unrecoverable=unrecoverable, alive_workers=len(before.alive_workers),
                               horizon_s=self._horizon(after, interval_s, time_left_s)[1],
                               target_micro_batches=self.batch_target.micro_batches, profile=self.profile,
                               settings=self.settings.search)

    def use_profile(self, profile: ModelProfile) -> None:
        """Price from now on with ``profile`` (the online profile's measured times): the
        search caches and the decisions prepared with the old one are dropped. Not while
        ``prepare`` runs."""
        self.profile = profile
        self.search = ReparallelizeSearch(profile, max_layer_splits=self.settings.search.max_layer_splits)
        self._prepare_search = ReparallelizeSearch(profile, max_layer_splits=self.settings.search.max_layer_splits)
        self._prepared = None
        self._program = None

    def symmetry(self) -> Symmetry | None:
        """The current plan's symmetry on the current cluster (``planner.symmetry``), or
        None where each failure is priced on its own."""
        return self._symmetry_of(self.plan, self.cluster)

    def _symmetry_of(self, plan: ExecutionPlan, cluster: ClusterState) -> Symmetry | None:
        if self._symmetry is None or self._symmetry[0] is not plan or self._symmetry[1] is not cluster:
            self._symmetry = plan, cluster, symmetry(plan, cluster)
        return self._symmetry[2]

    def likely_failures(self) -> list[frozenset[int]]:
        """The next failures worth preparing for, as sets of failed workers: each live
        worker of the plan alone, then each node that holds one (its live workers). Where
        ``odyssey.prepared_decisions_mib`` does not hold them all and the plan is
        symmetric, one representative per class of equivalent workers and nodes instead
        (``Symmetry.representatives``), whose decision is renamed for the others, then the
        cases no representative covers (the workers and nodes of the pipelines a recovery
        changed): the cold decision of each case where that is affordable, every case of
        the symmetric part covered where not."""
        cases = self._every_case_of(self.plan, self.cluster)
        if self._by_representatives(self.cluster, len(cases)):
            sym = self.symmetry()
            return sym.representatives() + [case for case in cases if not all(map(sym.covers, case))]
        return cases

    def _every_case_of(self, plan: ExecutionPlan, cluster: ClusterState) -> list[frozenset[int]]:
        """``_every_case``, listed once per plan and cluster: ``prepare`` and the lookups
        after it (``_prepared_drafts``) share it, 16,384 cases at 16,384 ranks."""
        if self._cases is None or self._cases[0] is not plan or self._cases[1] is not cluster:
            self._cases = plan, cluster, _every_case(plan, cluster)
        return self._cases[2]

    def _by_representatives(self, cluster: ClusterState, num_cases: int) -> bool:
        """Whether ``prepare`` covers the plan's ``num_cases`` likely failures on
        ``cluster`` by representatives (a symmetric plan whose cases
        ``odyssey.prepared_decisions_mib`` does not hold) rather than case by case."""
        return num_cases > self._memory_cap() and self._symmetry_of(self.plan, cluster) is not None

    def prepare_cap(self) -> int:
        """Most prepared decisions kept for the current plan: what
        ``odyssey.prepared_decisions_mib`` holds, and at least every representative of a
        symmetric plan."""
        sym = self.symmetry()
        return max(self._memory_cap(), len(sym.representatives()) if sym else 0)

    def _memory_cap(self) -> int:
        """Prepared decisions ``odyssey.prepared_decisions_mib`` holds (at least one)."""
        ranks = len(self.plan.workers) * self.plan.tensor_parallel_size
        budget = int(self.settings.prepared_decisions_mib * MIB)
        return max(1, budget // (PREPARED_BYTES_PER_RANK * max(1, ranks)))

    def prepare(self, cases: Iterable[frozenset[int]] | None = None, *,
                stop: Callable[[], bool] = lambda: False) -> int:
        """Price in advance the decisions for ``cases`` (sets of workers that may fail
        next; default ``likely_failures``), so that ``on_failure`` for one of them only
        weighs the priced candidates by Eq. 8, with the failure rate of that moment: a
        lookup. Meant to run after every plan change, in a background thread of the
        controller: once ``stop()`` is true or the plan or cluster has changed, it stops
        at the next pricing, inside a case (which it drops: a 70B case at 4,096 ranks
        prices for 7 s, which a failure must not wait for), and keeps the cases priced
        so far; it keeps at most ``prepare_cap`` cases. Returns the cases priced."""
        plan, cluster = self.plan, self.cluster
        if self._prepared is None or self._prepared[0] is not plan or self._prepared[1] is not cluster:
            self._prepared = plan, cluster, {}
        prepared = self._prepared[2]
        cap = self.prepare_cap()
        self._every_case_of(plan, cluster)  # listed now, not in the lookup (``_prepared_drafts``)

        def stale() -> bool:
            return stop() or self.plan is not plan or self.cluster is not cluster

        done = 0
        for workers in self.likely_failures() if cases is None else cases:
            if stale() or len(prepared) >= cap:
                break
            after = cluster.fail_ranks(r for w in workers for r in cluster.worker_ranks(w))
            if after.failed_workers in prepared or not after.alive_workers:
                continue
            try:
                prepared[after.failed_workers] = draft_candidates(
                    current=plan, cluster=after, profile=self.profile, settings=self.settings.search,
                    search=self._prepare_search, interrupted=stale, target=self.batch_target)
            except UnrecoverableFailure:
                continue  # decided cold, where the failure gets its one-line reason
            except PricingInterrupted:
                break
            done += 1
        return done

    def _prepared_drafts(self, before: ClusterState, after: ClusterState | None = None) -> tuple[Drafts, str] | None:
        """The drafts ``prepare`` priced for the current failure, if any (for this plan,
        the cluster as it was just before it, and exactly the failed workers of ``after``,
        default the center's cluster), or where
        ``prepare`` covers the plan by representatives, those of its representative,
        renamed (``planner.symmetry``); with ``Decision.source``. Failures add up: the
        prepared cases are keyed by every failed worker, the representatives by the new
        failure only."""
        if self._prepared is None:
            return None
        plan, cluster, prepared = self._prepared
        if plan is not self.plan or cluster is not before:
            return None
        failed = (after or self.cluster).failed_workers
        if failed in prepared:
            return prepared[failed], "prepared"
        if not self._by_representatives(before, len(self._every_case_of(plan, before))):
            return None  # every case is prepared as itself: one not ready yet is decided cold
        sym = self._symmetry_of(plan, before)  # found by ``prepare``
        found = sym.relabelling(failed - before.failed_workers) if sym is not None else None
        if found is None:
            return None
        representative, pi = found
        key = representative | before.failed_workers
        if key not in prepared:
            return None
        return rename_drafts(prepared[key], pi), "renamed"

    @property
    def estimate(self) -> PlanEstimate:
        """The current plan's estimate on the current cluster and profile, priced as its
        program is (``odyssey.decoupled_weight_grads``, ``odyssey.staggered_optimizer``)."""
        key = self.plan, self.cluster, self.profile
        if self._estimate is None or any(a is not b for a, b in zip(self._estimate[0], key)):
            self._estimate = key, estimate_plan(self.plan, self.profile, self.cluster,
                                                pricing=self.settings.search.pricing)
        return self._estimate[1]

    def snapshot_interval(self, *, nodes_per_group: int) -> int:
        """Steps between in-memory snapshots by Young's rule for the current plan, cluster
        and failure rate (``estimator.snapshot``), with parity groups of ``nodes_per_group``:
        the default of ``odyssey.snapshot_interval``. ValueError for a center built without
        a model."""
        if self.model is None:
            raise ValueError("snapshot_interval: this center has no model to share snapshots by (build it with model=)")
        seconds = snapshot_time_s(self.plan, self.profile, model=self.model, nodes_per_group=nodes_per_group,
                                  nodes=self.cluster.num_nodes)
        return self._young(seconds)

    def checkpoint_interval(self, *, disk_write_bytes_s: float) -> int:
        """Steps between disk checkpoints by Young's rule for the current plan, cluster and
        failure rate, each node writing at ``disk_write_bytes_s`` (``estimator.checkpoint``):
        the default of ``odyssey.checkpoint_interval``. ValueError for a center built without
        a model."""
        if self.model is None:
            raise ValueError("checkpoint_interval: this center has no model to price a checkpoint of "
                             "(build it with model=)")
        return self._young(checkpoint_time_s(self.plan, self.profile, model=self.model, cluster=self.cluster,
                                             disk_write_bytes_s=disk_write_bytes_s))

    @property
    def mtbf_s(self) -> float:
        """The job's mean time between failures now: its live devices at the failure rate."""
        return self.failure_model.expected_interval_s(self.cluster.alive_devices)

    def _young(self, save_s: float) -> int:
        return young_interval_steps(copy_s=save_s, step_s=self.estimate.step_time_s, mtbf_s=self.mtbf_s)

    @property
    def program(self) -> StepProgram:
        """The current plan's step program: the op lists and flags (split backward,
        staggered optimizer) its estimate priced, picked once per plan. Computed when
        first asked for: the simulator never runs one."""
        if self._program is None or self._program[0] is not self.plan:
            self._program = self.plan, step_program(self.plan, self.profile, self.cluster,
                                                    pricing=self.settings.search.pricing)
        return self._program[1]

    def published(self) -> dict:
        """The current plan as the controller publishes it: JSON-ready, with its step program."""
        return publish(self.plan, self.program)

    def _observe(self, *, failures: int, at_s: float | None) -> None:
        if at_s is None:
            return
        if at_s < self._last_event_s:
            raise ValueError(f"event at {at_s} s is before the previous event at {self._last_event_s} s")
        exposure = self.cluster.alive_devices * (at_s - self._last_event_s) / SECONDS_PER_HOUR
        self.failure_model.observe(failures=failures, device_hours=exposure)
        self._last_event_s = at_s

    def _decide(self, interval_s: float | None, time_left_s: float | None = None, *,
                cluster: ClusterState | None = None,
                prepared: Callable[[], tuple[Drafts, str] | None] = lambda: None, in_memory: bool = False,
                snapshot: SnapshotSource | None = None, roll_back: bool = False,
                start_replay_steps: int | None = None) -> Decision:
        """Price the candidates on ``cluster`` (default the center's; or take those
        ``prepared()`` finds) and weigh them by Eq. 8; commits nothing. ``time_left_s``,
        ``in_memory``, ``snapshot`` and ``start_replay_steps`` as in ``on_failure``."""
        cluster = cluster or self.cluster
        started = time.perf_counter()
        drafts, source = prepared() or (draft_candidates(current=self.plan, cluster=cluster,
                                                         profile=self.profile, settings=self.settings.search,
                                                         search=self.search,
                                                         target=self.batch_target), "cold")
        interval, horizon = self._horizon(cluster, interval_s, time_left_s)
        search_s = time.perf_counter() - started if self.search_time_s is None else self.search_time_s
        lost = sorted({b for d in drafts.drafts for b in d.plan.blocks_from_nowhere},
                      key=block_sort_key) if in_memory else []
        from_start = False
        if lost or (roll_back and snapshot is not None):
            why = (f"blocks {', '.join(map(str, lost))} were lost on every replica (ranks "
                   f"{sorted(cluster.failed_ranks)} failed): no survivor holds them") if lost else \
                "the rollback in progress was interrupted"
            if snapshot is not None:
                try:
                    drafts = self._rolled_back(drafts, snapshot, cluster)
                except SnapshotLost as exc:
                    raise UnrecoverableFailure(f"{why}, and {exc}") from None
            elif start_replay_steps is not None:
                drafts, from_start = self._from_start(drafts, start_replay_steps), True
            else:
                raise UnrecoverableFailure(why)
        decision = replace(choose(drafts, settings=self.settings.search, interval_s=horizon,
                                  search_time_s=search_s,
                                  batch_horizon_s=batch_horizon_s(horizon_s=horizon, time_left_s=time_left_s)),
                           expected_interval_s=interval, horizon_s=horizon,
                           source=source, replaced=self.plan, from_start=from_start,
                           interval_source="the caller (interval_s)" if interval_s is not None else
                           self.failure_model.source)
        return decision

    def _horizon(self, cluster: ClusterState, interval_s: float | None,
                 time_left_s: float | None) -> tuple[float, float]:
        """Eq. 8's expected interval to the next failure on ``cluster`` (``interval_s`` where
        given) and its horizon (``policy.eq8_horizon_s``)."""
        interval = interval_s if interval_s is not None else self.failure_model.expected_interval_s(
            cluster.alive_devices)
        return interval, eq8_horizon_s(interval_s=interval, time_left_s=time_left_s)

    def _commit(self, decision: Decision) -> None:
        """``decision``'s plan is what the job runs next (settled at once, or once told)."""
        self.plan = decision.chosen.plan
        self._rolling_back = decision.rollback is not None
        if self.settles_at_once:
            self.settle(self.plan)

    def _rolled_back(self, drafts: Drafts, snapshot: SnapshotSource, cluster: ClusterState) -> Drafts:
        """``drafts`` as rollbacks to the snapshot: each plan's transfers move every block from
        where the snapshot is read or rebuilt (the draft's ``restore``), and its transition
        (Eq. 8) is that move, the rebuilds and the steps trained again at the plan's step
        time."""
        rolled = []
        for draft in drafts.drafts:
            restore, transfers = snapshot.restore(draft.plan, cluster)
            moving_s = restore_time(restore, transfers, model=snapshot.model, profile=self.profile,
                                    cluster=cluster)
            rolled.append(replace(draft, plan=replace(draft.plan, transfers=transfers), restore=restore,
                                  moving_s=moving_s + snapshot.replayed_steps * draft.estimate.step_time_s))
        return replace(drafts, drafts=tuple(rolled), unchanged=False)

    @staticmethod
    def _from_start(drafts: Drafts, replayed_steps: int) -> Drafts:
        """``drafts`` as restarts from the job's start: no plan moves a block (each is
        drawn again where it is trained), and each transition is the steps trained again
        at the plan's step time."""
        restarted = tuple(replace(draft, plan=replace(draft.plan, transfers=()),
                                  moving_s=replayed_steps * draft.estimate.step_time_s) for draft in drafts.drafts)
        return replace(drafts, drafts=restarted, unchanged=False)


def _every_case(plan: ExecutionPlan, cluster: ClusterState) -> list[frozenset[int]]:
    """Each live worker of ``plan`` alone, then each node that holds one (its live workers)."""
    on_node: dict[int, set[int]] = {}
    for worker in cluster.alive_workers:
        on_node.setdefault(cluster.node_of_worker(worker), set()).add(worker)
    nodes = sorted({cluster.node_of_worker(w) for w in plan.workers})
    return [frozenset([w]) for w in plan.workers] + [frozenset(on_node[n]) for n in nodes if len(on_node[n]) > 1]


def checkpoint_interval(config: RecipeConfig, center: DecisionCenter) -> tuple[int, str]:
    """Steps between disk checkpoints (0: none), and in words how they were chosen:
    ``odyssey.checkpoint_interval`` as given, or Young's interval for ``center``'s plan."""
    configured = config.odyssey.checkpoint_interval
    if configured == 0:
        return 0, "none (odyssey.checkpoint_interval=0)"
    if configured is not None:
        return configured, f"every {configured} steps (odyssey.checkpoint_interval)"
    disk = config.cluster.disk_write_gb_s
    save_s = checkpoint_time_s(center.plan, center.profile, model=config.model, cluster=center.cluster,
                               disk_write_bytes_s=disk * 1e9)
    steps = center.checkpoint_interval(disk_write_bytes_s=disk * 1e9)
    return steps, (f"every {steps} steps (Young: sqrt(2 x save {save_s:.3g} s at {disk:g} GB/s a node x job MTBF "
                   f"{center.mtbf_s / SECONDS_PER_HOUR:.3g} h) / step {center.estimate.step_time_s:.3g} s; "
                   "written in the background)")
