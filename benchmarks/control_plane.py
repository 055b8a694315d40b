"""The live run's control plane at 1,024, 4,096 and 16,384 ranks (issue 34): what a plan
publication writes and each worker reads of it, how many store operations the protocol
asks of the controller's one TCPStore in steady training and in a recovery, and how long
until every worker holds its new plan.

Layout: Llama-2 7B as ``benchmarks/plan_search.py`` widens it (Ascend 910B recipe, TP1 x
PP4, 8 devices per node, so every rank is one plan worker), with 16 micro-batches per
pipeline (4 x PP: a 1F1B bubble of 16 %; ``--micro-batches``). The plan is the one a
recovery publishes: ``DecisionCenter.from_recipe`` then ``on_failure`` of one rank in the
middle, published with ``plan_frame.write_plan`` as ``Controller.publish_plan`` does.

Measured, per row:
- ``plan_bytes``: what the publication writes (the frame and every worker's op list, as
  stored); ``bytes_read_per_worker``: the frame plus the largest op list, what
  ``read_plan`` gets for the worst-off worker. The table adds the whole plan's JSON (what
  every worker read before issue 34; the run directory keeps it), and the time
  ``write_plan`` takes the controller and ``read_plan`` one worker, over a dict.
- ``own_share_bytes``: the largest, over workers, of the JSON bytes of what the worker
  needs from the whole plan: its op list, its pipeline's entry (stages and micro-batches:
  its neighbours), reroutes into its pipeline or onto it, sync units it is a member of
  (its DP groups, with their member lists), transfers it sends or receives, the comm
  rounds, the plan's scalar fields and the message's other fields. The table also gives
  the median worker's.
- The server's cost: a real TCPStore server (libuv, as the Controller opens it) in this
  process, a real controller poll on a thread beside it (``Controller._poll``'s requests:
  its heartbeat, the inbox length, every other poll a ``multi_get`` of every node's
  heartbeat key, each parsed; plus ``TrainingRun``'s commit check) over the row's keys every
  ``poll_interval``, and simulated nodes in driver processes, each rank and launcher on a
  store connection of its own, speaking the protocol with its key functions and messages:
  each launcher's beat thread (``NodeLauncher._beat``: the node's heartbeat with its
  ranks' beats, one ``compare_set``, and every heartbeat timeout the controller's heartbeat
  and the launcher key in one request; the ranks' own beats go to their node's store, which
  is not the controller's) and per step
  the node's commit (``runtime.rank.node_ledger``: the rank carrying the node's count
  appends the node's ``StepReport`` lines, adds the node's ranks to the step counter, waits
  for and gets the decision key). The poll runs alone for half a window: the server's CPU
  per poll
  (this process's CPU time less the poll thread's own). Then the simulated nodes run
  alone, closed-loop (as fast as they are answered, not at their periods) for a window:
  the server's CPU per request (this process's CPU time over their requests).
- A live recovery: simulated ranks (those of live workers) block in a get of the
  successor key (a get waits for its key); the plan is published (``write_plan``: the op
  lists, then the frame under that key); each rank gets the frame and then its worker's
  op list, checks the abort key, counts into ``arrived_key`` (the last one sets
  ``all_arrived_key``), waits on ``all_arrived_key`` and gets it, then counts into
  ``ready_key`` while the owner polls it (``RunState.wait_ready``); heartbeats are
  left out of this run. ``time_to_plan_s``: from the frame's set (the publication: the op
  lists are written before it) until the last rank got its op list.

Computed, not measured: ``steady_ops_per_s`` is the rate the protocol asks for at the
row's size: its periods (``odyssey`` defaults: heartbeat 0.1 s, poll 0.05 s) and a stated
step time (``--step-s``, 5 s) times the operations one node's period and one step take,
counted by running the same simulated-node code against a counting store: launchers'
heartbeats and nodes' commits (both grow with nodes), the controller's poll.
``recovery_ops_per_s``: the launchers' and the poll's rate plus every rank's recovery
requests (``RECOVERY_REQUESTS``, none repeated while waiting) over the time until all
arrived. Process-group rendezvous (gloo's own keys under ``process_group_prefix``) is not
counted. The table's "server busy" is the share of one core the store's single libuv
thread would need for the steady rate: the server's CPU per poll at the row's size times
the polls per second the controller asks for, plus the rest of the rate times the
server's CPU per request.

Extrapolated (listed in the row's ``extrapolated``): where the machine holds fewer clients
than the row has ranks (``--clients``, 1,024 by default), ``time_to_plan_s`` is every
rank's ``PLAN_REQUESTS`` requests served at the server's measured CPU per request (its rate
on this machine, as if nothing else asked of it), and the time until all arrived likewise
for ``RECOVERY_REQUESTS``. The table adds the same time on what the steady rate leaves of
the store's thread, and the simulated clients' own time scaled by ranks / clients (bound by
the clients' CPU: clients and server share this machine's 2 cores).

Run: PYTHONPATH=. nice .venv/bin/python benchmarks/control_plane.py [--quick] [--heartbeat-interval S]
(about 4 minutes on the shared 2-core machine; ``--quick``: 1,024 and 4,096 ranks, 256
clients, shorter windows).

Before issue 34 (one run, 2026-11-27, shared 2-core machine under a CI run), the same
benchmark of the protocol as it was (every worker read the whole plan from one key and
beat into the controller's store, polling waits):

| ranks | plan MB (read by every worker) | own share KB | parse s | steady ops/s | recovery ops/s | poll ms | time to plan s |
|---|---|---|---|---|---|---|---|
| 1,024 | 1.08 | 4.2 / 2.9 | 0.64 | 40,599 (99 %) | 449,380 (1024 %) | 111 | 2.44 |
| 4,096 | 4.53 | 9.1 / 7.8 | 2.72 | 162,097 (536 %) | 1,797,220 (5259 %) | 182 | 58.3 (extrapolated) |
| 16,384 | 19.21 | 31.2 / 28.3 | 10.4 | 648,087 (2785 %) | 7,188,580 (20098 %) | 1,190 | none: refused |

(a plan over 8 MiB could not be published at all: the libuv server drops such a request.)
"""

