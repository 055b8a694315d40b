"""The step program published with a plan is what the estimator priced.

Ranks run the op lists and flags in the plan's JSON and no longer derive them, so the
program must (a) replay, on the whole plan, to the step the estimate priced, (b) run
every op of the plan once on the worker the plan names, and (c) survive its JSON round
trip; a program of another generation or with a wrong op is refused.
"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from helpers import layouts, symmetric_plan
from odyssey_megatron.cli import dumps, main
from odyssey_megatron.config import load_config
from odyssey_megatron.decision_center import DecisionCenter
from odyssey_megatron.estimator import estimate_plan
from odyssey_megatron.estimator.program import step_program
from odyssey_megatron.estimator.pipeline import fixed_order_step
from odyssey_megatron.estimator.step_schedule import step_time
from odyssey_megatron.planner import reroute_plan
from odyssey_megatron.profile import uniform_profile
from odyssey_megatron.restorer import with_sync
from odyssey_megatron.schedules.ops import WEIGHT_GRAD, Op
from odyssey_megatron.schedules.program import check_own_ops, check_program, publish, read_published
from odyssey_megatron.settings import PLAIN, Pricing

RECIPE = "recipes/llama2_7b/ascend_910b_32.yaml"
OPTIONS = [PLAIN, Pricing(decouple=True), Pricing(decouple=True, staggered=True), Pricing(staggered=True)]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=layouts(), data=st.data())
def test_the_program_replays_to_the_priced_step_on_the_whole_plan(case, data):
    """Random layouts, failure-free or rerouted, every option set: the program is a valid
    program of the plan, and replaying its op lists on the whole plan (not the one
    pipeline per class the estimator simulated) takes the pipeline time the estimate
    gives, staggered exactly where the program says so."""
    plan, cluster, profile = case
    if data.draw(st.booleans()):
        failed = data.draw(st.sets(st.sampled_from(plan.workers), min_size=1, max_size=2))
        plan = reroute_plan(plan, failed_workers=failed, profile=profile) or plan
        cluster = cluster.fail_ranks(r for w in failed if w not in plan.workers for r in cluster.worker_ranks(w))
    options = data.draw(st.sampled_from(OPTIONS))
    program = step_program(plan, profile, cluster, pricing=options)
    check_program(plan, program)
    priced = estimate_plan(plan, profile, cluster, pricing=options).pipeline_time_s
    replayed = fixed_order_step(plan, profile, cluster, {w: list(ops) for w, ops in program.ops.items()})
    assert step_time(plan, profile, cluster, replayed, staggered=program.staggered_optimizer) == pytest.approx(
        priced, rel=1e-12)
    assert program.staggered_optimizer <= options.staggered
    assert program.split_backward <= options.decouple


def test_identical_pipelines_get_their_representatives_order_renamed():
    """DP4 x PP2 prices one pipeline; each other pipeline's workers run its op list with
    their own pipeline index and micro-batch ids."""
    profile = uniform_profile(num_layers=4)
    plan = symmetric_plan(dp=4, pp=2, num_layers=4, micro_batches_per_pipeline=3)
    program = step_program(plan, profile, pricing=Pricing(decouple=True))
    first = program.ops[0]  # stage 0 of pipeline 0
    for pi in range(1, 4):
        offset = 3 * pi
        assert program.ops[pi] == tuple(op._replace(pipeline=pi, micro_batch=op.micro_batch + offset) for op in first)
    assert program.split_backward and sum(op.kind == WEIGHT_GRAD for op in first) == 3


def test_a_published_plan_round_trips_through_json():
    profile = uniform_profile(num_layers=4)
    plan = with_sync(reroute_plan(symmetric_plan(dp=3, pp=2, num_layers=4, micro_batches_per_pipeline=2),
                                  failed_workers={4}, profile=profile), profile)
    program = step_program(plan, profile, pricing=Pricing(decouple=True, staggered=True))
    again = read_published(json.loads(dumps(publish(plan, program))))
    assert again == (plan, program)


@pytest.mark.parametrize("break_it, message", [
    (lambda p: replace(p, generation=p.generation + 1), "does not belong to plan generation"),
    (lambda p: replace(p, ops={w: ops for w, ops in p.ops.items() if w != 1}), "live workers are"),
    (lambda p: replace(p, ops={**p.ops, 0: p.ops[0][1:]}), "never runs"),
    (lambda p: replace(p, ops={**p.ops, 0: p.ops[0] + p.ops[0][:1]}), "twice"),
    (lambda p: replace(p, ops={**p.ops, 0: p.ops[0] + (Op("F", 0, 0, 99),)}), "not part of plan generation"),
    (lambda p: replace(p, ops={**p.ops, 0: p.ops[0] + p.ops[1][:1], 1: p.ops[1][1:]}), "the plan gives it to 1"),
    (lambda p: replace(p, ops={**p.ops, 0: p.ops[0] + (Op("W", 1, 0, 2),)}, split_backward=True),
     "the plan gives it to 1"),
    (lambda p: replace(p, ops={**p.ops, 0: p.ops[0] + (Op("W", 1, 0, 0),)}, split_backward=True),
     "not part of plan generation"),
    (lambda p: replace(p, split_backward=True), "split_backward=True, its op lists split no backwards"),
    (lambda p: replace(p, ops={**p.ops, 0: p.ops[0] + (Op("W", 0, 0, 0),)}),
     "split_backward=False, its op lists split backwards"),
])
def test_a_program_that_does_not_fit_its_plan_is_refused(break_it, message):
    profile = uniform_profile(num_layers=2)
    plan = symmetric_plan(dp=2, pp=2, num_layers=2, micro_batches_per_pipeline=2)
    program = step_program(plan, profile)
    check_program(plan, program)
    with pytest.raises(ValueError, match=message):
        check_program(plan, break_it(program))


def _rerouted():
    """DP3 x PP2 with worker 4 (pipeline 1, stage 1) failed: workers 3 and 5 run its micro-batches."""
    profile = uniform_profile(num_layers=4)
    plan = with_sync(reroute_plan(symmetric_plan(dp=3, pp=2, num_layers=4, micro_batches_per_pipeline=2),
                                  failed_workers={4}, profile=profile), profile)
    return plan, step_program(plan, profile, pricing=Pricing(decouple=True))


def test_each_worker_alone_accepts_its_own_list_of_the_whole_program():
    plan, program = _rerouted()
    assert plan.reroutes and program.split_backward
    for worker in plan.workers:
        check_own_ops(plan, replace(program, ops={worker: program.ops[worker]}), worker)


@pytest.mark.parametrize("break_it, message", [
    (lambda ops, others: ops[1:], r"never runs 1 op\(s\) the plan gives worker 3"),
    (lambda ops, others: ops + ops[-1:], "runs .* twice on worker 3"),
    (lambda ops, others: ops + others[:1], "gives Op.* to worker 3; the plan gives it to 0"),
    (lambda ops, others: ops + (Op("F", 1, 1, 7),), "op Op.* of worker 3 is not part of plan generation"),
    (lambda ops, others: ops + (Op("W", 1, 1, 3),), "gives Op.* to worker 3; the plan gives it to 5"),
])
def test_a_worker_refuses_an_own_list_missing_an_op_with_a_foreign_one_or_one_twice(break_it, message):
    """Worker 3 (stage 1 of pipeline 0) also runs micro-batches of the failed stage 1 of pipeline 1."""
    plan, program = _rerouted()
    assert any(r.worker == 3 for r in plan.reroutes)
    mine = replace(program, ops={3: break_it(program.ops[3], program.ops[0])})
    with pytest.raises(ValueError, match=message):
        check_own_ops(plan, mine, 3)


def test_a_worker_refuses_split_backwards_its_program_does_not_announce():
    plan, program = _rerouted()
    with pytest.raises(ValueError, match="worker 3's op list splits backwards; its program says none does"):
        check_own_ops(plan, replace(program, ops={3: program.ops[3]}, split_backward=False), 3)


def test_the_decision_center_publishes_each_plan_with_its_program():
    center = DecisionCenter.from_recipe(load_config(RECIPE, []))
    first = center.program
    assert first.generation == 0 and center.program is first, "picked once per plan"
    center.on_failure(ranks=[5])
    plan, program = read_published(center.published())
    assert plan == center.plan and program.generation == plan.generation == 1
    assert program == step_program(plan, center.profile, center.cluster, pricing=Pricing(decouple=True, staggered=True))


def test_plan_json_carries_the_step_program(capsys):
    assert main(["plan", "--config", RECIPE, "--failed", "5", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    plan, program = read_published(out)
    assert plan.generation == out["generation"] == program.generation
    assert set(program.ops) == set(plan.workers) and 5 not in program.ops
