"""The live run's control plane as it is today, at 1,024, 4,096 and 16,384 ranks (issue 34):
how big the published plan is, what each worker reads of it, how many store operations
the protocol asks of the controller's one TCPStore, and how long until every worker holds
a new plan. A baseline for the redesign, which changes the same protocol.

Layout: Llama-2 7B as ``benchmarks/plan_search.py`` widens it (Ascend 910B recipe, TP1 x
PP4, 8 devices per node, so every rank is one plan worker), with 16 micro-batches per
pipeline (4 x PP: a 1F1B bubble of 16 %; ``--micro-batches``). The plan is the one a
recovery publishes: ``DecisionCenter.from_recipe`` then ``on_failure`` of one rank in the
middle, published as ``PlanPublished.to_json``, the exact text ``ControllerLink.wait_plan``
reads from ``plan_key``.

Measured, per row:
- ``plan_bytes``: that text's length; ``bytes_read_per_worker``: the same (every rank
  reads the whole key). The table adds the time one worker takes to parse it
  (``PlanPublished.from_json``), on this machine.
- ``own_share_bytes``: the largest, over workers, of the JSON bytes of what the worker
  needs from that text: its op list, its pipeline's entry (stages and micro-batches: its
  neighbours), reroutes into its pipeline or onto it, sync units it is a member of (its DP
  groups, with their member lists), transfers it sends or receives, the comm rounds, the
  plan's scalar fields and the message's other fields (its ``restore``, if any, whole).
  The table also gives the median worker's.
- The server's cost: a real TCPStore server (libuv, as the Controller opens it) in this
  process, a real controller poll on a thread beside it (``Controller._poll``'s requests:
  its heartbeat, the inbox length, ``check`` and ``multi_get`` of every rank's and node's
  heartbeat key, each heartbeat parsed; plus ``TrainingRun``'s commit check) over all the
  row's keys every ``poll_interval``, and simulated nodes in driver processes, each rank
  and launcher on a store connection of its own, speaking the protocol with its key
  functions and messages: each rank's heartbeat thread (set its beat, get the
  controller's, check the abort key), its launcher (set the node's beat, and every poll
  interval get the controller's beat and the launcher key and the kill queue's length),
  and per step each rank's commit (append its ``StepReport``, add to the step counter,
  wait for and get the decision key). The poll runs alone for half a window: the server's
  CPU per poll (this process's CPU time less the poll thread's own). Then the simulated
  nodes run alone, closed-loop (as fast as they are answered, not at their periods) for
  a window: the server's CPU per request (this process's CPU time over their requests).
- A live recovery: simulated workers block in ``wait`` on the new plan's key; the plan is
  set; each gets it, checks the abort key, counts into ``arrived_key`` and polls it (with
  the abort key) every ``poll_interval / 10`` until all have arrived
  (``Worker._wait_all_arrived``), then counts into ``ready_key`` while the owner polls it
  (``TrainingRun._wait_ready``); heartbeats are left out of this run. The time from the
  plan's ``set`` to the last worker's ``get`` is ``time_to_plan_s`` where every rank of
  the row was simulated. The plan is first set under a spare key: the libuv server drops
  any request whose payload is over 8 MiB (the client sees "Connection reset by peer"),
  and where it drops the plan, today's controller cannot publish it and
  ``time_to_plan_s`` is null.

Computed, not measured: ``steady_ops_per_s`` and ``recovery_ops_per_s`` are the rates the
protocol asks for at the row's size: its periods (``odyssey`` defaults: heartbeat 0.1 s,
poll 0.05 s) and a stated step time (``--step-s``, 5 s) times the operations one node's
period and one step take, counted by running the same simulated-node code against a
counting store. Steady: heartbeats, launchers, controller poll, commits. Recovery: the
same heartbeats, launchers and poll plus every rank's arrival poll, the phase that lasts
from a worker's plan read until the last worker's; the plan reads themselves are
``time_to_plan_s``. Process-group rendezvous (gloo's own keys under ``process_group_prefix``)
is not counted. The table's "server busy" is the share of one core the store's single
libuv thread would need for the steady (recovery) rate: the server's CPU per poll at the
row's size times the polls per second the controller asks for, plus the rest of the rate
times the server's CPU per request.

Extrapolated (listed in the row's ``extrapolated``): where the machine holds fewer
clients than the row has ranks (``--clients``, 1,024 by default, and at most
``--read-budget`` bytes of plan reads), ``time_to_plan_s`` = ranks x plan bytes / the
server's byte rate measured while the simulated workers read this row's plan. That rate is
a lower bound: clients and server share this machine's 2 cores (and a CI run).

Run: PYTHONPATH=. nice .venv/bin/python benchmarks/control_plane.py [--quick]
(about 7 minutes on the shared 2-core machine; ``--quick``: 1,024 and 4,096 ranks, 256
clients, shorter windows, about 3 minutes).

One run, 2026-11-27, shared 2-core machine under a CI run (load about 7; poll times and
byte rates vary by 2x between runs):

| ranks | plan MB | own share KB | parse s | steady ops/s | recovery ops/s | poll ms | time to plan s |
|---|---|---|---|---|---|---|---|
| 1,024 | 1.08 | 4.2 / 2.9 | 0.64 | 40,599 (99 %) | 449,380 (1024 %) | 111 | 2.44 |
| 4,096 | 4.53 | 9.1 / 7.8 | 2.72 | 162,097 (536 %) | 1,797,220 (5259 %) | 182 | 58.3 (extrapolated) |
| 16,384 | 19.21 | 31.2 / 28.3 | 10.4 | 648,087 (2785 %) | 7,188,580 (20098 %) | 1,190 | none: refused |

Plan MB: also what each worker reads; own share: max / median; ops/s: asked for (server
busy); time to plan at 4,096 from 441 readers at 318 MB/s. The server's CPU per request
was 23-29 us. Each worker reads 250-620 times its share; one store thread carries
today's steady traffic at about 1,000 ranks and no more; the arrival poll (two requests
per rank every 5 ms) asks ten times that during a recovery; the controller's poll over
every heartbeat outlasts its 50 ms period from 4,096 ranks on (at 1,024: 15 to 111 ms
across runs here); and a plan over 8 MiB (16,384 ranks at 16, or 8, micro-batches per
pipeline) cannot be published at all.
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing
import socket
import statistics
import threading
import time
from dataclasses import dataclass

import torch.distributed as dist

from odyssey_megatron.config import load_config
from odyssey_megatron.decision_center import DecisionCenter
from odyssey_megatron.runtime.protocol import (
    CONTROLLER_HEARTBEAT,
    INBOX,
    Heartbeat,
    PlanPublished,
    StepReport,
    abort_key,
    applied_key,
    arrived_key,
    decided_key,
    kill_orders_key,
    launcher_key,
    node_heartbeat_key,
    plan_key,
    rank_heartbeat_key,
    ready_key,
    step_report_key,
)
from odyssey_megatron.runtime.step_ledger import Outcome
from odyssey_megatron.timeouts import Timeouts
from plan_search import DEVICES_PER_NODE, MODELS, recipe

_, DEVICE, TP, PP, _ = MODELS["7B"]  # plan_search.py's 7B, widened the same way
RANKS = (1024, 4096, 16384)
RUNNING = 0
"""The generation the simulated ranks train in; the recovery publishes the next one."""
STEPS = 1000
"""Steps whose decision key is set before the steady window: a commit never waits."""
DRIVERS = 4
THREADS_PER_DRIVER = 8


# -- the plan ----------------------------------------------------------------------------


def recovery_plan(config) -> tuple[str, str]:
    """(the published text of the plan after one rank in the middle fails, what was chosen)."""
    center = DecisionCenter.from_recipe(config)
    decision = center.on_failure(ranks=[config.parallel.num_ranks // 2 + TP])
    published = PlanPublished(center.plan, center.program, time.time(), start_step=100)
    return published.to_json(), f"{decision.chosen.policy} {decision.chosen.layout}"


def own_shares(text: str) -> list[int]:
    """Per live worker, the JSON bytes of the parts of the published plan it needs (see the
    module docstring): what a per-worker slice would hold, before any compaction."""
    def size(value) -> int:
        return len(json.dumps(value))

    data = json.loads(text)
    plan = data["plan"]
    program = plan["step_program"]
    scalars = size({k: v for k, v in data.items() if k != "plan"}) + size(
        {k: v for k, v in plan.items() if not isinstance(v, (list, dict))}) + size(
        {k: v for k, v in program.items() if k != "ops"}) + size(plan["comm_rounds"])
    pipeline_of, pipeline_size = {}, []
    for p, pipeline in enumerate(plan["pipelines"]):
        pipeline_size.append(size(pipeline))
        for stage in pipeline["stages"]:
            pipeline_of[stage["worker"]] = p
    extra: dict[int, int] = {}

    def charge(worker: int, item) -> None:
        extra[worker] = extra.get(worker, 0) + size(item)

    for unit in plan["sync_units"]:
        for worker in unit["workers"]:
            charge(worker, unit)
    for transfer in plan["transfers"]:
        for worker in {transfer["src"], transfer["dst"]} - {None}:
            charge(worker, transfer)
    reroutes_of_pipeline: dict[int, int] = {}
    for reroute in plan["reroutes"]:
        charge(reroute["worker"], reroute)
        reroutes_of_pipeline[reroute["pipeline"]] = reroutes_of_pipeline.get(reroute["pipeline"], 0) + size(reroute)
    shares = []
    for worker, ops in program["ops"].items():
        p = pipeline_of[int(worker)]
        shares.append(scalars + size(ops) + pipeline_size[p] + reroutes_of_pipeline.get(p, 0)
                      + extra.get(int(worker), 0))
    return shares


# -- one node's traffic, the same code live and counted -------------------------------------


@dataclass
class SimNode:
    """A node's launcher and its ranks, each on a store connection of its own."""

    node: int
    ranks: list[int]
    launcher: object
    rank_stores: list
    report: str
    """A ``StepReport`` line as a last-stage rank appends it, appended by every simulated rank
    (the other stages' carry no micro-batches: more bytes than the real, the same requests)."""

    def beat(self, seq: int, timeouts: Timeouts) -> None:
        """One heartbeat interval: each rank's heartbeat thread (``ControllerLink._beat_loop``)
        and the launcher's beat thread and watch loop (``Launcher._watch``), which polls twice
        per beat."""
        for rank, store in zip(self.ranks, self.rank_stores):
            store.set(rank_heartbeat_key(rank), Heartbeat(seq, time.time(), RUNNING).to_json())
            Heartbeat.from_json(store.get(CONTROLLER_HEARTBEAT))
            store.check([abort_key(RUNNING)])
        self.launcher.set(node_heartbeat_key(self.node), Heartbeat(seq, time.time()).to_json())
        for _ in range(round(timeouts.heartbeat_interval / timeouts.poll_interval)):
            Heartbeat.from_json(self.launcher.get(CONTROLLER_HEARTBEAT))
            self.launcher.get(launcher_key(self.node))
            self.launcher.queue_len(kill_orders_key(self.node))

    def commit(self, step: int) -> None:
        """Each rank's ``live_step.commit_step``: report, count in, wait for the decision."""
        for store in self.rank_stores:
            store.append(step_report_key(RUNNING, step), self.report)
            store.add(applied_key(RUNNING, step), 1)
            store.wait([decided_key(RUNNING, step)], datetime.timedelta(seconds=30))
            Outcome(store.get(decided_key(RUNNING, step)))


