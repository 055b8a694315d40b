"""What a crash or a power cut leaves of a training run's files: JSONL records up to a torn
last line (skipped by every reader, cut off by the next append, dropped by ``--resume``),
whole files only (``final.pt``, rewritten JSONL), checkpoints and ``latest.json`` fsynced
with the directories that list them, and a run directory only its owner may enter."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest
import torch

from odyssey_megatron.config import ModelConfig
from odyssey_megatron.errors import ConfigError
from odyssey_megatron.blocks import StageSpec, stage_blocks
from odyssey_megatron.hooks.training_state import TrainingState, empty_block
from odyssey_megatron.run_dir import append_jsonl, private_directory, read_jsonl
from odyssey_megatron.runtime.checkpoint import load_checkpoint, save_part
from odyssey_megatron.runtime.checkpoint_index import latest_checkpoint, mark_latest
from odyssey_megatron.runtime.control.training_run import forget_steps_from
from odyssey_megatron.runtime.final_model import FINAL_MODEL, merge_final_parts

pytestmark = pytest.mark.timeout(60)

TORN = '{"step": 3, "generation": 0, "sam'


def write_lines(path: Path, *lines: str) -> Path:
    path.write_text("".join(lines))
    return path


def step_line(step: int) -> str:
    return json.dumps({"step": step, "generation": 0, "samples": [step]}) + "\n"


def test_a_torn_last_line_of_samples_is_dropped_on_resume(tmp_path):
    samples = write_lines(tmp_path / "samples.jsonl", step_line(0), step_line(1), step_line(2), TORN)
    forget_steps_from(samples, 2)
    assert samples.read_text() == step_line(0) + step_line(1)
    assert [p.name for p in tmp_path.iterdir()] == ["samples.jsonl"]  # rewritten through a temporary, now gone


def test_a_reader_skips_a_torn_last_line_but_not_a_torn_middle_line(tmp_path):
    events = write_lines(tmp_path / "events.jsonl", step_line(0), step_line(1), TORN)
    assert [r["step"] for r in read_jsonl(events, key="RUN_DIR")] == [0, 1]
    write_lines(events, step_line(0), TORN + "\n", step_line(1))  # a line in the middle cut short: corruption
    with pytest.raises(ConfigError, match="events.jsonl line 2 is not JSON .*damaged"):
        read_jsonl(events, key="RUN_DIR")


def test_an_append_after_a_torn_line_starts_a_line_of_its_own(tmp_path):
    events = write_lines(tmp_path / "events.jsonl", step_line(0), TORN)
    append_jsonl(events, {"step": 1, "generation": 0, "samples": [1]})
    assert events.read_text() == step_line(0) + step_line(1)
    no_newline_at_all = write_lines(tmp_path / "other.jsonl", TORN)
    append_jsonl(no_newline_at_all, {"step": 0, "generation": 0, "samples": [0]})
    assert no_newline_at_all.read_text() == step_line(0)


@pytest.mark.parametrize("earlier", [b"the earlier final.pt", None])
def test_final_pt_is_the_earlier_file_or_none_when_writing_it_fails(tmp_path, monkeypatch, earlier):
    (tmp_path / "final").mkdir()
    torch.save({"tp_rank": 0, "tp_size": 1, "params": {"embedding.word_embeddings.weight": torch.ones(4, 2)}},
               tmp_path / "final" / "rank0.pt")
    if earlier is not None:
        (tmp_path / FINAL_MODEL).write_bytes(earlier)

    def save_half(value, out):
        out.write(b"half a state dict")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(torch, "save", save_half)
    with pytest.raises(OSError, match="No space left"):
        merge_final_parts(tmp_path, ranks=[0], tied=False)
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left == (["final", FINAL_MODEL] if earlier is not None else ["final"])  # no temporary left behind
    if earlier is not None:
        assert (tmp_path / FINAL_MODEL).read_bytes() == earlier


def test_a_new_run_directory_is_private_and_an_existing_one_made_so(tmp_path):
    private_directory(tmp_path / "runs" / "run")
    assert stat.S_IMODE((tmp_path / "runs" / "run").stat().st_mode) == 0o700
    (tmp_path / "shared").mkdir(mode=0o775)
    private_directory(tmp_path / "shared")
    assert stat.S_IMODE((tmp_path / "shared").stat().st_mode) == 0o700


def test_a_checkpoint_and_latest_json_are_fsynced_with_their_directories(tmp_path, monkeypatch):
    model = ModelConfig(num_layers=1, hidden_size=8, ffn_hidden_size=16, num_attention_heads=2, num_query_groups=1,
                        vocab_size=16, seq_length=4, params_dtype="fp32")
    stage = StageSpec((0, 1), first=True, last=True)
    state = TrainingState()
    for block in stage_blocks(stage, tied=model.tie_embeddings):
        tensors = empty_block(model, block, tp_size=1, device=torch.device("cpu"))
        state.receive(block, {key: torch.rand(t.shape) if t.is_floating_point() else torch.tensor(2)
                              for key, t in tensors.items()})
    synced, fsync = [], os.fsync

    def recording_fsync(descriptor):
        synced.append(Path(os.readlink(f"/proc/self/fd/{descriptor}")))
        fsync(descriptor)

    monkeypatch.setattr(os, "fsync", recording_fsync)
    save_part(tmp_path, state, state.held(), step=2, rank=0, tp_rank=0, tp_size=1, model=model)
    mark_latest(tmp_path, 2)
    checkpoints, step_dir = tmp_path / "checkpoint", tmp_path / "checkpoint" / "step-2"
    part = step_dir / "rank-0"
    assert {p for p in synced if p.parent == part} == {part / "__0_0.distcp", part / ".metadata.tmp"}
    manifest = [n for n, p in enumerate(synced) if p.parent == step_dir and p.name.startswith(".rank-0.json.")]
    assert len(manifest) == 1 and synced.index(part) < manifest[0]  # the part is durable before its manifest
    latest = [n for n, p in enumerate(synced) if p.parent == checkpoints and p.name.startswith(".latest.json.")]
    directories = [synced.index(d, manifest[0]) for d in (step_dir, checkpoints, tmp_path)]
    assert len(latest) == 1 and max(directories) < latest[0] < synced.index(checkpoints, latest[0])
    # the files are durable before latest.json names them, and its rename after it
    assert latest_checkpoint(tmp_path) == (2, step_dir)
    loaded = load_checkpoint(step_dir, run_dir=tmp_path, model=model, stage=stage, tp_rank=0, tp_size=1,
                             device=torch.device("cpu"))
    for block in state.held():
        assert all(torch.equal(a, b) for a, b in zip(state.export(block).values(), loaded.export(block).values()))
