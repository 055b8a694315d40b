"""Where a run's results land: checked before the run starts, written whole at the end.

``RunDir.prepare`` runs before any work: it settles the destination and creates a staging
directory beside it, so an unwritable or mistyped location fails at once instead of after
hours of simulation. Results go into the staging directory and ``commit`` renames it into
place (same file system, so atomic): the destination holds a complete result or nothing,
and ``discard`` leaves no trace. An existing run directory is never overwritten silently:
a default name moves on to a fresh one (``-2``, ``-3``, ...), an explicit one is refused
unless ``force`` is given and it holds an earlier run.

A live run also writes files while it runs, for operators, tests and ``--resume`` to read:
``write_atomically`` (and ``write_text``, ``write_json``, ``write_jsonl``) replaces a file through a temporary
beside it, so a reader never sees half of it, and ``append_jsonl`` adds one record per
line. Both fsync the file and, where an entry was made, its directory before returning: a
record written is still there after a power cut, and what a crash leaves is the old file,
the new one, or the records before a torn last line, which ``read_jsonl`` skips.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, Callable, Iterable

from odyssey_megatron.errors import ConfigError

__all__ = ["RUN_MARKER", "RunDir", "append_jsonl", "fsync_directory", "private_directory", "read_jsonl",
           "write_atomically", "write_json", "write_jsonl", "write_text"]

RUN_MARKER = "summary.json"
"""The file every finished run holds; ``force`` replaces only directories that have it."""
_MAX_FRESH_NAMES = 10_000
_CHUNK = 1 << 16
"""Bytes read at a time when looking back for the start of a torn line."""

log = logging.getLogger(__name__)


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


def private_directory(path: Path) -> None:
    """Create ``path`` (and missing parents) with only its owner allowed in, or make an
    existing one so: a training run directory holds checkpoints, which are loaded with
    pickle (see ``file_trust``)."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    path.chmod(0o700)


def fsync_directory(path: Path) -> None:
    """Make the entries of directory ``path`` (files created, renamed or removed) durable."""
    descriptor = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def write_atomically(path: Path, write: Callable[[BinaryIO], None]) -> None:
    """Replace ``path`` with what ``write`` writes to a binary file: through a temporary
    beside it (made for its owner alone, and so ``path`` is), fsynced, renamed over
    ``path``, the directory fsynced. If ``write`` fails, ``path`` is as it was and the
    temporary is gone."""
    path = Path(path)
    descriptor, temporary = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(descriptor, "wb") as out:
            write(out)
            out.flush()
            os.fsync(out.fileno())
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
    fsync_directory(path.parent)


def write_text(path: Path, text: str) -> None:
    """Replace ``path`` with ``text`` in UTF-8 (``write_atomically``)."""
    write_atomically(path, lambda out: out.write(text.encode()))


def write_json(path: Path, value: Any) -> None:
    """Replace ``path`` with ``value`` as JSON (``write_atomically``)."""
    write_text(path, json.dumps(value, indent=2, allow_nan=False) + "\n")


def write_jsonl(path: Path, records: Iterable[dict[str, Any]]) -> None:
    """Replace ``path`` with ``records``, one JSON object a line (``write_atomically``)."""
    write_text(path, "".join(json.dumps(record, allow_nan=False) + "\n" for record in records))


def append_jsonl(path: Path, record: dict[str, Any]) -> None:
    """Append ``record`` as one line of JSON, fsynced (with the directory, if the file is new).
    A torn last line (a crash cut an earlier append short) is cut off first, so the new
    record starts a line of its own instead of making the torn one corrupt. One writer
    per file: a run's ``RunRecord`` and its owner each hold their own."""
    path = Path(path)
    line = (json.dumps(record, allow_nan=False) + "\n").encode()
    created = not path.exists()
    with path.open("a+b") as out:
        torn = _torn_tail(out)
        if torn is not None:
            log.warning("%s: cutting off a torn last line (%d bytes)", path, out.tell() - torn)
            out.truncate(torn)
        out.write(line)
        out.flush()
        os.fsync(out.fileno())
    if created:
        fsync_directory(path.parent)


def _torn_tail(out: BinaryIO) -> int | None:
    """Where a last line without its newline begins in ``out``, or None; leaves ``out`` at the end."""
    end = position = out.seek(0, os.SEEK_END)
    if end == 0:
        return None
    out.seek(end - 1)
    if out.read(1) == b"\n":
        return None
    while position > 0:
        start = max(0, position - _CHUNK)
        out.seek(start)
        newline = out.read(position - start).rfind(b"\n")
        if newline >= 0:
            position = start + newline + 1
            break
        position = start
    out.seek(end)
    return position


def read_jsonl(path: Path, *, key: str) -> list[dict]:
    """The records of a JSONL file ``append_jsonl`` wrote. A last line without its newline
    is an append a crash cut short (or one still being written) and is skipped; any other
    line that is not a JSON object means the file was damaged: ConfigError naming ``key``
    (the argument the file came from), the file and the line."""
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise ConfigError(key, f"{path} is not UTF-8 text; the run's records are damaged") from None
    except OSError as exc:
        raise ConfigError(key, f"cannot read {path}: {exc.strerror}") from None
    lines = text.split("\n")[:-1]  # the part after the last newline is torn (or empty)
    records = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ConfigError(key, f"{path} line {number} is not JSON ({exc.msg}); the run's records are damaged "
                                   "(only a torn last line is skipped)") from None
        if not isinstance(record, dict):
            raise ConfigError(key, f"{path} line {number} is not a JSON object; the run's records are damaged")
        records.append(record)
    return records
