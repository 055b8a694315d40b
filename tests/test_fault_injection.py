"""Fault injection: ``odyssey.faults`` in a recipe and the worker-side ``FaultInjector``.

The config half: the YAML and the command-line override give the same specs, and every
mistake is one ConfigError naming ``odyssey.faults[i]`` and what is allowed. The injector
half: a fault strikes exactly at its rank (or node), step and phase, once. Kill, stop and
node faults end or freeze a real process, so they fire in spawned children and the test
reads how the child ended.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import re
import signal
import subprocess
from pathlib import Path

import pytest

from odyssey_megatron.config import FaultSpec, config_yaml, load_config
from odyssey_megatron.errors import ConfigError
from odyssey_megatron.phases import FaultPhase, Phase
from odyssey_megatron.runtime.protocol.launch import WorkerLaunch
from odyssey_megatron.timeouts import Timeouts
from odyssey_megatron.runtime.rank.fault_injection import FaultInjector, InjectedFault, pid_key

TINY = str(Path(__file__).resolve().parents[1] / "recipes/llama2_7b/tiny_cpu.yaml")
"""8 ranks, DP=2 x PP=4, 8 devices per node (one node), 20 steps."""
TWO_PER_NODE = "cluster.devices_per_node=2"
"""The tiny recipe's 8 ranks on 4 nodes, so nodes 1..3 may fail."""


def fault(**fields) -> FaultSpec:
    spec = FaultSpec(**fields)
    spec.check("odyssey.faults[0]")
    return spec


# -- the config ----------------------------------------------------------------------


def test_faults_from_yaml_and_from_the_command_line_are_the_same(tmp_path):
    recipe = tmp_path / "faults.yaml"
    recipe.write_text(Path(TINY).read_text() + "  faults:\n"
                      "    - {rank: 5, step: 2, phase: backward, action: kill}\n"
                      "    - {node: 3, step: 7, phase: recovery, action: kill}\n"
                      "    - {rank: 0, step: 19, phase: grad_sync, action: raise}\n"
                      "    - {rank: 6, step: 3, phase: mid_transfer, action: kill, with_ranks: [7]}\n")
    from_yaml = load_config(recipe, [TWO_PER_NODE])
    override = ("odyssey.faults=[{rank: 5, step: 2, phase: backward, action: kill}, "
                "{node: 3, step: 7, phase: recovery, action: kill}, {rank: 0, step: 19, phase: grad_sync, action: raise}, "
                "{rank: 6, step: 3, phase: mid_transfer, action: kill, with_ranks: [7]}]")
    from_cli = load_config(TINY, [TWO_PER_NODE, override])
    assert from_yaml.odyssey.faults == from_cli.odyssey.faults
    assert [str(spec) for spec in from_cli.odyssey.faults] == [
        "kill rank 5 at step 2, backward", "kill node 3 at step 7, recovery", "raise rank 0 at step 19, grad_sync",
        "kill ranks 6, 7 at step 3, mid_transfer"]
    assert load_config(TINY).odyssey.faults == []
    printed = tmp_path / "printed.yaml"  # --print-config's output loads back to the same faults
    printed.write_text(config_yaml(from_cli))
    assert load_config(printed).odyssey.faults == from_cli.odyssey.faults


ALLOWED_PHASES = ("must be one of snapshot, forward, backward, grad_sync, optimizer, transfer, recovery, "
                  "mid_transfer, group_setup, mid_group_setup; got 'backwards'")
ONE_NODE = "names no node that may fail: aim it at a rank (the recipe's 8 ranks fill 1 node(s) of cluster.devices_per_node=8"


