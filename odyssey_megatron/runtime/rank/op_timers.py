"""Seconds a rank's ops take in a step, taken through Megatron-Core's own timer hooks.

Megatron's schedules and optimizers call ``config.timers(name).start()`` and ``.stop()``
around each micro-batch's forward (``forward-compute``) and backward
(``backward-compute``), and around the optimizer's Adam step (``optimizer-inner-step``),
whenever the model's or the optimizer's config has ``timers``. The op-list executor runs
the same ``forward_step`` and ``backward_step``, and times its weight-gradient ops under
``weight-grad-compute`` the same way, so both executors are timed by one mechanism.
``OpTimers`` is such a ``timers`` object: it keeps the total and the count per name
until ``take``. The online profile (``runtime.control.online_profile``) and the
controller's straggler watch (``runtime.control.stragglers``) are fed from it.

The same hooks say where the rank is in its step: ``position`` counts the ops (forwards,
backwards, weight gradients) finished since ``begin_step``, and one more once the rank
counted into the step's commit (``counting_in``), which the worker's heartbeat carries so
that the controller blames a hang on the rank that is behind. And they let a
``slow`` fault (``runtime.rank.fault_injection``) stretch each op: with ``stretch`` above
1, an op's timer sleeps at its stop for ``stretch - 1`` times what the op took, inside the
timed interval, as a device that slow would take.

On CPU an op's time is the wall clock around it; on an accelerator, device events
recorded around it and read when the step's times are taken, so nothing inside the step
waits for the device.
"""

from __future__ import annotations

import time
from typing import Optional

import torch

__all__ = ["FORWARD", "BACKWARD", "WEIGHT_GRAD", "OPTIMIZER", "STEP_OPS", "OpTimers"]

FORWARD = "forward-compute"
BACKWARD = "backward-compute"
WEIGHT_GRAD = "weight-grad-compute"
OPTIMIZER = "optimizer-inner-step"
TIMED = (FORWARD, BACKWARD, WEIGHT_GRAD, OPTIMIZER)
"""Megatron calls its timers by more names (sends, receives, the whole schedule); these
are the ones the estimator prices as ops."""
STEP_OPS = (FORWARD, BACKWARD, WEIGHT_GRAD)
"""The timers of the ops in a step's op list (``schedules.ops.Op``), one stop per op."""


class _Untimed:
    def start(self, barrier: bool = False) -> None:
        pass

    def stop(self, barrier: bool = False) -> None:
        pass


class _Timer:
    """One name's timer, with the ``start``/``stop`` signature Megatron calls."""

    def __init__(self, device: torch.device, owner: "OpTimers", *, counts: bool):
        self._events = None if device.type == "cpu" else torch.get_device_module(device.type).Event
        self._owner, self._counts = owner, counts
        """``counts``: a stop finishes an op of the step's op list (``OpTimers.ops_done``)."""
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
        stopped = self._now()
        if self._owner.stretch > 1.0:
            time.sleep(self._seconds(self._started, stopped) * (self._owner.stretch - 1.0))
            stopped = self._now()
        self.intervals.append((self._started, stopped))
        self._started = None
        if self._counts and self._owner.position is not None:
            step, done = self._owner.position
            self._owner.position = (step, done + 1)  # one assignment: the heartbeat thread reads it whole

    def _seconds(self, start: object, end: object) -> float:
        if self._events is None:
            return end - start
        end.synchronize()
        return start.elapsed_time(end) / 1e3

    def take(self) -> tuple[float, int]:
        """(seconds, count) of the intervals since the last take."""
        intervals, self.intervals = self.intervals, []
        if intervals and self._events is not None:
            intervals[-1][1].synchronize()
        return sum(self._seconds(start, end) for start, end in intervals), len(intervals)


class OpTimers:
    """Megatron's ``timers`` protocol (``timers(name, log_level=None)`` returns a timer with
    ``start`` and ``stop``), keeping the names in ``TIMED``. The training thread calls
    ``begin_step`` as each step starts; the heartbeat thread reads ``position``."""

    position: Optional[tuple[int, int]]
    """(the step running, the ops of its op list finished: ``STEP_OPS`` timers stopped
    since ``begin_step``, one more once it counts into the step's commit); None outside
    training (``end_steps``)."""
    stretch: float
    """Each op takes this many times its own time (a ``slow`` fault); 1: as it comes."""

    def __init__(self, device: torch.device):
        self.position, self.stretch = None, 1.0
        self._timers = {name: _Timer(device, self, counts=name in STEP_OPS) for name in TIMED}
        self._untimed = _Untimed()

    def begin_step(self, step: int, *, stretch: float = 1.0) -> None:
        """Step ``step`` starts: no op of it done yet; its ops stretched by ``stretch``."""
        self.position, self.stretch = (step, 0), stretch

    def counting_in(self) -> None:
        """The rank counts into the step's commit, past its ops: it waits for the step's
        decision now (``runtime.control.blame``: it waits for every rank not counted in)."""
        if self.position is not None:
            step, done = self.position
            self.position = (step, done + 1)

    def end_steps(self) -> None:
        """The rank stops training (it leaves or enters a generation): no step to report."""
        self.position, self.stretch = None, 1.0

    def __call__(self, name: str, log_level: int | None = None) -> _Timer | _Untimed:
        return self._timers.get(name, self._untimed)

    def take(self) -> dict[str, tuple[float, int]]:
        """Per name in ``TIMED``: (total seconds, number of ops) since the last take."""
        return {name: timer.take() for name, timer in self._timers.items()}
