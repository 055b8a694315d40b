"""Files loaded with pickle (a DCP checkpoint, GPTDataset's index cache) are refused, with
one line naming the path, when another user could have written them; a directory only its
owner may enter vouches for everything under it."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from odyssey_megatron.cli import main
from odyssey_megatron.errors import ConfigError
from odyssey_megatron.file_trust import check_private
from odyssey_megatron.runtime.checkpoint import load_checkpoint
from odyssey_megatron.runtime.checkpoint_index import latest_checkpoint

pytestmark = pytest.mark.timeout(60)


def checkpoint_run(root: Path, *, run_mode: int = 0o755) -> tuple[Path, Path]:
    """A run directory with config.yaml and a checkpoint of step 2 that latest.json names."""
    run, step_dir = root / "run", root / "run" / "checkpoint" / "step-2"
    step_dir.mkdir(parents=True)
    (step_dir / ".metadata").write_bytes(b"a pickle")
    (run / "config.yaml").write_text("model: {}\n")
    (run / "checkpoint" / "latest.json").write_text(json.dumps({"step": 2, "path": "step-2"}))
    run.chmod(run_mode)
    return run, step_dir


def test_resuming_from_a_checkpoint_others_may_write_is_refused_in_one_line(tmp_path, capsys):
    run, step_dir = checkpoint_run(tmp_path)
    step_dir.chmod(0o757)
    assert main(["train", "--resume", str(run)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"odyssey: error: {step_dir}: is writable by group or others (mode 0757); ") and \
        err.count("\n") == 1, err


def test_a_private_run_directory_vouches_for_what_is_under_it(tmp_path):
    run, step_dir = checkpoint_run(tmp_path, run_mode=0o700)
    step_dir.chmod(0o757)
    (step_dir / ".metadata").chmod(0o666)  # as a umask of 000 leaves what DCP writes
    check_private(step_dir, root=run)


def test_a_writable_file_inside_and_a_foreign_owner_are_refused(tmp_path, monkeypatch):
    run, step_dir = checkpoint_run(tmp_path)
    check_private(step_dir, root=run)
    (step_dir / ".metadata").chmod(0o664)
    with pytest.raises(ConfigError, match=f"^{step_dir / '.metadata'}: is writable by group or others"):
        check_private(step_dir, root=run)
    (step_dir / ".metadata").chmod(0o644)
    uid = os.getuid()
    monkeypatch.setattr(os, "getuid", lambda: uid + 1)
    with pytest.raises(ConfigError, match=f"^{run}: is owned by uid {uid}, not by you"):
        check_private(step_dir, root=run)


def test_a_checkpoint_outside_its_run_directory_is_refused(tmp_path):
    run, _ = checkpoint_run(tmp_path)
    (tmp_path / "elsewhere").mkdir()
    (run / "checkpoint" / "latest.json").write_text(json.dumps({"step": 2, "path": "../../elsewhere"}))
    with pytest.raises(ConfigError, match=f"lies outside {run}"):
        latest_checkpoint(run)


def test_a_worker_loading_a_checkpoint_others_made_writable_since_the_controller_looked_refuses_it(tmp_path):
    """A worker reads ``RunSpec.resume`` itself, later and maybe on another node: it checks
    the checkpoint as the controller did, before DCP unpickles anything of it."""
    from odyssey_megatron.blocks import StageSpec
    from odyssey_megatron.config import ModelConfig

    run, step_dir = checkpoint_run(tmp_path)
    assert latest_checkpoint(run) == (2, step_dir)
    (step_dir / ".metadata").chmod(0o666)
    model = ModelConfig(num_layers=1, hidden_size=8, ffn_hidden_size=16, num_attention_heads=2, num_query_groups=1,
                        vocab_size=16, seq_length=4, params_dtype="fp32")
    with pytest.raises(ConfigError, match=f"^{step_dir / '.metadata'}: is writable by group or others"):
        load_checkpoint(step_dir, run_dir=run, model=model, stage=StageSpec((0, 1), first=True, last=True),
                        tp_rank=0, tp_size=1, device=torch.device("cpu"))
