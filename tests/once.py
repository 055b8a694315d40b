"""A fixture's build shared by every pytest-xdist worker.

Each xdist worker is a pytest session of its own, so a module fixture that tests on both
workers use (the failure-free reference run, the run through five failures) was built on
both: two more 8-rank ``odyssey train`` runs, each competing with the other worker's tests
for the machine's 2 cores. Built here, under a file lock in the workers' common base
directory, it is built by the first worker that needs it and read by the other."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any, Callable

import pytest
from filelock import FileLock


def built_once(tmp_path_factory: pytest.TempPathFactory, name: str, build: Callable[[Path], Any]) -> Any:
    """``build(directory)``'s JSON value, computed by the first worker to ask for ``name``
    in a directory of its own, and read back by every later one. A build that raised
    leaves no value: the next worker to ask builds it afresh (and fails the same way)."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # popen-gw<N>'s parent: the base directory of this pytest run
    directory, value = root / f"once-{name}", root / f"once-{name}.json"
    with FileLock(root / f"once-{name}.lock"):
        if value.is_file():
            return json.loads(value.read_text())
        shutil.rmtree(directory, ignore_errors=True)  # what a build that raised left
        directory.mkdir()
        result = build(directory)
        value.write_text(json.dumps(result))
        return result
