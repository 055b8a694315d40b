"""Authenticated store values: every value the runtime writes to a store carries an
HMAC-SHA256 tag under the run's secret, and every read checks it before anything acts on
the value. A client that can reach a store's port but lacks the secret (any process on a
node can reach its launcher's loopback store; the controller's listens on the network)
can still write there, but what it writes is refused: never a step decision, a plan, a
stop order, an abort, a kill order or a failure report the run acts on.

Why values and not connections: a TCPStore client handshakes in C++ before Python could
present credentials, the server takes no Unix socket, ``list_keys`` shows every key to
any client (a secret key name hides nothing), and a Python relay in front of the store
costs 277-964 us a request against 20-120 us direct. A tag costs microseconds
(``benchmarks/store_auth.py``).

The tag covers the key with the value, so a value copied to another key (a decision of
step 3 set as step 4's) is refused too. ``SignedStore`` wraps a store and does both sides:
writes are signed, and reads treat a value without a valid tag as absent, logging it once
per key with a one-line reason: ``check`` is False, ``wait`` and ``get`` go on waiting
for the real value (a forged decision never ends a wait as if it were the real one) until
the store's timeout (``DistStoreError``, which callers take as a late answer),
``multi_get`` gives None in its place, ``compare_set`` replaces one where the key should
be absent (and returns None where a forged value stays), and ``queue_pop`` raises ``ForgedValue`` (a ``ProtocolError``: the message is
dropped). Appended values (step reports) are lines, each tagged: a read drops the forged
lines and keeps the rest.

What is not authenticated, and why that is safe enough:
- counters (``add``: arrivals, readiness, step counters, snapshot and checkpoint parts):
  an atomic add carries no value to tag. A forged add can complete or spoil a count (a
  step decided before its last rank counted in, a rendezvous started early); each
  decision it triggers is still written, signed, by a process of the run;
- the keys torch itself writes for a generation's collective rendezvous (gloo's
  ``PrefixStore`` under ``process_group_prefix``, through ``SignedStore.unsigned``):
  forging them can only disrupt a rendezvous, a denial of service the collective guard
  times out, not make a rank act on something that did not happen;
- replays of a value the run itself wrote under the same key (an old heartbeat, an inbox
  message pushed again), and, since ``--resume`` reuses the secret, values recorded from
  an earlier start of the same run; generation-stamped keys and the detector's checks
  (pids, generations) make most such replays stale;
- anything else a store client can always do: delete keys, pop queues, flood the store
  (denial of service, which heartbeats and timeouts turn into a failure, never a wrong step).

The secret is 32 random bytes, as hex: ``run-secret`` (0600) in the run directory,
created by the controller at the run's first start and reused on ``--resume``. A launcher
of another node reads it from its ``--run-dir`` (a shared filesystem), or from
``ODYSSEY_RUN_SECRET`` where nodes share none. Workers get it from their launcher in
``WorkerLaunch``, through the fork server's pipe, never in argv.
"""

from __future__ import annotations

import datetime
import hashlib
import hmac
import logging
import os
import secrets
import stat
import threading
import time
from pathlib import Path
from typing import Any, Mapping, Optional

from odyssey_megatron.errors import ConfigError
from odyssey_megatron.runtime.protocol.messages import ProtocolError

__all__ = ["SECRET_ENV", "SECRET_FILE", "ForgedValue", "SignedStore", "Signer", "connect_signed",
           "controller_secret", "launcher_secret", "read_secret"]

SECRET_FILE = "run-secret"
"""In the run directory: the run's secret, 64 hex digits, readable by its owner alone."""
SECRET_ENV = "ODYSSEY_RUN_SECRET"
"""Where a node that shares no filesystem with node 0 finds the secret (the file's text)."""
_SECRET_BYTES = 32
_WHOLE, _LINE = b"S", b"A"
"""The first byte of a value ``set`` whole, and of each line ``append``ed."""
_TAG = 64
"""Hex digits of a tag (HMAC-SHA256)."""
_PAUSE_S = 0.01
"""How often a wait that found a forged value looks again for the real one."""

log = logging.getLogger(__name__)


class ForgedValue(ProtocolError):
    """A value without a valid tag under the run's secret."""


def controller_secret(run_dir: Path) -> bytes:
    """The run's secret: created in ``run_dir`` (0600) at the run's first start, read back
    on every later start (``--resume``)."""
    path = Path(run_dir) / SECRET_FILE
    try:
        descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    except FileExistsError:
        return read_secret(path)
    text = secrets.token_hex(_SECRET_BYTES)
    try:
        os.write(descriptor, text.encode())
        os.fsync(descriptor)
    finally:
        os.close(descriptor)
    return bytes.fromhex(text)


