"""Reroute pricing at scale prices as the whole plan does.

``pricing_window`` keeps the pipelines that decide a reroute's cost and
``RerouteCost`` prices one touched component of each shape; both must give exactly
``rerouted_makespan`` of the whole rerouted plan, wherever the failures sit in their
pipelines (normalization prices every such move), with and without split backwards and
staggered optimizer steps.
"""

from __future__ import annotations

from dataclasses import replace

from helpers import costly_edges_profile, symmetric_plan
from hypothesis import given, settings
from hypothesis import strategies as st

from odyssey_megatron.cluster import ClusterState
from odyssey_megatron.estimator.distinct import sub_plan, touched_pipelines
from odyssey_megatron.estimator.step_schedule import rerouted_makespan
from odyssey_megatron.plan import PipelinePlan, StagePlan
from odyssey_megatron.planner import reroute_plan
from odyssey_megatron.planner.reroute_pricing import RerouteCost, alike_components, pricing_window
from odyssey_megatron.settings import Pricing

PROFILE = replace(costly_edges_profile(8), p2p_bytes=3, intra_node_bandwidth=10.0, inter_node_bandwidth=2.0)
"""Links across nodes cost more, so who shares a node shows in the price."""


@st.composite
def failures(draw):
    """(layout naming its failed workers, cluster): a symmetric layout of 4 to 12
    pipelines, a node or a few workers failed, each failure maybe moved to another stage
    of its pipeline (as normalization tries)."""
    dp, pp = draw(st.integers(4, 12)), draw(st.integers(2, 4))
    plan = symmetric_plan(dp=dp, pp=pp, num_layers=8, micro_batches_per_pipeline=draw(st.integers(1, 4)))
    cluster = ClusterState(world_size=dp * pp, devices_per_node=draw(st.sampled_from([1, 2, 4, 8])))
    if draw(st.booleans()):
        cluster = cluster.fail_nodes([draw(st.integers(0, cluster.num_nodes - 1))])
    else:
        cluster = cluster.fail_ranks(draw(st.sets(st.integers(0, dp * pp - 1), min_size=1, max_size=4)))
    pipelines = list(plan.pipelines)
    for pi, pipeline in enumerate(pipelines):
        stages = list(pipeline.stages)
        for si, stage in enumerate(pipeline.stages):
            if stage.worker in cluster.failed_workers and draw(st.booleans()):
                sj = draw(st.integers(0, pp - 1))
                stages[si], stages[sj] = StagePlan(stages[sj].worker, stages[si].layers), \
                    StagePlan(stages[si].worker, stages[sj].layers)
        pipelines[pi] = PipelinePlan(tuple(stages), pipeline.micro_batches)
    return replace(plan, pipelines=tuple(pipelines)), cluster


@settings(max_examples=60, deadline=None)
@given(failures(), st.booleans(), st.booleans())
def test_window_and_alike_components_price_as_the_whole_plan(case, decouple, staggered):
    layout, cluster = case
    failed = cluster.failed_workers
    rerouted = reroute_plan(layout, failed_workers=failed, profile=PROFILE)
    window = sub_plan(layout, pricing_window(layout, failed=failed, cluster=cluster))
    rerouted_window = reroute_plan(window, failed_workers=failed, profile=PROFILE)
    assert (rerouted is None) == (rerouted_window is None)
    if rerouted is None:
        return
    pricing = Pricing(decouple=decouple, staggered=staggered)
    whole = rerouted_makespan(rerouted, PROFILE, cluster, pricing=pricing)
    assert rerouted_makespan(rerouted_window, PROFILE, cluster, pricing=pricing) == whole
    cost = RerouteCost(PROFILE, cluster, pricing=pricing, memo={})
    assert cost(rerouted) == whole
    assert cost(rerouted_window) == whole  # remembered by shape: the same key, the same price


def test_a_node_failure_is_priced_from_one_component_of_each_shape():
    # DP 16 x PP 4 on nodes of 4: node 5 holds stage 1 of pipelines 4-7. Each failed
    # pipeline's 2 micro-batches go to two peers; the first failed pipeline's peers
    # (0, 1) come before it, the others' peers after, so there are two shapes.
    plan = symmetric_plan(dp=16, pp=4, num_layers=8, micro_batches_per_pipeline=2)
    cluster = ClusterState(world_size=64, devices_per_node=4).fail_nodes([5])
    rerouted = reroute_plan(plan, failed_workers=cluster.failed_workers, profile=PROFILE)
    cut, _ = alike_components(rerouted, cluster)
    assert touched_pipelines(rerouted) == set(range(12))  # peers 0,1 <- 4; 2,3 <- 5; 8,9 <- 6; 10,11 <- 7
    assert len(cut.pipelines) == 16 - 12 + 2 * 3
