"""Megatron-Core's optimizer over one stage's fp32 master weights, loaded from its blocks.

A rank's ``TrainingState`` already holds fp32 weights and Adam moments per block, so
the optimizer is built around those tensors rather than around fresh copies:
``megatron.core.optimizer.FP32Optimizer`` wrapping AdamW (Megatron's ``adam`` with
decoupled weight decay, and its rule that biases and 1-D tensors take none) steps the
state's tensors in place and clips by the global gradient norm. In fp32 the model's
parameters are those tensors; in bf16 they are rounded copies that every step refreshes.

Megatron's ``Float16OptimizerWithFloat16Params`` would make its own fp32 masters, but it
only accepts ``torch.cuda.*`` tensor types (CPU and NPU tensors are refused) and would
duplicate the masters the state holds. fp16 is not offered: it needs loss scaling,
which the executors do not apply.

The global norm counts each block once, however many workers hold it after a
reparallelization: Megatron's norm skips parameters marked ``shared`` (what it does for
a tied output copy), so every parameter of a block this worker does not count is marked
so, and the norm's all-reduce runs over the plan's norm group (``grad_stats_parallel_group``).
Megatron computes the norm and steps; the clipping multiplication is done here (``clip``).

Each step's learning rate and weight decay are Megatron's ``OptimizerParamScheduler``'s for
the committed step (``hooks.lr_schedule``): ``set_step`` before the step is taken.
"""

from __future__ import annotations

from typing import Collection

import torch
import torch.distributed as dist
from megatron.core.optimizer import OptimizerConfig, get_standard_config_overrides
from megatron.core.optimizer.clip_grads import l2_norm_impl, multi_tensor_applier
from megatron.core.optimizer.optimizer import FP32Optimizer
from megatron.core.tensor_parallel import copy_tensor_model_parallel_attributes

from odyssey_megatron.blocks import Block, StageSpec, block_sort_key
from odyssey_megatron.config import DType, TrainingConfig
from odyssey_megatron.hooks.grad_sync import block_of, clip_scale
from odyssey_megatron.hooks.lr_schedule import LrSchedule, StepScheduler
from odyssey_megatron.hooks.model import global_name, is_tied
from odyssey_megatron.hooks.training_state import BlockState, TrainingState

__all__ = ["StageOptimizer", "optimizer_config"]


def optimizer_config(training: TrainingConfig, params_dtype: DType) -> OptimizerConfig:
    """Megatron's optimizer settings for a recipe (the same names as its arguments)."""
    if params_dtype == DType.fp16:
        raise ValueError("model.params_dtype fp16 needs loss scaling, which odyssey's executors do not apply; "
                         "use bf16 or fp32")
    return OptimizerConfig(
        optimizer="adam", lr=training.lr, weight_decay=training.weight_decay, adam_beta1=training.adam_beta1,
        adam_beta2=training.adam_beta2, adam_eps=training.adam_eps, clip_grad=training.clip_grad,
        bf16=params_dtype == DType.bf16, params_dtype=torch.bfloat16 if params_dtype == DType.bf16 else torch.float32,
    )


