"""The collective guard: a survivor leaves a collective whose peer froze (SIGSTOP: no
socket closes, as with a frozen node on a cluster) as soon as the generation is aborted,
with ``PeerLost``, and can enter a new world while the abandoned operation still runs."""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import signal
import threading
import time

import pytest
import torch
import torch.distributed as dist

from spawned_ranks import run_three_ranks

from odyssey_megatron.hooks import collective_guard
from odyssey_megatron.hooks.collective_guard import CollectiveGuard, PeerLost, is_peer_loss, prepare_backend

pytestmark = pytest.mark.timeout(120)

GROUP_TIMEOUT_S = 20.0
ABORT_AFTER_S = 1.0


def _survivor_or_frozen(rank: int, port: int, mode: str, results: mp.Queue) -> None:
    """Three ranks all-reduce once; rank 2 then freezes and the others all-reduce again,
    guarded. ``mode``: abort (another thread aborts after ABORT_AFTER_S), timeout (the
    guard's own timeout of 1 s ends the wait) or recv (as abort, but rank 0 waits on a
    receive from rank 2 through ``batch_isend_irecv``, as Megatron's schedule does, and
    rank 1 on a plain ``recv``; the guard's process backend is NCCL, as where the gloo
    groups are the snapshots' beside NCCL training: a wait on a gloo group is sliced
    whatever the process's backend). In abort mode, once the survivors formed their new
    world, rank 0 kills the frozen rank, which ends the abandoned operation: the seconds
    until the guard let the old groups go (None: not within 5 s)."""
    try:
        store = dist.TCPStore("127.0.0.1", port, 3, is_master=False, timeout=datetime.timedelta(seconds=60))
        dist.init_process_group("gloo", rank=rank, world_size=3, store=dist.PrefixStore("gen0", store),
                                timeout=datetime.timedelta(seconds=GROUP_TIMEOUT_S))
        group = dist.new_group([0, 1, 2], timeout=datetime.timedelta(seconds=GROUP_TIMEOUT_S))
        guard = CollectiveGuard(backend="nccl" if mode == "recv" else "gloo",
                                timeout_s=1.0 if mode == "timeout" else GROUP_TIMEOUT_S)
        guard.install()
        guard.track([group, dist.distributed_c10d._get_default_group()])
        tensor = torch.ones(4)
        dist.all_reduce(tensor, group=group)
        store.set(f"pid {rank}", str(os.getpid()))
        if rank == 2:
            os.kill(os.getpid(), signal.SIGSTOP)
            return
        if mode in ("abort", "recv"):
            threading.Timer(ABORT_AFTER_S, guard.abort, args=("test",)).start()
        started = time.monotonic()
        try:
            if mode != "recv":
                dist.all_reduce(tensor, group=group)
            elif rank == 0:
                for work in dist.batch_isend_irecv([dist.P2POp(dist.irecv, tensor, 2)]):
                    work.wait()
            else:
                dist.recv(tensor, 2)
            results.put((rank, "error", "the all-reduce with a frozen peer returned"))
            return
        except PeerLost as exc:
            waited, timed_out = time.monotonic() - started, exc.timed_out
        # Leave: destroy and drop everything; the guard keeps the groups, so nothing blocks.
        guard.abandon()
        left = time.monotonic()
        dist.destroy_process_group(group)
        dist.destroy_process_group()
        del group
        import gc

        gc.collect()
        guard.done_leaving()
        leave_s = time.monotonic() - left
        guard.reopen()
        dist.init_process_group("gloo", rank=rank, world_size=2, store=dist.PrefixStore("gen1", store),
                                timeout=datetime.timedelta(seconds=GROUP_TIMEOUT_S))
        tensor = torch.ones(4)
        dist.all_reduce(tensor)
        kept = guard.kept
        freed_s = None
        if mode == "abort":
            if rank == 0:
                os.kill(int(store.get("pid 2")), signal.SIGKILL)
            killed = time.monotonic()
            while guard.kept and time.monotonic() - killed < 5.0:
                time.sleep(0.01)
            freed_s = None if guard.kept else time.monotonic() - killed
        results.put((rank, "ok", (waited, timed_out, leave_s, float(tensor[0]), kept, freed_s)))
    except BaseException as exc:  # noqa: BLE001
        results.put((rank, "error", repr(exc)))


