"""``odyssey train`` end to end: the tiny recipe on 8 gloo ranks through the real
launcher, controller and workers, with failures injected from the config. A run that
loses ranks must finish with the same model (``final.pt``, per tensor) and the same
samples per step (``samples.jsonl``) as the failure-free run of the same steps.

Each run holds several failures one after another, so that every phase, action and
policy is covered by a few runs (each costs ~35 s of two shared cores)."""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from once import built_once
from PIL import Image
from wandb_records import history, wandb_records

from odyssey_megatron.cli import main
from odyssey_megatron.config import load_config
from odyssey_megatron.profile_file import profile_json, recipe_measured_for, recipe_profile, write_profile
from odyssey_megatron.report import PLOTS, phase_seconds
from odyssey_megatron.runtime.checkpoint_index import latest_checkpoint
from odyssey_megatron.runtime.protocol.auth import SECRET_FILE

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes" / "llama2_7b" / "tiny_cpu.yaml"
STEPS = 5
GROWING_STEPS = 12
RUN_TIMEOUT_S = 300

pytestmark = pytest.mark.timeout(2 * RUN_TIMEOUT_S)


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.fixture(scope="module")
def data_cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("data-cache")


def train(run_dir: Path, data_cache: Path, *args: str, node_rank: int | None = None,
          steps: int = STEPS) -> subprocess.Popen:
    """Start ``odyssey train`` on the tiny recipe for ``steps`` steps."""
    command = [sys.executable, "-m", "odyssey_megatron.cli", "train", "--config", str(RECIPE), "--run-dir",
               str(run_dir), f"training.train_iters={steps}", f"data.cache_dir={data_cache}", *args]
    if node_rank is not None:
        command += ["--node-rank", str(node_rank)]
    # A session of its own: a test can freeze or signal the node's whole process group.
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                            start_new_session=True)


