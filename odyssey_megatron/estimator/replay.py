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
attribute, dependency and consumer as ids); a replay keeps per worker a cursor into each
of its streams and processes wakeups in time order with a heap, so it costs
O(ops log ops). A worker wakes when it becomes free and when the output of an op it may
wait for arrives; on a fixed list only those two times matter, so the times equal the
recurrence above whatever order the wakeups come in.
"""

from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass
from typing import Mapping, Sequence

from odyssey_megatron.cluster import ClusterState
from odyssey_megatron.plan import ExecutionPlan
from odyssey_megatron.profile import ModelProfile
from odyssey_megatron.schedules.ops import BACKWARD, FORWARD, WEIGHT_GRAD, Op, compile_streams, dependency

WEIGHT_GRAD_SHARE = 0.5
"""Share of a backward spent on weight gradients: one of the two GEMMs of each linear layer."""


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
    """The op each op waits for on another stage; -1 for none (first-stage forwards, W)."""
    link_s: list[float]
    """Transfer seconds from each op's dependency's worker to its own (0 on one worker)."""
    consumer: list[int]
    """The op waiting for each op's output; -1 for none."""
    whole_s: list[float]
    """Compute seconds of each op with whole backwards."""
    split_s: list[float]
    """Compute seconds of each op with split backwards (B: the input-gradient share)."""
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
    compute: dict[tuple[int, int], tuple[float, float]] = {}
    for pi, si, stage in plan.stage_positions():
        start, end = stage.layers
        compute[pi, si] = profile.stage_compute(start, end, first=si == 0, last=si == num_stages[pi] - 1)
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
        if ops[i].kind == BACKWARD:
            weight_grad[i] = len(ops)
            ops.append(Op(WEIGHT_GRAD, *ops[i][1:]))
            worker.append(worker[i])
    index = {op: i for i, op in enumerate(ops)}

    link_cache: dict[tuple[int, int], float] = {}

    def link(a: int, b: int) -> float:
        if (a, b) not in link_cache:
            same_node = cluster is None or cluster.same_node(workers[a], workers[b])
            link_cache[a, b] = 0.0 if a == b else p2p_time(profile, same_node=same_node)
        return link_cache[a, b]

    n = len(ops)
    dep, link_s, consumer = [-1] * n, [0.0] * n, [-1] * n
    whole_s, split_s = [0.0] * n, [0.0] * n
    for i, op in enumerate(ops):
        forward_s, backward_s = compute[op.pipeline, op.stage]
        if op.kind == FORWARD:
            whole_s[i] = split_s[i] = forward_s
        elif op.kind == BACKWARD:
            whole_s[i], split_s[i] = backward_s, backward_s * (1 - WEIGHT_GRAD_SHARE)
        else:
            whole_s[i] = split_s[i] = backward_s * WEIGHT_GRAD_SHARE
        if i >= num_stream_ops:
            continue
        d = dependency(op, num_stages=num_stages[op.pipeline])
        if d is None:
            continue
        if d not in index:
            raise ScheduleDeadlock(f"{op} waits for {d}, which no worker runs")
        dep[i] = index[d]
        link_s[i] = link(worker[dep[i]], worker[i])
        consumer[dep[i]] = i
    return OpGraph(
        ops=tuple(ops), index=index, workers=workers, plan_order=tuple(workers.index(w) for w in streams),
        num_pipelines=len(plan.pipelines), streams=tuple(stream_ids),
        worker=worker, pipeline=[op.pipeline for op in ops], forward=[op.kind == FORWARD for op in ops], dependency=dep,
        link_s=link_s, consumer=consumer, whole_s=whole_s, split_s=split_s, weight_grad=weight_grad,
        settles=[op.kind != FORWARD or op.stage < num_stages[op.pipeline] - 1 for op in ops],
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
    ops, worker_of, pipeline_of, forward = graph.ops, graph.worker, graph.pipeline, graph.forward
    dependency_of, link_s, consumer, settles = graph.dependency, graph.link_s, graph.consumer, graph.settles
    workers = graph.workers
    num_workers = len(workers)
    defer = schedule is None and split_backward
    local = {w: i for i, w in enumerate(workers)}
    if schedule is None:
        streams, playing = graph.streams, graph.plan_order
        split = [split_backward] * num_workers
    else:
        streams, split = _fixed_streams(graph, schedule)
        playing = tuple(local[w] for w, ops in schedule.items() if ops)
    seconds = [graph.split_s if s else graph.whole_s for s in split]
    per_step = [sum(len(s) for s in lists) for lists in streams]
    if defer:  # a W per B
        per_step = [n + sum(not forward[i] for s in lists for i in s) for n, lists in zip(per_step, streams)]
    capacity = [float("inf")] * num_workers
    for worker, r in (room or {}).items():
        capacity[local[worker]] = r
    snapshot = [0.0] * num_workers
    for worker, s in (snapshot_s or {}).items():
        if worker in local:
            snapshot[local[worker]] = s
    groups = [[local[w] for w in group if w in local] for group in optimizer_groups]
    member_of: list[list[int]] = [[] for _ in range(num_workers)]
    for g, group in enumerate(groups):
        for w in group:
            member_of[w].append(g)

    # Per worker: its step, cursor per stream, ops run in the step, when it is free.
    step = [iterations if not streams[w] else 0 for w in range(num_workers)]
    cursor = [[0] * len(lists) for lists in streams]
    ran = [0] * num_workers
    free_at = [0.0] * num_workers
    deferred: list[deque[int]] = [deque() for _ in range(num_workers)]
    live = [0] * num_workers  # micro-batches holding activations (split backwards)
    settled = [False] * num_workers  # passed this step's first op that waits for the norm
    held = [False] * num_workers  # waiting at that op for the norm
    snapshot_end = [0.0] * num_workers
    finish = [0.0] * num_workers  # end of the worker's last step, snapshot included
    # Per step: when each op ended, who finished, when the last op anywhere ended (the
    # global norm), who waits for it, and per optimizer group who finished and when.
    end: list[list[float | None]] = [[None] * len(ops) for _ in range(iterations)]
    finished = [0] * iterations
    norm_at = [0.0] * iterations
    waiting_norm: list[list[tuple[float, int]]] = [[] for _ in range(iterations)]
    group_done = [[0] * len(groups) for _ in range(iterations)]
    group_end = [[0.0] * len(groups) for _ in range(iterations)]
    step_end = [0.0] * iterations
    pipeline_end = [0.0] * graph.num_pipelines
    busy = [0.0] * num_workers
    first: list[list[int]] = [[] for _ in range(num_workers)]
    last: list[list[int]] = [[] for _ in range(num_workers)]
    wakeups: list[tuple[float, int]] = []

    def start_step(w: int, k: int, at: float) -> None:
        step[w], ran[w], settled[w] = k, 0, False
        cursor[w] = [0] * len(cursor[w])
        snapshot_end[w] = at + snapshot[w]
        free_at[w] = snapshot_end[w] if snapshot_in_line else at
        heapq.heappush(wakeups, (free_at[w], w))

    def finish_step(w: int, k: int) -> None:
        """``w`` ran its last op of step ``k``: release who waited for it."""
        last_end = free_at[w]
        finish[w] = max(last_end, snapshot_end[w])  # the optimizer step waits for the snapshot
        step_end[k] = max(step_end[k], finish[w])
        finished[k] += 1
        norm_at[k] = max(norm_at[k], last_end)
        if finished[k] == len(playing):
            for at, h in waiting_norm[k]:
                held[h] = False
                heapq.heappush(wakeups, (at, h))  # it was ready then; only the norm was missing
        if k + 1 == iterations:
            step[w] = iterations
            return
        if not member_of[w]:
            start_step(w, k + 1, finish[w])
        for g in member_of[w]:  # the DP all-reduce needs the gradients only
            group_done[k][g] += 1
            group_end[k][g] = max(group_end[k][g], last_end)
            if group_done[k][g] < len(groups[g]):
                continue
            for m in groups[g]:
                if step[m] == k and all(group_done[k][h] == len(groups[h]) for h in member_of[m]):
                    start_step(m, k + 1, max([finish[m], *(group_end[k][h] for h in member_of[m])]))

    for w in playing:
        start_step(w, 0, 0.0)
    while wakeups:
        now, w = heapq.heappop(wakeups)
        k = step[w]
        if now < free_at[w] or k == iterations or ran[w] == per_step[w] or held[w]:
            continue  # busy, done, waiting for its optimizer groups or for the norm
        end_k = end[k]
        op, from_stream, position = -1, -1, 0
        for s, stream in enumerate(streams[w]):  # the ready head earliest in 1F1B order
            p = cursor[w][s]
            if p == len(stream) or (op >= 0 and p >= position):
                continue
            i = stream[p]
            d = dependency_of[i]
            if d >= 0:
                dep_end = end_k[d]
                if dep_end is None or dep_end + link_s[i] > now:
                    continue
            op, from_stream, position = i, s, p
        if defer and deferred[w] and (op < 0 or forward[op] and live[w] >= capacity[w]):
            op, from_stream = deferred[w][0], -1  # idle, or memory full: a deferred W first
        if op < 0:
            continue  # a completion elsewhere will wake this worker
        duration = seconds[w][op]
        if speculative and k and not settled[w] and settles[op]:
            if finished[k - 1] < len(playing):
                held[w] = True
                waiting_norm[k - 1].append((now, w))
                continue
            settled[w] = True
            norm = norm_at[k - 1]  # a forward computes, then holds its output until the norm is in
            done = max(now + duration, norm) if forward[op] else max(now, norm) + duration
        else:
            done = now + duration
        if from_stream < 0:
            deferred[w].popleft()
            live[w] -= 1
        else:
            cursor[w][from_stream] += 1
            if forward[op]:
                live[w] += 1
            elif defer:
                deferred[w].append(graph.weight_grad[op])
        end_k[op] = free_at[w] = done
        ran[w] += 1
        if k == 0:
            first[w].append(op)
            busy[w] += duration
            if done > pipeline_end[pipeline_of[op]]:
                pipeline_end[pipeline_of[op]] = done
        if k == iterations - 1:
            last[w].append(op)
        heapq.heappush(wakeups, (done, w))
        c = consumer[op]
        if c >= 0 and worker_of[c] != w:
            heapq.heappush(wakeups, (done + link_s[c], worker_of[c]))
        if ran[w] == per_step[w]:
            finish_step(w, k)

    stuck = [w for w in playing if step[w] < iterations]
    if stuck:
        heads = [ops[s[cursor[w][j]]] for w in stuck for j, s in enumerate(streams[w]) if cursor[w][j] < len(s)]
        raise ScheduleDeadlock(f"ops wait on each other in a cycle: {heads[:4]}")
    return Replay(
        step_end_s=tuple(step_end),
        pipeline_end_s=tuple(pipeline_end),
        busy_s={workers[w]: busy[w] for w in playing},
        first={workers[w]: [ops[i] for i in first[w]] for w in playing},
        last={workers[w]: [ops[i] for i in last[w]] for w in playing},
    )


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
