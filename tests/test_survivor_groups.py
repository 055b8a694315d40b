"""Where survivors' next communicator comes from, for each backend, NCCL version and
state of the old communicator (pure: checked on CPU, for the GPU runs to follow), and what a
generation's world made from the last one's asks of torch (``next_world``: the call it makes
recorded, since no NCCL runs here; the device check runs a real shrink)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from odyssey_megatron.hooks.process_groups import RankMap
from odyssey_megatron.hooks.survivor_groups import GroupSource, KeptWorld, group_source, keeps_parent, next_world, \
    runtime_nccl_version, survivor_group, torch_offers

BOTH = frozenset({"shrink_group", "split_group"})


@pytest.mark.parametrize("backend, version, healthy, gains, loses, as_default, offered, expected", [
    ("gloo", None, True, False, True, False, BOTH, GroupSource.rendezvous),  # gloo shrinks nothing
    ("gloo", None, False, False, True, False, BOTH, GroupSource.rendezvous),
    ("hccl", None, False, False, True, False, BOTH, GroupSource.rendezvous),
    ("nccl", None, True, False, True, False, BOTH, GroupSource.rendezvous),  # no NCCL at run time
    ("nccl", (2, 30, 3), False, False, True, False, BOTH, GroupSource.shrink_abort),  # a peer died, below the hang
    ("nccl", (2, 31, 0), False, False, True, False, BOTH, GroupSource.rendezvous),  # SHRINK_ABORT hangs survivors there
    ("nccl", (2, 32, 1), False, False, True, False, BOTH, GroupSource.rendezvous),
    ("nccl", (2, 26, 5), False, False, True, False, BOTH, GroupSource.rendezvous),  # no ncclCommShrink yet
    ("nccl", (2, 31, 0), True, False, True, False, BOTH, GroupSource.shrink),  # healthy: no abort, no hang
    ("nccl", (2, 27, 0), True, False, True, False, BOTH, GroupSource.shrink),
    ("nccl", (2, 26, 5), True, False, True, False, BOTH, GroupSource.split),  # healthy, no shrink: split
    ("nccl", (2, 31, 0), True, False, True, False, frozenset({"split_group"}), GroupSource.split),
    ("nccl", (2, 17, 1), True, False, True, False, BOTH, GroupSource.rendezvous),  # no ncclCommSplit either
    ("nccl", (2, 30, 3), False, False, True, False, frozenset(), GroupSource.rendezvous),  # no shrink_group
    ("nccl", (2, 30, 3), True, True, True, False, BOTH, GroupSource.rendezvous),  # a joiner: a shrink cannot add it
    ("nccl", (2, 31, 0), True, False, False, False, BOTH, GroupSource.split),  # none lost: nothing to exclude
    ("nccl", (2, 30, 3), False, False, False, False, BOTH, GroupSource.rendezvous),
    ("nccl", (2, 26, 5), True, False, True, True, BOTH, GroupSource.rendezvous),  # a split is no default group
    ("nccl", (2, 31, 0), True, False, True, True, BOTH, GroupSource.shrink),  # a shrink's is
])
def test_the_survivors_communicator_comes_from_a_shrink_only_where_it_neither_hangs_nor_is_refused(
        backend, version, healthy, gains, loses, as_default, offered, expected):
    assert group_source(backend=backend, nccl_version=version, parent_healthy=healthy, gains_ranks=gains,
                        loses_ranks=loses, as_default=as_default, offered=offered) is expected


def test_this_cpu_torch_offers_both_and_runs_no_nccl_so_survivors_meet_afresh():
    assert torch_offers() == BOTH  # torch 2.13 has both; they fail only for backends without them
    assert runtime_nccl_version() is None


def test_a_rendezvous_makes_nothing_from_the_old_group_and_leaves_it_alone():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        parent = dist.distributed_c10d._get_default_group()
        assert survivor_group(GroupSource.rendezvous, parent=parent, excluded=[], survivors=[0]) is None
        dist.all_reduce(torch.ones(1))  # the parent still works
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("backend, version, keeps", [("gloo", None, False), ("nccl", None, False),
                                                     ("nccl", (2, 26, 5), False), ("nccl", (2, 27, 0), True)])
def test_a_generation_keeps_its_world_only_where_the_next_one_could_shrink_it(backend, version, keeps):
    assert keeps_parent(backend=backend, nccl_version=version, offered=BOTH) is keeps


@pytest.fixture
def world_and_shrinks(monkeypatch):
    """A real one-rank gloo world to keep, and every ``dist.shrink_group`` call recorded
    (returning what the call would: the survivors' group, named here)."""
    calls = []
    monkeypatch.setattr(dist, "shrink_group", lambda *args, **kwargs: calls.append((args, kwargs)) or "shrunk")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield dist.distributed_c10d._get_default_group(), calls
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_survivors_on_nccl_shrink_the_kept_world_excluding_each_tp_rank_of_the_lost_worker(world_and_shrinks):
    """Workers 0, 1, 2 at TP 2 (ranks 0..5); worker 1 lost: ranks 2 and 3 are excluded, the
    shrink waits for nothing in flight, and the parent is aborted after."""
    parent, calls = world_and_shrinks
    group = next_world(KeptWorld(parent, RankMap.of((0, 1, 2), 2)), ranks=RankMap.of((0, 2), 2),
                       held_everywhere=True, backend="nccl", nccl_version=(2, 28, 9), offered=BOTH)
    assert group == "shrunk"
    assert calls == [(([2, 3],), {"group": parent, "shrink_flags": dist.distributed_c10d.SHRINK_DEFAULT})]


@pytest.mark.parametrize("backend, held_everywhere, workers", [
    ("gloo", True, (0, 2)),  # gloo cannot shrink
    ("nccl", False, (0, 2)),  # some rank did not keep its world (its generation was aborted there)
    ("nccl", True, (0, 2, 3)),  # a joiner: a shrink cannot add it
    ("nccl", True, (0, 1, 2)),  # nobody lost: nothing to exclude
])
def test_the_kept_world_is_destroyed_and_the_generation_meets_afresh_where_no_shrink_can_make_it(
        world_and_shrinks, backend, held_everywhere, workers):
    parent, calls = world_and_shrinks
    assert next_world(KeptWorld(parent, RankMap.of((0, 1, 2), 1)), ranks=RankMap.of(workers, 1),
                      held_everywhere=held_everywhere, backend=backend, nccl_version=(2, 28, 9), offered=BOTH) is None
    assert calls == [] and not dist.is_initialized()
