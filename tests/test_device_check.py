"""The CPU device check: the paths that move or restore a rank's blocks, run with the blocks
on a stand-in device and the default group standing in for NCCL
(``testing.stand_in_device``: it refuses any tensor not on the bound device, as NCCL
refuses a host tensor), in two-rank worlds. Each path must leave every block on the rank's
device and hand the default group nothing else: a block transfer (the Adam step counter
went as a host tensor), a snapshot taken and restored (the restored blocks were host
tensors) and the rollback's transfers after it, a checkpoint loaded (read into host
memory and held there), and the binding itself (no rank bound its device, so every rank of
a node used device 0, and no NCCL group was told its ``device_id``)."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
import torch.distributed as dist
from helpers import asymmetric_plan
from runtime_cases import SEED, tiny_model

from odyssey_megatron.blocks import StageSpec, stage_blocks
from odyssey_megatron.cluster import ClusterState
from odyssey_megatron.estimator.program import step_program
from odyssey_megatron.hooks.accelerator import Accelerator, required_device
from odyssey_megatron.hooks.process_groups import RankMap
from odyssey_megatron.hooks.training_state import TrainingState
from odyssey_megatron.plan import ExecutionPlan
from odyssey_megatron.profile import uniform_profile
from odyssey_megatron.restorer import live_holdings, plan_transfers
from odyssey_megatron.runtime.checkpoint import load_checkpoint, save_part
from odyssey_megatron.runtime.checkpoint_index import checkpoint_directory
from odyssey_megatron.runtime.protocol.plan_frame import PlanPublished
from odyssey_megatron.runtime.rank.block_transfer import execute_transfers
from odyssey_megatron.runtime.rank.plan_runner import initial_state
from odyssey_megatron.runtime.rank.snapshots import SnapshotTaker, restore_snapshot
from odyssey_megatron.settings import PLAIN
from odyssey_megatron.snapshot.keeper import NodeKeeper
from odyssey_megatron.snapshot.restore import SnapshotRecord, plan_restore
from odyssey_megatron.testing.local_world import run_world
from odyssey_megatron.testing.stand_in_device import STAND_IN, install

NUM_LAYERS = 4
STEP = 3
"""The committed steps every block has taken when it moves."""
WORLD_TIMEOUT = 120


def _plans() -> tuple[ExecutionPlan, ExecutionPlan]:
    """Two stages on workers 0 and 1, then the same stages swapped, with the transfers that
    move every block to the other worker."""
    old = asymmetric_plan([(2, 2)], [2], worker_of=lambda d, s: s)
    swapped = replace(asymmetric_plan([(2, 2)], [2], worker_of=lambda d, s: 1 - s), generation=1)
    profile, cluster = uniform_profile(num_layers=NUM_LAYERS), ClusterState(world_size=2)
    holdings = live_holdings(old, cluster=cluster, profile=profile)
    return old, replace(swapped, transfers=plan_transfers(swapped, holdings=holdings, profile=profile,
                                                          cluster=cluster))


def _join_stand_in_world(rank: int, world_size: int, name: str) -> torch.device:
    """Leave the gloo world ``run_world`` made; bind the stand-in device and join a default
    group on it, as a worker binds its device and joins a generation."""
    install()
    store = dist.distributed_c10d._get_default_store()
    dist.destroy_process_group()
    device = STAND_IN.bind(0)
    dist.init_process_group(STAND_IN.backend, rank=rank, world_size=world_size,
                            store=dist.PrefixStore(f"device-check-{name}", store), **STAND_IN.group_options(device))
    return device


def _placement(state: TrainingState, device: torch.device) -> dict[str, str]:
    """Each held tensor not on ``device``, with where it is."""
    return {f"{block}/{key}": str(tensor.device) for block in state.held()
            for key, tensor in state.export(block).items() if tensor.device != device}


def _result(state: TrainingState, device: torch.device) -> dict:
    return {"held": [str(b) for b in state.held()], "off_device": _placement(state, device),
            "steps": sorted({b.step for b in state.blocks.values()}),
            "checked": dist.distributed_c10d._get_default_group().checked}


def _at_step(state: TrainingState) -> TrainingState:
    for block in state.blocks.values():
        block.step = STEP
    return state


def _transfer(rank: int, world_size: int, old_json: str, new_json: str) -> dict:
    device = _join_stand_in_world(rank, world_size, "transfer")
    old, new = ExecutionPlan.from_json(old_json), ExecutionPlan.from_json(new_json)
    ranks, model = RankMap.identity(world_size, 1), tiny_model(NUM_LAYERS)
    state = _at_step(initial_state(plan=old, rank=rank, ranks=ranks, model=model, seed=SEED, device=device))
    execute_transfers(plan=new, state=state, rank=rank, ranks=ranks, model=model, device=device, committed=STEP)
    return _result(state, device)


def _rollback(rank: int, world_size: int, old_json: str, new_json: str, slots_json: str) -> dict:
    """Take a snapshot of the old stage, restore it as a rollback generation does, then run
    the new plan's transfers from where the shards were read."""
    device = _join_stand_in_world(rank, world_size, "rollback")
    store = dist.distributed_c10d._get_default_store()
    old, swapped = ExecutionPlan.from_json(old_json), ExecutionPlan.from_json(new_json)
    ranks, model = RankMap.identity(world_size, 1), tiny_model(NUM_LAYERS)
    cluster = ClusterState(world_size=world_size, devices_per_node=1)
    slots = json.loads(slots_json)
    program = step_program(old, uniform_profile(num_layers=NUM_LAYERS), cluster, pricing=PLAIN)
    taker = SnapshotTaker(slot=slots[rank], rank=rank, cluster=cluster, model=model,
                          published=PlanPublished(plan=old, program=program, published_at=0.0, snapshot_interval=1),
                          protection=None, store=store, ended=lambda: False, poll_s=0.01)
    trained = _at_step(initial_state(plan=old, rank=rank, ranks=ranks, model=model, seed=SEED, device=device))
    # Written from a host copy: the stand-in device cannot copy into a host tensor in place (a CUDA tensor can).
    taker.take(STEP, trained.copy(torch.device("cpu")))
    taker.wait_done()
    taker.abandon()
    dist.barrier()
    restore, transfers = plan_restore(SnapshotRecord(step=STEP, generation=0, plan=old, groups=()),
                                      plan=swapped, cluster=cluster, lost_keepers=set(), model=model)
    new = replace(swapped, transfers=transfers)
    state = restore_snapshot(restore, rank=rank, node_first_rank=rank, slots=[slots[rank]], model=model,
                             cluster=cluster, rank_in_generation=ranks.of_launch_rank,
                             timeout=dist.default_pg_timeout, track=lambda groups: None, device=device)
    restored = _result(state, device)
    execute_transfers(plan=new, state=state, rank=rank, ranks=ranks, model=model, device=device, committed=STEP)
    return {"restored": restored, "rolled_back": _result(state, device)}