@pytest.mark.parametrize(
    "faults, key, problem",
    [
        ("[{rank: 1, step: 2, phase: backwards, action: kill}]", "odyssey.faults[0].phase", ALLOWED_PHASES),
        ("[{rank: 1, step: 2, phase: forward, action: explode}]", "odyssey.faults[0].action",
         "must be one of kill, stop, raise, slow; got 'explode'"),
        ("[{rank: 1, node: 1, step: 2, phase: forward, action: kill}]", "odyssey.faults[0]",
         "must give exactly one of rank and node; got rank 1 and node 1"),
        ("[{step: 2, phase: forward, action: kill}]", "odyssey.faults[0]",
         "must give exactly one of rank and node; got neither"),
        ("[{rank: 1, step: 2, phase: forward, action: kill}, {rank: 8, step: 2, phase: forward, action: kill}]",
         "odyssey.faults[1].rank", "must lie in 0..7 (the recipe's 8 ranks); got 8"),
        ("[{rank: -1, step: 2, phase: forward, action: kill}]", "odyssey.faults[0].rank", "must lie in 0..7"),
        ("[{node: 0, step: 2, phase: forward, action: kill}]", "odyssey.faults[0].node", ONE_NODE),
        ("[{node: 1, step: 2, phase: forward, action: kill}]", "odyssey.faults[0].node", ONE_NODE),
        ("[{rank: 1, step: 20, phase: forward, action: kill}]", "odyssey.faults[0].step",
         "must lie in 0..19 (training.train_iters is 20); got 20"),
        ("[{rank: 1, step: -1, phase: forward, action: kill}]", "odyssey.faults[0].step", "must lie in 0..19"),
        ("[{rank: 1, phase: forward, action: kill}]", "odyssey.faults[0].step", "must be given"),
        ("[{rank: 1, step: two, phase: forward, action: kill}]", "odyssey.faults[0].step", "expected Optional[int]"),
        ("[{rank: 1, stp: 2, phase: forward, action: kill}]", "odyssey.faults[0].stp",
         "unknown key; allowed here: action, factor, join, node, phase, rank, step, steps, with_ranks"),
        ("[5]", "odyssey.faults[0]", "must be a mapping of rank, node, step, phase, action, with_ranks, join, factor, steps; got 5"),
        ("{rank: 5}", "odyssey.faults", "must be a list"),
        ("[{node: 1, step: 2, phase: forward, action: kill, with_ranks: [3]}]", "odyssey.faults[0].with_ranks",
         "must go with rank, not node"),
        ("[{rank: 1, step: 2, phase: forward, action: stop, with_ranks: [3]}]", "odyssey.faults[0].action",
         "must be kill for ranks failing together (with_ranks); got stop"),
        ("[{rank: 1, step: 2, phase: forward, action: kill, with_ranks: [3, 1]}]", "odyssey.faults[0].with_ranks",
         "must name other ranks than rank 1, each once; got [3, 1]"),
        ("[{rank: 1, step: 2, phase: forward, action: kill, with_ranks: [3, 3]}]", "odyssey.faults[0].with_ranks",
         "each once"),
        ("[{rank: 1, step: 2, phase: forward, action: kill, with_ranks: [8]}]", "odyssey.faults[0].with_ranks",
         "must name ranks of rank 1's node, 0..7 (cluster.devices_per_node=8): it kills their pids; got 8"),
        ("[{rank: 1, step: 2, action: kill}]", "odyssey.faults[0].phase", "must be given for action kill"),
        ("[{rank: 1, step: 2, phase: forward, action: kill, factor: 2.0}]", "odyssey.faults[0].factor",
         "goes with action slow only; got 2.0 with action kill"),
        ("[{rank: 1, step: 2, action: slow, steps: 3}]", "odyssey.faults[0].factor",
         "must be a number above 1 with action slow (each op takes factor times its time); got None"),
        ("[{rank: 1, step: 2, action: slow, factor: 0.5, steps: 3}]", "odyssey.faults[0].factor", "got 0.5"),
        ("[{rank: 1, step: 2, action: slow, factor: 2.0}]", "odyssey.faults[0].steps",
         "must be at least 1 with action slow (how many steps the rank stays slow); got None"),
        ("[{rank: 1, step: 2, phase: forward, action: slow, factor: 2.0, steps: 3}]", "odyssey.faults[0].phase",
         "must be left out with action slow"),
        ("[{node: 1, step: 2, action: slow, factor: 2.0, steps: 3}]", "odyssey.faults[0]",
         "action slow takes one rank and a step (no node, with_ranks or join)"),
        ("[{rank: 9, step: 2, action: slow, factor: 2.0, steps: 3}]", "odyssey.faults[0].rank", "must lie in 0..7"),
        ("[{rank: 1, step: 2, phase: snapshot, action: kill}]", "odyssey.faults[0].step",
         "must be a step that takes a snapshot (a positive multiple of odyssey.snapshot_interval, None) for phase "
         "snapshot; got 2"),
    ],
)
def test_bad_fault_is_one_line_naming_its_key(faults, key, problem):
    with pytest.raises(ConfigError) as info:
        load_config(TINY, [f"odyssey.faults={faults}"])
    assert info.value.key == key
    assert problem in info.value.problem
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(
    "faults, key, problem",
    [
        ("[{node: 0, step: 2, phase: forward, action: kill}]", "odyssey.faults[0].node",
         ("must lie in 1..3 (the recipe's 8 ranks fill 4 node(s) of cluster.devices_per_node=2, and node 0 hosts "
          "the controller, whose loss ends the run); got 0")),
        ("[{node: 4, step: 2, phase: forward, action: kill}]", "odyssey.faults[0].node", "must lie in 1..3"),
        ("[{node: 1, step: 2, phase: forward, action: stop}]", "odyssey.faults[0].action",
         "must be kill for a node fault"),
        ("[{rank: 1, step: 2, phase: forward, action: kill, with_ranks: [0, 2]}]", "odyssey.faults[0].with_ranks",
         "must name ranks of rank 1's node, 0..1 (cluster.devices_per_node=2): it kills their pids; got 2"),
    ],
)
def test_bad_node_fault_on_four_nodes(faults, key, problem):
    with pytest.raises(ConfigError) as info:
        load_config(TINY, [TWO_PER_NODE, f"odyssey.faults={faults}"])
    assert (info.value.key, problem in info.value.problem) == (key, True), info.value


