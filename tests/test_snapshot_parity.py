"""RAID-5 parity over in-memory snapshots (``snapshot.parity``): protection groups keep a
group's members on distinct nodes and leave as few ranks unprotected as any grouping could;
every single lost member's payload is rebuilt exactly from the others, and two lost are
not; and ``encode``/``rebuild`` over real gloo groups agree with the collective-free math."""

from __future__ import annotations

import datetime
import functools
import multiprocessing as mp
import random
import traceback

import pytest
import torch
import torch.distributed as dist

from spawned_ranks import run_three_ranks

from odyssey_megatron.snapshot import parity as parity_module
from odyssey_megatron.snapshot.parity import (ENCODE_PIECE_BYTES, ENCODE_WINDOW, EncodeSpares, StripeLayout, encode,
                                               encode_temporary_bytes, parity_of, protection_groups, rebuild,
                                               rebuild_temporary_bytes, rebuilt_from, unprotected, xor_into)
from odyssey_megatron.testing.local_world import run_world

# -- protection groups ---------------------------------------------------------------------


def test_four_nodes_of_two_ranks_make_two_groups_of_four_or_four_pairs_across_nodes():
    two_each = {node: [2 * node, 2 * node + 1] for node in range(4)}
    assert protection_groups(two_each, 4) == [(0, 2, 4, 6), (1, 3, 5, 7)]
    assert protection_groups(two_each, 2) == [(0, 2), (1, 3), (4, 6), (5, 7)]


def test_ranks_of_a_single_node_are_each_alone_and_unprotected():
    groups = protection_groups({3: [2, 0, 1]}, 3)
    assert groups == [(0,), (1,), (2,)]
    assert unprotected(groups) == [0, 1, 2]


def test_uneven_nodes_still_protect_every_rank_when_partners_exist():
    uneven = {0: [0, 1, 2], 1: [3], 2: [4, 5]}
    assert protection_groups(uneven, 2) == [(0, 3), (1, 4), (2, 5)]
    # Cut into threes, rank 2 is left alone with node 0 in every group: it takes rank 4 from (0, 3, 4).
    assert protection_groups(uneven, 3) == [(0, 3), (1, 5), (2, 4)]
    assert unprotected(protection_groups(uneven, 3)) == []


def test_an_odd_rank_out_of_pairs_joins_a_pair_as_a_third_member():
    assert protection_groups({0: [0], 1: [1], 2: [2]}, 2) == [(0, 1, 2)]


def test_ranks_a_big_node_holds_beyond_all_other_nodes_stay_unprotected():
    groups = protection_groups({0: [0, 1, 2, 3, 4, 5], 1: [6], 2: [7]}, 2)
    assert unprotected(groups) == [2, 3, 4, 5]
    assert sorted(g for g in groups if len(g) > 1) == [(0, 6), (1, 7)]


@pytest.mark.parametrize("size", [1, 0])
def test_a_group_size_below_two_is_refused(size):
    with pytest.raises(ValueError, match="size"):
        protection_groups({0: [0], 1: [1]}, size)


def test_a_rank_on_two_nodes_is_refused():
    with pytest.raises(ValueError, match="rank 1"):
        protection_groups({0: [0, 1], 1: [1, 2]}, 2)


def _fewest_alone(node_of: dict[int, int]) -> int:
    """By brute force over every grouping into pairs and triples on distinct nodes (any
    larger group splits into those): the fewest ranks left alone."""

    @functools.lru_cache(maxsize=None)
    def fewest(left: frozenset[int]) -> int:
        if not left:
            return 0
        first, rest = min(left), sorted(left - {min(left)})
        best = 1 + fewest(frozenset(rest))
        for i, a in enumerate(rest):
            if node_of[a] == node_of[first]:
                continue
            best = min(best, fewest(left - {first, a}))
            for b in rest[i + 1:]:
                if node_of[b] not in (node_of[first], node_of[a]):
                    best = min(best, fewest(left - {first, a, b}))
        return best

    return fewest(frozenset(node_of))