def _checkpoint(rank: int, world_size: int, old_json: str, new_json: str, run_dir: str) -> dict:
    """Each rank saves its old stage as its part; each loads its new stage (the other's)."""
    from pathlib import Path

    device = _join_stand_in_world(rank, world_size, "checkpoint")
    old, new = ExecutionPlan.from_json(old_json), ExecutionPlan.from_json(new_json)
    ranks, model = RankMap.identity(world_size, 1), tiny_model(NUM_LAYERS)
    state = _at_step(initial_state(plan=old, rank=rank, ranks=ranks, model=model, seed=SEED, device=device))
    stage = StageSpec.of_worker(old, rank)
    save_part(Path(run_dir), state, stage_blocks(stage, tied=model.tie_embeddings), step=STEP, rank=rank, tp_rank=0,
              tp_size=1, model=model)
    dist.barrier()
    loaded = load_checkpoint(checkpoint_directory(Path(run_dir), STEP), run_dir=Path(run_dir), model=model,
                             stage=StageSpec.of_worker(new, rank), tp_rank=0, tp_size=1, device=device)
    # The loaded blocks enter the default group as a transfer would send them.
    for block in loaded.held():
        dist.all_reduce(loaded.export(block)["step"])
    return _result(loaded, device)


def _unbound(rank: int, world_size: int) -> str:
    """A collective on the stand-in group before any device was bound."""
    install()
    store = dist.distributed_c10d._get_default_store()
    dist.destroy_process_group()
    dist.init_process_group(STAND_IN.backend, rank=rank, world_size=world_size,
                            store=dist.PrefixStore("device-check-unbound", store))
    try:
        dist.all_reduce(torch.zeros(2, device="lazy"))
    except RuntimeError as error:
        return str(error)
    finally:
        STAND_IN.bind(0)  # for run_world's closing barrier
    return "no error"


