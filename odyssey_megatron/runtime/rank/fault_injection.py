"""Failures injected on purpose, as the recipe's ``odyssey.faults`` lists them (``FaultSpec``).

A worker builds one ``FaultInjector`` and calls ``fire(phase, step)`` as each phase of a
step begins (a ``phases.Phase``, which equals the spec's ``FaultPhase`` of its name); a
fault aimed at it strikes there. A rank fault kills (SIGKILL), stops (SIGSTOP: a hung
worker, which its launcher kills once its heartbeats go stale) or raises
``InjectedFault`` in the training loop. A node fault kills the node's launcher, and with it
every worker of the node (each asked the kernel for SIGKILL when its launcher dies:
``controller_link``); the node's first worker (local rank 0) carries it out, so the node
fails at one well-defined point of the step. Ranks failing together (``with_ranks``)
are killed by the spec's ``rank``, their pids and then its own, back to back: each of them
published its pid in the store when its injector was built. Each spec fires at most once,
in the whole run: a step replayed after recovery reaches the same phase again and runs
clean, and a restarted worker (``odyssey.restart_workers``) skips the specs that fired (the
store marks them). A ``join`` spec strikes in the first generation that takes workers
back, whatever its step (``in_join``). A ``slow`` spec fires no phase: for each of its
steps, replays included (a slow device stays slow), ``slowdown`` gives the factor the
training loop stretches the rank's ops by (``runtime.rank.op_timers``).
"""

from __future__ import annotations

import logging
import os
import signal
from collections.abc import Sequence
from typing import Optional

import torch.distributed as dist

from odyssey_megatron.config import FaultSpec
from odyssey_megatron.phases import Phase
from odyssey_megatron.runtime.protocol.keys import fault_fired_key
from odyssey_megatron.runtime.protocol.launch import WorkerLaunch

__all__ = ["FaultInjector", "InjectedFault", "pid_key"]

log = logging.getLogger(__name__)


def pid_key(rank: int) -> str:
    """Where a rank that a fault kills together with another publishes its pid."""
    return f"faults/pid/{rank}"


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
    store: Optional[dist.Store]
    """Where ranks failing together publish their pids and fired specs are marked."""
    in_join: bool
    """The generation the worker runs takes workers back: ``join`` specs strike there."""

    def __init__(self, faults: Sequence[FaultSpec], *, rank: int, node: int, local_rank: int, launcher_pid: int,
                 store: Optional[dist.Store] = None):
        self.rank, self.node, self.local_rank, self.launcher_pid = rank, node, local_rank, launcher_pid
        self.store = store
        self.in_join = False
        self._pending = {
            f"odyssey.faults[{index}]": spec for index, spec in enumerate(faults)
            if (spec.rank == rank or (spec.node == node and local_rank == 0)) and spec.action != "slow"
            and not (store is not None and store.check([fault_fired_key(f"odyssey.faults[{index}]")]))
        }
        self._slow = {f"odyssey.faults[{index}]": spec for index, spec in enumerate(faults)
                      if spec.action == "slow" and spec.rank == rank}
        self._slowed: set[str] = set()
        """Slow specs that have slowed a step yet (logged once)."""
        together = [spec for spec in faults if rank in spec.with_ranks or (spec.rank == rank and spec.with_ranks)]
        if together and store is None:
            raise ValueError(f"rank {rank}: a fault kills ranks together ({together[0]}): give the injector the store")
        self._killed_by_another = any(rank in spec.with_ranks for spec in together)
        """A spec of another rank kills this one with it: its pid is in the store."""
        if self._killed_by_another:
            store.set(pid_key(rank), str(os.getpid()))

    @classmethod
    def for_worker(cls, faults: Sequence[FaultSpec], launch: WorkerLaunch,
                   store: Optional[dist.Store] = None) -> FaultInjector:
        """The injector of the worker its launcher started with ``launch``; ``store`` is the
        run's store (the controller's)."""
        return cls(faults, rank=launch.rank, node=launch.node, local_rank=launch.local_rank,
                   launcher_pid=launch.launcher_pid, store=store)

    def follow(self, store: dist.Store) -> None:
        """Use ``store`` from now on (a restarted controller's, ``WorkerProcess.reconnected``),
        publishing this rank's pid there again for the rank that would kill it with itself."""
        self.store = store
        if self._killed_by_another:
            store.set(pid_key(self.rank), str(os.getpid()))

    def slowdown(self, step: int) -> float:
        """How many times its own time each op of ``step`` takes on this rank: the factors
        of the slow specs holding there, multiplied; 1 where none holds."""
        factor = 1.0
        for key, spec in self._slow.items():
            if spec.slows(step):
                if key not in self._slowed:
                    self._slowed.add(key)
                    log.warning("rank %d: injecting %s: %s", self.rank, key, spec)
                factor *= spec.factor
        return factor

    def fire(self, phase: Phase, step: int) -> None:
        """Carry out the first pending fault for ``phase`` of ``step``, if any: kill or stop
        this process (or kill its node), or raise InjectedFault. Returns when none is
        pending there, or when a stopped worker is continued."""
        key = next((key for key, spec in self._pending.items()
                    if spec.phase == phase and (self.in_join if spec.join else spec.step == step)), None)
        if key is None:
            return
        spec = self._pending.pop(key)
        log.warning("rank %d: injecting %s: %s", self.rank, key, spec)
        if self.store is not None:
            self.store.set(fault_fired_key(key), "1")
        if spec.node is not None:
            os.kill(self.launcher_pid, signal.SIGKILL)
            os.kill(os.getpid(), signal.SIGKILL)  # without waiting for the kernel's death signal
        elif spec.with_ranks:
            pids = [int(self.store.get(pid_key(peer))) for peer in spec.with_ranks]  # before any dies
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:  # that rank died before
                    pass
            os.kill(os.getpid(), signal.SIGKILL)
        elif spec.action == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif spec.action == "stop":
            os.kill(os.getpid(), signal.SIGSTOP)
        else:
            raise InjectedFault(f"{key}: {spec}")
