"""The periodic checkpoint written in the background: each rank's part holds its blocks as
they were when the step started, whatever training does to them meanwhile; the owner marks
a checkpoint the latest once every writer of the generation counted in and the parts hold
every block; a write cut short leaves the checkpoint before it the latest."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

import odyssey_megatron.runtime.checkpoint as checkpoint
from odyssey_megatron.blocks import StageSpec, model_blocks
from odyssey_megatron.config import load_config
from odyssey_megatron.decision_center import DecisionCenter
from odyssey_megatron.hooks.accelerator import select_accelerator
from odyssey_megatron.hooks.training_state import TrainingState
from odyssey_megatron.run_dir import private_directory, read_jsonl
from odyssey_megatron.runtime.checkpoint import load_checkpoint
from odyssey_megatron.runtime.checkpoint_index import latest_checkpoint
from odyssey_megatron.runtime.control.checkpoint_following import CheckpointFollowing
from odyssey_megatron.runtime.control.run_record import RunRecord
from odyssey_megatron.runtime.protocol.keys import checkpoint_parts_key
from odyssey_megatron.runtime.rank.checkpoint_writer import CheckpointWriter
from odyssey_megatron.snapshot.shards import owners, shard_blocks

pytestmark = pytest.mark.timeout(120)

RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "llama2_7b" / "tiny_cpu.yaml"
CPU = select_accelerator("cpu")


class Job:
    """The tiny recipe's job on one store: every worker's writer, and the owner's following
    (its run state as ``CheckpointFollowing`` reads it: plan, committed steps, store, record)."""

    def __init__(self, run_dir: Path):
        private_directory(run_dir)
        self.config = load_config(RECIPE, ["odyssey.checkpoint_interval=2"])
        self.center = DecisionCenter.from_recipe(self.config)
        self.store = dist.HashStore()
        self.owned = owners(self.center.plan, self.config.model)
        self.writers = {w: CheckpointWriter(run_dir, rank=w, tp_rank=0, tp_size=1, model=self.config.model,
                                            store=self.store, host_buffer=CPU.host_buffer,
                                            synchronize=CPU.synchronize)
                        for w in sorted(set(self.owned.values()))}
        self.record = RunRecord(run_dir)
        self.run = SimpleNamespace(config=self.config, plan=self.center.plan, settled=True, committed=0,
                                   first_step=0, start_steps={0: 0}, store=self.store, run_dir=run_dir,
                                   center=self.center, controller=SimpleNamespace(record=self.record))
        self.following = CheckpointFollowing(self.run)
        self.state = TrainingState.initial(self.config.model, StageSpec((0, self.config.model.num_layers),
                                                                        first=True, last=True),
                                           seed=3, tp_rank=0, tp_size=1)

    def checkpoint(self, step: int) -> None:
        """Every writer starts its part of ``step``'s checkpoint, then training 'steps' on."""
        for block in self.state.blocks.values():
            block.step = step
        for worker, writer in self.writers.items():
            writer.start(self.state, shard_blocks(self.owned, worker), step=step, generation=0)
        for tensor in (t for b in self.state.held() for t in self.state.export(b).values() if t.is_floating_point()):
            tensor.add_(1.0)  # the optimizer step after the copy, while the writes run

    def written(self, step: int) -> None:
        for writer in self.writers.values():
            writer.wait()
        self.run.committed = step + 1
        self.following.collect()


def test_a_background_checkpoint_holds_the_blocks_as_the_step_started_and_is_marked_once_all_parts_are_in(
        tmp_path):
    job = Job(tmp_path / "run")
    before = {b: {k: t.clone() for k, t in job.state.export(b).items()} for b in job.state.held()}
    job.checkpoint(2)
    job.written(2)
    assert job.store.add(checkpoint_parts_key(0, 2), 0) == len(job.writers) == 8
    step, directory = latest_checkpoint(tmp_path / "run")
    assert (step, directory.name) == (2, "step-2")
    job.record.flush()  # the record writes from a thread of its own
    assert [e["step"] for e in read_jsonl(tmp_path / "run" / "events.jsonl", key="events")
            if e["event"] == "checkpoint"] == [2]
    model = job.config.model
    loaded = load_checkpoint(directory, run_dir=tmp_path / "run", model=model,
                             stage=StageSpec((0, model.num_layers), first=True, last=True), tp_rank=0, tp_size=1,
                             device=torch.device("cpu"))
    assert loaded.held() == model_blocks(model)
    for block in loaded.held():
        got = loaded.export(block)
        assert all(torch.equal(got[k], before[block][k]) for k in got if got[k].is_floating_point())  # not +1


def test_a_write_cut_short_leaves_the_checkpoint_before_it_the_latest(tmp_path, monkeypatch):
    job = Job(tmp_path / "run")
    job.checkpoint(2)
    job.written(2)
    real_save, calls = checkpoint.write_tensors, []

    def disk_full_on_the_third_part(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise OSError(28, "No space left on device")
        real_save(*args, **kwargs)

    monkeypatch.setattr(checkpoint, "write_tensors", disk_full_on_the_third_part)
    job.checkpoint(4)
    job.written(4)
    assert len(calls) == 8 and job.store.add(checkpoint_parts_key(0, 4), 0) == 7  # seven parts are in
    assert latest_checkpoint(tmp_path / "run")[0] == 2
    marker = (tmp_path / "run" / "checkpoint" / "latest.json").read_text()
    assert '"step": 2' in marker
    job.record.flush()  # the record writes from a thread of its own
    assert [e["step"] for e in read_jsonl(tmp_path / "run" / "events.jsonl", key="events")
            if e["event"] == "checkpoint"] == [2]
