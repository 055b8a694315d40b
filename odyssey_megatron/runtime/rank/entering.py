"""Entering a plan generation, for a rank whose role in it is to send blocks or to train.

The rank counts in and waits for every participant, joins a process group among them (a
shrink of the last generation's where every participant kept it and the backend can,
``survivor_groups.next_world``; else a fresh one on the generation's store prefix), takes
the state it starts from, checks that
every block it holds has taken exactly the committed steps, and moves the blocks the
plan's transfers name, checking that those it receives have too. Until the first step of the run (or of a resumed run) commits, no
trained state exists: a worker entering a generation then (``PlanPublished.fresh``) draws
its stage from the seed or the checkpoint, and no block moves. Where a failure left some
block with no live copy, the generation is a rollback (``PlanPublished.restore``): the
worker holds nothing (``Generation.begin``), reads or rebuilds the snapshot's shards it is
named for (``runtime.rank.snapshots``), and the plan's transfers move them, so the run goes
on from the snapshot's step. A joiner, admitted, receives its stage's blocks the same way.
"""

from __future__ import annotations

from pathlib import Path

import torch.distributed as dist

from odyssey_megatron.blocks import StageSpec, worker_blocks
from odyssey_megatron.hooks.process_groups import RankMap
from odyssey_megatron.hooks.survivor_groups import next_world, runtime_nccl_version, torch_offers
from odyssey_megatron.hooks.training_state import TrainingState
from odyssey_megatron.phases import Phase
from odyssey_megatron.runtime.checkpoint import load_checkpoint
from odyssey_megatron.runtime.protocol.keys import (
    ALL_ARRIVED,
    abort_key,
    all_arrived_key,
    arrived_key,
    kept_world_key,
    process_group_prefix,
)
from odyssey_megatron.runtime.protocol.liveness import missed_beat
from odyssey_megatron.runtime.rank.block_transfer import execute_transfers
from odyssey_megatron.runtime.rank.generation import Generation, GenerationEnded
from odyssey_megatron.runtime.rank.plan_runner import initial_state
from odyssey_megatron.runtime.rank.role import Role
from odyssey_megatron.runtime.rank.snapshots import restore_snapshot

__all__ = ["enter"]


def enter(generation: Generation, role: Role) -> None:
    """Join ``generation``'s process group, take the state to start from, and move the
    blocks the plan's transfers name; keep those this rank's stage trains."""
    process, plan, published = generation.process, generation.plan, generation.published
    generation.ranks = ranks = RankMap.of(published.participants(), process.tp)
    generation.rank = rank = ranks.rank(process.worker_id, process.tp_rank)
    if plan.generation > 0:
        process.injector.fire(Phase.recovery, generation.step)
    _wait_all_arrived(generation, ranks.world_size)
    _join_world(generation)
    process.guard.track([dist.distributed_c10d._get_default_group()])
    if published.restore is not None:
        generation.phase = Phase.restore
        process.state = restore_snapshot(
            published.restore, rank=process.launch.rank,
            node_first_rank=process.launch.rank - process.launch.local_rank, slots=process.launch.keeper,
            model=process.config.model, cluster=process.cluster, rank_in_generation=ranks.of_launch_rank,
            timeout=process.collective_timeout, track=process.guard.track, device=process.device)
    elif process.state is None:
        process.state = _first_state(generation) if role is Role.train else TrainingState()
    _check_steps(generation, published.start_step)
    generation.phase = Phase.transfer
    needed = worker_blocks(plan, process.worker_id, tied=process.config.model.tie_embeddings)
    held = dict(process.state.blocks)
    if plan.transfers and not published.fresh:
        process.injector.fire(Phase.transfer, generation.step)
        execute_transfers(plan=plan, state=process.state, rank=rank, ranks=ranks, model=process.config.model,
                          device=process.device, committed=published.start_step,
                          on_moved=lambda: process.injector.fire(Phase.mid_transfer, generation.step))
    process.state.keep(needed)
    generation.set_aside(needed, held=held)


def _join_world(generation: Generation) -> None:
    """Make the generation's default group: from the world kept from the last generation
    where every rank kept it (counted in before arriving), else by a fresh rendezvous."""
    process, number, ranks = generation.process, generation.plan.generation, generation.ranks
    kept, process.kept_world = process.kept_world, None
    group = None
    if kept is not None:
        group = next_world(kept, ranks=ranks, backend=process.accelerator.backend,
                           held_everywhere=process.store.add(kept_world_key(number), 0) == ranks.world_size,
                           nccl_version=runtime_nccl_version(), offered=torch_offers())
    if group is None:
        dist.init_process_group(process.accelerator.backend, rank=generation.rank, world_size=ranks.world_size,
                                store=dist.PrefixStore(process_group_prefix(number), process.rendezvous),
                                timeout=process.collective_timeout,
                                **process.accelerator.group_options(process.device))
    elif group.rank() != generation.rank:
        raise RuntimeError(f"the shrunk world made this rank {group.rank()}; generation {number} names it "
                           f"{generation.rank}")


def _wait_all_arrived(generation: Generation, world_size: int) -> None:
    """Count this rank in (and whether it kept the last world) and wait for the
    generation's every rank, or its abort."""
    process, number = generation.process, generation.plan.generation
    if process.store.check([abort_key(number)]):  # a rank that comes late counts in nowhere
        raise GenerationEnded("the controller ended the generation before this rank arrived")
    if process.kept_world is not None:
        process.store.add(kept_world_key(number), 1)
    everyone = all_arrived_key(number)
    if process.store.add(arrived_key(number), 1) == world_size:
        process.store.compare_set(everyone, "", ALL_ARRIVED)
    try:
        process.group_store.wait([everyone])  # it waits up to the collective timeout
    except dist.DistError as exc:  # missed_beat alone tells a late answer from a lost store
        if not missed_beat(exc):
            raise
        process.group_store = process.store_for_steps()  # its late answer must not be read as the next one's
        raise GenerationEnded(f"not every rank arrived within the collective timeout "
                              f"({process.timeouts.collective_timeout} s)") from None
    if process.group_store.get(everyone) != ALL_ARRIVED:
        raise GenerationEnded("the controller ended the generation before every rank arrived")


def _first_state(generation: Generation) -> TrainingState:
    """The blocks a run starts from: the resumed checkpoint's, else drawn from the seed."""
    process = generation.process
    if process.spec.resume is not None:
        return load_checkpoint(Path(process.spec.resume), run_dir=process.run_dir, model=process.config.model,
                               stage=StageSpec.of_worker(generation.plan, process.worker_id), tp_rank=process.tp_rank,
                               tp_size=process.tp, device=process.device)
    return initial_state(plan=generation.plan, rank=generation.rank, ranks=generation.ranks,
                         model=process.config.model, seed=process.config.training.seed, device=process.device)


def _check_steps(generation: Generation, committed: int) -> None:
    """Every block held has taken exactly ``committed`` steps: a rank applies only
    committed steps, so anything else means it could not learn a step's fate (its wait
    for the decision failed) and cannot join."""
    steps = {block.step for block in generation.process.state.blocks.values()}
    if steps - {committed}:
        raise RuntimeError(f"blocks at steps {sorted(steps)}; generation {generation.plan.generation} starts after "
                           f"{committed} committed steps")
