"""Small plan builders and random-case strategies shared by the tests."""

from __future__ import annotations

from dataclasses import replace
from typing import Sequence

from hypothesis import strategies as st

from odyssey_megatron.cluster import ClusterState
from odyssey_megatron.config import OdysseyConfig
from odyssey_megatron.decision_center import DecisionCenter
from odyssey_megatron.plan import ExecutionPlan
from odyssey_megatron.planner import Decision, FailureRateModel
from odyssey_megatron.planner.reparallelize import ReparallelizeSearch
from odyssey_megatron.profile import BlockCost, ModelProfile, uniform_profile
from odyssey_megatron.testing.plans import pipelines_plan


def symmetric_plan(*, dp: int, pp: int, num_layers: int, micro_batches_per_pipeline: int) -> ExecutionPlan:
    """Megatron's layout: stage s of pipeline d on worker s * dp + d, even layers (remainder last)."""
    base, extra = divmod(num_layers, pp)
    split = tuple(base + (1 if s >= pp - extra else 0) for s in range(pp))
    return asymmetric_plan([split] * dp, [micro_batches_per_pipeline] * dp, worker_of=lambda d, s: s * dp + d)


def asymmetric_plan(
    splits: Sequence[tuple[int, ...]],
    micro_batches: Sequence[int],
    *,
    worker_of=None,
    policy: str = "reparallelize",
) -> ExecutionPlan:
    """Pipelines with the given layer counts per stage; workers numbered pipeline-major by default."""
    return pipelines_plan(splits, micro_batches, worker_of=worker_of,
                          policy=policy if worker_of is None else "initial")


def lost_last_pipeline(plan: ExecutionPlan) -> ExecutionPlan:
    """``plan`` (one stage a pipeline) with its last pipeline's stage failed: every block
    has one holder fewer."""
    *kept, last = plan.pipelines
    return replace(plan, pipelines=(*kept, replace(last, stages=(replace(last.stages[0], worker=None),))))


def costly_edges_profile(num_layers: int, *, tie_embeddings: bool = False, budget: int = 1 << 62) -> ModelProfile:
    """Identical layers (F=1, B=2, 100 B of state, 1 B of activations) and a costly
    embedding and head, so stage copies of first and last stages differ."""
    base = uniform_profile(num_layers=num_layers, forward_s=1.0, backward_s=2.0, layer_state_bytes=100,
                           activation_bytes=1, memory_budget_bytes=budget, bandwidth=10.0)
    edge = BlockCost(0.5, 1.0, 60, 0, 0, 1)
    return replace(base, embedding=edge, output=edge, tie_embeddings=tie_embeddings)


@st.composite
def layouts(draw):
    """A failure-free layout: 1-4 pipelines of 1-4 stages, possibly of different lengths,
    uneven layer splits and micro-batch counts, on TP 1 or 2, with or without tied
    embeddings; plus the cluster (spare workers included) and profile. Pipelines with
    the same split get the same number of micro-batches, as the planner balances them:
    otherwise losing the whole of an overloaded pipeline and spreading its micro-batches
    over its peers would rightly make the step faster."""
    num_layers = draw(st.integers(2, 8))
    shapes = {}  # one or two distinct layer splits: pipelines of one split are each other's peers
    for length in draw(st.lists(st.integers(1, min(4, num_layers)), min_size=1, max_size=2)):
        cuts = sorted(draw(st.sets(st.integers(1, num_layers - 1), min_size=length - 1, max_size=length - 1)))
        bounds = [0, *cuts, num_layers]
        shapes.setdefault(tuple(b - a for a, b in zip(bounds, bounds[1:])), draw(st.integers(1, 4)))
    chosen = draw(st.lists(st.sampled_from(sorted(shapes.items())), min_size=1, max_size=4))
    splits = [split for split, _ in chosen]
    micro_batches = [count for _, count in chosen]
    lengths = [len(split) for split in splits]
    tp = draw(st.sampled_from([1, 2]))
    workers = sum(lengths) + draw(st.integers(0, 2))
    plan = replace(asymmetric_plan(splits, micro_batches), tensor_parallel_size=tp)
    cluster = ClusterState(world_size=workers * tp, tensor_parallel_size=tp,
                           devices_per_node=tp * draw(st.sampled_from([1, 2, 4, 8])))
    profile = costly_edges_profile(num_layers, tie_embeddings=draw(st.booleans()))
    return plan, cluster, profile


def decide(*, current: ExecutionPlan, cluster: ClusterState, profile: ModelProfile, settings: OdysseyConfig,
           failure_model: FailureRateModel | None = None, search_time_s: float | None = None,
           interval_s: float | None = None, search: ReparallelizeSearch | None = None) -> Decision:
    """The decision a ``DecisionCenter`` running ``current`` on ``cluster`` (its failures and
    joins already marked) makes now, through the one door the CLI, the simulator and the
    controller use; ``failure_model`` and ``search`` replace the center's own."""
    center = DecisionCenter(plan=current, cluster=cluster, profile=profile, settings=settings.decisions,
                            search_time_s=search_time_s)
    if failure_model is not None:
        center.failure_model = failure_model
    if search is not None:
        center.search = search
    return center.on_failure(interval_s=interval_s)
