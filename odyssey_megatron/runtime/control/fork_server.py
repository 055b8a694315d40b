"""The fork server every worker of a node is forked from, started as early as a run can.

Its first start imports the worker's module (torch, Megatron-Core: about ten seconds of
one core). ``odyssey train`` starts it before the node's own process imports the
controller side, which takes as long, so the two imports overlap on the node's cores
instead of following each other. No torch here: importing this module must cost nothing.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.forkserver

__all__ = ["WORKER_MODULE", "fork_context", "start_fork_server"]

WORKER_MODULE = "odyssey_megatron.runtime.rank.worker"
"""Where ``train_worker`` lives: what the fork server imports once for every worker."""


def fork_context(preload: str = WORKER_MODULE) -> multiprocessing.context.BaseContext:
    """The forkserver context, its server importing ``preload`` (when it is not running yet)."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload([preload])
    return context


def start_fork_server() -> None:
    """Start the fork server now, in the background: it imports the worker's module while
    this process goes on; the launcher's first worker reuses it."""
    fork_context()
    multiprocessing.forkserver.ensure_running()
