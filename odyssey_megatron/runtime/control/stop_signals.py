"""Stopping on purpose: SIGINT (a terminal's Ctrl-C) and SIGTERM (SLURM at preemption or
the time limit, Kubernetes at pod deletion, then SIGKILL some 30 s later) ask the run to
stop at its next step boundary, saving what is committed; a second one stops at once.

Installed by ``odyssey train`` in each node's main process (node 0's passes the request
to its controller, another node's launcher sends it there); workers ignore both signals
and follow the controller's ``StopOrder``.
"""

from __future__ import annotations

import logging
import signal
import threading
from typing import Callable

__all__ = ["StopAtOnce", "StopSignals"]

log = logging.getLogger(__name__)

_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class StopAtOnce(BaseException):
    """A second stop signal: end the node now (a BaseException, so that no ``except
    Exception`` on the way holds it up)."""

    def __init__(self, name: str, status: int):
        super().__init__(f"stopped at once by a second {name}")
        self.name, self.status = name, status


class StopSignals:
    """Call ``install`` in the main thread; the first SIGINT or SIGTERM calls
    ``on_first(name, status)`` (status: 128 + the signal, what the process exits with),
    the next raises ``StopAtOnce`` in the main thread.

    A handler runs in the main thread between two of its bytecodes, which may be inside a
    log write or hold a lock ``on_first`` needs (the run record's): logging there wrote into
    the node's log file reentrantly (a "Logging error" traceback on the terminal, seen in CI)
    and taking the lock would deadlock. So the handler only notes the signal, and a thread
    of its own logs it and calls ``on_first``."""

    def __init__(self, on_first: Callable[[str, int], None]):
        self.on_first = on_first
        self.received: list[str] = []
        self._previous: dict = {}
        self._first = threading.Event()
        self._closed = False
        self._thread: threading.Thread | None = None

    def install(self) -> None:
        self._thread = threading.Thread(target=self._deliver_first, name="odyssey-stop-signal", daemon=True)
        self._thread.start()
        for stop in _SIGNALS:
            self._previous[stop] = signal.signal(stop, self._handle)

    def restore(self) -> None:
        for stop, handler in self._previous.items():
            signal.signal(stop, handler)
        self._previous.clear()
        self._closed = True
        self._first.set()  # the thread ends; a signal it had not delivered yet is dropped with the run

    def _handle(self, signum: int, _frame) -> None:
        self.received.append(signal.Signals(signum).name)
        if len(self.received) > 1:
            raise StopAtOnce(self.received[-1], 128 + signum)
        self._first.set()

    def _deliver_first(self) -> None:
        self._first.wait()
        if self._closed:
            return
        name = self.received[0]
        log.warning("odyssey train: %s: stopping at the next step boundary, saving what is committed "
                    "(send it again to stop at once)", name)
        self.on_first(name, 128 + signal.Signals[name].value)