def test_random_clusters_group_every_rank_once_on_distinct_nodes_leaving_the_fewest_alone():
    rng = random.Random(4)
    for _ in range(300):
        counts = [rng.randint(0, 4) for _ in range(rng.randint(1, 5))]
        ranks = rng.sample(range(40), sum(counts))
        node_ids = rng.sample(range(100), len(counts))
        ranks_by_node = {node: ranks[sum(counts[:i]):sum(counts[:i + 1])] for i, node in enumerate(node_ids)}
        node_of = {rank: node for node, held in ranks_by_node.items() for rank in held}
        size = rng.randint(2, 5)
        groups = protection_groups(ranks_by_node, size)
        case = f"{ranks_by_node}, size {size}: {groups}"
        assert sorted(r for g in groups for r in g) == sorted(ranks), case
        assert all(len({node_of[r] for r in g}) == len(g) for g in groups), case
        assert all(list(g) == sorted(g) for g in groups) and groups == sorted(groups), case
        assert all(len(g) <= max(size, 3) for g in groups), case
        if len(ranks) <= 12:
            assert len(unprotected(groups)) == _fewest_alone(node_of), case
        shuffled = {node: rng.sample(held, len(held)) for node, held in rng.sample(list(ranks_by_node.items()),
                                                                                   len(ranks_by_node))}
        assert protection_groups(shuffled, size) == groups, "the order nodes and ranks are listed in matters"


# -- parity arithmetic ---------------------------------------------------------------------


def _payloads(sizes, seed: int, low: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(low, 256, (size,), dtype=torch.uint8, generator=gen) for size in sizes]


def _chunk(payload: torch.Tensor, index: int, layout: StripeLayout) -> torch.Tensor:
    """Chunk ``index`` of ``payload`` zero padded, read independently of the module's layout."""
    padded = torch.zeros((layout.members - 1) * layout.chunk_bytes, dtype=torch.uint8)
    padded[:payload.numel()] = payload
    return padded[index * layout.chunk_bytes:(index + 1) * layout.chunk_bytes]


RANDOM_LAYOUTS = [StripeLayout(tuple(random.Random(seed).choice([0, 1, 2, 7, 64, 101, 255])
                                     for _ in range(random.Random(seed + 100).randint(2, 6))))
                  for seed in range(40)]


def test_the_chunk_size_spreads_the_largest_payload_over_the_other_members():
    assert StripeLayout((10, 3, 4)).chunk_bytes == 5
    assert StripeLayout((11, 3, 4)).chunk_bytes == 6
    assert StripeLayout((0, 0)).chunk_bytes == 1
    assert [StripeLayout((1,) * 4).chunk_index(2, s) for s in (0, 1, 3)] == [0, 1, 2]
    with pytest.raises(ValueError, match="parity"):
        StripeLayout((1,) * 4).chunk_index(2, 2)
    with pytest.raises(ValueError, match="2 members"):
        StripeLayout((5,))


@pytest.mark.parametrize("layout", RANDOM_LAYOUTS, ids=str)
def test_stripes_hold_each_chunk_where_chunk_index_says_and_zeros_at_the_own_stripe(layout):
    for member, payload in enumerate(_payloads(layout.sizes, seed=1)):
        rows = layout.stripes(member, payload).view(layout.members, layout.chunk_bytes)
        assert not rows[member].any()
        for stripe in set(range(layout.members)) - {member}:
            assert torch.equal(rows[stripe], _chunk(payload, layout.chunk_index(member, stripe), layout))


@pytest.mark.parametrize("layout", RANDOM_LAYOUTS, ids=str)
def test_each_parity_is_the_xor_of_the_other_members_chunks_in_its_stripe(layout):
    payloads = _payloads(layout.sizes, seed=2)
    for stripe, parity in enumerate(parity_of(payloads, layout)):
        expected = torch.zeros(layout.chunk_bytes, dtype=torch.uint8)
        for member in set(range(layout.members)) - {stripe}:
            expected ^= _chunk(payloads[member], layout.chunk_index(member, stripe), layout)
        assert torch.equal(parity, expected), stripe


@pytest.mark.parametrize("layout", RANDOM_LAYOUTS, ids=str)
def test_any_one_lost_member_is_rebuilt_exactly_from_the_others_payloads_and_parities(layout):
    payloads = _payloads(layout.sizes, seed=3)
    parities = parity_of(payloads, layout)
    for lost in range(layout.members):
        gone = [torch.full_like(p, 0x5A) if m == lost else p for m, p in enumerate(payloads)]
        gone_parities = [torch.full_like(p, 0xA5) if m == lost else p for m, p in enumerate(parities)]
        assert torch.equal(rebuilt_from(gone, gone_parities, lost, layout), payloads[lost]), lost


@pytest.mark.parametrize("members", [3, 4, 6])
def test_two_lost_members_of_one_group_cannot_be_rebuilt(members):
    layout = StripeLayout((12,) * members)
    payloads = _payloads(layout.sizes, seed=5, low=1)  # no zero byte: a zeroed payload always differs
    parities = parity_of(payloads, layout)
    for lost in range(members):
        second = (lost + 1) % members
        payloads_left = [torch.zeros_like(p) if m == second else p for m, p in enumerate(payloads)]
        parities_left = [torch.zeros_like(p) if m == second else p for m, p in enumerate(parities)]
        assert not torch.equal(rebuilt_from(payloads_left, parities_left, lost, layout), payloads[lost])


