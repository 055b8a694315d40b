"""Block transfers over P2P: after worker 2 of four dies, the three survivors form a smaller
world and run the new plan's transfers (as the restorer makes them). Each rank must end
holding exactly its new stage's blocks, each bitwise the copy of the worker it kept or
received it from: weights, Adam moments and step, which differ per worker here so a copy
from the wrong source, a shuffled tensor or a lost moment shows."""

from __future__ import annotations

import re
import time
from dataclasses import asdict, replace
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from helpers import asymmetric_plan, symmetric_plan
from runtime_cases import SEED, tiny_model

from odyssey_megatron.cluster import ClusterState
from odyssey_megatron.config import ModelConfig
from odyssey_megatron.blocks import StageSpec
from odyssey_megatron.hooks.process_groups import RankMap
from odyssey_megatron.hooks.training_state import TrainingState
from odyssey_megatron.plan import ExecutionPlan, Transfer
from odyssey_megatron.profile import uniform_profile
from odyssey_megatron.restorer import check_transfers, live_holdings, plan_transfers
from odyssey_megatron.runtime.rank.block_transfer import (
    ShardMove,
    check_rank_part,
    execute_transfers,
    shard_moves,
)
from odyssey_megatron.testing.local_world import run_world

NUM_LAYERS = 4
HOST = torch.device("cpu")
DEAD_WORKER = 2
SURVIVORS = (0, 1, 3)


def _old_plan(tp: int) -> ExecutionPlan:
    """PP2 x DP2: stage s of pipeline d on worker 2s + d (workers 0, 1 first stages, 2, 3 last)."""
    plan = symmetric_plan(dp=2, pp=2, num_layers=NUM_LAYERS, micro_batches_per_pipeline=2)
    return replace(plan, tensor_parallel_size=tp)


def _new_plan(old: ExecutionPlan, splits, micro_batches, layout: dict, *, tied: bool) -> ExecutionPlan:
    """Survivors on ``layout`` ((pipeline, stage) -> worker), with the transfers the decision
    center gives a plan whose workers are chosen (``plan_transfers``), checked by it too."""
    tp = old.tensor_parallel_size
    profile = replace(uniform_profile(num_layers=NUM_LAYERS), tie_embeddings=tied)
    cluster = ClusterState(world_size=4 * tp, tensor_parallel_size=tp).fail_ranks(
        range(DEAD_WORKER * tp, (DEAD_WORKER + 1) * tp))
    plan = asymmetric_plan(splits, micro_batches, worker_of=lambda d, s: layout[d, s])
    plan = replace(plan, generation=1, policy="reparallelize", tensor_parallel_size=tp)
    holdings = live_holdings(old, cluster=cluster, profile=profile)
    plan = replace(plan, transfers=plan_transfers(plan, holdings=holdings, profile=profile, cluster=cluster))
    check_transfers(plan, holdings=holdings, profile=profile, cluster=cluster)
    return plan


def old_state(model: ModelConfig, plan: ExecutionPlan, worker: int, tp_rank: int) -> TrainingState:
    """What ``worker``'s TP rank held under ``plan``: its shards of the seed's weights, and
    moments and steps that are not zero and differ per worker, block and TP rank."""
    tp = plan.tensor_parallel_size
    state = TrainingState.initial(model, StageSpec.of_worker(plan, worker), seed=SEED, tp_rank=tp_rank, tp_size=tp)
    for index, block in enumerate(state.held()):
        held = state.blocks[block]
        generator = torch.Generator().manual_seed(1000 * worker + 10 * index + tp_rank)
        for moments in (held.exp_avg, held.exp_avg_sq):
            for tensor in moments.values():
                tensor.uniform_(0.5, 1.5, generator=generator)
        held.step = 100 * worker + 10 * index + tp_rank + 1
    return state


COMMITTED = 7
"""The steps committed when the plan with a stale block (``tp1_world``) is entered."""
STALE_BLOCK, STALE_SOURCE = 0, 1
"""The block whose copy on the worker that sends it is a step behind."""


