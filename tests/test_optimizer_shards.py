"""Which DP peers keep which block's optimizer state under the distributed optimizer: two
owners per block among its holders, about the same bytes on each, so one failure leaves
every block's state on a survivor."""

from __future__ import annotations

import pytest

from odyssey_megatron.blocks import EMBEDDING, OUTPUT
from odyssey_megatron.optimizer_shards import REPLICAS, owned_share, shard_owners

LLAMA_LIKE = {EMBEDDING: 393, **{layer: 608 for layer in range(8)}, OUTPUT: 393}
"""Optimizer bytes of a small Llama stage: eight layers and the larger-vocabulary edges."""


@pytest.mark.parametrize("holders", [[0], [3, 5], [0, 1, 2], [0, 2, 4, 6], list(range(8))])
def test_every_block_has_two_owners_among_its_holders_and_each_keeps_about_its_share(holders):
    owners = shard_owners(LLAMA_LIKE, holders)
    assert set(owners) == set(LLAMA_LIKE)
    assert all(len(set(o)) == min(REPLICAS, len(holders)) and set(o) <= set(holders) for o in owners.values())
    kept = {w: sum(LLAMA_LIKE[b] for b, o in owners.items() if w in o) for w in holders}
    share = owned_share(len(holders)) * sum(LLAMA_LIKE.values())
    assert all(abs(bytes_ - share) <= max(LLAMA_LIKE.values()) for bytes_ in kept.values()), kept
    if len(holders) > 1:  # any one holder lost: every block's state is still held
        assert all(set(o) - {lost} for lost in holders for o in owners.values())


def test_the_owners_follow_from_the_holders_alone():
    assert shard_owners(LLAMA_LIKE, [2, 0, 1]) == shard_owners(LLAMA_LIKE, [0, 1, 2])
    assert owned_share(1) == owned_share(2) == 1.0 and owned_share(8) == 0.25
    with pytest.raises(ValueError, match="holders must be >= 1"):
        owned_share(0)
    with pytest.raises(ValueError, match="at least one holder"):
        shard_owners(LLAMA_LIKE, [])