def read_secret(path: Path) -> bytes:
    """The secret in ``path``; ConfigError if another user could read or write it, or it is
    not one."""
    status = os.stat(path)
    if status.st_uid != os.getuid() or status.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise ConfigError(str(path), f"must be yours and readable by you alone (mode "
                                     f"{stat.S_IMODE(status.st_mode):04o}, uid {status.st_uid}): it holds the run's "
                                     f"secret; chmod 600 {path}")
    return _parse(path.read_text().strip(), source=str(path))


def launcher_secret(run_dir: Path, environ: Mapping[str, str], *, wait_s: float) -> bytes:
    """A launcher's secret (not node 0's): ``run_dir``'s ``run-secret`` if it is there,
    else ``ODYSSEY_RUN_SECRET``; where neither is, the file is waited for up to ``wait_s``
    (node 0 may not have started yet), then ConfigError naming both."""
    path = Path(run_dir) / SECRET_FILE
    deadline = time.monotonic() + wait_s
    while True:
        if path.is_file():
            return read_secret(path)
        if environ.get(SECRET_ENV):
            return _parse(environ[SECRET_ENV].strip(), source=SECRET_ENV)
        if time.monotonic() >= deadline:
            raise ConfigError("--run-dir", f"no run secret: {path} does not exist after {wait_s:g} s and "
                                           f"{SECRET_ENV} is not set; give node 0's --run-dir (a shared "
                                           f"filesystem) or set {SECRET_ENV} to the text of its {SECRET_FILE}")
        time.sleep(0.1)


def _parse(text: str, *, source: str) -> bytes:
    try:
        secret = bytes.fromhex(text)
    except ValueError:
        secret = b""
    if len(secret) != _SECRET_BYTES:
        raise ConfigError(source, f"must be {2 * _SECRET_BYTES} hex digits (a run's {SECRET_FILE}); got "
                                  f"{len(text)} characters")
    return secret


class Signer:
    """Tags and checks values under one run's secret; logs each key's first refusal."""

    def __init__(self, secret: bytes):
        self._secret = secret
        self._refused: set[str] = set()
        self._lock = threading.Lock()

    def _tag(self, key: str, payload: bytes) -> bytes:
        return hmac.new(self._secret, key.encode() + b"\0" + payload, hashlib.sha256).hexdigest().encode()

    def sign(self, key: str, value: str | bytes) -> bytes:
        """``value`` as ``key`` holds it: tagged for that key."""
        payload = _as_bytes(value)
        return _WHOLE + self._tag(key, payload) + payload

    def sign_lines(self, key: str, value: str | bytes) -> bytes:
        """``value`` (lines, each ending in a newline) to append under ``key``, each line tagged."""
        lines = _as_bytes(value).splitlines(keepends=True)
        return b"".join(_LINE + self._tag(key, line) + line for line in lines)

    def open(self, key: str, stored: bytes) -> Optional[bytes]:
        """What ``key`` holds without its tags: the value, or the lines with a valid tag
        (appended values); None for a value without one."""
        if stored[:1] == _LINE:
            lines = stored.splitlines(keepends=True)
            kept = [line[1 + _TAG:] for line in lines if self._valid(key, line[1 + _TAG:], line[1:1 + _TAG])]
            if len(kept) < len(lines):
                self._refuse(key, f"{len(lines) - len(kept)} of its {len(lines)} lines")
            return b"".join(kept)
        payload = stored[1 + _TAG:]
        if stored[:1] == _WHOLE and self._valid(key, payload, stored[1:1 + _TAG]):
            return payload
        self._refuse(key, "its value")
        return None

    def _valid(self, key: str, payload: bytes, tag: bytes) -> bool:
        return hmac.compare_digest(self._tag(key, payload), tag)

    def _refuse(self, key: str, what: str) -> None:
        with self._lock:
            if key in self._refused:
                return
            self._refused.add(key)
        log.warning("store key %s: refused %s: no valid tag under this run's secret (written by a client without "
                    "it, or this process holds another run's secret)", key, what)


def _as_bytes(value: str | bytes) -> bytes:
    return value if isinstance(value, bytes) else value.encode()


