"""The fork server every worker of a node is forked from, started as early as a run can.

Its first start imports what the workers run (``WORKER_PRELOAD``: torch, Megatron-Core,
the tokenizer libraries; about seven seconds of one core), once for all of them.
``odyssey train`` starts it first thing, so that import overlaps with the node's own
process's (the controller side: torch, W&B), which never imports Megatron-Core itself
(``runtime.rank.entry``). No torch here: importing this module must cost nothing.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.forkserver
import signal
from typing import Sequence

__all__ = ["WORKER_PRELOAD", "start_fork_server"]

WORKER_PRELOAD = ("odyssey_megatron.runtime.rank.worker", "megatron.core.tokenizers.text.models")
"""What the fork server imports once for every worker: ``train_worker``'s module, and the
tokenizer libraries Megatron-Core's ``MegatronTokenizer`` imports on its first use (each
worker loads the tokenizer; imported there, they cost each worker seconds of CPU)."""


def start_fork_server(preload: Sequence[str]) -> multiprocessing.context.BaseContext:
    """Start the fork server now, if it is not running, in the background: it imports
    ``preload`` (``WORKER_PRELOAD`` for ``odyssey train``'s workers; a test's idle workers
    need only their own module) while this process goes on; the launcher's workers are
    forked from it. Returns its forkserver context. A server already running keeps what it
    imported.

    It starts with SIGTERM ignored (a disposition its exec keeps, and its workers inherit,
    as they ignore it anyway): SLURM signals every process of a job step, and a fork server
    killed by it would leave every worker's exit status unreadable to the launcher
    (multiprocessing reports 255 for each), though the workers live on to save the stop's
    checkpoint. SIGINT it ignores itself."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(list(dict.fromkeys(preload)))
    previous = signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        multiprocessing.forkserver.ensure_running()
    finally:
        signal.signal(signal.SIGTERM, previous)
    return context
