"""The online profile: ranks time their ops through Megatron-Core's timer hooks, and the
controller rescales the decision center's profile to what they measured."""

from __future__ import annotations

from dataclasses import replace

import pytest

from helpers import symmetric_plan
from odyssey_megatron.cli import dumps
from odyssey_megatron.estimator.program import step_program
from odyssey_megatron.profile import uniform_profile
from odyssey_megatron.restorer import with_sync
from odyssey_megatron.runtime.control.online_profile import SMOOTHING, OnlineProfile, Scales
from odyssey_megatron.runtime.protocol.messages import StepReport
from odyssey_megatron.runtime.rank.op_timers import BACKWARD, FORWARD, OPTIMIZER, WEIGHT_GRAD
from odyssey_megatron.schedules.program import publish
from odyssey_megatron.settings import Pricing
from odyssey_megatron.testing.local_world import run_world
from runtime_cases import op_times

MICRO_BATCHES = 4


def _published(decouple: bool) -> tuple[str, bool]:
    plan = symmetric_plan(dp=1, pp=2, num_layers=2, micro_batches_per_pipeline=MICRO_BATCHES)
    profile = uniform_profile(num_layers=2)
    plan = with_sync(plan, profile)
    program = step_program(plan, profile, pricing=Pricing(decouple=decouple, staggered=False))
    return dumps(publish(plan, program)), program.split_backward


@pytest.mark.timeout(300)
@pytest.mark.parametrize("schedule, decouple", [("megatron", False), ("odyssey", True)])
def test_every_op_of_either_executor_is_timed_once_per_step(schedule, decouple):
    """Megatron's 1F1B and the op-list executor call the same timer hooks: per step, each
    rank times one forward and one backward per micro-batch (and one weight-gradient op
    each where backwards are split) and one Adam step; and counts each op of its list
    once (the position its heartbeat carries)."""
    published, split = _published(decouple)
    assert split == decouple  # the op-list executor's case runs W ops
    results = run_world(op_times, 2, published, schedule)
    assert {r["executor"] for r in results} == {"MegatronPipelineSchedule" if schedule == "megatron"
                                                else "StepExecutor"}
    for result in results:
        for taken in result["taken"]:
            counts = {name: count for name, (_, count) in taken.items()}
            assert counts == {FORWARD: MICRO_BATCHES, BACKWARD: MICRO_BATCHES,
                              WEIGHT_GRAD: MICRO_BATCHES if split else 0, OPTIMIZER: 1}
            assert all(seconds > 0 for seconds, count in taken.values() if count)
        assert result["positions"] == [(0, result["ops"]), (1, result["ops"])]


def _report(rank: int, *, forward_s: float, backward_s: float, weight_grad_s: float = 0.0,
            optimizer_s: float) -> StepReport:
    return StepReport(rank, (), (), (), forward_s, MICRO_BATCHES, backward_s, MICRO_BATCHES, weight_grad_s,
                      MICRO_BATCHES if weight_grad_s else 0, optimizer_s, 1e-3)


def test_factors_are_measured_over_predicted_and_rescale_the_profile():
    """Both stages measured 3x slower forwards, 2x slower backwards (split: B + W) and 5x
    slower Adam than the profile: the rescaled profile predicts what was measured; a
    second step moves the factors by the moving average's weight."""
    plan = symmetric_plan(dp=1, pp=2, num_layers=4, micro_batches_per_pipeline=MICRO_BATCHES)
    base = replace(uniform_profile(num_layers=4), optimizer_s_per_param_byte=1e-9)
    online = OnlineProfile(base)
    holdings = plan.holdings(base)
    reports = []
    for si, stage in enumerate(plan.pipelines[0].stages):
        times = base.stage_times(*stage.layers, first=si == 0, last=si == 1)
        reports.append(_report(stage.worker, forward_s=3 * MICRO_BATCHES * times.forward_s,
                               backward_s=1.5 * MICRO_BATCHES * times.backward_s,
                               weight_grad_s=0.5 * MICRO_BATCHES * times.backward_s,
                               optimizer_s=5 * base.optimizer_s(holdings[stage.worker])))
    online.observe(plan, reports)
    assert online.scales.as_tuple() == pytest.approx((3.0, 2.0, 5.0))
    rescaled = online.profile()
    for si, stage in enumerate(plan.pipelines[0].stages):
        before = base.stage_times(*stage.layers, first=si == 0, last=si == 1)
        after = rescaled.stage_times(*stage.layers, first=si == 0, last=si == 1)
        assert after.forward_s == pytest.approx(3 * before.forward_s)
        assert after.backward_s == pytest.approx(2 * before.backward_s)
        assert rescaled.optimizer_s(holdings[stage.worker]) == pytest.approx(5 * base.optimizer_s(
            holdings[stage.worker]))
    assert rescaled.intra_node_bandwidth == base.intra_node_bandwidth  # links are not timed
    online.observe(plan, [replace(r, forward_s=r.forward_s / 3) for r in reports])  # forwards now as profiled
    assert online.scales.forward == pytest.approx(3.0 + SMOOTHING * (1.0 - 3.0))
    assert online.scales.backward == pytest.approx(2.0)


def test_a_kind_nobody_ran_keeps_its_factor_and_idle_ranks_are_ignored():
    plan = symmetric_plan(dp=1, pp=2, num_layers=4, micro_batches_per_pipeline=MICRO_BATCHES)
    online = OnlineProfile(uniform_profile(num_layers=4))
    online.scales = Scales(2.0, 2.0, 2.0)
    online.steps_observed = 1
    idle = _report(7, forward_s=100.0, backward_s=100.0, optimizer_s=100.0)  # worker 7 holds no stage
    online.observe(plan, [idle, _report(0, forward_s=0.0, backward_s=0.0, optimizer_s=0.0)])
    assert online.scales == Scales(2.0, 2.0, 2.0)


def test_scales_differ_beyond_a_relative_change():
    assert Scales(1.0, 1.0, 1.0).differs(Scales(1.0, 1.0, 1.2), by=0.1)
    assert not Scales(1.05, 0.95, 1.0).differs(Scales(1.0, 1.0, 1.0), by=0.1)