@pytest.fixture(scope="module")
def plans() -> tuple[str, str]:
    old, new = _plans()
    return old.to_json(), new.to_json()


def _assert_every_block_on_the_device(result: dict, blocks: list[str]) -> None:
    assert result["held"] == blocks
    assert result["off_device"] == {}, f"tensors off the rank's device: {result['off_device']}"
    assert result["steps"] == [STEP]
    assert result["checked"] > 0, "the default group checked no tensor: the path moved nothing through it"


NEW_STAGES = (["2", "3", "output"], ["embedding", "0", "1"])
"""What ranks 0 and 1 hold after the swap."""


@pytest.mark.timeout(WORLD_TIMEOUT + 30)
def test_a_block_transfer_hands_the_group_only_device_tensors_step_counter_included(plans):
    for rank, result in enumerate(run_world(_transfer, 2, *plans, timeout=WORLD_TIMEOUT)):
        _assert_every_block_on_the_device(result, NEW_STAGES[rank])


@pytest.mark.timeout(WORLD_TIMEOUT + 30)
def test_a_restored_snapshot_is_on_the_device_and_its_rollback_transfers_move_device_tensors(plans):
    keeper = NodeKeeper(2)
    try:
        slots = json.dumps([[*paths.data, *paths.parity] for paths in keeper.paths])
        results = run_world(_rollback, 2, *plans, slots, timeout=WORLD_TIMEOUT)
    finally:
        keeper.close()
    for rank, result in enumerate(results):
        old_stage = NEW_STAGES[1 - rank]
        assert result["restored"]["held"] == old_stage  # each rank read its own node's keeper
        assert result["restored"]["off_device"] == {}, f"restored off the device: {result['restored']['off_device']}"
        _assert_every_block_on_the_device(result["rolled_back"], NEW_STAGES[rank])


@pytest.mark.timeout(WORLD_TIMEOUT + 30)
def test_a_checkpoint_loads_onto_the_device(plans, tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir(mode=0o700)
    for rank, result in enumerate(run_world(_checkpoint, 2, *plans, str(run_dir), timeout=WORLD_TIMEOUT)):
        _assert_every_block_on_the_device(result, NEW_STAGES[rank])


@pytest.mark.timeout(WORLD_TIMEOUT + 30)
def test_the_stand_in_group_refuses_a_collective_before_the_rank_bound_its_device():
    for error in run_world(_unbound, 2, timeout=WORLD_TIMEOUT):
        assert "no lazy device is bound in this process: nothing called set_device" in error


def test_a_worker_binds_its_device_and_nccl_and_hccl_groups_get_it_as_device_id():
    install()
    assert STAND_IN.bind(3) == torch.device("lazy", 0)  # one stand-in device: every local rank wraps to it
    assert torch.get_device_module("lazy").current_device() == 0
    gpu = torch.device("cuda", 3)
    npu = torch.device("privateuseone", 1)  # what torch_npu's "npu" is, which this build cannot name
    assert Accelerator("cuda", "nccl", 8).group_options(gpu) == {"device_id": gpu}
    assert Accelerator("npu", "hccl", 8).group_options(npu) == {"device_id": npu}
    assert Accelerator("cpu", "gloo", 1).group_options(torch.device("cpu")) == {}
    assert Accelerator("cpu", "gloo", 1).bind(5) == torch.device("cpu")


def _required(rank: int, world_size: int) -> list[str]:
    _join_stand_in_world(rank, world_size, "required")
    gloo = dist.new_group([0, 1], backend="gloo")
    return [str(required_device()), str(required_device(gloo))]


@pytest.mark.timeout(WORLD_TIMEOUT + 30)
def test_the_device_a_group_requires_follows_its_backend():
    assert run_world(_required, 2, timeout=WORLD_TIMEOUT) == [["lazy:0", "cpu"]] * 2
