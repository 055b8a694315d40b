"""Dynamic-parallelism plans: Algorithm 1 of paper 001 over asymmetric pipelines.

For each candidate strategy (pipeline lengths over the survivors): distribute the batch,
pick each length's best layer split, estimate step time as the slowest pipeline plus DP
sync in coloured rounds. The best few strategies are then placed on real workers by the
restorer's Kuhn-Munkres assignment, which also yields their weight transfers.

Layouts are ranked by the pricing that scores the plans (``ReparallelizeSearch.layouts``):
a layout's layer splits are chosen on plain 1F1B (cheap, thousands per decision), but its
step is priced as the runtime runs it, split backwards and staggered optimizer steps
included, which moves a long pipeline's bubble into weight-gradient work and can reorder
the layouts by 20 %. Only the layouts that can still reach the fastest few are priced so.

Under the distributed optimizer a layout's memory is checked at its own holder counts
(``estimator.memory.layout_profile``): a layout of fewer pipelines keeps a larger share
of each block's optimizer state on each rank, so its layer splits are chosen against that.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, replace
from typing import Callable, Mapping, Optional, Sequence

from odyssey_megatron.blocks import Block
from odyssey_megatron.cluster import ClusterState
from odyssey_megatron.estimator.communication import allreduce_time
from odyssey_megatron.estimator.memory import layout_profile
from odyssey_megatron.estimator.optimizer import optimizer_time
from odyssey_megatron.estimator.step_schedule import timed_step_schedule
from odyssey_megatron.plan import ExecutionPlan, PipelinePlan, StagePlan
from odyssey_megatron.planner.batch import assign_micro_batch_ids, distribute_batch
from odyssey_megatron.planner.layers import SplitSearch, stage_ranges
from odyssey_megatron.planner.strategies import parallel_strategies, pipeline_length_sweep
from odyssey_megatron.profile import ModelProfile
from odyssey_megatron.restorer import color_rounds, plan_weight_transfer, sync_units, with_sync
from odyssey_megatron.settings import PLAIN, Pricing


@dataclass(frozen=True)
class Layout:
    """A strategy with its batch and layer distribution, before workers are chosen."""

    splits: tuple[tuple[int, ...], ...]
    """Layer counts per stage, one entry per pipeline."""
    micro_batches: tuple[int, ...]
    est_step_time_s: float
    """Plain 1F1B pipeline time plus DP sync: what its layer splits and batch shares were
    chosen by (``_layout``)."""
    step_time_s: Optional[float] = None
    """Its step as the plan placed from it runs (``ReparallelizeSearch.price``); None where
    ``layouts`` did not need it."""

    @property
    def symmetric(self) -> bool:
        """Megatron's DP x PP: every pipeline has the same layer split."""
        return len(set(self.splits)) == 1


