"""The decision center: a recipe's profile, cluster and current plan, updated on failures.

The live controller and the simulator both drive this object: build it from a recipe,
call ``on_failure`` with what the fault detector saw, run the plan it returns.
"""

from __future__ import annotations

from typing import Iterable

from odyssey_megatron.cluster import ClusterState
from odyssey_megatron.config import RecipeConfig
from odyssey_megatron.plan import ExecutionPlan
from odyssey_megatron.planner import Decision, FailureRateModel, decide, initial_plan
from odyssey_megatron.planner.reparallelize import ReparallelizeSearch
from odyssey_megatron.profile import ModelProfile, analytic_profile
from odyssey_megatron.specs import device_spec

GIB = 1024**3


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
    """Current plan and cluster state of one job; ``on_failure`` commits the next plan."""

    def __init__(self, config: RecipeConfig, *, profile: ModelProfile | None = None):
        self.config = config
        self.profile = profile if profile is not None else recipe_profile(config)
        par = config.parallel
        self.cluster = ClusterState(
            world_size=par.num_ranks,
            tensor_parallel_size=par.tensor_model_parallel_size,
            devices_per_node=config.cluster.devices_per_node,
        )
        self.failure_model = FailureRateModel(
            device_mtbf_hours=config.odyssey.device_mtbf_hours,
            learn=config.odyssey.learn_failure_rate,
        )
        self._last_event_s = 0.0
        self.search = ReparallelizeSearch(self.profile, max_layer_splits=config.odyssey.max_layer_splits)
        self.plan: ExecutionPlan = initial_plan(
            data_parallel_size=par.data_parallel_size,
            pipeline_parallel_size=par.pipeline_model_parallel_size,
            tensor_parallel_size=par.tensor_model_parallel_size,
            num_micro_batches=config.training.num_micro_batches,
            profile=self.profile,
            max_layer_splits=config.odyssey.max_layer_splits,
        )

    def on_failure(
        self, *, ranks: Iterable[int] = (), nodes: Iterable[int] = (), at_s: float | None = None
    ) -> Decision:
        """Mark ``ranks`` and every rank of ``nodes`` failed, decide, and commit the chosen plan.

        ``at_s`` is the job's clock at the failure (seconds since start); given, the failure
        and the device-hours since the previous one feed the learned failure rate.
        """
        if at_s is not None:
            if at_s < self._last_event_s:
                raise ValueError(f"failure at {at_s} s is before the previous event at {self._last_event_s} s")
            exposure = self.cluster.alive_devices * (at_s - self._last_event_s) / 3600.0
            self.failure_model.observe(failures=1, device_hours=exposure)
            self._last_event_s = at_s
        self.cluster = self.cluster.fail_ranks(ranks).fail_nodes(nodes)
        return self._decide()

    def on_join(self, *, ranks: Iterable[int]) -> Decision:
        """Mark repaired or replacement ``ranks`` alive, decide whether to use them (the
        current plan keeps training meanwhile), and commit the chosen plan."""
        self.cluster = self.cluster.repair_ranks(ranks)
        return self._decide()

    def _decide(self) -> Decision:
        decision = decide(
            current=self.plan,
            cluster=self.cluster,
            profile=self.profile,
            settings=self.config.odyssey,
            failure_model=self.failure_model,
            search=self.search,
        )
        self.plan = decision.chosen.plan
        return decision
