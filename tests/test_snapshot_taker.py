"""A rank's snapshots (``runtime.rank.snapshots.SnapshotTaker``) over a real gloo pair on
two emulated nodes, with real keeper memory: the optimizer step waits for the copy into
the keeper only, not for the parity encode, which runs on past it; the next snapshot waits
for the one before to be done, and the parity sealed is the XOR the math says."""

from __future__ import annotations

import datetime
import time
from pathlib import Path

import pytest
import torch

from odyssey_megatron.blocks import state_entries
from odyssey_megatron.cluster import ClusterState
from odyssey_megatron.config import load_config
from odyssey_megatron.testing.local_world import run_world

TINY = Path(__file__).resolve().parents[1] / "recipes" / "llama2_7b" / "tiny_cpu.yaml"
LATE_S = 2.0
"""Rank 1 starts its snapshot this late: rank 0's parity encode waits for it that long."""


def _taker_rank(rank: int, world: int, slots: list[list[str]]) -> dict:
    import torch.distributed as dist

    from odyssey_megatron.estimator.program import step_program
    from odyssey_megatron.hooks.training_state import TrainingState
    from odyssey_megatron.profile import uniform_profile
    from odyssey_megatron.runtime.protocol.plan_frame import PlanPublished
    from odyssey_megatron.runtime.rank.snapshots import SnapshotTaker, protection_group
    from odyssey_megatron.settings import Pricing
    from odyssey_megatron.snapshot.keeper import KeeperBuffer
    from odyssey_megatron.testing.plans import pipelines_plan

    model = load_config(TINY).model
    plan = pipelines_plan([(model.num_layers,)] * 2, [1, 1])
    published = PlanPublished(plan=plan, program=step_program(plan, uniform_profile(num_layers=model.num_layers),
                                                              pricing=Pricing(decouple=False, staggered=False)),
                              published_at=time.time(), snapshot_interval=1)
    cluster = ClusterState(world_size=world, devices_per_node=1)
    timeout = datetime.timedelta(seconds=60)
    protection = protection_group(plan, rank=rank, cluster=cluster, nodes_per_group=2, rank_in_generation=lambda r: r,
                                  timeout=timeout)
    store = dist.distributed_c10d._get_default_store()
    taker = SnapshotTaker(slot=slots[rank], rank=rank, cluster=cluster, model=model, published=published,
                          protection=protection, store=store, ended=lambda: False, poll_s=0.01)
    state = TrainingState()
    generator = torch.Generator().manual_seed(rank)
    for block in taker.owned:
        state.receive(block, {key: torch.randn(shape, generator=generator).to(getattr(torch, dtype))
                              if dtype.startswith("float") else torch.zeros(shape, dtype=getattr(torch, dtype))
                              for key, dtype, shape in state_entries(model, block, tp_size=1)})
    dist.barrier()
    if rank == 1:
        time.sleep(LATE_S)
    taker.take(1, state)
    started = time.perf_counter()
    taker.wait_copied()
    copy_wait_s = time.perf_counter() - started
    taker.take(2, state)  # waits for snapshot 1 to be done, on both ranks
    taker.wait_done()
    data, parity = (KeeperBuffer(path).read() for path in (slots[rank][0], slots[rank][2]))
    taker.abandon()
    return {"copy_wait_s": copy_wait_s, "payload": data[1].clone(), "parity": parity[1].clone(),
            "metas": (data[0], parity[0]), "sizes": taker.stripes.sizes}


@pytest.mark.timeout(120)
def test_the_optimizer_step_waits_for_the_copy_into_the_keeper_not_for_the_parity_encode():
    from odyssey_megatron.snapshot.keeper import NodeKeeper
    from odyssey_megatron.snapshot.parity import StripeLayout, parity_of

    keepers = [NodeKeeper(1, name=f"test-taker-node{node}") for node in range(2)]
    slots = [list(keeper.paths[0].data + keeper.paths[0].parity) for keeper in keepers]
    try:
        ranks = run_world(_taker_rank, 2, slots, timeout=100)
    finally:
        for keeper in keepers:
            keeper.close()
    assert ranks[0]["copy_wait_s"] < LATE_S / 2, "rank 0's optimizer step waited for its parity partner"
    layout = StripeLayout(ranks[0]["sizes"])
    # run_world hands tensors back as numpy arrays
    expected = parity_of([torch.from_numpy(ranks[m]["payload"]) for m in range(2)], layout)
    for member in range(2):
        assert torch.equal(torch.from_numpy(ranks[member]["parity"]), expected[member]), member
        assert ranks[member]["metas"][0]["step"] == ranks[member]["metas"][1]["step"] == 1
