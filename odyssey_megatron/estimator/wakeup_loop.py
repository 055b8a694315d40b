"""The wakeup loop of ``estimator.replay``, compiled (numba) over flat arrays.

A decision at cluster scale replays plans of about 100,000 ops a few dozen times; as
interpreted Python this loop was two thirds of a cold 70B decision. The rules are
``replay``'s, op for op, and so are the results: every time is the same max-plus
expression over the same floats (``tests/test_replay.py`` compares them with frozen
fingerprints of the loops it replaced).

State lives in arrays indexed by worker (its step, ops run, open streams, when it is
free, micro-batches holding activations, its ring of deferred W ops), by stream (a
cursor), by step and op (when it ended; -1 before it ran) and by step and optimizer
group. Workers whose next op is forced wait in a FIFO (one entry per op run, step start
or release from the norm wait at most). Workers with a choice wait in a binary heap
ordered as ``heapq`` orders (time, worker) tuples, so ties wake in worker order, holding
each worker's earliest wakeup only: a later reason to wake it needs no entry of its own,
since at the earlier wakeup it either runs an op (and wakes again when free) or, nothing
being ready, wakes again at the soonest arrival it knows of; a wakeup that finds it busy
wakes it again when it is free. Queueing every reason instead, most of them found the
worker busy: the 24 replays of a cold 70B decision at 4,096 ranks ran 17 % slower so,
with the same results.

Compiled once per machine (``cache=True`` keeps it beside this file, or in numba's
cache directory), which takes a few seconds the first time.
"""

from __future__ import annotations

import numpy as np
from numba import njit


@njit(cache=True, inline="always")
def _earlier(t1, w1, t2, w2):
    return t1 < t2 or (t1 == t2 and w1 < w2)


@njit(cache=True)
def _put(times, workers, slot, position, at, worker):
    """Store (at, worker) at ``position``, where ``slot`` finds it."""
    times[position] = at
    workers[position] = worker
    slot[worker] = position


@njit(cache=True)
def _sift_up(times, workers, slot, position, at, worker):
    """Put (at, worker) at ``position`` or above."""
    while position > 0:
        parent = (position - 1) >> 1
        if not _earlier(at, worker, times[parent], workers[parent]):
            break
        _put(times, workers, slot, position, times[parent], workers[parent])
        position = parent
    _put(times, workers, slot, position, at, worker)


@njit(cache=True)
def _wake_at(times, workers, slot, size, at, worker):
    """Wake ``worker`` at ``at``, unless it wakes no later already; returns the heap size."""
    position = slot[worker]
    if position < 0:
        _sift_up(times, workers, slot, size, at, worker)
        return size + 1
    if at < times[position]:
        _sift_up(times, workers, slot, position, at, worker)
    return size


@njit(cache=True)
def _heap_pop(times, workers, slot, size):
    """Remove the earliest wakeup; returns (its time, its worker, the new size)."""
    at, worker = times[0], workers[0]
    slot[worker] = -1
    size -= 1
    if size > 0:
        t, w = times[size], workers[size]
        position = 0
        while True:
            child = 2 * position + 1
            if child >= size:
                break
            if child + 1 < size and _earlier(times[child + 1], workers[child + 1], times[child], workers[child]):
                child += 1
            if not _earlier(times[child], workers[child], t, w):
                break
            _put(times, workers, slot, position, times[child], workers[child])
            position = child
        _put(times, workers, slot, position, t, w)
    return at, worker, size


@njit(cache=True, inline="always")
def _later(a, b):
    """Python's ``max(a, b)``: ``a`` unless ``b`` is greater."""
    return b if b > a else a


@njit(cache=True, inline="always")
def _open_stream(w, stream_start, stream_ops_start, cursor):
    """The first stream of worker ``w`` with ops left (its only one, if it has one)."""
    first, end = stream_start[w], stream_start[w + 1]
    if end - first != 1:
        for j in range(first, end):
            if cursor[j] < stream_ops_start[j + 1] - stream_ops_start[j]:
                return j
    return first