def test_beside_a_dedicated_controller_every_node_of_ranks_may_fail():
    dedicated = [TWO_PER_NODE, "cluster.dedicated_controller=true"]
    config = load_config(TINY, [*dedicated, "odyssey.faults=[{node: 4, step: 2, phase: forward, action: kill}]"])
    assert config.odyssey.faults[0].node == 4  # nodes 1..4 hold the ranks; node 0 only the controller
    with pytest.raises(ConfigError) as info:
        load_config(TINY, [*dedicated, "odyssey.faults=[{node: 5, step: 2, phase: forward, action: kill}]"])
    assert info.value.key == "odyssey.faults[0].node" and info.value.problem == (
        "must lie in 1..4 (the recipe's 8 ranks fill 4 node(s) of cluster.devices_per_node=2, nodes 1..4: node 0 is "
        "the dedicated controller's, whose loss ends the run); got 5")


# -- the injector in this process ----------------------------------------------------

PHASES = (Phase.forward, Phase.backward, Phase.grad_sync, Phase.optimizer, Phase.transfer, Phase.recovery,
          Phase.mid_transfer, Phase.group_setup, Phase.mid_group_setup)


@pytest.fixture
def launcher():
    """A stand-in for the node launcher: a process a node fault may kill; one that no
    fault was meant to kill must still be running at the end."""
    process = subprocess.Popen(["sleep", "60"])
    yield process
    assert process.poll() is None, "a fault killed the launcher"
    process.kill()
    process.wait()


def test_raise_fires_at_its_point_once_and_logs_first(caplog, launcher):
    injector = FaultInjector([fault(rank=3, step=2, phase="backward", action="raise")],
                             rank=3, node=0, local_rank=3, launcher_pid=launcher.pid)
    injector.fire(Phase.forward, 2)
    injector.fire(Phase.backward, 1)
    with caplog.at_level(logging.WARNING), pytest.raises(InjectedFault) as info:
        injector.fire(Phase.backward, 2)
    assert str(info.value) == "odyssey.faults[0]: raise rank 3 at step 2, backward"
    assert "rank 3: injecting odyssey.faults[0]: raise rank 3 at step 2, backward" in caplog.text
    injector.fire(Phase.backward, 2)  # the step replayed after recovery runs clean


def test_a_fault_listed_twice_also_fails_the_replay(launcher):
    twice = [fault(rank=0, step=4, phase="optimizer", action="raise")] * 2
    injector = FaultInjector(twice, rank=0, node=0, local_rank=0, launcher_pid=launcher.pid)
    for key in ("odyssey.faults[0]", "odyssey.faults[1]"):
        with pytest.raises(InjectedFault, match=re.escape(key)):
            injector.fire(Phase.optimizer, 4)
    injector.fire(Phase.optimizer, 4)


