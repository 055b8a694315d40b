"""Where survivors' next communicator comes from, for each backend, NCCL version and
state of the old communicator (pure: checked on CPU, for the GPU runs to follow)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from odyssey_megatron.hooks.survivor_groups import GroupSource, group_source, runtime_nccl_version, \
    survivor_group, torch_offers

BOTH = frozenset({"shrink_group", "split_group"})


@pytest.mark.parametrize("backend, version, healthy, gains, offered, expected", [
    ("gloo", None, True, False, BOTH, GroupSource.rendezvous),  # gloo shrinks nothing
    ("gloo", None, False, False, BOTH, GroupSource.rendezvous),
    ("hccl", None, False, False, BOTH, GroupSource.rendezvous),
    ("nccl", None, True, False, BOTH, GroupSource.rendezvous),  # no NCCL at run time
    ("nccl", (2, 30, 3), False, False, BOTH, GroupSource.shrink_abort),  # a peer died, below the hang
    ("nccl", (2, 31, 0), False, False, BOTH, GroupSource.rendezvous),  # SHRINK_ABORT hangs survivors there
    ("nccl", (2, 32, 1), False, False, BOTH, GroupSource.rendezvous),
    ("nccl", (2, 26, 5), False, False, BOTH, GroupSource.rendezvous),  # no ncclCommShrink yet
    ("nccl", (2, 31, 0), True, False, BOTH, GroupSource.shrink),  # healthy: no abort, no hang
    ("nccl", (2, 27, 0), True, False, BOTH, GroupSource.shrink),
    ("nccl", (2, 26, 5), True, False, BOTH, GroupSource.split),  # healthy, no shrink: split
    ("nccl", (2, 31, 0), True, False, frozenset({"split_group"}), GroupSource.split),
    ("nccl", (2, 17, 1), True, False, BOTH, GroupSource.rendezvous),  # no ncclCommSplit either
    ("nccl", (2, 30, 3), False, False, frozenset(), GroupSource.rendezvous),  # a torch without shrink_group
    ("nccl", (2, 30, 3), True, True, BOTH, GroupSource.rendezvous),  # a joiner: a shrink cannot add it
])
def test_the_survivors_communicator_comes_from_a_shrink_only_where_it_neither_hangs_nor_is_refused(
        backend, version, healthy, gains, offered, expected):
    assert group_source(backend=backend, nccl_version=version, parent_healthy=healthy, gains_ranks=gains,
                        offered=offered) is expected


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