from __future__ import annotations

import argparse
import dataclasses
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
from odyssey_megatron.runtime.protocol.keys import (
    ALL_ARRIVED,
    CONTROLLER_HEARTBEAT,
    INBOX,
    PUBLISHED_GENERATION,
    abort_key,
    all_arrived_key,
    applied_key,
    arrived_key,
    decided_key,
    launcher_key,
    node_heartbeat_key,
    plan_key,
    plan_ops_key,
    ready_key,
    step_report_key,
    successor_key,
)
from odyssey_megatron.runtime.protocol.messages import ControllerHeartbeat, NodeHeartbeat, StepReport
from odyssey_megatron.runtime.protocol.plan_frame import PlanPublished, read_plan, write_plan
from odyssey_megatron.schedules.program import publish
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


def recovery_plan(config) -> tuple[PlanPublished, str]:
    """(the plan published after one rank in the middle fails, what was chosen)."""
    center = DecisionCenter.from_recipe(config)
    decision = center.on_failure(ranks=[config.parallel.num_ranks // 2 + TP])
    published = PlanPublished(center.plan, center.program, time.time(), start_step=100)
    return published, f"{decision.chosen.policy} {decision.chosen.layout}"


def whole_text(published: PlanPublished) -> str:
    """The whole plan as one JSON text, as the run directory keeps it (``plan-<g>.json``)
    and as every worker read it before issue 34, with the message's fields."""
    return json.dumps({"kind": "plan", "published_at": published.published_at, "start_step": published.start_step,
                       "fresh": published.fresh, "snapshot_interval": published.snapshot_interval,
                       "snapshot": None, "restore": None, "joined": list(published.joined),
                       "plan": publish(published.plan, published.program)})


class DictStore:
    """The store calls ``write_plan`` and ``read_plan`` make, over a dict."""

    def __init__(self):
        self.values: dict[str, bytes] = {}

    def multi_set(self, keys, values):
        self.values.update(zip(keys, values))

    def set(self, key, value):
        self.values[key] = value

    def get(self, key):
        return self.values[key]


def own_shares(text: str) -> list[int]:
    """Per live worker, the JSON bytes of the parts of the whole plan (``whole_text``) it
    needs (see the module docstring), before any compaction."""
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

    last_beat: bytes = b""

    def beat(self, seq: int, timeouts: Timeouts) -> None:
        """One heartbeat interval of the launcher's beat thread (``NodeLauncher._beat``): the
        node's heartbeat with its ranks' last beats, a ``compare_set`` over the previous one
        (nobody rings in steady training); every ``reads_every`` beats (the heartbeat
        timeout), also the controller's beat and the launcher key in one request. The ranks
        beat into their node's store, which the controller's never sees."""
        beat = NodeHeartbeat(seq, time.time(), {str(r): seq for r in self.ranks}, {str(r): RUNNING for r in self.ranks},
                             {str(r): 100_000 + r for r in self.ranks}).to_json().encode()
        if self.launcher.compare_set(node_heartbeat_key(self.node), self.last_beat, beat) != beat:
            self.launcher.set(node_heartbeat_key(self.node), beat)  # the first beat finds the row's seeded one
        self.last_beat = beat
        if seq % reads_every(timeouts) == 0:
            controller, _ = self.launcher.multi_get([CONTROLLER_HEARTBEAT, launcher_key(self.node)])
            ControllerHeartbeat.from_json(controller)

    def commit(self, step: int) -> None:
        """The node's commit (``runtime.rank.node_ledger``) as the controller's store sees it:
        the rank that carries the node's count appends the node's reports, counts the node's
        ranks in, waits for the decision and reads it (the ranks report, count in and wait in
        their node's store)."""
        store = self.rank_stores[0]
        store.append(step_report_key(RUNNING, step), self.report * len(self.ranks))
        store.add(applied_key(RUNNING, step), len(self.ranks))
        store.wait([decided_key(RUNNING, step)], datetime.timedelta(seconds=30))
        Outcome(store.get(decided_key(RUNNING, step)))


def step_report(micro_batches: int) -> str:
    return StepReport(rank=0, micro_batches=tuple(range(micro_batches)), losses=(2.345678,) * micro_batches,
                      samples=tuple(range(1_000_000, 1_000_000 + micro_batches)), forward_s=0.123,
                      forwards=micro_batches, backward_s=0.234, backwards=micro_batches, weight_grad_s=0.0,
                      weight_grads=0,
                      optimizer_s=0.012, lr=3.0e-4).to_json() + "\n"


def controller_beat(seq: int) -> str:
    """``Controller._beat``'s value: one generation aborted lately, kill orders queued for a few nodes."""
    return ControllerHeartbeat(seq, time.time(), (RUNNING,), {str(n): 1 for n in range(4)}).to_json()


class CountingStore:
    """A dict with a store's methods, counting requests: the protocol's operations per period."""

    def __init__(self):
        self.values: dict[str, bytes] = {CONTROLLER_HEARTBEAT: controller_beat(0).encode()}
        self.requests = 0

    def _count(self) -> None:
        self.requests += 1

    def set(self, key, value):
        self._count()
        self.values[key] = value.encode() if isinstance(value, str) else value

    def compare_set(self, key, expected, desired):
        self._count()
        if self.values.get(key, b"") == expected:
            self.values[key] = desired
        return self.values.get(key, expected)

    def get(self, key):
        self._count()
        return self.values.get(key, Outcome.COMMITTED.value)

    def check(self, keys):
        self._count()
        return all(k in self.values for k in keys)

    def multi_get(self, keys):
        self._count()
        return [self.values.get(k, Outcome.COMMITTED.value) for k in keys]

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


def reads_every(timeouts: Timeouts) -> int:
    """Beats between an unrung launcher's reads of the controller's heartbeat."""
    return max(1, round(timeouts.heartbeat_timeout / timeouts.heartbeat_interval))


def requests_per_period(timeouts: Timeouts) -> tuple[float, int]:
    """(requests of one node's heartbeat interval, on average; of one node's step commit)."""
    beat, commit = CountingStore(), CountingStore()
    ranks = list(range(DEVICES_PER_NODE))
    node = SimNode(0, ranks, beat, [], "")
    node.beat(0, timeouts)  # the first beat overwrites what was there
    beat.requests = 0
    for seq in range(1, reads_every(timeouts) + 1):
        node.beat(seq, timeouts)
    SimNode(0, ranks, commit, [commit], "").commit(0)
    return beat.requests / reads_every(timeouts), commit.requests


CONTROLLER_POLL_REQUESTS = 3.5
"""``Controller._poll``, on average: its beat, the inbox length, every other poll a
``multi_get`` of every node's heartbeat key (``check`` only of keys it never read); and
``RunState.collect_commits``' add on the running step's counter."""


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


PLAN_REQUESTS = 2
"""One rank's requests until it holds its plan: the successor key (the frame), its op list."""
RECOVERY_REQUESTS = PLAN_REQUESTS + 6
"""One rank's requests to enter a generation (``_recover``): no request repeats while it waits."""


def _recover(nodes: list[SimNode], readers: frozenset[int], timeouts: Timeouts) -> dict:
    """Enter the next generation as ``Worker`` does, for this thread's simulated ranks among
    ``readers``: get the successor key (waiting for it), the frame and the worker's own op list
    (``read_plan``'s requests), count in, wait until all arrived, count ready. The thread's
    ranks take each phase in turn (a wait blocks the thread; the counts never do)."""
    world = len(readers)
    ranks = [(r, s) for node in nodes for r, s in zip(node.ranks, node.rank_stores) if r in readers]
    if not ranks:
        return {"read_at": 0.0, "requests": 0, "arrived_at": 0.0}
    generation = RUNNING + 1
    for rank, store in ranks:
        store.get(successor_key(RUNNING))  # ControllerLink.next_after: the frame, once set (a get waits)
        store.get(plan_ops_key(generation, rank // TP))
    read_at = time.time()
    everyone = all_arrived_key(generation)
    for rank, store in ranks:
        store.check([abort_key(generation)])
        if store.add(arrived_key(generation), 1) == world:
            store.compare_set(everyone, "", ALL_ARRIVED)
    for rank, store in ranks:
        store.wait([everyone], datetime.timedelta(seconds=120))
        store.get(everyone)
    arrived_at = time.time()
    for rank, store in ranks:
        store.add(ready_key(generation), 1)
    return {"read_at": read_at, "requests": RECOVERY_REQUESTS * len(ranks), "arrived_at": arrived_at}


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
        """Of each poll; the even ones read every node's heartbeat."""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        seq, next_poll = 0, time.monotonic()
        while not self._stop.wait(max(0.0, next_poll - time.monotonic())):
            next_poll = max(next_poll + self.period, time.monotonic())
            started, cpu = time.perf_counter(), time.thread_time()
            self.store.set(CONTROLLER_HEARTBEAT, controller_beat(seq))
            self.store.queue_len(INBOX)
            if seq % 2 == 0:  # node beats every other poll, each new (a node beats once per interval)
                if seq == 0:
                    self.store.check(self.keys)  # only keys it has not read yet
                for raw in self.store.multi_get(self.keys):
                    NodeHeartbeat.from_json(raw)
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


class FrameStamp:
    """The store ``write_plan`` writes to, noting when the frame's set began: the moment a
    plan is published (its op lists are in the store by then)."""

    def __init__(self, store: dist.TCPStore):
        self.store, self.frame_at = store, None

    def multi_set(self, keys, values):
        self.store.multi_set(keys, values)

    def set(self, key, value):
        self.frame_at = time.time()
        self.store.set(key, value)


def live_recovery(store: dist.TCPStore, pipes: list, published: PlanPublished, readers: frozenset[int],
                  timeouts: Timeouts) -> dict:
    """Publish ``published`` (``write_plan``, as ``Controller.publish_plan`` does: the op
    lists, then the frame under the successor key) to the simulated ranks ``readers``
    (those of live workers), blocked in a get of the successor key, and have them enter the
    generation, the owner polling the ready counter: what it took from the frame's set."""
    recovered: list[dict] = []
    recovery = threading.Thread(target=lambda: recovered.extend(ask(pipes, "recover", readers)))
    recovery.start()
    time.sleep(1.0)  # the workers block in get of the successor key
    stamped = FrameStamp(store)
    write_plan(stamped, published)  # the op lists, then the frame under the successor key
    published_at = stamped.frame_at
    store.set(PUBLISHED_GENERATION, str(RUNNING + 1))
    while store.add(ready_key(RUNNING + 1), 0) < len(readers):  # RunState.wait_ready
        time.sleep(timeouts.poll_interval)
    recovery.join()
    read_s = max(r["read_at"] for r in recovered) - published_at
    arrived_s = max(r["arrived_at"] for r in recovered) - published_at
    return {"read_s": read_s, "arrived_s": arrived_s,
            "requests_per_s": sum(r["requests"] for r in recovered) / arrived_s}


# -- one row -----------------------------------------------------------------------------------


def measure(ranks: int, args, timeouts: Timeouts) -> dict:
    config = recipe("7B", ranks, micro_batches=args.micro_batches)
    published, chosen = recovery_plan(config)
    text = whole_text(published)
    shares = own_shares(text)
    slices = DictStore()
    started = time.perf_counter()
    write_plan(slices, published)
    write_s = time.perf_counter() - started
    frame = len(slices.values[plan_key(published.plan.generation)])
    ops = {w: len(slices.values[plan_ops_key(published.plan.generation, w)]) for w in published.plan.workers}
    widest = max(ops, key=ops.get)
    started = time.perf_counter()
    read_plan(slices, slices.get(plan_key(published.plan.generation)), rank=widest * TP, current_generation=RUNNING)
    parse_s = time.perf_counter() - started
    nodes = ranks // DEVICES_PER_NODE
    simulated = min(ranks, args.clients) // DEVICES_PER_NODE * DEVICES_PER_NODE
    beats_per_step = round(args.step_s / timeouts.heartbeat_interval)
    beat_requests, commit_requests = requests_per_period(timeouts)

    store = open_store()
    keys = [node_heartbeat_key(n) for n in range(nodes)]
    beat = NodeHeartbeat(0, time.time(), {str(r): 0 for r in range(DEVICES_PER_NODE)},
                         {str(r): RUNNING for r in range(DEVICES_PER_NODE)},
                         {str(r): 100_000 + r for r in range(DEVICES_PER_NODE)}).to_json()
    store.multi_set(keys, [beat] * len(keys))
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
        live = frozenset(r for r in range(simulated) if r // TP in set(published.plan.workers))
        recovery = live_recovery(store, pipes, published, live, timeouts)
    finally:
        for driver in drivers:
            driver.terminate()
            driver.join()

    controller_rate = CONTROLLER_POLL_REQUESTS / timeouts.poll_interval
    beats = nodes * beat_requests / timeouts.heartbeat_interval
    commits = nodes * commit_requests / args.step_s
    steady = beats + commits + controller_rate + 1 / args.step_s
    controller_share = controller_cpu / len(polls) / timeouts.poll_interval  # at its period, however long it took
    cpu_per_request = driven_cpu / driven
    steady_busy = controller_share + (steady - controller_rate) * cpu_per_request
    if simulated == ranks:
        time_to_plan, arrived, extrapolated = recovery["read_s"], recovery["arrived_s"], []
    else:  # the server's measured cost per request, for every rank's requests, on a store with nothing else to do
        time_to_plan = ranks * PLAN_REQUESTS * cpu_per_request
        arrived = ranks * RECOVERY_REQUESTS * cpu_per_request
        extrapolated = ["time_to_plan_s", "recovery_ops_per_s"]
    recovering = beats + controller_rate + ranks * RECOVERY_REQUESTS / arrived
    return {
        "row": {
            "ranks": ranks, "nodes": nodes, "plan_bytes": frame + sum(ops.values()),
            "bytes_read_per_worker": frame + ops[widest], "own_share_bytes": max(shares),
            "steady_ops_per_s": round(steady), "recovery_ops_per_s": round(recovering),
            "time_to_plan_s": round(time_to_plan, 3), "extrapolated": extrapolated,
        },
        "chosen": chosen, "whole_bytes": len(text), "frame_bytes": frame, "median_share": statistics.median(shares),
        "write_s": write_s, "parse_s": parse_s, "simulated": simulated, "recovery": recovery, "arrived_s": arrived,
        "scaled_time_to_plan_s": recovery["read_s"] * ranks / simulated,
        "beats_per_s": beats, "commits_per_s": commits,
        "poll_ms": 1e3 * statistics.median(polls[::2]), "driven_per_s": driven / args.window,
        "us_per_request": 1e6 * cpu_per_request,
        "steady_busy": steady_busy, "heartbeat_interval": timeouts.heartbeat_interval,
        "time_to_plan_beside_steady_s": time_to_plan / max(1e-9, 1 - steady_busy) if steady_busy < 1 else None,
    }


def print_table(measured: list[dict], args) -> None:
    interval = measured[0]["heartbeat_interval"]
    print(f"\nLlama-2 7B, {DEVICE} recipe widened: TP{TP} x PP{PP}, {args.micro_batches} micro-batches per "
          f"pipeline, {DEVICES_PER_NODE} ranks per node; plan after one rank failed; step {args.step_s} s; "
          f"heartbeat {interval} s, poll {interval / 2} s.")
    print("| ranks | nodes | chosen | whole plan MB | published KB (frame B) | read per worker B | own share KB "
          "max / median | write s | read s | steady ops/s (beats + commits) | server busy | poll ms | µs/op | "
          "clients (closed-loop ops/s) | time to plan s | beside the steady load s | live clients' time, scaled s | "
          "all arrived s | recovery ops/s |")
    print("|" + "---|" * 19)
    for m in measured:
        row = m["row"]
        kind = "extrapolated" if row["extrapolated"] else "measured"
        beside = m["time_to_plan_beside_steady_s"]
        print(f"| {row['ranks']:,} | {row['nodes']:,} | {m['chosen']} | {m['whole_bytes'] / 1e6:.2f} | "
              f"{row['plan_bytes'] / 1e3:,.0f} ({m['frame_bytes']:,}) | {row['bytes_read_per_worker']:,} | "
              f"{row['own_share_bytes'] / 1e3:.1f} / {m['median_share'] / 1e3:.1f} | {m['write_s']:.2f} | "
              f"{m['parse_s']:.3f} | {row['steady_ops_per_s']:,} "
              f"({m['beats_per_s']:,.0f} + {m['commits_per_s']:,.0f}) | "
              f"{100 * m['steady_busy']:.0f} % | {m['poll_ms']:.1f} | {m['us_per_request']:.1f} | "
              f"{m['simulated']:,} ({m['driven_per_s']:,.0f}) | {row['time_to_plan_s']:.3f} ({kind}) | "
              f"{'saturated' if beside is None else f'{beside:.2f}'} | {m['scaled_time_to_plan_s']:.2f} | "
              f"{m['arrived_s']:.3f} | {row['recovery_ops_per_s']:,} |")
    print("whole plan: the JSON every worker read before (now in the run directory only); published: the frame "
          "every worker reads plus every worker's op list, zlib; read per worker: the frame and the largest op list; "
          "write s / read s: write_plan of the whole publication (the controller, before it wakes anyone) and "
          "read_plan of the largest slice (one worker), over a dict; "
          "server busy: share of one core the store's one libuv thread needs for the steady rate; "
          "poll ms: one controller poll that reads every node's heartbeat, median (every other poll: "
          "once per heartbeat interval); "
          "µs/op: server CPU per simulated-node request; time to plan: from the frame's set until the "
          "last rank read its op list, measured where every rank was simulated, else every rank's "
          f"{PLAN_REQUESTS} requests at the server's µs/op (an idle store thread); beside the steady load: the same "
          "on what the steady rate leaves of the thread; live clients' time, scaled: the simulated clients' time "
          "times ranks / clients (bound by the clients' own CPU on this machine); all arrived: until the last "
          f"rank's all-arrived wait returned (extrapolated as time to plan, for {RECOVERY_REQUESTS} requests); "
          "recovery ops/s: the periodic rate plus every rank's requests over the time until all arrived.")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="1,024 and 4,096 ranks, 256 clients, short windows")
    parser.add_argument("--ranks", type=int, nargs="+", default=None)
    parser.add_argument("--micro-batches", type=int, default=16, help="per pipeline")
    parser.add_argument("--step-s", type=float, default=5.0, help="the training step time the commits come at")
    parser.add_argument("--clients", type=int, default=1024, help="simulated ranks this machine holds")
    parser.add_argument("--window", type=float, default=4.0, help="seconds of closed-loop traffic per row")
    parser.add_argument("--heartbeat-interval", type=float, default=None,
                        help="seconds (default: odyssey's); the heartbeat timeout becomes 10 intervals")
    parser.add_argument("--smoke", action="store_true",
                        help="CI's check that it runs: 32 ranks (4 nodes), every one simulated, half-second windows")
    args = parser.parse_args()
    if args.quick:
        args.clients, args.window = min(args.clients, 256), min(args.window, 2.0)
    if args.smoke:
        args.ranks, args.clients, args.window = [32], 32, 0.5
    ranks = args.ranks or (RANKS[:2] if args.quick else RANKS)
    timeouts = load_config(None, []).odyssey.timeouts
    if args.heartbeat_interval is not None:
        timeouts = dataclasses.replace(timeouts, heartbeat_interval=args.heartbeat_interval,
                                       heartbeat_timeout=10 * args.heartbeat_interval)
    measured = []
    for r in ranks:
        started = time.perf_counter()
        measured.append(measure(r, args, timeouts))
        print(f"{r:,} ranks: {time.perf_counter() - started:.0f} s", flush=True)
    print_table(measured, args)
    print(json.dumps({"rows": [m["row"] for m in measured]}))


if __name__ == "__main__":
    main()
