"""The worker's entry point as a node's process names it. Importing this module costs
nothing: a node's own process (its launcher, on node 0 the controller too) only forks
workers from the fork server, which has their modules imported, and so never imports
torch's model side or Megatron-Core itself (measured on node 0 of the tiny recipe: its
process's CPU per start fell from 10.4-11.4 s to 5.4-6.3 s with the data and final-model
changes beside this)."""

from __future__ import annotations

from odyssey_megatron.runtime.protocol.launch import WorkerLaunch

__all__ = ["train_worker"]


def train_worker(launch: WorkerLaunch) -> None:
    """``runtime.rank.worker.train_worker``, imported where it runs: in the forked worker."""
    from odyssey_megatron.runtime.rank.worker import train_worker as run

    run(launch)
