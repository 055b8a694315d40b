"""The one engine that turns per-worker op lists into times (paper 001, Eq. 10-11).

Every op (forward F, backward B, weight gradient W of ``schedules.ops``) starts when its
worker is free and the output of its dependency on another stage has arrived:

    t_start(op) = max(t_end(previous op on its worker), t_end(dependency) + t_p2p)

and step time is the latest end (Eq. 10). The estimator needs this recurrence in three
shapes, all options of ``replay``:

- **list scheduling** (no ``schedule``): a worker with several streams (a rerouting
  peer) runs, whenever it is free, the ready stream head that comes earliest in its
  stream's 1F1B order, own stream first on ties. The order each worker ended up with is
  the schedule the executor runs.
- **split backwards** (``split_backward``): each backward computes input gradients only
  (B, which the previous stage waits for) and queues its weight gradient (W, which
  nothing waits for); a worker runs a queued W when no stream head is ready, or before a
  forward once its memory holds no more micro-batches (paper 003's Decoupled BackProp).
- **fixed lists** (``schedule``): each worker runs its given list in order; a list
  holding W ops runs split backwards.

and over several steps (``iterations``): a worker starts its next step once every
optimizer group it belongs to finished this one (paper 003's Staggered Optimizer), with
``speculative`` steps that hold their first gradient write or send until every worker
finished the previous step (the global norm is in), and optimizer snapshots per worker.

Data model: a plan's ops are indexed once (``OpGraph``: integer ids, one flat list per
attribute, dependency and consumer edges as ids), and every replay of the plan shares
them. A replay keeps a record per worker (``_Worker``: a cursor into each of its
streams, when it is free, its deferred W ops) and per step (``_Step``: when each op
ended, who finished). A worker whose next op is forced runs it as soon as its
dependency is timed; a worker with a choice makes it at a wakeup, in time order
(``_Replayer``). O(ops log ops).
"""

from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass, field
from typing import Mapping, Sequence

from odyssey_megatron.cluster import ClusterState
from odyssey_megatron.plan import ExecutionPlan
from odyssey_megatron.profile import ModelProfile, StageTimes
from odyssey_megatron.schedules.ops import BACKWARD, FORWARD, WEIGHT_GRAD, Op, compile_streams

INF = float("inf")


class ScheduleDeadlock(RuntimeError):
    """The op lists wait on each other in a cycle: the plan cannot run as compiled."""


def p2p_time(profile: ModelProfile, *, same_node: bool) -> float:
    """Seconds to send one micro-batch's activations (or their gradients) to the next stage."""
    if profile.p2p_bytes == 0:
        return 0.0
    return profile.link_latency_s + profile.p2p_bytes / profile.bandwidth(same_node)


@dataclass(frozen=True)
class OpGraph:
    """A plan's ops indexed once: every replay of the plan (plain, split, fixed lists,
    several steps) runs each op on the same worker after the same dependency, so one
    graph serves them all. Op ids: the plan's stream ops (F and B) worker by worker, then
    a W per B. Workers are numbered by ascending worker id (their local index)."""

    ops: tuple[Op, ...]
    """Op of each id."""
    index: dict[Op, int]
    """Id of each op."""
    workers: tuple[int, ...]
    """Worker id of each local index, ascending (wakeups at one time go in this order)."""
    plan_order: tuple[int, ...]
    """Local indexes in the plan's stage order, the order results list workers in."""
    num_pipelines: int
    """Pipelines of the plan."""
    streams: tuple[tuple[list[int], ...], ...]
    """Per local worker, ``compile_streams``'s streams as ids: its own stage's, then the
    ones it adopts."""
    worker: list[int]
    """Local index of the worker running each op."""
    pipeline: list[int]
    """Pipeline of each op."""
    forward: list[bool]
    """Whether each op is a forward."""
    dependency: list[int]
    """The op each op waits for (``schedules.ops.dependency``); -1 for none (first-stage
    forwards, W)."""
    link_s: list[float]
    """Transfer seconds from each op's dependency's worker to its own (0 on one worker)."""
    consumer: list[int]
    """The op waiting for each op's output; -1 for none."""
    whole_s: list[float]
    """Compute seconds of each op with whole backwards."""
    split_s: list[float]
    """Compute seconds of each op with split backwards (B: the input-gradient half,
    ``ModelProfile.stage_times``)."""
    weight_grad: list[int]
    """The W of each B; -1 for other ops."""
    settles: list[bool]
    """Whether a speculative step must wait for the global norm before it finishes the op:
    it writes gradients (B, W) or sends its result (a forward below the last stage)."""