def arrival_poll(store, world: int) -> bool:
    """One tick of ``Worker._wait_all_arrived``'s loop: whether every rank has arrived."""
    if store.add(arrived_key(RUNNING + 1), 0) >= world:
        return True
    store.check([abort_key(RUNNING + 1)])
    return False


def step_report(micro_batches: int) -> str:
    return StepReport(rank=0, micro_batches=tuple(range(micro_batches)), losses=(2.345678,) * micro_batches,
                      samples=tuple(range(1_000_000, 1_000_000 + micro_batches)), forward_s=0.123,
                      forwards=micro_batches, backward_s=0.234, backwards=micro_batches, weight_grad_s=0.0,
                      weight_grads=0,
                      optimizer_s=0.012).to_json() + "\n"


class CountingStore:
    """A dict with a store's methods, counting requests: the protocol's operations per period."""

    def __init__(self):
        self.values: dict[str, bytes] = {CONTROLLER_HEARTBEAT: Heartbeat(0, 0.0).to_json().encode()}
        self.requests = 0

    def _count(self) -> None:
        self.requests += 1

    def set(self, key, value):
        self._count()
        self.values[key] = value.encode() if isinstance(value, str) else value

    def get(self, key):
        self._count()
        return self.values.get(key, Outcome.COMMITTED.value)

    def check(self, keys):
        self._count()
        return all(k in self.values for k in keys)

    def queue_len(self, key):
        self._count()
        return 0

    def append(self, key, value):
        self._count()

    def add(self, key, amount):
        self._count()
        return 0

    def wait(self, keys, timeout=None):
        self._count()


