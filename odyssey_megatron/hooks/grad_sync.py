"""Layer-granular data-parallel gradient sync and the global gradient norm.

Every micro-batch's loss is scaled by 1 / (micro-batches in the whole step), so summing
a block's gradient over the workers that hold it gives exactly the single-process
gradient, whichever pipeline, stage or rerouting peer ran each micro-batch. Blocks held
by the same workers form a sync unit: one flattened SUM all-reduce per unit, in the
restorer's coloured rounds (a worker is in at most one unit per round, so the order of
collectives is the same on every member).

Each unit's gradients live in one contiguous buffer of the rank's, kept across steps:
every parameter's ``.grad`` is a view into it, set (zeroed) before the step's first
backward, so autograd accumulates straight into it and the all-reduce runs in place, as
with PyTorch DDP's ``gradient_as_bucket_view`` (Megatron-Core's DDP also reduces a
persistent buffer, after adding each ``.grad`` into it). Copying gradients into a fresh
flat tensor and back cost more than the all-reduce itself on CPU (fresh allocations of a
stage's size fault in every page). A staggered optimizer step keeps its gradients until
it settles, before the next step's first backward (``schedules.ops.settle_point``): the
runner starts the next step's gradients only then.

With ``overlap`` a unit is a bucket: post-accumulate-grad hooks count its gradients, and
when the step's last backward has reached every tensor of the unit its all-reduce starts
asynchronously, while backward goes on through earlier layers. Units then start in the
order backward finishes them rather than by round; each unit has its own process group,
so members need not agree on the order across units.
"""

from __future__ import annotations

from collections import defaultdict
from functools import partial

import torch
import torch.distributed as dist

from odyssey_megatron.blocks import Block, StageSpec, block_of_parameter
from odyssey_megatron.hooks.accelerator import required_device
from odyssey_megatron.hooks.global_weights import global_name
from odyssey_megatron.hooks.model import is_tied
from odyssey_megatron.hooks.op_clock import OpClock
from odyssey_megatron.plan import ExecutionPlan


def block_of(name: str, stage: StageSpec, *, tied: bool = False) -> Block:
    """The block a stage parameter belongs to, by its name on the stage (a tied output
    copy is the embedding)."""
    return block_of_parameter(global_name(name, stage.layers[0], tied=tied))


def parameters_by_block(model: torch.nn.Module, stage: StageSpec) -> dict[Block, list[torch.nn.Parameter]]:
    blocks: dict[Block, list[torch.nn.Parameter]] = defaultdict(list)
    for name, param in model.named_parameters():
        blocks[block_of(name, stage, tied=is_tied(model))].append(param)
    return dict(blocks)


class _Bucket:
    """One sync unit's tensors on this rank, the buffer their gradients live in and its
    in-flight all-reduce."""

    def __init__(self, unit: int, group: dist.ProcessGroup, params: list[torch.nn.Parameter], clock: OpClock):
        dtypes = {p.dtype for p in params}
        if len(dtypes) > 1:
            raise ValueError(f"sync unit {unit} mixes parameter dtypes {sorted(map(str, dtypes))}: its gradients "
                             "share one buffer")
        self.unit, self.group, self.params, self.clock = unit, group, params, clock
        total = sum(p.numel() for p in params)
        # A unit this rank holds no parameter of still takes part in its all-reduce, on the group's device.
        dtype, device = (params[0].dtype, params[0].device) if params else (torch.float32, required_device(group))
        self.flat = torch.zeros(total, dtype=dtype, device=device)
        self.pending = 0
        self.started = False
        self.work: dist.Work | None = None
        """The all-reduce in flight, if started asynchronously."""
        self.paced: object = None

    def zero(self) -> None:
        """Zero the buffer and make it the home of every parameter's gradient."""
        self.flat.zero_()
        offset = 0
        for param in self.params:
            n = param.numel()
            param.grad = self.flat[offset : offset + n].view_as(param)
            offset += n

    def start(self, *, async_op: bool) -> None:
        self.paced = self.clock.collective_started(self.unit, self.group)
        self.started = True
        self.work = dist.all_reduce(self.flat, op=dist.ReduceOp.SUM, group=self.group, async_op=async_op)

    def finish(self) -> None:
        """Wait out the all-reduce started, if any, and the time the clock gives it."""
        if self.work is not None:
            self.work.wait()
        if self.started:
            self.clock.collective_finished(self.paced)
        self.started, self.work, self.paced = False, None, None


class LayerGradSync:
    """All-reduces this rank's gradients unit by unit: round by round, or overlapped."""

    def __init__(
        self,
        *,
        plan: ExecutionPlan,
        worker: int,
        params: dict[Block, list[torch.nn.Parameter]],
        unit_groups: dict[int, dist.ProcessGroup],
        overlap: bool = False,
        clock: OpClock | None = None,
    ):
        """``clock`` paces each all-reduce (``runtime.rank.emulation``); default: real time."""
        clock = clock or OpClock()
        self._buckets: list[_Bucket] = []
        for round_ in plan.comm_rounds:
            for index in round_:
                unit = plan.sync_units[index]
                if worker in unit.workers:
                    members = [p for b in unit.blocks for p in params.get(b, [])]
                    self._buckets.append(_Bucket(index, unit_groups[index], members, clock))
        self._overlap = overlap
        self._backward_passes = 0
        if overlap:
            for bucket in self._buckets:
                for param in bucket.params:
                    param.register_post_accumulate_grad_hook(partial(self._on_grad, bucket))

    @property
    def in_flight(self) -> int:
        """All-reduces started and not yet finished (overlap starts them during backward)."""
        return sum(bucket.work is not None for bucket in self._buckets)

    @property
    def num_units(self) -> int:
        """Sync units this rank takes part in."""
        return len(self._buckets)

    def start_step(self, *, backward_passes: int) -> None:
        """Call once per step before the first backward, once nothing needs the last
        step's gradients: this rank will run ``backward_passes`` backwards through every
        one of its tensors, into zeroed gradients."""
        self._backward_passes = backward_passes
        for bucket in self._buckets:
            bucket.zero()
            bucket.pending = backward_passes * len(bucket.params)

    def _on_grad(self, bucket: _Bucket, _param: torch.nn.Parameter) -> None:
        bucket.pending -= 1
        if bucket.pending == 0:
            bucket.start(async_op=True)

    def sync(self) -> None:
        """Call once per step, after the last backward and before the optimizer step."""
        for bucket in self._buckets:
            if not bucket.started:
                bucket.start(async_op=False)
            bucket.finish()


def block_owners(plan: ExecutionPlan) -> dict[Block, int]:
    """The worker whose gradient of each block the global norm counts: the lowest worker
    holding it. Summed over the norm group, the norm is then the single-process one."""
    return {block: min(unit.workers) for unit in plan.sync_units for block in unit.blocks}


def clip_scale(norm: float, max_norm: float) -> float | None:
    """The factor global-norm clipping multiplies every gradient by, as Megatron's
    ``clip_grad_by_total_norm_fp32`` computes it; None when it leaves them alone
    (``max_norm`` 0 turns clipping off)."""
    scale = max_norm / (norm + 1.0e-6)
    return scale if max_norm > 0 and scale < 1.0 else None
