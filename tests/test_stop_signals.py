"""Stop signals: the first SIGINT or SIGTERM asks for a stop at the next step boundary,
the second stops at once (in the main thread, as a BaseException nothing holds up)."""

from __future__ import annotations

import os
import signal

import pytest

from odyssey_megatron.runtime.control.stop_signals import StopAtOnce, StopSignals


def test_the_first_signal_asks_for_a_stop_and_the_second_stops_at_once():
    asked = []
    signals = StopSignals(lambda name, status: asked.append((name, status)))
    signals.install()
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        assert asked == [("SIGTERM", 143)]
        with pytest.raises(StopAtOnce) as stopped:
            os.kill(os.getpid(), signal.SIGINT)
        assert (stopped.value.status, str(stopped.value)) == (130, "stopped at once by a second SIGINT")
        assert not isinstance(stopped.value, Exception)
    finally:
        signals.restore()
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