def test_a_slow_rank_is_slowed_by_its_factor_for_its_steps_replays_included_and_fires_no_phase(caplog, launcher):
    config = load_config(TINY, ["odyssey.faults=[{action: slow, rank: 3, step: 2, factor: 2.0, steps: 3}]"])
    [spec] = config.odyssey.faults
    assert str(spec) == "slow rank 3 x2 for steps 2..4"
    injector = FaultInjector([spec], rank=3, node=0, local_rank=3, launcher_pid=launcher.pid)
    elsewhere = FaultInjector([spec], rank=2, node=0, local_rank=2, launcher_pid=launcher.pid)
    for phase in PHASES:
        injector.fire(phase, 2)  # no phase of it kills, stops or raises
    with caplog.at_level(logging.WARNING):
        assert [injector.slowdown(step) for step in range(7)] == [1.0, 1.0, 2.0, 2.0, 2.0, 1.0, 1.0]
    assert caplog.text.count("rank 3: injecting odyssey.faults[0]: slow rank 3 x2 for steps 2..4") == 1
    assert injector.slowdown(3) == 2.0  # a replayed step is slow again: the device stays slow
    assert [elsewhere.slowdown(step) for step in range(7)] == [1.0] * 7


def test_a_stretched_op_takes_its_factor_times_its_own_time_and_counts_as_done():
    """The slow fault's mechanism: the op's timer sleeps at its stop, inside the timed
    interval; each op of the step's list moves the rank's position on by one."""
    import time

    import torch

    from odyssey_megatron.runtime.rank.op_timers import FORWARD, OPTIMIZER, OpTimers

    timers = OpTimers(torch.device("cpu"))
    assert timers.position is None
    timers.begin_step(4, stretch=3.0)
    began = time.perf_counter()
    for _ in range(2):
        timers(FORWARD).start()
        time.sleep(0.05)
        timers(FORWARD).stop()
    took = time.perf_counter() - began
    timers(OPTIMIZER).start()
    timers(OPTIMIZER).stop()
    assert timers.position == (4, 2)  # the optimizer is no op of the list
    seconds, count = timers.take()[FORWARD]
    assert count == 2 and 0.29 <= seconds <= took and took >= 0.3
    timers.begin_step(5)
    assert timers.position == (5, 0) and timers.stretch == 1.0
    timers.end_steps()
    assert timers.position is None


def test_rank_faults_aimed_elsewhere_never_fire(launcher):
    faults = [fault(rank=1, step=0, phase="forward", action="raise"), fault(rank=1, step=1, phase="recovery", action="raise")]
    for rank, node, local_rank in [(0, 0, 0), (2, 0, 2), (9, 1, 1)]:
        injector = FaultInjector(faults, rank=rank, node=node, local_rank=local_rank, launcher_pid=launcher.pid)
        for step in range(3):
            for phase in PHASES:
                injector.fire(phase, step)


class MarkingStore:
    """The store calls the injector makes: a fired spec is marked in it."""

    def __init__(self):
        self.values = {}

    def set(self, key, value):
        self.values[key] = value

    def check(self, keys):
        return all(k in self.values for k in keys)


def test_a_join_fault_strikes_in_the_first_generation_that_takes_workers_back_whatever_its_step(launcher):
    injector = FaultInjector([fault(rank=5, join=True, phase="mid_transfer", action="raise")],
                             rank=5, node=0, local_rank=5, launcher_pid=launcher.pid, store=MarkingStore())
    for step in range(4):
        injector.fire(Phase.mid_transfer, step)  # generations that take nobody back
    injector.in_join = True
    with pytest.raises(InjectedFault, match=re.escape("raise rank 5 in the first join, mid_transfer")):
        injector.fire(Phase.mid_transfer, 7)
    injector.fire(Phase.mid_transfer, 9)  # the next join runs clean


def test_a_restarted_worker_does_not_fire_the_faults_its_predecessor_fired(launcher):
    faults = [fault(rank=2, step=1, phase="forward", action="raise"), fault(rank=2, step=3, phase="forward", action="raise")]
    store = MarkingStore()
    first = FaultInjector(faults, rank=2, node=0, local_rank=2, launcher_pid=launcher.pid, store=store)
    with pytest.raises(InjectedFault, match=re.escape("odyssey.faults[0]")):
        first.fire(Phase.forward, 1)
    restarted = FaultInjector(faults, rank=2, node=0, local_rank=2, launcher_pid=launcher.pid, store=store)
    restarted.fire(Phase.forward, 1)  # a replay of step 1 on the restarted worker runs clean
    with pytest.raises(InjectedFault, match=re.escape("odyssey.faults[1]")):
        restarted.fire(Phase.forward, 3)  # the one that never fired still does


