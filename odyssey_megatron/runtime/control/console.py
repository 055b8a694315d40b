"""What ``odyssey train`` prints on a node's terminal, and where the rest of its log goes.

The terminal reads like Megatron's: a progress line every ``logger.log_interval``
committed steps (``Progress``), each failure in one line when the controller names it
(``failure_line``) and its recovery in one line when the new plan's first step commits
(``recovery_line``), the warnings and errors an operator acts on, and the summary. Both
go through the ``odyssey_megatron.console`` logger. Everything else a node's processes
log (the launcher, the controller, the run's owner, Megatron's dataset builder) goes to
``RUN_DIR/logs/node-<n>.log``, and each worker's own output, tracebacks and gloo's
messages included, to ``RUN_DIR/logs/rank-<r>.log`` (``runtime.rank.worker_process``).
"""

from __future__ import annotations

import logging
import sys
import time
from pathlib import Path
from typing import Optional

from odyssey_megatron.runtime.control.detector import Cause, Failure

__all__ = ["CONSOLE", "Progress", "failure_line", "log_node_to", "log_to_terminal", "recovery_line"]

CONSOLE = "odyssey_megatron.console"
"""The logger whose INFO records reach the terminal: progress, failures and recoveries."""

LOGS = "logs"
"""The run directory's folder for node and rank logs."""


class _Terminal(logging.Formatter):
    """``[time] message`` as Megatron stamps its lines; other loggers' records (warnings
    and errors only) also name their level."""

    def __init__(self):
        super().__init__(datefmt="%Y-%m-%d %H:%M:%S")

    def format(self, record: logging.LogRecord) -> str:
        text = record.getMessage()
        if record.name != CONSOLE:
            text = f"{record.levelname}: {text}"
        if record.exc_info:
            text += "\n" + self.formatException(record.exc_info)
        return f"[{self.formatTime(record, self.datefmt)}] {text}"


def _for_terminal(record: logging.LogRecord) -> bool:
    return record.name == CONSOLE or record.levelno >= logging.WARNING


def log_to_terminal() -> None:
    """The process's logging for ``odyssey train``: the console lines, warnings and errors
    on stderr; INFO records are kept for the node's log file (``log_node_to``)."""
    root = logging.getLogger()
    root.setLevel(logging.INFO)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_Terminal())
    handler.addFilter(_for_terminal)
    root.addHandler(handler)


def log_node_to(run_dir: Path, node: int) -> Path:
    """Append everything this process logs to ``RUN_DIR/logs/node-<node>.log``; its path."""
    path = Path(run_dir) / LOGS / f"node-{node}.log"
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter("%(asctime)s %(name)s: %(message)s"))
    logging.getLogger().addHandler(handler)
    return path


class Progress:
    """The progress line of committed steps, laid out like Megatron's ``training_log``:
    iteration/total, consumed samples, time per iteration, samples/s and tokens/s over the
    steps since the last line (a recovery in between shows as a slower interval), the
    learning rate of the line's step, global batch, the loss averaged over those steps, the
    ranks training and the time left at that pace. The first step of a run has no interval
    behind it (the ranks were starting), so its line has no rates."""

    def __init__(self, *, train_iters: int, log_interval: int, global_batch_size: int, seq_length: int):
        self.train_iters, self.log_interval = train_iters, log_interval
        self.global_batch_size, self.seq_length = global_batch_size, seq_length
        self._since: Optional[tuple[float, int]] = None
        """(time, steps committed) where the current interval began."""
        self._losses: list[float] = []

    def committed(self, *, step: int, loss: float, lr: float, ranks: int,
                  now: Optional[float] = None) -> Optional[str]:
        """Note committed ``step`` (0-based), taken at learning rate ``lr`` by ``ranks``; the
        line to print when it ends an interval. Call once per committed step, in order."""
        now = time.monotonic() if now is None else now
        self._losses.append(loss)
        iteration = step + 1
        if iteration % self.log_interval:
            if self._since is None:  # the first commit starts the clock: before it, the ranks were starting
                self._since = now, iteration
            return None
        fields = [f"iteration {iteration:8d}/{self.train_iters:8d}",
                  f"consumed samples: {iteration * self.global_batch_size:12d}"]
        if self._since is not None:
            seconds, steps = now - self._since[0], iteration - self._since[1]
            per_step = seconds / steps
            samples_s = self.global_batch_size / per_step
            fields += [f"elapsed time per iteration (ms): {per_step * 1000:.1f}",
                       f"samples/s: {samples_s:.1f}", f"tokens/s: {samples_s * self.seq_length:.0f}"]
        fields += [f"learning rate: {lr:.6E}", f"global batch size: {self.global_batch_size:5d}",
                   f"lm loss: {sum(self._losses) / len(self._losses):.6E}", f"ranks training: {ranks:4d}"]
        if self._since is not None:
            fields.append(f"time left: {_clock((self.train_iters - iteration) * per_step)}")
        self._since, self._losses = (now, iteration), []
        return " | ".join(fields) + " |"


    def rolled_back(self) -> None:
        """The run went back to a snapshot: the steps after it are committed again, and the
        interval restarts with the first of them."""
        self._since, self._losses = None, []