def op_graph(plan: ExecutionPlan, profile: ModelProfile, cluster: ClusterState | None) -> OpGraph:
    """The ``OpGraph`` of ``plan``'s ``compile_streams`` (links priced on ``cluster``'s
    nodes; all on one node without it). Raises ScheduleDeadlock if an op waits for one
    that no worker runs."""
    streams = compile_streams(plan)
    num_stages = [p.num_stages for p in plan.pipelines]
    compute: dict[tuple[int, int], StageTimes] = {}
    for pi, si, stage in plan.stage_positions():
        start, end = stage.layers
        compute[pi, si] = profile.stage_times(start, end, first=si == 0, last=si == num_stages[pi] - 1)
    workers = tuple(sorted(streams))
    ops: list[Op] = []
    worker: list[int] = []
    stream_ids = []
    for local, w in enumerate(workers):
        lists = []
        for stream in streams[w]:
            lists.append(list(range(len(ops), len(ops) + len(stream))))
            ops.extend(stream)
            worker.extend([local] * len(stream))
        stream_ids.append(tuple(lists))
    num_stream_ops = len(ops)
    weight_grad = [-1] * num_stream_ops
    for i in range(num_stream_ops):
        if ops[i][0] == BACKWARD:
            weight_grad[i] = len(ops)
            ops.append(Op(WEIGHT_GRAD, *ops[i][1:]))
            worker.append(worker[i])
    index = {op: i for i, op in enumerate(ops)}

    link_cache: dict[tuple[int, int], float] = {}
    n = len(ops)
    dep, link_s, consumer = [-1] * n, [0.0] * n, [-1] * n
    whole_s, split_s = [0.0] * n, [0.0] * n
    pipeline, forward, settling = [0] * n, [False] * n, [True] * n
    for i, (kind, pi, si, mb) in enumerate(ops):
        times = compute[pi, si]
        last = si == num_stages[pi] - 1
        pipeline[i] = pi
        if kind == FORWARD:
            forward[i], settling[i] = True, not last  # as ``settles``: a forward settles if it sends
            whole_s[i] = split_s[i] = times.forward_s
            d = (FORWARD, pi, si - 1, mb) if si else None  # ``dependency``, as a plain tuple: equal to the Op
        elif kind == BACKWARD:
            whole_s[i], split_s[i] = times.backward_s, times.input_grad_s
            d = (BACKWARD, pi, si + 1, mb) if not last else (FORWARD, pi, si, mb)
        else:
            whole_s[i] = split_s[i] = times.weight_grad_s
            continue  # a W waits for nothing on another stage
        if d is None:
            continue
        j = index.get(d)
        if j is None:
            raise ScheduleDeadlock(f"{ops[i]} waits for {Op(*d)}, which no worker runs")
        dep[i] = j
        consumer[j] = i
        pair = worker[j], worker[i]
        link = link_cache.get(pair)
        if link is None:
            same_node = cluster is None or cluster.same_node(workers[pair[0]], workers[pair[1]])
            link = link_cache[pair] = 0.0 if pair[0] == pair[1] else p2p_time(profile, same_node=same_node)
        link_s[i] = link
    return OpGraph(
        ops=tuple(ops), index=index, workers=workers, plan_order=tuple(workers.index(w) for w in streams),
        num_pipelines=len(plan.pipelines), streams=tuple(stream_ids), worker=worker, pipeline=pipeline,
        forward=forward, dependency=dep, link_s=link_s, consumer=consumer, whole_s=whole_s, split_s=split_s,
        weight_grad=weight_grad, settles=settling,
    )


