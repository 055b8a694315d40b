"""The store keys worker and control side share, generation by generation, and the values
markers take."""

from __future__ import annotations

INBOX = "control/inbox"
"""Queue of registrations, exits, failure reports and departures, read by the controller only."""
CONTROLLER_HEARTBEAT = "heartbeat/controller"


def rank_heartbeat_key(rank: int) -> str:
    """A worker's ``Heartbeat``, in its node's store (its launcher's), not the controller's."""
    return f"heartbeat/rank/{rank}"


def node_heartbeat_key(node: int) -> str:
    """The node's ``NodeHeartbeat``: its launcher's beat with each of its workers' last one;
    or ``DOORBELL``, until the launcher's next beat."""
    return f"heartbeat/node/{node}"


DOORBELL = b"doorbell"
"""What the controller writes over a node's heartbeat key when the node's launcher must
read the controller's heartbeat at once (an abort, a kill order for it). A launcher writes
each beat with ``compare_set`` against its previous one, so one request per interval both
beats and finds whether anyone wrote there since (the doorbell, or another launcher of the
node: a replacement); otherwise it reads the controller's heartbeat only every
``heartbeat_timeout``, to see it live."""


NODE_VIEW = "node/view"
"""In a node's store: the ``NodeView`` its launcher relays to the node's workers."""


def kill_orders_key(node: int) -> str:
    """Queue of ``KillOrder``: ranks the controller declared failed, which node ``node``'s
    launcher must kill."""
    return f"control/kill/node/{node}"


def launcher_key(node: int) -> str:
    """Who launches node ``node`` now (``host:pid``), set by its launcher as it starts: a
    launcher that finds it set joins a running run (a repaired or replacement node), and
    one that finds another there has been replaced and ends its workers (fencing)."""
    return f"control/launcher/node/{node}"


def launcher_name(host: str, pid: int) -> str:
    """How a launcher names itself under ``launcher_key``: its host and process."""
    return f"{host}:{pid}"


def fenced(launcher: str) -> str:
    """What the controller writes under ``launcher_key`` over ``launcher``'s name when it
    failed that launcher's node as silent: the launcher may live on (its node, or the
    controller's view of it, stalled), so it kills its workers, which ran in a generation
    the run has left, and registers the node again, to be judged afresh."""
    return f"fenced:{launcher}"


def generation_prefix(generation: int) -> str:
    """Every key of one plan generation lives under this prefix (process groups too, through
    a ``PrefixStore``), so nothing of an aborted generation is read by the next."""
    return f"gen{generation}/"


def plan_key(generation: int) -> str:
    """The generation's plan frame (``PlanPublished.frame``), set after every op list (a
    worker that sees it finds its own): the successor of the generation before, so the
    get a worker waits in between generations returns the frame itself."""
    return successor_key(generation - 1)


def plan_ops_key(generation: int, worker: int) -> str:
    """Worker ``worker``'s op list in the generation's step program, read by its TP ranks."""
    return generation_prefix(generation) + f"ops/{worker}"


RUN_SPEC = "run/spec"
"""The training run's ``RunSpec``, set by the controller before any worker starts."""
RUN_STOP = "run/stop"
"""A ``StopOrder``, set by the controller when the run stops on purpose (a signal) or its
owner fails: every worker leaves its generation, writes the blocks the order assigns it as
of the last committed step, sets its ``stopped_key`` and exits."""
RUN_DONE = "run/done"
"""Set by the controller when the last step is committed and ``final.pt`` written: idle
workers and those waiting for a plan exit."""


PUBLISHED_GENERATION = "run/generation"
"""The newest plan generation published: where a joining worker starts watching."""


def process_group_prefix(generation: int) -> str:
    """Where a generation's ``init_process_group`` rendezvous (a ``PrefixStore``)."""
    return generation_prefix(generation) + "pg/"


def arrived_key(generation: int) -> str:
    """Counter: ranks that arrived to enter the generation. Ranks wait for all of them on
    the store, where the abort key can end the wait, before the process group's
    rendezvous, which only a timeout ends."""
    return generation_prefix(generation) + "arrived"


def kept_world_key(generation: int) -> str:
    """Counter: arriving ranks that kept the last generation's default group
    (``survivor_groups.next_world``): where every rank did, the new world may shrink it."""
    return generation_prefix(generation) + "kept-world"


