"""Scaffolding for the control-side tests: a controller process, one launcher process per
"node" and workers that register, heartbeat, adopt the published plan and then wait, all
with the real classes; tests see them the way an operator does, through ``workers.json``
and ``events.jsonl``. Spawned processes import this module, so it imports only what they
need (torch comes with the store)."""

from __future__ import annotations

import json
import logging
import multiprocessing
import os
import signal
import sys
import datetime
import threading
import time
from functools import partial
from pathlib import Path
from typing import Any, Callable

from odyssey_megatron.estimator.program import step_program
from odyssey_megatron.plan import ExecutionPlan, PipelinePlan, StagePlan
from odyssey_megatron.profile import uniform_profile
from odyssey_megatron.runtime.control.controller import Controller
from odyssey_megatron.runtime.control.launch_config import LaunchConfig
from odyssey_megatron.runtime.control.launcher import NodeLauncher
from odyssey_megatron.runtime.protocol.auth import SECRET_FILE, SignedStore, Signer, connect_signed, read_secret
from odyssey_megatron.runtime.protocol.launch import EXIT_CONTROLLER_LOST, WorkerLaunch
from odyssey_megatron.timeouts import Timeouts
from odyssey_megatron.runtime.rank.controller_link import ControllerLink
from odyssey_megatron.schedules.program import publish, read_published

LIFETIME_S = 120
"""Every process of a cluster ends by itself after this, should a test fail to end it."""
ABORT_REQUEST = "abort-generation-0"
"""A file a test creates in the run directory to have the controller abort generation 0."""


def _log_to_stderr(name: str) -> None:
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s {name} %(name)s: %(message)s")


def idle_worker(launch: WorkerLaunch, *, reporting_rank: int | None = None, aborts: Path | None = None,
                reattaching: bool = False, giving_up: tuple[int, ...] = ()) -> None:
    """Register, heartbeat, adopt plan generation 0, then wait; ``reporting_rank`` reports
    an error of its own instead and hangs. When the controller aborts generation 0, the
    worker writes the time it heard of it to ``aborts/<rank>``. ``reattaching``: once the
    controller is lost, it reattaches to a restarted one (as having committed step 0) and
    waits again where the verdict takes it back, else it exits as the real worker does; a
    rank in ``giving_up`` exits at once instead (``EXIT_CONTROLLER_LOST``), as a real worker
    whose blocks are at different steps does."""
    _log_to_stderr(f"rank {launch.rank}")
    link = ControllerLink(launch)
    if aborts is not None:
        link.on_abort = lambda generation: _note(aborts / str(launch.rank), repr(time.time()))
    lost = threading.Event()
    if reattaching:
        link.on_controller_lost = lambda why: lost.set()
    link.start()
    link.generation = link.watching = link.wait_plan(newer_than=-1).plan.generation
    if launch.rank == reporting_rank:
        link.report_failure("RuntimeError: injected")
    deadline = time.monotonic() + LIFETIME_S
    while lost.wait(max(0.0, deadline - time.monotonic())):
        lost.clear()
        if launch.rank in giving_up:
            os._exit(EXIT_CONTROLLER_LOST)
        verdict = link.reattach(epoch=0, generation=link.generation, committed_step=0)
        if verdict is None:
            os._exit(EXIT_CONTROLLER_LOST)
        if not verdict.accepted:
            os._exit(0)