class ReparallelizeSearch:
    """Algorithm 1 for one decision (the split, sync-round and price caches live as long as it)."""

    def __init__(self, profile: ModelProfile, *, max_layer_splits: int):
        self.profile = profile
        self.splits = SplitSearch(profile, limit=max_layer_splits)
        """Splits by the whole optimizer state on every rank; their times are every layout's."""
        self._limit = max_layer_splits
        self._held_splits: dict[frozenset, SplitSearch] = {}
        """Under the distributed optimizer, a split search per set of holder counts."""
        self._sync_cache: dict[tuple, float] = {}
        self._priced: dict[tuple, float] = {}
        """Priced pipeline and optimizer seconds per set of (split, micro-batches) classes and
        pricing (and pipeline lengths, which set the memory, under the distributed optimizer)."""
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
        alive_dp: int | None = None,
        sweep: bool = False,
        fastest: int = 1,
        pricing: Pricing = PLAIN,
        checkpoint: Callable[[], None] = lambda: None,
    ) -> list[Layout]:
        """Every feasible candidate layout: the strategies within the radii of the DP degree
        ``current_dp`` and of ``alive_dp`` (the DP degree the workers alive give) and, with ``sweep``, one per pipeline length plus the radii around
        the DP degree of the fastest of those; each leaves idle fewer workers than its
        shortest pipeline has stages (without ``sweep``, fewer than the pipeline length of
        the window's centre). The ``fastest`` fastest
        as priced (``price``, with ``pricing``: how the plans run) come first, fastest first,
        then the fastest symmetric layout where they do not hold it, then the rest
        (``step_time_s`` None where a lower bound shows they are not among those). ``checkpoint``
        is called between two pricings and may raise to stop the search."""
        key = (num_workers, num_micro_batches, current_dp, alive_dp, dp_radius, pp_radius, sweep, fastest, pricing)
        if key not in self._found:
            self._found[key] = self._ranked(
                self._search(num_workers=num_workers, num_micro_batches=num_micro_batches, current_dp=current_dp,
                             alive_dp=alive_dp, dp_radius=dp_radius, pp_radius=pp_radius, sweep=sweep,
                             pricing=pricing, checkpoint=checkpoint),
                fastest=fastest, pricing=pricing, checkpoint=checkpoint)
        return list(self._found[key])

    def _search(self, *, num_workers: int, num_micro_batches: int, current_dp: int, alive_dp: int | None,
                dp_radius: int, pp_radius: int, sweep: bool, pricing: Pricing,
                checkpoint: Callable[[], None]) -> list[Layout]:
        """The candidate layouts, priced on plain 1F1B (``_layout``)."""
        centres = dict.fromkeys([current_dp] + ([alive_dp] if alive_dp is not None else []))
        found: dict[tuple[int, ...], Layout] = {}
        if sweep:
            coarse = pipeline_length_sweep(num_workers=num_workers, max_stages=self.profile.num_layers,
                                           max_idle=self.profile.num_layers - 1)
            found.update(self._layouts(coarse, num_micro_batches, pricing, checkpoint))
            if found:
                centres[len(min(found.values(), key=_speed).splits)] = None
        for centre in centres:
            strategies = parallel_strategies(
                num_workers=num_workers,
                current_dp=centre,
                dp_radius=dp_radius,
                pp_radius=pp_radius,
                max_stages=self.profile.num_layers,
                # a strategy idles fewer workers than its shortest pipeline has stages; the
                # window alone (a decision on the critical path), fewer than its centre's length
                max_idle=self.profile.num_layers - 1 if sweep else max(0, num_workers // max(centre, 1) - 1),
            )
            found.update(self._layouts([s for s in strategies if s not in found], num_micro_batches, pricing,
                                       checkpoint))
        return list(found.values())

    def _ranked(self, layouts: list[Layout], *, fastest: int, pricing: Pricing,
                checkpoint: Callable[[], None]) -> list[Layout]:
        """``layouts`` in the order ``layouts`` describes. Each is priced (``price``) in order
        of its lower bound (``lower_bound_s``) while that bound is below the ``fastest``-th
        fastest step priced so far, or, for a symmetric layout, below the fastest symmetric
        one's: the head is what pricing them all would give. The rest follow by bound."""
        bounded = sorted((self.lower_bound_s(layout), _speed(layout), i) for i, layout in enumerate(layouts))
        priced: list[Layout] = []
        rest: list[tuple[float, tuple, int]] = []
        symmetric = float("inf")
        for bound, speed, i in bounded:
            layout = layouts[i]
            times = sorted(p.step_time_s for p in priced)
            kth = times[fastest - 1] if len(times) >= fastest else float("inf")
            if bound >= kth and not (layout.symmetric and bound < symmetric):
                rest.append((bound, speed, i))
                continue
            checkpoint()
            layout = replace(layout, step_time_s=self.price(layout, pricing=pricing))
            priced.append(layout)
            if layout.symmetric:
                symmetric = min(symmetric, layout.step_time_s)
        priced.sort(key=_priced_speed)
        head = priced[:fastest]
        best_symmetric = next((p for p in priced if p.symmetric), None)
        if best_symmetric is not None and best_symmetric not in head:
            head.append(best_symmetric)
        return head + sorted((p for p in priced if p not in head), key=_priced_speed) + [
            layouts[i] for _, _, i in sorted(rest)]

    def _classes(self, layout: Layout) -> tuple[tuple[tuple[int, ...], int], ...]:
        """The layout's distinct (layer split, micro-batches) pipelines."""
        return tuple(sorted(set(zip(layout.splits, layout.micro_batches))))

    def lower_bound_s(self, layout: Layout) -> float:
        """No schedule runs a step of ``layout`` faster (``price`` included): its busiest
        worker's forwards and backwards, one after another, then its DP sync."""
        busiest = max(share * self.splits.busiest_stage_s(split) for split, share in self._classes(layout))
        return busiest + self._sync_time(layout.splits)

    def price(self, layout: Layout, *, pricing: Pricing) -> float:
        """``layout``'s step as ``estimate_plan`` prices the plan placed from it with
        ``pricing``: one pipeline of each class (the estimator keeps no more,
        ``estimator.distinct``) on adjacent workers, its DP sync and optimizer step, less the
        global norm's all-reduce, alike for every layout."""
        classes = self._classes(layout)
        lengths = tuple(sorted(len(split) for split in layout.splits))
        key = classes, pricing, lengths if pricing.distributed_optimizer else None  # its memory: ``layout_profile``
        if key not in self._priced:
            pipelines, worker = [], 0
            for (split, _), ids in zip(classes, assign_micro_batch_ids([share for _, share in classes])):
                stages = []
                for layers in stage_ranges(split):
                    stages.append(StagePlan(worker, layers))
                    worker += 1
                pipelines.append(PipelinePlan(tuple(stages), ids))
            sample = ExecutionPlan(0, "reparallelize", self.profile.num_layers, 1, tuple(pipelines))
            held = layout_profile(self.profile, lengths, pricing=pricing)
            _, pipeline_s = timed_step_schedule(sample, held, pricing=pricing)
            self._priced[key] = pipeline_s + optimizer_time(sample, self.profile, None, staggered=True)
        return self._priced[key] + self._sync_time(layout.splits)

    def _layouts(self, strategies: list[tuple[int, ...]], num_micro_batches: int, pricing: Pricing,
                 checkpoint: Callable[[], None]) -> dict[tuple[int, ...], Layout]:
        layouts = {}
        for strategy in strategies:
            if len(strategy) > num_micro_batches:
                continue
            checkpoint()
            layout = self._layout(strategy, num_micro_batches, pricing)
            if layout is not None:
                layouts[strategy] = layout
        return layouts

    def _layout(self, strategy: tuple[int, ...], num_micro_batches: int, pricing: Pricing = PLAIN) -> Layout | None:
        """Paper IV-A hands out micro-batches in proportion to pipeline sizes. A short
        pipeline has a smaller bubble, so proportional shares leave it idle while a long
        one finishes; from there, one micro-batch at a time moves off the slowest pipeline
        to the pipeline where it lowers the step most, while that helps."""
        shares = distribute_batch(num_micro_batches, strategy)
        search = self.split_search(strategy, pricing=pricing)
        priced = self._price(strategy, shares, search)
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
                candidate = self._price(strategy, moved, search)
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

    def split_search(self, lengths: Sequence[int], *, pricing: Pricing) -> SplitSearch:
        """The split search whose memory checks are those of a layout of pipelines of
        ``lengths`` stages (``layout_profile``): the one search, but under the distributed
        optimizer one per set of holder counts."""
        if not pricing.distributed_optimizer:
            return self.splits
        key = frozenset(self.profile.pipeline_holder_counts(lengths).items())
        if key not in self._held_splits:
            self._held_splits[key] = SplitSearch(layout_profile(self.profile, lengths, pricing=pricing),
                                                 limit=self._limit)
        return self._held_splits[key]

    def _price(self, strategy: tuple[int, ...], shares: Sequence[int],
               search: SplitSearch) -> tuple[list[float], tuple] | None:
        """(pipeline time per pipeline, layer split per pipeline): each pipeline length gets
        the best split (of ``search``, the strategy's) for its busiest share; None when that
        fits no memory budget."""
        busiest = Counter()
        for length, share in zip(strategy, shares):
            busiest[length] = max(busiest[length], share)
        split_of = {}
        for length, share in busiest.items():
            best = search.best(length, share)
            if best is None:
                return None
            split_of[length] = best[0]
        splits = tuple(split_of[length] for length in strategy)
        return [search.pipeline_cost(split, share)[0] for split, share in zip(splits, shares)], splits

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


def _priced_speed(layout: Layout) -> tuple[float, int]:
    """Fastest as priced first; on a tie, fewer pipelines."""
    return layout.step_time_s, len(layout.splits)


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
    pricing: Pricing = PLAIN,
) -> ExecutionPlan:
    """Put ``layout`` on the survivors with the least weight movement (Kuhn-Munkres) from
    ``holdings``, what each live worker holds under ``current`` (``live_holdings``). A
    block moved carries its weights and optimizer state, under the distributed optimizer
    (``pricing``) the share its new holder keeps in the layout (``layout_profile``)."""
    slots, ranges = [], []
    for split in layout.splits:
        stage_layers = stage_ranges(split)
        ranges.append(stage_layers)
        for si, (start, end) in enumerate(stage_layers):
            slots.append(profile.stage_blocks(start, end, first=si == 0, last=si == len(split) - 1))
    held = layout_profile(profile, [len(split) for split in layout.splits], pricing=pricing)
    transfer = plan_weight_transfer(holdings=holdings, slots=slots, profile=held, cluster=cluster)
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