def _run(mode: str) -> dict[int, tuple]:
    return run_three_ranks(_survivor_or_frozen, mode, answers=2)  # the survivors answer


def test_an_abort_ends_a_collective_whose_peer_froze_and_the_survivors_form_a_new_world():
    got = _run("abort")
    for rank in (0, 1):
        waited, timed_out, leave_s, reduced, kept, freed_s = got[rank]
        assert ABORT_AFTER_S <= waited < ABORT_AFTER_S + 0.5, waited  # not the group's 20 s
        assert not timed_out
        assert leave_s < 1.0  # dropping the groups did not wait for the abandoned operation
        assert reduced == 2.0 and kept > 0  # the new world of two works; the old groups are still held
        # ... until the abandoned operation ends (the frozen peer killed: its sockets close), not
        # for a fixed linger of seven group timeouts (211 s at a 30 s collective timeout).
        assert freed_s is not None and freed_s < 2.0, freed_s


def test_an_abort_ends_a_receive_from_a_frozen_peer_on_a_gloo_group_also_in_an_nccl_process():
    got = _run("recv")
    for rank in (0, 1):
        waited, timed_out, _, reduced, _, _ = got[rank]
        assert ABORT_AFTER_S <= waited < ABORT_AFTER_S + 0.5 and not timed_out and reduced == 2.0


def test_a_collective_that_outlasts_the_timeout_raises_peer_lost_marked_timed_out():
    got = _run("timeout")
    for rank in (0, 1):
        waited, timed_out, _, reduced, _, _ = got[rank]
        assert 1.0 <= waited < 2.0 and timed_out and reduced == 2.0


def test_gloo_transport_errors_and_dist_errors_are_peer_loss_and_others_are_not():
    assert is_peer_loss(RuntimeError("[../gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:1"))
    assert is_peer_loss(RuntimeError("[../gloo/transport/tcp/pair.cc:589] Write error: Broken pipe"))
    assert is_peer_loss(RuntimeError("[gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 20000ms for recv"))
    assert is_peer_loss(RuntimeError("[gloo/transport/tcp/pair.h:311] Connect timeout [none]"))
    refused = RuntimeError("[gloo/transport/tcp/pair.cc:152] timed out connecting: SO_ERROR: Connection refused, "
                           "remote=[127.0.0.1]:37795$0")
    assert is_peer_loss(refused)
    assert is_peer_loss(dist.DistNetworkError("store gone"))
    assert is_peer_loss(PeerLost("x"))
    assert not is_peer_loss(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))
    assert not is_peer_loss(ValueError("Connection closed by peer"))


