"""Collectives a survivor can leave: once its generation is aborted, every wait on a
process group's work ends within milliseconds, with one typed error, ``PeerLost``.

On a cluster a node that freezes, loses power or drops off the network closes no socket,
so its peers' collectives wait until a timeout fires (on one machine a killed process's
sockets close at once, which is why only frozen nodes show this). The controller names
such a node from its missed heartbeats and aborts the generation; each worker's watching
thread then calls ``CollectiveGuard.abort``, and what that does depends on the backend:

- **gloo**: ``ProcessGroup.abort()`` and ``shutdown()`` return at once but do not end an
  operation in flight (checked on torch 2.13: an all-reduce with a SIGSTOPped peer waited
  out its whole timeout after both), and a point-to-point work can neither be polled
  (``is_completed`` stays False until waited) nor waited with a timeout (the timeout fails
  the receive). So a gloo work is waited on by a helper thread while the calling thread
  waits for that, looking at the abort flag every ``slice_s``. A gloo group is made without
  connecting its members (``prepare_backend``) and connected when the guard takes it in
  (``track``), by an all-to-all on the group's own threads, so that waiting for a member
  that never connects happens in an operation the guard leaves: made eagerly, a group
  waited in ``new_group`` itself, where nothing ends a wait, five group timeouts (gloo's
  ``Pair::waitUntil``: 150 s at a 30 s collective timeout) for a member that died having
  published its address, then failed with an error of its own. An abandoned operation
  still holds its group's sockets and threads (and its helper thread) until gloo ends it,
  and dropping the group's last reference before then blocks until it does: the guard
  keeps the generation's groups (the graveyard) until their operations have surely ended
  (``_LINGER_TIMEOUTS``).
- **NCCL and HCCL**: the communicators are aborted from the watching thread (a thread
  other than the one blocked in the collective, as nvidia-resiliency-ext's monitor does),
  which ends the kernels in flight; the watchdog is told to clean up rather than tear the
  process down (``TORCH_NCCL_ASYNC_ERROR_HANDLING``, ``NCCL_ERROR_HANDLING``).

Every wait is guarded because ``torch.distributed.Work.wait`` is: the synchronous
collectives of torch.distributed and Megatron-Core's point-to-point requests both wait
through it; and the functions that start operations (``isend``, ``all_reduce``, ...) are
wrapped too, since gloo raises at once when a pair's socket is already closed. So the
classification happens where the collective was called, for code the project does not
own too. A wait that outlasts ``timeout_s`` raises ``PeerLost`` with
``timed_out`` set, which the worker reports to the controller.

What an error means is read from what the guard knows and from the error's type: a
``torch.distributed.DistError`` (NCCL, the store) is a lost peer or group; an error that
ends an operation which has run the collective timeout by the guard's clock (from when
the operation started, which the guarded starters note) is a timeout, whatever its text
says; one that ends it sooner is a lost peer, also where gloo words it "timed out" (a
connection a dead peer's closed port refused, within milliseconds). Gloo's transport
alone raises a bare ``RuntimeError`` whose text is all that tells a lost peer from an
error of the program; ``_GLOO_PEER_LOSS_MARKS`` lists those texts. The ones a real
peer provokes in tests/test_collective_guard.py (a peer killed, one killed with data
unread, one frozen past gloo's timeout) are pinned there, so a torch whose gloo words
them anew fails there rather than misclassifying.
"""

from __future__ import annotations

import concurrent.futures
import datetime
import functools
import os
import threading
import time
import weakref
from typing import Callable, Iterable, Optional

import torch
import torch.distributed as dist

__all__ = ["CollectiveGuard", "PeerLost", "is_peer_loss", "prepare_backend"]

_GLOO_PEER_LOSS_MARKS = ("Connection closed by peer", "Connection reset by peer", "Read error", "Socket closed",
                         "Broken pipe", "Timed out", "timed out", "Connect timeout", "Connection refused", "aborted")
