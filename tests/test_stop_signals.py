"""Stop signals: the first SIGINT or SIGTERM asks for a stop at the next step boundary,
the second stops at once (in the main thread, as a BaseException nothing holds up)."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from odyssey_megatron.runtime.control.stop_signals import StopAtOnce, StopSignals


def test_the_first_signal_asks_for_a_stop_and_the_second_stops_at_once():
    asked = []
    signals = StopSignals(lambda name, status: asked.append((name, status)))
    signals.install()
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        _wait_for(lambda: asked == [("SIGTERM", 143)])
        with pytest.raises(StopAtOnce) as stopped:
            os.kill(os.getpid(), signal.SIGINT)
        assert (stopped.value.status, str(stopped.value)) == (130, "stopped at once by a second SIGINT")
        assert not isinstance(stopped.value, Exception)
    finally:
        signals.restore()
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


def _wait_for(condition, *, within: float = 5.0) -> None:
    deadline = time.monotonic() + within
    while not condition():
        assert time.monotonic() < deadline, "not within the time"
        time.sleep(0.01)


def test_the_first_signal_is_acted_on_off_the_main_thread_whatever_it_holds():
    """The handler runs in the main thread wherever it is: here inside a lock ``on_first``
    needs (as the run record's is, or the log file's while a line is written). Acted on in
    the handler, ``on_first`` could not take it (the code before: deadlock, or a reentrant
    write into the log file); now it runs on the signals' thread once the lock is free."""
    lock = threading.Lock()
    asked = []

    def on_first(name: str, status: int) -> None:
        taken = lock.acquire(timeout=1.0)
        asked.append((name, status, taken, threading.current_thread() is threading.main_thread()))
        if taken:
            lock.release()

    signals = StopSignals(on_first)
    signals.install()
    try:
        with lock:
            os.kill(os.getpid(), signal.SIGINT)  # the handler runs here, the lock held
            time.sleep(0.1)
            assert asked == []
        _wait_for(lambda: asked == [("SIGINT", 130, True, False)])
    finally:
        signals.restore()
