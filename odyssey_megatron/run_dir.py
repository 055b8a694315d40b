"""Where a run's results land: checked before the run starts, written whole at the end.

``RunDir.prepare`` runs before any work: it settles the destination and creates a staging
directory beside it, so an unwritable or mistyped location fails at once instead of after
hours of simulation. Results go into the staging directory and ``commit`` renames it into
place (same file system, so atomic): the destination holds a complete result or nothing,
and ``discard`` leaves no trace. An existing run directory is never overwritten silently:
a default name moves on to a fresh one (``-2``, ``-3``, ...), an explicit one is refused
unless ``force`` is given and it holds an earlier run.

A live run also writes files while it runs, for operators and tests to read meanwhile:
``write_json`` replaces a file atomically (a reader never sees half of it) and
``append_jsonl`` adds one record per line, flushed at once.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from odyssey_megatron.errors import ConfigError

__all__ = ["RUN_MARKER", "RunDir", "append_jsonl", "write_json"]

RUN_MARKER = "summary.json"
"""The file every finished run holds; ``force`` replaces only directories that have it."""
_MAX_FRESH_NAMES = 10_000


def _umask() -> int:
    umask = os.umask(0)
    os.umask(umask)
    return umask


def _fresh(path: Path) -> Path:
    """``path`` if free, else the first free ``path-2``, ``path-3``, ..."""
    if not os.path.lexists(path):
        return path
    for n in range(2, _MAX_FRESH_NAMES):
        candidate = path.with_name(f"{path.name}-{n}")
        if not os.path.lexists(candidate):
            return candidate
    raise ConfigError("--out", f"{path} and {_MAX_FRESH_NAMES} numbered variants exist; give --out")


@dataclass
class RunDir:
    """A destination and the staging directory its results are written into first."""

    destination: Path
    staging: Path
    replace: bool
    """Whether ``destination`` exists and ``commit`` swaps it out (``force``, or an empty directory)."""
    created: list[Path] = field(default_factory=list)
    """Parent directories ``prepare`` made, removed again by ``discard``."""

    @classmethod
    def prepare(cls, path: str | Path, *, key: str, explicit: bool, force: bool) -> "RunDir":
        """Check ``path`` and stage a directory beside it; ``explicit``: the user named it."""
        path = Path(path)
        if path.name in ("", ".", ".."):
            raise ConfigError(key, f"{path} does not name a directory of its own; give a new directory name")
        replace = False
        if os.path.lexists(path):
            if not path.is_dir() or path.is_symlink():
                raise ConfigError(key, f"{path} exists and is not a directory")
            if not explicit:
                path = _fresh(path)
            elif any(path.iterdir()):
                if not force:
                    raise ConfigError(key, f"{path} already holds files; give a new directory or --force to replace "
                                           "an earlier run")
                if not (path / RUN_MARKER).is_file():
                    raise ConfigError(key, f"{path} holds no earlier run ({RUN_MARKER} is missing); --force replaces "
                                           "only run directories")
                if Path.cwd().resolve().is_relative_to(path.resolve()):
                    raise ConfigError(key, f"{path} holds the working directory; --force will not replace it")
                replace = True
            else:
                replace = True
        parent, missing, created = path.parent, [], []
        while not os.path.lexists(parent):
            missing.append(parent)
            parent = parent.parent
        if not parent.is_dir():
            raise ConfigError(key, f"{parent} is not a directory, so {path} cannot be created")
        try:
            for directory in reversed(missing):
                directory.mkdir()
                created.append(directory)
            staging = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".partial", dir=path.parent))
            staging.chmod(0o777 & ~_umask())  # mkdtemp makes it private; a run directory is not
        except OSError as exc:
            for directory in reversed(created):
                directory.rmdir()
            raise ConfigError(key, f"cannot write in {path.parent}: {exc.strerror}") from None
        return cls(destination=path, staging=staging, replace=replace, created=created)

    def commit(self) -> Path:
        """Move the staged results into place; returns where they are."""
        if self.replace and self.destination.is_dir():
            old = Path(tempfile.mkdtemp(prefix=f".{self.destination.name}.", suffix=".old", dir=self.destination.parent))
            os.replace(self.destination, old)
            os.replace(self.staging, self.destination)
            shutil.rmtree(old)
        else:
            self.destination = _fresh(self.destination)
            os.replace(self.staging, self.destination)
        return self.destination

    def discard(self) -> None:
        """Remove the staging directory and any parents ``prepare`` created."""
        shutil.rmtree(self.staging, ignore_errors=True)
        for directory in reversed(self.created):
            try:
                directory.rmdir()
            except OSError:
                break


def write_json(path: Path, value: Any) -> None:
    """Replace ``path`` with ``value`` as JSON through a temporary file beside it."""
    temporary = path.with_name(f".{path.name}.tmp")
    temporary.write_text(json.dumps(value, indent=2, allow_nan=False) + "\n")
    os.replace(temporary, path)


def append_jsonl(path: Path, record: dict[str, Any]) -> None:
    """Append ``record`` as one line of JSON."""
    with path.open("a") as out:
        out.write(json.dumps(record, allow_nan=False) + "\n")
