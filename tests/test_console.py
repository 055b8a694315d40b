"""What ``odyssey train`` prints on the terminal (``runtime.control.console``), from
made-up commits, failures and recoveries: the end-to-end check of the console is in
``tests/test_train.py``."""

from __future__ import annotations

import logging

import pytest

from odyssey_megatron.runtime.control.console import (
    CONSOLE,
    Progress,
    _for_terminal,
    _Terminal,
    failure_line,
    recovery_line,
)
from odyssey_megatron.runtime.control.detector import Cause, Failure

pytestmark = pytest.mark.timeout(60)


def progress(log_interval: int) -> Progress:
    return Progress(train_iters=20, log_interval=log_interval, global_batch_size=16, seq_length=64)


def test_a_progress_line_every_interval_reads_like_megatrons_and_rates_the_steps_since_the_last():
    p = progress(log_interval=1)
    first = p.committed(step=0, lr=1e-3, loss=6.25, ranks=8, now=100.0)
    # The ranks were starting before the first commit: no rate for it.
    assert first.startswith("iteration        1/      20 | consumed samples:           16 |")
    assert "samples/s" not in first and "time left" not in first and "lm loss: 6.250000E+00" in first
    second = p.committed(step=1, lr=1e-3, loss=6.0, ranks=8, now=100.5)
    assert ("| elapsed time per iteration (ms): 500.0 | samples/s: 32.0 | tokens/s: 2048 | learning rate: "
            "1.000000E-03 | global batch size:    16 | lm loss: 6.000000E+00 | ranks training:    8 | "
            "time left: 0:00:09 |") in second


def test_a_progress_line_shows_the_learning_rate_its_step_was_taken_at():
    p = progress(log_interval=2)
    rates = (1e-4, 5e-4, 1e-3, 8e-4)
    lines = [p.committed(step=s, lr=lr, loss=1.0, ranks=8, now=float(s)) for s, lr in enumerate(rates)]
    assert lines[0] is None and lines[2] is None
    assert "learning rate: 5.000000E-04" in lines[1] and "learning rate: 8.000000E-04" in lines[3]


def test_an_interval_averages_its_loss_and_a_recovery_inside_it_slows_its_rate():
    p = progress(log_interval=5)
    lines = [p.committed(step=s, lr=1e-3, loss=float(s), ranks=8 if s < 3 else 7, now=10.0 + s + (4.0 if s >= 3 else 0))
             for s in range(10)]
    assert lines[:4] == [None] * 4 and lines[5:9] == [None] * 4
    # Steps 2..5 (the clock starts at the first commit) took 8 s, 4 of them a recovery.
    assert "iteration        5/" in lines[4] and "elapsed time per iteration (ms): 2000.0" in lines[4]
    assert "lm loss: 2.000000E+00" in lines[4] and "ranks training:    7" in lines[4]  # steps 0..4 averaged
    assert "elapsed time per iteration (ms): 1000.0" in lines[9] and "time left: 0:00:10" in lines[9]


def test_a_failure_is_one_line_naming_what_failed_and_how_it_was_seen():
    kill = Failure(Cause.EXIT, (5,), None, failed_at=10.0, detected_at=10.042, detail="killed by SIGKILL")
    assert failure_line(kill) == "failure: rank 5 exited (killed by SIGKILL); detected from its exit 0.042 s after"
    node = Failure(Cause.NODE, (4, 5), 1, 10.0, 11.5, "launcher pid 7 on vm silent for over 1 s")
    assert failure_line(node).startswith("failure: node 1 lost with ranks [4, 5] (launcher pid 7")
    assert "from missed heartbeats 1.500 s after" in failure_line(node)


def test_a_recovery_is_one_line_with_the_decision_and_the_time_to_train_again():
    record = {"failed_ranks": [2, 6], "cause": "exit", "policy": "reroute", "decision_source": "prepared",
              "chosen": {"layout": "[2,2]x4"}, "alternatives": [{}, {}], "transfers": 0, "transfer_bytes": 0,
              "start_step": 10, "restarts": 0, "failed_at": 0.0, "detected_at": 0.01, "decided_at": 0.05,
              "ready_at": 0.45, "first_step_at": 0.95, "detection_s": 0.01, "to_first_step_s": 0.95}
    line = recovery_line(record)
    assert "\n" not in line
    assert line == ("recovery: ranks [2, 6] (exit) -> reroute to [2,2]x4 (prepared decision, best of 3 plans), "
                    "0 transfers 0.00 MiB, from step 10; training again 0.950 s after the failure (detection 0.010 s "
                    "+ decision 0.040 s + entering the plan 0.400 s + first step 0.500 s)")


def test_a_rollback_names_its_snapshot_the_steps_trained_again_and_the_shards_rebuilt():
    record = {"failed_ranks": [2, 3], "cause": "node", "policy": "reparallelize", "decision_source": "cold",
              "chosen": {"layout": "[3,3,2]x2"}, "alternatives": [], "transfers": 11, "transfer_bytes": 2**21,
              "start_step": 2, "restarts": 0, "failed_at": 0.0, "detected_at": 1.0, "decided_at": 1.1,
              "ready_at": 1.5, "first_step_at": 2.0, "detection_s": 1.0, "to_first_step_s": 2.0,
              "snapshot_step": 2, "replayed_steps": 2, "rebuilt_shards": 2}
    assert ("reparallelize to [3,3,2]x2 (cold decision, best of 1 plans), rolled back to the in-memory snapshot of "
            "step 2 (2 steps to train again, 2 shards rebuilt from parity), 11 transfers 2.00 MiB, from step 2; "
            "training again 2.000 s") in recovery_line(record)


def test_a_rollback_restarts_the_progress_interval():
    p = progress(log_interval=1)
    for s in range(4):
        p.committed(step=s, lr=1e-3, loss=1.0, ranks=8, now=float(s))
    p.rolled_back()
    again = p.committed(step=2, lr=1e-3, loss=1.0, ranks=6, now=10.0)
    assert "iteration        3/" in again and "elapsed time" not in again  # no interval behind it
    assert "elapsed time per iteration (ms): 500.0" in p.committed(step=3, lr=1e-3, loss=1.0, ranks=6, now=10.5)


def test_the_terminal_shows_the_console_and_warnings_and_keeps_info_chatter_for_the_node_log():
    def record(name, level):
        return logging.LogRecord(name, level, __file__, 1, "the message", None, None)

    assert _for_terminal(record(CONSOLE, logging.INFO))
    assert _for_terminal(record("odyssey_megatron.runtime.control.launcher", logging.ERROR))
    assert not _for_terminal(record("odyssey_megatron.runtime.control.controller", logging.INFO))
    assert not _for_terminal(record("megatron.core.datasets.gpt_dataset", logging.INFO))
    assert _Terminal().format(record(CONSOLE, logging.INFO)).endswith("] the message")
    assert _Terminal().format(record("x", logging.WARNING)).endswith("] WARNING: the message")
