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
from functools import cached_property, lru_cache
from typing import Mapping, MutableMapping, Sequence

import numpy as np

from odyssey_megatron.cluster import ClusterState
from odyssey_megatron.estimator.wakeup_loop import run_wakeup_loop
from odyssey_megatron.plan import ExecutionPlan
from odyssey_megatron.profile import ModelProfile
from odyssey_megatron.schedules.ops import BACKWARD, FORWARD, WEIGHT_GRAD, Op, dependency, one_f_one_b, stream_sources

INF = float("inf")


class ScheduleDeadlock(RuntimeError):
    """The op lists wait on each other in a cycle: the plan cannot run as compiled."""


def p2p_time(profile: ModelProfile, *, same_node: bool) -> float:
    """Seconds to send one micro-batch's activations (or their gradients) to the next stage."""
    if profile.p2p_bytes == 0:
        return 0.0
    return profile.link_latency_s + profile.p2p_bytes / profile.bandwidth(same_node)


KINDS = (FORWARD, BACKWARD, WEIGHT_GRAD)
"""Op kinds by their code in ``OpGraph.kind``."""


@dataclass(frozen=True)
class OpGraph:
    """A plan's ops indexed once: every replay of the plan (plain, split, fixed lists,
    several steps) runs each op on the same worker after the same dependency, so one
    graph serves them all. Op ids: the plan's stream ops (F and B) worker by worker,
    stream by stream, then a W per B. Workers are numbered by ascending worker id (their
    local index). Per-op attributes are arrays by op id, which the compiled wakeup loop
    reads as they are; ``ops`` and ``index`` name ops as ``Op`` tuples, built when asked."""

    kind: np.ndarray
    """Code of each op's kind (``KINDS``)."""
    pipeline: np.ndarray
    """Pipeline of each op."""
    stage: np.ndarray
    """Stage of each op."""
    micro_batch: np.ndarray
    """Micro-batch of each op."""
    workers: tuple[int, ...]
    """Worker id of each local index, ascending (wakeups at one time go in this order)."""
    plan_order: tuple[int, ...]
    """Local indexes in the plan's stage order, the order results list workers in."""
    num_pipelines: int
    """Pipelines of the plan."""
    stream_start: np.ndarray
    """Per local worker (and one past the last), its first stream (``stream_sources``:
    its own stage's, then the ones it adopts)."""
    stream_ops_start: np.ndarray
    """Per stream (and one past the last), its first op id; a stream's ops are consecutive."""
    worker: np.ndarray
    """Local index of the worker running each op."""
    forward: np.ndarray
    """Whether each op is a forward."""
    dependency: np.ndarray
    """The op each op waits for (``schedules.ops.dependency``); -1 for none (first-stage
    forwards, W)."""
    link_s: np.ndarray
    """Transfer seconds from each op's dependency's worker to its own (0 on one worker)."""
    consumer: np.ndarray
    """The op waiting for each op's output; -1 for none."""
    whole_s: np.ndarray
    """Compute seconds of each op with whole backwards."""
    split_s: np.ndarray
    """Compute seconds of each op with split backwards (B: the input-gradient half,
    ``ModelProfile.stage_times``)."""
    weight_grad: np.ndarray
    """The W of each B; -1 for other ops."""
    settles: np.ndarray
    """Whether a speculative step must wait for the global norm before it finishes the op:
    it writes gradients (B, W) or sends its result (a forward below the last stage)."""

    @cached_property
    def ops(self) -> tuple[Op, ...]:
        """Op of each id."""
        kinds = [KINDS[k] for k in self.kind.tolist()]
        return tuple(map(Op, kinds, self.pipeline.tolist(), self.stage.tolist(), self.micro_batch.tolist()))

    @cached_property
    def index(self) -> dict[Op, int]:
        """Id of each op."""
        return {op: i for i, op in enumerate(self.ops)}

    @property
    def arrays(self) -> tuple[np.ndarray, ...]:
        """The per-op arrays in the wakeup loop's argument order."""
        return (self.dependency, self.link_s, self.consumer, self.worker, self.forward, self.settles,
                self.weight_grad, self.pipeline, self.whole_s, self.split_s)

    @cached_property
    def flat_streams(self) -> tuple[np.ndarray, ...]:
        """Every worker's streams as the wakeup loop reads them (``_flatten``)."""
        stream_ops = np.arange(self.stream_ops_start[-1], dtype=np.int64)  # stream ops come first, in order
        return (self.stream_start, self.stream_ops_start, stream_ops,
                *_counts(self.stream_start, self.stream_ops_start, stream_ops, self.forward))


