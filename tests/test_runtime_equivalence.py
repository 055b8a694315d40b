"""Plans executed on real Megatron-Core over gloo equal one process running every micro-batch.

For each plan: the loss of every micro-batch, every gradient after the first step's DP
sync and clipping (on every rank that holds it) and every parameter after three clipped
Adam steps match the single-process reference (fp32). Parameters are held to 1% of one
Adam step (lr / 100): Adam divides by sqrt(v), so on an element whose gradient is near
zero a last-bit difference in a summation order (TP all-reduce, DP sum) moves the update
by up to lr, which is rounding, not a wrong gradient.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from helpers import asymmetric_plan, symmetric_plan
from odyssey_megatron.cli import dumps
from odyssey_megatron.estimator.program import step_program
from odyssey_megatron.planner.reroute import reroute_plan
from odyssey_megatron.profile import uniform_profile
from odyssey_megatron.restorer import with_sync
from odyssey_megatron.schedules.program import publish
from odyssey_megatron.settings import Pricing
from odyssey_megatron.testing.local_world import run_world
from runtime_cases import LR, last_stage_steps_first, reference, run_plan

pytestmark = pytest.mark.timeout(600)


def _shard_of(full: torch.Tensor, name: str, like: torch.Tensor, tp_rank: int, tp_size: int) -> torch.Tensor:
    if full.shape == like.shape:
        return full
    dim = next(d for d in range(full.dim()) if full.shape[d] != like.shape[d])
    if name.endswith("linear_fc1.weight"):
        gate, up = full.chunk(2, dim=dim)
        return torch.cat([gate.chunk(tp_size, dim=dim)[tp_rank], up.chunk(tp_size, dim=dim)[tp_rank]], dim=dim)
    return full.chunk(tp_size, dim=dim)[tp_rank]


def published_json(plan, profile, *, decouple=True, staggered=False) -> str:
    """``plan`` as the decision center publishes it: with sync units and the step program
    it prices (``odyssey.decoupled_weight_grads``, ``odyssey.staggered_optimizer``)."""
    plan = with_sync(plan, profile)
    return dumps(publish(plan, step_program(plan, profile, pricing=Pricing(decouple=decouple, staggered=staggered))))


def _check(plan, workers, schedule="auto", tie_embeddings=False, overlap=False, decouple=True, staggered=False,
           distributed_optimizer=False):
    """Runs each rank from the published JSON alone; Megatron's 1F1B is published plain."""
    profile = replace(uniform_profile(num_layers=plan.num_layers), tie_embeddings=tie_embeddings)
    published = published_json(plan, profile, decouple=decouple and schedule != "megatron", staggered=staggered)
    expected = run_world(reference, 1, plan.num_layers, plan.num_micro_batches, tie_embeddings)[0]
    world = len(workers) * plan.tensor_parallel_size
    results = run_world(run_plan, world, published, tuple(workers), schedule, tie_embeddings, overlap,
                        distributed_optimizer)
    for step in range(len(expected["losses"])):
        got = {}
        for r in results:
            got.update(r["losses"][step])
        assert sorted(got) == sorted(expected["losses"][step]), "every micro-batch's loss exactly once"
        for m, loss in expected["losses"][step].items():
            assert got[m] == pytest.approx(loss, rel=1e-6)
    seen = set()
    for r in results:
        # Sharded, clipping scales the ranges this peer steps, not the gradients it does not use.
        for kind in ("params",) if distributed_optimizer else ("grads", "params"):
            for name, value in r[kind].items():
                value = torch.from_numpy(value)
                full = torch.from_numpy(expected[kind][name])
                want = _shard_of(full, name, value, r["tp_rank"], r["tp_size"])
                atol = 1e-6 if kind == "grads" else LR / 100
                torch.testing.assert_close(value, want, rtol=1e-5, atol=atol, msg=lambda m, kind=kind, name=name: f"{kind} {name}: {m}")
                seen.add(name)
    assert seen == set(expected["params"]), "every parameter is held somewhere"
    for r in results:
        for in_flight, units in r["started_during_backward"]:
            assert in_flight == (units if overlap else 0), "overlap starts every unit's all-reduce in backward"
    if staggered:
        assert {r["retaken_steps"] for r in results} == {expected["clipped"]}, "every clipped step retaken, on every rank"
    return results


