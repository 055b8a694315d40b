"""One controller per run directory (``run_lock``): a second ``odyssey train`` of the same
run refuses, in one line naming the directory and the controller that holds it, and a
controller killed by SIGKILL leaves nothing that blocks its resume. Controllers are real
processes here: ``python -c`` children that take the lock and wait."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from odyssey_megatron.config import load_config
from odyssey_megatron.errors import ConfigError
from odyssey_megatron.run_dir import private_directory
from odyssey_megatron.run_lock import RunDirLock
from odyssey_megatron.runtime.control.launch_config import LaunchConfig

pytestmark = pytest.mark.timeout(60)

REPO = Path(__file__).resolve().parents[1]


def holding_controller(run_dir: Path) -> subprocess.Popen:
    """A process that takes ``run_dir``'s lock, says so, and waits to be killed."""
    code = textwrap.dedent(f"""
        import time
        from odyssey_megatron.run_lock import RunDirLock
        lock = RunDirLock.take({str(run_dir)!r})
        print("held", flush=True)
        time.sleep(60)
    """)
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.stdout.readline() == "held\n"
    return proc


def test_a_second_controller_is_refused_naming_the_directory_and_the_holder_until_the_first_dies(tmp_path):
    run_dir = tmp_path / "run"
    private_directory(run_dir)
    first = holding_controller(run_dir)
    try:
        with pytest.raises(ConfigError) as refused:
            RunDirLock.take(run_dir)
        message = str(refused.value)
        assert message.startswith(f"{run_dir}: is in use by another odyssey train controller (pid {first.pid} on ")
        assert "\n" not in message
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait()
    with RunDirLock.take(run_dir):  # the kernel dropped the dead controller's lock
        with pytest.raises(ConfigError, match=f"pid {os.getpid()} on "):
            RunDirLock.take(run_dir)  # held by this process now: a second take in it is refused too
    RunDirLock.take(run_dir).release()  # and released on leaving


def test_train_on_node_0_takes_the_lock_before_writing_the_run_directory(tmp_path):
    """A requeued ``--resume`` while the first controller still runs writes nothing there."""
    from odyssey_megatron.runtime.train import train_node

    run_dir = tmp_path / "run"
    private_directory(run_dir)
    first = holding_controller(run_dir)
    try:
        before = sorted(path.name for path in run_dir.iterdir())
        config = load_config(REPO / "recipes" / "llama2_7b" / "tiny_cpu.yaml")
        with pytest.raises(ConfigError, match=f"^{run_dir}: is in use by another odyssey train controller "
                                              f"\\(pid {first.pid} on "):
            train_node(config, LaunchConfig(), run_dir=run_dir)
        assert sorted(path.name for path in run_dir.iterdir()) == before
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait()
