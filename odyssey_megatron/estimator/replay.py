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

Data model: a plan's ops are indexed once (``OpGraph``: integer ids, one flat array per
attribute, dependency and consumer edges as ids), and every replay of the plan shares
them. The wakeup loop (``estimator.wakeup_loop``, compiled) keeps per worker a cursor
into each of its streams, when it is free and its deferred W ops, and per step when each
op ended. A worker whose next op is forced runs it as soon as its dependency is timed;
a worker with a choice makes it at a wakeup, in time order: every op that starts
earlier has been timed by then (op times are positive), so the choice sees each input
that has arrived, as a simulation advancing all workers in time order would. A worker
whose one open stream's head has its input timed knows its next choice already and
makes it without a wakeup. O(ops log ops).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

import numpy as np

from odyssey_megatron.cluster import ClusterState
from odyssey_megatron.plan import ExecutionPlan
from odyssey_megatron.profile import ModelProfile, StageTimes
from odyssey_megatron.estimator.wakeup_loop import run_wakeup_loop
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
    arrays: tuple[np.ndarray, ...]
    """The per-op lists the wakeup loop reads, as arrays in its argument order:
    dependency, link_s, consumer, worker, forward, settles, weight_grad, pipeline,
    whole_s, split_s."""
    flat_streams: tuple[np.ndarray, ...]
    """``streams`` as the wakeup loop reads them (``_flatten``)."""


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
    arrays = (
        np.array(dep, np.int64), np.array(link_s), np.array(consumer, np.int64), np.array(worker, np.int64),
        np.array(forward, np.bool_), np.array(settling, np.bool_), np.array(weight_grad, np.int64),
        np.array(pipeline, np.int64), np.array(whole_s), np.array(split_s),
    )
    return OpGraph(
        ops=tuple(ops), index=index, workers=workers, plan_order=tuple(workers.index(w) for w in streams),
        num_pipelines=len(plan.pipelines), streams=tuple(stream_ids), worker=worker, pipeline=pipeline,
        forward=forward, dependency=dep, link_s=link_s, consumer=consumer, whole_s=whole_s, split_s=split_s,
        weight_grad=weight_grad, settles=settling, arrays=arrays, flat_streams=_flatten(stream_ids, arrays[4]),
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
    local = {w: i for i, w in enumerate(graph.workers)}
    if schedule is None:
        streams, playing, split = graph.flat_streams, graph.plan_order, [split_backward] * len(graph.workers)
    else:
        fixed, split = _fixed_streams(graph, schedule)
        streams = _flatten(fixed, graph.arrays[4])
        playing = tuple(local[w] for w, ops in schedule.items() if ops)
    defer = schedule is None and split_backward
    groups = [[local[w] for w in group if w in local] for group in optimizer_groups]
    member_of: list[list[int]] = [[] for _ in graph.workers]
    for g, group in enumerate(groups):
        for w in group:
            member_of[w].append(g)
    stream_start, stream_ops_start, stream_ops, stream_ops_of, backwards_of = streams
    step, cursor, step_end, pipeline_end, busy, order_start, first, first_len, last, last_len = run_wakeup_loop(
        *graph.arrays, graph.num_pipelines,
        stream_start, stream_ops_start, stream_ops, np.array(split, np.bool_),
        stream_ops_of + backwards_of if defer else stream_ops_of,
        _per_worker(graph, room, INF), _per_worker(graph, snapshot_s, 0.0),
        *_csr(member_of), *_csr(groups),
        np.array(playing, np.int64), defer, iterations, speculative, snapshot_in_line,
    )
    names, ops = graph.workers, graph.ops
    stuck = [w for w in playing if step[w] < iterations]
    if stuck:
        heads = [ops[stream_ops[stream_ops_start[j] + cursor[j]]] for w in stuck
                 for j in range(stream_start[w], stream_start[w + 1]) if cursor[j] < stream_ops_start[j + 1] - stream_ops_start[j]]
        raise ScheduleDeadlock(f"ops wait on each other in a cycle: {heads[:4]}")
    order_start, first_len, last_len = order_start.tolist(), first_len.tolist(), last_len.tolist()
    first, last, busy = first.tolist(), last.tolist(), busy.tolist()
    return Replay(
        step_end_s=tuple(step_end.tolist()),
        pipeline_end_s=tuple(pipeline_end.tolist()),
        busy_s={names[w]: busy[w] for w in playing},
        first={names[w]: [ops[i] for i in first[order_start[w]:order_start[w] + first_len[w]]] for w in playing},
        last={names[w]: [ops[i] for i in last[order_start[w]:order_start[w] + last_len[w]]] for w in playing},
    )


def _flatten(streams: Sequence[tuple[list[int], ...]], forward: np.ndarray) -> tuple[np.ndarray, ...]:
    """Per-worker streams of op ids as the wakeup loop reads them: where each worker's
    streams start (in the stream arrays), where each stream's ops start, the ops; per
    worker its stream ops and, of those, its backwards (each defers a W)."""
    lengths = [len(ids) for worker_streams in streams for ids in worker_streams]
    stream_start = np.zeros(len(streams) + 1, np.int64)
    np.cumsum([len(worker_streams) for worker_streams in streams], out=stream_start[1:])
    stream_ops_start = np.zeros(len(lengths) + 1, np.int64)
    np.cumsum(lengths, out=stream_ops_start[1:])
    stream_ops = np.array([op for worker_streams in streams for ids in worker_streams for op in ids], np.int64)
    owner = np.repeat(np.arange(len(streams)), np.diff(stream_ops_start[stream_start]))
    stream_ops_of = np.bincount(owner, minlength=len(streams)).astype(np.int64)
    backwards_of = np.bincount(owner, weights=~forward[stream_ops], minlength=len(streams)).astype(np.int64)
    return stream_start, stream_ops_start, stream_ops, stream_ops_of, backwards_of


def _per_worker(graph: OpGraph, values: Mapping[int, float] | None, default: float) -> np.ndarray:
    """``values`` by worker id as an array by local index, ``default`` where absent."""
    array = np.full(len(graph.workers), default)
    for local, worker in enumerate(graph.workers):
        if values and worker in values:
            array[local] = values[worker]
    return array


def _csr(rows: Sequence[Sequence[int]]) -> tuple[np.ndarray, np.ndarray]:
    """Lists of ints as (where each row starts, the rows concatenated)."""
    start = np.zeros(len(rows) + 1, np.int64)
    np.cumsum([len(row) for row in rows], out=start[1:])
    return start, np.array([x for row in rows for x in row], np.int64)


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