def _enter(rank: int, world_size: int, old_json: str, new_json: str, tied: bool, refused_json: str | None,
           own_group: bool, stale_json: str | None = None) -> dict:
    """Hold what the old plan gave this rank, enter the new plan (over a group of its own
    with a short timeout if ``own_group``, as a recovery bounds its waits); then, if given,
    try a plan whose transfers some rank cannot do, from the state entered; then, if given,
    with every block at ``COMMITTED`` steps but the stale one, a plan that sends it."""
    old, new = ExecutionPlan.from_json(old_json), ExecutionPlan.from_json(new_json)
    tp = new.tensor_parallel_size
    ranks = RankMap.of(SURVIVORS, tp)
    model = tiny_model(NUM_LAYERS, tied)
    state = old_state(model, old, ranks.worker(rank), rank % tp)
    group = dist.new_group(timeout=timedelta(seconds=120)) if own_group else None
    report = execute_transfers(plan=new, state=state, rank=rank, ranks=ranks, model=model, device=HOST, group=group)
    result = {"report": asdict(report),
              "held": {f"{block}:{key}": t.clone() for block in state.held() for key, t in state.export(block).items()}}
    if refused_json is not None:
        start = time.perf_counter()
        try:
            execute_transfers(plan=ExecutionPlan.from_json(refused_json), state=state, rank=rank, ranks=ranks,
                              model=model, device=HOST)
            result["refusal"] = None
        except ValueError as error:
            result["refusal"] = str(error)
        result["refusal_s"] = time.perf_counter() - start
        result["held_after_refusal"] = {f"{block}:{key}": t for block in state.held()
                                        for key, t in state.export(block).items()}
    if stale_json is not None:
        for block, held in state.blocks.items():
            held.step = COMMITTED - (block == STALE_BLOCK and ranks.worker(rank) == STALE_SOURCE)
        try:
            execute_transfers(plan=ExecutionPlan.from_json(stale_json), state=state, rank=rank, ranks=ranks,
                              model=model, device=HOST, committed=COMMITTED)
            result["stale"] = None
        except RuntimeError as error:
            result["stale"] = str(error)
        result["steps_after_stale"] = {str(block): held.step for block, held in state.blocks.items()}
    return result