def _note(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` at once (a reader never sees it half written)."""
    partial_path = path.with_name(path.name + ".partial")
    partial_path.write_text(text)
    partial_path.rename(path)


def _controller_main(run_dir: Path, timeouts: Timeouts, plan_json: str | None, port_out: multiprocessing.Queue,
                     port: int = 0) -> None:
    """A controller on ``port`` (0: any free one) that publishes ``plan_json`` (None: no plan,
    as a restarted controller waits for the survivors first)."""
    _log_to_stderr("controller")
    controller = Controller(host="127.0.0.1", port=port, timeouts=timeouts, run_dir=run_dir)
    controller.start()
    if plan_json is not None:
        controller.publish_plan(*read_published(json.loads(plan_json)))
    port_out.put(controller.port)
    deadline = time.monotonic() + LIFETIME_S
    while not (run_dir / ABORT_REQUEST).exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    if time.monotonic() < deadline:
        controller.abort(0)
        time.sleep(deadline - time.monotonic())


def _launcher_main(config: LaunchConfig, timeouts: Timeouts, target: Callable[[WorkerLaunch], None],
                   restart_workers: int, run_dir: Path) -> None:
    _log_to_stderr(f"launcher {config.node_rank}")
    sys.exit(NodeLauncher(config, timeouts=timeouts, target=target, secret=read_secret(run_dir / SECRET_FILE),
                          restart_workers=restart_workers).run())


def signed_client(port: int, run_dir: Path, *, timeout_s: float = 10) -> SignedStore:
    """A client of the controller's store on ``port`` holding the secret of ``run_dir``'s run."""
    return connect_signed("127.0.0.1", port, timeout=datetime.timedelta(seconds=timeout_s),
                          signer=Signer(read_secret(run_dir / SECRET_FILE)))


def process_state(pid: int) -> str | None:
    """The kernel's one-letter state (R, S, T stopped, Z zombie...), None once it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):  # gone before the open, or between it and the read
        return None
    return stat.rsplit(")", 1)[1].split()[0]


def alive(pid: int) -> bool:
    return process_state(pid) not in (None, "Z", "X")


def wait_for(predicate: Callable[[], Any], *, timeout: float, what: str, interval: float = 0.01) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise TimeoutError(f"{what}: not within {timeout} s")


class LocalCluster:
    """A controller and ``nodes`` launchers of ``per_node`` workers on this machine,
    started by ``with`` and every process of it killed on leaving."""

    def __init__(self, run_dir: Path, *, nodes: int, per_node: int, timeouts: Timeouts,
                 reporting_rank: int | None = None, restart_workers: int = 0, aborts: Path | None = None,
                 reattaching: bool = False, giving_up: tuple[int, ...] = ()):
        self.run_dir, self.nodes, self.per_node, self.timeouts = run_dir, nodes, per_node, timeouts
        self.restart_workers = restart_workers
        self.port: int | None = None
        self.target = partial(idle_worker, reporting_rank=reporting_rank, aborts=aborts, reattaching=reattaching,
                              giving_up=giving_up)
        self.controller: multiprocessing.Process | None = None
        self.launchers: list[multiprocessing.Process] = []

    def __enter__(self) -> "LocalCluster":
        context = multiprocessing.get_context("spawn")
        port_out = context.Queue()
        workers = range(self.nodes * self.per_node)  # data parallel over every rank, one micro-batch each
        plan = ExecutionPlan(generation=0, policy="initial", num_layers=2, tensor_parallel_size=1,
                             pipelines=tuple(PipelinePlan((StagePlan(w, (0, 2)),), (w,)) for w in workers))
        published = json.dumps(publish(plan, step_program(plan, uniform_profile(num_layers=2))))
        self.controller = context.Process(target=_controller_main,
                                          args=(self.run_dir, self.timeouts, published, port_out))
        self.controller.start()
        try:
            self.port = port_out.get(timeout=60)
            for node in range(self.nodes):
                self.start_launcher(node)
            wait_for(self._ready, timeout=60, what="every worker registered and, unless failed, running generation 0")
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc_info: Any) -> None:
        workers = self.workers()
        for process in [self.controller, *self.launchers]:
            if process is not None and process.is_alive():
                process.kill()
            if process is not None:
                process.join(timeout=10)
        for row in workers.values():  # a worker outlives its launcher only if the test failed
            if row["pid"] is not None and alive(row["pid"]):
                os.kill(row["pid"], signal.SIGKILL)

    def restart_controller(self) -> None:
        """Start a controller again on the same port and run directory (the lost one's
        secret), publishing nothing."""
        context = multiprocessing.get_context("spawn")
        port_out = context.Queue()
        self.controller = context.Process(target=_controller_main,
                                          args=(self.run_dir, self.timeouts, None, port_out, self.port))
        self.controller.start()
        port_out.get(timeout=60)  # its store is open

    def start_launcher(self, node: int) -> multiprocessing.Process:
        """Start node ``node``'s launcher (again, for a replacement node), in its own process group."""
        flags = {"nnodes": str(self.nodes), "node_rank": str(node), "master_port": str(self.port),
                 "nproc_per_node": str(self.per_node)}
        config = LaunchConfig.resolve(flags, environ={})
        launcher = multiprocessing.get_context("spawn").Process(
            target=_launcher_main, args=(config, self.timeouts, self.target, self.restart_workers, self.run_dir))
        launcher.start()
        self.launchers.append(launcher)
        return launcher

    def _ready(self) -> bool:
        workers = self.workers()
        return (len(workers) == self.nodes * self.per_node
                and all(w["pid"] is not None for w in workers.values())
                and all(w["generation"] == 0 for w in workers.values() if w["state"] == "alive"))

    def workers(self) -> dict[int, dict]:
        path = self.run_dir / "workers.json"
        return {int(rank): row for rank, row in json.loads(path.read_text()).items()} if path.exists() else {}

    def events(self, kind: str | None = None) -> list[dict]:
        path = self.run_dir / "events.jsonl"
        lines = path.read_text().split("\n")[:-1] if path.exists() else []  # a line still being written has no \n
        records = [json.loads(line) for line in lines]
        return [r for r in records if kind is None or r["event"] == kind]

    def wait_event(self, kind: str, *, timeout: float, **match: Any) -> dict:
        def found():
            return next((e for e in self.events(kind) if all(e.get(k) == v for k, v in match.items())), None)

        return wait_for(found, timeout=timeout, what=f"a {kind} event with {match}")
