"""The decision center: a job's profile, cluster and current plan, updated on failures.

The live controller and the simulator both drive this object: build it from a recipe
(``DecisionCenter.from_recipe``) or around a running plan, call ``on_failure`` with what
the fault detector saw, and publish the plan it returns with its step program
(``published``): the op lists and flags the plan was priced with, which ranks run as they
are.
"""

from __future__ import annotations

from typing import Iterable

from odyssey_megatron.cluster import ClusterState
from odyssey_megatron.config import OdysseyConfig, RecipeConfig
from odyssey_megatron.estimator.program import step_program
from odyssey_megatron.plan import ExecutionPlan
from odyssey_megatron.planner import Decision, FailureRateModel, decide, initial_plan
from odyssey_megatron.planner.reparallelize import ReparallelizeSearch
from odyssey_megatron.profile import ModelProfile, analytic_profile
from odyssey_megatron.schedules.program import StepProgram, publish
from odyssey_megatron.specs import device_spec
from odyssey_megatron.units import GIB, SECONDS_PER_HOUR


def recipe_profile(config: RecipeConfig) -> ModelProfile:
    """The analytic profile of the recipe's model on its device."""
    model = config.model
    budget = config.odyssey.memory_budget_gib
    return analytic_profile(
        num_layers=model.num_layers,
        hidden_size=model.hidden_size,
        ffn_hidden_size=model.ffn_hidden_size,
        num_attention_heads=model.num_attention_heads,
        num_query_groups=model.num_query_groups,
        vocab_size=model.vocab_size,
        seq_length=model.seq_length,
        tie_embeddings=model.tie_embeddings,
        dtype_bytes=model.dtype_bytes,
        micro_batch_size=config.training.micro_batch_size,
        tensor_parallel_size=config.parallel.tensor_model_parallel_size,
        device=device_spec(config.cluster.device),
        memory_budget_bytes=None if budget is None else int(budget * GIB),
    )


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
        settings: OdysseyConfig,
        search_time_s: float | None = None,
    ):
        """A job running ``plan`` on ``cluster``. ``search_time_s`` replaces the measured
        search time in every transition (the simulator needs determinism)."""
        self.plan = plan
        self.cluster = cluster
        self.profile = profile
        self.settings = settings
        self.search_time_s = search_time_s
        self.failure_model = FailureRateModel(device_mtbf_hours=settings.device_mtbf_hours,
                                              learn=settings.learn_failure_rate)
        self.search = ReparallelizeSearch(profile, max_layer_splits=settings.max_layer_splits)
        self._last_event_s = 0.0
        self._program: tuple[ExecutionPlan, StepProgram] | None = None
        """The plan the program was last computed for, and the program."""

    @classmethod
    def from_recipe(cls, config: RecipeConfig, *, profile: ModelProfile | None = None) -> "DecisionCenter":
        """The recipe's job before any failure: its analytic profile (or ``profile``), the
        whole cluster and Megatron's symmetric DP x PP plan."""
        profile = profile if profile is not None else recipe_profile(config)
        par = config.parallel
        plan = initial_plan(
            data_parallel_size=par.data_parallel_size,
            pipeline_parallel_size=par.pipeline_model_parallel_size,
            tensor_parallel_size=par.tensor_model_parallel_size,
            num_micro_batches=config.training.num_micro_batches,
            profile=profile,
            max_layer_splits=config.odyssey.max_layer_splits,
        )
        cluster = ClusterState(
            world_size=par.num_ranks,
            tensor_parallel_size=par.tensor_model_parallel_size,
            devices_per_node=config.cluster.devices_per_node,
        )
        return cls(plan=plan, cluster=cluster, profile=profile, settings=config.odyssey)

    def on_failure(
        self, *, ranks: Iterable[int] = (), nodes: Iterable[int] = (), at_s: float | None = None,
        interval_s: float | None = None,
    ) -> Decision:
        """Mark ``ranks`` and every rank of ``nodes`` failed, decide, and commit the chosen plan.

        ``at_s`` is the job's clock at the failure (seconds since start); given, the failure
        and the device-hours since the previous event feed the learned failure rate.
        ``interval_s`` replaces the expected time to the next failure in Eq. 8 (hindsight:
        the simulator's oracle knows it). Raises UnrecoverableFailure.
        """
        self._observe(failures=1, at_s=at_s)
        self.cluster = self.cluster.fail_ranks(ranks).fail_nodes(nodes)
        return self._decide(interval_s)

    def on_join(self, *, ranks: Iterable[int], at_s: float | None = None, interval_s: float | None = None) -> Decision:
        """Mark repaired or replacement ``ranks`` alive, decide whether to use them (the
        current plan keeps training meanwhile), and commit the chosen plan. ``at_s`` and
        ``interval_s`` as in ``on_failure``; a join adds exposure, not a failure."""
        self._observe(failures=0, at_s=at_s)
        self.cluster = self.cluster.repair_ranks(ranks)
        return self._decide(interval_s)

    def restart_on(self, plan: ExecutionPlan) -> None:
        """The job restarted from a checkpoint onto ``plan`` (no in-memory recovery existed)."""
        self.plan = plan

    @property
    def program(self) -> StepProgram:
        """The current plan's step program: the op lists and flags (split backward,
        staggered optimizer) its estimate priced, picked once per plan. Computed when
        first asked for: the simulator never runs one."""
        if self._program is None or self._program[0] is not self.plan:
            self._program = self.plan, step_program(self.plan, self.profile, self.cluster,
                                                    decouple=self.settings.decoupled_weight_grads,
                                                    staggered=self.settings.staggered_optimizer)
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

    def _decide(self, interval_s: float | None) -> Decision:
        decision = decide(
            current=self.plan,
            cluster=self.cluster,
            profile=self.profile,
            settings=self.settings,
            failure_model=self.failure_model,
            search_time_s=self.search_time_s,
            interval_s=interval_s,
            search=self.search,
        )
        self.plan = decision.chosen.plan
        return decision
