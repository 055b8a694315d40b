"""Node 0 prepares the run's data (``data.prepare_data``) in a process of its own, forked
from the workers' fork server, which has the tokenizer libraries and Megatron-Core's
datasets imported already.

Why apart: node 0's process hosts the controller, whose polling thread judges every
node's liveness. Tokenizing a corpus holds the interpreter's lock for minutes, and
importing what it needs (Megatron-Core, transformers, datasets) costs seconds of CPU on
every start: in the controller's process, both stall its polling thread, and on a
loaded machine they are most of a short run's start-up.
"""

from __future__ import annotations

import logging
import signal
import traceback
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Callable, Optional

from odyssey_megatron.config import RecipeConfig
from odyssey_megatron.data import PreparedData
from odyssey_megatron.errors import ConfigError
from odyssey_megatron.runtime.control.console import log_node_to, log_to_terminal
from odyssey_megatron.runtime.control.fork_server import WORKER_PRELOAD, start_fork_server

__all__ = ["prepare_apart"]

log = logging.getLogger(__name__)


def prepare_apart(config: RecipeConfig, *, run_dir: Path, stopped: Callable[[], bool],
                  poll_s: float) -> Optional[PreparedData]:
    """The data ``config`` names, prepared in a child process; None when ``stopped()``
    turned true first (the child is killed: a stop need not wait for a corpus to be
    tokenized). A user error (a missing corpus, a tokenizer too large, an untrusted cache
    file) is the ConfigError the child met; a child that dies without an answer is a
    RuntimeError that says how it ended."""
    context = start_fork_server(WORKER_PRELOAD)
    answers, answer_end = context.Pipe(duplex=False)
    child = context.Process(target=_prepare_and_answer, args=(config, run_dir, answer_end), name="odyssey-data")
    child.start()
    answer_end.close()  # the child holds the only writing end: its death reads as EOF here
    try:
        while not answers.poll(poll_s):
            if stopped():
                child.kill()
                return None
        try:
            answer = answers.recv()
        except EOFError:
            answer = None
    finally:
        answers.close()
        child.join()
    if answer is None:
        raise RuntimeError(f"preparing the data ended with exit status {child.exitcode} and no answer "
                           f"(see {run_dir}/logs/node-0.log)")
    kind, *detail = answer
    if kind == "prepared":
        return detail[0]
    if kind == "config_error":
        raise ConfigError(*detail)
    raise RuntimeError(f"preparing the data failed:\n{detail[0]}")


def _prepare_and_answer(config: RecipeConfig, run_dir: Path, answer: Connection) -> None:
    """In the child: prepare, then send ("prepared", PreparedData), ("config_error", key,
    problem) or ("failed", traceback). It logs as node 0's process does: warnings on the
    terminal, everything in node 0's log. Ctrl-C reaches every process of the terminal's
    group: the child leaves stopping to its parent, which kills it."""
    import datasets

    from odyssey_megatron.data import prepare_data

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    log_to_terminal()
    log_node_to(run_dir, 0)
    datasets.disable_progress_bars()  # the terminal shows training progress; preparing data is logged
    model, train, data = config.model, config.training, config.data
    try:
        prepared = prepare_data(corpus=data.corpus, tokenizer=data.tokenizer, vocab_size=model.vocab_size,
                                seq_length=model.seq_length, num_samples=train.train_iters * train.global_batch_size,
                                seed=train.seed, cache_dir=data.cache_dir)
        answer.send(("prepared", prepared))
    except ConfigError as exc:  # already names its key (an untrusted cache file: file_trust)
        answer.send(("config_error", exc.key, exc.problem))
    except ValueError as exc:
        answer.send(("config_error", "data.corpus", str(exc)))
    except Exception:  # noqa: BLE001 - a bug: its traceback goes to the parent, which raises it
        log.exception("preparing the data failed")
        answer.send(("failed", traceback.format_exc()))
    finally:
        answer.close()
