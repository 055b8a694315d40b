"""Block geometry has one owner (``odyssey_megatron.blocks``): the stages Megatron-Core
builds hold exactly the blocks, parameters and bytes it computes from the model config,
and the snapshot writers the estimator prices are the ones the snapshots write by."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from helpers import asymmetric_plan
from odyssey_megatron.blocks import (
    EMBEDDING,
    OUTPUT,
    StageSpec,
    block_bytes,
    block_sort_key,
    shard_shapes,
    stage_blocks,
    worker_blocks,
)
from odyssey_megatron.config import ModelConfig, load_config
from odyssey_megatron.decision_center import DecisionCenter
from odyssey_megatron.estimator.snapshot import snapshot_shares
from odyssey_megatron.snapshot.shards import owners, shard_blocks, shard_entries
from odyssey_megatron.testing.local_world import run_world

TINY = Path(__file__).resolve().parents[1] / "recipes" / "llama2_7b" / "tiny_cpu.yaml"
MODEL = dict(num_layers=4, hidden_size=32, ffn_hidden_size=48, num_attention_heads=4, num_query_groups=2,
             vocab_size=64, seq_length=16, params_dtype="fp32")
"""Every dimension different, and grouped-query attention, so a wrong shape cannot hide."""
STAGES = [StageSpec((0, 4), True, True), StageSpec((0, 1), True, False), StageSpec((1, 3), False, False),
          StageSpec((3, 4), False, True), StageSpec((1, 4), False, True)]


def test_a_stage_holds_its_layers_the_first_the_embedding_and_the_last_the_output_and_a_tied_embedding():
    assert stage_blocks(StageSpec((0, 2), True, False), tied=True) == [EMBEDDING, 0, 1]
    assert stage_blocks(StageSpec((2, 3), False, False), tied=True) == [2]
    assert stage_blocks(StageSpec((3, 5), False, True), tied=False) == [3, 4, OUTPUT]
    assert stage_blocks(StageSpec((3, 5), False, True), tied=True) == [EMBEDDING, 3, 4, OUTPUT]
    assert stage_blocks(StageSpec((0, 5), True, True), tied=True) == [EMBEDDING, 0, 1, 2, 3, 4, OUTPUT]


def test_block_bytes_by_hand():
    """A layer of the test model: QKV (4 + 2 x 2) x 8 x 32, the projection 32 x 32, the
    SwiGLU [gate; up] 96 x 32 and down 32 x 48, two norms of 32; fp32 weights and two fp32
    moments of each, and the 8-byte step. TP 2 splits all but the norms."""
    model = ModelConfig(**MODEL)
    layer = 64 * 32 + 32 * 32 + 96 * 32 + 32 * 48
    assert block_bytes(model, 0, 1) == 12 * (layer + 2 * 32) + 8
    assert block_bytes(model, 0, 2) == 12 * (layer // 2 + 2 * 32) + 8
    assert block_bytes(model, EMBEDDING, 2) == 12 * 64 * 32 // 2 + 8
    assert block_bytes(model, OUTPUT, 1) == 12 * (32 + 64 * 32) + 8
    tied = ModelConfig(**{**MODEL, "tie_embeddings": True})
    assert block_bytes(tied, OUTPUT, 1) == 12 * 32 + 8  # the final norm: the head is the embedding
    with pytest.raises(ValueError, match="not a block of a 4-layer model"):
        block_bytes(model, 4, 1)


def _plans():
    """(name, model, plan): symmetric, asymmetric, TP 2, tied, and what recoveries decide."""
    cases = []
    for name, overrides in [("symmetric", []), ("tied", ["model.tie_embeddings=true"]),
                            ("tp2", ["parallel.tensor_model_parallel_size=2", "parallel.pipeline_model_parallel_size=2"])]:
        config = load_config(TINY, ["cluster.devices_per_node=2", *overrides])
        center = DecisionCenter.from_recipe(config)
        cases.append((name, config.model, center.plan))
        decision = center.on_failure(ranks=[2])
        for candidate in (decision.chosen, *decision.alternatives):
            cases.append((f"{name} after {candidate.policy} {candidate.layout}", config.model, candidate.plan))
    config = load_config(TINY)
    cases.append(("asymmetric", config.model, asymmetric_plan([(3, 5), (2, 2, 4), (8,)], [5, 3, 2])))
    return cases


@pytest.mark.parametrize(("name", "model", "plan"), _plans(), ids=lambda value: value if isinstance(value, str) else "")
def test_the_estimator_prices_the_shares_the_snapshots_write(name, model, plan):
    """Each worker's priced share is the bytes of the tensors it packs into its keeper
    (``shard_entries`` of the blocks ``owners`` gives it), and every writer trains what it
    writes."""
    written = owners(plan, model)
    tp = plan.tensor_parallel_size
    packed = {w: sum(math.prod(shape) * dtype.itemsize
                     for _, dtype, shape in shard_entries(model, shard_blocks(written, w), tp_size=tp))
              for w in plan.workers}
    assert snapshot_shares(plan, model) == packed
    assert set(written) == {b for w in plan.workers for b in worker_blocks(plan, w, tied=model.tie_embeddings)}
    for block, worker in written.items():
        assert block in worker_blocks(plan, worker, tied=model.tie_embeddings)


def _megatron_stages(rank: int, world_size: int, fields: dict) -> dict:
    """Every stage of ``STAGES``, tied and untied, built by ``build_stage_model`` on the meta
    device at TP 1 (rank 0 alone) and TP 2 (both ranks): per stage, the TP shard shape of
    each parameter by global name, and the parameter count of each block as the gradient
    sync groups them."""
    import torch
    import torch.distributed as dist
    from megatron.core.process_groups_config import ProcessGroupCollection

    from odyssey_megatron.hooks.grad_sync import parameters_by_block
    from odyssey_megatron.hooks.global_weights import global_name
    from odyssey_megatron.hooks.model import build_stage_model, is_tied

    singles = [dist.new_group([r]) for r in range(world_size)]
    pair = dist.new_group(list(range(world_size)))
    own = singles[rank]
    out = {}
    for tied in (False, True):
        model = ModelConfig(**{**fields, "tie_embeddings": tied})
        for tp, group in ((1, own), (2, pair)):
            if tp == 1 and rank != 0:
                continue
            groups = ProcessGroupCollection(tp=group, cp=own, pp=own, ep=own, expt_dp=own, embd=None, pos_embd=None,
                                            dp=own, dp_cp=own)
            for stage in STAGES:
                with torch.device("meta"):
                    gpt = build_stage_model(model, stage, pg_collection=groups)
                shapes = {global_name(name, stage.layers[0], tied=is_tied(gpt)): tuple(p.shape)
                          for name, p in gpt.named_parameters()}
                counts = {block: sum(p.numel() for p in params)
                          for block, params in parameters_by_block(gpt, stage).items()}
                out[tied, tp, stage] = shapes, counts
    return out


def test_megatron_core_stages_hold_the_blocks_parameters_and_bytes_of_the_geometry():
    built = run_world(_megatron_stages, 2, MODEL, timeout=240)
    assert built[0].keys() >= built[1].keys()
    for (tied, tp, stage), (shapes, counts) in built[0].items():
        if (tied, tp, stage) in built[1]:
            assert built[1][tied, tp, stage] == (shapes, counts)  # both TP ranks' shards alike
        model = ModelConfig(**{**MODEL, "tie_embeddings": tied})
        held = stage_blocks(stage, tied=tied)
        assert sorted(counts, key=block_sort_key) == held, (tied, tp, stage)
        expected = {name: shape for block in held for name, shape in shard_shapes(model, block, tp_size=tp).items()}
        assert shapes == expected, (tied, tp, stage)
        for block, count in counts.items():
            assert block_bytes(model, block, tp) == 12 * count + 8, (tied, tp, stage, block)