# The loop's steps below run as calls, not inlined: compiled without the NRT (``_nrt=False``:
# they allocate nothing and keep no array), a call costs no reference counting, where an
# inlined helper (``inline="always"``) pays an NRT incref and decref per array argument and
# made the loop 20-50 % slower.


@njit(cache=True, _nrt=False)
def _wake(x, at, ran, ops_per_step, open_streams, queued, free_at, forced, forced_tail, heap_times, heap_workers,
          slot, heap_size):
    """``wake`` worker ``x`` at ``at`` (its step starts, an input arrives, the norm is in):
    a forced next op (ops left in its step, one open stream at most, no deferred W op)
    joins the FIFO; else ``x`` chooses at ``at``, if it is free by then. Returns the FIFO's
    tail and the heap's size."""
    if ran[x] < ops_per_step[x] and open_streams[x] <= 1 and queued[x] == 0:
        forced[forced_tail] = x
        forced_tail += 1
    elif at >= free_at[x]:
        heap_size = _wake_at(heap_times, heap_workers, slot, heap_size, at, x)
    return forced_tail, heap_size


@njit(cache=True, _nrt=False)
def _start_step(m, k, at, step, ran, settled, stream_start, stream_ops_start, cursor, open_streams, snapshot_s,
                snapshot_end, free_at, snapshot_in_line):
    """``start_step``: worker ``m`` starts step ``k`` at ``at``, its streams rewound."""
    step[m], ran[m], settled[m] = k, 0, False
    count = 0
    for j in range(stream_start[m], stream_start[m + 1]):
        cursor[j] = 0
        if stream_ops_start[j + 1] > stream_ops_start[j]:
            count += 1
    open_streams[m] = count
    snapshot_end[m] = at + snapshot_s[m]
    free_at[m] = snapshot_end[m] if snapshot_in_line else at


@njit(cache=True, _nrt=False)
def _forced_op(w, k, free_at, stream_start, stream_ops_start, stream_ops, cursor, dependency, link_s, end):
    """Worker ``w``'s forced op in step ``k``, the next of its open stream: (the op, its
    stream, when it can start); op -1 while its dependency has not run (timing that wakes ``w``)."""
    s = _open_stream(w, stream_start, stream_ops_start, cursor)
    op = stream_ops[stream_ops_start[s] + cursor[s]]
    start = free_at[w]
    d = dependency[op]
    if d >= 0:
        arrival = end[k, d]
        if arrival < 0.0:
            return -1, s, start
        arrival += link_s[op]
        if arrival > start:
            start = arrival
    return op, s, start


@njit(cache=True, _nrt=False)
def _ready_head(w, k, now, stream_start, stream_ops_start, stream_ops, cursor, dependency, link_s, end):
    """Of worker ``w``'s stream heads in step ``k``, the one ready at ``now`` earliest in 1F1B
    order: (the op, its stream; -1, -1 if none is ready; and the soonest arrival of an input
    on its way, inf if none)."""
    op, s, position, soonest = -1, -1, 0, np.inf
    for j in range(stream_start[w], stream_start[w + 1]):
        p = cursor[j]
        if p == stream_ops_start[j + 1] - stream_ops_start[j] or (op >= 0 and p >= position):
            continue
        i = stream_ops[stream_ops_start[j] + p]
        d = dependency[i]
        if d >= 0:
            arrival = end[k, d]
            if arrival < 0.0:
                continue
            arrival += link_s[i]
            if arrival > now:  # on its way
                if arrival < soonest:
                    soonest = arrival
                continue
        op, s, position = i, j, p
    return op, s, soonest


@njit(cache=True, _nrt=False)
def _take(w, op, s, cursor, stream_ops_start, open_streams, forward, live, defer, ring, ring_start, ring_head,
          queued, ops_per_step, weight_grad):
    """Worker ``w`` takes ``op``: from stream ``s`` (its cursor moves on; a forward holds its
    activations, a deferred backward queues its W op) or, ``s`` -1, from its ring of
    deferred W ops (which frees the activations)."""
    if s < 0:
        ring_head[w] = (ring_head[w] + 1) % (ops_per_step[w] + 1)
        queued[w] -= 1
        live[w] -= 1
        return
    cursor[s] += 1
    if cursor[s] == stream_ops_start[s + 1] - stream_ops_start[s]:
        open_streams[w] -= 1
    if forward[op]:
        live[w] += 1
    elif defer:
        ring[ring_start[w] + (ring_head[w] + queued[w]) % (ops_per_step[w] + 1)] = weight_grad[op]
        queued[w] += 1


