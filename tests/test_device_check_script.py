"""``scripts/device_check.sh --dry-run``: lists what the device check would run and exits 0
on a CPU machine, installing nothing (no venv made, no pip run); the NCCL shrink check says
why it is skipped there."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from odyssey_megatron.device_check import CHECKS, main

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.timeout(60)
def test_the_dry_run_lists_every_check_and_installs_nothing(tmp_path):
    venv = tmp_path / "venv"
    env = {**os.environ, "VENV": str(venv), "PYTHON": sys.executable, "PYTHONPATH": str(REPO)}
    done = subprocess.run(["bash", str(REPO / "scripts" / "device_check.sh"), "--dry-run"], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=50)
    assert done.returncode == 0, done.stderr
    lines = [json.loads(line) for line in done.stdout.splitlines()]
    assert [line["check"] for line in lines] == list(CHECKS)
    assert all(line["would_check"] for line in lines)
    assert not venv.exists()  # the dry run made no venv, so installed nothing into one


def test_the_nccl_shrink_check_is_one_json_line_skipped_with_its_reason_on_a_machine_without_two_gpus(capsys):
    assert main(["--only", "nccl_shrink"]) == 0
    [line] = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert (line["check"], line["status"]) == ("nccl_shrink", "skipped") and line["reason"].endswith("NCCL needs two")
