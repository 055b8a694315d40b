"""The learning rate and weight decay of each step: Megatron-Core's ``OptimizerParamScheduler``
set to the committed step.

Megatron's scheduler counts samples (Megatron-LM's and Bridge's iteration-based runs step it
by the global batch after every iteration) and keeps its own counter. A plan generation
builds its optimizer anew, from whatever step the run has committed, and a rollback goes
back to a snapshot's step; a counter of the steps this optimizer took would restart or run
ahead there. So before every optimizer step the scheduler is moved, by its own
``step(increment)``, to the samples the committed steps before it consumed: the rates of
step ``s`` are a function of ``s`` alone, whatever plan, generation or resume runs it, as
Megatron computes them for a run that never failed.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Optional

from megatron.core.optimizer import MegatronOptimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

from odyssey_megatron.config import TrainingConfig

__all__ = ["LrSchedule", "StepScheduler"]


@dataclass(frozen=True)
class LrSchedule:
    """``OptimizerParamScheduler``'s arguments for a recipe, in samples, as Megatron-LM's
    ``get_optimizer_param_scheduler`` (and Bridge's ``ConfigContainer``) derive them from
    the iteration keys."""

    init_lr: float
    max_lr: float
    min_lr: float
    lr_warmup_steps: float
    lr_decay_steps: int
    lr_decay_style: str
    start_wd: float
    end_wd: float
    wd_incr_steps: int
    wd_incr_style: str
    wsd_decay_steps: Optional[int]
    lr_wsd_decay_style: str
    samples_per_step: int
    """The global batch: what one committed step adds to the scheduler's count."""

    @classmethod
    def of(cls, training: TrainingConfig) -> "LrSchedule":
        batch = training.global_batch_size
        decay_steps = training.decay_iters * batch
        warmup = (training.lr_warmup_fraction * decay_steps if training.lr_warmup_fraction is not None
                  else training.lr_warmup_iters * batch)
        start_wd, end_wd = training.weight_decay_range
        wsd = training.lr_wsd_decay_iters
        return cls(init_lr=training.lr_warmup_init, max_lr=training.lr, min_lr=training.min_lr,
                   lr_warmup_steps=warmup, lr_decay_steps=decay_steps, lr_decay_style=str(training.lr_decay_style),
                   start_wd=start_wd, end_wd=end_wd, wd_incr_steps=training.train_iters * batch,
                   wd_incr_style=str(training.weight_decay_incr_style),
                   wsd_decay_steps=None if wsd is None else wsd * batch,
                   lr_wsd_decay_style=str(training.lr_wsd_decay_style), samples_per_step=batch)

    def scheduler(self, optimizer: MegatronOptimizer) -> OptimizerParamScheduler:
        """Megatron's scheduler over ``optimizer``, at step 0 (it sets the rates as it is made)."""
        arguments = {name: value for name, value in asdict(self).items() if name != "samples_per_step"}
        return OptimizerParamScheduler(optimizer, **arguments)


class StepScheduler:
    """Megatron's scheduler over one optimizer, set to a committed step on demand."""

    def __init__(self, optimizer: MegatronOptimizer, schedule: LrSchedule):
        """The param groups must carry their ``wd_mult`` (Megatron's scheduler multiplies the
        weight decay it sets by it; a group without one would decay at the full rate)."""
        self.megatron = schedule.scheduler(optimizer)
        self.samples_per_step = schedule.samples_per_step

    def set_step(self, step: int) -> float:
        """Set every param group's learning rate and weight decay to those of training step
        ``step`` (0-based: ``step`` steps committed before it); its learning rate."""
        self.megatron.step(increment=step * self.samples_per_step - self.megatron.num_steps)
        return self.lr

    @property
    def lr(self) -> float:
        """The learning rate the next optimizer step applies (every group has the same)."""
        return self.megatron.optimizer.param_groups[0]["lr"]
