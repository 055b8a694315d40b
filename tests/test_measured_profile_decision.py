"""A measured profile changes the decision where the analytic one was wrong: a worked case.

The analytic profile takes the fixed cost of an op (launching it, the schedule's
bookkeeping) as nil; ``odyssey profile`` measured 0.22 ms per forward or backward op for
the tiny recipe on this 2-core CPU machine, beside 1-2 ms of a layer's work. After worker
7 of the tiny recipe's DP2 x PP4 fails (7 survivors, 16 micro-batches), the analytic
profile picks a 3-stage pipeline beside two 2-stage ones. Each micro-batch of a 3-stage
pipeline pays the fixed cost three times per pass, so with the measured cost the planner
picks three 2-stage pipelines and a 1-stage one instead, which the measured profile
prices faster, and the analytic one slower, than the analytic choice.
"""

from __future__ import annotations

from dataclasses import replace

from odyssey_megatron.config import load_config
from odyssey_megatron.decision_center import DecisionCenter
from odyssey_megatron.estimator import estimate_plan
from odyssey_megatron.profile_file import (
    analytic_recipe_profile,
    profile_json,
    recipe_measured_for,
    recipe_profile,
    write_profile,
)

TINY = "recipes/llama2_7b/tiny_cpu.yaml"
OVERRIDES = ["training.global_batch_size=32"]
MEASURED_OP_OVERHEAD_S = 2.2e-4
"""What ``odyssey profile --config tiny_cpu.yaml`` measured on this machine per op."""


def layout(plan) -> tuple:
    """Every pipeline's (worker, layers) per stage and its micro-batches."""
    return tuple((tuple((s.worker, s.layers) for s in p.stages), p.micro_batches) for p in plan.pipelines)


def test_the_measured_op_cost_picks_shallower_pipelines_that_are_faster(tmp_path):
    analytic_config = load_config(TINY, OVERRIDES)
    analytic = analytic_recipe_profile(analytic_config, device="cpu")
    assert analytic.op_overhead_s == 0.0
    measured = replace(analytic, op_overhead_s=MEASURED_OP_OVERHEAD_S)
    path = tmp_path / "measured.json"
    write_profile(path, profile_json(measured, measured_for=recipe_measured_for(analytic_config),
                                     source={"op_overhead_s": "measured by odyssey profile"}))
    measured_config = load_config(TINY, [*OVERRIDES, f"odyssey.profile={path}"])
    assert recipe_profile(measured_config) == measured

    chosen = {}
    for name, config in (("analytic", analytic_config), ("measured", measured_config)):
        center = DecisionCenter.from_recipe(config)  # the profile the recipe names, else the analytic one
        center.search_time_s = 0.0
        chosen[name] = center.on_failure(ranks=[7], interval_s=3600.0).chosen.plan
        assert chosen[name].policy == "reparallelize"

    assert layout(chosen["analytic"]) == (
        (((0, (0, 3)), (2, (3, 6)), (6, (6, 8))), tuple(range(0, 7))),
        (((1, (0, 4)), (4, (4, 8))), tuple(range(7, 12))),
        (((3, (0, 4)), (5, (4, 8))), tuple(range(12, 16))),
    )
    assert layout(chosen["measured"]) == (
        (((0, (0, 4)), (4, (4, 8))), tuple(range(0, 5))),
        (((1, (0, 4)), (5, (4, 8))), tuple(range(5, 10))),
        (((2, (0, 4)), (6, (4, 8))), tuple(range(10, 14))),
        (((3, (0, 8)),), tuple(range(14, 16))),
    )

    settings = analytic_config.odyssey
    center = DecisionCenter.from_recipe(measured_config)
    cluster = center.cluster.fail_ranks([7])

    def step_s(plan, profile) -> float:
        return estimate_plan(plan, profile, cluster, pricing=settings.pricing).step_time_s

    assert step_s(chosen["measured"], measured) < step_s(chosen["analytic"], measured)
    assert step_s(chosen["analytic"], analytic) < step_s(chosen["measured"], analytic)