@dataclass(frozen=True)
class Replay:
    """What a replay measured."""

    step_end_s: tuple[float, ...]
    """Per step, when its last worker finished (its snapshot included)."""
    pipeline_end_s: tuple[float, ...]
    """Per pipeline, when its last op of the first step ended."""
    busy_s: dict[int, float]
    """Compute seconds of each worker in the first step."""
    first: dict[int, list[Op]]
    """Each worker's ops in the order the first step ran them."""
    last: dict[int, list[Op]]
    """Each worker's ops in the order the last step ran them."""


def replay(
    graph: OpGraph,
    schedule: Mapping[int, Sequence[Op]] | None = None,
    *,
    split_backward: bool = False,
    room: Mapping[int, float] | None = None,
    iterations: int = 1,
    optimizer_groups: Sequence[frozenset[int]] = (),
    speculative: bool = False,
    snapshot_s: Mapping[int, float] | None = None,
    snapshot_in_line: bool = False,
) -> Replay:
    """Replay ``iterations`` steps over ``graph``; raises ScheduleDeadlock.

    ``schedule``: each worker's op list, run in order (workers with none sit out); without
    it every worker list-schedules its streams, with ``split_backward`` splitting each
    backward and deferring its W while the worker holds fewer than ``room[worker]``
    micro-batches' activations (no limit where absent). Between steps a worker waits
    until every ``optimizer_groups`` group it belongs to finished the step and starts
    the next at the latest of their ends; with ``speculative`` steps its first op that
    writes gradients or sends its result ends no earlier than the previous step's last
    op anywhere. ``snapshot_s[worker]`` seconds of optimizer state are copied from each
    step's start, beside compute (the step ends no earlier than the copy) or, with
    ``snapshot_in_line``, before the step's first op.
    """
    if schedule is None:
        streams, playing, split = graph.streams, graph.plan_order, [split_backward] * len(graph.workers)
    else:
        streams, split = _fixed_streams(graph, schedule)
        local = {w: i for i, w in enumerate(graph.workers)}
        playing = tuple(local[w] for w, ops in schedule.items() if ops)
    defer = schedule is None and split_backward
    member_of: list[list[int]] = [[] for _ in graph.workers]
    groups = [[graph.workers.index(w) for w in group if w in graph.workers] for group in optimizer_groups]
    for g, group in enumerate(groups):
        for w in group:
            member_of[w].append(g)
    workers = [
        _Worker(
            index=w, streams=streams[w], seconds=graph.split_s if split[w] else graph.whole_s,
            ops_per_step=sum(len(ids) + (sum(not graph.forward[i] for i in ids) if defer else 0) for ids in streams[w]),
            room=(room or {}).get(worker, INF), snapshot_s=(snapshot_s or {}).get(worker, 0.0), groups=member_of[w],
        )
        for w, worker in enumerate(graph.workers)
    ]
    run = _Replayer(graph, workers, [workers[w] for w in playing], groups, defer=defer, iterations=iterations,
                    speculative=speculative, snapshot_in_line=snapshot_in_line)
    run.run()
    names = graph.workers
    return Replay(
        step_end_s=tuple(step.end_s for step in run.steps),
        pipeline_end_s=tuple(run.pipeline_end),
        busy_s={names[w.index]: w.busy_s for w in run.playing},
        first={names[w.index]: [graph.ops[i] for i in w.first] for w in run.playing},
        last={names[w.index]: [graph.ops[i] for i in w.last] for w in run.playing},
    )