def requests_per_period(timeouts: Timeouts) -> tuple[int, int, int]:
    """(requests of one node's heartbeat interval, of one node's step commit, of one rank's arrival tick)."""
    beat, commit, arrival = CountingStore(), CountingStore(), CountingStore()
    ranks = list(range(DEVICES_PER_NODE))
    SimNode(0, ranks, beat, [beat] * DEVICES_PER_NODE, "").beat(0, timeouts)
    SimNode(0, ranks, commit, [commit] * DEVICES_PER_NODE, "").commit(0)
    arrival_poll(arrival, world=2)
    return beat.requests, commit.requests, arrival.requests


CONTROLLER_POLL_REQUESTS = 5
"""``Controller._poll``: its beat, the inbox length, ``check`` and ``multi_get`` of every
heartbeat key; and ``TrainingRun._collect_commits``' add on the running step's counter."""


# -- the drivers (separate processes) ---------------------------------------------------------


def _client(port: int):
    return dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=120))


def _drive(port: int, nodes: list[tuple[int, list[int]]], timeouts: Timeouts, beats_per_step: int, report: str,
           conn) -> None:
    """A driver process: connect its nodes, then carry out the parent's commands."""
    sims = [SimNode(n, ranks, _client(port), [_client(port) for _ in ranks], report) for n, ranks in nodes]
    per_thread = [sims[i::THREADS_PER_DRIVER] for i in range(THREADS_PER_DRIVER)]
    conn.send("connected")
    while True:  # until the parent ends the process
        command, argument = conn.recv()
        if command == "steady":
            conn.send(_in_threads(per_thread, lambda mine: _closed_loop(mine, timeouts, beats_per_step, argument)))
        else:
            conn.send(_in_threads(per_thread, lambda mine: _recover(mine, argument, timeouts)))


