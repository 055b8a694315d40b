"""The phases a worker passes through: entering a plan generation, then in every training
step. The worker says which one it was in when a generation ends, and an injected fault
(``odyssey.faults``, ``runtime.rank.fault_injection``) strikes as one begins. One enum owns
the names; the recipe's ``phase`` key takes the subset a fault can strike in."""

from __future__ import annotations

from odyssey_megatron.typed_yaml import Choice

__all__ = ["FaultPhase", "Phase"]


class Phase(Choice):
    """Where a worker is. Entering a generation, in the order a rank passes them: recovery
    (entering the new plan, before its process group's rendezvous), restore (a rollback:
    reading or rebuilding the snapshot's shards), transfer (the group formed, before any block
    moves), mid_transfer (after this rank's first block moved, sent or received, before it
    waits on its others; with one block, after it moved), group_setup (a training rank, its
    blocks moved, about to build the plan's process groups while its peers build them),
    mid_group_setup (a training rank that has made the first of the plan's groups it shares
    with others, its address published to them, while its peers build them; in the first
    generation too, at step 0). In training: checkpoint (the step's disk checkpoint), snapshot
    (as a step that takes an in-memory snapshot starts, before this rank writes its part),
    forward and backward (each micro-batch), grad_sync (before the DP all-reduces), optimizer
    (after the global norm and the step's commit, before the step is applied: its replicas
    apply it)."""

    recovery = "recovery"
    restore = "restore"
    transfer = "transfer"
    mid_transfer = "mid_transfer"
    group_setup = "group_setup"
    mid_group_setup = "mid_group_setup"
    checkpoint = "checkpoint"
    snapshot = "snapshot"
    forward = "forward"
    backward = "backward"
    grad_sync = "grad_sync"
    optimizer = "optimizer"


FaultPhase = Choice("FaultPhase", [(phase.value, phase.value) for phase in (
    Phase.snapshot, Phase.forward, Phase.backward, Phase.grad_sync, Phase.optimizer, Phase.transfer, Phase.recovery,
    Phase.mid_transfer, Phase.group_setup, Phase.mid_group_setup)], module=__name__)
"""The phases a fault may strike in (``odyssey.faults[i].phase``), listed in this order in its
errors: every phase but restore and checkpoint. Each member equals the ``Phase`` of its name
(a ``Choice`` compares as its string)."""
