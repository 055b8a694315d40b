"""Peak memory per stage (paper 001, Eq. 14), from the op lists that actually run.

Static memory is the held blocks' weights, gradients and optimizer state. Dynamic
memory is the activations of micro-batches whose forward ran and backward (or, when
backwards are split, weight gradient) has not:
1F1B keeps N_pp - i of them on stage i, a rerouting peer may keep more. Counting
in-flight micro-batches on the op list gives Eq. 14 for plain pipelines and the right
answer for rerouted ones.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np

from odyssey_megatron.estimator.replay import KINDS, op_kinds
from odyssey_megatron.plan import ExecutionPlan
from odyssey_megatron.profile import ModelProfile
from odyssey_megatron.schedules.ops import FORWARD, WEIGHT_GRAD, Op


def max_in_flight(kinds: np.ndarray) -> int:
    """Most micro-batches holding activations at once on a worker running ops of
    ``kinds`` (codes of ``replay.KINDS``) in order. A forward allocates them; a backward
    frees them, unless the worker splits its backwards, then the W does."""
    forward, weight_grad = kinds == KINDS.index(FORWARD), kinds == KINDS.index(WEIGHT_GRAD)
    frees = weight_grad if weight_grad.any() else ~forward
    return max(0, int(np.cumsum(forward.astype(np.int64) - frees).max(initial=0)))


def stage_memory(profile: ModelProfile, start: int, end: int, *, first: bool, last: bool) -> tuple[int, int]:
    """(static bytes, activation bytes per in-flight micro-batch) of a stage owning [start, end)."""
    static = sum(profile.block(b).static_bytes for b in profile.stage_blocks(start, end, first=first, last=last))
    activation = sum(profile.block(b).activation_bytes for b in profile.compute_blocks(start, end, first=first, last=last))
    return static, activation


def owner_memory(plan: ExecutionPlan, profile: ModelProfile) -> dict[int, tuple[int, int]]:
    """``stage_memory`` of each live stage owner's stage, computed once per stage shape
    (a large plan has thousands of owners and a few shapes)."""
    shapes: dict[tuple, tuple[int, int]] = {}
    owners = {}
    for pi, si, stage in plan.stage_positions():
        if stage.worker is None:
            continue
        shape = (*stage.layers, si == 0, si == plan.pipelines[pi].num_stages - 1)
        if shape not in shapes:
            shapes[shape] = stage_memory(profile, shape[0], shape[1], first=shape[2], last=shape[3])
        owners[stage.worker] = shapes[shape]
    return owners


def peak_memory(plan: ExecutionPlan, profile: ModelProfile, schedule: Mapping[int, Sequence[Op]]) -> dict[int, int]:
    """Peak bytes per live stage owner."""
    return {worker: static + max_in_flight(op_kinds(schedule, worker)) * activation
            for worker, (static, activation) in owner_memory(plan, profile).items()}
