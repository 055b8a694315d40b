"""The recovery summary ``odyssey train`` prints at the end, read back from the run
directory (``samples.jsonl`` and the ``recovery`` records of ``events.jsonl``), so it
says what the records say."""

from __future__ import annotations

import json
from pathlib import Path

__all__ = ["read_jsonl", "summarize_run"]


def read_jsonl(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def summarize_run(run_dir: Path) -> str:
    run_dir = Path(run_dir)
    steps = read_jsonl(run_dir / "samples.jsonl")
    events = read_jsonl(run_dir / "events.jsonl")
    recoveries = [e for e in events if e["event"] == "recovery"]
    lines = [f"run {run_dir}: {len(steps)} steps committed"
             + (f", loss {steps[0]['loss']:.4f} -> {steps[-1]['loss']:.4f}" if steps else "")
             + f", {len(recoveries)} recover{'y' if len(recoveries) == 1 else 'ies'}"]
    for r in recoveries:
        lines.append(
            f"  generation {r['generation']}: ranks {r['failed_ranks']} failed ({r['cause']}); {r['policy']} from "
            f"step {r['start_step']}: detected {r['detection_s']:.3f} s, planned {r['to_plan_s']:.3f} s, first step "
            f"done {r['to_first_step_s']:.3f} s after the failure; {r['transfer_bytes'] / 2**20:.2f} MiB moved")
    return "\n".join(lines)