@pytest.mark.parametrize("schedule", ["megatron", "odyssey"])
def test_symmetric_dp2_pp2(schedule):
    _check(symmetric_plan(dp=2, pp=2, num_layers=4, micro_batches_per_pipeline=3), range(4), schedule)


@pytest.mark.parametrize("schedule", ["megatron", "odyssey"])
def test_asymmetric_two_and_three_stages_uneven_splits_and_batches(schedule):
    # Megatron's schedule with DP sync overlapped with backward; the executor without.
    _check(asymmetric_plan([(4, 2), (1, 3, 2)], [5, 2]), range(5), schedule, overlap=schedule == "megatron")


@pytest.mark.parametrize("decouple,staggered", [(False, False), (True, False), (True, True)])
def test_rerouted_dp4_pp2_after_one_failure(decouple, staggered):
    """With ``decouple`` every worker splits its backwards and runs the weight gradients
    later (26 instead of 30 slots); the overlapped DP sync still starts in the last W.
    Staggered, of the three steps' norms (0.486, 0.502, 0.482 against a clip of 0.5) the
    second clips: it is retaken at the third step's settle point, whose forwards before
    it run again; the first step's gradients are unclipped."""
    profile = uniform_profile(num_layers=4)
    plan = symmetric_plan(dp=4, pp=2, num_layers=4, micro_batches_per_pipeline=3)
    rerouted = reroute_plan(plan, failed_workers={5}, profile=profile)  # stage 1 of pipeline 1
    survivors = [w for w in range(8) if w != 5]
    results = _check(rerouted, survivors, overlap=True, decouple=decouple, staggered=staggered)
    assert max(r["ops"] for r in results) > min(r["ops"] for r in results), "peers ran extra micro-batches"
    split = sorted(r["weight_grad_ops"] for r in results)
    assert split == ([3] * 4 + [4] * 3 if decouple else [0] * 7), "every worker splits all its backwards"


def test_the_distributed_optimizer_over_three_dp_peers_trains_the_reference_model():
    """Each peer steps 2/3 of every tensor (two owners a range), counts its first-owned
    range in the norm and all-gathers the stepped weights: the final weights are the
    single-process run's, on every peer."""
    results = _check(symmetric_plan(dp=3, pp=1, num_layers=2, micro_batches_per_pipeline=2), range(3),
                     distributed_optimizer=True)
    for stepped, held in (r["stepped_elements"] for r in results):
        assert stepped == pytest.approx(held * 2 / 3, abs=100), "each peer keeps two of three ranges"


def test_rerouted_tensor_parallel_with_tied_embeddings_and_split_backwards():
    """Split backwards all-reduce input gradients over TP like Megatron's, and the peer's
    own output layer (a tied copy of the embedding) defers its weight GEMM too."""
    profile = uniform_profile(num_layers=4)
    plan = symmetric_plan(dp=2, pp=2, num_layers=4, micro_batches_per_pipeline=3)
    rerouted = replace(reroute_plan(plan, failed_workers={3}, profile=profile), tensor_parallel_size=2)
    results = _check(rerouted, [0, 1, 2], tie_embeddings=True)
    assert sorted(r["weight_grad_ops"] for r in results) == [3, 3, 3, 3, 6, 6]


def test_tensor_parallel_two_in_dp2_pp2():
    plan = symmetric_plan(dp=2, pp=2, num_layers=4, micro_batches_per_pipeline=2)
    _check(replace(plan, tensor_parallel_size=2), range(4))


def test_tied_embeddings_across_first_and_last_stages():
    results = _check(asymmetric_plan([(4, 2), (1, 3, 2)], [3, 3]), range(5), "odyssey", tie_embeddings=True)
    holders = [r for r in results if "embedding.word_embeddings.weight" in r["params"]]
    assert len(holders) == 4  # first and last stage of both pipelines hold a copy


@pytest.mark.parametrize("staggered", [False, True])
def test_staggered_steps_do_not_wait_for_the_whole_pipeline(staggered, tmp_path):
    """Two pipelines of two stages; the second's last stage failed, so the first's last
    stage runs its micro-batches too, and with split backwards staggering pays (24 slots
    a step instead of 26). Staggered, that last stage takes its optimizer step while the
    first stages are still before theirs; with the global norm all-reduced first it cannot."""
    profile = uniform_profile(num_layers=4)
    plan = reroute_plan(symmetric_plan(dp=2, pp=2, num_layers=4, micro_batches_per_pipeline=2), failed_workers={3},
                        profile=profile)
    seen = run_world(last_stage_steps_first, 3, published_json(plan, profile, staggered=staggered),
                     str(tmp_path / "stepped"))
    assert seen[0] is seen[1] is staggered  # worker 2 is the last stage