def finish(process: subprocess.Popen) -> tuple[int, str, str]:
    try:
        out, err = process.communicate(timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        process.kill()
        out, err = process.communicate()
    return process.returncode, out, err


def train_nodes(run_dir: Path, data_cache: Path, nodes: int, *args: str) -> tuple[int, str, str]:
    """``odyssey train`` as ``nodes`` node processes on this machine, to the end: node 0's
    (status, stdout, stderr)."""
    processes = [train(run_dir, data_cache, *args, node_rank=node) for node in range(nodes)]
    outcome = finish(processes[0])
    for process in processes[1:]:
        finish(process)
    return outcome


def faults(*specs: str) -> str:
    return f"odyssey.faults=[{', '.join(specs)}]"


def slow_device(directory: Path, *, forward_s: float) -> str:
    """``cluster.emulate_device=<profile>``: the tiny recipe's profile with each layer's
    forward at ``forward_s`` and backward at twice that. Every rank pads its ops to those
    times (their results stay those of real time), so steps take seconds: a test that acts
    from outside once a step is recorded (a signal, a kill, a freeze) lands a step or two
    later, not after the last of five fast steps (the controller records commits a few
    steps behind the ranks while it starts)."""
    config = load_config(RECIPE)
    profile = recipe_profile(config)
    layers = tuple(replace(layer, forward_s=forward_s, backward_s=2 * forward_s, weight_grad_s=None)
                   for layer in profile.layers)
    path = directory / f"slow-device-{forward_s}.json"
    write_profile(path, profile_json(replace(profile, layers=layers), measured_for=recipe_measured_for(config),
                                     source={}))
    return f"cluster.emulate_device={path}"


def _failure_free(tmp_path_factory, data_cache: Path, name: str, steps: int) -> Path:
    """The failure-free run of ``steps`` steps, built once for every xdist worker."""
    def run(directory: Path) -> str:
        status, _, err = finish(train(directory / name, data_cache, steps=steps))
        assert status == 0, err[-4000:]
        return str(directory / name)
    return Path(built_once(tmp_path_factory, name, run))


@pytest.fixture(scope="module")
def reference(tmp_path_factory, data_cache) -> Path:
    return _failure_free(tmp_path_factory, data_cache, "failure-free", STEPS)


@pytest.fixture(scope="module")
def long_reference(tmp_path_factory, data_cache) -> Path:
    """The failure-free run of ``GROWING_STEPS`` steps: long enough to lose workers and grow back."""
    return _failure_free(tmp_path_factory, data_cache, "failure-free-long", GROWING_STEPS)


def assert_same_training(run_dir: Path, reference: Path, *, controller_killed: bool = False) -> None:
    """Same samples in every step and the same final model as the failure-free run.
    ``controller_killed``: a SIGKILLed controller takes the events its record thread had not
    written yet with it, so a step it committed may have no step event (its samples are in)."""
    steps, expected = read_jsonl(run_dir / "samples.jsonl"), read_jsonl(reference / "samples.jsonl")
    assert [s["step"] for s in steps] == list(range(len(expected)))
    assert [s["samples"] for s in steps] == [s["samples"] for s in expected]
    final, want = torch.load(run_dir / "final.pt"), torch.load(reference / "final.pt")
    assert final.keys() == want.keys()
    for name, tensor in want.items():
        assert torch.allclose(final[name], tensor, rtol=1e-4, atol=1e-6), name
    # Every commit of a step (a step trained again after a rollback too) at the failure-free run's rate.
    rates, expected_rates = step_rates(run_dir), {step: {rate} for step, (rate,) in step_rates(reference).items()}
    if controller_killed:
        assert rates and all(rates[step] == expected_rates[step] for step in rates), rates
    else:
        assert rates == expected_rates


def step_rates(run_dir: Path) -> dict[int, set[float]]:
    """The learning rates each step was committed at, from the run's step events."""
    rates: dict[int, set[float]] = {}
    for event in read_jsonl(run_dir / "events.jsonl"):
        if event["event"] == "step":
            rates.setdefault(event["step"], set()).add(event["lr"])
    return rates


def megatron_rates(steps: int) -> list[float]:
    """The tiny recipe's learning rate per step as Megatron-LM runs its keys (2 warmup steps
    from 0, cosine to min_lr 1e-4 at the last step): Megatron-Core's scheduler, made with
    sample counts, stepped by the global batch after each iteration."""
    batch, groups = 16, SimpleNamespace(param_groups=[{}])
    scheduler = OptimizerParamScheduler(groups, init_lr=0.0, max_lr=1e-3, min_lr=1e-4, lr_warmup_steps=2 * batch,
                                        lr_decay_steps=steps * batch, lr_decay_style="cosine", start_wd=0.01,
                                        end_wd=0.01, wd_incr_steps=steps * batch, wd_incr_style="constant")
    rates = []
    for _ in range(steps):
        rates.append(groups.param_groups[0]["lr"])
        scheduler.step(increment=batch)
    return rates


def run_logs(run_dir: Path) -> str:
    """For a failed assertion: the tail of each node's log and the warnings and errors of
    each rank's."""
    text = ""
    for log in sorted(run_dir.glob("logs/*.log")):
        lines = log.read_text(errors="replace").splitlines()
        if log.name.startswith("rank-"):
            lines = [line for line in lines if any(w in line for w in ("WARNING", "ERROR", "Error", "stopped", "saved"))]
        text += f"\n--- {log.name}:\n" + "\n".join(lines[-30:])
    return text


def recoveries(run_dir: Path) -> list[dict]:
    return [e for e in read_jsonl(run_dir / "events.jsonl") if e["event"] == "recovery"]


def wandb_runs(run_dir: Path) -> list[Path]:
    """The run's offline W&B run directories (one per ``odyssey train`` invocation)."""
    return sorted((run_dir / "wandb").glob("offline-run-*"))


def read_wandb_run(directory: Path, table_name: str = "recoveries") -> tuple[str, list[dict], list[dict]]:
    """(run id, history rows, rows of the table ``table_name``) as W&B recorded them."""
    records = wandb_records(next(directory.glob("run-*.wandb")))
    run_id = next(r.run.run_id for r in records if r.WhichOneof("record_type") == "run")
    rows = []
    for table in sorted(directory.glob(f"files/media/table/{table_name}_*.table.json"),
                        key=lambda p: int(p.name.split("_")[1])):
        data = json.loads(table.read_text())
        rows += [dict(zip(data["columns"], row)) for row in data["data"]]
    return run_id, history(records), rows


def test_failure_free_run_commits_every_step_on_every_sample_once(reference):
    steps = read_jsonl(reference / "samples.jsonl")
    assert [s["step"] for s in steps] == list(range(STEPS))
    samples = [i for s in steps for i in s["samples"]]
    assert sorted(samples) == list(range(STEPS * 16))  # global batch 16, micro-batch 2
    assert all(s["generation"] == 0 for s in steps)
    workers = json.loads((reference / "workers.json").read_text())
    assert sorted(int(r) for r in workers) == list(range(8))
    assert all(row["state"] == "exited" for row in workers.values())
    assert (reference / "plan-0.json").is_file() and (reference / "config.yaml").is_file()
    events = [e["event"] for e in read_jsonl(reference / "events.jsonl")]
    assert "failure" not in events and events.count("step") == STEPS and "finished" in events
    # The online profile: the ranks' op times rescaled the profile after step 1 (step 0 allocates).
    rescaled = [e for e in read_jsonl(reference / "events.jsonl") if e["event"] == "profile"]
    assert rescaled and rescaled[0]["step"] == 1 and all(e["generation"] == 0 for e in rescaled)
    assert all(e[kind] > 0 for e in rescaled for kind in ("forward", "backward", "optimizer", "estimated_step_s"))
    (wandb_run,) = wandb_runs(reference)
    rows = read_wandb_run(wandb_run)[1]
    assert [row["profile/forward_scale"] for row in rows if "profile/forward_scale" in row] == [
        e["forward"] for e in rescaled]
    steps = {row["step"]: row for row in rows if "train/loss" in row}
    measured = [steps[s].get("train/step_time_s") for s in range(STEPS)]
    assert measured[0] is None and all(t > 0 for t in measured[1:])  # step 0 waits for every rank to start
    assert all(steps[s]["train/tokens_per_s"] == pytest.approx(16 * 64 / measured[s]) for s in range(1, STEPS))
    # Warmup, then cosine decay: each step at Megatron-Core's rate, in the events and in W&B.
    expected = megatron_rates(STEPS)
    assert len(set(expected)) == STEPS and step_rates(reference) == {s: {rate} for s, rate in enumerate(expected)}
    assert [steps[s]["train/lr"] for s in range(STEPS)] == pytest.approx(expected, rel=1e-12)


def test_rerouting_survives_a_kill_a_hang_and_an_error_with_nothing_lost(tmp_path, data_cache, reference):
    """Four failures, one per step and one per stage (each stage keeps a replica): SIGKILL
    in backward, SIGSTOP in forward (found by its missed heartbeats, killed by its
    launcher), an exception in the gradient sync, SIGKILL in forward."""
    run_dir = tmp_path / "run"
    status, _, err = finish(train(run_dir, data_cache, "odyssey.policy=reroute", faults(
        "{rank: 5, step: 1, phase: backward, action: kill}",
        "{rank: 2, step: 2, phase: forward, action: stop}",
        "{rank: 7, step: 3, phase: grad_sync, action: raise}",
        "{rank: 1, step: 4, phase: forward, action: kill}")))
    assert status == 0, err[-4000:]
    assert_same_training(run_dir, reference)
    done = recoveries(run_dir)
    assert [(r["failed_ranks"], r["cause"], r["policy"], r["start_step"]) for r in done] == [
        ([5], "exit", "reroute", 1), ([2], "heartbeat", "reroute", 2), ([7], "error", "reroute", 3),
        ([1], "exit", "reroute", 4)]
    assert all(r["to_first_step_s"] > r["to_plan_s"] >= r["detection_s"] >= 0 for r in done)
    (wandb_run,) = wandb_runs(run_dir)
    run_id, rows, table = read_wandb_run(wandb_run)
    assert run_id == (run_dir / "wandb-run-id").read_text().strip()
    steps = {row["step"]: row for row in rows if "train/loss" in row}
    assert sorted(steps) == list(range(STEPS))
    assert [steps[s["step"]]["train/loss"] for s in read_jsonl(run_dir / "samples.jsonl")] == [
        s["loss"] for s in read_jsonl(run_dir / "samples.jsonl")]
    assert [steps[s]["train/training_ranks"] for s in range(STEPS)] == [8, 7, 6, 5, 4]
    assert all(row["train/estimated_step_time_s"] > 0 for row in steps.values())
    recovered = [row for row in rows if "recovery/to_first_step_s" in row]
    assert [row["recovery/to_first_step_s"] for row in recovered] == [r["to_first_step_s"] for r in done]
    assert [(row["failed_ranks"], row["policy"]) for row in table] == [
        (str(r["failed_ranks"]), r["policy"]) for r in done]



def test_a_rank_at_half_speed_is_the_one_removed_as_a_straggler_and_nothing_is_lost(tmp_path, data_cache,
                                                                                   long_reference):
    """Rank 3 runs every op at a quarter speed for the whole run, its heartbeats alive: its
    op times single it out after three slow steps, and with odyssey.straggler=remove it, and
    only it, is failed and recovered from as any failure. No healthy rank is blamed at a
    2.5x threshold: with two runs of 8 ranks on 2 cores (CI's load), a healthy rank's
    millisecond ops measured 1.5-1.9x its peers' for three steps in a row, and a 2x rank
    as little as 1.04x in one step; above 2.5x only one healthy step in about 50."""
    run_dir = tmp_path / "run"
    status, out, err = finish(train(run_dir, data_cache, "odyssey.straggler=remove", "odyssey.straggler_steps=3",
                                    "odyssey.straggler_slowdown=2.5",
                                    faults(f"{{action: slow, rank: 3, step: 0, factor: 4.0, steps: {GROWING_STEPS}}}"),
                                    steps=GROWING_STEPS))
    assert status == 0, err[-4000:] + run_logs(run_dir)
    assert_same_training(run_dir, long_reference)
    events = read_jsonl(run_dir / "events.jsonl")
    [straggler] = [e for e in events if e["event"] == "straggler"]
    assert (straggler["rank"], straggler["action"]) == (3, "remove") and straggler["slowdown"] > 2.5, straggler
    failures = [e for e in events if e["event"] == "failure"]
    assert [(f["cause"], f["ranks"]) for f in failures] == [("straggler", [3])], failures
    assert "straggler: rank 3: its ops took" in out + err
    assert "injecting odyssey.faults[0]: slow rank 3 x4 for steps 0..11" in (run_dir / "logs" / "rank-3.log").read_text()


@pytest.fixture(scope="module")
def reparallelized(tmp_path_factory, data_cache) -> tuple[Path, str]:
    """A reparallelizing run through five failures, each injected where a recovery or a
    step is most exposed; its run directory and every rank's log lines in time order.

    The last two kills are aimed at the plan rank 4's loss leaves (generation 3: workers
    0, 3, 6 as stages of layers 0-2, 3-5, 6-7 beside workers 1, 7 with layers 0-3, 4-7):
    every block ranks 0 and 3 hold lives on rank 1 or 7 too, and rank 6's layers on rank 7,
    so every recovery goes on from what the survivors hold. Ranks 0 and 7 would leave rank 6
    the last copy of layers 6-7, and its kill a rollback to the start."""
    def run(directory: Path) -> tuple[str, str]:
        run_dir = directory / "reparallelized"
        # The rate fixed at the recipe's prior: five kills seconds apart would make the rate
        # from evidence expect a failure every few seconds, and Eq. 8 then picks plans that
        # move nothing, where this test is about transfers cut short.
        status, _, err = finish(train(run_dir, data_cache, "odyssey.policy=reparallelize",
                                      "odyssey.learn_failure_rate=false", faults(
            "{rank: 5, step: 1, phase: backward, action: kill}",
            "{rank: 2, step: 1, phase: mid_transfer, action: kill}",
            "{rank: 4, step: 2, phase: grad_sync, action: kill}",
            "{rank: 0, step: 3, phase: optimizer, action: kill, with_ranks: [3]}",
            "{rank: 6, step: 4, phase: group_setup, action: kill}")))
        if status != 0:
            pytest.fail(f"odyssey train exited {status}:\n{err[-4000:]}")
        return str(run_dir), rank_log_lines(run_dir)
    run_dir, lines = built_once(tmp_path_factory, "reparallelized", run)
    return Path(run_dir), lines


def rank_log_lines(run_dir: Path) -> str:
    """Every rank's log lines, in time order."""
    lines = [line for log in (run_dir / "logs").glob("rank-*.log") for line in log.read_text().splitlines()]
    return "\n".join(sorted(line for line in lines if line[:4].isdigit()))


GROUP_SETUP = {"group_setup", "mid_group_setup"}
"""A training rank's phases while it sets up the plan's groups: before them, then once it
shares one (the guard connects them once all are made)."""


def ended_in(err: str, rank: int, generation: int) -> str:
    """The phase in which ``rank``'s worker logged that ``generation`` ended under it."""
    marker = f"rank {rank}: generation {generation} ended in "
    (line,) = [line for line in err.splitlines() if marker in line]
    return line.split(marker)[1].split(" of step")[0]


def test_reparallelizing_survives_kills_mid_transfer_in_group_setup_and_two_at_once(reparallelized, reference):
    """A kill in backward; in the recovery that follows, a second rank killed once its
    first block has moved (the decision restarts from what the survivors hold, blocks
    received included); a kill in the gradient sync; two ranks killed in one instant in
    the optimizer step, after step 3 committed and before they applied it (their replicas
    apply it, so the next plan starts at step 4); then a third as the survivors build that
    plan's process groups (the decision restarts)."""
    run_dir, err = reparallelized
    assert_same_training(run_dir, reference)
    events = read_jsonl(run_dir / "events.jsonl")
    injected = [line.split("injecting ")[1] for line in err.splitlines() if ": injecting odyssey.faults[" in line]
    assert injected == [
        "odyssey.faults[0]: kill rank 5 at step 1, backward", "odyssey.faults[1]: kill rank 2 at step 1, mid_transfer",
        "odyssey.faults[2]: kill rank 4 at step 2, grad_sync",
        "odyssey.faults[3]: kill ranks 0, 3 at step 3, optimizer", "odyssey.faults[4]: kill rank 6 at step 4, group_setup"]
    failures = {tuple(e["ranks"]): e for e in events if e["event"] == "failure"}
    assert sorted(failures) == [(0,), (2,), (3,), (4,), (5,), (6,)]
    plans = [e for e in events if e["event"] == "plan"]

    def plan_before(failure: dict) -> dict:
        """The generation running (or being entered) when ``failure`` struck."""
        return [p for p in plans if p["time"] < failure["detected_at"]][-1]

    # Ranks 0 and 3 failed in one instant. The controller decides once for failures that
    # reach it while it gathers (a poll after it noticed the first); on a busy machine one
    # may die later than that (the kernel's teardown of a killed process waits for a core)
    # and is a restart. Every plan published since the first of them is one try of the
    # last recovery: rank 6's kill in group setup restarts it at least once.
    first_at = min(failures[(0,)]["detected_at"], failures[(3,)]["detected_at"])
    tries = [p for p in plans if p["time"] > first_at]
    together = not {0, 3} & set(tries[0]["workers"])
    done = recoveries(run_dir)
    assert [(r["failed_ranks"], r["policy"], r["start_step"]) for r in done] == [
        ([2, 5], "reparallelize", 1), ([4], "reparallelize", 2), ([0, 3, 6], "reparallelize", 4)]
    assert [r["restarts"] for r in done] == [1, 0, len(tries) - 1] and len(tries) >= 2
    assert all(r["transfer_bytes"] > 0 and r["mapping_bytes"] <= r["naive_mapping_bytes"] for r in done)
    if together:
        assert not {0, 3} & set(plan_before(failures[(6,)])["workers"])

    # Rank 2 died in generation 1's transfers with a block still to move after its first;
    # if it sent that first block, its receiver (with nothing else to move with it) holds
    # it and went on to build the groups.
    assert plan_before(failures[(2,)])["generation"] == 1
    moves = [t for t in json.loads((run_dir / "plan-1.json").read_text())["transfers"] if 2 in (t["src"], t["dst"])]
    assert len(moves) >= 2, moves
    receiver = moves[0]["dst"]
    if moves[0]["src"] == 2 and sum(receiver in (t["src"], t["dst"]) for t in moves) == 1:
        assert ended_in(err, receiver, 1) in GROUP_SETUP

    # Rank 6 died entering a plan as a training rank, while its peers built the groups.
    entered = plan_before(failures[(6,)])
    assert entered["start_step"] == 4 and 6 in entered["workers"]
    assert {ended_in(err, rank, entered["generation"]) for rank in set(entered["workers"]) - {6}} <= GROUP_SETUP


def test_a_rank_lost_while_the_survivors_build_groups_costs_no_collective_timeout(reparallelized):
    """The two kills above that leave survivors building process groups with a dead
    peer (mid_transfer, group_setup): the controller's abort ends their wait as the groups
    are connected (``CollectiveGuard.track``), and they are back in the restarted decision's
    plan well inside the collective timeout (30 s)."""
    run_dir, _ = reparallelized
    events = read_jsonl(run_dir / "events.jsonl")
    failed_at = {tuple(e["ranks"]): e["failed_at"] for e in events if e["event"] == "failure"}
    ready_at = {tuple(r["failed_ranks"]): r["ready_at"] for r in recoveries(run_dir)}
    waited = {"mid_transfer": ready_at[(2, 5)] - failed_at[(2,)], "group_setup": ready_at[(0, 3, 6)] - failed_at[(6,)]}
    assert max(waited.values()) < 10, waited


def test_a_rank_killed_as_the_first_generation_builds_its_groups_takes_no_survivor_with_it(tmp_path, data_cache,
                                                                                          reference):
    """Rank 3 dies in generation 0 having published its address in the first of the plan's
    groups it shares, while its peers build theirs (mid_group_setup: it never connects).
    The survivors make their groups without waiting for it and leave the generation while
    the guard connects them, at the controller's abort or a refused connection, as a lost
    peer: none reports an error of its own or a stall (found by hurting a run from
    outside: survivors held five collective timeouts inside ``new_group``, others failing
    in it, one after another), and all are back in the next plan well inside the
    collective timeout (30 s); the run ends with the failure-free model."""
    run_dir = tmp_path / "run"
    status, _, err = finish(train(run_dir, data_cache, faults("{rank: 3, step: 0, phase: mid_group_setup, action: kill}")))
    assert status == 0, err[-4000:] + run_logs(run_dir)
    assert_same_training(run_dir, reference)
    lines = rank_log_lines(run_dir)
    assert "rank 3: injecting odyssey.faults[0]: kill rank 3 at step 0, mid_group_setup" in lines
    failures = [e for e in read_jsonl(run_dir / "events.jsonl") if e["event"] == "failure"]
    assert [(f["ranks"], f["cause"]) for f in failures] == [([3], "exit")], failures
    assert {ended_in(lines, rank, 0) for rank in set(range(8)) - {3}} <= GROUP_SETUP  # each left, none failed
    (recovery,) = recoveries(run_dir)
    assert recovery["failed_ranks"] == [3] and recovery["start_step"] == 0
    assert recovery["ready_at"] - recovery["failed_at"] < 10, recovery


def _free_port() -> int:
    """A free port below the kernel's ephemeral range. The other nodes try to connect
    before node 0 listens; a connection to a free port inside that range may be given the
    same port as its own source (a TCP self-connect), which then holds the port node 0
    needs."""
    range_file = Path("/proc/sys/net/ipv4/ip_local_port_range")
    low = int(range_file.read_text().split()[0]) if range_file.is_file() else 32768
    for port in random.sample(range(10_000, low), 100):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in 10000..{low - 1}")


def test_a_lost_node_is_planned_as_one_failure_beside_a_dedicated_controller(tmp_path, data_cache, reference):
    """Node 0 runs only the controller (``cluster.dedicated_controller``, as a CPU host
    would); nodes 1 and 2 run 4 ranks each (DP 8). Killing node 2's launcher takes its
    workers with it: one node failure, and node 1 trains on. With no memory for a decision
    per worker and node, as on a large cluster, the controller prepared node 1's and
    renames it for node 2 (``planner.symmetry``): the run trains on the renamed plan. The
    starting profile throughout, so that nothing restarts the preparation, done long
    before the failure, just before it."""
    run_dir, port = tmp_path / "run", _free_port()
    common = ["parallel.pipeline_model_parallel_size=1", "parallel.data_parallel_size=8",
              "cluster.devices_per_node=4", "cluster.dedicated_controller=true", "odyssey.prepared_decisions_mib=0",
              "odyssey.online_profile=false", "--nnodes", "3", "--master-port", str(port),
              faults("{node: 2, step: 2, phase: backward, action: kill}")]
    status, out, err = train_nodes(run_dir, data_cache, 3, *common)
    assert status == 0, err[-4000:]
    done = recoveries(run_dir)
    assert [(r["failed_ranks"], r["cause"], r["decision_source"]) for r in done] == [
        ([4, 5, 6, 7], "node", "renamed")]
    assert_same_training(run_dir, reference)
    assert "recoveries: 1 (" in out and (run_dir / "report" / "recovery_phases.png").is_file()
    workers = json.loads((run_dir / "workers.json").read_text())
    assert {r: w["node"] for r, w in workers.items()} == {str(r): 1 + r // 4 for r in range(8)}
    assert "started rank" not in (run_dir / "logs" / "node-0.log").read_text()


def wait_for_step(run_dir: Path, step: int, *, nodes: tuple[subprocess.Popen, ...] = (),
                  within: float = RUN_TIMEOUT_S) -> None:
    """Until ``samples.jsonl`` records ``step`` as committed; fails at once if one of
    ``nodes`` ends first, with what the nodes wrote."""
    deadline = time.monotonic() + within
    samples = run_dir / "samples.jsonl"
    while not (samples.is_file() and any(json.loads(line)["step"] >= step
                                         for line in samples.read_text().splitlines() if line.endswith("}"))):
        ended = [i for i, node in enumerate(nodes) if node.poll() is not None]
        if ended or time.monotonic() > deadline:
            why = f"node {ended[0]} exited {nodes[ended[0]].returncode}" if ended else f"not within {within} s"
            pytest.fail(f"step {step} was not committed: {why}{run_logs(run_dir)}")
        time.sleep(0.02)


def wait_for_event(run_dir: Path, event: str, *, nodes: tuple[subprocess.Popen, ...],
                   within: float = RUN_TIMEOUT_S) -> dict:
    """The first ``event`` record of ``events.jsonl``, once there; fails at once if one of
    ``nodes`` ends first."""
    deadline = time.monotonic() + within
    events = run_dir / "events.jsonl"
    while True:
        lines = events.read_text().splitlines() if events.is_file() else []
        found = [json.loads(line) for line in lines if line.endswith("}") and f'"event": "{event}"' in line]
        if found:
            return found[0]
        ended = [i for i, node in enumerate(nodes) if node.poll() is not None]
        if ended or time.monotonic() > deadline:
            why = f"node {ended[0]} exited {nodes[ended[0]].returncode}" if ended else f"not within {within} s"
            pytest.fail(f"no {event} event: {why}{run_logs(run_dir)}")
        time.sleep(0.02)


def test_a_frozen_node_holding_a_whole_stage_costs_no_collective_timeout_and_is_rebuilt_from_parity(
        tmp_path, data_cache, reference):
    """4 nodes of 2 ranks on this machine: DP 2 x PP 4 puts both replicas of stage k on node
    k. Snapshots every 2 steps; once the first is complete, node 2 is frozen whole from
    outside (SIGSTOP of its launcher, which keeps its snapshot memory, its fork server and
    workers): no socket closes, as when a node hangs or drops off the network. The
    controller names the node from its silent launcher and aborts the generation; the
    survivors leave their collectives at once instead of waiting out the 30 s collective
    timeout. No survivor holds stage 2's blocks and the frozen keeper counts as lost: its two
    shards are rebuilt from parity across the other nodes, the run rolls back to the
    snapshot and ends with the failure-free model."""
    run_dir, port = tmp_path / "run", _free_port()
    common = ["cluster.devices_per_node=2", "odyssey.online_profile=false", "odyssey.collective_timeout=30",
              "odyssey.snapshot_interval=2", slow_device(tmp_path, forward_s=0.02), "--nnodes", "4",
              "--master-port", str(port)]
    nodes = [train(run_dir, data_cache, *common, node_rank=n) for n in range(4)]
    try:
        wait_for_event(run_dir, "snapshot", nodes=tuple(nodes))
        os.killpg(nodes[2].pid, signal.SIGSTOP)
        status, out, err = finish(nodes[0])
    finally:
        os.killpg(nodes[2].pid, signal.SIGKILL)
        os.killpg(nodes[2].pid, signal.SIGCONT)
        for node in nodes[1:]:
            finish(node)
    assert status == 0, err[-4000:] + run_logs(run_dir)
    (recovery,) = recoveries(run_dir)
    assert recovery["cause"] == "node" and recovery["failed_ranks"] == [4, 5]
    assert recovery["snapshot_step"] in (2, 4) and recovery["rebuilt_shards"] == 2, recovery
    # Back to training well inside the collective timeout (the heartbeat timeout is 1 s;
    # the recovery benchmark measures the figure itself).
    assert recovery["ready_at"] - recovery["failed_at"] < 10, recovery
    assert_same_training(run_dir, reference)


def test_node_0s_process_stopped_for_3_s_fails_no_node_and_trains_to_the_failure_free_model(
        tmp_path, data_cache, reference):
    """Two nodes of 4 ranks. Once a step is committed, node 0's ``odyssey train`` process
    (the controller with the store it hosts, and node 0's launcher; not its workers) is
    stopped for 3 s, as swap, a GC pause or a stalled shared filesystem stops a
    controller, then continued. Every client of its store waits meanwhile; the
    controller's first look after it comes 3 s late and counts no node's silence from
    before it: no failure is recorded, the late look is logged, and the run ends with the
    failure-free model."""
    run_dir, port = tmp_path / "run", _free_port()
    common = ["cluster.devices_per_node=4", "odyssey.online_profile=false", slow_device(tmp_path, forward_s=0.02),
              "--nnodes", "2", "--master-port", str(port)]
    nodes = [train(run_dir, data_cache, *common, node_rank=n) for n in range(2)]
    try:
        wait_for_step(run_dir, 1, nodes=tuple(nodes))
        os.kill(nodes[0].pid, signal.SIGSTOP)
        time.sleep(3)
        os.kill(nodes[0].pid, signal.SIGCONT)
        status, _, err = finish(nodes[0])
    finally:
        if nodes[0].poll() is None:  # the test failed while it was stopped
            os.kill(nodes[0].pid, signal.SIGCONT)
        for node in nodes[1:]:
            finish(node)
    assert status == 0, err[-4000:] + run_logs(run_dir)
    assert events(run_dir, "failure") == [], run_logs(run_dir)
    assert "s after its previous look (this process stalled)" in (run_dir / "logs" / "node-0.log").read_text()
    assert_same_training(run_dir, reference)


LAUNCH_VARIABLES = ("NNODES", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE")


def test_a_slurm_launch_of_two_nodes_survives_losing_a_node_before_the_first_commit(tmp_path, data_cache,
                                                                                   reference):
    """Two node processes on this machine as ``srun --ntasks-per-node=1`` starts them: no
    torchrun flag or variable, only SLURM_NNODES, SLURM_NODEID and SLURM_JOB_NODELIST (its
    first host is the master) and the job script's MASTER_PORT. PP 2 x DP 4 over nodes of 4
    ranks: node 1 holds every replica of stage 1, and dies in step 0, before any step
    committed. No trained state exists, so nothing is lost: the survivors draw their new
    stages from the seed, move no block, and train to the failure-free model."""
    run_dir = tmp_path / "run"
    base = {key: value for key, value in os.environ.items() if key not in LAUNCH_VARIABLES and not key.startswith("SLURM")}
    slurm = {"SLURM_NNODES": "2", "SLURM_JOB_NODELIST": "localhost,otherhost", "MASTER_PORT": str(_free_port())}
    command = [sys.executable, "-m", "odyssey_megatron.cli", "train", "--config", str(RECIPE), "--run-dir", str(run_dir),
               f"training.train_iters={STEPS}", f"data.cache_dir={data_cache}", "cluster.devices_per_node=4",
               "parallel.pipeline_model_parallel_size=2", "parallel.data_parallel_size=4",
               "odyssey.online_profile=false", faults("{node: 1, step: 0, phase: backward, action: kill}")]
    nodes = [subprocess.Popen(command, env={**base, **slurm, "SLURM_NODEID": str(node)}, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, cwd=ROOT) for node in (0, 1)]
    (status, _, err), _ = finish(nodes[0]), finish(nodes[1])
    assert status == 0, err[-4000:]
    node_log = (run_dir / "logs" / "node-1.log").read_text()
    assert "node 1: started rank 4 " in node_log and "node 1: started rank 7 " in node_log  # SLURM_NODEID=1: 4..7
    (recovery,) = recoveries(run_dir)
    assert recovery["failed_ranks"] == [4, 5, 6, 7] and recovery["cause"] == "node" and recovery["start_step"] == 0
    plan = next(e for e in read_jsonl(run_dir / "events.jsonl") if e["event"] == "plan" and e["generation"] == 1)
    assert plan["start_step"] == 0
    assert_same_training(run_dir, reference)


def test_a_node_whose_command_never_starts_ends_the_start_in_one_line_after_the_recovery_timeout(tmp_path,
                                                                                              data_cache):
    """Two nodes of 4 ranks, only node 0's command started: the first generation waits for
    ranks 4-7 to register up to the recovery timeout, then the run ends in one line naming
    them. Before, the generation was published at once: node 0's ranks gave up on the others
    after the collective timeout and then waited for a plan that nothing failed them into."""
    run_dir = tmp_path / "run"
    status, _, err = finish(train(run_dir, data_cache, "cluster.devices_per_node=4", "odyssey.collective_timeout=4",
                                  "odyssey.recovery_timeout=8", "--nnodes", "2", "--master-port", str(_free_port()),
                                  node_rank=0))
    assert status != 0 and "Traceback" not in err, err[-4000:]
    assert "ranks 4, 5, 6, 7 did not register within the recovery timeout (8.0 s): are their nodes' commands " \
           "started?" in err, err[-4000:]
    assert not events(run_dir, "plan")


def test_ctrl_c_then_sigterm_stop_at_a_step_boundary_and_resume_loses_and_repeats_nothing(tmp_path, data_cache,
                                                                                          reference):
    """A terminal's Ctrl-C (SIGINT to the whole process group) once a step is recorded: the
    run stops, every block is saved as of the last committed step and the run exits 130
    saying how to resume. The resumed run is stopped by SIGTERM to its whole process group
    (as SLURM signals every process of a job step: the fork server too, which once left the
    launcher reading every worker as dead), exits 143, and a second resume trains to the
    end: the failure-free model, and every step committed exactly once over the three runs
    (the last one at full speed: no signal needs to land in it). Every start signs the
    store's values with the one secret the first made (``protocol.auth``)."""
    run_dir, slow = tmp_path / "run", slow_device(tmp_path, forward_s=0.1)  # about 4 s a step
    stops, secrets = [], []
    for stop, command in ((signal.SIGINT, None), (signal.SIGTERM, ["--resume", str(run_dir)])):
        process = (train(run_dir, data_cache, slow) if command is None else subprocess.Popen(
            [sys.executable, "-m", "odyssey_megatron.cli", "train", *command], stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True, cwd=ROOT, start_new_session=True))
        wait_for_step(run_dir, stops[-1] if stops else 0, nodes=(process,))  # the first step this run records
        os.killpg(process.pid, stop)
        status, _, err = finish(process)
        assert status == 128 + stop, err[-4000:]
        outcome = json.loads((run_dir / "outcome.json").read_text())
        assert outcome["resume"] == f"odyssey train --resume {run_dir}", outcome
        stops.append([e for e in read_jsonl(run_dir / "events.jsonl") if e["event"] == "stop"][-1]["step"])
        assert f"saved as checkpoint/step-{stops[-1]}" in outcome["message"], outcome["message"] + run_logs(run_dir)
        assert [s["step"] for s in read_jsonl(run_dir / "samples.jsonl")] == list(range(stops[-1]))
        secrets.append((run_dir / SECRET_FILE).read_bytes())
    assert 1 <= stops[0] < stops[1] <= STEPS
    command = [sys.executable, "-m", "odyssey_megatron.cli", "train", "--resume", str(run_dir),
               "cluster.emulate_device=null"]
    resumed = subprocess.run(command, capture_output=True, text=True, timeout=RUN_TIMEOUT_S, cwd=ROOT)
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert_same_training(run_dir, reference)
    committed = [e["step"] for e in read_jsonl(run_dir / "events.jsonl") if e["event"] == "step"]
    assert committed == list(range(STEPS))  # none trained twice, none lost
    assert secrets == [(run_dir / SECRET_FILE).read_bytes()] * 2
    assert stat.S_IMODE((run_dir / SECRET_FILE).stat().st_mode) == 0o600


def test_a_controller_restarted_within_the_window_takes_the_survivors_back_and_loses_no_committed_step(
        tmp_path, data_cache, long_reference):
    """Two nodes of 4 ranks (DP 8: each holds the whole model), survivors waiting 120 s
    for a restarted controller (``odyssey.controller_reattach_s``). Once step 2 committed,
    node 0's process (the controller, its launcher and its four workers) is SIGKILLed.
    Node 1's workers save what they hold and wait; ``odyssey train --resume`` on node 0
    takes them back, the same processes, at the step they hold (``reattachment``), recovers
    from node 0's loss on them, and grows back onto node 0's new workers. Node 1's command
    never ends in between; the run ends on all 8 ranks with the failure-free model, every
    step committed once from the step the survivors held on."""
    run_dir, port = tmp_path / "run", _free_port()
    common = ["parallel.pipeline_model_parallel_size=1", "parallel.data_parallel_size=8",
              "cluster.devices_per_node=4", "odyssey.online_profile=false", "--nnodes", "2", "--master-port", str(port)]
    node0 = train(run_dir, data_cache, *common, "odyssey.controller_reattach_s=120",
                  slow_device(tmp_path, forward_s=0.02), node_rank=0, steps=GROWING_STEPS)
    node1 = train(run_dir, data_cache, *common, "odyssey.controller_reattach_s=120",
                  slow_device(tmp_path, forward_s=0.02), node_rank=1, steps=GROWING_STEPS)
    ended1: list[tuple[int, str, str]] = []  # read from the start: a full pipe would stall node 1's launcher
    reader = threading.Thread(target=lambda: ended1.append(finish(node1)), daemon=True)
    reader.start()
    restarted = None
    try:
        wait_for_step(run_dir, 2, nodes=(node0,))
        os.killpg(node0.pid, signal.SIGKILL)
        finish(node0)
        first = {e["rank"]: e["pid"] for e in events(run_dir, "rank_joined") if e["rank"] >= 4}
        deadline = time.monotonic() + 60
        while latest_checkpoint(run_dir) is None:  # node 1's save
            assert time.monotonic() < deadline and node1.poll() is None, run_logs(run_dir)
            time.sleep(0.1)
        assert node1.poll() is None, run_logs(run_dir)
        restarted = subprocess.Popen(
            [sys.executable, "-m", "odyssey_megatron.cli", "train", "--resume", str(run_dir), "--nnodes", "2",
             "--master-port", str(port), "--node-rank", "0"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, start_new_session=True)
        status, _, err = finish(restarted)
        reader.join(RUN_TIMEOUT_S)
        [(status1, _, err1)] = ended1
    finally:
        for process in (node0, node1, restarted):
            if process is not None and process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
    assert status == 0, err[-4000:] + run_logs(run_dir)
    assert status1 == 0, err1[-4000:]
    [taken] = events(run_dir, "reattachment")
    assert taken["accepted"] == [4, 5, 6, 7] and not taken["refused"], taken
    assert {e["rank"]: e["pid"] for e in events(run_dir, "rank_reattached")} == first  # the same processes
    resumed_plans = [e for e in events(run_dir, "plan") if e["time"] > taken["time"]]
    assert resumed_plans[0]["start_step"] == taken["step"] >= 2  # from the step they held: none lost
    [recovery] = [r for r in recoveries(run_dir) if r["time"] > taken["time"]]
    assert recovery["failed_ranks"] == [0, 1, 2, 3], recovery
    assert any(j["grew"] and j["ranks"] == [0, 1, 2, 3] for j in events(run_dir, "join")), events(run_dir, "join")
    assert resumed_plans[-1]["workers"] == list(range(8))
    assert_same_training(run_dir, long_reference, controller_killed=True)
    committed = [e["step"] for e in events(run_dir, "step") if e["time"] > taken["time"]]
    assert committed == list(range(taken["step"], GROWING_STEPS))


def _interrupted_while_waiting_for_survivors(run_dir: Path) -> tuple[int, str]:
    """``odyssey train --resume`` on node 0 of 2, survivors awaited for 60 s, sent SIGINT
    once it says it waits for them: its (status, terminal output)."""
    command = [sys.executable, "-m", "odyssey_megatron.cli", "train", "--resume", str(run_dir), "--nnodes", "2",
               "--node-rank", "0", "--master-port", str(_free_port()), "odyssey.controller_reattach_s=60"]
    restarted = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT,
                                 start_new_session=True)
    lines: list[str] = []
    try:
        for line in restarted.stdout:
            lines.append(line)
            if "survivors to reattach" in line:
                restarted.send_signal(signal.SIGINT)
                break
        lines.extend(restarted.communicate(timeout=60)[0])
    finally:
        if restarted.poll() is None:
            os.killpg(restarted.pid, signal.SIGKILL)
    return restarted.returncode, "".join(lines)


def test_a_node_lost_with_the_controller_and_its_writers_leaves_a_checkpoint_the_other_node_fills_in(
        tmp_path, data_cache, reference):
    """Two nodes of 4 ranks (DP 8), node 0 hosting the controller, survivors waiting for a
    restarted controller (``odyssey.controller_reattach_s``): node 0's whole process group
    is SIGKILLed once step 2 committed, its four workers with it, though the plan chose
    them to write half the blocks. Node 1's workers save their share, find no claim of the
    dead writers' blocks, fill them in, and wait: the step they took is a whole checkpoint.
    A restart Ctrl-C'd while it waits for survivors that do not come (on another port) ends
    untrained with one line. A restart with no window refuses node 1's survivors: its
    launcher exits 75, and node 1's command, started again over a collective timeout later,
    takes part as a member of the resumed run's first generation, which waits for its ranks
    (not as a joiner, which that generation would wait for in vain), and the run goes on
    from the checkpoint (not from the start) to the failure-free model with no failure."""
    run_dir, port = tmp_path / "run", _free_port()
    common = ["parallel.pipeline_model_parallel_size=1", "parallel.data_parallel_size=8",
              "cluster.devices_per_node=4", "odyssey.online_profile=false", "odyssey.controller_reattach_s=120",
              "--nnodes", "2", "--master-port", str(port)]
    slow = slow_device(tmp_path, forward_s=0.02)
    node0 = train(run_dir, data_cache, *common, slow, node_rank=0)
    node1 = train(run_dir, data_cache, *common, slow, node_rank=1)
    ended1: list[tuple[int, str, str]] = []  # read from the start: a full pipe would stall node 1's launcher
    reader = threading.Thread(target=lambda: ended1.append(finish(node1)), daemon=True)
    reader.start()
    resumed = again1 = None
    try:
        wait_for_step(run_dir, 2, nodes=(node0, node1))
        os.killpg(node0.pid, signal.SIGKILL)
        finish(node0)
        deadline = time.monotonic() + 60
        while latest_checkpoint(run_dir) is None:  # node 1's save
            assert time.monotonic() < deadline and node1.poll() is None, run_logs(run_dir)
            time.sleep(0.1)
        [directory] = sorted(run_dir.glob("checkpoint/step-*"))
        step = int(directory.name.removeprefix("step-"))
        parts = {p.name: json.loads(p.read_text())["blocks"] for p in directory.glob("rank-*.json")}
        assert {name for name in parts if "fill" not in name} == {f"rank-{r}.json" for r in range(4, 8)}, parts
        assert any("fill" in name for name in parts), parts  # the dead writers' share, written by node 1
        assert len({b for blocks in parts.values() for b in blocks}) == 10, parts  # every block
        status, err = _interrupted_while_waiting_for_survivors(run_dir)
        assert status == 130 and "Traceback" not in err, err[-4000:]
        assert (f"stopped (SIGINT on node 0) before this start trained; resume from the checkpoint of step {step}"
                in err), err[-4000:]
        assert events(run_dir, "reattachment")[-1]["why"] == "the restarted controller was stopped (SIGINT on node 0)"
        assert node1.poll() is None, run_logs(run_dir)  # still waiting: that restart was on another port
        # At full speed from here (the run's spec, which both nodes' workers read): nothing is to land in it.
        resumed = subprocess.Popen(
            [sys.executable, "-m", "odyssey_megatron.cli", "train", "--resume", str(run_dir), "--nnodes", "2",
             "--master-port", str(port), "--node-rank", "0", "odyssey.controller_reattach_s=0",
             "cluster.emulate_device=null"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, start_new_session=True)
        reader.join(RUN_TIMEOUT_S)
        [(status1, _, err1)] = ended1
        assert status1 == 75 and "refused its workers" in err1, err1[-4000:] + run_logs(run_dir)
        # Started again a while later, as a person would: past the collective timeout in which
        # the first generation's ranks wait for each other (published before node 1 came, that
        # generation ended under node 0's ranks, and node 1's then stalled alone).
        time.sleep(load_config(RECIPE).odyssey.timeouts.collective_timeout + 5)
        again1 = train(run_dir, data_cache, *common, node_rank=1)
        status, _, err = finish(resumed)
        status_again, _, err_again = finish(again1)
    finally:
        for process in (node0, node1, resumed, again1):
            if process is not None and process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
    assert status == 0, err[-4000:] + run_logs(run_dir)
    assert status_again == 0, err_again[-4000:]
    resumed_plans = [e for e in events(run_dir, "plan") if e["time"] > events(run_dir, "reattachment")[-1]["time"]]
    assert resumed_plans[0]["start_step"] == step >= 2 and resumed_plans[0]["workers"] == list(range(8))
    node_1_again = [e for e in events(run_dir, "node_joined") if e["node"] == 1][-1]
    assert resumed_plans[0]["time"] > node_1_again["time"]  # the first generation waited for node 1's command
    failures = [(f["cause"], f["ranks"], f["detail"]) for f in events(run_dir, "failure")]
    # Node 1's new workers entered the first generation: nothing failed, nothing recovered.
    assert not recoveries(run_dir), f"failures {failures}" + run_logs(run_dir)
    assert_same_training(run_dir, reference, controller_killed=True)


def test_every_replica_of_a_stage_killed_at_once_rolls_back_to_the_snapshot_in_their_node_s_keeper(
        tmp_path, data_cache, reference):
    """Both replicas of stage 1 (ranks 2 and 3, on the one node of the tiny recipe) die in
    one instant as step 4 starts: no survivor holds blocks 2 and 3, and there is no disk
    checkpoint. Snapshots are taken every 2 steps; step 4's never completes (ranks 2 and 3
    die before writing their part), so the run rolls back to step 2's: the survivors read the
    dead ranks' shards from the node's keeper (which outlives its trainers), train steps 2
    and 3 again and end with the failure-free model, each step's samples recorded once."""
    run_dir = tmp_path / "run"
    status, _, err = finish(train(run_dir, data_cache, "odyssey.snapshot_interval=2", faults(
        "{rank: 2, with_ranks: [3], step: 4, phase: snapshot, action: kill}")))
    assert status == 0, err[-4000:] + run_logs(run_dir)
    (recovery,) = recoveries(run_dir)
    assert recovery["failed_ranks"] == [2, 3] and recovery["snapshot_step"] == 2, recovery
    assert recovery["replayed_steps"] == 2 and recovery["rebuilt_shards"] == 0
    assert recovery["read_for_failed_ranks"] == [2, 3]  # read from the keeper by survivors
    assert "rolled back to the in-memory snapshot of step 2 (2 steps to train again)" in err
    logs = "".join(p.read_text() for p in run_dir.glob("logs/rank-*.log"))
    assert "read rank 2's snapshot shard of step 2 from the node's keeper" in logs
    assert not (run_dir / "checkpoint").exists()
    assert_same_training(run_dir, reference)


def test_every_replica_of_a_stage_killed_before_the_first_snapshot_rolls_back_to_the_run_s_start(
        tmp_path, data_cache, reference):
    """Both replicas of stage 2 (ranks 4 and 5) die in one instant in step 3: no survivor
    holds layers 4 and 5, no in-memory snapshot was taken yet (Young's interval is 26 steps
    on the tiny recipe) and there is no disk checkpoint (once: exit 3, nothing to resume).
    The run rolls back to its start: the survivors draw their new stages from the seed,
    train steps 0 to 2 again and end with the failure-free model, each step's samples
    recorded once."""
    run_dir = tmp_path / "run"
    status, _, err = finish(train(run_dir, data_cache, faults(
        "{rank: 4, with_ranks: [5], step: 3, phase: forward, action: kill}")))
    assert status == 0, err[-4000:] + run_logs(run_dir)
    (recovery,) = recoveries(run_dir)
    assert recovery["failed_ranks"] == [4, 5] and recovery["rolled_back_to_start"], recovery
    assert recovery["start_step"] == 0 and recovery["replayed_steps"] == 3 and recovery["snapshot_step"] is None
    assert [(e["step"], e["replayed"]) for e in read_jsonl(run_dir / "events.jsonl") if e["event"] == "rollback"] == [
        (0, 3)]
    assert "rolled back to the run's start (3 steps to train again)" in err
    assert not (run_dir / "checkpoint").exists()
    assert_same_training(run_dir, reference)


def test_a_lost_node_holding_every_replica_of_a_stage_is_rebuilt_from_parity_across_the_other_nodes(
        tmp_path, data_cache, reference):
    """4 nodes of 2 ranks: DP 2 x PP 4 puts both replicas of stage k on node k. Node 1 dies
    whole as step 4 starts (its launcher, the keeper of its snapshot memory, and its
    workers): its stage's only copies and its snapshot shards are gone. Its two shards of
    step 2's snapshot are rebuilt by XOR from the parity of their protection groups (the
    i-th rank of every node). Rank 6 dies as the rollback moves its blocks: the decision
    starts again, rank 6's shard is read from its node's keeper by rank 7 (which then
    serves node 1's rebuild for it too), and the run ends with the failure-free model.
    The host memory budget holds the starting plan (checked before the run), not the
    survivors' larger shares on 3 nodes: each recovery says so and goes on."""
    from odyssey_megatron.decision_center import DecisionCenter
    from odyssey_megatron.estimator.host_memory import run_host_memory
    from odyssey_megatron.units import GIB

    run_dir, recipe = tmp_path / "run", ["cluster.devices_per_node=2", "odyssey.snapshot_interval=2"]
    config = load_config(RECIPE, recipe)
    center = DecisionCenter.from_recipe(config)
    start = max(held.total for held in run_host_memory(config, center.plan, center.cluster).values())
    status, _, err = train_nodes(run_dir, data_cache, 4, *recipe, f"cluster.host_memory_gib={1.2 * start / GIB}",
                                 "odyssey.online_profile=false", "--nnodes", "4", "--master-port", str(_free_port()),
                                 faults("{node: 1, step: 4, phase: snapshot, action: kill}",
                                        "{rank: 6, step: 2, phase: transfer, action: kill}"))
    assert status == 0, err[-4000:] + run_logs(run_dir)
    assert "generation 2: over cluster.host_memory_gib: node " in err
    (recovery,) = recoveries(run_dir)
    assert recovery["failed_ranks"] == [2, 3, 6] and recovery["restarts"] == 1, recovery
    assert recovery["snapshot_step"] == 2 and recovery["rebuilt_shards"] == 2 and recovery["replayed_steps"] == 2
    assert recovery["read_for_failed_ranks"] == [6]
    logs = "".join(p.read_text() for p in run_dir.glob("logs/rank-*.log"))
    assert "rebuilt rank 2's snapshot shard of step 2 from parity (group [0, 2, 4, 6])" in logs
    assert "rebuilt rank 3's snapshot shard of step 2 from parity (group [1, 3, 5, 7])" in logs
    assert "rank 7: read rank 6's snapshot shard of step 2 from the node's keeper" in logs
    assert_same_training(run_dir, reference)


def test_a_lost_node_beside_a_dedicated_controller_rolls_back_to_its_snapshot_rebuilt_from_parity(
        tmp_path, data_cache, reference):
    """Node 0 runs only the controller (``cluster.dedicated_controller``); nodes 1 and 2 run
    4 ranks each, so DP 2 x PP 4 puts stages 0 and 1 on node 1 and stages 2 and 3 on node 2.
    Node 1 dies whole as step 4 starts: no survivor holds stages 0 and 1, and their
    snapshot shards went with node 1's keeper. Each is rebuilt by XOR from its protection
    group's other member on node 2 (rank i with rank i + 4), the run rolls back to step 2's
    snapshot and ends with the failure-free model. Node 1 is the launcher's node 1 but the
    first node with workers: taking one numbering for the other would mark node 2's keeper
    lost, leaving nothing to rebuild from."""
    run_dir = tmp_path / "run"
    status, _, err = train_nodes(run_dir, data_cache, 3, "cluster.devices_per_node=4",
                                 "cluster.dedicated_controller=true", "odyssey.snapshot_interval=2",
                                 "odyssey.online_profile=false", "--nnodes", "3", "--master-port", str(_free_port()),
                                 faults("{node: 1, step: 4, phase: snapshot, action: kill}"))
    assert status == 0, err[-4000:] + run_logs(run_dir)
    (recovery,) = recoveries(run_dir)
    assert recovery["cause"] == "node" and recovery["failed_ranks"] == [0, 1, 2, 3], recovery
    assert recovery["snapshot_step"] == 2 and recovery["rebuilt_shards"] == 4 and recovery["replayed_steps"] == 2
    logs = "".join(p.read_text() for p in run_dir.glob("logs/rank-*.log"))
    for rank in range(4):
        assert f"rebuilt rank {rank}'s snapshot shard of step 2 from parity (group [{rank}, {rank + 4}])" in logs
    assert_same_training(run_dir, reference)


def test_two_lost_nodes_of_one_protection_group_fall_back_to_the_disk_checkpoint_and_resume_from_it(
        tmp_path, data_cache, reference):
    """4 nodes of 2 ranks, snapshots every 2 steps and a disk checkpoint every 2: nodes 1
    and 2 die in step 4's optimizer phase, after its checkpoint was copied to host memory as
    the step started and written in the background during its forward and backward. Ranks 2 and 4 are
    in one protection group, which rebuilds one lost shard at most: the run exits 3 saying
    so and naming the checkpoint of step 4; ``--resume`` on one node continues from there
    and ends where the failure-free run ends."""
    run_dir = tmp_path / "run"
    status, _, err = train_nodes(run_dir, data_cache, 4, "cluster.devices_per_node=2", "odyssey.snapshot_interval=2",
                                 "odyssey.checkpoint_interval=2", "odyssey.online_profile=false", "--nnodes", "4",
                                 "--master-port", str(_free_port()),
                                 faults("{node: 1, step: 4, phase: optimizer, action: kill}",
                                        "{node: 2, step: 4, phase: optimizer, action: kill}"))
    assert status == 3, err[-4000:]
    assert "the snapshot shards of ranks [2, 4] are all lost, and their protection group (ranks [0, 2, 4, 6]) " \
           "rebuilds one at most" in err, err[-3000:] + run_logs(run_dir)
    assert f"resume from the checkpoint of step 4 with: odyssey train --resume {run_dir}" in err, err[-2000:]
    assert json.loads((run_dir / "outcome.json").read_text())["status"] == 3
    assert stat.S_IMODE(run_dir.stat().st_mode) == 0o700  # --resume unpickles the checkpoints in it
    for name in ("samples.jsonl", "events.jsonl"):  # as if the run had been killed mid-append
        with (run_dir / name).open("a") as records:
            records.write('{"step": 3, "gen')
    command = [sys.executable, "-m", "odyssey_megatron.cli", "train", "--resume", str(run_dir),
               "cluster.devices_per_node=8"]
    resumed = subprocess.run(command, capture_output=True, text=True, timeout=RUN_TIMEOUT_S, cwd=ROOT)
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert_same_training(run_dir, reference)
    first, second = wandb_runs(run_dir)  # one W&B run, continued by --resume
    assert read_wandb_run(first)[0] == read_wandb_run(second)[0] == (run_dir / "wandb-run-id").read_text().strip()


def events(run_dir: Path, kind: str) -> list[dict]:
    return [e for e in read_jsonl(run_dir / "events.jsonl") if e["event"] == kind]


def test_a_restarted_worker_joins_back_even_when_killed_while_it_receives_its_blocks(
        tmp_path, data_cache, long_reference):
    """Rank 5 is killed in step 1; its launcher starts it again (``odyssey.restart_workers``)
    and the run, trained on by 7 workers meanwhile, decides to grow back onto it: the
    generation hands over at a step boundary and the next one names rank 5, which holds
    nothing and receives its blocks. It is killed again once its first block has moved
    (a ``join`` fault): the join's generation is abandoned and decided again without it,
    from the settled plan. Restarted once more, it joins for good; the run ends on all 8
    ranks with the failure-free model, every sample once."""
    run_dir = tmp_path / "run"
    status, out, err = finish(train(run_dir, data_cache, "odyssey.restart_workers=2", "odyssey.online_profile=false",
                                    slow_device(tmp_path, forward_s=0.03),
                                    faults("{rank: 5, step: 1, phase: backward, action: kill}",
                                           "{rank: 5, join: true, phase: mid_transfer, action: kill}"),
                                    steps=GROWING_STEPS))
    assert status == 0, err[-4000:] + run_logs(run_dir)
    interrupted, = events(run_dir, "join_interrupted")
    assert interrupted["workers"] == [5] and interrupted["failed_ranks"] == [5]
    joins = [j for j in events(run_dir, "join") if j["grew"]]
    assert [j["workers"] for j in joins] == [[5]], joins
    assert joins[0]["training_ranks"] == 8 and joins[0]["transfer_bytes"] > 0
    assert joins[0]["first_step_at"] > joins[0]["published_at"] > joins[0]["decided_at"]
    plans = events(run_dir, "plan")
    assert [p["joined"] for p in plans if p["joined"]] == [[5], [5]]  # the interrupted join, then the one that held
    assert sorted(plans[-1]["workers"]) == list(range(8))
    assert [r["failed_ranks"] for r in recoveries(run_dir)] == [[5], [5]]
    assert "join: rank 5 back -> " in err and "(8 ranks training)" in err
    assert "joins: 1 grown" in out and "workers [5] back -> " in out  # odyssey report's summary
    _, history_rows, table = read_wandb_run(wandb_runs(run_dir)[0], "joins")
    assert [(row["workers"], row["grew"]) for row in table if row["grew"]] == [("[5]", True)]
    assert [row["join/transfer_bytes"] for row in history_rows if "join/transfer_bytes" in row] == [
        joins[0]["transfer_bytes"]]
    ranks = [row["train/training_ranks"] for row in history_rows if "train/training_ranks" in row]
    assert ranks[0] == 8 and min(ranks) < 8 and ranks[-1] == 8  # the training ranks go down, then back up
    assert_same_training(run_dir, long_reference)


def test_a_replacement_node_joins_the_run_through_a_failure_elsewhere_during_its_join(
        tmp_path, data_cache, long_reference):
    """Two nodes of 4 ranks, DP 8: node 1 dies in step 1 and the run goes on rerouted on
    node 0. A fresh ``odyssey train --node-rank 1`` (a replacement host) registers while
    it trains: its 4 workers join. As the join's generation moves their blocks, rank 2 on
    node 0 is killed (a ``join`` fault): a failure during the join, decided from the settled
    plan with the new node's ranks among the candidates. Rank 2's launcher starts it again
    and it joins too: the run ends on all 8 ranks with the failure-free model."""
    run_dir, port = tmp_path / "run", _free_port()
    common = ["parallel.pipeline_model_parallel_size=1", "parallel.data_parallel_size=8", "cluster.devices_per_node=4",
              "odyssey.restart_workers=1", "odyssey.online_profile=false", slow_device(tmp_path, forward_s=0.1),
              "--nnodes", "2", "--master-port", str(port),
              faults("{node: 1, step: 1, phase: backward, action: kill}",
                     "{rank: 2, join: true, phase: transfer, action: kill}")]
    nodes = [train(run_dir, data_cache, *common, node_rank=n, steps=GROWING_STEPS) for n in range(2)]
    try:
        wait_for_event(run_dir, "failure", nodes=(nodes[0],))
        nodes.append(train(run_dir, data_cache, *common, node_rank=1, steps=GROWING_STEPS))
        status, out, err = finish(nodes[0])
    finally:
        for node in nodes[1:]:
            finish(node)
    assert status == 0, err[-4000:] + run_logs(run_dir)
    assert nodes[2].returncode == 0
    failures = [(f["cause"], f["ranks"], f["detail"]) for f in events(run_dir, "failure")]
    interrupted, = events(run_dir, "join_interrupted")
    assert interrupted["workers"] == [4, 5, 6, 7] and interrupted["failed_ranks"] == [2], (
        f"{interrupted}; failures {failures}" + run_logs(run_dir))
    plans = events(run_dir, "plan")
    assert sorted(plans[-1]["workers"]) == list(range(8)), f"failures {failures}" + run_logs(run_dir)
    joined = [w for p in plans for w in p["joined"]]
    assert sorted(set(joined)) == [2, 4, 5, 6, 7]
    node_joins = events(run_dir, "node_joined")
    assert [n["node"] for n in node_joins].count(1) == 2
    assert_same_training(run_dir, long_reference)


@pytest.fixture(scope="module")
def bridge_run(tmp_path_factory, data_cache) -> tuple[Path, str, str]:
    """``bridge_tiny.yaml``, Megatron-Bridge's ConfigContainer layout of the tiny recipe
    with an ``odyssey:`` section added, run with Bridge's names on the command line
    through one kill: its run directory, stdout and stderr."""
    def run(directory: Path) -> tuple[str, str, str]:
        run_dir = directory / "bridge"
        command = [sys.executable, "-m", "odyssey_megatron.cli", "train", "--config",
                   str(ROOT / "recipes" / "llama2_7b" / "bridge_tiny.yaml"), "--run-dir", str(run_dir),
                   f"train.train_iters={STEPS}", f"dataset.path_to_cache={data_cache}",
                   faults("{rank: 5, step: 2, phase: backward, action: kill}")]
        done = subprocess.run(command, capture_output=True, text=True, timeout=RUN_TIMEOUT_S, cwd=ROOT)
        assert done.returncode == 0, done.stderr[-4000:]
        return str(run_dir), done.stdout, done.stderr
    run_dir, out, err = built_once(tmp_path_factory, "bridge", run)
    return Path(run_dir), out, err


def test_a_megatron_bridge_recipe_trains_as_it_is(bridge_run, reference):
    """It trains through the kill to the same model as the tiny recipe's failure-free run."""
    run_dir, _, _ = bridge_run
    assert_same_training(run_dir, reference)
    assert [r["failed_ranks"] for r in recoveries(run_dir)] == [[5]]


def test_the_console_shows_progress_one_line_per_failure_and_recovery_and_no_rank_detail(bridge_run):
    """The main job's terminal reads like Megatron's: the recipe's notes, the disk
    checkpoints' interval as the run starts, then a progress line per committed step
    (``logger.log_interval: 1``), the failure and its recovery in a line each, the summary;
    each rank's detail (gloo's lost connection, the injected kill) in
    ``logs/rank-<r>.log``, the launcher's and controller's chatter in ``logs/node-0.log``."""
    run_dir, out, err = bridge_run
    notes = [line for line in err.splitlines() if not line.startswith("[")]  # before the run starts
    assert notes and all(line.startswith("Megatron-Bridge recipe: ") for line in notes), notes
    lines = [line.split("] ", 1)[1] for line in err.splitlines() if line not in notes]  # stamped "[date time] "
    assert lines[0].startswith("disk checkpoints: every ") and "(Young: " in lines[0], lines[0]
    lines = lines[1:]
    progress = [line for line in lines if line.startswith("iteration ")]
    assert [line.split("|")[0].split()[1] for line in progress] == [f"{s}/" for s in range(1, STEPS + 1)]
    assert all("lm loss: " in line and "ranks training: " in line for line in progress)
    assert all("samples/s: " in line and "tokens/s: " in line and "time left: " in line for line in progress[1:])
    recovery = [line for line in lines if line not in progress]
    assert len(recovery) == 2, err
    assert recovery[0].startswith("failure: rank 5 exited (killed by SIGKILL); detected from its exit")
    assert recovery[1].startswith("recovery: rank 5 (exit) -> ") and "training again " in recovery[1]
    for noise in ("GLHF", "Traceback", "UserWarning", "gloo", "wandb:", "INFO"):
        assert noise not in out + err, noise
    assert "recoveries: 1 (" in out and "W&B run: " in out  # the summary
    logs = run_dir / "logs"
    assert sorted(p.name for p in logs.glob("rank-*.log")) == [f"rank-{r}.log" for r in range(8)]
    assert "injecting odyssey.faults[0]: kill rank 5" in (logs / "rank-5.log").read_text()
    survivors = "".join((logs / f"rank-{r}.log").read_text() for r in range(8) if r != 5)
    assert "generation 0 ended in " in survivors and "gloo" in survivors
    node = (logs / "node-0.log").read_text()
    assert "node 0: started rank 7 " in node and "node 0: rank 5 (pid " in node and "failure: rank 5 " in node


def test_odyssey_report_draws_and_sums_up_a_real_run(bridge_run, capsys):
    """``odyssey report`` on the run (against itself as the baseline): every plot a
    readable PNG, the summary on stdout as written to ``report.txt``, with the recovery
    and every sample accounted for."""
    run_dir, _, _ = bridge_run
    status = main(["report", str(run_dir), "--baseline", str(run_dir)])
    out, err = capsys.readouterr()
    assert status == 0, err
    for name in PLOTS:
        with Image.open(run_dir / "report" / name) as image:
            assert image.format == "PNG"
            width, height = image.size
            assert width >= 800 and height >= 240, (name, image.size)
            image.verify()
    text = (run_dir / "report" / "report.txt").read_text()
    assert out.startswith(text)
    (recovery,) = recoveries(run_dir)
    assert f"recoveries: 1 ({recovery['policy']} 1)" in text
    assert (f"generation 1: {recovery['policy']} ({recovery['decision_source']} decision) from step 2 after ranks [5] "
            "failed") in text
    assert f"samples: {16 * STEPS} expected (16 x {STEPS} committed steps), {16 * STEPS} distinct seen; " \
           "samples lost: 0; samples doubled: 0" in text
    assert sum(phase_seconds(recovery).values()) == pytest.approx(recovery["to_first_step_s"])


def test_resume_needs_a_checkpoint(tmp_path, capsys):
    assert main(["train", "--resume", str(tmp_path)]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"odyssey: error: --resume: {tmp_path} holds no complete checkpoint of an odyssey train run "
        "(odyssey.checkpoint_interval was 0, or the run ended before one was due)")


def test_fp16_is_refused_before_anything_starts(tmp_path, capsys):
    assert main(["train", "--config", str(RECIPE), "--run-dir", str(tmp_path / "run"), "model.params_dtype=fp16"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "odyssey: error: model.params_dtype: odyssey train runs fp32 or bf16 (fp16 needs loss scaling, which its "
        "executors do not apply)")
    assert not (tmp_path / "run").exists()


def test_a_shrinking_batch_is_refused_before_anything_starts(tmp_path, capsys):
    """Its steps train the recipe's whole batch: a plan that drops micro-batches is for
    ``odyssey plan`` and ``odyssey simulate``."""
    assert main(["train", "--config", str(RECIPE), "--run-dir", str(tmp_path / "run"),
                 "odyssey.batch_on_failure=shrink"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "odyssey: error: odyssey.batch_on_failure: odyssey train keeps the recipe's batch (keep); shrink is for "
        "odyssey plan and odyssey simulate")
    assert not (tmp_path / "run").exists()


def test_an_emulated_device_that_does_not_exist_is_refused_before_anything_starts(tmp_path, capsys):
    missing = tmp_path / "nowhere.json"
    assert main(["train", "--config", str(RECIPE), "--run-dir", str(tmp_path / "run"),
                 f"cluster.emulate_device={missing}"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith(
        "odyssey: error: cluster.emulate_device: must be one of ") and not (tmp_path / "run").exists()
