"""Which DP peers keep which range of a block's optimizer state under the distributed
optimizer: two owners per element among the block's holders, the same share on each, so
one failure leaves every element on a survivor."""

from __future__ import annotations

import pytest

from odyssey_megatron.optimizer_shards import REPLICAS, first_owned_range, fullest_share, owned_ranges, owned_share


@pytest.mark.parametrize("numel", [1, 7, 1000, 4096 * 11008])
@pytest.mark.parametrize("holders", [[0], [3, 5], [0, 1, 2], [0, 2, 4, 6], list(range(16))])
def test_every_element_has_two_owners_and_each_holder_keeps_its_share(numel, holders):
    ranges = owned_ranges(numel, holders)
    assert set(ranges) == set(holders)
    owners = [0] * numel if numel < 10_000 else None
    for kept in ranges.values():
        assert all(0 <= start <= end <= numel for start, end in kept)
        assert abs(sum(end - start for start, end in kept) - owned_share(len(holders)) * numel) <= 2
        if owners is not None:
            for start, end in kept:
                for element in range(start, end):
                    owners[element] += 1
    if owners is not None:
        assert set(owners) == {min(REPLICAS, len(holders))}
    if len(holders) > REPLICAS:  # each element sent and counted once, by one of its owners
        first = sorted(first_owned_range(numel, holders, worker) for worker in holders)
        assert [start for start, _ in first] == [0] + [end for _, end in first[:-1]] and first[-1][1] == numel
        assert all(first_owned_range(numel, holders, w) in ranges[w] for w in holders)
    if len(holders) > 1:  # any one holder lost: every element still has an owner
        for lost in holders:
            left = sorted(r for worker, kept in ranges.items() if worker != lost for r in kept)
            covered = 0
            for start, end in left:
                assert start <= covered, (lost, left)
                covered = max(covered, end)
            assert covered == numel


def test_the_ranges_follow_from_the_holders_alone():
    assert owned_ranges(10, [2, 0, 1]) == owned_ranges(10, [0, 1, 2]) == {
        0: ((0, 3), (6, 10)), 1: ((0, 3), (3, 6)), 2: ((3, 6), (6, 10))}
    assert owned_share(1) == owned_share(2) == 1.0 and owned_share(8) == 0.25
    assert fullest_share(10, 3) == 7 and fullest_share(10, 2) == 10 and fullest_share(16, 8) == 4
    with pytest.raises(ValueError, match="holders must be >= 1"):
        owned_share(0)
    with pytest.raises(ValueError, match="at least one holder"):
        owned_ranges(10, [])
