"""The run's timeouts and their order: a recipe's ``odyssey.`` section sets them
(``OdysseyConfig.timeouts``), the runtime's two sides wait by them (``runtime.protocol``
hands them to every worker). They sit below both, so neither imports upward."""

from __future__ import annotations

from dataclasses import dataclass

from odyssey_megatron.errors import ConfigError

__all__ = ["TIMEOUT_ORDER", "Timeouts"]

TIMEOUT_ORDER = ("heartbeat_interval", "heartbeat_timeout", "collective_timeout", "recovery_timeout")
"""Shortest first, each strictly shorter than the next. Several beats may be lost before a
peer counts as gone; a hung peer is named by its missed heartbeats before the survivors'
collectives time out on their own; and a recovery, which waits on collectives (group
init, transfers), sees a stuck one fail inside its own window, so the decision can restart
with the new survivors instead of the whole recovery timing out."""


@dataclass(frozen=True)
class Timeouts:
    """The recipe's ``odyssey.`` timeouts in seconds (documented there), checked for order."""

    heartbeat_interval: float
    heartbeat_timeout: float
    collective_timeout: float
    recovery_timeout: float
    initial_heartbeat_timeout: float = 60.0
    """The heartbeat timeout of a worker that has not entered its first plan generation yet
    (starting: imports, data, the first stage build), and of a node's launcher until every
    worker of it has registered; at least ``heartbeat_timeout``."""
    controller_reattach_s: float = 0.0
    """How long workers and launchers that lost the controller, their held blocks saved,
    keep their memory and wait for a restarted controller to reattach to (0: they exit
    after the save): the recipe's ``odyssey.controller_reattach_s``."""

    def __post_init__(self) -> None:
        if not self.initial_heartbeat_timeout >= self.heartbeat_timeout:
            raise ConfigError("odyssey.initial_heartbeat_timeout",
                              f"must be at least odyssey.heartbeat_timeout ({self.heartbeat_timeout}); "
                              f"got {self.initial_heartbeat_timeout}")
        if not self.controller_reattach_s >= 0:
            raise ConfigError("odyssey.controller_reattach_s", f"must be >= 0 seconds; got {self.controller_reattach_s}")
        for shorter, longer in zip(TIMEOUT_ORDER, TIMEOUT_ORDER[1:]):
            a, b = getattr(self, shorter), getattr(self, longer)
            if not a < b:
                raise ConfigError(
                    f"odyssey.{longer}",
                    f"must be greater than odyssey.{shorter} ({a}); got {b} (the order is {' < '.join(TIMEOUT_ORDER)})",
                )

    @property
    def poll_interval(self) -> float:
        """How often a receiver looks at heartbeats and queues: twice per beat, so a change
        is seen within half a period."""
        return self.heartbeat_interval / 2

    @property
    def controller_silence(self) -> float:
        """How long workers and launchers wait for a silent controller before they count it
        as gone: the collective timeout, not the heartbeat timeout. The controller beats
        from a thread of a busy process (the decision center plans in Python beside it),
        so on a loaded node its beats come late by more than a worker's may; counting it
        gone ends the whole run, while a controller whose process died is known at once
        from its closed connection."""
        return self.collective_timeout
