import os
import sys
from pathlib import Path

import pytest
from hypothesis import settings

sys.path.insert(0, str(Path(__file__).parent))

# CI replays the same examples every run, so a red CI is always reproducible; local runs
# keep drawing new examples to find new cases.
settings.register_profile("ci", derandomize=True, print_blob=True)
if os.environ.get("CI"):
    settings.load_profile("ci")


@pytest.fixture
def one_rank_group():
    """A world of this test process alone (gloo), for what a collective save needs."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


SERIAL_FILES = (
    "test_train.py", "test_control.py",  # live runs: controllers, launchers, workers
    "test_block_transfer.py", "test_collective_guard.py", "test_emulation.py", "test_fault_injection.py",
    "test_missed_beat.py", "test_profiler.py", "test_rendezvous_store.py", "test_runtime_equivalence.py",
    "test_snapshot_keeper.py", "test_store_server.py",  # processes judged by timeouts or measured against the clock
)
"""Files whose tests start processes and judge them by the clock: they run one after
another on one pytest-xdist worker (the README's test command runs two), so no two of
them load the machine at once; the other worker runs the rest, which only computes."""


def pytest_collection_modifyitems(config, items):
    """Under ``--dist loadgroup``: the serial files form one group, every other file a
    group of its own (its module fixtures are built once)."""
    for item in items:
        group = "serial" if item.path.name in SERIAL_FILES else item.path.stem
        item.add_marker(pytest.mark.xdist_group(group))


_misnamed = [name for name in SERIAL_FILES if not (Path(__file__).parent / name).is_file()]
if _misnamed:  # a typo would let a clock-judged file run beside the live runs
    raise RuntimeError(f"tests/conftest.py SERIAL_FILES names no such file: {_misnamed}")