@lru_cache(maxsize=4096)
def _one_f_one_b_order(num_micro_batches: int, stage: int, num_stages: int) -> tuple[np.ndarray, np.ndarray]:
    """``one_f_one_b`` over positions in a micro-batch list: (1 for each backward, 0 for
    each forward; the position of each op's micro-batch), shared by every stream of that shape."""
    order = one_f_one_b(range(num_micro_batches), stage=stage, num_stages=num_stages)
    return (np.array([kind == BACKWARD for kind, _ in order], np.int8),
            np.array([position for _, position in order], np.int64))


def op_graph(plan: ExecutionPlan, profile: ModelProfile, cluster: ClusterState | None, *,
             slowdowns: Mapping[int, float] | None = None) -> OpGraph:
    """The ``OpGraph`` of ``plan``'s streams (``stream_sources``; links priced on ``cluster``'s
    nodes; all on one node without it). ``slowdowns``: workers that compute slower than
    the profile says (a straggler at its measured slowdown), each op they run taking that
    many times its profiled seconds; links are not stretched. Raises ScheduleDeadlock if
    an op waits for one that no worker runs. Built as arrays, one 1F1B order per stream
    shape."""
    sources = stream_sources(plan)
    workers = tuple(sorted(sources))
    num_stages = np.array([p.num_stages for p in plan.pipelines] or [0], np.int64)
    kind, pipeline, stage, micro_batch, worker, stream_start, stream_ops_start = _stream_ops(plan, sources, workers)
    backwards = np.flatnonzero(kind == 1)
    num_stream_ops = len(kind)
    kind = np.concatenate([kind, np.full(len(backwards), 2, np.int8)])  # a W per B, after every stream op
    pipeline, stage = np.concatenate([pipeline, pipeline[backwards]]), np.concatenate([stage, stage[backwards]])
    micro_batch = np.concatenate([micro_batch, micro_batch[backwards]])
    worker = np.concatenate([worker, worker[backwards]])
    weight_grad = np.full(len(kind), -1, np.int64)
    weight_grad[backwards] = num_stream_ops + np.arange(len(backwards))
    last = stage == num_stages[pipeline] - 1
    dep = _dependencies(kind, pipeline, stage, micro_batch, last, num_stages)
    waits = dep >= 0
    consumer = np.full(len(kind), -1, np.int64)
    consumer[dep[waits]] = np.flatnonzero(waits)
    node = np.array([cluster.node_of_worker(w) if cluster else 0 for w in workers] or [0], np.int64)
    source = worker[np.maximum(dep, 0)]
    link_s = np.where(~waits | (source == worker), 0.0,
                      np.where(node[source] == node[worker], p2p_time(profile, same_node=True),
                               p2p_time(profile, same_node=False)))
    times = _stage_seconds(plan, profile, num_stages)
    whole_s = times[[0, 1, 3]][kind, pipeline, stage]  # by kind: F, whole B, W
    split_s = times[[0, 2, 3]][kind, pipeline, stage]  # by kind: F, input-gradient B, W
    if slowdowns:
        factor = np.array([slowdowns.get(w, 1.0) for w in workers] or [1.0])[worker]
        whole_s, split_s = whole_s * factor, split_s * factor
    local = {w: i for i, w in enumerate(workers)}
    return OpGraph(
        kind=kind, pipeline=pipeline, stage=stage, micro_batch=micro_batch, workers=workers,
        plan_order=tuple(local[w] for w in sources), num_pipelines=len(plan.pipelines), stream_start=stream_start,
        stream_ops_start=stream_ops_start, worker=worker, forward=kind == 0, dependency=dep, link_s=link_s,
        consumer=consumer, whole_s=whole_s, split_s=split_s, weight_grad=weight_grad, settles=(kind != 0) | ~last,
    )