@njit(cache=True, _nrt=False)
def _release_groups(w, k, member_start, member_groups, group_start, group_members, group_done, group_end, last_end,
                    step, finish, starting, starting_at, num_starting):
    """Worker ``w`` finished step ``k`` at ``last_end``: count it done in its optimizer groups
    (the DP all-reduce needs the gradients only), and start step ``k + 1`` for each member
    whose groups are all done, once the last of them is (``starting``). Returns how many
    start."""
    for gx in range(member_start[w], member_start[w + 1]):
        g = member_groups[gx]
        group_done[k, g] += 1
        group_end[k, g] = _later(group_end[k, g], last_end)
        if group_done[k, g] < group_start[g + 1] - group_start[g]:
            continue
        for mx in range(group_start[g], group_start[g + 1]):
            m = group_members[mx]
            if step[m] != k:
                continue
            ready, at = True, finish[m]
            for hx in range(member_start[m], member_start[m + 1]):
                h = member_groups[hx]
                if group_done[k, h] != group_start[h + 1] - group_start[h]:
                    ready = False
                    break
                at = _later(at, group_end[k, h])
            if ready:
                step[m] = k + 1  # starting: later members see it has left step k
                starting[num_starting], starting_at[num_starting] = m, at
                num_starting += 1
    return num_starting


@njit(cache=True, _nrt=False)
def _next_choice_known(w, k, speculative, open_streams, stream_start, stream_ops_start, stream_ops, cursor,
                       dependency, end):
    """``head_input_known``: whether worker ``w``'s choice once its op ends is known already
    (its one open stream's head has its input timed), so it makes it at once."""
    if speculative or open_streams[w] != 1:
        return False
    s = _open_stream(w, stream_start, stream_ops_start, cursor)
    d = dependency[stream_ops[stream_ops_start[s] + cursor[s]]]
    return d < 0 or end[k, d] >= 0.0