"""What gloo's tcp transport says (in a bare ``RuntimeError``) when a peer or the group is
gone. Provoked and pinned by tests: "Connection closed by peer", "Read error ...:
Connection reset by peer", "Timed out waiting". Kept though no test provokes them yet:
"timed out connecting: SO_ERROR: Connection refused" (a dead peer's closed port),
"Connect timeout", "Socket closed", "Broken pipe" (a failed writev), all in this gloo's
strings, and "aborted", for a backend that reports its abort untyped. (Gloo says
"writev" where it once said "Write error", which no longer occurs.)"""
_SLICED_BACKENDS = ("gloo",)
_ABORTED_BACKENDS = ("nccl", "hccl")
_LINGER_TIMEOUTS = 7
"""How many collective timeouts an abandoned gloo operation may still run: a pair it connects
waits up to one for the peer's address in the store and five (gloo's ``Pair::waitUntil``)
for the peer to connect, then the operation up to one for its data."""


class PeerLost(RuntimeError):
    """A collective or point-to-point operation ended because a peer or the generation is
    gone (a closed connection, an abort, a timeout): the worker leaves the generation and
    keeps its state, rather than treating it as an error of its own. ``timed_out``: it ran
    the collective timeout by the guard's clock (a frozen peer, which the worker reports as
    a stall), rather than ending sooner (a peer gone, which must not be reported as a
    stall: that takes the reporter out).
    """

    def __init__(self, detail: str, *, timed_out: bool = False):
        super().__init__(detail)
        self.timed_out = timed_out


def is_peer_loss(exc: BaseException) -> bool:
    """Whether an error raised by a collective means a lost peer or group: a typed one,
    or gloo's untyped transport error (``_GLOO_PEER_LOSS_MARKS``)."""
    if isinstance(exc, (PeerLost, dist.DistError)):
        return True
    return isinstance(exc, RuntimeError) and any(mark in str(exc) for mark in _GLOO_PEER_LOSS_MARKS)


def prepare_backend(backend: str) -> None:
    """Before any process group exists: a gloo group (the training's, and the snapshots'
    whatever the backend) is made without connecting its members, as NCCL makes its
    communicators at their first collective (``TORCH_GLOO_LAZY_INIT``), and connected by
    ``CollectiveGuard.track`` in an operation the guard can leave; an NCCL/HCCL watchdog
    that sees an error aborts the communicators and lets the process live (the default
    tears it down)."""
    os.environ["TORCH_GLOO_LAZY_INIT"] = "1"
    if backend == "nccl":
        os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = "2"  # CleanUpOnly
    elif backend == "hccl":
        os.environ["HCCL_ASYNC_ERROR_HANDLING"] = "2"


_ORIGINAL_WAIT = dist.Work.wait
_STARTERS = ("send", "recv", "isend", "irecv", "batch_isend_irecv", "all_reduce", "broadcast", "barrier",
             "all_gather", "all_gather_into_tensor", "reduce", "reduce_scatter_tensor")
"""The torch.distributed functions that start operations (Megatron-Core calls them by module attribute)."""
_ORIGINAL_STARTERS = {name: getattr(dist.distributed_c10d, name) for name in _STARTERS}
_installed: Optional["CollectiveGuard"] = None


def _guarded_wait(work: dist.Work, timeout: Optional[datetime.timedelta] = None) -> bool:
    guard = _installed
    if guard is None or timeout is not None:
        return _ORIGINAL_WAIT(work) if timeout is None else _ORIGINAL_WAIT(work, timeout)
    return guard.wait(work)


def _guarded_start(start: Callable) -> Callable:
    @functools.wraps(start)
    def guarded(*args, **kwargs):
        guard = _installed
        return start(*args, **kwargs) if guard is None else guard.start(start, *args, **kwargs)

    return guarded


