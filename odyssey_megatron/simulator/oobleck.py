"""Oobleck (paper 002) in the simulator: pipeline templates, reinstantiation, batch redistribution.

Unit. Oobleck's *node* is one of our workers (a TP group): in Oobleck a node runs one
pipeline stage with its GPUs sharding that stage (section 4.1.2: a stage never spans
nodes), which is exactly what a worker does here. So "n0 nodes" reads "n0 workers".

Templates (4.1.1). n0 is the fewest stages whose best layer split fits in memory. There is
one template per pipeline size n0 .. N - f*n0 (N: workers at start, f: tolerated
failures; never more stages than layers), the paper's largest p, so that any
N' >= (f+1)*n0 workers split into at least f+1 pipelines. A template's layer split is
the shared split search's best at the paper's planning micro-batch count 4S (4.1.2); step
times therefore come from the same estimator as every other system.

Instantiation (4.2). Every multiset of template sizes that uses all workers with at least
f+1 pipelines (and at most one pipeline per micro-batch) is enumerated (4.2.1, the coin
change of Eq. 5); past ``MAX_ENUMERATED_MIXES`` of them (hundreds of workers, where
Oobleck's own list would run to millions) only mixes of one or two sizes are kept.
Oobleck's planner ranks them by step time without looking at placement (lone-pipeline
times plus the layer-granular DP sync, i.e. ``estimate_plan`` without a cluster); the
fastest wins and pipelines get consecutive workers, smallest template first, as the
authors' instantiator does. The winner then runs, like every system's plan, with the
job's schedule options (``SimulationContext.pricing``).

Batch distribution (4.2.2, Eq. 6). Eq. 6 balances N_b,i * T_i, T_i being a pipeline's
time per micro-batch (its planning time at 4S micro-batches over 4S); we hand out
micro-batches one at a time to the pipeline that would finish earliest, every pipeline
starting with one, so the global batch stays exactly ``num_micro_batches`` (5.2).

Reinstantiation (5.1), step for step as the authors' ``ReconfigurationEngine``: a pipeline
that lost workers but keeps >= n0 takes the template of its new size (simple); a smaller
one borrows the last worker of the largest pipeline that has more than n0 (borrow); when
none can lend, under-sized pipelines merge with each other, then with a full one (merge).
Workers are sorted in each pipeline and stage i runs on the i-th; pipelines are ordered
by (size, first worker). Only the pipelines that changed move layers.

Copying (5). Every worker fetches the blocks of its new stage it does not hold. As in the
authors' code, each block is broadcast from one live former holder (the first in the old
pipeline order) to all that need it; each endpoint's link carries its bytes
(``state_bytes``: weights and optimizer state) at ``profile.bandwidth(same_node)``, and the
busiest endpoint sets the copy time.

Costs. A failure pauses for ``detection_s + reconfigure_s`` plus the copy and loses the
halted iteration: half the step before the failure on average, as Odyssey and ReCycle
are charged here. A repair re-runs instantiation on all workers (3.3: instantiation
"happens whenever a node fails or is added"), pauses ``reconfigure_s`` plus the copy and
loses nothing (it can wait for the step boundary). The reported throughput is the shared
estimator's on the real placement.

Giving up (3.4, 5). Below (f+1)*n0 workers, or when a layer has no live replica, Oobleck
cannot continue in memory. The paper stops the job for the user to restart from a
checkpoint; here it restarts from the last checkpoint (``restart_from_checkpoint``):
back into Oobleck pipelines when (f+1)*n0 workers are alive, otherwise onto the symmetric
fallback layout, where every later event restarts again until enough workers are back.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
from collections import defaultdict
from dataclasses import dataclass
from typing import AbstractSet, Iterator, Sequence

from odyssey_megatron.blocks import Block, block_sort_key
from odyssey_megatron.cluster import ClusterState
from odyssey_megatron.estimator import estimate_plan
from odyssey_megatron.estimator.communication import sync_time, unit_sync_time
from odyssey_megatron.estimator.optimizer import optimizer_time
from odyssey_megatron.plan import ExecutionPlan, PipelinePlan, StagePlan, SyncUnit
from odyssey_megatron.planner.batch import assign_micro_batch_ids
from odyssey_megatron.planner.layers import stage_ranges
from odyssey_megatron.restorer import with_sync
from odyssey_megatron.simulator.restart import restart_from_checkpoint, split_search
from odyssey_megatron.simulator.system import Outcome, SimulationContext, initial_layout

__all__ = ["OobleckPipeline", "OobleckSystem", "reinstantiate"]

PLANNING_MICRO_BATCHES_PER_STAGE = 4
"""Oobleck plans templates with N_b = 4S micro-batches (4.1.2)."""
MAX_ENUMERATED_MIXES = 20_000
"""Template mixes listed exhaustively before the search keeps two-size mixes only."""


@dataclass(frozen=True)
class OobleckPipeline:
    workers: tuple[int, ...]
    """Sorted; stage i runs on ``workers[i]``. Workers beyond the template idle: only when
    no template matches the size (stage count capped by the layer count)."""
    num_stages: int
    """The template it is instantiated from (templates are named by their size)."""

    @property
    def stage_workers(self) -> tuple[int, ...]:
        return self.workers[: self.num_stages]


class OobleckSystem:
    name = "oobleck"
    spare_devices = 0

    def __init__(
        self,
        context: SimulationContext,
        *,
        tolerated_failures: int = 2,
        reconfigure_s: float = 8.0,
        detection_s: float = 0.0,
        start_on_job_plan: bool = False,
    ):
        """``reconfigure_s``: rebuild process groups and the model and optimizer on the new
        stages, copies excluded; the work Odyssey's reparallelize pays, so the same default
        (``OdysseyConfig.reparallelize_restart_s``). ``detection_s``: from a failure to the
        survivors knowing of it (pass the scenario's, as for the other systems).
        ``start_on_job_plan``: start on the job's own DP x PP plan, as every system in a
        comparison does, where its pipelines are instances of the templates; else on
        Oobleck's own instantiation."""
        if tolerated_failures < 0:
            raise ValueError(f"tolerated_failures must be >= 0, got {tolerated_failures}")
        if context.num_micro_batches < tolerated_failures + 1:
            raise ValueError(
                f"{context.num_micro_batches} micro-batches cannot feed the f + 1 = {tolerated_failures + 1} "
                "pipelines Oobleck keeps: lower tolerated_failures"
            )
        self.context = context
        self.tolerated_failures = tolerated_failures
        self.reconfigure_s = reconfigure_s
        self.detection_s = detection_s
        self.start_on_job_plan = start_on_job_plan
        self.min_pipeline_workers = self._smallest_pipeline()
        """n0: the fewest workers (stages) a pipeline needs to fit in memory."""
        self.templates: dict[int, tuple[int, ...]] = {}
        """Pipeline size -> layer split; fixed at ``start`` for the whole run (4.1)."""
        self.pipelines: tuple[OobleckPipeline, ...] = ()
        """Current pipelines; empty after giving up, while the symmetric fallback runs."""
        self.micro_batches: tuple[int, ...] = ()
        """Micro-batches per pipeline, summing to the global batch."""
        self.step_s = 0.0
        self.samples_per_s = 0.0
        self._micro_batch_s: dict[int, float] = {}
        self._stage_work: dict[int, tuple[tuple[float, float], ...]] = {}
        self._heaviest_stage: dict[int, tuple[Block, ...]] = {}
        self._best_sizes: dict[int, tuple[int, ...]] = {}
        self._distributions: dict[tuple[int, ...], tuple[int, ...]] = {}
        self._planned_step_s: dict[tuple[int, ...], float] = {}

    @property
    def min_workers(self) -> int:
        """(f+1)*n0: below this Oobleck cannot keep f+1 replicas and gives up (5)."""
        return (self.tolerated_failures + 1) * self.min_pipeline_workers

    # -- System protocol -------------------------------------------------------------

    def start(self, cluster: ClusterState) -> float:
        """Generate the templates for the starting cluster and instantiate on it, or start on
        the job's own plan (``start_on_job_plan``)."""
        workers = len(cluster.alive_workers)
        if workers < self.min_workers:
            raise ValueError(
                f"Oobleck needs (f+1)*n0 = {self.min_workers} workers to tolerate "
                f"{self.tolerated_failures} failure(s), the cluster has {workers}: lower tolerated_failures"
            )
        search = split_search(self.context)
        largest = min(workers - self.tolerated_failures * self.min_pipeline_workers, self.context.num_layers)
        for size in range(self.min_pipeline_workers, largest + 1):
            found = search.best(size, PLANNING_MICRO_BATCHES_PER_STAGE * size)
            if found is not None:
                self._add_template(size, split=found[0], planning_s=found[1])
        pipelines = self._job_pipelines(workers) if self.start_on_job_plan else None
        if pipelines is not None:
            self._adopt(cluster, pipelines)
        else:
            self._instantiate(cluster)
        return self.samples_per_s

    def _job_pipelines(self, workers: int) -> tuple[OobleckPipeline, ...] | None:
        """The job's DP x PP plan as Oobleck pipelines; None where they are not template
        instances (another layer split), leave workers idle or are too few for f + 1."""
        job = initial_layout(self.context)
        pipelines = tuple(OobleckPipeline(tuple(s.worker for s in p.stages), p.num_stages) for p in job.pipelines)
        if (all(self.templates.get(p.num_stages) == p.layer_counts for p in job.pipelines)
                and all(list(p.workers) == sorted(p.workers) for p in pipelines)
                and len(job.workers) == workers and len(pipelines) > self.tolerated_failures):
            return pipelines
        return None

    def on_failure(self, cluster: ClusterState, failed: AbstractSet[int], now_s: float) -> Outcome:
        note = f"{len(failed)} worker(s) failed"
        if not self.pipelines:
            return self._restart(cluster, now_s, f"{note}; Oobleck is not running")
        if len(cluster.alive_workers) < self.min_workers:
            return self._restart(cluster, now_s, f"{note}; fewer than (f+1)*n0 = {self.min_workers} workers left")
        dead = cluster.failed_workers
        before = self.pipelines
        if not any(w in dead for p in before for w in p.stage_workers):
            self.pipelines = tuple(
                dataclasses.replace(p, workers=tuple(w for w in p.workers if w not in dead)) for p in before
            )
            return Outcome(pause_s=0.0, samples_per_s=self.samples_per_s, note=f"{note}: only idle workers")
        groups, steps = reinstantiate([list(p.workers) for p in before], failed=dead,
                                      min_workers=self.min_pipeline_workers)
        after = tuple(OobleckPipeline(tuple(g), self._template_for(len(g))) for g in groups)
        copy_s = self._copy_time(cluster, before=before, after=after)
        if copy_s is None:
            return self._restart(cluster, now_s, f"{note}; a layer has no live replica")
        lost_s = self.step_s / 2  # the halted iteration, half done on average
        self._adopt(cluster, after)
        return Outcome(
            pause_s=self.detection_s + self.reconfigure_s + copy_s,
            samples_per_s=self.samples_per_s,
            lost_s=lost_s,
            note=f"{note}: reinstantiated ({', '.join(steps)}) into pipelines of {self._sizes()}",
        )

    def on_join(self, cluster: ClusterState, joined: AbstractSet[int], now_s: float) -> Outcome:
        note = f"{len(joined)} worker(s) rejoined"
        if not self.pipelines:
            return self._restart(cluster, now_s, note, after_failure=False)
        before = self.pipelines
        after = self._instantiation(cluster)
        # Never None: the running pipelines hold every layer.
        copy_s = self._copy_time(cluster, before=before, after=after)
        self._adopt(cluster, after)
        return Outcome(pause_s=self.reconfigure_s + copy_s, samples_per_s=self.samples_per_s,
                       note=f"{note}: instantiated pipelines of {self._sizes()}")

    # -- the plan Oobleck runs ---------------------------------------------------------

    def execution_plan(self) -> ExecutionPlan:
        """The current pipelines as a plan on their real workers, DP sync filled in."""
        return with_sync(self._plan_on(self.pipelines, self.micro_batches), self.context.profile)

    def _plan_on(self, pipelines: Sequence[OobleckPipeline], shares: Sequence[int]) -> ExecutionPlan:
        ids = assign_micro_batch_ids(shares)
        plans = tuple(
            PipelinePlan(
                tuple(StagePlan(w, r) for w, r in zip(p.stage_workers, stage_ranges(self.templates[p.num_stages]))),
                ids[i],
            )
            for i, p in enumerate(pipelines)
        )
        return ExecutionPlan(0, "reparallelize", self.context.num_layers, self.context.tensor_parallel_size, plans)

    def _adopt(self, cluster: ClusterState, pipelines: tuple[OobleckPipeline, ...]) -> None:
        """Run ``pipelines`` with the batch redistributed (5.2); throughput by the shared estimator."""
        self.pipelines = pipelines
        self.micro_batches = self._distribute(tuple(p.num_stages for p in pipelines))
        estimate = estimate_plan(self.execution_plan(), self.context.profile, cluster, pricing=self.context.pricing)
        self.step_s = estimate.step_time_s
        self.samples_per_s = estimate.samples_per_s

    def _sizes(self) -> tuple[int, ...]:
        return tuple(len(p.workers) for p in self.pipelines)

    # -- templates, instantiation and batch distribution (4.1, 4.2) --------------------

    def _smallest_pipeline(self) -> int:
        search = split_search(self.context)
        for size in range(1, self.context.num_layers + 1):
            if search.best(size, PLANNING_MICRO_BATCHES_PER_STAGE * size) is not None:
                return size
        raise ValueError("the model fits in memory with no number of pipeline stages")

    def _template_for(self, size: int) -> int:
        return max(t for t in self.templates if t <= size)

    def _add_template(self, size: int, *, split: tuple[int, ...], planning_s: float) -> None:
        """Keep the split and what the planner's bounds need: time per micro-batch at the
        planning batch, per stage its (compute before it, compute per micro-batch), and
        the blocks of the stage with the most gradient bytes."""
        profile = self.context.profile
        self.templates[size] = split
        self._micro_batch_s[size] = planning_s / (PLANNING_MICRO_BATCHES_PER_STAGE * size)
        stages = [dict(start=start, end=end, first=s == 0, last=s == size - 1)
                  for s, (start, end) in enumerate(stage_ranges(split))]
        passes = [profile.stage_compute(**stage) for stage in stages]
        self._stage_work[size] = tuple(
            (sum(f + b for f, b in passes[:s]), forward + backward) for s, (forward, backward) in enumerate(passes)
        )
        self._heaviest_stage[size] = tuple(max(
            (profile.stage_blocks(**stage) for stage in stages),
            key=lambda blocks: sum(profile.block(b).grad_bytes for b in blocks),
        ))

    def _instantiate(self, cluster: ClusterState) -> None:
        self._adopt(cluster, self._instantiation(cluster))

    def _instantiation(self, cluster: ClusterState) -> tuple[OobleckPipeline, ...]:
        """The fastest template mix on all alive workers, consecutive workers per pipeline,
        smallest template first; workers no mix can use idle in the last pipeline."""
        workers = sorted(cluster.alive_workers)
        sizes = self._best_mix(len(workers))
        bounds = [sum(sizes[:i]) for i in range(len(sizes))] + [len(workers)]
        return tuple(
            OobleckPipeline(tuple(workers[bounds[i]:bounds[i + 1]]), size) for i, size in enumerate(sizes)
        )

    def _best_mix(self, num_workers: int) -> tuple[int, ...]:
        """Eq. 5's feasible sets, ranked by planned step time; memoised per worker count.

        Oobleck lists every set (its authors ran at most 30 nodes); past
        ``MAX_ENUMERATED_MIXES`` sets (hundreds of workers) we keep the sets of at most two
        template sizes, which hold every balanced layout. Branch and bound: sets are
        visited by a lower bound of their step time, exact times only while one can win.
        """
        if num_workers not in self._best_sizes:
            mixes: list[tuple[int, ...]] = []
            for total in range(num_workers, self.min_workers - 1, -1):
                mixes = list(itertools.islice(self._mixes(total), MAX_ENUMERATED_MIXES + 1))
                if len(mixes) > MAX_ENUMERATED_MIXES:
                    mixes = list(self._two_size_mixes(total))
                if mixes:
                    break  # the paper's templates always cover all workers; capped ones may not
            best, best_s = None, float("inf")
            for bound, sizes in sorted((self._step_lower_bound(m), m) for m in mixes):
                if bound >= best_s:
                    break
                step_s = self.planned_step_time(sizes)
                if step_s < best_s:
                    best, best_s = sizes, step_s
            self._best_sizes[num_workers] = best
        return self._best_sizes[num_workers]

    def _mixes(self, total: int) -> Iterator[tuple[int, ...]]:
        """Non-decreasing template sizes summing to ``total``, f+1 to M of them (4.2.1), in
        lexicographic order. Depth first on an explicit stack: a mix of thousands of
        workers holds thousands of pipelines, past Python's recursion limit."""
        sizes = sorted(self.templates)
        most = self.context.num_micro_batches
        least = self.tolerated_failures + 1
        prefix: list[int] = []
        chosen: list[int] = []  # the index in ``sizes`` of each size in ``prefix``
        remaining, first = total, 0  # what the mix still lacks; the smallest size index it may add
        while True:
            if remaining == 0:
                if len(prefix) >= least:
                    yield tuple(prefix)
            elif len(prefix) < most and first < len(sizes) and sizes[first] <= remaining:
                prefix.append(sizes[first])
                chosen.append(first)
                remaining -= sizes[first]
                continue
            if not chosen:  # every extension of every prefix was tried
                return
            remaining += prefix.pop()
            first = chosen.pop() + 1

    def _two_size_mixes(self, total: int) -> Iterator[tuple[int, ...]]:
        """The sets of ``_mixes`` that use one or two template sizes."""
        sizes = sorted(self.templates)
        allowed = range(self.tolerated_failures + 1, self.context.num_micro_batches + 1)
        for i, small in enumerate(sizes):
            for count in range(1, total // small + 1):
                rest = total - count * small
                if rest == 0 and count in allowed:
                    yield (small,) * count
                for large in sizes[i + 1:]:
                    if rest > 0 and rest % large == 0 and count + rest // large in allowed:
                        yield (small,) * count + (large,) * (rest // large)

    def _distribute(self, stage_counts: tuple[int, ...]) -> tuple[int, ...]:
        """Eq. 6 by greedy balance: each next micro-batch goes to the pipeline that would
        finish first (lowest index on ties), every pipeline starting with one.

        Pipelines of one template move in step, so the greedy runs a template at a time."""
        if stage_counts not in self._distributions:
            shares = [1] * len(stage_counts)
            members: dict[int, list[int]] = defaultdict(list)
            for i, n in enumerate(stage_counts):
                members[n].append(i)
            heap = [(2 * self._micro_batch_s[n], n) for n in members]
            heapq.heapify(heap)
            remaining = self.context.num_micro_batches - len(shares)
            while remaining:
                cost = heap[0][0]
                tied = []
                while heap and heap[0][0] == cost:
                    tied.append(heapq.heappop(heap)[1])
                takers = sorted(i for n in tied for i in members[n])[:remaining]
                for i in takers:
                    shares[i] += 1
                remaining -= len(takers)
                for n in tied:
                    heapq.heappush(heap, ((shares[members[n][0]] + 1) * self._micro_batch_s[n], n))
            self._distributions[stage_counts] = tuple(shares)
        return self._distributions[stage_counts]

    def _pipeline_s(self, stage_counts: tuple[int, ...]) -> float:
        search = split_search(self.context)
        loads = set(zip(stage_counts, self._distribute(stage_counts)))
        return max(search.pipeline_cost(self.templates[n], m)[0] for n, m in loads)

    def _step_lower_bound(self, stage_counts: tuple[int, ...]) -> float:
        """A cheap bound under ``planned_step_time``. Pipeline: some stage s runs all m
        forwards and backwards, after micro-batch 0's passes through the stages before it.
        Sync: the heaviest stage's worker all-reduces all its blocks over at least every
        pipeline, one round per unit, and a ring all-reduce costs its bytes plus latency
        per unit, so its rounds take at least one all-reduce of those blocks together."""
        loads = set(zip(stage_counts, self._distribute(stage_counts)))
        pipeline_s = max(before + m * work for n, m in loads for before, work in self._stage_work[n])
        peers = tuple(range(len(stage_counts)))
        sync_s = max(unit_sync_time(SyncUnit(self._heaviest_stage[n], peers), self.context.profile, None)
                     for n in set(stage_counts))
        return pipeline_s + sync_s

    def planned_step_time(self, stage_counts: tuple[int, ...]) -> float:
        """Oobleck's planner estimate, placement-blind: the slowest lone pipeline, the
        layer-granular DP sync and the optimizer step (equals ``estimate_plan`` without a
        cluster)."""
        if stage_counts not in self._planned_step_s:
            start = [sum(stage_counts[:i]) for i in range(len(stage_counts))]
            canonical = [OobleckPipeline(tuple(range(s, s + n)), n) for s, n in zip(start, stage_counts)]
            plan = with_sync(self._plan_on(canonical, self._distribute(stage_counts)), self.context.profile)
            profile = self.context.profile
            self._planned_step_s[stage_counts] = (self._pipeline_s(stage_counts) + sync_time(plan, profile)
                                                  + optimizer_time(plan, profile, None, staggered=False))
        return self._planned_step_s[stage_counts]

    # -- copying missing layers (5) --------------------------------------------------

    def _holdings(self, pipelines: Sequence[OobleckPipeline]) -> dict[int, list[Block]]:
        """Blocks per stage worker, in pipeline then stage order."""
        profile = self.context.profile
        held: dict[int, list[Block]] = {}
        for p in pipelines:
            ranges = stage_ranges(self.templates[p.num_stages])
            for s, (worker, (start, end)) in enumerate(zip(p.stage_workers, ranges)):
                held[worker] = profile.stage_blocks(start, end, first=s == 0, last=s == p.num_stages - 1)
        return held

    def _copy_time(self, cluster: ClusterState, *, before: Sequence[OobleckPipeline],
                   after: Sequence[OobleckPipeline]) -> float | None:
        """Seconds to broadcast every missing block from its first live former holder;
        None when some block has no live holder left."""
        profile = self.context.profile
        dead = cluster.failed_workers
        held = {w: set(blocks) for w, blocks in self._holdings(before).items() if w not in dead}
        needed: dict[Block, list[int]] = defaultdict(list)
        for worker, blocks in self._holdings(after).items():
            for b in blocks:
                if b not in held.get(worker, ()):
                    needed[b].append(worker)
        send: dict[int, float] = defaultdict(float)
        receive: dict[int, float] = defaultdict(float)
        for b in sorted(needed, key=block_sort_key):
            source = next((w for w, blocks in held.items() if b in blocks), None)
            if source is None:
                return None
            size = profile.block(b).state_bytes
            receivers = needed[b]
            local = all(cluster.same_node(source, r) for r in receivers)
            send[source] += size / profile.bandwidth(local) + profile.link_latency_s
            for r in receivers:
                receive[r] += size / profile.bandwidth(cluster.same_node(source, r)) + profile.link_latency_s
        return max([*send.values(), *receive.values()], default=0.0)

    # -- giving up (3.4) ---------------------------------------------------------------

    def _restart(self, cluster: ClusterState, now_s: float, note: str, *, after_failure: bool = True) -> Outcome:
        """Roll back to the last checkpoint: into Oobleck pipelines if (f+1)*n0 workers are
        alive, else onto the shared symmetric fallback (and stop running pipelines)."""
        outcome = restart_from_checkpoint(self.context, cluster, now_s, note, after_failure=after_failure)
        if len(cluster.alive_workers) < self.min_workers:
            self.pipelines, self.micro_batches, self.samples_per_s = (), (), outcome.samples_per_s
            return outcome
        self._instantiate(cluster)
        return dataclasses.replace(outcome, samples_per_s=self.samples_per_s,
                                   note=f"{outcome.note}; restarted into pipelines of {self._sizes()}")


def reinstantiate(groups: Sequence[Sequence[int]], *, failed: AbstractSet[int],
                  min_workers: int) -> tuple[list[list[int]], tuple[str, ...]]:
    """Section 5.1 on the workers of each pipeline (in pipeline order): returns the new
    pipelines' workers, sorted within and ordered by (size, first worker), and which of
    simple / borrow / merge happened. Mirrors the authors' ``ReconfigurationEngine``:
    a lender is the last largest pipeline with more than ``min_workers``; it gives its
    highest workers; merging joins under-sized pipelines in order, then takes the first
    full one if still short."""
    survivors = [[w for w in g if w not in failed] for g in groups]
    steps: list[str] = []
    kept: list[list[int]] = []
    short = False
    for original, group in zip(groups, survivors):
        if not group:
            continue
        if len(group) >= min_workers:
            if len(group) < len(original):
                steps.append("simple")
        while len(group) < min_workers:
            lender = max(reversed(survivors), key=len)
            if len(lender) <= min_workers:
                short = True
                break
            while len(lender) > min_workers and len(group) < min_workers:
                group.append(lender.pop())
            steps.append("borrow")
        kept.append(group)
    if short:
        kept = _merge(kept, min_workers=min_workers)
        steps.append("merge")
    for group in kept:
        group.sort()
    kept.sort(key=lambda g: (len(g), g[0]))
    return kept, tuple(dict.fromkeys(steps))


def _merge(groups: list[list[int]], *, min_workers: int) -> list[list[int]]:
    short = [g for g in groups if len(g) < min_workers]
    merged = [g for g in groups if len(g) >= min_workers]
    while short:
        group = short.pop(0)
        while len(group) < min_workers:
            group.extend(short.pop(0) if short else merged.pop(0))
        merged.append(group)
    return merged
