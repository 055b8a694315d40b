"""Per-block training state: drawn once from the seed, exported to and imported from plain
tensors bitwise, and carried into a plan of another layout without changing what training
computes (parameters and Adam moments equal one process that never changed plans)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from helpers import asymmetric_plan, symmetric_plan
from odyssey_megatron.blocks import EMBEDDING, OUTPUT, StageSpec
from odyssey_megatron.cluster import ClusterState
from odyssey_megatron.config import ModelConfig
from odyssey_megatron.hooks.global_weights import StageShard, merge_stage_state_dicts
from odyssey_megatron.hooks.training_state import BlockState, TrainingState
from odyssey_megatron.profile import uniform_profile
from odyssey_megatron.restorer import check_transfers, live_holdings, plan_transfers, with_sync
from odyssey_megatron.testing.local_world import run_world
from runtime_cases import LR, SEED, reference, tiny_model
from state_cases import change_layout, round_trip

pytestmark = pytest.mark.timeout(300)


def _state(model: ModelConfig, stage: StageSpec, tp_rank: int = 0, tp_size: int = 1) -> TrainingState:
    return TrainingState.initial(model, stage, seed=SEED, tp_rank=tp_rank, tp_size=tp_size)


def test_initial_blocks_are_tp_shards_of_one_whole_model_draw():
    """TP ranks draw their shards of the same full tensors; a stage holds its blocks only,
    a tied last stage the embedding too, all with zero moments at step 0."""
    model = tiny_model(4, tie_embeddings=True)
    whole = StageSpec((0, 4), first=True, last=True)
    full = {n: t for s in _state(model, whole).blocks.values() for n, t in s.params.items()}
    shards = [StageShard(whole, k, 2, {n: t for s in _state(model, whole, k, 2).blocks.values()
                                       for n, t in s.params.items()}) for k in range(2)]
    merged = merge_stage_state_dicts(shards, tied=True)
    assert merged.keys() == full.keys()
    for name, tensor in full.items():
        assert torch.equal(merged[name], tensor), name
    last = _state(model, StageSpec((2, 4), first=False, last=True))
    assert last.held() == [EMBEDDING, 2, 3, OUTPUT]
    assert torch.equal(last.blocks[EMBEDDING].params["embedding.word_embeddings.weight"],
                       full["embedding.word_embeddings.weight"])
    for block in last.blocks.values():
        assert block.step == 0
        assert all(not t.any() for t in (*block.exp_avg.values(), *block.exp_avg_sq.values()))


def test_keep_drops_the_rest_and_receive_takes_exported_tensors():
    model = tiny_model(4)
    state = _state(model, StageSpec((0, 2), first=True, last=False))
    other = _state(model, StageSpec((2, 4), first=False, last=True))
    state.keep([1, 2])
    assert state.held() == [1]
    state.receive(2, other.export(2))
    assert state.held() == [1, 2]
    assert all(torch.equal(a, b) for a, b in zip(state.export(2).values(), other.export(2).values()))
    with pytest.raises(ValueError, match="block 3 is not held here"):
        state.export(3)


def _layer_one() -> dict[str, torch.Tensor]:
    return _state(tiny_model(4), StageSpec((0, 2), first=True, last=False)).export(1)


QKV = "decoder.layers.1.self_attention.linear_qkv.weight"


@pytest.mark.parametrize("edit,culprit", [
    (lambda t: t.pop("step"), "step"),
    (lambda t: t.update(step=torch.tensor(1.5)), "step"),
    (lambda t: t.update({"momentum/" + QKV: t[f"param/{QKV}"]}), f"momentum/{QKV}"),
    (lambda t: t.update({"param/decoder.layers.0.input_layernorm.weight": torch.ones(32)}),
     "param/decoder.layers.0.input_layernorm.weight: not a parameter of this block"),
    (lambda t: t.update({f"param/{QKV}": t[f"param/{QKV}"].bfloat16()}), f"param/{QKV}: dtype torch.bfloat16"),
    (lambda t: t.pop(f"exp_avg_sq/{QKV}"), f"exp_avg_sq/{QKV}: missing"),
    (lambda t: t.pop(f"param/{QKV}"), f"exp_avg/{QKV}: no param/{QKV}"),
    (lambda t: t.update({f"exp_avg/{QKV}": t[f"exp_avg/{QKV}"][:1]}), f"{QKV}: shapes differ"),
])
def test_bad_block_tensors_name_the_key(edit, culprit):
    tensors = _layer_one()
    edit(tensors)
    with pytest.raises(ValueError, match="^block 1: " + culprit.replace("[", r"\[").replace(".", r"\.")):
        BlockState.from_tensors(1, tensors)


def test_export_import_round_trip_is_bitwise_and_training_goes_on_alike():
    """On two ranks: PP2 in fp32, one TP=2 worker, and PP2 in bf16 with tied embeddings (the
    last stage's embedding copy is a block too). Training draws no random numbers, so no
    RNG state is carried; a runner built from imported copies continues bit for bit; in
    bf16 the state holds fp32 masters finer than the model's weights."""
    profile = uniform_profile(num_layers=4)
    pp2 = with_sync(symmetric_plan(dp=1, pp=2, num_layers=4, micro_batches_per_pipeline=2), profile)
    tp2 = with_sync(replace(asymmetric_plan([(4,)], [2]), tensor_parallel_size=2), profile)
    tied = with_sync(pp2, replace(profile, tie_embeddings=True))
    cases = [("pp2-fp32", pp2.to_json(), "fp32", False), ("tp2-fp32", tp2.to_json(), "fp32", False),
             ("pp2-bf16-tied", tied.to_json(), "bf16", True)]
    results = run_world(round_trip, 2, cases, 2)
    blocks = {"pp2-fp32": [["embedding", "0", "1"], ["2", "3", "output"]],
              "tp2-fp32": [["embedding", "0", "1", "2", "3", "output"]] * 2,
              "pp2-bf16-tied": [["embedding", "0", "1"], ["embedding", "2", "3", "output"]]}
    for rank, by_case in enumerate(results):
        for name, r in by_case.items():
            where = f"{name} rank {rank}"
            assert r["blocks"] == blocks[name][rank], where
            assert r["steps"] == [3], where
            assert r["initial_differs"] == [], f"{where}: the state draws what the seed always drew"
            assert r["rng_changed"] == [], f"{where}: a step drew random numbers"
            assert r["round_trip_differs"] == [], where
            assert r["model_differs"] == [], f"{where}: the second runner loads the same weights"
            assert r["continued_differs"] == [], f"{where}: training from the copies goes on alike"
            assert r["model_is_rounded_master"], where
            assert (r["below_model_precision"] > 0) == name.endswith(("bf16", "bf16-tied")), where


STEPS_A, STEPS_B = 2, 2
TOLERANCE = {"param": (1e-5, LR / 100), "exp_avg": (1e-5, 1e-8), "exp_avg_sq": (1e-4, 1e-11)}
"""(rtol, atol). Parameters as in ``test_runtime_equivalence``; the moments differ from the
reference by summation order only (measured: at most 9e-10 on first moments up to 4e-3,
5e-13 on second moments up to 2e-6), so their bounds sit 10-20x above that; a moment or
step count lost in a move is off by the moment itself."""


def test_state_carried_into_another_layout_trains_like_one_process(tmp_path):
    """PP2 x DP2 (stage s of pipeline d on worker 2s + d) becomes pipelines of 3+1 and 1+3
    layers with 3 and 1 micro-batches, every worker on another stage: worker 2 keeps layer
    2 and takes the first stage, worker 1 keeps layer 1 and takes a last stage, workers 0
    and 3 keep nothing. The restorer's transfers move the rest (through files here: the
    sender exports, the receiver imports). Parameters and Adam moments after all steps
    equal one process that trained every step on the whole model."""
    profile = uniform_profile(num_layers=4)
    cluster = ClusterState(world_size=4)
    plan_a = with_sync(symmetric_plan(dp=2, pp=2, num_layers=4, micro_batches_per_pipeline=2), profile)
    layout = {(0, 0): 2, (0, 1): 0, (1, 0): 3, (1, 1): 1}
    plan_b = asymmetric_plan([(3, 1), (1, 3)], [3, 1], worker_of=lambda d, s: layout[d, s])
    plan_b = with_sync(replace(plan_b, generation=1, policy="reparallelize"), profile)
    holdings = live_holdings(plan_a, cluster=cluster, profile=profile)
    plan_b = replace(plan_b, transfers=plan_transfers(plan_b, holdings=holdings, profile=profile, cluster=cluster))
    check_transfers(plan_b, holdings=holdings, profile=profile, cluster=cluster)

    expected = run_world(reference, 1, 4, plan_a.num_micro_batches, False, STEPS_A + STEPS_B)[0]
    results = run_world(change_layout, 4, plan_a.to_json(), plan_b.to_json(), str(tmp_path), STEPS_A, STEPS_B)

    moves = [(r["held_before"], r["kept"], r["received"]) for r in results]
    assert moves == [
        (["embedding", "0", "1"], [], ["3", "output"]),
        (["embedding", "0", "1"], ["1"], ["2", "3", "output"]),
        (["2", "3", "output"], ["2"], ["embedding", "0", "1"]),
        (["2", "3", "output"], [], ["embedding", "0"]),
    ]
    seen = set()
    for rank, r in enumerate(results):
        for key, value in r["final"].items():
            block, kind = key.split(":", 1)
            if kind == "step":
                assert int(value) == STEPS_A + STEPS_B, f"rank {rank} block {block}"
                continue
            kind, name = kind.split("/", 1)
            want = torch.from_numpy(expected["params" if kind == "param" else kind][name])
            rtol, atol = TOLERANCE[kind]
            torch.testing.assert_close(torch.from_numpy(value), want, rtol=rtol, atol=atol,
                                       msg=lambda m, key=key: f"rank {rank} {key}: {m}")
            seen.add((kind, name))
    assert seen == {(kind, name) for kind in ("param", "exp_avg", "exp_avg_sq") for name in expected["params"]}
