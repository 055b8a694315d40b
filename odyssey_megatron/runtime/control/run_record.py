"""The live part of a run directory, written by the controller while the run goes on:
``events.jsonl`` (one JSON object per line: joins, failures, exits, plans),
``workers.json`` (rank -> pid, host, node, generation, state; rewritten whenever one
changes, so operators and tests can find a worker) and ``plan-<generation>.json``.
The controller's polling thread and its owner both write; a lock keeps lines whole.
Listeners (``subscribe``: the live W&B trace) get every event as it is written."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any, Callable

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
        self._lock = threading.Lock()
        self._listeners: list[Callable[[dict], None]] = []

    def subscribe(self, listener: Callable[[dict], None]) -> None:
        """Hand every later event to ``listener`` too (it must return at once)."""
        self._listeners.append(listener)

    def event(self, event: str, **fields: Any) -> None:
        """Append one event, stamped with the wall-clock ``time`` it was recorded."""
        record = {"event": event, "time": time.time(), **fields}
        with self._lock:
            append_jsonl(self.events_path, record)
            for listener in self._listeners:
                listener(record)

    def workers(self, table: dict[int, dict]) -> None:
        with self._lock:
            write_json(self.workers_path, {str(rank): row for rank, row in table.items()})

    def plan(self, plan: ExecutionPlan, program: StepProgram) -> None:
        """The plan as published, with its step program (``schedules.program.read_published``
        reads it): ``write_plan`` checked the pair before it published it."""
        with self._lock:
            write_json(self.directory / f"plan-{plan.generation}.json", publish(plan, program, checked=True))