def _in_threads(per_thread: list, work) -> list:
    """``work`` of each thread's nodes, run on threads at once (a store request releases the GIL)."""
    results = [None] * len(per_thread)

    def run(i):
        results[i] = work(per_thread[i])

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(per_thread))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def _closed_loop(nodes: list[SimNode], timeouts: Timeouts, beats_per_step: int, seconds: float) -> tuple[int, int]:
    """Beat (and commit every ``beats_per_step`` beats) as fast as the server answers; (beats, commits)."""
    beats = commits = 0
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        for node in nodes:
            node.beat(beats, timeouts)
        beats += 1
        if beats % beats_per_step == 0:
            for node in nodes:
                node.commit(commits % STEPS)
            commits += 1
    return beats * len(nodes), commits * len(nodes)


def _recover(nodes: list[SimNode], world: int, timeouts: Timeouts) -> dict:
    """Enter the next generation as ``Worker`` does, for this thread's simulated ranks of the
    first ``world``: wait for and read the plan, count in, poll until all arrived, count ready."""
    stores = [s for node in nodes for r, s in zip(node.ranks, node.rank_stores) if r < world]
    if not stores:
        return {"read_at": 0.0, "requests": 0, "arrived_at": 0.0}
    key = plan_key(RUNNING + 1)
    requests = 0
    for store in stores:
        store.wait([key], datetime.timedelta(seconds=120))
        store.get(key)
        requests += 2
    read_at = time.time()
    for store in stores:
        store.check([abort_key(RUNNING + 1)])
        store.add(arrived_key(RUNNING + 1), 1)
        requests += 2
    waiting = list(stores)
    while waiting:
        still = [s for s in waiting if not arrival_poll(s, world)]
        requests += len(waiting) + len(still)  # an add each, and a check of the abort key for those still waiting
        waiting = still
        if waiting:
            time.sleep(timeouts.poll_interval / 10)
    arrived_at = time.time()
    for store in stores:
        store.add(ready_key(RUNNING + 1), 1)
        requests += 1
    return {"read_at": read_at, "requests": requests, "arrived_at": arrived_at}


