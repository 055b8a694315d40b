"""Dynamic-parallelism plans: Algorithm 1 of paper 001 over asymmetric pipelines.

For each candidate strategy (pipeline lengths over the survivors): distribute the batch,
pick each length's best layer split, estimate step time as the slowest pipeline plus DP
sync in coloured rounds. The best few strategies are then placed on real workers by the
restorer's Kuhn-Munkres assignment, which also yields their weight transfers.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Mapping, Sequence

from odyssey_megatron.blocks import Block
from odyssey_megatron.cluster import ClusterState
from odyssey_megatron.estimator.communication import allreduce_time
from odyssey_megatron.plan import ExecutionPlan, PipelinePlan, StagePlan
from odyssey_megatron.planner.batch import assign_micro_batch_ids, distribute_batch
from odyssey_megatron.planner.layers import SplitSearch, stage_ranges
from odyssey_megatron.planner.strategies import parallel_strategies, pipeline_length_sweep
from odyssey_megatron.profile import ModelProfile
from odyssey_megatron.restorer import color_rounds, plan_weight_transfer, sync_units, with_sync


@dataclass(frozen=True)
class Layout:
    """A strategy with its batch and layer distribution, before workers are chosen."""

    splits: tuple[tuple[int, ...], ...]
    """Layer counts per stage, one entry per pipeline."""
    micro_batches: tuple[int, ...]
    est_step_time_s: float


class ReparallelizeSearch:
    """Algorithm 1 for one decision (the split and sync-round caches live as long as it)."""

    def __init__(self, profile: ModelProfile, *, max_layer_splits: int):
        self.profile = profile
        self.splits = SplitSearch(profile, limit=max_layer_splits)
        self._sync_cache: dict[tuple, float] = {}
        self._found: dict[tuple, list[Layout]] = {}
        """``layouts`` per window: every failure of one worker leaves the same number of
        survivors, so the decisions prepared for them share one search."""

    def layouts(
        self,
        *,
        num_workers: int,
        num_micro_batches: int,
        current_dp: int,
        dp_radius: int,
        pp_radius: int,
        sweep: bool = False,
    ) -> list[Layout]:
        """Every feasible candidate layout, fastest first: the strategies within the radii of
        the current DP degree and, with ``sweep``, one per pipeline length plus the radii
        around the DP degree of the fastest of those."""
        key = (num_workers, num_micro_batches, current_dp, dp_radius, pp_radius, sweep)
        if key not in self._found:
            self._found[key] = self._search(num_workers=num_workers, num_micro_batches=num_micro_batches,
                                            current_dp=current_dp, dp_radius=dp_radius, pp_radius=pp_radius,
                                            sweep=sweep)
        return list(self._found[key])

    def _search(self, *, num_workers: int, num_micro_batches: int, current_dp: int, dp_radius: int, pp_radius: int,
                sweep: bool) -> list[Layout]:
        max_idle = max(0, num_workers // max(current_dp, 1) - 1)
        centres = [current_dp]
        found: dict[tuple[int, ...], Layout] = {}
        if sweep:
            coarse = pipeline_length_sweep(num_workers=num_workers, max_stages=self.profile.num_layers,
                                           max_idle=max_idle)
            found.update(self._layouts(coarse, num_micro_batches))
            if found:
                centres.append(len(min(found.values(), key=_speed).splits))
        for centre in centres:
            strategies = parallel_strategies(
                num_workers=num_workers,
                current_dp=centre,
                dp_radius=dp_radius,
                pp_radius=pp_radius,
                max_stages=self.profile.num_layers,
                max_idle=max_idle,
            )
            found.update(self._layouts([s for s in strategies if s not in found], num_micro_batches))
        return sorted(found.values(), key=_speed)

    def _layouts(self, strategies: list[tuple[int, ...]], num_micro_batches: int) -> dict[tuple[int, ...], Layout]:
        layouts = {}
        for strategy in strategies:
            if len(strategy) > num_micro_batches:
                continue
            layout = self._layout(strategy, num_micro_batches)
            if layout is not None:
                layouts[strategy] = layout
        return layouts

    def _layout(self, strategy: tuple[int, ...], num_micro_batches: int) -> Layout | None:
        """Paper IV-A hands out micro-batches in proportion to pipeline sizes. A short
        pipeline has a smaller bubble, so proportional shares leave it idle while a long
        one finishes; from there, one micro-batch at a time moves off the slowest pipeline
        to the pipeline where it lowers the step most, while that helps."""
        shares = distribute_batch(num_micro_batches, strategy)
        priced = self._price(strategy, shares)
        while priced is not None and len(set(strategy)) > 1:  # equal pipelines are balanced already
            times, _ = priced
            slowest = max(range(len(shares)), key=times.__getitem__)
            moves = {}  # one receiver per class of equal pipelines
            if shares[slowest] > 1:
                for k, (length, share) in enumerate(zip(strategy, shares)):
                    if (length, share) != (strategy[slowest], shares[slowest]):
                        moves.setdefault((length, share), k)
            best = None
            for k in moves.values():
                moved = list(shares)
                moved[slowest] -= 1
                moved[k] += 1
                candidate = self._price(strategy, moved)
                if candidate is not None and max(candidate[0]) < max(times) - 1e-9 and (
                        best is None or max(candidate[0]) < max(best[1][0])):
                    best = (moved, candidate)
            if best is None:
                break
            shares, priced = best
        if priced is None:
            return None
        times, splits = priced
        return Layout(splits, tuple(shares), max(times) + self._sync_time(splits))

    def _price(self, strategy: tuple[int, ...], shares: Sequence[int]) -> tuple[list[float], tuple] | None:
        """(pipeline time per pipeline, layer split per pipeline): each pipeline length gets
        the best split for its busiest share; None when that fits no memory budget."""
        busiest = Counter()
        for length, share in zip(strategy, shares):
            busiest[length] = max(busiest[length], share)
        split_of = {}
        for length, share in busiest.items():
            best = self.splits.best(length, share)
            if best is None:
                return None
            split_of[length] = best[0]
        splits = tuple(split_of[length] for length in strategy)
        return [self.splits.pipeline_cost(split, share)[0] for split, share in zip(splits, shares)], splits

    def _sync_time(self, splits: tuple[tuple[int, ...], ...]) -> float:
        """DP sync of a layout, from one representative pipeline per distinct split (two when
        it repeats), so conflicts and rounds match the full plan at a fraction of the cost."""
        counts = Counter(splits)
        key = tuple(sorted(counts.items()))
        if key not in self._sync_cache:
            pipelines, owner_split, worker = [], {}, 0
            for split, count in key:
                for _ in range(min(count, 2)):
                    stages = []
                    for layers in stage_ranges(split):
                        stages.append(StagePlan(worker, layers))
                        owner_split[worker] = split
                        worker += 1
                    pipelines.append(PipelinePlan(tuple(stages), (0,)))
            sample = ExecutionPlan(0, "reparallelize", self.profile.num_layers, 1, tuple(pipelines))
            units = sync_units(sample, self.profile)
            total = 0.0
            for round_ in color_rounds(units):
                slowest = 0.0
                for index in round_:
                    unit = units[index]
                    group = sum(counts[s] for s in {owner_split[w] for w in unit.workers})
                    num_bytes = sum(self.profile.block(b).grad_bytes for b in unit.blocks)
                    slowest = max(slowest, allreduce_time(
                        num_bytes,
                        group_size=group,
                        bandwidth=self.profile.inter_node_bandwidth,
                        latency_s=self.profile.link_latency_s,
                    ))
                total += slowest
            self._sync_cache[key] = total
        return self._sync_cache[key]


def _speed(layout: Layout) -> tuple[float, int]:
    """Fastest first; on a tie, fewer pipelines (fewer DP sync participants)."""
    return layout.est_step_time_s, len(layout.splits)


def place_layout(
    layout: Layout,
    *,
    current: ExecutionPlan,
    holdings: Mapping[int, Sequence[Block]],
    cluster: ClusterState,
    profile: ModelProfile,
) -> ExecutionPlan:
    """Put ``layout`` on the survivors with the least weight movement (Kuhn-Munkres) from
    ``holdings``, what each live worker holds under ``current`` (``live_holdings``)."""
    slots, ranges = [], []
    for split in layout.splits:
        stage_layers = stage_ranges(split)
        ranges.append(stage_layers)
        for si, (start, end) in enumerate(stage_layers):
            slots.append(profile.stage_blocks(start, end, first=si == 0, last=si == len(split) - 1))
    transfer = plan_weight_transfer(holdings=holdings, slots=slots, profile=profile, cluster=cluster)
    workers = iter(transfer.assignment)
    pipelines = tuple(
        PipelinePlan(tuple(StagePlan(next(workers), layers) for layers in stage_layers), ids)
        for stage_layers, ids in zip(ranges, assign_micro_batch_ids(layout.micro_batches))
    )
    plan = ExecutionPlan(
        generation=current.generation + 1,
        policy="reparallelize",
        num_layers=current.num_layers,
        tensor_parallel_size=current.tensor_parallel_size,
        pipelines=pipelines,
        transfers=transfer.transfers,
    )
    return with_sync(plan, profile)


def describe_layout(splits: Sequence[tuple[int, ...]]) -> str:
    """'[4,4]x2 + [3,3,2]' style summary for logs."""
    counts = Counter(splits)
    return " + ".join(f"[{','.join(map(str, s))}]x{n}" for s, n in sorted(counts.items(), key=lambda kv: -len(kv[0])))
