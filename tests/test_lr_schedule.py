"""The learning rate and weight decay of every step, as a recipe's scheduler keys give them
(``hooks.lr_schedule``): equal to Megatron-Core's own ``OptimizerParamScheduler`` stepped one
iteration at a time as Megatron-LM's training loop steps it, also where a new plan
generation (or a rollback) sets its scheduler straight to the committed step; and the keys'
one-line errors."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from megatron.core.optimizer import OptimizerConfig
from megatron.core.optimizer.optimizer import FP32Optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

from odyssey_megatron.config import TrainingConfig, load_config
from odyssey_megatron.errors import ConfigError
from odyssey_megatron.hooks.cpu_shim import cpu_shim
from odyssey_megatron.hooks.lr_schedule import LrSchedule, StepScheduler
from odyssey_megatron.runtime.control.run_state import RunFailed, step_rate
from odyssey_megatron.runtime.protocol.messages import StepReport

pytestmark = pytest.mark.timeout(120)

TINY = Path(__file__).resolve().parents[1] / "recipes" / "llama2_7b" / "tiny_cpu.yaml"
TRAIN_ITERS, BATCH, LR, WEIGHT_DECAY = 20, 16, 1e-3, 0.1

SCHEDULES = {
    "constant": {},
    "cosine, warmup iters": dict(lr_decay_style="cosine", lr_warmup_iters=3, min_lr=1e-4),
    "linear, warmup fraction": dict(lr_decay_style="linear", lr_warmup_fraction=0.15, lr_decay_iters=15,
                                    lr_warmup_init=1e-5, min_lr=2e-5),
    "inverse-square-root": dict(lr_decay_style="inverse-square-root", lr_warmup_iters=4, min_lr=1e-4),
    "WSD": dict(lr_decay_style="WSD", lr_warmup_iters=2, lr_wsd_decay_iters=6, lr_wsd_decay_style="minus_sqrt",
                min_lr=1e-5),
    "weight decay rising": dict(lr_decay_style="cosine", lr_warmup_iters=2, start_weight_decay=0.01,
                                end_weight_decay=0.1, weight_decay_incr_style="linear"),
    "weight decay cosine": dict(start_weight_decay=0.0, end_weight_decay=0.05, weight_decay_incr_style="cosine"),
}


def _optimizer() -> FP32Optimizer:
    """Megatron's optimizer over AdamW's two kinds of group, as ``StageOptimizer`` builds them
    (its loss-scale tensor is made on ``cuda``: the CPU shim maps it to the CPU)."""
    matrix, vector = torch.nn.Parameter(torch.zeros(2, 2)), torch.nn.Parameter(torch.zeros(2))
    adam = torch.optim.AdamW([{"params": [matrix], "weight_decay": WEIGHT_DECAY, "wd_mult": 1.0},
                              {"params": [vector], "weight_decay": 0.0, "wd_mult": 0.0}], lr=LR)
    with cpu_shim():
        return FP32Optimizer(adam, OptimizerConfig(lr=LR, weight_decay=WEIGHT_DECAY), init_state_fn=lambda *_: None)


def _rates(optimizer) -> list[tuple[float, float]]:
    return [(group["lr"], group["weight_decay"]) for group in optimizer.param_groups]


def _megatron_run(keys: dict) -> list[list[tuple[float, float]]]:
    """Each iteration's rates in Megatron-LM's run of these keys: its scheduler made with the
    arguments ``get_optimizer_param_scheduler`` derives (in samples), stepped by the global
    batch after every iteration."""
    decay_iters = keys.get("lr_decay_iters", TRAIN_ITERS)
    warmup = (keys["lr_warmup_fraction"] * decay_iters * BATCH if "lr_warmup_fraction" in keys
              else keys.get("lr_warmup_iters", 0) * BATCH)
    wsd = keys.get("lr_wsd_decay_iters")
    optimizer = _optimizer()
    scheduler = OptimizerParamScheduler(
        optimizer, init_lr=keys.get("lr_warmup_init", 0.0), max_lr=LR, min_lr=keys.get("min_lr", 0.0),
        lr_warmup_steps=warmup, lr_decay_steps=decay_iters * BATCH, lr_decay_style=keys.get("lr_decay_style", "constant"),
        start_wd=keys.get("start_weight_decay", WEIGHT_DECAY), end_wd=keys.get("end_weight_decay", WEIGHT_DECAY),
        wd_incr_steps=TRAIN_ITERS * BATCH, wd_incr_style=keys.get("weight_decay_incr_style", "constant"),
        wsd_decay_steps=None if wsd is None else wsd * BATCH,
        lr_wsd_decay_style=keys.get("lr_wsd_decay_style", "exponential"))
    rates = []
    for _ in range(TRAIN_ITERS):
        rates.append(_rates(optimizer))
        scheduler.step(increment=BATCH)
    return rates


def _ours(keys: dict) -> tuple[TrainingConfig, StepScheduler]:
    training = TrainingConfig(global_batch_size=BATCH, train_iters=TRAIN_ITERS, lr=LR, weight_decay=WEIGHT_DECAY,
                              **keys)
    optimizer = _optimizer()
    return training, StepScheduler(optimizer, LrSchedule.of(training))


@pytest.mark.parametrize("keys", SCHEDULES.values(), ids=SCHEDULES.keys())
def test_every_step_takes_megatrons_rates_however_the_scheduler_got_there(keys):
    expected = _megatron_run(keys)
    assert len({tuple(rates) for rates in expected}) > 1 or not keys  # the case does schedule something
    _, running = _ours(keys)
    for step in range(TRAIN_ITERS):  # one generation, step after step
        assert running.set_step(step) == expected[step][0][0]
        assert _rates(running.megatron.optimizer) == expected[step], step
    for step in (11, 3, 17, 0):  # a generation that starts there: after a reroute, a rollback, a resume
        _, fresh = _ours(keys)
        fresh.set_step(step)
        assert _rates(fresh.megatron.optimizer) == expected[step], step
        running.set_step(step)  # the same scheduler sent back (a rollback) or forward
        assert _rates(running.megatron.optimizer) == expected[step], step


def test_a_recipe_without_schedule_keys_trains_at_its_constant_rate_and_weight_decay():
    _, scheduler = _ours({})
    for step in (0, 1, TRAIN_ITERS - 1):
        assert scheduler.set_step(step) == LR
        assert _rates(scheduler.megatron.optimizer) == [(LR, WEIGHT_DECAY), (LR, 0.0)]


def test_a_warmup_fraction_counts_from_the_decay_iters():
    training, _ = _ours(dict(lr_decay_style="cosine", lr_warmup_fraction=0.25, lr_decay_iters=8))
    assert LrSchedule.of(training).lr_warmup_steps == 2 * BATCH


def test_a_step_is_recorded_at_its_ranks_rate_and_fails_the_run_where_they_disagree():
    def report(rank: int, lr: float) -> StepReport:
        return StepReport(rank, (), (), (), 0.0, 0, 0.0, 0, 0.0, 0, 0.0, lr)

    assert step_rate(3, [report(0, 5e-4), report(1, 5e-4)]) == 5e-4
    with pytest.raises(RunFailed, match=r"^step 3: the ranks took it at different learning rates \[0.0005, 0.001\]"):
        step_rate(3, [report(0, 5e-4), report(1, 1e-3)])


BAD_KEYS = {
    "training.lr_decay_style=exponential": ("training.lr_decay_style", "constant, linear, cosine, inverse-square-root"),
    "training.lr_warmup_iters=-1": ("training.lr_warmup_iters", ">= 0"),
    "training.lr_warmup_iters=20": ("training.lr_warmup_iters", "below training.lr_decay_iters (20"),
    "training.lr_warmup_iters=0 training.lr_warmup_fraction=1.0": ("training.lr_warmup_fraction", "[0, 1)"),
    "training.lr_decay_iters=0": ("training.lr_decay_iters", "> 0"),
    "training.min_lr=0.01": ("training.min_lr", "[0, training.lr (0.001)]"),
    "training.lr_warmup_init=-1e-4": ("training.lr_warmup_init", "[0, training.lr"),
    "training.lr_decay_style=WSD": ("training.lr_wsd_decay_iters", "must be given with lr_decay_style WSD"),
    "training.lr_wsd_decay_style=step": ("training.lr_wsd_decay_style", "linear, cosine, exponential, minus_sqrt"),
    "training.start_weight_decay=0.2": ("training.end_weight_decay", ">= training.start_weight_decay (0.2)"),
    "training.end_weight_decay=0.2": ("training.weight_decay_incr_style", "must agree"),
    "training.weight_decay_incr_style=square": ("training.weight_decay_incr_style", "constant, linear, cosine"),
}


@pytest.mark.parametrize("override", BAD_KEYS, ids=BAD_KEYS)
def test_a_bad_schedule_key_is_one_line_naming_it_and_what_is_allowed(override):
    key, allowed = BAD_KEYS[override]
    with pytest.raises(ConfigError) as caught:
        load_config(TINY, override.split())
    assert caught.value.key == key and allowed in caught.value.problem and "\n" not in str(caught.value)


def test_warmup_iters_and_a_warmup_fraction_together_are_refused():
    with pytest.raises(ConfigError, match=r"^training.lr_warmup_fraction: give it or training.lr_warmup_iters"):
        load_config(TINY, ["training.lr_warmup_iters=2", "training.lr_warmup_fraction=0.1"])
    fraction = load_config(TINY, ["training.lr_warmup_iters=0", "training.lr_warmup_fraction=0.1"]).training
    assert fraction.lr_warmup_fraction == 0.1