def start_drivers(port: int, simulated: int, timeouts: Timeouts, beats_per_step: int,
                  report: str) -> tuple[list, list]:
    """Driver processes holding the first ``simulated`` ranks' nodes, spread round-robin:
    (their pipes, the processes)."""
    context = multiprocessing.get_context("spawn")
    nodes = [(n, list(range(n * DEVICES_PER_NODE, (n + 1) * DEVICES_PER_NODE)))
             for n in range(simulated // DEVICES_PER_NODE)]
    pipes, processes = [], []
    for d in range(DRIVERS):
        parent, child = context.Pipe()
        processes.append(context.Process(target=_drive, daemon=True,
                                         args=(port, nodes[d::DRIVERS], timeouts, beats_per_step, report, child)))
        processes[-1].start()
        pipes.append(parent)
    for pipe in pipes:
        pipe.recv()  # connected
    return pipes, processes


def ask(pipes: list, command: str, argument) -> list:
    """Send every driver ``command`` and gather their threads' results."""
    for pipe in pipes:
        pipe.send((command, argument))
    return [result for pipe in pipes for result in pipe.recv()]


# -- the controller's side ---------------------------------------------------------------------


def open_store() -> dist.TCPStore:
    """A libuv TCPStore server on a free loopback port, opened as ``Controller`` opens its
    own (the server owns the listening socket from then on)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    sock.listen(socket.SOMAXCONN)
    store = dist.TCPStore("127.0.0.1", sock.getsockname()[1], is_master=True, wait_for_workers=False,
                          use_libuv=True, master_listen_fd=sock.fileno(), timeout=datetime.timedelta(seconds=120))
    sock.detach()
    return store


class ControllerPoll:
    """``Controller._poll``'s requests (see ``CONTROLLER_POLL_REQUESTS``) on a thread of this
    process every ``poll_interval``, over every heartbeat key of the row, each heartbeat
    parsed; it keeps its own CPU time (to tell the store server's apart) and durations."""

    def __init__(self, store: dist.TCPStore, keys: list[str], timeouts: Timeouts):
        self.store, self.keys, self.period = store.clone(), keys, timeouts.poll_interval
        self.cpu_s = 0.0
        self.durations: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        seq, next_poll = 0, time.monotonic()
        while not self._stop.wait(max(0.0, next_poll - time.monotonic())):
            next_poll = max(next_poll + self.period, time.monotonic())
            started, cpu = time.perf_counter(), time.thread_time()
            self.store.set(CONTROLLER_HEARTBEAT, Heartbeat(seq, time.time()).to_json())
            self.store.queue_len(INBOX)
            self.store.check(self.keys)
            for raw in self.store.multi_get(self.keys):
                Heartbeat.from_json(raw)
            self.store.add(applied_key(RUNNING, 0), 0)
            self.cpu_s += time.thread_time() - cpu
            self.durations.append(time.perf_counter() - started)
            seq += 1

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def server_cpu(poll: ControllerPoll, seconds: float, during=None) -> tuple[float, object]:
    """CPU seconds this process spent outside the poll thread (the store server's libuv
    thread; the main thread waits) over ``seconds``, or over ``during()``; and its result."""
    process, polled = time.process_time(), poll.cpu_s
    result = during() if during is not None else time.sleep(seconds)
    return (time.process_time() - process) - (poll.cpu_s - polled), result


def live_recovery(store: dist.TCPStore, pipes: list, text: str, readers: int, timeouts: Timeouts) -> dict | None:
    """Publish ``text`` to the first ``readers`` simulated ranks, blocked in ``wait`` on its
    key, and have them enter the generation, the owner polling the ready counter; what it
    took, or None where the store refuses the plan (first tried under another key, so no
    rank waits for a plan that never comes)."""
    probe = store.clone()
    try:
        probe.set("benchmark/plan-size-probe", text)
    except dist.DistError:
        return None
    store.delete_key("benchmark/plan-size-probe")
    recovered: list[dict] = []
    recovery = threading.Thread(target=lambda: recovered.extend(ask(pipes, "recover", readers)))
    recovery.start()
    time.sleep(1.0)  # the workers block in wait on the plan's key
    published_at = time.time()
    store.set(plan_key(RUNNING + 1), text)
    while store.add(ready_key(RUNNING + 1), 0) < readers:  # TrainingRun._wait_ready
        time.sleep(timeouts.poll_interval)
    recovery.join()
    read_s = max(r["read_at"] for r in recovered) - published_at
    arrived_s = max(r["arrived_at"] for r in recovered) - published_at
    return {"read_s": read_s, "arrived_s": arrived_s, "bytes_per_s": readers * len(text) / read_s,
            "requests_per_s": sum(r["requests"] for r in recovered) / arrived_s}


# -- one row -----------------------------------------------------------------------------------


def measure(ranks: int, args, timeouts: Timeouts) -> dict:
    config = recipe("7B", ranks, micro_batches=args.micro_batches)
    text, chosen = recovery_plan(config)
    started = time.perf_counter()
    PlanPublished.from_json(text, current_generation=RUNNING)
    parse_s = time.perf_counter() - started
    shares = own_shares(text)
    nodes = ranks // DEVICES_PER_NODE
    simulated = min(ranks, args.clients) // DEVICES_PER_NODE * DEVICES_PER_NODE
    readers = min(simulated, max(DEVICES_PER_NODE, args.read_budget // len(text)))
    beats_per_step = round(args.step_s / timeouts.heartbeat_interval)
    beat_requests, commit_requests, arrival_requests = requests_per_period(timeouts)

    store = open_store()
    keys = [rank_heartbeat_key(r) for r in range(ranks)] + [node_heartbeat_key(n) for n in range(nodes)]
    store.multi_set(keys, [Heartbeat(0, time.time(), RUNNING).to_json()] * len(keys))
    store.multi_set([launcher_key(n) for n in range(nodes)], [f"host{n}:1" for n in range(nodes)])
    store.multi_set([decided_key(RUNNING, s) for s in range(STEPS)], [Outcome.COMMITTED.value] * STEPS)
    pipes, drivers = start_drivers(store.port, simulated, timeouts, beats_per_step, step_report(args.micro_batches))
    try:
        poll = ControllerPoll(store, keys, timeouts)
        controller_cpu, _ = server_cpu(poll, args.window / 2)
        poll.stop()
        polls = list(poll.durations)
        driven_cpu, results = server_cpu(poll, 0, lambda: ask(pipes, "steady", args.window))
        node_beats, node_commits = map(sum, zip(*results))
        driven = node_beats * beat_requests + node_commits * commit_requests

        recovery = live_recovery(store, pipes, text, readers, timeouts)
    finally:  # a driver may still wait on a plan the store refused
        for driver in drivers:
            driver.terminate()
            driver.join()

    controller_rate = CONTROLLER_POLL_REQUESTS / timeouts.poll_interval
    beats = nodes * beat_requests / timeouts.heartbeat_interval
    steady = beats + nodes * commit_requests / args.step_s + controller_rate + 1 / args.step_s
    recovering = beats + ranks * arrival_requests / (timeouts.poll_interval / 10) + controller_rate
    controller_share = controller_cpu / len(polls) / timeouts.poll_interval  # at its period, however long it took
    cpu_per_request = driven_cpu / driven
    if recovery is None:  # today's controller cannot publish it: no time to plan
        time_to_plan, extrapolated = None, []
    elif readers == ranks:
        time_to_plan, extrapolated = round(recovery["read_s"], 3), []
    else:
        time_to_plan, extrapolated = round(ranks * len(text) / recovery["bytes_per_s"], 3), ["time_to_plan_s"]
    return {
        "row": {
            "ranks": ranks, "nodes": nodes, "plan_bytes": len(text), "bytes_read_per_worker": len(text),
            "own_share_bytes": max(shares), "steady_ops_per_s": round(steady), "recovery_ops_per_s": round(recovering),
            "time_to_plan_s": time_to_plan, "extrapolated": extrapolated,
        },
        "chosen": chosen, "median_share": statistics.median(shares), "parse_s": parse_s, "simulated": simulated,
        "readers": readers, "recovery": recovery,
        "poll_ms": 1e3 * statistics.median(polls), "driven_per_s": driven / args.window,
        "us_per_request": 1e6 * cpu_per_request,
        "steady_busy": controller_share + (steady - controller_rate) * cpu_per_request,
        "recovery_busy": controller_share + (recovering - controller_rate) * cpu_per_request,
    }


def print_table(measured: list[dict], args) -> None:
    print(f"\nLlama-2 7B, {DEVICE} recipe widened: TP{TP} x PP{PP}, {args.micro_batches} micro-batches per "
          f"pipeline, {DEVICES_PER_NODE} ranks per node; plan after one rank failed; step {args.step_s} s; "
          "heartbeat 0.1 s, poll 0.05 s.")
    print("| ranks | nodes | chosen | plan MB (= read per worker) | own share KB max / median | parse s | "
          "steady ops/s | server busy | recovery ops/s | server busy | poll ms | µs/op | "
          "clients (closed-loop ops/s) | time to plan s | all arrived s (live) | readers (MB/s) |")
    print("|" + "---|" * 16)
    for m in measured:
        row, recovery = m["row"], m["recovery"]
        if recovery is None:
            plan_cells = "refused by the store | - | -"
        else:
            kind = "extrapolated" if row["extrapolated"] else "measured"
            plan_cells = (f"{row['time_to_plan_s']:.2f} ({kind}) | {recovery['arrived_s']:.2f} ({m['readers']} ranks, "
                          f"{recovery['requests_per_s']:,.0f} ops/s) | "
                          f"{m['readers']:,} ({recovery['bytes_per_s'] / 1e6:,.0f})")
        print(f"| {row['ranks']:,} | {row['nodes']:,} | {m['chosen']} | {row['plan_bytes'] / 1e6:.2f} | "
              f"{row['own_share_bytes'] / 1e3:.1f} / {m['median_share'] / 1e3:.1f} | {m['parse_s']:.2f} | "
              f"{row['steady_ops_per_s']:,} | {100 * m['steady_busy']:.0f} % | {row['recovery_ops_per_s']:,} | "
              f"{100 * m['recovery_busy']:.0f} % | {m['poll_ms']:.1f} | {m['us_per_request']:.1f} | "
              f"{m['simulated']:,} ({m['driven_per_s']:,.0f}) | {plan_cells} |")
    if any(m["recovery"] is None for m in measured):
        print("refused by the store: the libuv TCPStore server drops a request whose payload exceeds 8 MiB "
              "(its log: 'Invalid payload size ... max: 8388608'; the client's set fails with 'Connection reset "
              "by peer'), so Controller.publish_plan cannot publish this plan: time_to_plan_s is null.")
    print("server busy: share of one core the store's one libuv thread needs (>100 %: it cannot keep up); "
          "poll ms: one controller poll over every heartbeat key, median (its period is 50 ms); "
          "µs/op: server CPU per simulated-node request; "
          "all arrived: from the plan's set until the live recovery's last rank arrived, and the requests/s it drove.")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="1,024 and 4,096 ranks, 256 clients, short windows")
    parser.add_argument("--ranks", type=int, nargs="+", default=None)
    parser.add_argument("--micro-batches", type=int, default=16, help="per pipeline")
    parser.add_argument("--step-s", type=float, default=5.0, help="the training step time the commits come at")
    parser.add_argument("--clients", type=int, default=1024, help="simulated ranks this machine holds")
    parser.add_argument("--read-budget", type=int, default=2_000_000_000,
                        help="bytes of plan reads in one live recovery (fewer readers for a bigger plan)")
    parser.add_argument("--window", type=float, default=4.0, help="seconds of closed-loop traffic per row")
    args = parser.parse_args()
    if args.quick:
        args.clients, args.window = min(args.clients, 256), min(args.window, 2.0)
    ranks = args.ranks or (RANKS[:2] if args.quick else RANKS)
    timeouts = load_config(None, []).odyssey.timeouts
    measured = []
    for r in ranks:
        started = time.perf_counter()
        measured.append(measure(r, args, timeouts))
        print(f"{r:,} ranks: {time.perf_counter() - started:.0f} s", flush=True)
    print_table(measured, args)
    print(json.dumps({"rows": [m["row"] for m in measured]}))


if __name__ == "__main__":
    main()