def _lost_or_frozen(rank: int, port: int, case: str, results: mp.Queue) -> None:
    """What ends a guarded operation, as gloo raises it for real: (type of the error the
    ``PeerLost`` came from, its first line, timed out, seconds since the operation began).
    Groups [0, 2] and [1, 2]; rank 2 dies or freezes. ``killed``: rank 0 waits in an
    all-reduce of [0, 2] that rank 2 never joins, rank 1 all-reduces 32 MB after 32 MB
    with it in [1, 2]; rank 0 stops rank 2 (data to it piles up unread) and kills it.
    ``frozen`` (every timeout 1 s): rank 2 freezes; rank 0 all-reduces in [0, 2], rank 1
    in a group with it made since, so never connected (rank 2 never publishes its address
    there); each starts the operation 0.5 s before waiting on it, so that gloo's own
    timeout, or the store's, ends it before the guard's clock does. ``frozen unsliced``: as
    frozen, the guard waiting as it does on NCCL (a plain ``wait``, no slices)."""
    try:
        prepare_backend("gloo")
        timeout = GROUP_TIMEOUT_S if case == "killed" else 1.0
        store = dist.TCPStore("127.0.0.1", port, 3, is_master=False, timeout=datetime.timedelta(seconds=60))
        dist.init_process_group("gloo", rank=rank, world_size=3, store=dist.PrefixStore("gen0", store),
                                timeout=datetime.timedelta(seconds=timeout))
        guard = CollectiveGuard(backend="nccl" if case.endswith("unsliced") else "gloo", timeout_s=timeout)
        case = case.removesuffix(" unsliced")
        guard.install()
        with_0, with_1 = (dist.new_group(members, timeout=datetime.timedelta(seconds=timeout))
                          for members in ([0, 2], [1, 2]))
        guard.track([dist.distributed_c10d._get_default_group(), *([with_0] if rank != 1 else []),
                     *([with_1] if rank != 0 else [])])
        store.set(f"pid {rank}", str(os.getpid()))
        dist.all_reduce(torch.ones(1))
        large = torch.ones(1 << 23)
        if rank == 2:
            if case == "frozen":
                os.kill(os.getpid(), signal.SIGSTOP)
            while True:
                dist.all_reduce(large, group=with_1)
        if case == "frozen":
            time.sleep(0.3)  # rank 2 is frozen by now
            unconnected = dist.new_group([1, 2], timeout=datetime.timedelta(seconds=timeout))
        elif rank == 0:
            peer = int(store.get("pid 2"))
            threading.Timer(1.0, os.kill, args=(peer, signal.SIGSTOP)).start()
            threading.Timer(1.5, os.kill, args=(peer, signal.SIGKILL)).start()
        began = time.monotonic()
        try:
            if case == "frozen":
                work = dist.all_reduce(torch.ones(1), group=with_0 if rank == 0 else unconnected, async_op=True)
                time.sleep(0.5)
                work.wait()
            elif rank == 0:
                dist.all_reduce(torch.ones(1), group=with_0)
            else:
                while True:
                    dist.all_reduce(large, group=with_1)
            results.put((rank, "error", "the operation with a lost peer returned"))
        except PeerLost as exc:
            cause = exc.__cause__
            results.put((rank, "ok", (type(cause).__name__, str(cause).splitlines()[0] if cause else "",
                                      exc.timed_out, time.monotonic() - began)))
    except BaseException as exc:  # noqa: BLE001
        results.put((rank, "error", repr(exc)))
    results.close()
    results.join_thread()
    os._exit(0)  # the guard's helper threads may still be inside abandoned operations


def test_a_peer_killed_mid_collective_is_lost_by_what_gloo_says_of_a_closed_or_reset_connection():
    """Pins the texts that alone classify gloo's untyped errors: a torch whose gloo words
    them otherwise fails here, instead of its survivors leaving with an error of their own."""
    got = run_three_ranks(_lost_or_frozen, "killed", answers=2)
    (closed_type, closed, closed_timed_out, closed_s), (reset_type, reset, reset_timed_out, reset_s) = got[0], got[1]
    assert closed_type == reset_type == "RuntimeError"  # no type of its own: the text is all there is
    assert "Connection closed by peer" in closed, closed  # rank 2's pair with rank 0 had nothing in flight
    # 32 MB unread in its socket: the kernel resets the connection, unless the killed rank's
    # socket had been drained by then (CI saw a close there once): either text is pinned.
    assert ("Read error" in reset and "Connection reset by peer" in reset) or "Connection closed by peer" in reset, reset
    assert not closed_timed_out and not reset_timed_out  # a lost peer is no stall to report
    assert closed_s < GROUP_TIMEOUT_S / 2 and reset_s < GROUP_TIMEOUT_S / 2