@pytest.mark.parametrize("phase", ["restore", "checkpoint"])
def test_a_phase_of_the_worker_that_no_fault_strikes_in_is_refused_by_the_config(phase):
    with pytest.raises(ConfigError) as info:
        load_config(TINY, [f"odyssey.faults=[{{rank: 1, step: 2, phase: {phase}, action: kill}}]"])
    assert info.value.key == "odyssey.faults[0].phase"
    assert info.value.problem == ALLOWED_PHASES.replace("'backwards'", repr(phase))


def test_a_fault_s_phase_matches_the_phase_the_worker_fires_and_only_restore_and_checkpoint_have_none():
    matched = {phase for phase in Phase if any(fault == phase for fault in FaultPhase)}
    assert matched == set(Phase) - {Phase.restore, Phase.checkpoint}


# -- the injector in a child process -------------------------------------------------


def _worker(faults: list[FaultSpec], launch: WorkerLaunch, reached: str) -> None:
    """Pass every point of steps 0..2 but the fault's; touch ``reached`` before firing it."""
    injector = FaultInjector.for_worker(faults, launch)
    spec = faults[0]
    for step in range(3):
        for phase in PHASES:
            if (step, phase) == (spec.step, spec.phase):
                Path(reached).touch()
            injector.fire(phase, step)


def _pass_every_point(faults: list[FaultSpec], launches: list[WorkerLaunch]) -> None:
    for launch in launches:
        injector = FaultInjector.for_worker(faults, launch)
        for step in range(3):
            for phase in PHASES:
                injector.fire(phase, step)


def _launch(rank: int, *, node: int, local_rank: int, launcher_pid: int) -> WorkerLaunch:
    return WorkerLaunch(rank=rank, local_rank=local_rank, node=node, world_size=8, store_host="127.0.0.1",
                        store_port=1, node_store_port=2, node_ranks=(rank,), launcher_pid=launcher_pid,
                        timeouts=Timeouts(0.1, 1.0, 30.0, 120.0), secret=bytes(32))


def _start(*args, target=_worker) -> mp.Process:
    child = mp.get_context("spawn").Process(target=target, args=args, daemon=True)
    child.start()
    return child


@pytest.mark.timeout(60)
def test_kill_ends_the_worker_with_sigkill_at_its_point(tmp_path, launcher):
    reached = tmp_path / "reached"
    launch = _launch(4, node=0, local_rank=4, launcher_pid=launcher.pid)
    child = _start([fault(rank=4, step=1, phase="grad_sync", action="kill")], launch, str(reached))
    try:
        child.join(30)
        assert child.exitcode == -signal.SIGKILL
        assert reached.exists()
    finally:
        child.kill()


@pytest.mark.timeout(60)
def test_stop_freezes_the_worker_until_continued(tmp_path, launcher):
    """SIGSTOP, as a hung worker; once continued, ``fire`` returns and the worker runs on."""
    reached = tmp_path / "reached"
    launch = _launch(2, node=0, local_rank=2, launcher_pid=launcher.pid)
    child = _start([fault(rank=2, step=2, phase="transfer", action="stop")], launch, str(reached))
    try:
        _, status = os.waitpid(child.pid, os.WUNTRACED)
        assert os.WIFSTOPPED(status) and os.WSTOPSIG(status) == signal.SIGSTOP
        assert reached.exists()
        os.kill(child.pid, signal.SIGCONT)
        child.join(30)
        assert child.exitcode == 0
    finally:
        child.kill()


@pytest.mark.timeout(60)
def test_node_fault_kills_the_launcher_and_the_worker(tmp_path):
    reached = tmp_path / "reached"
    launcher = subprocess.Popen(["sleep", "60"])
    launch = _launch(2, node=1, local_rank=0, launcher_pid=launcher.pid)
    worker = _start([fault(node=1, step=0, phase="optimizer", action="kill")], launch, str(reached))
    try:
        worker.join(30)
        assert worker.exitcode == -signal.SIGKILL
        assert launcher.wait(30) == -signal.SIGKILL
        assert reached.exists()
    finally:
        worker.kill()
        launcher.kill()
        launcher.wait()