def _clock(seconds: float) -> str:
    seconds = round(seconds)
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


def _ranks(ranks) -> str:
    ranks = sorted(ranks)
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks}"


_HOW = {Cause.EXIT: "from its exit", Cause.ERROR: "from its report", Cause.HEARTBEAT: "from missed heartbeats",
        Cause.STALL: "from its report of a collective past the timeout",
        Cause.STRAGGLER: "from its op times in the step reports", Cause.NODE: "from missed heartbeats",
        Cause.LATE: "as the others waited for it to enter the generation"}
"""How the controller learnt of a failure, by cause."""


def failure_line(failure: Failure) -> str:
    """One line: what failed, how it was detected and how long after it failed."""
    what = {Cause.EXIT: f"{_ranks(failure.ranks)} exited ({failure.detail})",
            Cause.ERROR: f"{_ranks(failure.ranks)} raised {failure.detail}",
            Cause.HEARTBEAT: f"{_ranks(failure.ranks)} hung ({failure.detail})",
            Cause.STALL: f"{_ranks(failure.ranks)} stalled ({failure.detail})",
            Cause.STRAGGLER: f"{_ranks(failure.ranks)} removed as a straggler ({failure.detail})",
            Cause.NODE: f"node {failure.node} lost with {_ranks(failure.ranks)} ({failure.detail})",
            Cause.LATE: f"{_ranks(failure.ranks)} late ({failure.detail})"}[failure.cause]
    return (f"failure: {what}; detected {_HOW[failure.cause]} "
            f"{failure.detected_at - failure.failed_at:.3f} s after")


def recovery_line(record: dict) -> str:
    """One line from a ``recovery`` event of ``events.jsonl``: the failed ranks and cause,
    the decision (policy, layout, source, how many plans were priced), what moved, and the
    time from the failure to the first committed step, phase by phase."""
    chosen, moved = record["chosen"], record["transfer_bytes"] / 2**20
    decided = record["decided_at"] - record["detected_at"]
    ready_at = record["ready_at"] or record["decided_at"]
    entered, first = ready_at - record["decided_at"], record["first_step_at"] - ready_at
    n = record["restarts"]
    restarts = f", decided again {n} time{'s' if n > 1 else ''} for failures during it" if n else ""
    rollback = ""
    if record.get("snapshot_step") is not None:
        rebuilt = f", {record['rebuilt_shards']} shards rebuilt from parity" if record["rebuilt_shards"] else ""
        rollback = (f" rolled back to the in-memory snapshot of step {record['snapshot_step']} "
                    f"({record['replayed_steps']} steps to train again{rebuilt}),")
    elif record.get("rolled_back_to_start"):
        rollback = f" rolled back to the run's start ({record['replayed_steps']} steps to train again),"
    return (f"recovery: {_ranks(record['failed_ranks'])} ({record['cause']}) -> {record['policy']} to "
            f"{chosen['layout']} ({record['decision_source']} decision, best of {len(record['alternatives']) + 1} "
            f"plans{restarts}),{rollback} {record['transfers']} transfers {moved:.2f} MiB, from step "
            f"{record['start_step']}; "
            f"training again {record['to_first_step_s']:.3f} s after the failure (detection "
            f"{record['detection_s']:.3f} s + decision {decided:.3f} s + entering the plan {entered:.3f} s + first "
            f"step {first:.3f} s)")


def join_line(record: dict) -> str:
    """One line per join carried out: who came back, the plan grown onto them, what moved."""
    moved = record["transfer_bytes"] / 2**20
    return (f"join: {_ranks(record['ranks'])} back -> {record['policy']} to {record['chosen']['layout']} "
            f"({record['training_ranks']} ranks training), {record['transfers']} transfers {moved:.2f} MiB, after "
            f"step {record['handover_step']}; training on the grown plan {record['to_first_step_s']:.3f} s after the "
            f"decision (waiting for the step boundary {record['handover_s']:.3f} s)")