def test_a_payload_of_the_wrong_size_or_type_is_refused():
    layout = StripeLayout((4, 4))
    with pytest.raises(ValueError, match="4 bytes"):
        layout.stripes(0, torch.zeros(5, dtype=torch.uint8))
    with pytest.raises(ValueError, match="uint8"):
        layout.stripes(0, torch.zeros(4, dtype=torch.int32))


@pytest.mark.parametrize("offset", [0, 3])
def test_xor_into_cut_across_threads_xors_every_byte_of_aligned_and_unaligned_views(monkeypatch, offset):
    monkeypatch.setattr(parity_module, "_XOR_MIN_SLICE", 8)  # a small buffer cut into XOR_THREADS slices
    target, source = _payloads((1000 + offset, 1000 + offset), seed=9)
    expected = target.clone()
    expected[offset:offset + 997] ^= source[offset:offset + 997]
    xor_into(target[offset:], source[offset:offset + 997])  # a shorter source XORs a prefix
    assert torch.equal(target, expected)


def test_an_encode_holds_no_temporary_in_a_pair_and_a_window_of_pieces_in_a_larger_group():
    assert encode_temporary_bytes((600, 400)) == 0
    # chunks of 200 B, smaller than a piece: a spare a chunk for each sender but the first
    assert encode_temporary_bytes((600, 400, 10, 0)) == 2 * 200
    # a 6 GB share in a group of 4: ENCODE_WINDOW pieces, not a 2 GB chunk
    assert encode_temporary_bytes((6 * 10**9,) * 4) == ENCODE_WINDOW * ENCODE_PIECE_BYTES
    # 20 B chunks: as many pieces as one sender sends
    assert encode_temporary_bytes((40, 40, 40), piece_bytes=7) == 3 * 7
    assert rebuild_temporary_bytes((600, 400, 10, 0), lost=0) == 600  # the lost payload, at dst
    assert rebuild_temporary_bytes((6, 4), lost=1) == 2 * 6


# -- over gloo -----------------------------------------------------------------------------

GLOO_SIZES = (9, 0, 4)
"""Three members: a chunk of 5 bytes, an empty payload and one shorter than its chunks
(rebuilds move them in pieces of 2 bytes)."""
GLOO_SEED = 7
HOST_PAD = 3


def _member(rank: int, port: int, results: mp.Queue) -> None:
    """Member ``rank`` of a three-member group encodes into a view of a larger host buffer,
    then each member is lost in turn: its two survivors rebuild it to either of them over a
    group of their own, and the whole world rebuilds it with the lost rank as a newcomer at dst."""
    try:
        store = dist.TCPStore("127.0.0.1", port, 4, is_master=False, timeout=datetime.timedelta(seconds=60))
        dist.init_process_group("gloo", rank=rank, world_size=3, store=store)
        parity_module.PIECE_BYTES = 2  # a rebuild's chunks go down the chain in pieces, through both spares
        layout = StripeLayout(GLOO_SIZES)
        payload = _payloads(GLOO_SIZES, GLOO_SEED)[rank]
        host = torch.full((layout.chunk_bytes + 2 * HOST_PAD,), 0xEE, dtype=torch.uint8)
        parity = encode(payload, member=rank, layout=layout, group=dist.group.WORLD,
                        out=host[HOST_PAD:HOST_PAD + layout.chunk_bytes])
        rebuilt = {}
        for lost in range(3):
            survivors = [m for m in range(3) if m != lost]
            pair = dist.new_group(survivors)
            for dst in (0, 1):
                if rank != lost:
                    got = rebuild(lost=lost, member=rank, payload=payload, parity=parity, layout=layout,
                                  group=pair, dst=dst)
                    rebuilt[("survivors", lost, dst)] = None if got is None else got.tolist()
            newcomer = rank == lost
            got = rebuild(lost=lost, member=None if newcomer else rank, payload=None if newcomer else payload,
                          parity=None if newcomer else parity, layout=layout, group=dist.group.WORLD, dst=lost)
            rebuilt[("newcomer", lost)] = None if got is None else got.tolist()
        dist.destroy_process_group()
        results.put((rank, "ok", (host.tolist(), rebuilt)))
    except BaseException:  # noqa: BLE001
        results.put((rank, "error", traceback.format_exc()))


