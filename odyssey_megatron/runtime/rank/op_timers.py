"""Seconds a rank's ops take in a step, taken through Megatron-Core's own timer hooks.

Megatron's schedules and optimizers call ``config.timers(name).start()`` and ``.stop()``
around each micro-batch's forward (``forward-compute``) and backward
(``backward-compute``), and around the optimizer's Adam step (``optimizer-inner-step``),
whenever the model's or the optimizer's config has ``timers``. The op-list executor runs
the same ``forward_step`` and ``backward_step``, and times its weight-gradient ops under
``weight-grad-compute`` the same way, so both executors are timed by one mechanism.
``OpTimers`` is such a ``timers`` object: it keeps the total and the count per name
until ``take``. The online profile (``runtime.control.online_profile``) is fed from it.

On CPU an op's time is the wall clock around it; on an accelerator, device events
recorded around it and read when the step's times are taken, so nothing inside the step
waits for the device.
"""

from __future__ import annotations

import time

import torch

__all__ = ["FORWARD", "BACKWARD", "WEIGHT_GRAD", "OPTIMIZER", "OpTimers"]

FORWARD = "forward-compute"
BACKWARD = "backward-compute"
WEIGHT_GRAD = "weight-grad-compute"
OPTIMIZER = "optimizer-inner-step"
TIMED = (FORWARD, BACKWARD, WEIGHT_GRAD, OPTIMIZER)
"""Megatron calls its timers by more names (sends, receives, the whole schedule); these
are the ones the estimator prices as ops."""


class _Untimed:
    def start(self, barrier: bool = False) -> None:
        pass

    def stop(self, barrier: bool = False) -> None:
        pass


class _Timer:
    """One name's timer, with the ``start``/``stop`` signature Megatron calls."""

    def __init__(self, device: torch.device):
        self._events = None if device.type == "cpu" else torch.get_device_module(device.type).Event
        self._started: object = None
        self.intervals: list[tuple[object, object]] = []

    def _now(self) -> object:
        if self._events is None:
            return time.perf_counter()
        event = self._events(enable_timing=True)
        event.record()
        return event

    def start(self, barrier: bool = False) -> None:
        self._started = self._now()

    def stop(self, barrier: bool = False) -> None:
        if self._started is None:
            raise RuntimeError("timer stopped without being started")
        self.intervals.append((self._started, self._now()))
        self._started = None

    def take(self) -> tuple[float, int]:
        """(seconds, count) of the intervals since the last take."""
        intervals, self.intervals = self.intervals, []
        if self._events is None:
            return sum(end - start for start, end in intervals), len(intervals)
        if intervals:
            intervals[-1][1].synchronize()
        return sum(start.elapsed_time(end) for start, end in intervals) / 1e3, len(intervals)


class OpTimers:
    """Megatron's ``timers`` protocol (``timers(name, log_level=None)`` returns a timer with
    ``start`` and ``stop``), keeping the names in ``TIMED``."""

    def __init__(self, device: torch.device):
        self._timers = {name: _Timer(device) for name in TIMED}
        self._untimed = _Untimed()

    def __call__(self, name: str, log_level: int | None = None) -> _Timer | _Untimed:
        return self._timers.get(name, self._untimed)

    def take(self) -> dict[str, tuple[float, int]]:
        """Per name in ``TIMED``: (total seconds, number of ops) since the last take."""
        return {name: timer.take() for name, timer in self._timers.items()}
