"""Blocks whose chosen writer died with the controller are written by the next replica at
its turn (``runtime.rank.fill_in``), on real checkpoint parts, with the clock a seam: a
healthy writer is waited for and never duplicated; a writer that never claimed, or claimed
and never finished, is filled in; a later replica waits for an earlier one's claim."""

from __future__ import annotations

import torch

from odyssey_megatron.blocks import StageSpec, stage_blocks
from odyssey_megatron.config import ModelConfig
from odyssey_megatron.hooks.training_state import TrainingState
from odyssey_megatron.run_dir import private_directory
from odyssey_megatron.runtime.checkpoint import load_checkpoint, save_part
from odyssey_megatron.runtime.checkpoint_index import checkpoint_parts, checkpoint_directory, latest_checkpoint
from odyssey_megatron.runtime.rank.fill_in import Replica, claim, fill_in

MODEL = ModelConfig(num_layers=2, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4, num_query_groups=2,
                    vocab_size=128, seq_length=16, params_dtype="fp32")
WHOLE = StageSpec((0, 2), first=True, last=True)
BLOCKS = stage_blocks(WHOLE, tied=MODEL.tie_embeddings)
STEP, GRACE_S, STAGGER_S, CLAIM_WAIT_S = 3, 10.0, 1.0, 25.0


class FakeClock:
    """Time that moves only when the code under test sleeps; ``at`` runs an action (another
    writer's claim or part) once the clock reaches its time."""

    def __init__(self, actions: dict[float, callable] | None = None):
        self.now, self.actions = 0.0, dict(actions or {})

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds
        for at in sorted(t for t in self.actions if t <= self.now):
            self.actions.pop(at)()


def state() -> TrainingState:
    trained = TrainingState.initial(MODEL, WHOLE, seed=5, tp_rank=0, tp_size=1)
    for block in trained.blocks.values():
        block.step = STEP
    return trained


def run(tmp_path, replicas, clock, written):
    run_dir = tmp_path / "run"
    held = state()

    def write(blocks, step, part):
        written.append((part, [str(b) for b in blocks], clock.now))
        save_part(run_dir, held, blocks, step=step, rank=1, tp_rank=0, tp_size=1, model=MODEL, part=part)

    return fill_in(run_dir, replicas, part="rank-1-fill", tp_rank=0, write=write, grace_s=GRACE_S,
                   stagger_s=STAGGER_S, claim_wait_s=CLAIM_WAIT_S, clock=clock, sleep=clock.sleep, poll_s=0.5)


def own_share(run_dir, blocks, *, rank: int) -> None:
    """What worker ``rank`` writes of its share: its claim, then its part."""
    claim(run_dir, step=STEP, part=f"rank-{rank}", blocks=blocks, tp_rank=0)
    save_part(run_dir, state(), blocks, step=STEP, rank=rank, tp_rank=0, tp_size=1, model=MODEL)


def setup_run(tmp_path):
    run_dir = tmp_path / "run"
    private_directory(run_dir)
    own_share(run_dir, BLOCKS[:1], rank=1)  # this worker's own share, written before it fills in
    return run_dir


def test_a_chosen_writer_that_never_claimed_is_filled_in_at_the_replica_s_turn_and_the_step_is_whole(tmp_path):
    run_dir, written = setup_run(tmp_path), []
    assert latest_checkpoint(run_dir) is None  # the dead writer's blocks are missing
    clock = FakeClock()
    wrote = run(tmp_path, [Replica(b, STEP, turn=1) for b in BLOCKS[1:]], clock, written)
    assert [r.block for r in wrote] == BLOCKS[1:]
    assert written == [("rank-1-fill-0", [str(b) for b in BLOCKS[1:]], GRACE_S)]  # at its turn, not before
    step, directory = latest_checkpoint(run_dir)
    assert step == STEP
    loaded = load_checkpoint(directory, run_dir=run_dir, model=MODEL, stage=WHOLE, tp_rank=0, tp_size=1,
                             device=torch.device("cpu"))
    want = state()
    for block in BLOCKS:
        assert all(torch.equal(want.export(block)[k], v) for k, v in loaded.export(block).items())


def test_a_healthy_writer_is_waited_for_and_nothing_is_written_twice(tmp_path):
    run_dir, written = setup_run(tmp_path), []
    clock = FakeClock({1.0: lambda: claim(run_dir, step=STEP, part="rank-0", blocks=BLOCKS[1:], tp_rank=0),
                       12.0: lambda: save_part(run_dir, state(), BLOCKS[1:], step=STEP, rank=0, tp_rank=0, tp_size=1,
                                               model=MODEL)})  # its part lands after this replica's turn
    assert run(tmp_path, [Replica(b, STEP, turn=1) for b in BLOCKS[1:]], clock, written) == []
    assert written == [] and clock.now >= 12.0
    names = sorted(b for _, part in checkpoint_parts(checkpoint_directory(run_dir, STEP)) for b in part["blocks"])
    assert names == sorted(str(b) for b in BLOCKS)  # each block once


def test_a_writer_that_claimed_and_died_writing_is_filled_in_after_the_claim_wait(tmp_path):
    run_dir, written = setup_run(tmp_path), []
    clock = FakeClock({1.0: lambda: claim(run_dir, step=STEP, part="rank-0", blocks=BLOCKS[1:], tp_rank=0)})
    run(tmp_path, [Replica(b, STEP, turn=1) for b in BLOCKS[1:]], clock, written)
    [(part, blocks, at)] = written
    assert blocks == [str(b) for b in BLOCKS[1:]] and CLAIM_WAIT_S <= at < CLAIM_WAIT_S + 2.0  # claimed at 1 s
    assert latest_checkpoint(run_dir)[0] == STEP


def test_a_later_replica_waits_for_an_earlier_one_s_claim_and_fills_in_only_what_it_left(tmp_path):
    """This worker is second in line (turn 2): the chosen writer is dead; the first replica
    claims one block at its turn and writes it; the other block nobody claims, and this
    worker writes it one stagger later."""
    run_dir, written = setup_run(tmp_path), []
    clock = FakeClock({
        GRACE_S: lambda: claim(run_dir, step=STEP, part="rank-2-fill-0", blocks=BLOCKS[1:2], tp_rank=0),
        GRACE_S + 3.0: lambda: save_part(run_dir, state(), BLOCKS[1:2], step=STEP, rank=2, tp_rank=0, tp_size=1,
                                         model=MODEL, part="rank-2-fill-0"),
    })
    wrote = run(tmp_path, [Replica(b, STEP, turn=2) for b in BLOCKS[1:]], clock, written)
    assert [r.block for r in wrote] == BLOCKS[2:]
    assert written == [("rank-1-fill-0", [str(b) for b in BLOCKS[2:]], GRACE_S + STAGGER_S)]
    assert latest_checkpoint(run_dir)[0] == STEP
