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
  still holds its group's sockets and threads (and its helper thread) until gloo ends it
  (a closed socket at once, a frozen peer at gloo's own timeout), and dropping the group's
  last reference before then blocks the dropping thread until it does. Gloo's own
  threads can outlive every operation the guard knows of, too: a worker that left a
  generation on a peer's closed socket blocked in ``gc.collect`` for over the recovery
  timeout, in the group's destructor joining gloo's tcp loop thread, so the run lost a
  healthy rank. The guard holds a left generation's gloo groups (``abandon``) until the
  leaving thread has dropped its own references (``done_leaving``) and every operation on
  them known to run has ended (a helper thread still waits on one, or a work was started
  and never waited), then drops them on a thread of its own (the reaper), which alone
  waits for whatever of gloo still runs.
- **NCCL and HCCL**: the communicators are aborted from the watching thread (a thread
  other than the one blocked in the collective, as nvidia-resiliency-ext's monitor does),
  which ends the kernels in flight and frees the communicators, so nothing of them is held;
  the watchdog is told to clean up rather than tear the process down
  (``TORCH_NCCL_ASYNC_ERROR_HANDLING``, ``HCCL_ASYNC_ERROR_HANDLING``). Their communicators
  start without blocking (``TORCH_NCCL_USE_COMM_NONBLOCKING``) and are connected, every pair
  of a group's members, by ``track`` as gloo's are: an init waiting for a dead member then
  waits in an operation an abort ends, before the first step rather than inside it.
  An abort that fails is logged and kept (``abort_errors``), never dropped.

Which of the two a wait is follows the backend of the group its operation runs on (noted
when a guarded start begins it), not the process's: the snapshots' parity groups are gloo
groups beside NCCL training, and their waits are sliced there too.

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
import gc
import inspect
import logging
import os
import threading
import time
from dataclasses import dataclass
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

log = logging.getLogger(__name__)


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


def prepare_backend(backend: str, *, timeout_s: Optional[float] = None) -> None:
    """Before any process group exists: a gloo group (the training's, and the snapshots'
    whatever the backend) is made without connecting its members, as NCCL makes its
    communicators at their first collective (``TORCH_GLOO_LAZY_INIT``), and connected by
    ``CollectiveGuard.track`` in an operation the guard can leave. An NCCL communicator
    starts without blocking (``TORCH_NCCL_USE_COMM_NONBLOCKING``), so that an abort from
    another thread reaches an init that waits for a dead member, and waits for its members
    at most ``timeout_s``, the collective timeout (``TORCH_NCCL_NONBLOCKING_TIMEOUT``, 30
    minutes unless set). An NCCL/HCCL watchdog that sees an error aborts the communicators
    and lets the process live (the default tears it down)."""
    os.environ["TORCH_GLOO_LAZY_INIT"] = "1"
    if backend == "nccl":
        os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = "2"  # CleanUpOnly
        os.environ["TORCH_NCCL_USE_COMM_NONBLOCKING"] = "1"
        if timeout_s is not None:
            os.environ["TORCH_NCCL_NONBLOCKING_TIMEOUT"] = str(max(1, round(timeout_s)))  # whole seconds
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


def _backend_of(group: Optional[dist.ProcessGroup]) -> str:
    """The backend of ``group`` (None: the default group), as torch names it: gloo, nccl, hccl."""
    return str(dist.get_backend(group))


@functools.lru_cache(maxsize=None)
def _signature(start: Callable) -> inspect.Signature:
    return inspect.signature(start)


def _backend_of_call(start: Callable, args: tuple, kwargs: dict) -> Optional[str]:
    """The backend of the group the operation ``start(*args, **kwargs)`` runs on; None where
    the call names no group torch knows (the start then fails on its own)."""
    try:
        if start.__name__ == "batch_isend_irecv":
            ops = args[0] if args else kwargs.get("p2p_op_list", [])
            group = ops[0].group if ops else None
        else:
            group = _signature(start).bind_partial(*args, **kwargs).arguments.get("group")
        return _backend_of(group)
    except (TypeError, ValueError, RuntimeError):
        return None


@dataclass(frozen=True)
class _Started:
    """An operation a guarded start began, until it is waited on."""

    began: float
    """When it started (monotonic)."""
    backend: str
    """Its group's backend, which says how it is waited on."""


class _Held:
    """A left generation's gloo groups, held until the thread that left has dropped its own
    references (``left``) and the operations that may run on them (``running``) ended."""

    def __init__(self, objects: list, running: list[concurrent.futures.Future]):
        self.objects, self.running = objects, running
        self.left = threading.Event()


class CollectiveGuard:
    """One per worker process: ``install`` once, ``track`` each generation's groups as they
    are made, ``abort`` from any thread when the generation ends, ``abandon`` when leaving
    it, ``reopen`` before entering the next."""

    backend: str
    """The process's backend: how a wait on an operation of a group the guard cannot name is done."""
    device: torch.device
    """Where an NCCL/HCCL group's connecting all-to-all runs, for a group bound to no device."""
    timeout_s: float
    """How long one wait may take before it raises ``PeerLost(timed_out=True)``: the
    collective timeout, which the groups themselves are created with too."""
    slice_s: float
    """How long a sliced wait blocks between two looks at the abort flag."""

    def __init__(self, *, backend: str, timeout_s: float, slice_s: float = 0.05,
                 device: Optional[torch.device] = None):
        self.backend, self.timeout_s, self.slice_s = backend, timeout_s, slice_s
        self.device = device if device is not None else torch.device("cpu")
        self._aborted = threading.Event()
        self._reason = ""
        self._generation: Optional[int] = None
        """The generation whose groups are guarded now (``reopen``)."""
        self._lock = threading.Lock()
        self._groups: list[tuple[dist.ProcessGroup, str]] = []
        """The generation's groups, each with its backend."""
        self._in_flight: dict[dist.Work, _Started] = {}
        """Works guarded starts returned, until waited on (those never waited are still
        running as far as anyone knows: ``abandon`` holds their gloo groups until they end)."""
        self._waiting: set[concurrent.futures.Future] = set()
        """Helper threads' waits on gloo works, until each ends (with its operation)."""
        self._held: list[_Held] = []
        self._abort_errors: list[str] = []
        self._waiters = concurrent.futures.ThreadPoolExecutor(max_workers=64, thread_name_prefix="odyssey-wait")
        """Threads that wait on gloo works for the calling thread (one each while it waits)."""
        self._starting = threading.local()
        """``began`` and ``backend``: when the guarded start this thread is in began, and its
        group's backend (its operation's own wait happens inside it, for a synchronous one)."""

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
        every member, in the order the groups were made): aborted with the generation, held
        while an operation may run on them, and connected now, every pair of members in one
        all-to-all, an operation the guard leaves on an abort (connected later, a gloo pair
        would connect inside a point-to-point start, which blocks its caller, and an NCCL
        communicator inside the first step)."""
        groups = [(g, _backend_of(g)) for g in groups if g is not None]
        with self._lock:
            self._groups.extend(groups)
            aborted = self._aborted.is_set()
        if aborted:  # made after the abort came: end them too
            self._abort_groups()
        for group, backend in groups:
            if group.size() > 1:
                self._connect(group, backend)

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

    @property
    def abort_errors(self) -> list[str]:
        """What each group's abort that failed said, this generation (also in ``check``'s error)."""
        with self._lock:
            return list(self._abort_errors)

    def check(self) -> None:
        """Raise ``PeerLost`` if the generation was aborted: for loops that wait on the store."""
        if self._aborted.is_set():
            failed = "; ".join(self.abort_errors)
            raise PeerLost(f"the generation was aborted ({self._reason})" + (f"; {failed}" if failed else ""))

    def abandon(self) -> None:
        """Leaving the generation: let its groups go. NCCL/HCCL groups at once (an abort
        ended their operations and freed their communicators; a generation that ended
        without one has none in flight). Gloo groups, with the default group, are held
        and dropped by the reaper once the leaving thread called ``done_leaving`` and
        every operation that may still run on them has ended: the waits helper threads
        still run (an abort or a timeout left them) and the works started but never waited
        on, which a helper thread now waits on."""
        with self._lock:
            groups, self._groups = self._groups, []
            unwaited, self._in_flight = self._in_flight, {}
            running = list(self._waiting)
        running += [self._waiters.submit(_ORIGINAL_WAIT, work)
                    for work, started in unwaited.items() if started.backend in _SLICED_BACKENDS]
        gloo = [group for group, backend in groups if backend in _SLICED_BACKENDS]
        if dist.is_initialized() and not any(group is dist.group.WORLD for group in gloo):
            gloo.append(dist.group.WORLD)
        self._hold(gloo, running)

    def done_leaving(self) -> None:
        """The leaving thread has dropped its references to the left generations' groups
        (``abandon``): the reaper's are the last, and it may drop them."""
        with self._lock:
            held = list(self._held)
        for entry in held:
            entry.left.set()

    def reopen(self, generation: Optional[int] = None) -> None:
        """Before entering ``generation``: clear the abort (the last one's leaving is done)."""
        self.done_leaving()
        with self._lock:
            self._aborted.clear()
            self._reason = ""
            self._abort_errors.clear()
            self._generation = generation

    @property
    def kept(self) -> int:
        """Left generations whose gloo groups are still held (the leaving thread has not
        called ``done_leaving``, an operation on them still runs, or gloo still ends them)."""
        with self._lock:
            return len(self._held)

    def _hold(self, objects: list, running: list[concurrent.futures.Future]) -> None:
        """Hold ``objects`` for the reaper (nothing to hold: nothing to reap)."""
        if not objects and not running:
            return
        held = _Held(objects, running)
        with self._lock:
            self._held.append(held)
        threading.Thread(target=self._reap, args=(held,), name="odyssey-reaper", daemon=True).start()

    def _reap(self, held: _Held) -> None:
        """On the reaper: drop ``held``'s objects once the leaving thread has dropped its own
        and its operations ended. Dropping a gloo group blocks until gloo's threads end, here
        only; ``gc.collect`` here too, so that a group also in a reference cycle is not left
        to a collection on the training thread."""
        held.left.wait()
        concurrent.futures.wait(held.running)
        objects, held.objects = held.objects, []
        del objects
        gc.collect()
        with self._lock:
            self._held.remove(held)

    # -- starting and waiting ------------------------------------------------------------

    def start(self, start: Callable, *args, **kwargs):
        """``start(*args, **kwargs)`` (a torch.distributed function that starts an
        operation), noting when it began and its group's backend; an error that means a lost
        peer (gloo raises at once where a pair's socket is already closed), or any error once
        the generation is aborted, raises ``PeerLost``."""
        self.check()
        # A start that starts others (all_gather_object): the outer one's note comes back after.
        outer = getattr(self._starting, "began", None), getattr(self._starting, "backend", None)
        began, backend = time.monotonic(), _backend_of_call(start, args, kwargs) or self.backend
        self._starting.began, self._starting.backend = began, backend
        try:
            started = start(*args, **kwargs)
        except PeerLost:
            raise
        except Exception as exc:
            if self.aborted or is_peer_loss(exc):
                raise PeerLost(_first_line(exc)) from exc
            raise
        finally:
            self._starting.began, self._starting.backend = outer
        with self._lock:
            for work in started if isinstance(started, list) else [started]:
                if isinstance(work, dist.Work):
                    self._in_flight[work] = _Started(began, backend)
        return started

    def wait(self, work: dist.Work, *, began: Optional[float] = None, backend: Optional[str] = None) -> bool:
        """``work.wait()``, ending with ``PeerLost`` on an abort, a timeout or a lost peer.
        ``began`` and ``backend``: when the operation started and its group's backend, where
        no guarded start noted them."""
        started = time.monotonic()
        with self._lock:
            noted = self._in_flight.pop(work, None)
        began = next((t for t in (began, noted.began if noted else None, getattr(self._starting, "began", None))
                      if t is not None), started)
        backend = next(b for b in (backend, noted.backend if noted else None,
                                   getattr(self._starting, "backend", None), self.backend) if b is not None)
        if backend not in _SLICED_BACKENDS:
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
        waited = self._wait_on_helper(work)
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
            # Left below, the helper's wait goes on (in ``_waiting``) until gloo ends the operation.
            self.check()
            if time.monotonic() - started > self.timeout_s:
                raise PeerLost(f"a collective waited over the collective timeout ({self.timeout_s} s)",
                               timed_out=True)

    def _wait_on_helper(self, work: dist.Work) -> concurrent.futures.Future:
        """``work.wait()`` on a helper thread, counted in ``_waiting`` until it returns."""
        waited = self._waiters.submit(_ORIGINAL_WAIT, work)
        with self._lock:
            self._waiting.add(waited)
        waited.add_done_callback(self._wait_ended)
        return waited

    def _wait_ended(self, waited: concurrent.futures.Future) -> None:
        with self._lock:
            self._waiting.discard(waited)

    def _connect(self, group: dist.ProcessGroup, backend: str) -> None:
        """Connect every pair of ``group``'s members in one all-to-all that an abort ends:
        gloo's on the host; NCCL's and HCCL's on the group's device, where a communicator
        that started without blocking waits for its members."""
        device = torch.device("cpu") if backend in _SLICED_BACKENDS else (group.bound_device_id or self.device)
        mesh = torch.zeros(group.size(), device=device)
        self.check()
        began = time.monotonic()
        self.wait(dist.all_to_all_single(torch.empty_like(mesh), mesh, group=group, async_op=True),
                  began=began, backend=backend)

    def _abort_groups(self) -> None:
        """Abort the generation's NCCL/HCCL groups (gloo's abort ends no operation: its waits
        are sliced instead). A failed abort is logged and kept, never dropped: a communicator
        it left may still hold the device."""
        with self._lock:
            groups = [group for group, backend in self._groups if backend in _ABORTED_BACKENDS]
        for group in groups:
            try:
                group.abort()
            except Exception as exc:  # noqa: BLE001 - e.g. one its watchdog tore down first; said below
                error = (f"aborting process group {getattr(group, 'group_name', type(group).__name__)} failed: "
                         f"{type(exc).__name__}: {_first_line(exc)}")
                log.warning("%s", error)
                with self._lock:
                    self._abort_errors.append(error)


def _first_line(exc: BaseException) -> str:
    text = str(exc)
    return text.splitlines()[0] if text else type(exc).__name__
