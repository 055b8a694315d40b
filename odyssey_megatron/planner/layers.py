"""Layer splits for one pipeline (paper 001, IV-A "Layer Distribution").

Split evenly; the remainder layers go to r of the S stages, every placement enumerated
while there are at most ``limit`` of them. Beyond that a heuristic set of placements
(at the end, at the start, spread out, in the middle) stands in for the full list.
"""

from __future__ import annotations

import itertools
from math import comb

from odyssey_megatron.estimator.memory import stage_memory
from odyssey_megatron.estimator.pipeline import lone_pipeline_time
from odyssey_megatron.estimator.replay import p2p_time
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

    A split is estimated on a lone pipeline with the Eq. 11 programme; splits that
    overflow the memory budget are dropped; ties in time go to lower peak memory, then to
    the split with extra layers latest (the last stage keeps the fewest activations).
    Splits are priced in order of a lower bound on their time, and pricing stops once
    the bound exceeds the best time found, so the answer is that of pricing them all.
    """

    def __init__(self, profile: ModelProfile, *, limit: int):
        self._profile = profile
        self._limit = limit
        self._link_s = p2p_time(profile, same_node=True)
        self._best: dict[tuple[int, int], tuple[tuple[int, ...], float, int] | None] = {}
        self._time: dict[tuple[tuple[int, ...], int], tuple[float, int]] = {}
        self._stage: dict[tuple[int, int, bool, bool], tuple[tuple[float, float], int, int]] = {}

    def _stage_cost(self, start: int, end: int, first: bool, last: bool) -> tuple[tuple[float, float], int, int]:
        """((forward, backward), static bytes, activation bytes per micro-batch) of one stage."""
        key = (start, end, first, last)
        if key not in self._stage:
            compute = self._profile.stage_compute(start, end, first=first, last=last)
            self._stage[key] = (compute, *stage_memory(self._profile, start, end, first=first, last=last))
        return self._stage[key]

    def _stages(self, split: tuple[int, ...], num_micro_batches: int) -> tuple[list[tuple[float, float]], int]:
        """((forward, backward) per stage, peak memory of the fullest stage under 1F1B)."""
        num_stages = len(split)
        stage_times, peak = [], 0
        for s, (start, end) in enumerate(stage_ranges(split)):
            compute, static, activation = self._stage_cost(start, end, s == 0, s == num_stages - 1)
            stage_times.append(compute)
            peak = max(peak, static + min(num_stages - s, num_micro_batches) * activation)
        return stage_times, peak

    def busiest_stage_s(self, split: tuple[int, ...]) -> float:
        """Forward plus backward seconds of one micro-batch on the slowest stage of ``split``."""
        num_stages = len(split)
        return max(sum(self._stage_cost(start, end, s == 0, s == num_stages - 1)[0])
                   for s, (start, end) in enumerate(stage_ranges(split)))

    def pipeline_cost(self, split: tuple[int, ...], num_micro_batches: int) -> tuple[float, int]:
        """(pipeline time, peak memory of its fullest stage) for one pipeline."""
        key = (split, num_micro_batches)
        if key not in self._time:
            stage_times, peak = self._stages(split, num_micro_batches)
            self._time[key] = (lone_pipeline_time(stage_times, num_micro_batches, link_s=self._link_s), peak)
        return self._time[key]

    def best(self, num_stages: int, num_micro_batches: int) -> tuple[tuple[int, ...], float, int] | None:
        """(split, pipeline time, peak memory), or None if no split fits in memory."""
        key = (num_stages, num_micro_batches)
        if key not in self._best:
            bounded = []
            for split in layer_splits(self._profile.num_layers, num_stages, limit=self._limit):
                stage_times, peak = self._stages(split, num_micro_batches)
                if peak <= self._profile.memory_budget_bytes:
                    bound = lone_pipeline_lower_bound(stage_times, num_micro_batches, link_s=self._link_s)
                    bounded.append((bound, split))
            best = None
            for bound, split in sorted(bounded):
                if best is not None and bound > best[0] + 1e-9:  # cannot tie even after rounding
                    break
                time_s, peak = self.pipeline_cost(split, num_micro_batches)
                option = (round(time_s, 9), peak, split, time_s)
                best = option if best is None else min(best, option)
            self._best[key] = None if best is None else (best[2], best[3], best[1])
        return self._best[key]


def lone_pipeline_lower_bound(stage_times: list[tuple[float, float]], num_micro_batches: int, *, link_s: float) -> float:
    """No 1F1B schedule beats this: stage s runs all its forwards and backwards, after the
    first micro-batch's forwards reached it and before the last one's backwards left."""
    bound = before = 0.0
    for s, (forward_s, backward_s) in enumerate(stage_times):
        bound = max(bound, before + num_micro_batches * (forward_s + backward_s) + 2 * s * link_s)
        before += forward_s + backward_s
    return bound
