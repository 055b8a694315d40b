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

With ``sharded_units`` (the distributed optimizer, ``optimizer_shards``) the optimizer
steps only the ranges of each tensor this worker keeps in a sync unit of more than two
holders: a view of the tensor's range (fp32 models only so far; bf16 would step an fp32
master of the range), with the range's moments alone. Each range's first owner alone
counts it in the global norm, and after the step every holder's first-owned ranges are
all-gathered over the unit, so every holder ends the step with the whole stepped weights.
"""

from __future__ import annotations

from typing import Collection, Sequence

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
from odyssey_megatron.hooks.global_weights import global_name
from odyssey_megatron.hooks.model import is_tied
from odyssey_megatron.hooks.training_state import BlockState, TrainingState
from odyssey_megatron.optimizer_shards import REPLICAS, first_owned_range, owned_ranges

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
                 tp_group: dist.ProcessGroup, worker: int | None = None,
                 sharded_units: Sequence[tuple[dist.ProcessGroup, Sequence[int], Sequence[Block]]] = ()):
        """Loads ``gpt`` (built for ``stage``, parameters uninitialised) from ``state``, which
        must hold exactly the stage's blocks, with every parameter's shape. The global norm
        counts the blocks in ``counted_blocks`` here and sums over ``norm_group``. Steps
        take ``lr_schedule``'s rates (``set_step``); ``config``'s lr and weight decay are its
        step 0's. ``sharded_units``: (group, holders, blocks) of each sync unit of more than
        ``REPLICAS`` holders whose optimizer state this ``worker`` shards with the others."""
        tied = is_tied(gpt)
        located = {name: (global_name(name, stage.layers[0], tied=tied), block_of(name, stage, tied=tied))
                   for name, _ in gpt.named_parameters()}
        _check_blocks(state, stage, located)
        self._masters: list[tuple[torch.nn.Parameter, torch.nn.Parameter]] = []
        """(model parameter, its fp32 master) where the model is not fp32."""
        self._views: list[tuple[torch.nn.Parameter, tuple[int, int], torch.nn.Parameter]] = []
        """(fp32 model parameter, a range of it, the view of that range the optimizer steps)."""
        shard_of = {block: holders for _, holders, blocks in sharded_units for block in blocks}
        if any(len(set(holders)) <= REPLICAS or worker not in holders for holders in shard_of.values()):
            raise ValueError(f"sharded units need more than {REPLICAS} holders, this worker ({worker}) among them")
        self._gathers = [(group, sorted(set(holders)), [p for name, p in gpt.named_parameters()
                                                       if located[name][1] in set(blocks)])
                         for group, holders, blocks in sharded_units]
        """(group, holders, parameters) of each sharded unit, for the all-gather after a step."""
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
                wd_mult = min([1.0] + [o.get("wd_mult", 1.0) for key, o in overrides.items() if key.matches(param, name)])
                if block in shard_of:
                    if param.dtype != torch.float32:
                        raise ValueError(f"the distributed optimizer shards fp32 models only so far; {full} is "
                                         f"{param.dtype}")
                    param.data = weights.to(param.device)
                    holders, numel = shard_of[block], param.numel()
                    counted_range = first_owned_range(numel, holders, worker)
                    for start, end in owned_ranges(numel, holders)[worker]:
                        stepped = torch.nn.Parameter(param.data.view(-1)[start:end])
                        self._views.append((param, (start, end), stepped))
                        copy_tensor_model_parallel_attributes(stepped, param)
                        stepped.shared = (start, end) != counted_range
                        self._located.append((full, block, stepped))
                        moments.append((stepped, source.step, source.exp_avg[full].reshape(-1)[start:end].clone(),
                                        source.exp_avg_sq[full].reshape(-1)[start:end].clone()))
                        groups.setdefault(wd_mult, []).append(stepped)
                    continue
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
        self._worker = worker

    @property
    def adam(self) -> torch.optim.Optimizer:
        """The torch optimizer inside: what a retake snapshot copies."""
        return self.megatron.optimizer

    def zero_grad(self) -> None:
        self.megatron.zero_grad(set_to_none=True)

    def grads_to_masters(self) -> None:
        """Call once per step after the gradients are synced and before the optimizer
        clips and steps: bf16 masters take the model's gradients in fp32, and the ranges
        stepped take their part of them."""
        for param, master in self._masters:
            master.grad = None if param.grad is None else param.grad.float()
        for param, (start, end), view in self._views:
            view.grad = None if param.grad is None else param.grad.view(-1)[start:end]
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
        for group, holders, params in self._gathers:
            _gather_first_owned(group, holders, params, holders.index(self._worker))

    def _publish(self) -> None:
        with torch.no_grad():
            for param, master in self._masters:
                param.copy_(master)

    def state(self) -> TrainingState:
        """The stage's blocks as trained so far: the tensors the optimizer steps, not copies.
        Not with sharded units: their state is spread over the unit's holders."""
        if self._gathers:
            raise RuntimeError("the distributed optimizer's state is sharded over DP peers: snapshots, checkpoints, "
                               "block transfers and recovery do not take it yet")
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


def _gather_first_owned(group: dist.ProcessGroup, holders: Sequence[int], params: Sequence[torch.Tensor],
                        me: int) -> None:
    """All-gather every holder's first-owned range of each of ``params`` (the unit's, in
    the same order on every holder) into every holder's tensors, padded to one size."""
    n = len(holders)
    spans = [[first_owned_range(p.numel(), holders, worker) for p in params] for worker in holders]
    size = max(sum(end - start for start, end in own) for own in spans)
    mine = torch.cat([p.detach().view(-1)[start:end] for p, (start, end) in zip(params, spans[me])])
    flat = torch.zeros(size, dtype=params[0].dtype, device=params[0].device)
    flat[:mine.numel()] = mine
    gathered = [torch.empty_like(flat) for _ in range(n)]
    dist.all_gather(gathered, flat, group=group)
    with torch.no_grad():
        for j, own in enumerate(spans):
            offset = 0
            for p, (start, end) in zip(params, own):
                p.view(-1)[start:end].copy_(gathered[j][offset:offset + end - start])
                offset += end - start


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