def all_arrived_key(generation: int) -> str:
    """Set by the rank whose arrival completes ``arrived_key`` (``ALL_ARRIVED``), or by the
    controller when it ends the generation first (``ABORTED``): arriving ranks wait on it,
    without polling, for whichever comes first."""
    return generation_prefix(generation) + "all_arrived"


ALL_ARRIVED = b"all"
ABORTED = b"abort"


def successor_key(generation: int) -> str:
    """What follows generation ``generation`` (-1: the first plan), set by the controller
    once it is known: the next generation's plan frame (``plan_key``), or the name of
    ``RUN_STOP`` or ``RUN_DONE``. A worker between generations waits on it, without polling."""
    return generation_prefix(generation) + "successor"


def ready_key(generation: int) -> str:
    """Counter: ranks that entered the generation (groups built, blocks moved, stage built)."""
    return generation_prefix(generation) + "ready"


def abort_key(generation: int) -> str:
    """Set by the controller when a failure ends the generation: a rank waiting on the
    store (not in a collective, where the peers' closed sockets end its wait) stops."""
    return generation_prefix(generation) + "abort"


def handover_key(generation: int) -> str:
    """Set by the controller to end the generation at the next step boundary (a join): the
    rank that commits the next step decides it as the generation's last (``step_ledger``)."""
    return generation_prefix(generation) + "handover"


def applied_key(generation: int, step: int) -> str:
    """Counter: ranks of the generation whose gradients for ``step`` are final
    (``step_ledger``). The step is committed once it equals the generation's training
    ranks; the controller freezes it (``FROZEN``) when a failure ends the generation, so a
    late rank cannot commit it."""
    return generation_prefix(generation) + f"applied/{step}"


def stopped_key(rank: int) -> str:
    """Set by a rank once it carried out the ``StopOrder`` (wrote its part, or had none)."""
    return f"run/stopped/{rank}"


def reattach_verdict_key(rank: int) -> str:
    """Set by a restarted controller for a survivor of the lost one that announced itself
    (``RankReattached``): its ``ReattachVerdict``, taken back or refused."""
    return f"run/reattach/{rank}"


def decided_key(generation: int, step: int) -> str:
    """Whether ``step`` committed (``step_ledger``): set once its counter decided it, by the
    rank that completed it or by the controller that froze it."""
    return generation_prefix(generation) + f"decided/{step}"


FROZEN = -(1 << 40)
"""Added to an ``applied_key`` counter to freeze it: below zero, never the world size again."""


def step_report_key(generation: int, step: int) -> str:
    """Appended JSON lines, one per training rank of the generation that took ``step``'s
    optimizer step: ``StepReport``."""
    return generation_prefix(generation) + f"report/{step}"


def node_report_key(generation: int, step: int) -> str:
    """In a node's store: the ``StepReport`` lines of the node's ranks for ``step``
    (``runtime.rank.node_ledger``), carried to ``step_report_key`` in one append."""
    return generation_prefix(generation) + f"node/report/{step}"


def node_applied_key(generation: int, step: int) -> str:
    """In a node's store: counter of the node's ranks counted into ``step``."""
    return generation_prefix(generation) + f"node/applied/{step}"


def node_decided_key(generation: int, step: int) -> str:
    """In a node's store: ``step``'s decision, as the rank that carried the node's count left it."""
    return generation_prefix(generation) + f"node/decided/{step}"


def snapshot_parts_key(generation: int, step: int) -> str:
    """Counter: training ranks of the generation whose shard and parity chunk of the
    snapshot of ``step`` are in their node's keeper."""
    return generation_prefix(generation) + f"snapshot/{step}/parts"


def snapshot_done_key(generation: int, step: int) -> str:
    """Set by the rank whose part completed the snapshot of ``step``: it counts from now on."""
    return generation_prefix(generation) + f"snapshot/{step}/done"


def checkpoint_parts_key(generation: int, step: int) -> str:
    """Counter: training ranks of the generation whose part of the disk checkpoint of
    ``step`` is durable (``runtime.rank.checkpoint_writer``); the owner marks the checkpoint
    the latest once every writer counted in."""
    return generation_prefix(generation) + f"checkpoint/{step}/parts"


def fault_fired_key(key: str) -> str:
    """Set when the injected fault ``key`` (``odyssey.faults[i]``) fired: a restarted worker
    does not fire it again."""
    return f"faults/fired/{key}"


def final_key(generation: int) -> str:
    """Counter: ranks that wrote their part of ``final.pt``."""
    return generation_prefix(generation) + "final"
