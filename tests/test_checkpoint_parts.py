"""Checkpoint parts: written by workers without a collective (a stop, or a lost
controller), found complete by ``latest_checkpoint`` only when they hold every block, and
read back under another stage split exactly as written; beside a collective save of the
same step, never in its way."""

from __future__ import annotations

import torch

from odyssey_megatron.config import ModelConfig
from odyssey_megatron.blocks import StageSpec, stage_blocks
from odyssey_megatron.hooks.training_state import TrainingState
from odyssey_megatron.run_dir import private_directory
from odyssey_megatron.runtime.checkpoint import load_checkpoint, part_tensors, save_part
from odyssey_megatron.runtime.checkpoint_index import latest_checkpoint, mark_latest

MODEL = ModelConfig(num_layers=4, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4, num_query_groups=2,
                    vocab_size=128, seq_length=16, params_dtype="fp32")
WHOLE = StageSpec((0, 4), first=True, last=True)


def trained(step: int) -> TrainingState:
    """The whole model's blocks as if ``step`` steps had been taken."""
    state = TrainingState.initial(MODEL, WHOLE, seed=5, tp_rank=0, tp_size=1)
    for block in state.blocks.values():
        block.step = step
        for moment in (*block.exp_avg.values(), *block.exp_avg_sq.values()):
            moment.fill_(0.25)
    return state


def test_parts_that_hold_every_block_are_the_latest_and_load_under_another_split(tmp_path):
    run_dir = tmp_path / "run"
    private_directory(run_dir)
    state, blocks = trained(3), stage_blocks(WHOLE, tied=MODEL.tie_embeddings)
    save_part(run_dir, state, blocks[:3], step=3, rank=0, tp_rank=0, tp_size=1, model=MODEL)
    assert latest_checkpoint(run_dir) is None  # half the blocks: not a checkpoint
    save_part(run_dir, state, blocks[2:], step=3, rank=5, tp_rank=0, tp_size=1, model=MODEL)
    step, directory = latest_checkpoint(run_dir)
    assert (step, directory.name) == (3, "step-3")
    second = StageSpec((2, 4), first=False, last=True)
    loaded = load_checkpoint(directory, run_dir=run_dir, model=MODEL, stage=second, tp_rank=0, tp_size=1,
                             device=torch.device("cpu"))
    assert loaded.held() == stage_blocks(second, tied=MODEL.tie_embeddings)
    for block in loaded.held():
        want, got = state.export(block), loaded.export(block)
        assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)


def test_the_newest_complete_checkpoint_wins_whether_marked_or_not(tmp_path):
    run_dir = tmp_path / "run"
    private_directory(run_dir)
    blocks = stage_blocks(WHOLE, tied=MODEL.tie_embeddings)
    save_part(run_dir, trained(2), blocks, step=2, rank=1, tp_rank=0, tp_size=1, model=MODEL)
    mark_latest(run_dir, 2)
    save_part(run_dir, trained(4), blocks[:-1], step=4, rank=1, tp_rank=0, tp_size=1, model=MODEL)
    assert latest_checkpoint(run_dir)[0] == 2  # step 4 lacks the output block
    save_part(run_dir, trained(4), blocks[-1:], step=4, rank=2, tp_rank=0, tp_size=1, model=MODEL)
    assert latest_checkpoint(run_dir)[0] == 4


def test_a_part_cut_short_beside_a_collective_save_of_the_same_step_leaves_the_save_found_and_read(
        tmp_path, one_rank_group):
    """A run an earlier version checkpointed with one collective DCP save per step, resumed
    and stopped (or its controller lost) right there, writes parts into the same step's
    directory; one cut short (its writer died) must not hide the save there, which holds
    every block: the step is found, and loads from the save."""
    import torch.distributed.checkpoint as dcp

    run_dir = tmp_path / "run"
    private_directory(run_dir)
    saved, blocks = trained(6), stage_blocks(WHOLE, tied=MODEL.tie_embeddings)
    directory = run_dir / "checkpoint" / "step-6"
    dcp.save(part_tensors(saved, blocks, tp_rank=0, tp_size=1), process_group=one_rank_group,
             storage_writer=dcp.FileSystemWriter(directory, sync_files=True))
    mark_latest(run_dir, 6)
    save_part(run_dir, trained(6), blocks[:1], step=6, rank=3, tp_rank=0, tp_size=1, model=MODEL)
    step, directory = latest_checkpoint(run_dir)
    assert (step, directory.name) == (6, "step-6")
    loaded = load_checkpoint(directory, run_dir=run_dir, model=MODEL, stage=WHOLE, tp_rank=0, tp_size=1,
                             device=torch.device("cpu"))
    assert loaded.held() == blocks
    for block in blocks:
        want, got = saved.export(block), loaded.export(block)
        assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)


DEEP = ModelConfig(num_layers=8, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4, num_query_groups=2,
                   vocab_size=128, seq_length=16, params_dtype="fp32")


def test_writers_that_are_not_alive_leave_their_blocks_to_the_other_replicas_and_parts_hold_every_block(tmp_path):
    """The save without a collective shares blocks out as the snapshots do
    (``shards.owners``), among the live workers: with workers 0 and 4 dead (one replica of
    each stage of DP 4 x PP 2), the live replicas write all of it, each block once, and the
    parts they write are a complete checkpoint. A block no live worker holds is left out
    (the save then lacks it)."""
    from helpers import symmetric_plan
    from odyssey_megatron.blocks import worker_blocks
    from odyssey_megatron.snapshot.shards import owners

    plan = symmetric_plan(dp=4, pp=2, num_layers=8, micro_batches_per_pipeline=2)
    alive = [w for w in plan.workers if w not in (0, 4)]
    writers = owners(plan, DEEP, workers=alive)
    assert set(writers.values()) <= set(alive) and len(writers) == 10
    run_dir = tmp_path / "run"
    private_directory(run_dir)
    state = TrainingState.initial(DEEP, StageSpec((0, 8), first=True, last=True), seed=5, tp_rank=0, tp_size=1)
    for block in state.blocks.values():
        block.step = 3
    for worker in set(writers.values()):
        save_part(run_dir, state, [b for b, w in writers.items() if w == worker], step=3, rank=worker, tp_rank=0,
                  tp_size=1, model=DEEP)
    assert latest_checkpoint(run_dir)[0] == 3
    stage_0 = [w for w in plan.workers if 0 in worker_blocks(plan, w, tied=False)]
    assert 0 not in owners(plan, DEEP, workers=[w for w in plan.workers if w not in stage_0])
