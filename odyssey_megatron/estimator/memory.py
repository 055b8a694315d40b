"""Peak memory per stage (paper 001, Eq. 14), from the op lists that actually run.

Static memory is the held blocks' weights, gradients and optimizer state. Dynamic
memory is the activations of micro-batches whose forward ran and backward (or, when
backwards are split, weight gradient) has not:
1F1B keeps N_pp - i of them on stage i, a rerouting peer may keep more. Counting
in-flight micro-batches on the op list gives Eq. 14 for plain pipelines and the right
answer for rerouted ones.

Under the distributed optimizer a rank keeps only its share of each block's optimizer
state, and that share is set by how many workers hold the block in the plan at hand
(``held_profile``), not by the recipe's DP size: after a failure a reroute leaves a failed
stage's blocks one holder fewer, and a reparallelization may give a block fewer holders
than the recipe did, so each survivor keeps more.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np

from odyssey_megatron.estimator.replay import KINDS, op_kinds
from odyssey_megatron.plan import ExecutionPlan
from odyssey_megatron.profile import ModelProfile
from odyssey_megatron.schedules.ops import FORWARD, WEIGHT_GRAD, Op
from odyssey_megatron.settings import Pricing


def held_profile(plan: ExecutionPlan, profile: ModelProfile, *, pricing: Pricing) -> ModelProfile:
    """The profile ``plan``'s memory is priced with: ``profile`` (each block's whole
    optimizer state) or, with ``pricing.distributed_optimizer``, each block's state cut
    to what its fullest holder keeps at its holder count in ``plan``
    (``ExecutionPlan.holder_counts``). Take it from the whole plan before pricing a part of
    it (``estimator.distinct``'s pipelines, a reroute's touched ones), which holds fewer."""
    return profile.held(plan.holder_counts(profile)) if pricing.distributed_optimizer else profile


def layout_profile(profile: ModelProfile, lengths: Sequence[int], *, pricing: Pricing) -> ModelProfile:
    """``held_profile`` of any plan of whole pipelines of ``lengths`` stages, known before
    its layer splits and workers are chosen (``ModelProfile.pipeline_holder_counts``):
    what the planner's memory checks of a layout read."""
    return profile.held(profile.pipeline_holder_counts(lengths)) if pricing.distributed_optimizer else profile


def optimizer_state_per_rank(plan: ExecutionPlan, profile: ModelProfile, *, pricing: Pricing) -> dict[int, int]:
    """Bytes of optimizer state each live stage owner of ``plan`` keeps: its blocks' whole
    state, or under the distributed optimizer their fullest holder's share in ``plan``."""
    held = held_profile(plan, profile, pricing=pricing)
    return {worker: sum(held.block(b).optimizer_bytes for b in blocks)
            for worker, blocks in plan.holdings(profile).items()}


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
