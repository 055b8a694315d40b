"""Rank functions for the training-state tests (importable by spawned processes)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist

from odyssey_megatron.estimator.program import step_program
from odyssey_megatron.hooks.process_groups import RankMap
from odyssey_megatron.hooks.training_state import TrainingState
from odyssey_megatron.plan import ExecutionPlan
from odyssey_megatron.profile import uniform_profile
from odyssey_megatron.settings import Pricing
from runtime_cases import SEED, data, runner_settings, tiny_model


def _runner(plan: ExecutionPlan, rank: int, ranks: RankMap, model, state: TrainingState):
    """A rank of ``plan`` on the step program the recipes' defaults publish (split
    backwards and staggered steps where they pay)."""
    from odyssey_megatron.runtime.rank.plan_runner import PlanRunner

    program = step_program(plan, uniform_profile(num_layers=plan.num_layers),
                           pricing=Pricing(decouple=True, staggered=True))
    return PlanRunner(plan=plan, program=program, rank=rank, ranks=ranks, state=state,
                      settings=runner_settings(model))


def _train(runner, steps: range) -> None:
    source = data()
    for step in steps:
        runner.train_step(lambda m, step=step: source.micro_batch(step, m), step=step)
    runner.settle()


def _exported(state: TrainingState) -> dict[str, torch.Tensor]:
    """Every held block's tensors, keyed ``block:key``, copied."""
    return {f"{block}:{key}": tensor.clone() for block in state.held() for key, tensor in state.export(block).items()}


def _differ(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    """Keys whose tensors are not bitwise equal (dtype included), or held by one side only."""
    return sorted(set(a) ^ set(b)) + sorted(k for k in set(a) & set(b)
                                            if a[k].dtype != b[k].dtype or not torch.equal(a[k], b[k]))


def _rng_states() -> dict[str, torch.Tensor]:
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    return {"global": torch.get_rng_state(), **{n: s.clone() for n, s in get_cuda_rng_tracker().get_states().items()}}


def round_trip(rank: int, world_size: int, cases: list[tuple[str, str, str, bool]], steps: int) -> dict:
    """Per case (name, plan JSON, params dtype, tied embeddings): train ``steps`` steps,
    export every block, import the copies into a fresh state, build a second runner from
    it, and take one more step on both runners. Reports what differs bitwise."""
    from odyssey_megatron.hooks.global_weights import global_name
    from odyssey_megatron.hooks.model import build_stage_model
    from odyssey_megatron.runtime.rank.plan_runner import initial_state

    results = {}
    for name, plan_json, params_dtype, tied in cases:
        plan = ExecutionPlan.from_json(plan_json)
        tp = plan.tensor_parallel_size
        ranks = RankMap.identity(world_size // tp, tp)
        model = replace(tiny_model(plan.num_layers, tied), params_dtype=params_dtype)
        runner = _runner(plan, rank, ranks, model, initial_state(plan=plan, rank=rank, ranks=ranks, model=model,
                                                                 seed=SEED))
        seeded = build_stage_model(model, runner.stage, pg_collection=runner.groups.pg_collection, seed=SEED)
        drawn = dict(runner.model.named_parameters())
        initial_differs = sorted(n for n, p in seeded.named_parameters() if not torch.equal(p, drawn.pop(n)))
        initial_differs += sorted(drawn)

        before = _rng_states()
        _train(runner, range(steps))
        rng_changed = _differ(before, _rng_states())

        sent = _exported(runner.training_state())  # the copies a transfer would deliver
        received = TrainingState()
        for block in runner.training_state().held():
            received.receive(block, {key.split(":", 1)[1]: t.clone() for key, t in sent.items()
                                     if key.split(":", 1)[0] == str(block)})
        round_trip_differs = _differ(sent, _exported(received))

        second = _runner(plan, rank, ranks, model, received)
        model_differs = _differ(dict(runner.model.named_parameters()), dict(second.model.named_parameters()))
        _train(runner, range(steps, steps + 1))
        _train(second, range(steps, steps + 1))
        continued_differs = _differ(_exported(runner.training_state()), _exported(second.training_state()))
        continued_differs += _differ(dict(runner.model.named_parameters()), dict(second.model.named_parameters()))

        masters = runner.training_state()
        rounded = {global_name(n, runner.stage.layers[0], tied=tied): p for n, p in runner.model.named_parameters()}
        below_model_precision = sum(
            int((master != master.to(rounded[n].dtype).float()).sum())
            for block in masters.held() for n, master in masters.blocks[block].params.items())
        model_is_rounded_master = all(
            torch.equal(rounded[n], master.to(rounded[n].dtype))
            for block in masters.held() for n, master in masters.blocks[block].params.items())
        results[name] = {
            "blocks": [str(b) for b in masters.held()],
            "steps": sorted({s.step for s in masters.blocks.values()}),
            "initial_differs": initial_differs, "rng_changed": rng_changed, "round_trip_differs": round_trip_differs,
            "model_differs": model_differs, "continued_differs": continued_differs,
            "below_model_precision": below_model_precision, "model_is_rounded_master": model_is_rounded_master,
        }
        for r in (runner, second):
            r.groups.destroy()
        del runner, second
    return results


def change_layout(rank: int, world_size: int, plan_a_json: str, plan_b_json: str, transfer_dir: str,
                  steps_a: int, steps_b: int) -> dict:
    """Train ``steps_a`` steps on plan A, carry the state into plan B (keep what B's stage
    holds, run B's transfers through files: the sender exports, the receiver imports), train
    ``steps_b`` more. Returns the final blocks (``block:key`` -> tensor) and what moved."""
    from odyssey_megatron.runtime.rank.plan_runner import initial_state

    plan_a, plan_b = ExecutionPlan.from_json(plan_a_json), ExecutionPlan.from_json(plan_b_json)
    ranks = RankMap.identity(world_size, 1)
    model = tiny_model(plan_a.num_layers)
    runner = _runner(plan_a, rank, ranks, model, initial_state(plan=plan_a, rank=rank, ranks=ranks, model=model,
                                                               seed=SEED))
    _train(runner, range(steps_a))
    state = runner.training_state()
    runner.groups.destroy()
    del runner
    held_before = state.held()

    directory = Path(transfer_dir)
    for t in plan_b.transfers:
        if t.src == rank:
            torch.save(state.export(t.layer), directory / f"block-{t.layer}-to-{t.dst}.pt")
    dist.barrier()
    worker = ranks.worker(rank)
    needed = plan_b.holdings(uniform_profile(num_layers=plan_b.num_layers))[worker]
    state.keep(needed)
    kept = state.held()
    received = [t.layer for t in plan_b.transfers if t.dst == rank]
    for block in received:
        state.receive(block, torch.load(directory / f"block-{block}-to-{rank}.pt", weights_only=True))

    runner = _runner(plan_b, rank, ranks, model, state)
    _train(runner, range(steps_a, steps_a + steps_b))
    final = runner.training_state()
    return {
        "held_before": [str(b) for b in held_before], "kept": [str(b) for b in kept],
        "received": [str(b) for b in received], "final": _exported(final),
    }
