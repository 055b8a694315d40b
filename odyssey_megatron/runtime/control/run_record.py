"""The live part of a run directory, written by the controller while the run goes on:
``events.jsonl`` (one JSON object per line: joins, failures, exits, plans),
``workers.json`` (rank -> pid, host, node, generation, state; rewritten whenever one
changes, so operators and tests can find a worker) and ``plan-<generation>.json``.

The controller's polling thread and its owner both record, and neither may wait on a
disk: every write is fsynced, and ``plan-<g>.json`` takes seconds at 16,384 ranks, while a
polling thread held that long would find every node silent. So records are queued and
one writer thread of the record's own writes them in order; ``flush`` waits until all
queued are on disk. Listeners (``subscribe``: the live W&B trace) get every event on that
thread, as it is written."""

from __future__ import annotations

import queue
import threading
import time
from pathlib import Path
from typing import Any, Callable, Optional

from odyssey_megatron.plan import ExecutionPlan
from odyssey_megatron.run_dir import append_jsonl, write_json
from odyssey_megatron.schedules.program import StepProgram, publish

__all__ = ["RunRecord"]


class RunRecord:
    def __init__(self, directory: Path):
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.events_path = self.directory / "events.jsonl"
        self.workers_path = self.directory / "workers.json"
        self._listeners: list[Callable[[dict], None]] = []
        self._writes: queue.Queue[Callable[[], None]] = queue.Queue()
        """Writes not done yet, in the order they were asked for."""
        self._failed: Optional[BaseException] = None
        """The error a write raised: the next call raises it (a record must not go missing silently)."""
        self._writer = threading.Thread(target=self._write_all, name="odyssey-run-record", daemon=True)
        self._writer.start()

    def subscribe(self, listener: Callable[[dict], None]) -> None:
        """Hand every later event to ``listener`` too (on the writer thread; it must return at once)."""
        self._listeners.append(listener)

    def event(self, event: str, **fields: Any) -> None:
        """Append one event, stamped with the wall-clock ``time`` it was recorded (now, not
        when it reaches the disk)."""
        record = {"event": event, "time": time.time(), **fields}

        def write() -> None:
            append_jsonl(self.events_path, record)
            for listener in self._listeners:
                listener(record)

        self._queue(write)

    def workers(self, table: dict[int, dict]) -> None:
        rows = {str(rank): row for rank, row in table.items()}
        self._queue(lambda: write_json(self.workers_path, rows))

    def plan(self, plan: ExecutionPlan, program: StepProgram) -> None:
        """The plan as published, with its step program (``schedules.program.read_published``
        reads it): ``write_plan`` checked the pair before it published it. Both are frozen,
        so the writer thread may encode them later."""
        path = self.directory / f"plan-{plan.generation}.json"
        self._queue(lambda: write_json(path, publish(plan, program, checked=True)))

    def flush(self) -> None:
        """Wait until every record asked for so far is written (and its listeners called)."""
        self._writes.join()
        self._raise_failure()

    def _queue(self, write: Callable[[], None]) -> None:
        self._raise_failure()
        self._writes.put(write)

    def _raise_failure(self) -> None:
        if self._failed is not None:
            raise RuntimeError(f"the run record could not be written in {self.directory}") from self._failed

    def _write_all(self) -> None:
        while True:
            write = self._writes.get()
            try:
                if self._failed is None:
                    write()
            except BaseException as exc:  # noqa: BLE001 - raised to the next caller, not lost on this thread
                self._failed = exc
            finally:
                self._writes.task_done()