@pytest.mark.timeout(120)
def test_encode_and_rebuild_over_gloo_agree_with_the_collective_free_math():
    got = run_three_ranks(_member, answers=3)
    layout = StripeLayout(GLOO_SIZES)
    payloads = _payloads(GLOO_SIZES, GLOO_SEED)
    for rank, parity in enumerate(parity_of(payloads, layout)):
        host, rebuilt = got[rank]
        assert host[HOST_PAD:-HOST_PAD] == parity.tolist(), rank
        assert host[:HOST_PAD] == host[-HOST_PAD:] == [0xEE] * HOST_PAD, "encode wrote outside its out view"
        for lost in range(3):
            survivors = [m for m in range(3) if m != lost]
            for dst in (0, 1):
                if rank != lost:
                    expected = payloads[lost].tolist() if survivors[dst] == rank else None
                    assert rebuilt[("survivors", lost, dst)] == expected, (rank, lost, dst)
            assert rebuilt[("newcomer", lost)] == (payloads[lost].tolist() if rank == lost else None), (rank, lost)


GROUP_SIZES = {
    2: [(23, 17), (0, 9)],
    3: [(40, 0, 13), (31, 31, 31)],
    4: [(64, 1, 50, 17), (5, 5, 5, 0)],
    5: [(101, 64, 7, 0, 88)],
}
"""Uneven payloads per group size: chunks of several 3-byte pieces, chunks shorter than
others', an empty payload, lengths no multiple of a word."""
TINY_PIECE = 3
"""Pieces of 3 bytes: a chunk goes in many pieces, more than ``ENCODE_WINDOW`` arrive in
spares in the larger groups, so each spare is reused."""


def _groups_member(rank: int, world: int) -> dict:
    """Every rank builds a group of the first ``members`` ranks for each size (all ranks, in
    one order); its members encode each of the size's payload sets in tiny pieces twice,
    into buffers of different garbage, counting torch's allocations in each, then rebuild
    each lost member in turn at that member, which takes part as a newcomer."""
    groups = {members: dist.new_group(list(range(members))) for members in GROUP_SIZES}
    got = {}
    for members, size_sets in GROUP_SIZES.items():
        if rank >= members:
            continue
        for sizes in size_sets:
            layout = StripeLayout(sizes)
            payload = _payloads(sizes, seed=sum(sizes))[rank]
            allocated = []
            empty = torch.empty

            def counted(*args, **kwargs):
                tensor = empty(*args, **kwargs)
                allocated.append(tensor.numel() * tensor.element_size())
                return tensor

            spares = EncodeSpares()  # a snapshot taker's, new: nothing kept yet
            torch.empty = counted
            try:
                parity = encode(payload, member=rank, layout=layout, group=groups[members],
                                out=torch.full((layout.chunk_bytes,), 0xEE, dtype=torch.uint8), piece_bytes=TINY_PIECE,
                                spares=spares)
                first = sum(allocated)
                again = encode(payload, member=rank, layout=layout, group=groups[members],
                               out=torch.full((layout.chunk_bytes,), 0x11, dtype=torch.uint8), piece_bytes=TINY_PIECE,
                               spares=spares)
            finally:
                torch.empty = empty
            allocated = (first, sum(allocated) - first, torch.equal(again, parity))
            rebuilt = {}
            for lost in range(members):
                newcomer = rank == lost
                result = rebuild(lost=lost, member=None if newcomer else rank, payload=None if newcomer else payload,
                                 parity=None if newcomer else parity, layout=layout, group=groups[members], dst=lost)
                rebuilt[lost] = None if result is None else result.tolist()
            got[sizes] = (parity.tolist(), allocated, rebuilt)
    return got


@pytest.mark.timeout(120)
def test_every_member_is_rebuilt_bit_exact_after_an_encode_in_pieces_in_groups_of_two_to_five():
    """The encode over gloo, in pieces, gives each member the parity the collective-free
    math does, allocating exactly ``encode_temporary_bytes`` once per layout; from those
    parities the gloo rebuild returns any one lost member's payload bit for bit."""
    ranks = run_world(_groups_member, max(GROUP_SIZES), timeout=100)
    for members, size_sets in GROUP_SIZES.items():
        for sizes in size_sets:
            layout = StripeLayout(sizes)
            payloads = _payloads(sizes, seed=sum(sizes))
            expected = parity_of(payloads, layout)
            for member in range(members):
                parity, allocated, rebuilt = ranks[member][sizes]
                assert parity == expected[member].tolist(), (sizes, member)
                # the first encode of a layout allocates its spares, the next one reuses them
                assert allocated == (encode_temporary_bytes(sizes, piece_bytes=TINY_PIECE), 0, True), (sizes, member)
                assert rebuilt[member] == payloads[member].tolist(), (sizes, member)
                assert all(rebuilt[lost] is None for lost in range(members) if lost != member), (sizes, member)
