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


LONG_FILES = ("test_train.py", "test_control.py", "test_benchmarks.py")
"""Files whose tests take half a minute to three minutes each (live runs: controllers,
launchers, workers; the benchmarks' smoke runs), where the others take seconds. The
README's test command runs two pytest-xdist workers, each taking the next test as it frees
up; these go first, so that the suite ends on short tests on both workers, not on one
worker idle while the other finishes a long run. Live runs thus go on two at a time, or
beside computing tests: their timeouts are sized for that load."""


def pytest_collection_modifyitems(config, items):
    items.sort(key=lambda item: item.path.name not in LONG_FILES)  # stable: each file's own order stays


_misnamed = [name for name in LONG_FILES if not (Path(__file__).parent / name).is_file()]
if _misnamed:  # a typo would silently send those tests last
    raise RuntimeError(f"tests/conftest.py LONG_FILES names no such file: {_misnamed}")