def _check_entered(old: ExecutionPlan, new: ExecutionPlan, tied: bool, results: list[dict]) -> None:
    """Every rank holds exactly its new stage's blocks (from the profile's view of the plan),
    each bitwise the copy of the worker that held it (itself) or sent it (the transfer's
    source), and reports the blocks and bytes it moved."""
    tp = new.tensor_parallel_size
    ranks = RankMap.of(SURVIVORS, tp)
    model = tiny_model(NUM_LAYERS, tied)
    holdings = new.holdings(replace(uniform_profile(num_layers=NUM_LAYERS), tie_embeddings=tied))
    old_holdings = old.holdings(replace(uniform_profile(num_layers=NUM_LAYERS), tie_embeddings=tied))
    for rank, result in enumerate(results):
        worker, k = ranks.worker(rank), rank % tp
        sources = {t.layer: t.src // tp for t in new.transfers if t.dst == worker * tp + k}
        expected = {}
        for block in holdings.get(worker, []):
            source = worker if block in old_holdings[worker] else sources[block]
            copy = old_state(model, old, source, k).export(block)
            expected.update({f"{block}:{key}": t for key, t in copy.items()})
        held = {key: torch.from_numpy(value) for key, value in result["held"].items()}
        assert sorted(held) == sorted(expected), f"rank {rank} (worker {worker})"
        for key, tensor in expected.items():
            assert held[key].dtype == tensor.dtype and torch.equal(held[key], tensor), f"rank {rank} {key}"

        report = result["report"]
        assert list(report["held"]) == holdings.get(worker, []), f"rank {rank}"
        assert list(report["received"]) == list(sources), f"rank {rank}"
        assert list(report["sent"]) == [t.layer for t in new.transfers if t.src == worker * tp + k], f"rank {rank}"
        assert report["bytes_received"] == sum(
            t.nbytes for block, source in sources.items() for t in old_state(model, old, source, k).export(block).values())
    assert sum(r["report"]["bytes_sent"] for r in results) == sum(r["report"]["bytes_received"] for r in results)


@pytest.fixture(scope="module")
def tp1_world():
    """TP 1. Old: workers 0, 1 hold (embedding, 0, 1), workers 2, 3 hold (2, 3, output);
    worker 2 dies. New: pipelines of 3+1 and 4 layers, worker 3 on the first stage (keeps
    2, receives embedding, 0, 1), worker 0 on the second (receives 3 and output, which only
    worker 3 holds now), worker 1 the whole model (keeps embedding, 0, 1, receives 2, 3,
    output). Then the same stages with a transfer of layer 3 from worker 3, which dropped it;
    then with one of layer 0 from worker 1, whose copy is a step behind, to worker 3."""
    old = _old_plan(tp=1)
    new = _new_plan(old, [(3, 1), (4,)], [3, 1], {(0, 0): 3, (0, 1): 0, (1, 0): 1}, tied=False)
    refused = replace(new, generation=2, transfers=(Transfer(3, 3, 1, 100),))
    stale = replace(new, generation=3, transfers=(Transfer(STALE_BLOCK, STALE_SOURCE, 3, 100),))
    return old, new, run_world(_enter, 3, old.to_json(), new.to_json(), False, refused.to_json(), False,
                               stale.to_json())


def test_survivors_take_their_new_stages_over_p2p(tp1_world):
    old, new, results = tp1_world
    assert [list(r["report"]["received"]) for r in results] == [
        [3, "output"], [2, 3, "output"], ["embedding", 0, 1]], "workers 0, 1, 3 receive"
    assert set(results[2]["report"]["sent"]) == {2, 3, "output"}, "worker 3 both sends and receives"
    _check_entered(old, new, False, results)


def test_a_rank_that_cannot_send_stops_every_rank_before_anything_moves(tp1_world):
    """The agreement before any send: the rank that cannot do its part says why, every
    other rank says who refused, at once rather than when a receive times out, and no
    rank's state changes."""
    _, _, results = tp1_world
    assert results[2]["refusal"].startswith(
        f"transfer {Transfer(3, 3, 1, 100)}: rank 2, its source, does not hold block 3")
    for r in results[:2]:
        assert r["refusal"].startswith("ranks [2] cannot do their part of plan generation 2's transfers")
    for rank, r in enumerate(results):
        assert r["refusal_s"] < 60, f"rank {rank} refused at once, not after a timeout"
        assert r["held_after_refusal"].keys() == r["held"].keys(), f"rank {rank}"
        for key, value in r["held"].items():
            assert (r["held_after_refusal"][key] == value).all(), f"rank {rank} {key}"


def test_a_block_received_at_another_step_than_the_committed_one_fails_its_receiver(tp1_world):
    """A received block's Adam step count is checked as a kept block's is: the receiver
    fails, the way a rank holding a stale block fails entering, and keeps its own copy."""
    _, _, results = tp1_world
    assert results[2]["stale"] == (f"blocks received at steps {{{STALE_BLOCK}: {COMMITTED - 1}}}; "
                                   f"generation 3 starts after {COMMITTED} committed steps")
    assert results[2]["steps_after_stale"][str(STALE_BLOCK)] == COMMITTED, "the stale copy is not held"
    assert [r["stale"] for r in results[:2]] == [None, None], "the sender and a bystander go on"


def test_tp2_shards_move_rank_by_rank_and_an_idle_worker_keeps_nothing():
    """TP 2 with tied embeddings (a last stage holds an embedding copy). New: one pipeline of
    1+3 layers, worker 3 on the first stage (keeps the embedding, receives layer 0), worker
    0 on the last (keeps the embedding and 1, receives 2, 3, output from worker 3), worker 1
    idle. Column- and row-parallel shards (the latter strided views of the full tensor)
    and replicated norms each go from TP rank k to TP rank k."""
    old = _old_plan(tp=2)
    new = _new_plan(old, [(1, 3)], [4], {(0, 0): 3, (0, 1): 0}, tied=True)
    results = run_world(_enter, 6, old.to_json(), new.to_json(), True, None, True)
    assert [list(r["report"]["received"]) for r in results] == [[2, 3, "output"]] * 2 + [[]] * 2 + [[0]] * 2
    assert [r["report"]["held"] for r in results[2:4]] == [(), ()], "worker 1 owns no stage"
    _check_entered(old, new, True, results)


@pytest.mark.parametrize("tp,transfer,culprit", [
    (1, Transfer(0, None, 1, 100), "src is None, the block must be read from a checkpoint"),
    (1, Transfer(0, 2, 1, 100), "source worker 2 is not in this world (workers (0, 1, 3))"),
    (1, Transfer(0, 1, 2, 100), "destination worker 2 is not in this world"),
    (2, Transfer(0, 1, 6, 100), "TP rank 1 sends to TP rank 0"),
    (2, Transfer(0, 7, 7, 100), "worker 3 sends to itself"),
])
def test_transfers_p2p_cannot_run_are_refused_naming_them(tp, transfer, culprit):
    plan = replace(_old_plan(tp), transfers=(transfer,))
    with pytest.raises(ValueError, match="^" + re.escape(f"transfer {transfer}: {culprit}")):
        shard_moves(plan, RankMap.of(SURVIVORS, tp))


def test_launch_ranks_map_to_this_worlds_ranks():
    """Plans name launch ranks (worker * TP + k); worker 3 is the third survivor, ranks 4, 5."""
    plan = replace(_old_plan(2), transfers=(Transfer(2, 7, 1, 100), Transfer("output", 6, 2, 100)))
    moves = shard_moves(plan, RankMap.of(SURVIVORS, 2))
    assert [(m.block, m.src, m.dst) for m in moves] == [(2, 5, 1), ("output", 4, 2)]


def test_a_rank_refuses_a_part_it_cannot_do():
    model = tiny_model(NUM_LAYERS)
    first = StageSpec((0, 2), first=True, last=False)
    state = TrainingState.initial(model, first, seed=SEED, tp_rank=0, tp_size=1)
    send_2 = ShardMove(Transfer(2, 0, 1, 100), src=0, dst=1)
    with pytest.raises(ValueError, match=r"rank 0, its source, does not hold block 2 \(it holds \['embedding', 0, 1\]\)"):
        check_rank_part([send_2], rank=0, state=state, keep=[], model=model, tp_size=1)
    send_1 = ShardMove(Transfer(1, 0, 2, 100), src=0, dst=1)
    with pytest.raises(ValueError, match=r"holds block 1 with param/decoder\.layers\.1\.mlp\.linear_fc1\.weight of "
                                         r"shape \(128, 32\) torch\.float32, the model needs \(64, 32\)"):
        check_rank_part([send_1], rank=0, state=state, keep=[], model=model, tp_size=2)
    receive_2 = ShardMove(Transfer(2, 2, 0, 100), src=1, dst=0)
    with pytest.raises(ValueError, match=r"rank 0: blocks \[3, 'output'\] of its new stage are neither held nor"):
        check_rank_part([receive_2], rank=0, state=state, keep=[1, 2, 3, "output"], model=model, tp_size=1)
    check_rank_part([receive_2, send_1], rank=0, state=state, keep=[1, 2], model=model, tp_size=1)


def test_a_model_of_another_depth_is_refused_before_any_collective():
    """No world is formed here: the refusal comes before the first collective."""
    with pytest.raises(ValueError, match=r"^model\.num_layers 6, the plan has 4 layers$"):
        execute_transfers(plan=_old_plan(1), state=TrainingState(), rank=0, ranks=RankMap.of(SURVIVORS, 1),
                          model=tiny_model(6), device=HOST)