@dataclass(eq=False, slots=True)
class _Worker:
    """One worker during a replay: what it runs, and where it is."""

    index: int
    """Local index (``OpGraph.workers``); wakeups at one time go in its order."""
    streams: tuple[list[int], ...]
    """Op ids: the streams it list-schedules, or its one fixed list."""
    seconds: list[float]
    """Compute seconds per op id: ``OpGraph.whole_s``, or ``split_s`` if it splits backwards."""
    ops_per_step: int
    """Ops it runs per step (a W per B where the replay defers them)."""
    room: float
    """Micro-batches whose activations fit beside its weights."""
    snapshot_s: float
    """Seconds its optimizer snapshot takes each step."""
    groups: list[int]
    """The optimizer groups it belongs to."""
    step: int = 0
    cursor: list[int] = field(default_factory=list)
    """Per stream, the position of its next op."""
    open_streams: int = 0
    """Streams not yet run out in this step."""
    ran: int = 0
    """Ops run in this step."""
    free_at: float = 0.0
    """When its last op ends (or, at a step's start, when it may start)."""
    deferred: deque[int] = field(default_factory=deque)
    """W ops waiting for a bubble."""
    live: int = 0
    """Micro-batches holding activations."""
    settled: bool = False
    """Whether it passed this step's first op that waits for the previous step's norm."""
    held: bool = False
    """Whether it waits at that op for the norm."""
    snapshot_end: float = 0.0
    finish: float = 0.0
    """When its last step ended, snapshot included."""
    busy_s: float = 0.0
    """Compute seconds in the first step."""
    first: list[int] = field(default_factory=list)
    """Op ids in the order the first step ran them."""
    last: list[int] = field(default_factory=list)
    """Op ids in the order the last step ran them."""

    def forced(self) -> bool:
        """Whether its next op is forced: it is in a step, with one stream left and no W deferred."""
        return self.ran < self.ops_per_step and self.open_streams <= 1 and not self.deferred


@dataclass(eq=False, slots=True)
class _Step:
    """One step during a replay."""

    end: list[float | None]
    """When each op (by id) ended; None if it has not run yet."""
    group_done: list[int]
    """Per optimizer group, members that finished the step."""
    group_end: list[float]
    """Per optimizer group, when the last of them finished its last op."""
    finished: int = 0
    """Workers that finished the step."""
    norm_at: float = 0.0
    """When the last op anywhere ended: the global norm is in."""
    waiting_norm: list[tuple[float, _Worker]] = field(default_factory=list)
    """Workers held for the norm in the next step, and since when."""
    end_s: float = 0.0
    """When the last worker finished it, snapshot included."""