def test_an_operation_that_ran_the_collective_timeout_is_timed_out_whatever_its_error_says():
    """By the guard's clock, from the operation's start: gloo's own timeout (its text says
    "Timed out", a pinned mark) and the store's wait for a peer's address that never comes
    (a typed ``DistStoreError`` saying "wait timeout", which the text rule took for a lost peer)."""
    got = run_three_ranks(_lost_or_frozen, "frozen", answers=2)
    gloo_type, gloo_says, gloo_timed_out, gloo_s = got[0]
    store_type, store_says, store_timed_out, store_s = got[1]
    assert gloo_type == "RuntimeError" and "Timed out waiting" in gloo_says, gloo_says
    assert store_type == "DistStoreError" and "imed out" not in store_says, store_says
    assert gloo_timed_out and store_timed_out
    assert 1.0 <= gloo_s < 1.4 and 1.0 <= store_s < 1.4  # their own timeouts ended them, not the guard's clock


def test_a_timeout_is_judged_on_the_guards_clock_where_waits_are_not_sliced_as_on_nccl():
    """An NCCL rank's wait is a plain one that the backend's own timeout ends: the guard
    marks it timed out by its clock (a stall to report) as it does gloo's sliced waits."""
    got = run_three_ranks(_lost_or_frozen, "frozen unsliced", answers=2)
    assert all(timed_out and 1.0 <= waited < 1.4 for _, _, timed_out, waited in got.values()), got


class _RecordingGroup:
    """Stands in for a ProcessGroupNCCL: records that it was aborted (no GPU here)."""

    def __init__(self):
        self.aborted = 0

    def abort(self):
        self.aborted += 1

    def size(self):
        return 1  # no pair to connect


def test_on_nccl_an_abort_aborts_every_tracked_group_also_those_made_after_it(monkeypatch):
    monkeypatch.setattr(collective_guard, "_backend_of", lambda group: "nccl")  # torch knows no stand-in's backend
    guard = CollectiveGuard(backend="nccl", timeout_s=5)
    guard.reopen(3)
    first, second = _RecordingGroup(), _RecordingGroup()
    guard.track([first])
    guard.abort("node 2 lost")
    guard.abort("again")  # once only
    assert first.aborted == 1
    guard.track([second])  # made while the generation was already aborted
    assert second.aborted == 1
    with pytest.raises(PeerLost, match="node 2 lost"):
        guard.check()
    guard.abandon()
    guard.reopen(4)
    guard.check()  # the next generation starts clean


def test_an_abort_that_arrives_for_a_generation_the_worker_left_is_ignored():
    """The heartbeat thread may see generation 3's abort key after the worker left it (a
    closed socket ended it first) and entered generation 4: that must not abort 4."""
    guard = CollectiveGuard(backend="gloo", timeout_s=5)
    guard.reopen(4)
    guard.abort("the controller ended generation 3", generation=3)
    assert not guard.aborted
    guard.abort("the controller ended generation 4", generation=4)
    assert guard.aborted


def test_the_nccl_watchdog_is_told_to_clean_up_instead_of_tearing_the_process_down(monkeypatch):
    monkeypatch.delenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", raising=False)
    monkeypatch.delenv("TORCH_GLOO_LAZY_INIT", raising=False)
    prepare_backend("nccl")
    assert os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "2"
    monkeypatch.delenv("TORCH_NCCL_ASYNC_ERROR_HANDLING")
    prepare_backend("gloo")
    assert "TORCH_NCCL_ASYNC_ERROR_HANDLING" not in os.environ


def test_gloo_groups_connect_at_their_first_operation_whatever_the_backend(monkeypatch):
    """The snapshots' parity groups are gloo groups beside NCCL training too."""
    for backend in ("gloo", "nccl"):
        monkeypatch.delenv("TORCH_GLOO_LAZY_INIT", raising=False)
        prepare_backend(backend)
        assert os.environ["TORCH_GLOO_LAZY_INIT"] == "1"


class _FailingAbort(_RecordingGroup):
    """A communicator whose abort fails (as HCCL's may, its watchdog having torn it down)."""

    group_name = "7"

    def abort(self):
        super().abort()
        raise RuntimeError("HCCL function error: HcclCommDestroy, error code is 4\nmore detail")


