"""What a launcher hands a worker process it starts, and the exit statuses they agree on."""

from __future__ import annotations

from dataclasses import dataclass, field

from odyssey_megatron.timeouts import Timeouts

EXIT_CONTROLLER_LOST = 75
"""Exit status of a worker or launcher that lost its controller (EX_TEMPFAIL)."""
EXIT_REPLACED = 76
"""Exit status of a launcher another launcher of the same node replaced (fenced)."""


@dataclass(frozen=True)
class WorkerLaunch:
    """What a launcher hands a worker process it starts (pickled by multiprocessing, locally)."""

    rank: int
    local_rank: int
    node: int
    world_size: int
    store_host: str
    store_port: int
    node_store_port: int
    """The node's store, served by its launcher on the loopback address: the worker's
    heartbeats go there (``NodeHeartbeat``), the launcher's ``NodeView`` comes back, and the
    node's ranks commit their steps together there (``runtime.rank.node_ledger``)."""
    node_ranks: tuple[int, ...]
    """Every rank its launcher runs (this one among them)."""
    launcher_pid: int
    timeouts: Timeouts
    secret: bytes = field(repr=False)
    """The run's secret (``protocol.auth``): the worker signs and checks every store value
    with it. Here, not in argv, where ``ps`` would show it."""
    keeper: tuple[tuple[str, ...], ...] = ()
    """The node's keeper memory (``snapshot.keeper``): per local rank, the paths of its two
    data and two parity buffers."""
    joining: bool = False
    """The run is under way: the worker was restarted, or its node replaced, and holds
    nothing; it waits for a generation that admits it (``PlanPublished.joined``)."""
