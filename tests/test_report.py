"""``odyssey report``: worked examples on hand-written run directories for the figures the
summary states, and the one-line errors for directories that are not runs. The report of
a real ``odyssey train`` run is tested with its run in ``test_train.py``."""

from __future__ import annotations

import json
from pathlib import Path

from odyssey_megatron.cli import main
from odyssey_megatron.report import PHASES, PLOTS, phase_seconds, read_run, samples_account, summary_text, write_report


def write_run(directory: Path, events: list[dict], samples: list[dict], *, global_batch: int = 4) -> Path:
    directory.mkdir()
    (directory / "config.yaml").write_text(f"model:\n  seq_length: 8\ntraining:\n  global_batch_size: {global_batch}\n")
    (directory / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    (directory / "samples.jsonl").write_text("".join(json.dumps(s) + "\n" for s in samples))
    return directory


def step(n: int, generation: int, time: float) -> dict:
    return {"event": "step", "time": time, "step": n, "generation": generation, "loss": 5.0 - n / 10}


RECOVERY = {"event": "recovery", "time": 14.0, "generation": 1, "failed_ranks": [2], "cause": "exit",
            "failed_at": 12.5, "detected_at": 12.75, "decided_at": 13.0, "ready_at": 13.5, "first_step_at": 14.0,
            "policy": "reroute", "decision_source": "prepared", "start_step": 3, "transfers": 0, "transfer_bytes": 0}
EVENTS = [
    {"event": "controller_started", "time": 0.0},
    {"event": "plan", "time": 0.5, "generation": 0, "policy": "initial", "workers": [0, 1, 2, 3], "start_step": 0},
    step(0, 0, 10.0), step(1, 0, 11.0), step(2, 0, 12.0),
    {"event": "failure", "time": 12.75, "cause": "exit", "ranks": [2], "failed_at": 12.5, "detected_at": 12.75},
    {"event": "plan", "time": 13.0, "generation": 1, "policy": "reroute", "workers": [0, 1, 3], "start_step": 3},
    step(3, 1, 14.0), RECOVERY, step(4, 1, 15.0),
]


def test_summary_of_a_worked_example(tmp_path):
    samples = [{"step": s, "generation": int(s >= 3), "samples": list(range(4 * s, 4 * s + 4)), "loss": 1.0}
               for s in range(5)]
    samples[4]["samples"] = [16, 17, 17, 3]  # 18 and 19 lost, 17 and 3 doubled
    run = read_run(write_run(tmp_path / "run", EVENTS, samples), key="RUN_DIR")
    assert phase_seconds(RECOVERY) == dict(zip(PHASES, (0.25, 0.25, 0.5, 0.5)))
    account = samples_account(run)
    assert (account.expected, account.distinct, account.lost, account.doubled) == (20, 18, 2, 2)
    assert summary_text(run).splitlines()[1:] == [
        "time: 10.000 s from the controller's start to the first commit, then 5.000 s for 4 more steps: "
        "3.20 samples/s, 26 tokens/s on average",
        "failures: 1",
        "  ranks [2] (exit) at +12.500 s, detected 0.250 s later",
        "recoveries: 1 (reroute 1)",
        "  generation 1: reroute (prepared decision) from step 3 after ranks [2] failed: detection 0.250 s + "
        "decision 0.250 s + "
        "entering the plan 0.500 s + first step 0.500 s = 1.500 s; 0 transfers, 0.00 MiB moved",
        "time lost to recoveries: 1.500 s (from each failure to the first step committed after it)",
        "samples: 20 expected (4 x 5 committed steps), 18 distinct seen; samples lost: 2; samples doubled: 2",
    ]


def test_a_run_that_never_committed_a_step_still_reports(tmp_path):
    run = read_run(write_run(tmp_path / "run", EVENTS[:2], []), key="RUN_DIR")
    paths = write_report(run, tmp_path / "out")
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == sorted([*PLOTS, "report.txt"])
    assert paths["report.txt"].read_text().splitlines()[-1].endswith("samples lost: 0; samples doubled: 0")


def one_line_error(capsys, *args) -> str:
    status = main(["report", *map(str, args)])
    out, err = capsys.readouterr()
    assert status == 2 and out == ""
    assert err.count("\n") == 1, err
    return err


def test_a_directory_without_events_is_refused(tmp_path, capsys):
    write_run(tmp_path / "run", EVENTS, []).joinpath("events.jsonl").unlink()
    err = one_line_error(capsys, tmp_path / "run")
    assert err.startswith("odyssey: error: RUN_DIR: ") and "holds no events.jsonl" in err


def test_garbled_events_are_refused(tmp_path, capsys):
    run = write_run(tmp_path / "run", EVENTS, [])
    with (run / "events.jsonl").open("a") as handle:
        handle.write('{"event": "step", "time": 16.0, "ste\n')
    err = one_line_error(capsys, run)
    assert err.startswith("odyssey: error: RUN_DIR: ") and f"line {len(EVENTS) + 1} is not JSON" in err
    (run / "events.jsonl").write_text(json.dumps({**RECOVERY, "ready_at": "soon"}) + "\n")
    err = one_line_error(capsys, run)
    assert "record 1 (recovery) lacks a valid ready_at" in err


def test_a_run_killed_mid_append_is_read_without_its_torn_last_line(tmp_path):
    run = write_run(tmp_path / "run", EVENTS, [{"step": 0, "generation": 0, "samples": [0, 1, 2, 3]}])
    with (run / "events.jsonl").open("a") as handle:
        handle.write('{"event": "step", "time": 16.0, "ste')
    with (run / "samples.jsonl").open("a") as handle:
        handle.write('{"step": 1, "generation": 0, "sam')
    records = read_run(run, key="RUN_DIR")
    assert len(records.events) == len(EVENTS) and list(records.samples) == [0]


def test_a_baseline_that_is_not_a_run_is_refused(tmp_path, capsys):
    run = write_run(tmp_path / "run", EVENTS, [])
    (tmp_path / "other").mkdir()
    err = one_line_error(capsys, run, "--baseline", tmp_path / "other")
    assert err.startswith("odyssey: error: --baseline: ") and "holds no events.jsonl" in err
    assert not (run / "report").exists()