class _Replayer:
    """The wakeup loop of one ``replay``.

    A worker whose next op is forced (one stream left, no W deferred) runs it as soon as
    its dependency is timed, at ``max(free, dependency end + link)``. A worker with a
    choice makes it at a wakeup (when it becomes free, when an input arrives), taken in
    time order from a heap: every op that starts earlier has been timed by then (op
    times are positive), so the choice sees each input that has arrived, as a
    simulation advancing all workers in time order would.
    """

    def __init__(self, graph: OpGraph, workers: list[_Worker], playing: list[_Worker], groups: list[list[int]], *,
                 defer: bool, iterations: int, speculative: bool, snapshot_in_line: bool):
        self.graph, self.workers, self.playing, self.groups = graph, workers, playing, groups
        self.defer, self.iterations, self.speculative, self.snapshot_in_line = (
            defer, iterations, speculative, snapshot_in_line)
        self.steps = [_Step([None] * len(graph.ops), [0] * len(groups), [0.0] * len(groups))
                      for _ in range(iterations)]
        self.pipeline_end = [0.0] * graph.num_pipelines
        self.forced: deque[_Worker] = deque()
        self.wakeups: list[tuple[float, int]] = []  # (time, local index) of workers with a choice
        for worker in workers:
            worker.step = iterations  # sits out unless it plays
        for worker in playing:
            self.start_step(worker, 0, 0.0)

    def wake(self, worker: _Worker, at: float) -> None:
        """``worker`` may act from ``at``: at once if its next op is forced, else at ``at``
        (unless it is busy until later: its own wakeup comes then)."""
        if worker.forced():
            self.forced.append(worker)
        elif at >= worker.free_at:
            heapq.heappush(self.wakeups, (at, worker.index))

    def head_input_known(self, worker: _Worker) -> bool:
        """Whether the head of ``worker``'s one open stream has its dependency timed (or has
        none): then when its input arrives is known, so its choice at any time (that head if
        its input is in, else a deferred W; a W first if memory is full) depends on nothing
        another worker may still time, and it can be made without a wakeup."""
        streams, cursor = worker.streams, worker.cursor
        s = 0 if len(streams) == 1 else next(j for j, ids in enumerate(streams) if cursor[j] < len(ids))
        d = self.graph.dependency[streams[s][cursor[s]]]
        return d < 0 or self.steps[worker.step].end[d] is not None

    def start_step(self, worker: _Worker, k: int, at: float) -> None:
        worker.step, worker.ran, worker.settled = k, 0, False
        worker.cursor = [0] * len(worker.streams)
        worker.open_streams = sum(1 for ids in worker.streams if ids)
        worker.snapshot_end = at + worker.snapshot_s
        worker.free_at = worker.snapshot_end if self.snapshot_in_line else at
        self.wake(worker, worker.free_at)

    def finish_step(self, worker: _Worker, k: int) -> None:
        """``worker`` ran its last op of step ``k``: release who waited for it."""
        step, last_end = self.steps[k], worker.free_at
        worker.finish = max(last_end, worker.snapshot_end)  # the optimizer step waits for the snapshot
        step.end_s = max(step.end_s, worker.finish)
        step.finished += 1
        step.norm_at = max(step.norm_at, last_end)
        if step.finished == len(self.playing):
            for at, held in step.waiting_norm:
                held.held = False
                self.wake(held, at)  # it was ready then; only the norm was missing
        if k + 1 == self.iterations:
            worker.step = self.iterations
            return
        if not worker.groups:
            self.start_step(worker, k + 1, worker.finish)
        for g in worker.groups:  # the DP all-reduce needs the gradients only
            step.group_done[g] += 1
            step.group_end[g] = max(step.group_end[g], last_end)
            if step.group_done[g] < len(self.groups[g]):
                continue
            for member in map(self.workers.__getitem__, self.groups[g]):
                if member.step == k and all(step.group_done[h] == len(self.groups[h]) for h in member.groups):
                    self.start_step(member, k + 1, max([member.finish, *(step.group_end[h] for h in member.groups)]))

    def run(self) -> None:
        """Time every op of every step; raises ScheduleDeadlock."""
        graph, workers, forced, wakeups = self.graph, self.workers, self.forced, self.wakeups
        dependency_of, link_s, consumer, worker_of = graph.dependency, graph.link_s, graph.consumer, graph.worker
        forward, settles, weight_grad, pipeline_of = graph.forward, graph.settles, graph.weight_grad, graph.pipeline
        defer, speculative, iterations = self.defer, self.speculative, self.iterations
        pipeline_end, last_step, push, pop = self.pipeline_end, iterations - 1, heapq.heappush, heapq.heappop
        while forced or wakeups:
            if forced:
                worker, now = forced.popleft(), None
            else:
                now, w = pop(wakeups)
                worker = workers[w]
            k = worker.step
            if k == iterations or worker.ran == worker.ops_per_step or worker.held:
                continue  # done, or waiting for its optimizer groups or for the norm
            end = self.steps[k].end
            streams, cursor, queued = worker.streams, worker.cursor, worker.deferred
            while True:  # run its ops while it can run them now
                if worker.open_streams <= 1 and not queued:  # forced: the next op of its open stream
                    s = 0 if len(streams) == 1 else next(j for j, ids in enumerate(streams) if cursor[j] < len(ids))
                    op = streams[s][cursor[s]]
                    start = worker.free_at
                    d = dependency_of[op]
                    if d >= 0:
                        arrival = end[d]
                        if arrival is None:
                            break  # timing its dependency wakes it
                        arrival += link_s[op]
                        if arrival > start:
                            start = arrival
                else:  # a choice, made at a wakeup
                    if now is None or now < worker.free_at:
                        break  # busy; its own wakeup is queued
                    op, s, position, soonest = -1, -1, 0, INF
                    for j, ids in enumerate(streams):  # the ready head earliest in 1F1B order, own stream first
                        p = cursor[j]
                        if p == len(ids) or (op >= 0 and p >= position):
                            continue
                        i = ids[p]
                        d = dependency_of[i]
                        if d >= 0:
                            arrival = end[d]
                            if arrival is None:
                                continue
                            arrival += link_s[i]
                            if arrival > now:  # on its way
                                if arrival < soonest:
                                    soonest = arrival
                                continue
                        op, s, position = i, j, p
                    if queued and (op < 0 or forward[op] and worker.live >= worker.room):
                        op, s = queued[0], -1  # idle, or memory full: a deferred W first
                    if op < 0:  # idle until an input on its way arrives (or one not yet sent: its wake)
                        if soonest < INF:
                            push(wakeups, (soonest, worker.index))
                        break
                    start = now
                seconds = worker.seconds[op]
                if speculative and k and not worker.settled and settles[op]:
                    previous = self.steps[k - 1]
                    if previous.finished < len(self.playing):
                        worker.held = True
                        previous.waiting_norm.append((start, worker))
                        break
                    worker.settled = True  # a forward computes, then holds its output until the norm is in
                    norm_at = previous.norm_at
                    done = max(start + seconds, norm_at) if forward[op] else max(start, norm_at) + seconds
                else:
                    done = start + seconds
                if s < 0:
                    queued.popleft()
                    worker.live -= 1
                else:
                    cursor[s] += 1
                    if cursor[s] == len(streams[s]):
                        worker.open_streams -= 1
                    if forward[op]:
                        worker.live += 1
                    elif defer:
                        queued.append(weight_grad[op])
                end[op] = worker.free_at = done
                worker.ran += 1
                if k == 0:
                    worker.first.append(op)
                    worker.busy_s += seconds
                    if done > pipeline_end[pipeline_of[op]]:
                        pipeline_end[pipeline_of[op]] = done
                if k == last_step:
                    worker.last.append(op)
                c = consumer[op]
                if c >= 0 and worker_of[c] != worker.index:
                    waiting, at = workers[worker_of[c]], done + link_s[c]  # ``wake``, inlined: once per op
                    if waiting.ran < waiting.ops_per_step and waiting.open_streams <= 1 and not waiting.deferred:
                        forced.append(waiting)
                    elif at >= waiting.free_at:
                        push(wakeups, (at, waiting.index))
                if worker.ran == worker.ops_per_step:
                    self.finish_step(worker, k)
                    break
                if worker.open_streams > 1 or queued:
                    if speculative or worker.open_streams != 1 or not self.head_input_known(worker):
                        push(wakeups, (done, worker.index))  # its next choice waits for the clock
                        break
                    now = done  # its choice at ``done`` is known already: make it now
        stuck = [worker for worker in self.playing if worker.step < iterations]
        if stuck:
            heads = [graph.ops[ids[worker.cursor[j]]] for worker in stuck for j, ids in enumerate(worker.streams)
                     if worker.cursor[j] < len(ids)]
            raise ScheduleDeadlock(f"ops wait on each other in a cycle: {heads[:4]}")


def _fixed_streams(
    graph: OpGraph, schedule: Mapping[int, Sequence[Op]]
) -> tuple[list[tuple[list[int], ...]], list[bool]]:
    """Each worker's list as its one stream of ids (none for a worker without ops), and
    whether it splits its backwards (its list holds W ops)."""
    local = {w: i for i, w in enumerate(graph.workers)}
    streams: list[tuple[list[int], ...]] = [() for _ in graph.workers]
    split = [False] * len(graph.workers)
    for worker, ops in schedule.items():
        if not ops:
            continue
        try:
            ids = [graph.index[op] for op in ops]
        except KeyError as exc:
            raise ValueError(f"worker {worker} runs {exc.args[0]}, which the plan does not have") from None
        w = local.get(worker)
        if w is None or any(graph.worker[i] != w for i in ids):
            raise ValueError(f"worker {worker} runs ops the plan gives to another worker")
        streams[w] = (ids,)
        split[w] = any(op.kind == WEIGHT_GRAD for op in ops)
    return streams, split
