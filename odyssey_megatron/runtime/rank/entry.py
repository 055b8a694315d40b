"""The worker's entry point as a node's process names it. Importing this module costs
nothing: a node's own process (its launcher, on node 0 the controller too) only forks
workers from the fork server, which has their modules imported, and so never imports
torch's model side or Megatron-Core itself (measured: about seven seconds of one core on
every start of every node, on the tiny recipe's CPU machine)."""

from __future__ import annotations

from odyssey_megatron.runtime.protocol.launch import WorkerLaunch

__all__ = ["train_worker"]


def train_worker(launch: WorkerLaunch) -> None:
    """``runtime.rank.worker.train_worker``, imported where it runs: in the forked worker."""
    from odyssey_megatron.runtime.rank.worker import train_worker as run

    run(launch)
