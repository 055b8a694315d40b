"""Layer splits for one pipeline (paper 001, IV-A "Layer Distribution").

Split evenly; the remainder layers go to r of the S stages, every placement enumerated
while there are at most ``limit`` of them. Beyond that a heuristic set of placements
(at the end, at the start, spread out, in the middle) stands in for the full list.
"""

from __future__ import annotations

import itertools
from math import comb

from odyssey_megatron.estimator import estimate_plan
from odyssey_megatron.plan import ExecutionPlan, PipelinePlan, StagePlan
from odyssey_megatron.profile import ModelProfile


def _with_extra(base: int, num_stages: int, extra_at: tuple[int, ...]) -> tuple[int, ...]:
    chosen = set(extra_at)
    return tuple(base + (1 if s in chosen else 0) for s in range(num_stages))


def layer_splits(num_layers: int, num_stages: int, *, limit: int) -> list[tuple[int, ...]]:
    """Candidate layer counts per stage, in a deterministic order."""
    if not 1 <= num_stages <= num_layers:
        raise ValueError(f"cannot split {num_layers} layers over {num_stages} stages")
    base, remainder = divmod(num_layers, num_stages)
    if comb(num_stages, remainder) <= limit:
        placements = itertools.combinations(range(num_stages), remainder)
    else:
        stride = num_stages / remainder
        placements = [
            tuple(range(num_stages - remainder, num_stages)),
            tuple(range(remainder)),
            tuple(sorted({int(num_stages - 1 - i * stride) for i in range(remainder)})),
            tuple(range((num_stages - remainder) // 2, (num_stages - remainder) // 2 + remainder)),
            tuple(range(1, remainder + 1)),
            tuple(range(num_stages - remainder - 1, num_stages - 1)),
        ]
    seen, splits = set(), []
    for placement in placements:
        split = _with_extra(base, num_stages, placement)
        if sum(split) == num_layers and split not in seen:
            seen.add(split)
            splits.append(split)
    return splits


def stage_ranges(split: tuple[int, ...]) -> list[tuple[int, int]]:
    """[start, end) per stage for layer counts ``split``."""
    ranges, start = [], 0
    for count in split:
        ranges.append((start, start + count))
        start += count
    return ranges


class SplitSearch:
    """Best layer split per (stages, micro-batches) for one decision, memoised.

    A split is estimated on a lone pipeline with the real op-list programme; splits that
    overflow the memory budget are dropped; ties in time go to lower peak memory, then to
    the split with extra layers latest (the last stage keeps the fewest activations).
    """

    def __init__(self, profile: ModelProfile, *, limit: int):
        self._profile = profile
        self._limit = limit
        self._best: dict[tuple[int, int], tuple[tuple[int, ...], float, int] | None] = {}
        self._time: dict[tuple[tuple[int, ...], int], tuple[float, int]] = {}

    def pipeline_cost(self, split: tuple[int, ...], num_micro_batches: int) -> tuple[float, int]:
        """(pipeline time, peak memory of its fullest stage) for one pipeline."""
        key = (split, num_micro_batches)
        if key not in self._time:
            plan = lone_pipeline_plan(split, num_micro_batches)
            estimate = estimate_plan(plan, self._profile)
            self._time[key] = (estimate.pipeline_time_s, estimate.max_peak_memory_bytes)
        return self._time[key]

    def best(self, num_stages: int, num_micro_batches: int) -> tuple[tuple[int, ...], float, int] | None:
        """(split, pipeline time, peak memory), or None if no split fits in memory."""
        key = (num_stages, num_micro_batches)
        if key not in self._best:
            options = []
            for split in layer_splits(self._profile.num_layers, num_stages, limit=self._limit):
                time_s, peak = self.pipeline_cost(split, num_micro_batches)
                if peak <= self._profile.memory_budget_bytes:
                    options.append((round(time_s, 9), peak, split, time_s))
            best = min(options, default=None)
            self._best[key] = None if best is None else (best[2], best[3], best[1])
        return self._best[key]


def lone_pipeline_plan(split: tuple[int, ...], num_micro_batches: int) -> ExecutionPlan:
    """A one-pipeline plan on workers 0..S-1, for estimating a pipeline shape alone."""
    stages = tuple(StagePlan(worker, layers) for worker, layers in enumerate(stage_ranges(split)))
    return ExecutionPlan(
        generation=0,
        policy="initial",
        num_layers=sum(split),
        tensor_parallel_size=1,
        pipelines=(PipelinePlan(stages, tuple(range(num_micro_batches))),),
    )
