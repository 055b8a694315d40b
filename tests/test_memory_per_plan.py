"""Under the distributed optimizer each rank keeps its share of a block's optimizer state
at the block's holder count in the plan at hand, not at the recipe's DP size: a plan that
lost a holder of a block (a reroute) or gives it fewer holders (a reparallelization onto
fewer pipelines) needs more on each rank, and the planner refuses what would not fit."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from helpers import layouts, symmetric_plan
from odyssey_megatron.blocks import EMBEDDING, OUTPUT
from odyssey_megatron.cli import main
from odyssey_megatron.cluster import ClusterState
from odyssey_megatron.config import load_config
from odyssey_megatron.decision_center import DecisionCenter
from odyssey_megatron.estimator import estimate_plan
from odyssey_megatron.estimator.memory import held_profile, owner_memory
from odyssey_megatron.optimizer_shards import fullest_share, owned_ranges
from odyssey_megatron.planner import reroute_plan
from odyssey_megatron.planner.initial import initial_plan
from odyssey_megatron.planner.reparallelize import Layout, place_layout
from odyssey_megatron.profile import uniform_profile
from odyssey_megatron.profile_file import analytic_recipe_profile, recipe_profile
from odyssey_megatron.restorer import live_holdings, with_sync
from odyssey_megatron.settings import PLAIN, Pricing
from odyssey_megatron.units import GIB

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "recipes/llama2_7b/tiny_cpu.yaml"
FLAT = REPO / "tests/data/bridge/llama2_7b_pretrain.yaml"
SHARDED = Pricing(distributed_optimizer=True)


def worked_profile(num_layers: int = 2, *, budget: int = 1 << 62):
    """Layers of 100 weight bytes, 40 gradient bytes and 120 optimizer bytes, F=1 s, B=2 s,
    no activations, free edges and links: a rank's memory is its blocks' state alone."""
    base = uniform_profile(num_layers=num_layers, layer_state_bytes=100, memory_budget_bytes=budget)
    layer = replace(base.layers[0], grad_bytes=40, optimizer_bytes=120)
    return replace(base, layers=(layer,) * num_layers)


def test_a_block_held_by_four_peers_keeps_half_its_state_on_each_and_by_two_all_of_it():
    profile = worked_profile()
    # two layers a rank: 2 x (100 + 40) bytes of weights and gradients, then the optimizer state
    for dp, optimizer_bytes in ((4, 2 * 60), (3, 2 * 80), (2, 2 * 120), (1, 2 * 120)):
        plan = with_sync(symmetric_plan(dp=dp, pp=1, num_layers=2, micro_batches_per_pipeline=1), profile)
        sharded = estimate_plan(plan, profile, pricing=SHARDED)
        assert set(sharded.peak_memory_bytes) == {(280 + optimizer_bytes,)}, dp
        assert estimate_plan(plan, profile).peak_memory_bytes[0] == (520,)  # a full copy without it


def test_a_reroute_prices_the_survivors_of_a_stage_that_lost_a_holder_at_the_larger_share():
    profile = worked_profile()
    plan = with_sync(symmetric_plan(dp=4, pp=1, num_layers=2, micro_batches_per_pipeline=3), profile)
    rerouted = with_sync(reroute_plan(plan, failed_workers={3}, profile=profile), profile)
    assert rerouted.holder_counts(profile) == {0: 3, 1: 3, EMBEDDING: 3, OUTPUT: 3}
    before = estimate_plan(plan, profile, pricing=SHARDED).peak_memory_bytes
    after = estimate_plan(rerouted, profile, pricing=SHARDED).peak_memory_bytes
    assert before == ((400,),) * 4
    assert after == ((440,), (440,), (440,), (None,))  # 2 x 80: a third of each layer's state more


def test_a_layouts_split_is_checked_at_its_own_holder_counts():
    """One pipeline of two stages holds each layer once: a full copy, 260 bytes a stage.
    Four pipelines of one stage: half of it on each of 4 holders, 400 bytes; two: 520."""
    profile = worked_profile(budget=450)
    kwargs = dict(tensor_parallel_size=1, num_micro_batches=4, profile=profile, max_layer_splits=16, pricing=SHARDED)
    assert initial_plan(data_parallel_size=4, pipeline_parallel_size=1, **kwargs).pipelines[0].layer_counts == (2,)
    with pytest.raises(ValueError, match="no split of 2 layers over 1 stages fits"):
        initial_plan(data_parallel_size=2, pipeline_parallel_size=1, **kwargs)
    with pytest.raises(ValueError, match="no split of 2 layers over 1 stages fits"):
        initial_plan(data_parallel_size=4, pipeline_parallel_size=1, **{**kwargs, "pricing": PLAIN})
    assert initial_plan(data_parallel_size=1, pipeline_parallel_size=2, **kwargs).pipelines[0].layer_counts == (1, 1)


def test_holder_counts_of_a_layout_are_those_of_its_plan_a_tied_embedding_held_by_first_and_last_stages():
    profile = replace(worked_profile(num_layers=4), tie_embeddings=True)
    assert profile.pipeline_holder_counts([1, 3, 3]) == {EMBEDDING: 5, 0: 3, 1: 3, 2: 3, 3: 3, OUTPUT: 3}
    plan = symmetric_plan(dp=3, pp=2, num_layers=4, micro_batches_per_pipeline=1)
    assert profile.pipeline_holder_counts([2, 2, 2]) == plan.holder_counts(profile)


def test_a_block_moved_to_a_new_holder_carries_the_share_it_keeps_there():
    """Two pipelines of one stage on workers 0 and 1 become four, workers 2 and 3 joining:
    each receives both layers, 100 weight bytes and, of 4 holders, half of the 120
    optimizer bytes each; a full copy without the distributed optimizer."""
    profile = worked_profile()
    current = with_sync(symmetric_plan(dp=2, pp=1, num_layers=2, micro_batches_per_pipeline=2), profile)
    cluster = ClusterState(world_size=4)
    holdings = live_holdings(current, cluster=cluster, profile=profile)
    layout = Layout(splits=((2,),) * 4, micro_batches=(1,) * 4, est_step_time_s=0.0)
    for pricing, layer_bytes in ((SHARDED, 100 + 60), (PLAIN, 100 + 120)):
        plan = place_layout(layout, current=current, holdings=holdings, cluster=cluster, profile=profile,
                            pricing=pricing)
        moved = sorted((t.dst, t.layer, t.bytes) for t in plan.transfers if t.bytes)
        assert moved == [(2, 0, layer_bytes), (2, 1, layer_bytes), (3, 0, layer_bytes), (3, 1, layer_bytes)]


@settings(max_examples=60, deadline=None)
@given(layouts(), st.data())
def test_no_rank_keeps_more_optimizer_state_than_it_is_priced_for_and_the_fullest_keeps_exactly_that(case, data):
    """Brute force: every block's ranges cut over its actual holders (``owned_ranges``), in
    a failure-free layout or after any failures it can be rerouted around."""
    plan, _, profile = case
    assert profile.pipeline_holder_counts([p.num_stages for p in plan.pipelines]) == plan.holder_counts(profile)
    sizes = st.integers(0, 5000)
    profile = replace(profile, layers=tuple(replace(c, optimizer_bytes=data.draw(sizes)) for c in profile.layers),
                      embedding=replace(profile.embedding, optimizer_bytes=data.draw(sizes)),
                      output=replace(profile.output, optimizer_bytes=data.draw(sizes)))
    failed = data.draw(st.sets(st.sampled_from(plan.workers), max_size=len(plan.workers) - 1))
    rerouted = reroute_plan(plan, failed_workers=failed, profile=profile) if failed else plan
    if rerouted is None:
        return
    holders: dict = {}
    for worker, blocks in rerouted.holdings(profile).items():
        for block in blocks:
            holders.setdefault(block, []).append(worker)
    held = held_profile(rerouted, profile, pricing=SHARDED)
    priced = owner_memory(rerouted, held)
    kept_by: dict = {}
    for block, workers in holders.items():
        kept = {w: sum(end - start for start, end in r)
                for w, r in owned_ranges(profile.block(block).optimizer_bytes, workers).items()}
        assert held.block(block).optimizer_bytes == max(kept.values()), block
        for w, count in kept.items():
            kept_by.setdefault(w, []).append((block, count))
    for worker, kept in kept_by.items():
        static = sum(profile.block(b).param_bytes + profile.block(b).grad_bytes for b, _ in kept)
        assert static + sum(count for _, count in kept) <= priced[worker][0]
        assert priced[worker][0] == static + sum(held.block(b).optimizer_bytes for b, _ in kept)
    assert held_profile(rerouted, profile, pricing=PLAIN) is profile


TIGHT = ["parallel.data_parallel_size=4", "parallel.pipeline_model_parallel_size=2",
         "odyssey.distributed_optimizer=true", "odyssey.decoupled_weight_grads=false",
         "odyssey.staggered_optimizer=false", "odyssey.memory_budget_gib=0.0091"]
"""The tiny recipe on DP 4 x PP 2, its budget (9,771,050 bytes) between a reroute's peak
with stage 0's state at 2 of its 4 holders' share and at 2 of 3."""


def test_the_recipe_profile_holds_each_blocks_whole_optimizer_state():
    profile = recipe_profile(load_config(TINY, TIGHT))
    layer = profile.layers[0]
    assert layer.optimizer_bytes == 3 * layer.grad_bytes == 594_432  # 12 bytes a parameter, fp32 gradients


def test_a_reroute_that_fits_only_at_the_recipes_share_is_refused_and_the_chosen_plan_fits_at_its_own():
    config = load_config(TINY, TIGHT)
    center = DecisionCenter.from_recipe(config)
    profile, budget = center.profile, center.profile.memory_budget_bytes
    rerouted = with_sync(reroute_plan(center.plan, failed_workers={3}, profile=profile), profile)
    peak = estimate_plan(rerouted, profile, center.cluster, pricing=config.odyssey.pricing).peak_memory_bytes
    # stage 0 (embedding, layers 0-3) lost one of its 4 holders: each survivor keeps 2/3, not 2/4
    whole = analytic_recipe_profile(config, device="cpu")
    more = sum(fullest_share(whole.block(b).optimizer_bytes, 3) - fullest_share(whole.block(b).optimizer_bytes, 4)
               for b in (EMBEDDING, 0, 1, 2, 3))
    assert more == 4 * (396_288 - 297_216) + (262_144 - 196_608) == 461_824
    assert peak[0][0] == 10_010_624 > budget > peak[0][0] - more
    decision = center.on_failure(ranks=[3])
    assert decision.chosen.policy != "reroute" and "reroute exceeds the memory budget on a peer" in decision.note
    assert decision.chosen.estimate.max_peak_memory_bytes <= budget
    again = estimate_plan(decision.chosen.plan, profile, center.cluster, pricing=config.odyssey.pricing)
    assert again.peak_memory_bytes == decision.chosen.estimate.peak_memory_bytes


def _plan_json(capsys, *args: str) -> dict:
    code = main(["plan", "--config", str(FLAT), "cluster.num_nodes=1", *args, "--json"])
    out, err = capsys.readouterr()
    assert code == 0, err
    return json.loads(out)


@pytest.mark.timeout(300)
def test_bridges_7b_on_one_node_after_a_failure_is_priced_with_the_share_its_three_holders_keep(capsys):
    """Llama-2 7B, TP 2 on 8 H100s (DP 4): every rank keeps half of its optimizer state
    (18.8 GiB of 37.7) and peaks at 48.0 GiB. After rank 3 fails, three pipelines hold each
    block: 2/3 of it, 6.3 GiB more a rank. At a 60 GiB budget the reroute (58.3 GiB at the
    recipe's share, 64.6 GiB at its own) does not fit; the three whole pipelines do."""
    initial = _plan_json(capsys, "odyssey.memory_budget_gib=60")
    after = _plan_json(capsys, "odyssey.memory_budget_gib=60", "--failed", "3")
    whole = analytic_recipe_profile(load_config(FLAT, ["cluster.num_nodes=1"]), device="h100-80gb")
    blocks = (EMBEDDING, *range(32), OUTPUT)
    assert round(sum(whole.block(b).optimizer_bytes for b in blocks) / GIB, 1) == 37.7
    more = sum(fullest_share(whole.block(b).optimizer_bytes, 3) - fullest_share(whole.block(b).optimizer_bytes, 4)
               for b in blocks)
    assert round(more / GIB, 2) == 6.28
    peak = initial["est_peak_memory_bytes"][0][0]
    assert {p for stages in initial["est_peak_memory_bytes"] for p in stages} == {peak}
    assert round(peak / GIB, 1) == 48.0
    assert after["policy"] == "reparallelize" and len(after["pipelines"]) == 3
    assert after["est_peak_memory_bytes"] == [[peak + more]] * 3
    assert max(p for stages in after["est_peak_memory_bytes"] for p in stages) <= after["memory_budget_bytes"]
    assert initial["est_optimizer_state_bytes"] + more == after["est_optimizer_state_bytes"]


def test_plan_prints_the_optimizer_state_a_rank_keeps_at_the_plans_own_holders(capsys):
    lines = {}
    for failed in ([], ["--failed", "3"]):
        code = main(["plan", "--config", str(FLAT), "cluster.num_nodes=1", "odyssey.memory_budget_gib=60", *failed])
        assert code == 0
        lines[len(failed)] = [line for line in capsys.readouterr().out.splitlines() if line.startswith("  optimizer")]
    assert lines[0] == ["  optimizer   18.8 GiB per rank of the 37.7 GiB a full copy holds (distributed optimizer: "
                        "every part on 2 of each block's 4 holders)"]
    assert lines[2] == ["  optimizer   25.1 GiB per rank of the 37.7 GiB a full copy holds (distributed optimizer: "
                        "every part on 2 of each block's 3 holders)"]
    assert main(["plan", "--config", str(FLAT), "cluster.num_nodes=1", "optimizer.use_distributed_optimizer=false",
                 "ddp.use_distributed_optimizer=false", "model.pipeline_model_parallel_size=2"]) == 0
    assert "  optimizer   18.8 GiB per rank (a full copy of its stage's state)" in capsys.readouterr().out.splitlines()
