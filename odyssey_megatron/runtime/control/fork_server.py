"""The fork server every worker of a node is forked from, started as early as a run can.

Its first start imports the worker's module (torch, Megatron-Core: about ten seconds of
one core). ``odyssey train`` starts it before the node's own process imports the
controller side, which takes as long, so the two imports overlap on the node's cores
instead of following each other. No torch here: importing this module must cost nothing.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.forkserver
import signal

__all__ = ["WORKER_PRELOAD", "fork_context", "start_fork_server"]

WORKER_PRELOAD = ("odyssey_megatron.runtime.rank.worker", "megatron.core.tokenizers.text.models")
"""What the fork server imports once for every worker: ``train_worker``'s module, and the
tokenizer libraries Megatron-Core's ``MegatronTokenizer`` imports on its first use (each
worker loads the tokenizer; imported there, they cost each worker seconds of CPU)."""


def fork_context(target_module: str = WORKER_PRELOAD[0]) -> multiprocessing.context.BaseContext:
    """The forkserver context; its server, when not running yet, imports the workers'
    modules and ``target_module`` (where the launcher's worker function lives)."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(list(dict.fromkeys((target_module, *WORKER_PRELOAD))))
    return context


def start_fork_server(target_module: str = WORKER_PRELOAD[0]) -> multiprocessing.context.BaseContext:
    """Start the fork server now, if it is not running, in the background: it imports the
    worker's module while this process goes on; the launcher's workers are forked from it.
    Returns its context (``fork_context``).

    It starts with SIGTERM ignored (a disposition its exec keeps, and its workers inherit,
    as they ignore it anyway): SLURM signals every process of a job step, and a fork server
    killed by it would leave every worker's exit status unreadable to the launcher
    (multiprocessing reports 255 for each), though the workers live on to save the stop's
    checkpoint. SIGINT it ignores itself."""
    context = fork_context(target_module)
    previous = signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        multiprocessing.forkserver.ensure_running()
    finally:
        signal.signal(signal.SIGTERM, previous)
    return context