def test_megatron_schedule_refuses_a_pipeline_whose_stage_ranks_descend():
    """A process group orders its members by rank, Megatron's 1F1B takes group rank i for
    stage i; ``auto`` runs such a pipeline on the executor (``test_training_state``)."""
    from odyssey_megatron.hooks.process_groups import RankMap
    from odyssey_megatron.runtime.rank.plan_runner import PlanRunner, initial_state
    from runtime_cases import SEED, runner_settings, tiny_model

    plan = asymmetric_plan([(2, 2)], [2], worker_of=lambda d, s: 1 - s)
    ranks, model = RankMap.identity(2, 1), tiny_model(4)
    with pytest.raises(ValueError, match="ascending order"):
        PlanRunner(plan=plan, program=step_program(plan, uniform_profile(num_layers=4)), rank=0, ranks=ranks,
                   state=initial_state(plan=plan, rank=0, ranks=ranks, model=model, seed=SEED),
                   settings=runner_settings(model, schedule="megatron"))


def test_the_distributed_optimizer_refuses_a_staggered_step():
    from odyssey_megatron.hooks.process_groups import RankMap
    from odyssey_megatron.runtime.rank.plan_runner import PlanRunner, initial_state
    from runtime_cases import SEED, runner_settings, tiny_model

    plan = symmetric_plan(dp=3, pp=1, num_layers=2, micro_batches_per_pipeline=1)
    program = replace(step_program(plan, uniform_profile(num_layers=2)), staggered_optimizer=True)
    ranks, model = RankMap.identity(3, 1), tiny_model(2)
    with pytest.raises(ValueError, match="a staggered optimizer step cannot run with the distributed optimizer"):
        PlanRunner(plan=plan, program=program, rank=0, ranks=ranks,
                   state=initial_state(plan=plan, rank=0, ranks=ranks, model=model, seed=SEED),
                   settings=runner_settings(model, distributed_optimizer=True))


def test_auto_takes_megatrons_schedule_only_for_plain_1f1b_and_megatron_is_refused_elsewhere():
    """``resolve_schedule`` is pure: each reason Megatron's 1F1B cannot run a step, alone."""
    from odyssey_megatron.hooks.process_groups import RankMap
    from odyssey_megatron.runtime.rank.plan_runner import resolve_schedule

    profile = uniform_profile(num_layers=4)
    plain = symmetric_plan(dp=2, pp=2, num_layers=4, micro_batches_per_pipeline=2)
    program = step_program(plain, profile)
    ranks = RankMap.identity(4, 1)
    rerouted = reroute_plan(with_sync(plain, profile), failed_workers={3}, profile=profile)
    descending = asymmetric_plan([(2, 2)], [2], worker_of=lambda d, s: 1 - s)
    cases = {
        "rerouted": dict(plan=rerouted, program=step_program(rerouted, profile, pricing=Pricing(decouple=False))),
        "paced": dict(plan=plain, program=program, emulated=True),
        # The published flag, though worker 0's own list splits nothing: its pipeline's stages must agree.
        "split backwards": dict(plan=plain, program=replace(program, split_backward=True)),
        "staggered optimizer": dict(plan=plain, program=replace(program, staggered_optimizer=True)),
        "ascending": dict(plan=descending, program=step_program(descending, profile), ranks=RankMap.identity(2, 1)),
    }
    assert resolve_schedule("auto", plan=plain, program=program, worker=0, ranks=ranks, emulated=False) == "megatron"
    assert resolve_schedule("megatron", plan=plain, program=program, worker=0, ranks=ranks, emulated=False) == "megatron"
    for reason, case in cases.items():
        args = {"worker": 0, "ranks": ranks, "emulated": False, **case}
        assert resolve_schedule("auto", **args) == "odyssey", reason
        assert resolve_schedule("odyssey", **args) == "odyssey", reason
        with pytest.raises(ValueError, match=reason):
            resolve_schedule("megatron", **args)
    with pytest.raises(ValueError, match="schedule must be one of auto, odyssey, megatron; got 'fast'"):
        resolve_schedule("fast", plan=plain, program=program, worker=0, ranks=ranks, emulated=False)