@pytest.mark.timeout(60)
def test_node_fault_spares_other_nodes_and_the_other_workers_of_its_node(launcher):
    """Only the node's first worker (local rank 0) carries a node fault out; in a child,
    since a wrong match would kill the process it fires in."""
    launches = [_launch(3, node=1, local_rank=1, launcher_pid=launcher.pid),
                _launch(0, node=0, local_rank=0, launcher_pid=launcher.pid),
                _launch(4, node=2, local_rank=0, launcher_pid=launcher.pid)]
    child = _start([fault(node=1, step=1, phase="backward", action="kill")], launches, target=_pass_every_point)
    try:
        child.join(30)
        assert child.exitcode == 0
    finally:
        child.kill()


def _wait_killed(injector_args: dict, store_port: int) -> None:
    """A rank that a fault kills with another: publish its pid, then wait to be killed."""
    import time

    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", store_port, is_master=False)
    FaultInjector(store=store, **injector_args)
    time.sleep(60)


def _fire_together(injector_args: dict, store_port: int, phase: str, step: int) -> None:
    import torch.distributed as dist

    injector = FaultInjector(store=dist.TCPStore("127.0.0.1", store_port, is_master=False), **injector_args)
    injector.fire(phase, step)


@pytest.mark.timeout(60)
def test_ranks_failing_together_are_killed_in_one_instant_by_the_first(launcher):
    """Rank 1 carries out ``with_ranks: [3]``: it kills rank 3 (its pid from the store) and
    then itself, within milliseconds; rank 3 only published its pid."""
    import datetime
    import time

    import torch.distributed as dist

    faults = [fault(rank=1, step=2, phase="mid_transfer", action="kill", with_ranks=[3])]
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=30))
    common = dict(faults=faults, node=0, launcher_pid=launcher.pid)
    peer = _start(dict(rank=3, local_rank=3, **common), store.port, target=_wait_killed)
    store.wait([pid_key(3)])
    assert int(store.get(pid_key(3))) == peer.pid
    carrier = _start(dict(rank=1, local_rank=1, **common), store.port, "mid_transfer", 2, target=_fire_together)
    try:
        deaths, deadline = {}, time.monotonic() + 30
        while len(deaths) < 2 and time.monotonic() < deadline:
            for name, child in (("peer", peer), ("carrier", carrier)):
                if name not in deaths and child.exitcode is not None:
                    deaths[name] = time.monotonic()
            time.sleep(0.001)
        assert (peer.exitcode, carrier.exitcode) == (-signal.SIGKILL, -signal.SIGKILL)
        assert abs(deaths["peer"] - deaths["carrier"]) < 0.05
    finally:
        peer.kill()
        carrier.kill()


def test_a_fault_with_ranks_needs_the_store(launcher):
    faults = [fault(rank=1, step=2, phase="forward", action="kill", with_ranks=[3])]
    for rank in (1, 3):
        with pytest.raises(ValueError, match="give the injector the store"):
            FaultInjector(faults, rank=rank, node=0, local_rank=rank, launcher_pid=launcher.pid)
    FaultInjector(faults, rank=2, node=0, local_rank=2, launcher_pid=launcher.pid)  # not in it: no store needed


def test_a_rank_killed_with_another_publishes_its_pid_again_in_a_restarted_controllers_store():
    """The rank that kills ``with_ranks`` reads their pids from the run's store: after a
    restarted controller took the ranks back (``WorkerProcess.reconnected``), from its store,
    which never saw the pids published in the lost one's; without this it waited out the
    store's timeout there (120 s, measured in a reattached run) before it killed anyone."""
    import torch.distributed as dist

    spec = fault(rank=2, step=4, phase="forward", action="kill", with_ranks=[3])
    lost, restarted = dist.HashStore(), dist.HashStore()
    injector = FaultInjector([spec], rank=3, node=1, local_rank=1, launcher_pid=1, store=lost)
    assert lost.get(pid_key(3)) == str(os.getpid()).encode()
    injector.follow(restarted)
    assert restarted.get(pid_key(3)) == str(os.getpid()).encode() and injector.store is restarted
    killer = FaultInjector([spec], rank=2, node=1, local_rank=0, launcher_pid=1, store=lost)
    killer.follow(restarted)
    assert not restarted.check([pid_key(2)])  # the killer publishes nothing: no one kills it