class SignedStore:
    """``store`` (a ``dist.Store``, or anything with its calls) with every value signed on
    the way in and checked on the way out, as the module docstring says. Counters pass
    as they are."""

    def __init__(self, store: Any, signer: Signer):
        self._store, self.signer = store, signer

    @property
    def unsigned(self) -> Any:
        """The store itself, for torch's own rendezvous keys (see the module docstring)."""
        return self._store

    def clone(self) -> "SignedStore":
        return SignedStore(self._store.clone(), self.signer)

    # -- writes

    def set(self, key: str, value: str | bytes) -> None:
        self._store.set(key, self.signer.sign(key, value))

    def multi_set(self, keys: list[str], values: list[str | bytes]) -> None:
        self._store.multi_set(keys, [self.signer.sign(k, v) for k, v in zip(keys, values)])

    def compare_set(self, key: str, expected: str | bytes, desired: str | bytes) -> Optional[bytes]:
        """As ``dist.Store.compare_set`` (an empty ``expected``: the key is absent): what
        ``key`` holds after it; None if that is a forged value."""
        signed_desired = self.signer.sign(key, desired)
        absent = not _as_bytes(expected)
        stored = self._store.compare_set(key, b"" if absent else self.signer.sign(key, expected), signed_desired)
        value = self.signer.open(key, stored)
        if value is None and absent:  # a forged value where none should be counts as none: replace it
            value = self.signer.open(key, self._store.compare_set(key, stored, signed_desired))
        return value

    def append(self, key: str, value: str | bytes) -> None:
        """Append ``value``: lines, each ending in a newline, each tagged apart."""
        self._store.append(key, self.signer.sign_lines(key, value))

    def queue_push(self, key: str, value: str | bytes) -> None:
        self._store.queue_push(key, self.signer.sign(key, value))

    # -- reads

    def get(self, key: str) -> bytes:
        """``key``'s value, waiting for it (as ``dist.Store.get``); a forged value is waited
        past until the real one replaces it, up to the store's timeout (``DistStoreError``)."""
        deadline = None
        while True:
            value = self.signer.open(key, self._store.get(key))
            if value is not None:
                return value
            deadline = deadline or time.monotonic() + self._timeout_s()
            if time.monotonic() >= deadline:
                _timed_out(f"store key {key} held a forged value for the store's timeout")
            time.sleep(_PAUSE_S)

    def multi_get(self, keys: list[str]) -> list[Optional[bytes]]:
        """Each key's value (waiting for it); None in place of a forged one."""
        return [self.signer.open(k, v) for k, v in zip(keys, self._store.multi_get(keys))]

    def check(self, keys: list[str]) -> bool:
        """Whether every key holds a value with a valid tag."""
        return self._store.check(keys) and all(v is not None for v in self.multi_get(keys))

    def exists(self, keys: list[str]) -> bool:
        """Whether every key holds a value, forged or not: for a read that follows and checks it."""
        return self._store.check(keys)

    def wait(self, keys: list[str], timeout: Optional[datetime.timedelta] = None) -> None:
        """Until every key holds a value with a valid tag (``timeout``: the store's if None)."""
        limit_s = self._timeout_s() if timeout is None else timeout.total_seconds()
        deadline = time.monotonic() + limit_s
        while True:
            left = datetime.timedelta(seconds=max(deadline - time.monotonic(), _PAUSE_S))
            if timeout is None:
                self._store.wait(keys)
            else:
                self._store.wait(keys, left)
            if self.check(keys):
                return
            if time.monotonic() >= deadline:
                _timed_out(f"store keys {keys} held a forged value for {limit_s:g} s")
            time.sleep(_PAUSE_S)

    def queue_pop(self, key: str, block: bool = True) -> bytes:
        """The next message queued under ``key``; ForgedValue for one without a valid tag."""
        value = self.signer.open(key, self._store.queue_pop(key, block=block))
        if value is None:
            raise ForgedValue(f"a message under {key} has no valid tag under this run's secret")
        return value

    # -- passed as they are

    def add(self, key: str, amount: int) -> int:
        return self._store.add(key, amount)

    def queue_len(self, key: str) -> int:
        return self._store.queue_len(key)

    def delete_key(self, key: str) -> bool:
        return self._store.delete_key(key)

    def num_keys(self) -> int:
        return self._store.num_keys()

    def set_timeout(self, timeout: datetime.timedelta) -> None:
        self._store.set_timeout(timeout)

    @property
    def timeout(self) -> datetime.timedelta:
        return self._store.timeout

    def _timeout_s(self) -> float:
        timeout = getattr(self._store, "timeout", None)
        return timeout.total_seconds() if timeout is not None else 0.0


def connect_signed(host: str, port: int, *, timeout: datetime.timedelta, signer: Signer) -> SignedStore:
    """A client of the store at ``host:port`` (its requests wait up to ``timeout``), every
    value signed and checked under ``signer``."""
    import torch.distributed as dist

    return SignedStore(dist.TCPStore(host, port, is_master=False, timeout=timeout), signer)


def _timed_out(why: str) -> None:
    import torch.distributed as dist

    raise dist.DistStoreError(why)