class CollectiveGuard:
    """One per worker process: ``install`` once, ``track`` each generation's groups as they
    are made, ``abort`` from any thread when the generation ends, ``abandon`` when leaving
    it, ``reopen`` before entering the next."""

    backend: str
    timeout_s: float
    """How long one wait may take before it raises ``PeerLost(timed_out=True)``: the
    collective timeout, which the groups themselves are created with too."""
    slice_s: float
    """How long a sliced wait blocks between two looks at the abort flag."""

    def __init__(self, *, backend: str, timeout_s: float, slice_s: float = 0.05):
        self.backend, self.timeout_s, self.slice_s = backend, timeout_s, slice_s
        self._aborted = threading.Event()
        self._reason = ""
        self._generation: Optional[int] = None
        """The generation whose groups are guarded now (``reopen``)."""
        self._lock = threading.Lock()
        self._groups: list[dist.ProcessGroup] = []
        self._graveyard: list[tuple[float, list]] = []
        """(monotonic time after which every operation has ended, what must outlive it)."""
        self._waiters = concurrent.futures.ThreadPoolExecutor(max_workers=64, thread_name_prefix="odyssey-wait")
        """Threads that wait on gloo works for the calling thread (one each while it waits)."""
        self._began: weakref.WeakKeyDictionary[dist.Work, float] = weakref.WeakKeyDictionary()
        """When each work a guarded start returned began (monotonic), until it is waited on."""
        self._starting = threading.local()
        """``began``: when the guarded start this thread is in began (its operation's own
        wait happens inside it, for a synchronous one)."""

    def install(self) -> None:
        """Route every ``Work.wait`` of this process, and every start of an operation,
        through this guard."""
        global _installed
        _installed = self
        dist.Work.wait = _guarded_wait
        for name, start in _ORIGINAL_STARTERS.items():
            guarded = _guarded_start(start)
            # Both bindings: P2POp checks its op against distributed_c10d's own isend and irecv.
            setattr(dist, name, guarded)
            setattr(dist.distributed_c10d, name, guarded)

    def uninstall(self) -> None:
        global _installed
        _installed = None
        dist.Work.wait = _ORIGINAL_WAIT
        for name, start in _ORIGINAL_STARTERS.items():
            setattr(dist, name, start)
            setattr(dist.distributed_c10d, name, start)

    # -- the generation's lifecycle ------------------------------------------------------

    def track(self, groups: Iterable[dist.ProcessGroup]) -> None:
        """Take in groups of the current generation, as soon as they are made (collective:
        every member, in the order the groups were made): aborted with the generation, kept
        until their operations end, and a gloo group connected now, every pair of members
        in one all-to-all, an operation the guard leaves on an abort (connected later, a
        pair would connect inside a point-to-point start, which blocks its caller)."""
        groups = [g for g in groups if g is not None]
        with self._lock:
            self._groups.extend(groups)
            aborted = self._aborted.is_set()
        if aborted:  # made after the abort came: end them too
            self._abort_groups()
        for group in groups:
            if group.size() > 1 and dist.get_backend(group) == "gloo":
                mesh = torch.zeros(group.size())
                self.check()
                began = time.monotonic()
                self.wait(dist.all_to_all_single(torch.empty_like(mesh), mesh, group=group, async_op=True),
                          began=began)

    def abort(self, reason: str, *, generation: Optional[int] = None) -> None:
        """End the generation's waits (callable from any thread, more than once).
        ``generation``: the one the abort is for; an abort that arrives for an earlier
        one, after the worker moved on, is ignored."""
        with self._lock:
            if self._aborted.is_set() or (generation is not None and generation != self._generation):
                return
            self._reason = reason
            self._aborted.set()
        self._abort_groups()

    @property
    def aborted(self) -> bool:
        return self._aborted.is_set()

    def check(self) -> None:
        """Raise ``PeerLost`` if the generation was aborted: for loops that wait on the store."""
        if self._aborted.is_set():
            raise PeerLost(f"the generation was aborted ({self._reason})")

    def abandon(self) -> None:
        """Leaving the generation: keep its groups (and whatever else the caller passes
        through ``keep``) alive until every operation on them has surely ended, so that no
        thread blocks dropping them."""
        with self._lock:
            groups, self._groups = self._groups, []
        if self._aborted.is_set() or groups:
            default = dist.distributed_c10d._get_default_group() if dist.is_initialized() else None
            self.keep([*groups, default] if default is not None else groups)

    def keep(self, objects: list) -> None:
        """Hold ``objects`` (groups, works) until every operation on them has surely ended."""
        self._graveyard.append((time.monotonic() + _LINGER_TIMEOUTS * self.timeout_s + 1.0, objects))

    def reopen(self, generation: Optional[int] = None) -> None:
        """Before entering ``generation``: clear the abort, drop what has surely ended."""
        now = time.monotonic()
        self._graveyard = [(until, kept) for until, kept in self._graveyard if until > now]
        with self._lock:
            self._aborted.clear()
            self._reason = ""
            self._generation = generation

    @property
    def kept(self) -> int:
        """Entries (an abandoned generation's groups, an abandoned work) still held."""
        return len(self._graveyard)

    # -- starting and waiting ------------------------------------------------------------

    def start(self, start: Callable, *args, **kwargs):
        """``start(*args, **kwargs)`` (a torch.distributed function that starts an
        operation), noting when it began; an error that means a lost peer (gloo raises at
        once where a pair's socket is already closed), or any error once the generation is
        aborted, raises ``PeerLost``."""
        self.check()
        outer = getattr(self._starting, "began", None)  # a start that starts others (all_gather_object)
        began = self._starting.began = time.monotonic()
        try:
            started = start(*args, **kwargs)
        except PeerLost:
            raise
        except Exception as exc:
            if self.aborted or is_peer_loss(exc):
                raise PeerLost(_first_line(exc)) from exc
            raise
        finally:
            self._starting.began = outer
        with self._lock:
            for work in started if isinstance(started, list) else [started]:
                if isinstance(work, dist.Work):
                    self._began[work] = began
        return started

    def wait(self, work: dist.Work, *, began: Optional[float] = None) -> bool:
        """``work.wait()``, ending with ``PeerLost`` on an abort, a timeout or a lost peer.
        ``began``: when the operation started, where no guarded start noted it."""
        started = time.monotonic()
        with self._lock:
            noted = self._began.pop(work, None)
        began = next((t for t in (began, noted, getattr(self._starting, "began", None)) if t is not None), started)
        if self.backend not in _SLICED_BACKENDS:
            try:
                return _ORIGINAL_WAIT(work)
            except Exception as exc:
                if self._aborted.is_set() or is_peer_loss(exc):
                    # The backend's own timeout (NCCL's watchdog) is the collective timeout: judged
                    # on this clock, not by its words, so an NCCL rank reports a stall as gloo's does.
                    raise PeerLost(_first_line(exc), timed_out=not self._aborted.is_set()
                                   and time.monotonic() - began >= self.timeout_s) from exc
                raise
        self.check()
        waited = self._waiters.submit(_ORIGINAL_WAIT, work)
        while True:
            try:
                return waited.result(timeout=self.slice_s)
            except concurrent.futures.TimeoutError:
                pass
            except PeerLost:  # from the rendezvous store, on the group's thread as it connected a pair
                raise
            except Exception as exc:
                if is_peer_loss(exc):
                    # Gloo's own timeout is the collective timeout too: what ends an operation
                    # that has run that long is a timeout; a lost peer ends it sooner.
                    raise PeerLost(_first_line(exc), timed_out=time.monotonic() - began >= self.timeout_s) from exc
                raise
            if self._aborted.is_set():
                self.keep([work])
                raise PeerLost(f"the generation was aborted ({self._reason})")
            if time.monotonic() - started > self.timeout_s:
                self.keep([work])
                raise PeerLost(f"a collective waited over the collective timeout ({self.timeout_s} s)",
                               timed_out=True)

    def _abort_groups(self) -> None:
        if self.backend not in _ABORTED_BACKENDS:
            return
        with self._lock:
            groups = list(self._groups)
        for group in groups:
            try:
                group.abort()
            except Exception:  # noqa: BLE001 - a group already torn down by its watchdog
                pass


def _first_line(exc: BaseException) -> str:
    text = str(exc)
    return text.splitlines()[0] if text else type(exc).__name__
