"""One controller per run directory: node 0's ``odyssey train`` holds an exclusive lock on
``RUN_DIR/controller.lock`` for as long as it controls the run, so a second controller of
the same run (a requeued ``odyssey train --resume`` while a node 0 cut off from the
cluster still runs, or the same resume started twice) refuses to write the directory
instead of both writing its records and checkpoints.

The lock is ``flock(2)``: the kernel drops it when the process holding it dies, however it
dies, so a crashed controller never blocks its resume and there is no stale lock to clean
up. The file says who holds it (pid, host, since when), for the refusal to name. On a
shared file system the lock must reach across hosts: NFS maps ``flock`` to a lock on the
server (NFSv4, or v3 with its lock daemon); Lustre needs its ``flock`` mount option, or
each host sees only its own locks.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from pathlib import Path

from odyssey_megatron.errors import ConfigError

__all__ = ["LOCK_FILE", "RunDirLock"]

LOCK_FILE = "controller.lock"


class RunDirLock:
    """The lock on one run directory, held from ``take`` until ``release`` (or the process's
    end). A context manager: ``with RunDirLock.take(run_dir): ...``."""

    def __init__(self, path: Path, descriptor: int):
        self.path, self._descriptor = path, descriptor

    @classmethod
    def take(cls, run_dir: Path) -> "RunDirLock":
        """Lock ``run_dir`` (which exists) for this process, or ConfigError naming the
        directory and the controller that holds it."""
        path = Path(run_dir) / LOCK_FILE
        descriptor = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder(descriptor)
            os.close(descriptor)
            raise ConfigError(str(run_dir), f"is in use by another odyssey train controller ({holder}); two "
                                             "controllers of one run would both write it: stop that one, or wait "
                                             "for it to end") from None
        except BaseException:
            os.close(descriptor)
            raise
        os.ftruncate(descriptor, 0)
        os.pwrite(descriptor, json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                                          "since": time.strftime("%Y-%m-%d %H:%M:%S")}).encode(), 0)
        return cls(path, descriptor)

    def release(self) -> None:
        """Let another controller take the directory (idempotent)."""
        if self._descriptor >= 0:
            os.close(self._descriptor)  # closing the last descriptor drops the lock
            self._descriptor = -1

    def __enter__(self) -> "RunDirLock":
        return self

    def __exit__(self, *exc_info) -> None:
        self.release()


def _holder(descriptor: int) -> str:
    """Who holds the lock, as its file says (it may not have written it yet)."""
    try:
        holder = json.loads(os.pread(descriptor, 4096, 0))
        return f"pid {holder['pid']} on {holder['host']}, since {holder['since']}"
    except (ValueError, KeyError, TypeError):
        return "a process that has not said who it is yet"
