"""Files that are loaded with pickle, loaded only if no other user could have written them.

Two loaders the plugin cannot change unpickle what they read, so whoever wrote the file
can run code in the run:

- ``torch.distributed.checkpoint`` reads a checkpoint's ``.metadata`` with ``pickle.load``
  (and would ``torch.load(weights_only=False)`` any non-tensor item it lists);
- Megatron's ``GPTDataset`` loads its cached indices with
  ``numpy.load(allow_pickle=True)``, which falls back to ``pickle.load`` for a file that
  is not ``.npy``.

Everything else a run reads is data without code: JSON, YAML, the IndexedDataset's
``.bin``/``.idx`` (memory-mapped), ``final/rank*.pt`` (``torch.load(weights_only=True)``).

``check_private`` refuses what another user could have written, the way ssh's
StrictModes does: the path, every directory from it up to the run or cache root, and
everything inside it must be owned by the current user and not writable by group or
others. A directory only its owner may enter (no group or other search permission, as a
training run directory is made) ends the walk: nothing under it can be reached, let
alone written, by anyone else, whatever the umask gave the files inside.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from odyssey_megatron.errors import ConfigError

__all__ = ["check_private"]

_WHY = "another user could put code in it, and it is loaded with pickle"


def check_private(path: Path, *, root: Path) -> None:
    """Check ``path`` (a file or a directory; the part of it that exists) and the
    directories between it and ``root``, ``root`` included, as the module docstring says.
    ConfigError naming the first path another user could have written."""
    root, target = Path(root).resolve(), Path(path).resolve()
    if not target.is_relative_to(root):
        raise ConfigError(str(path), f"lies outside {root}, where it was expected")
    depth = len(target.relative_to(root).parts)
    for entry in [*(target.parents[n] for n in reversed(range(depth))), target]:
        if not entry.exists() or _check_entry(entry):
            return
    for directory, subdirectories, files in os.walk(target):
        for name in files:
            _check_entry(Path(directory) / name)
        subdirectories[:] = [d for d in subdirectories if not _check_entry(Path(directory) / d)]


def _check_entry(path: Path) -> bool:
    """Check that ``path`` is the current user's and not writable by others; True if it
    is a directory no one else may enter, where the walk ends."""
    status = os.stat(path)
    if status.st_uid != os.getuid():
        raise ConfigError(str(path), f"is owned by uid {status.st_uid}, not by you (uid {os.getuid()}); {_WHY}")
    if stat.S_ISDIR(status.st_mode) and not status.st_mode & (stat.S_IXGRP | stat.S_IXOTH):
        return True
    if status.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise ConfigError(str(path), f"is writable by group or others (mode {stat.S_IMODE(status.st_mode):04o}); "
                                     f"{_WHY}: chmod go-w {path}")
    return False
