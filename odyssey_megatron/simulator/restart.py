"""Checkpoint restarts, which every simulated system falls back to.

Every system checkpoints every ``checkpoint_interval_s`` of wall time (the save cost is
charged to all systems alike by the engine). A restart loses the progress since the last
checkpoint, pays ``restart_s + checkpoint_load_s`` (after a failure also the detection
every system pays), and resumes on the best *symmetric* DP x PP layout the survivors
allow (pipeline length chosen by the estimator, steps priced with the job's schedule
options; workers that do not fit the layout idle). By default only layouts stock
Megatron runs: DP divides the global batch's micro-batches (Megatron refuses a global
batch that does not split evenly over DP); the layer split is the estimator's best,
which Megatron-Core expresses with ``pipeline_model_parallel_layout``.
``restart_layouts: varuna`` allows any DP, the micro-batches split unevenly.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from odyssey_megatron.cluster import ClusterState
from odyssey_megatron.estimator import estimate_plan
from odyssey_megatron.estimator.memory import layout_profile
from odyssey_megatron.plan import ExecutionPlan, PipelinePlan, StagePlan
from odyssey_megatron.planner.batch import assign_micro_batch_ids, distribute_batch
from odyssey_megatron.planner.layers import SplitSearch, stage_ranges
from odyssey_megatron.restorer import with_sync
from odyssey_megatron.simulator.system import MEGATRON_LAYOUTS, RESTARTING, Outcome, SimulationContext


@dataclass(frozen=True)
class SymmetricLayout:
    data_parallel_size: int
    pipeline_parallel_size: int
    samples_per_s: float


def symmetric_plan_on(workers: list[int], *, dp: int, split: tuple[int, ...], num_micro_batches: int,
                      tensor_parallel_size: int) -> ExecutionPlan:
    """DP x PP plan on the first dp * pp ``workers`` (Megatron's order: stage-major)."""
    pp = len(split)
    ids = assign_micro_batch_ids(distribute_batch(num_micro_batches, [pp] * dp))
    pipelines = tuple(
        PipelinePlan(tuple(StagePlan(workers[s * dp + d], r) for s, r in enumerate(stage_ranges(split))), ids[d])
        for d in range(dp)
    )
    return ExecutionPlan(0, "initial", sum(split), tensor_parallel_size, pipelines)


def best_symmetric_layout(context: SimulationContext, num_workers: int) -> SymmetricLayout | None:
    """The fastest DP x PP <= ``num_workers`` (None if no pipeline fits in memory)."""
    return _best_symmetric_layout(context, num_workers)


@lru_cache(maxsize=None)
def split_search(context: SimulationContext, dp: int | None = None, pp: int | None = None) -> SplitSearch:
    """One memoised split search per simulated job and DP x PP layout (default: the job's
    own), whose memory is that layout's (``layout_profile``: under the distributed
    optimizer each rank keeps its share at DP holders). Oobleck's templates, reused at every
    DP degree, are checked at the job's."""
    dp = context.data_parallel_size if dp is None else dp
    pp = context.pipeline_parallel_size if pp is None else pp
    return SplitSearch(layout_profile(context.profile, [pp] * dp, pricing=context.pricing), limit=256)


def restart_data_parallel_size(context: SimulationContext, fitting: int) -> int:
    """The largest DP of at most ``fitting`` pipelines a restart may run: one that divides
    the micro-batches under MEGATRON_LAYOUTS, any (up to one micro-batch each) otherwise."""
    dp = min(fitting, context.num_micro_batches)
    if context.restart_layouts == MEGATRON_LAYOUTS:
        while dp > 1 and context.num_micro_batches % dp:
            dp -= 1
    return dp


@lru_cache(maxsize=4096)
def _best_symmetric_layout(context: SimulationContext, num_workers: int) -> SymmetricLayout | None:
    best = None
    for pp in range(1, min(num_workers, context.num_layers) + 1):
        dp = restart_data_parallel_size(context, num_workers // pp)
        if dp == 0:
            continue
        rate = _symmetric_rate(context, dp, pp)
        if rate is not None and (best is None or rate > best.samples_per_s):
            best = SymmetricLayout(dp, pp, rate)
    return best


@lru_cache(maxsize=None)
def _symmetric_rate(context: SimulationContext, dp: int, pp: int) -> float | None:
    """Samples/s of the DP x PP layout on workers 0..dp*pp-1 (None if no split fits in
    memory). Memoised by (dp, pp): a restart packs its ranks afresh, so the layout runs on
    the same workers however many survive, and the estimator reads nothing of the cluster
    beyond those workers' nodes; after a failure only the pipeline lengths whose DP degree
    changed are priced again."""
    busiest = -(-context.num_micro_batches // dp)
    found = split_search(context, dp, pp).best(pp, busiest)
    if found is None:
        return None
    packed = ClusterState(world_size=dp * pp * context.tensor_parallel_size,
                          tensor_parallel_size=context.tensor_parallel_size, devices_per_node=context.devices_per_node)
    plan = with_sync(
        symmetric_plan_on(list(range(dp * pp)), dp=dp, split=found[0], num_micro_batches=context.num_micro_batches,
                          tensor_parallel_size=context.tensor_parallel_size),
        context.profile,
    )
    step_s = estimate_plan(plan, context.profile, packed, pricing=context.pricing).step_time_s
    return context.num_micro_batches * context.profile.samples_per_micro_batch / step_s


def restart_plan(context: SimulationContext, cluster: ClusterState) -> ExecutionPlan | None:
    """The plan a job restarted from a checkpoint runs: the best symmetric layout on the
    lowest-numbered survivors (None if the model no longer fits)."""
    workers = list(cluster.alive_workers)
    layout = best_symmetric_layout(context, len(workers))
    if layout is None:
        return None
    busiest = -(-context.num_micro_batches // layout.data_parallel_size)
    dp, pp = layout.data_parallel_size, layout.pipeline_parallel_size
    split = split_search(context, dp, pp).best(pp, busiest)[0]
    plan = symmetric_plan_on(workers, dp=layout.data_parallel_size, split=split,
                             num_micro_batches=context.num_micro_batches,
                             tensor_parallel_size=context.tensor_parallel_size)
    return with_sync(plan, context.profile)


def time_since_checkpoint(context: SimulationContext, now_s: float) -> float:
    return now_s % context.checkpoint_interval_s


def restart_from_checkpoint(context: SimulationContext, cluster: ClusterState, now_s: float, note: str, *,
                            after_failure: bool = True) -> Outcome:
    """Roll back to the last checkpoint and restart on the survivors' best symmetric layout;
    ``after_failure``: the restart answers a failure, so it first waits for its detection
    (a repair is known when it happens)."""
    layout = best_symmetric_layout(context, len(cluster.alive_workers))
    detection_s = context.detection_s if after_failure else 0.0
    return Outcome(
        pause_s=detection_s + context.restart_s + context.checkpoint_load_s,
        samples_per_s=0.0 if layout is None else layout.samples_per_s,
        lost_s=time_since_checkpoint(context, now_s),
        pause_state=RESTARTING,
        note=note if layout is not None else f"{note}; the model no longer fits the survivors",
    )


def restart_onto_symmetric(
    context: SimulationContext, cluster: ClusterState, now_s: float, note: str, *, after_failure: bool = True
) -> tuple[Outcome, ExecutionPlan | None, float]:
    """A checkpoint restart for a system that keeps a plan: the outcome, the symmetric plan
    it resumes on (None if the model no longer fits) and that plan's step time."""
    outcome = restart_from_checkpoint(context, cluster, now_s, note, after_failure=after_failure)
    plan = restart_plan(context, cluster)
    step_s = 0.0 if plan is None else estimate_plan(plan, context.profile, cluster, pricing=context.pricing).step_time_s
    return outcome, plan, step_s