def _stream_ops(plan: ExecutionPlan, sources: dict, workers: tuple[int, ...]) -> tuple[np.ndarray, ...]:
    """Every stream op, worker by worker (``workers``), stream by stream: its kind code,
    pipeline, stage, micro-batch and local worker; where each worker's streams start,
    and where each stream's ops start."""
    micro_batches = {pi: np.array(p.micro_batches, np.int64) for pi, p in enumerate(plan.pipelines)}
    pieces = []
    for local, w in enumerate(workers):
        for pi, si, keep in sources[w]:
            mbs = micro_batches[pi]
            kinds, positions = _one_f_one_b_order(len(mbs), si, plan.pipelines[pi].num_stages)
            mb = mbs[positions]
            if keep is not None:
                kept = np.isin(mb, np.fromiter(keep, np.int64, len(keep)))
                kinds, mb = kinds[kept], mb[kept]
            pieces.append((kinds, pi, si, mb, local))
    lengths = np.array([len(piece[3]) for piece in pieces], np.int64)

    def each(field: int) -> np.ndarray:
        return np.repeat(np.array([piece[field] for piece in pieces], np.int64), lengths)

    stream_start = np.zeros(len(workers) + 1, np.int64)
    np.cumsum([len(sources[w]) for w in workers], out=stream_start[1:])
    stream_ops_start = np.zeros(len(pieces) + 1, np.int64)
    np.cumsum(lengths, out=stream_ops_start[1:])
    return (np.concatenate([np.zeros(0, np.int8), *(piece[0] for piece in pieces)]), each(1), each(2),
            np.concatenate([np.zeros(0, np.int64), *(piece[3] for piece in pieces)]), each(4),
            stream_start, stream_ops_start)


def _dependencies(kind, pipeline, stage, micro_batch, last, num_stages) -> np.ndarray:
    """The op id each op waits for (``schedules.ops.dependency``), found by key among all
    ops; -1 for none. Raises ScheduleDeadlock for one that no worker runs."""
    span = (len(num_stages), int(num_stages.max()) + 1, int(micro_batch.max(initial=0)) + 1)

    def key(k, p, s, m):
        return ((k * span[0] + p) * span[1] + s) * span[2] + m

    waits = np.where(kind == 0, stage > 0, kind == 1)
    wanted = np.where(kind == 0, key(0, pipeline, stage - 1, micro_batch),
                      np.where(last, key(0, pipeline, stage, micro_batch), key(1, pipeline, stage + 1, micro_batch)))
    keys = key(kind.astype(np.int64), pipeline, stage, micro_batch)
    by_key = np.argsort(keys, kind="stable")
    sorted_keys = keys[by_key]
    found_at = np.minimum(np.searchsorted(sorted_keys, wanted), max(len(kind) - 1, 0))
    found = waits & (sorted_keys[found_at] == wanted) if len(kind) else waits
    if (waits & ~found).any():
        i = int(np.flatnonzero(waits & ~found)[0])
        op = Op(KINDS[kind[i]], int(pipeline[i]), int(stage[i]), int(micro_batch[i]))
        raise ScheduleDeadlock(f"{op} waits for {dependency(op, num_stages=int(num_stages[op.pipeline]))}, "
                               "which no worker runs")
    return np.where(waits, by_key[found_at] if len(kind) else found_at, -1)


def _stage_seconds(plan: ExecutionPlan, profile: ModelProfile, num_stages: np.ndarray) -> np.ndarray:
    """Per (forward, whole backward, input-gradient backward, W), pipeline and stage, the
    op's compute seconds (``ModelProfile.stage_times``, once per stage shape)."""
    times = np.zeros((4, len(plan.pipelines), int(num_stages.max()) + 1))
    by_shape: dict[tuple, tuple[float, ...]] = {}
    for pi, si, st in plan.stage_positions():
        shape = (*st.layers, si == 0, si == num_stages[pi] - 1)
        if shape not in by_shape:
            t = profile.stage_times(shape[0], shape[1], first=shape[2], last=shape[3])
            by_shape[shape] = t.forward_s, t.backward_s, t.input_grad_s, t.weight_grad_s
        times[:, pi, si] = by_shape[shape]
    return times


@dataclass(frozen=True)
class Replay:
    """What a replay measured."""

    step_end_s: tuple[float, ...]
    """Per step, when its last worker finished (its snapshot included)."""
    pipeline_end_s: tuple[float, ...]
    """Per pipeline, when its last op of the first step ended."""
    busy_s: dict[int, float]
    """Compute seconds of each worker in the first step."""
    first: OpLists
    """Each worker's ops in the order the first step ran them."""
    last: OpLists
    """Each worker's ops in the order the last step ran them."""