@njit(cache=True)
def run_wakeup_loop(
    # the graph, per op
    dependency, link_s, consumer, worker_of, forward, settles, weight_grad, pipeline_of, whole_s, split_s,
    num_pipelines,
    # the workers: streams (worker -> its streams -> their op ids), options
    stream_start, stream_ops_start, stream_ops, splits, ops_per_step, room, snapshot_s,
    # optimizer groups: per worker the groups it is in, per group its members
    member_start, member_groups, group_start, group_members,
    playing, defer, iterations, speculative, snapshot_in_line,
):
    """Time every op of ``iterations`` steps. Returns (per worker the step it is in:
    ``iterations`` once done, fewer after a deadlock; per stream its cursor; per step its
    end; per pipeline its first step's end; per worker its first step's compute seconds;
    per worker the offset of its op orders in the next four arrays: the first step's op
    ids in order and how many, the last step's and how many)."""
    num_ops = dependency.shape[0]
    num_workers = splits.shape[0]
    num_groups = group_start.shape[0] - 1
    num_playing = playing.shape[0]
    last_step = iterations - 1

    # per step
    end = np.full((iterations, num_ops), -1.0)
    group_done = np.zeros((iterations, max(num_groups, 1)), np.int64)
    group_end = np.zeros((iterations, max(num_groups, 1)))
    finished = np.zeros(iterations, np.int64)
    norm_at = np.zeros(iterations)
    step_end = np.zeros(iterations)
    held_at = np.empty((iterations, num_workers))  # workers held for the norm, and since when
    held_worker = np.empty((iterations, num_workers), np.int64)
    num_held = np.zeros(iterations, np.int64)
    pipeline_end = np.zeros(num_pipelines)

    # per worker
    step = np.full(num_workers, iterations, np.int64)  # sits out unless it plays
    ran = np.zeros(num_workers, np.int64)
    open_streams = np.zeros(num_workers, np.int64)
    free_at = np.zeros(num_workers)
    live = np.zeros(num_workers, np.int64)
    settled = np.zeros(num_workers, np.bool_)
    held = np.zeros(num_workers, np.bool_)
    snapshot_end = np.zeros(num_workers)
    finish = np.zeros(num_workers)
    busy = np.zeros(num_workers)
    cursor = np.zeros(stream_ops_start.shape[0] - 1, np.int64)
    order_start = np.zeros(num_workers + 1, np.int64)
    ring_start = np.zeros(num_workers + 1, np.int64)  # deferred W ops: a ring of ops_per_step + 1 each
    for w in range(num_workers):
        order_start[w + 1] = order_start[w] + ops_per_step[w]
        ring_start[w + 1] = ring_start[w] + ops_per_step[w] + 1
    first = np.empty(order_start[num_workers], np.int64)
    first_len = np.zeros(num_workers, np.int64)
    last = np.empty(order_start[num_workers], np.int64)
    last_len = np.zeros(num_workers, np.int64)
    ring = np.empty(ring_start[num_workers], np.int64)
    ring_head = np.zeros(num_workers, np.int64)
    queued = np.zeros(num_workers, np.int64)

    entries = num_ops * iterations + 2 * num_workers * iterations + 1
    forced = np.empty(entries, np.int64)  # FIFO of workers whose next op is forced
    forced_head, forced_tail = 0, 0
    heap_times = np.empty(num_workers)  # wakeups of workers with a choice, one per worker at most
    heap_workers = np.empty(num_workers, np.int64)
    slot = np.full(num_workers, -1, np.int64)  # each worker's position in the heap; -1: none
    heap_size = 0

    starting = np.empty(num_workers, np.int64)  # workers starting a step together, and when
    starting_at = np.empty(num_workers)
    num_starting = 0
    for x in range(num_playing):
        starting[num_starting] = playing[x]
        starting_at[num_starting] = 0.0
        num_starting += 1
    k = 0
    while True:
        for x in range(num_starting):
            m = starting[x]
            _start_step(m, k, starting_at[x], step, ran, settled, stream_start, stream_ops_start, cursor, open_streams,
                        snapshot_s, snapshot_end, free_at, snapshot_in_line)
            forced_tail, heap_size = _wake(m, free_at[m], ran, ops_per_step, open_streams, queued, free_at, forced,
                                           forced_tail, heap_times, heap_workers, slot, heap_size)
        num_starting = 0

        if forced_head == forced_tail and heap_size == 0:
            break
        choosing_at = -1.0  # the wakeup's time; -1: a forced worker, no choice to make
        if forced_head < forced_tail:
            w = forced[forced_head]
            forced_head += 1
        else:
            choosing_at, w, heap_size = _heap_pop(heap_times, heap_workers, slot, heap_size)
        k = step[w]
        if k == iterations or ran[w] == ops_per_step[w] or held[w]:
            continue  # done, or waiting for its optimizer groups or for the norm
        while True:  # run its ops while it can run them now
            if open_streams[w] <= 1 and queued[w] == 0:  # forced: the next op of its open stream
                op, s, start = _forced_op(w, k, free_at, stream_start, stream_ops_start, stream_ops, cursor,
                                          dependency, link_s, end)
                if op < 0:
                    break  # timing its dependency wakes it
            else:  # a choice, made at a wakeup
                start = choosing_at
                if start < 0.0:
                    break  # not woken: it waits for its wakeup
                if start < free_at[w]:  # busy: woken by an input that arrived while it runs
                    heap_size = _wake_at(heap_times, heap_workers, slot, heap_size, free_at[w], w)
                    break
                op, s, soonest = _ready_head(w, k, start, stream_start, stream_ops_start, stream_ops, cursor,
                                             dependency, link_s, end)
                if queued[w] > 0 and (op < 0 or (forward[op] and live[w] >= room[w])):
                    op, s = ring[ring_start[w] + ring_head[w]], -1  # idle, or memory full: a deferred W first
                if op < 0:  # idle until an input on its way arrives (or one not yet sent: its wake)
                    if soonest < np.inf:
                        heap_size = _wake_at(heap_times, heap_workers, slot, heap_size, soonest, w)
                    break
            seconds = split_s[op] if splits[w] else whole_s[op]
            if speculative and k > 0 and not settled[w] and settles[op]:
                if finished[k - 1] < num_playing:  # held until the norm is in
                    held[w] = True
                    held_at[k - 1, num_held[k - 1]] = start
                    held_worker[k - 1, num_held[k - 1]] = w
                    num_held[k - 1] += 1
                    break
                settled[w] = True  # a forward computes, then holds its output until the norm is in
                if forward[op]:
                    done = _later(start + seconds, norm_at[k - 1])
                else:
                    done = _later(start, norm_at[k - 1]) + seconds
            else:
                done = start + seconds
            _take(w, op, s, cursor, stream_ops_start, open_streams, forward, live, defer, ring, ring_start, ring_head,
                  queued, ops_per_step, weight_grad)
            end[k, op] = free_at[w] = done
            ran[w] += 1
            if k == 0:
                first[order_start[w] + first_len[w]] = op
                first_len[w] += 1
                busy[w] += seconds
                if done > pipeline_end[pipeline_of[op]]:
                    pipeline_end[pipeline_of[op]] = done
            if k == last_step:
                last[order_start[w] + last_len[w]] = op
                last_len[w] += 1
            c = consumer[op]
            if c >= 0 and worker_of[c] != w:  # wake the worker waiting for its output
                forced_tail, heap_size = _wake(worker_of[c], done + link_s[c], ran, ops_per_step, open_streams,
                                               queued, free_at, forced, forced_tail, heap_times, heap_workers, slot,
                                               heap_size)
            if ran[w] == ops_per_step[w]:  # ``finish_step``: release who waited for it
                last_end = free_at[w]
                finish[w] = _later(last_end, snapshot_end[w])  # the optimizer step waits for the snapshot
                step_end[k] = _later(step_end[k], finish[w])
                finished[k] += 1
                norm_at[k] = _later(norm_at[k], last_end)
                if finished[k] == num_playing:
                    for y in range(num_held[k]):  # they were ready then; only the norm was missing
                        x = held_worker[k, y]
                        held[x] = False
                        forced_tail, heap_size = _wake(x, held_at[k, y], ran, ops_per_step, open_streams, queued,
                                                       free_at, forced, forced_tail, heap_times, heap_workers, slot,
                                                       heap_size)
                if k + 1 == iterations:
                    step[w] = iterations
                    break
                if member_start[w] == member_start[w + 1]:
                    starting[num_starting], starting_at[num_starting] = w, finish[w]
                    num_starting += 1
                num_starting = _release_groups(w, k, member_start, member_groups, group_start, group_members,
                                               group_done, group_end, last_end, step, finish, starting, starting_at,
                                               num_starting)
                k += 1  # the step those start
                break
            if open_streams[w] > 1 or queued[w] > 0:
                if not _next_choice_known(w, k, speculative, open_streams, stream_start, stream_ops_start,
                                          stream_ops, cursor, dependency, end):
                    heap_size = _wake_at(heap_times, heap_workers, slot, heap_size, done, w)  # its next choice waits
                    break
                choosing_at = done  # make it now
    return step, cursor, step_end, pipeline_end, busy, order_start, first, first_len, last, last_len


def warm_up() -> None:
    """Compile the loop, or load it from numba's cache (a fraction of a second), now
    rather than in the first decision: a replay of one forward on one worker, with the
    argument types every replay passes."""
    none, zero, one = np.full(1, -1, np.int64), np.zeros(1, np.int64), np.ones(1, np.int64)
    seconds, flag, nothing = np.ones(1), np.ones(1, np.bool_), np.zeros(0, np.int64)
    bounds = np.array([0, 1], np.int64)
    run_wakeup_loop(none, np.zeros(1), none, zero, flag, ~flag, none, zero, seconds, seconds, 1,
                    bounds, bounds, zero, ~flag, one, np.full(1, np.inf), np.zeros(1),
                    np.zeros(2, np.int64), nothing, zero, nothing, zero, False, 1, False, False)