class StageOptimizer:
    """The optimizer of one stage: ``megatron`` is Megatron-Core's optimizer object."""

    def __init__(self, state: TrainingState, gpt: torch.nn.Module, stage: StageSpec, *, config: OptimizerConfig,
                 lr_schedule: LrSchedule, counted_blocks: Collection[Block], norm_group: dist.ProcessGroup | None,
                 tp_group: dist.ProcessGroup):
        """Loads ``gpt`` (built for ``stage``, parameters uninitialised) from ``state``, which
        must hold exactly the stage's blocks, with every parameter's shape. The global norm
        counts the blocks in ``counted_blocks`` here and sums over ``norm_group``. Steps
        take ``lr_schedule``'s rates (``set_step``); ``config``'s lr and weight decay are its
        step 0's."""
        tied = is_tied(gpt)
        located = {name: (global_name(name, stage.layers[0], tied=tied), block_of(name, stage, tied=tied))
                   for name, _ in gpt.named_parameters()}
        _check_blocks(state, stage, located)
        self._masters: list[tuple[torch.nn.Parameter, torch.nn.Parameter]] = []
        """(model parameter, its fp32 master) where the model is not fp32."""
        self._located: list[tuple[str, Block, torch.nn.Parameter]] = []
        """(global name, block, the parameter the optimizer steps) per stage parameter."""
        overrides = get_standard_config_overrides(config)
        groups: dict[float, list[torch.nn.Parameter]] = {}
        moments = []
        with torch.no_grad():
            for name, param in gpt.named_parameters():
                full, block = located[name]
                source = state.blocks[block]
                weights = source.params[full]
                if tuple(weights.shape) != tuple(param.shape):
                    raise ValueError(f"training state block {block!r}: param/{full} has shape "
                                     f"{tuple(weights.shape)}, the stage needs {tuple(param.shape)}")
                if param.dtype == torch.float32:
                    param.data = weights.to(param.device)
                    stepped = param
                else:
                    stepped = torch.nn.Parameter(weights.to(param.device))
                    copy_tensor_model_parallel_attributes(stepped, param)
                    param.copy_(stepped)
                    self._masters.append((param, stepped))
                stepped.shared = block not in counted_blocks
                self._located.append((full, block, stepped))
                moments.append((stepped, source.step, source.exp_avg[full], source.exp_avg_sq[full]))
                wd_mult = min([1.0] + [o.get("wd_mult", 1.0) for key, o in overrides.items() if key.matches(param, name)])
                groups.setdefault(wd_mult, []).append(stepped)
        adam = torch.optim.AdamW(
            [{"params": params, "weight_decay": config.weight_decay * wd_mult, "wd_mult": wd_mult}
             for wd_mult, params in groups.items()],
            lr=config.lr, betas=(config.adam_beta1, config.adam_beta2), eps=config.adam_eps)
        for stepped, step, exp_avg, exp_avg_sq in moments:
            # What AdamW's first step would create, with the state's values: its step on the
            # host, as torch keeps it (on the device only for capturable or fused AdamW).
            adam.state[stepped] = {"step": torch.tensor(float(step), dtype=torch.float32, device="cpu"),
                                   "exp_avg": exp_avg.to(stepped.device), "exp_avg_sq": exp_avg_sq.to(stepped.device)}
        if self._masters:
            adam.register_step_post_hook(lambda *_: self._publish())
        self.megatron = FP32Optimizer(adam, config, init_state_fn=lambda *_: None)
        self.megatron.grad_stats_parallel_group = norm_group
        self.megatron.tp_group = tp_group
        self.scheduler = StepScheduler(self.megatron, lr_schedule)

    @property
    def adam(self) -> torch.optim.Optimizer:
        """The torch optimizer inside: what a retake snapshot copies."""
        return self.megatron.optimizer

    def zero_grad(self) -> None:
        self.megatron.zero_grad(set_to_none=True)

    def grads_to_masters(self) -> None:
        """Call once per step after the gradients are synced and before the optimizer
        clips and steps: bf16 masters take the model's gradients in fp32."""
        for param, master in self._masters:
            master.grad = None if param.grad is None else param.grad.float()
        self.megatron.prepare_grads()

    def clip(self) -> float:
        """Megatron's global gradient norm (collective over the norm group), and clipping
        by it; returns the norm before clipping. Megatron's own ``clip_grad_by_total_norm_fp32``
        asserts ``torch.cuda.FloatTensor`` gradients, so the scaling is done here, with
        its arithmetic (``grad_sync.clip_scale``)."""
        norm = float(self.megatron.get_grad_norm())
        self.scale_grads(clip_scale(norm, self.megatron.config.clip_grad))
        return norm

    def scale_grads(self, scale: float | None) -> None:
        """Multiply the gradients the optimizer steps with by ``scale`` (None: leave them)."""
        if scale is not None:
            for param in self.megatron.get_parameters():
                if param.grad is not None:
                    param.grad.mul_(scale)

    def local_norm_square(self) -> torch.Tensor:
        """This rank's share of the squared global norm, computed as Megatron's norm computes
        it before its all-reduce (same gradients, same kernel): a staggered step all-reduces
        it asynchronously and gets the norm ``get_grad_norm`` would have returned."""
        grads = self.megatron.get_main_grads_for_grad_norm()
        device = next(p.device for _, _, p in self._located)
        if not grads:
            return torch.zeros(1, dtype=torch.float32, device=device)
        norm, _ = multi_tensor_applier(l2_norm_impl, torch.zeros(1, dtype=torch.int, device=device), [grads], False)
        return norm**2

    def set_step(self, step: int) -> float:
        """Take the learning rate and weight decay of training step ``step`` (0-based) from now
        on, a retake of it included; returns that learning rate."""
        return self.scheduler.set_step(step)

    @property
    def lr(self) -> float:
        """The learning rate the next step applies."""
        return self.scheduler.lr

    def step(self) -> None:
        """Step with the gradients as they are (clipped already, or speculatively unclipped),
        at the rates of the step last given to ``set_step``."""
        self.megatron.step_with_ready_grads()

    def _publish(self) -> None:
        with torch.no_grad():
            for param, master in self._masters:
                param.copy_(master)

    def state(self) -> TrainingState:
        """The stage's blocks as trained so far: the tensors the optimizer steps, not copies."""
        blocks: dict[Block, BlockState] = {}
        for full, block, stepped in self._located:
            moments = self.adam.state[stepped]
            step = int(moments["step"])
            state = blocks.setdefault(block, BlockState({}, {}, {}, step))
            if state.step != step:
                raise RuntimeError(f"block {block!r}: {full} took {step} steps, the block's others {state.step}")
            state.params[full] = stepped.detach()
            state.exp_avg[full] = moments["exp_avg"]
            state.exp_avg_sq[full] = moments["exp_avg_sq"]
        return TrainingState(blocks)


def _check_blocks(state: TrainingState, stage: StageSpec, located: dict[str, tuple[str, Block]]) -> None:
    needed = {block for _, block in located.values()}
    if set(state.blocks) != needed:
        missing = sorted(needed - set(state.blocks), key=block_sort_key)
        extra = sorted(set(state.blocks) - needed, key=block_sort_key)
        raise ValueError(f"training state for stage {stage}: missing blocks {missing} (receive them), "
                         f"extra blocks {extra} (keep drops them)")
    for block in needed:
        names = {full for full, b in located.values() if b == block}
        held = set(state.blocks[block].params)
        if held != names:
            raise ValueError(f"training state block {block!r}: holds {sorted(held - names)} the stage has not, "
                             f"lacks {sorted(names - held)}")
