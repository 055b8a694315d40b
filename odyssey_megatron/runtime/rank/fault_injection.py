"""Failures injected on purpose, as the recipe's ``odyssey.faults`` lists them (``FaultSpec``).

A worker builds one ``FaultInjector`` and calls ``fire(phase, step)`` as each phase of a
step begins; a fault aimed at it strikes there. A rank fault kills (SIGKILL), stops
(SIGSTOP: a hung worker, which its launcher kills once its heartbeats go stale) or raises
``InjectedFault`` in the training loop. A node fault kills the node's launcher, and with it
every worker of the node (each asked the kernel for SIGKILL when its launcher dies:
``controller_link``); the node's first worker (local rank 0) carries it out, so the node
fails at one well-defined point of the step. Each spec fires at most once: a step replayed
after recovery reaches the same phase again and runs clean.
"""

from __future__ import annotations

import logging
import os
import signal
from collections.abc import Sequence

from odyssey_megatron.config import FaultPhase, FaultSpec
from odyssey_megatron.runtime.protocol import WorkerLaunch

__all__ = ["FaultInjector", "InjectedFault"]

log = logging.getLogger(__name__)


class InjectedFault(Exception):
    """The ``raise`` action: an error inside the training loop, as a bug or a failed op raises one."""


class FaultInjector:
    """The faults aimed at one worker. Construct once in the worker; call ``fire`` at the
    start of every phase of every step, recovery and transfers included."""

    rank: int
    node: int
    local_rank: int
    """The worker's index on its node; local rank 0 carries out the node's faults."""
    launcher_pid: int
    """The node launcher, which a node fault kills."""
    _pending: dict[str, FaultSpec]
    """The faults aimed at this worker that have not fired yet, by their config key."""

    def __init__(self, faults: Sequence[FaultSpec], *, rank: int, node: int, local_rank: int, launcher_pid: int):
        self.rank, self.node, self.local_rank, self.launcher_pid = rank, node, local_rank, launcher_pid
        self._pending = {
            f"odyssey.faults[{index}]": spec for index, spec in enumerate(faults)
            if spec.rank == rank or (spec.node == node and local_rank == 0)
        }

    @classmethod
    def for_worker(cls, faults: Sequence[FaultSpec], launch: WorkerLaunch) -> FaultInjector:
        """The injector of the worker its launcher started with ``launch``."""
        return cls(faults, rank=launch.rank, node=launch.node, local_rank=launch.local_rank,
                   launcher_pid=launch.launcher_pid)

    def fire(self, phase: str, step: int) -> None:
        """Carry out the first pending fault for ``phase`` of ``step``, if any: kill or stop
        this process (or kill its node), or raise InjectedFault. Returns when none is
        pending there, or when a stopped worker is continued."""
        phase = FaultPhase(phase)  # a misspelt phase would silently never fire
        key = next((key for key, spec in self._pending.items() if spec.phase == phase and spec.step == step), None)
        if key is None:
            return
        spec = self._pending.pop(key)
        log.warning("rank %d: injecting %s: %s", self.rank, key, spec)
        if spec.node is not None:
            os.kill(self.launcher_pid, signal.SIGKILL)
            os.kill(os.getpid(), signal.SIGKILL)  # without waiting for the kernel's death signal
        elif spec.action == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif spec.action == "stop":
            os.kill(os.getpid(), signal.SIGSTOP)
        else:
            raise InjectedFault(f"{key}: {spec}")