def test_every_failed_abort_is_logged_and_named_in_the_error_that_ends_the_generation(monkeypatch, caplog):
    monkeypatch.setattr(collective_guard, "_backend_of", lambda group: "hccl")
    guard = CollectiveGuard(backend="hccl", timeout_s=5)
    guard.reopen(2)
    failing, other = _FailingAbort(), _RecordingGroup()
    guard.track([failing, other])
    with caplog.at_level("WARNING", logger=collective_guard.__name__):
        guard.abort("node 1 lost")
    assert failing.aborted == other.aborted == 1  # one failure does not stop the others' aborts
    assert guard.abort_errors == ["aborting process group 7 failed: RuntimeError: HCCL function error: "
                                  "HcclCommDestroy, error code is 4"]
    assert guard.abort_errors[0] in caplog.text
    with pytest.raises(PeerLost, match="node 1 lost.*HcclCommDestroy"):
        guard.check()
    guard.reopen(3)
    assert guard.abort_errors == []


def test_a_generation_left_with_nothing_in_flight_holds_none_of_its_groups():
    """Its groups go at once: nothing of a replaced generation outlives it (the guard held
    every left generation for seven collective timeouts)."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=GROUP_TIMEOUT_S))
    try:
        guard = CollectiveGuard(backend="gloo", timeout_s=GROUP_TIMEOUT_S)
        guard.install()
        group = dist.new_group([0])
        guard.track([dist.distributed_c10d._get_default_group(), group])
        dist.all_reduce(torch.ones(2), group=group)
        dist.all_reduce(torch.ones(2), group=group, async_op=True)  # never waited on: ended by now
        guard.abandon()
        del group
        guard.done_leaving()
        deadline = time.monotonic() + 2.0
        while guard.kept and time.monotonic() < deadline:  # the never-waited work's helper returns
            time.sleep(0.01)
        assert guard.kept == 0
    finally:
        guard.uninstall()
        dist.destroy_process_group()


def test_nccl_communicators_start_without_blocking_and_wait_no_longer_than_a_collective(monkeypatch):
    for name in ("TORCH_NCCL_USE_COMM_NONBLOCKING", "TORCH_NCCL_NONBLOCKING_TIMEOUT"):
        monkeypatch.delenv(name, raising=False)
    prepare_backend("nccl", timeout_s=30.0)
    assert os.environ["TORCH_NCCL_USE_COMM_NONBLOCKING"] == "1"
    assert os.environ["TORCH_NCCL_NONBLOCKING_TIMEOUT"] == "30"  # not NCCL's 30 minutes
    monkeypatch.delenv("TORCH_NCCL_USE_COMM_NONBLOCKING")
    prepare_backend("gloo", timeout_s=30.0)
    assert "TORCH_NCCL_USE_COMM_NONBLOCKING" not in os.environ


class _DroppedGroup:
    """Stands in for a gloo group: records the thread that drops its last reference."""

    def __init__(self, dropped_on: list):
        self.dropped_on = dropped_on

    def size(self) -> int:
        return 1

    def __del__(self):
        self.dropped_on.append(threading.current_thread().name)


def test_a_left_generation_s_groups_are_dropped_by_the_reaper_once_the_leaving_thread_let_go(monkeypatch):
    """Gloo's destructor can block (joining its tcp loop thread: a worker hung in
    ``gc.collect`` past the recovery timeout): the training thread never drops a left
    group's last reference, even with no operation in flight; the reaper does, and only
    after ``done_leaving``."""
    monkeypatch.setattr(collective_guard, "_backend_of", lambda group: "gloo")
    guard = CollectiveGuard(backend="gloo", timeout_s=5)
    guard.reopen(1)
    dropped_on: list[str] = []
    group = _DroppedGroup(dropped_on)
    guard.track([group])
    guard.abandon()
    del group
    import gc

    gc.collect()
    time.sleep(0.1)
    assert dropped_on == [] and guard.kept == 1  # held while the leaving thread may still drop references
    guard.done_leaving()
    deadline = time.monotonic() + 2.0
    while guard.kept and time.monotonic() < deadline:
        time.sleep(0.01)
    assert guard.kept == 0 and dropped_on == ["odyssey-reaper"]