class OpLists(MutableMapping[int, list[Op]]):
    """Each worker's ops in the order it runs them, kept as op ids of one ``OpGraph``: a
    replay's op orders. Read as lists of ``Op`` (made when a worker's is first read);
    a replay of the same graph and ``op_kinds`` read the ids, naming no op, which keeps
    a large decision's schedules from building hundreds of thousands of tuples. A list
    set for a worker must hold ops of the graph."""

    def __init__(self, graph: OpGraph, ids: dict[int, np.ndarray]):
        self.graph = graph
        self.ids = ids
        """Op ids per worker id, in order."""
        self._named: dict[int, list[Op]] = {}

    def __getitem__(self, worker: int) -> list[Op]:
        if worker not in self._named:
            g, ids = self.graph, self.ids[worker]
            self._named[worker] = list(map(Op, [KINDS[k] for k in g.kind[ids].tolist()], g.pipeline[ids].tolist(),
                                           g.stage[ids].tolist(), g.micro_batch[ids].tolist()))
        return self._named[worker]

    def __setitem__(self, worker: int, ops: Sequence[Op]) -> None:
        try:
            self.ids[worker] = np.array([self.graph.index[op] for op in ops], np.int64)
        except KeyError as exc:
            raise ValueError(f"worker {worker} runs {exc.args[0]}, which the plan does not have") from None
        self._named[worker] = list(ops)

    def __delitem__(self, worker: int) -> None:
        del self.ids[worker]
        self._named.pop(worker, None)

    def __iter__(self):
        return iter(self.ids)

    def __len__(self) -> int:
        return len(self.ids)

    def __repr__(self) -> str:
        return repr(dict(self))


def op_kinds(schedule: Mapping[int, Sequence[Op]], worker: int) -> np.ndarray:
    """Codes (``KINDS``) of ``worker``'s ops in ``schedule``, in order (none if it has no list)."""
    if isinstance(schedule, OpLists):
        return schedule.graph.kind[schedule.ids[worker]] if worker in schedule.ids else np.zeros(0, np.int8)
    return np.array([KINDS.index(op.kind) for op in schedule.get(worker, ())], np.int8)


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
        streams = _flatten(fixed, graph.forward)
        playing = tuple(local[w] for w in schedule if len(op_kinds(schedule, w)))
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
    names = graph.workers
    stuck = [w for w in playing if step[w] < iterations]
    if stuck:
        heads = [graph.ops[stream_ops[stream_ops_start[j] + cursor[j]]] for w in stuck
                 for j in range(stream_start[w], stream_start[w + 1])
                 if cursor[j] < stream_ops_start[j + 1] - stream_ops_start[j]]
        raise ScheduleDeadlock(f"ops wait on each other in a cycle: {heads[:4]}")
    order_start, first_len, last_len = order_start.tolist(), first_len.tolist(), last_len.tolist()
    busy = busy.tolist()
    return Replay(
        step_end_s=tuple(step_end.tolist()),
        pipeline_end_s=tuple(pipeline_end.tolist()),
        busy_s={names[w]: busy[w] for w in playing},
        first=OpLists(graph, {names[w]: first[order_start[w]:order_start[w] + first_len[w]] for w in playing}),
        last=OpLists(graph, {names[w]: last[order_start[w]:order_start[w] + last_len[w]] for w in playing}),
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
    stream_ops = np.concatenate([np.zeros(0, np.int64), *(ids for worker_streams in streams for ids in worker_streams)])
    return stream_start, stream_ops_start, stream_ops, *_counts(stream_start, stream_ops_start, stream_ops, forward)


def _counts(stream_start, stream_ops_start, stream_ops, forward) -> tuple[np.ndarray, np.ndarray]:
    """Per worker, its stream ops and, of those, its backwards (each defers a W)."""
    num_workers = len(stream_start) - 1
    owner = np.repeat(np.arange(num_workers), np.diff(stream_ops_start[stream_start]))
    return (np.bincount(owner, minlength=num_workers).astype(np.int64),
            np.bincount(owner, weights=~forward[stream_ops], minlength=num_workers).astype(np.int64))


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


def _fixed_streams(graph: OpGraph, schedule: Mapping[int, Sequence[Op]]) -> tuple[list[tuple], list[bool]]:
    """Each worker's list as its one stream of ids (none for a worker without ops), and
    whether it splits its backwards (its list holds W ops)."""
    local = {w: i for i, w in enumerate(graph.workers)}
    streams: list[tuple] = [() for _ in graph.workers]
    split = [False] * len(graph.workers)
    for worker in schedule:
        if isinstance(schedule, OpLists) and schedule.graph is graph:
            ids = schedule.ids[worker]  # op orders of a replay of this graph
        else:
            try:
                ids = np.array([graph.index[op] for op in schedule[worker]], np.int64)
            except KeyError as exc:
                raise ValueError(f"worker {worker} runs {exc.args[0]}, which the plan does not have") from None
        if not len(ids):
            continue
        w = local.get(worker)
        if w is None or (graph.worker[ids] != w).any():
            raise ValueError(f"worker {worker} runs ops the plan gives to another worker")
        streams[w] = (ids,)
        split[w] = bool((graph.kind[ids] == 2).any())
    return streams, split
