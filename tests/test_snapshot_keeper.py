"""The node's snapshot memory (``snapshot.keeper``): tensors packed into a payload and back,
and buffers that other processes open by path, that outlive a writer killed by SIGKILL (a
snapshot sealed before stays readable, one begun and not sealed reads as none), and that
leave nothing on the machine once the keeper and every process holding them are killed.
Workers are emulated by ``python -c`` children that inherit no fd, as the fork server's
workers do not."""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import signal
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path
from typing import Iterator

import pytest
import torch

from odyssey_megatron.snapshot.keeper import (
    ALIGNMENT,
    HEADER_BYTES,
    KeeperBuffer,
    NodeKeeper,
    PayloadEntry,
    pack,
    payload_layout,
    unpack,
)

REPO = Path(__file__).resolve().parents[1]


def snapshot(step: int) -> dict[str, torch.Tensor]:
    """A worker's shard at ``step``: fp32 weights and Adam moments, and the int64 step."""
    weights = torch.arange(24, dtype=torch.float32).reshape(6, 4) / 8 + step
    return {"param/w": weights, "exp_avg/w": weights / 10, "exp_avg_sq/w": weights * weights,
            "step": torch.tensor(step, dtype=torch.int64)}


def layout(tensors: dict[str, torch.Tensor]) -> tuple[list[PayloadEntry], int]:
    return payload_layout([(key, tensor.dtype, tuple(tensor.shape)) for key, tensor in tensors.items()])


def write(buffer: KeeperBuffer, step: int) -> None:
    tensors = snapshot(step)
    entries, nbytes = layout(tensors)
    pack(tensors, entries, buffer.begin(nbytes))
    buffer.seal({"step": step, "generation": 3})


def assert_holds(buffer: KeeperBuffer, step: int) -> None:
    read = buffer.read()
    assert read is not None
    meta, payload = read
    assert meta == {"step": step, "generation": 3}
    expected = snapshot(step)
    unpacked = unpack(payload, layout(expected)[0])
    assert unpacked.keys() == expected.keys()
    assert all(torch.equal(unpacked[key], expected[key]) for key in expected)


@contextlib.contextmanager
def child(code: str, **popen) -> Iterator[subprocess.Popen]:
    """A ``python -c`` child that inherits no fd (the test module importable), SIGKILLed on the way out."""
    prelude = f"import sys; sys.path.insert(0, {str(REPO / 'tests')!r})\n"
    proc = subprocess.Popen([sys.executable, "-c", prelude + textwrap.dedent(code)], cwd=REPO, close_fds=True,
                            env={**os.environ, "PYTHONPATH": str(REPO)}, stdout=subprocess.PIPE, text=True, **popen)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        proc.stdout.close()


def kill(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGKILL)
    assert proc.wait() == -signal.SIGKILL


def holders(name: str) -> set[int]:
    """The processes that hold one of the memfds named ``name-...`` by an fd or a mapping."""
    found = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError):
            links = [os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")]
            if any(f"/memfd:{name}-" in text for text in [*links, Path(f"/proc/{pid}/maps").read_text()]):
                found.add(int(pid))
    return found


def mappings(path: str) -> int:
    """How many maps of the buffer at ``path`` this process holds."""
    return Path("/proc/self/maps").read_text().count(os.readlink(path).removesuffix(" (deleted)") + " ")


@pytest.fixture
def keeper() -> Iterator[NodeKeeper]:
    keeper = NodeKeeper(2, name=f"odyssey-test-{uuid.uuid4().hex[:12]}")
    yield keeper
    keeper.close()


# -- packing ----------------------------------------------------------------------------


def test_tensors_packed_into_a_payload_unpack_equal_views_scalars_and_empty_ones_included():
    tensors = {"param/w": torch.randn(7, 5).t(), "exp_avg/b": torch.randn(3), "step": torch.tensor(12),
               "empty": torch.empty(0, 4), "exp_avg_sq/w": torch.rand(5, 7)[:, ::2]}
    assert not tensors["param/w"].is_contiguous() and not tensors["exp_avg_sq/w"].is_contiguous()
    entries, nbytes = layout(tensors)
    out = torch.full((nbytes,), 0xAB, dtype=torch.uint8)
    pack(tensors, entries, out)
    copies, views = unpack(out, entries), unpack(out, entries, copy=False)
    for key, tensor in tensors.items():
        assert copies[key].dtype == tensor.dtype and copies[key].shape == tensor.shape
        assert torch.equal(copies[key], tensor) and torch.equal(views[key], tensor)
    out.zero_()
    assert torch.equal(copies["param/w"], tensors["param/w"]) and copies["step"].item() == 12
    assert views["param/w"].abs().sum() == 0 and views["step"].item() == 0


def test_the_layout_is_in_order_aligned_non_overlapping_and_the_same_in_every_process():
    spec = [("a", torch.float32, (5,)), ("b", torch.int8, (3,)), ("empty", torch.float32, (0, 4)),
            ("step", torch.int64, ()), ("c", torch.float32, (2, 3))]
    entries, nbytes = payload_layout(spec)
    assert [(e.key, e.dtype, e.shape) for e in entries] == spec
    assert [(e.offset, e.nbytes) for e in entries] == [(0, 20), (64, 3), (128, 0), (128, 8), (192, 24)]
    assert nbytes == 216
    assert all(e.offset % ALIGNMENT == 0 for e in entries)
    assert all(a.offset + a.nbytes <= b.offset for a, b in zip(entries, entries[1:]))
    assert payload_layout(list(spec)) == (entries, nbytes)


def test_packing_refuses_a_tensor_unlike_its_entry_a_missing_one_and_a_key_placed_twice():
    entries, nbytes = payload_layout([("w", torch.float32, (2, 3))])
    out = torch.empty(nbytes, dtype=torch.uint8)
    with pytest.raises(ValueError, match="'w' is torch.float32 \\(3, 2\\)"):
        pack({"w": torch.zeros(3, 2)}, entries, out)
    with pytest.raises(ValueError, match="not the layout's"):
        pack({"v": torch.zeros(2, 3)}, entries, out)
    with pytest.raises(ValueError, match="at least 24 bytes"):
        pack({"w": torch.zeros(2, 3)}, entries, out[:20])
    with pytest.raises(ValueError, match="placed twice"):
        payload_layout([("w", torch.float32, (1,)), ("w", torch.float32, (1,))])


# -- buffers in one process ---------------------------------------------------------------


def test_the_keeper_hands_out_four_distinct_picklable_paths_per_slot_that_go_with_it():
    keeper = NodeKeeper(2, name="odyssey-test-paths")
    paths = keeper.paths
    assert pickle.loads(pickle.dumps(paths)) == paths
    flat = [path for slot in paths for path in (*slot.data, *slot.parity)]
    assert len(set(flat)) == 8 and all(path.startswith(f"/proc/{os.getpid()}/fd/") for path in flat)
    KeeperBuffer(flat[0]).close()
    keeper.close()
    keeper.close()
    with pytest.raises(FileNotFoundError):
        KeeperBuffer(flat[0])


def test_a_buffer_reads_none_until_sealed_and_again_once_begun(keeper):
    buffer = KeeperBuffer(keeper.paths[0].data[0])
    assert buffer.read() is None
    with pytest.raises(RuntimeError, match="begin"):
        buffer.seal({})
    write(buffer, 5)
    assert_holds(buffer, 5)
    buffer.begin(layout(snapshot(5))[1])
    assert buffer.read() is None
    buffer.seal({"again": True})
    assert buffer.read()[0] == {"again": True}
    buffer.begin(0)
    buffer.seal({})
    meta, payload = buffer.read()
    assert meta == {} and payload.numel() == 0
    buffer.close()


def test_a_meta_too_big_for_the_header_is_refused_naming_the_limit_and_a_corrupt_header_reads_as_none(keeper):
    path = keeper.paths[0].data[0]
    buffer = KeeperBuffer(path)
    buffer.begin(16)
    with pytest.raises(ValueError, match=f"at most {HEADER_BYTES - 16} \\(HEADER_BYTES={HEADER_BYTES}"):
        buffer.seal({"blob": "x" * HEADER_BYTES})
    assert buffer.read() is None
    write(buffer, 1)
    assert_holds(buffer, 1)
    fd = os.open(path, os.O_RDWR)
    at = os.pread(fd, HEADER_BYTES, 0).index(b'"step": 1') + len(b'"step": ')
    os.pwrite(fd, b"2", at)
    os.close(fd)
    assert buffer.read() is None
    buffer.close()


def test_a_payload_changed_after_its_seal_reads_as_none_though_its_header_is_intact(keeper):
    """The header's CRC covers the payload too: one flipped byte anywhere in it (here in the
    middle of a weight, and in the padding between two tensors) and ``read`` finds no
    snapshot, as for a torn or corrupt header; ``sealed_meta`` reads the header alone."""
    path = keeper.paths[0].data[1]
    buffer = KeeperBuffer(path)
    entries, nbytes = layout(snapshot(4))
    padding = next(entry.offset + entry.nbytes for entry in entries if (entry.offset + entry.nbytes) % ALIGNMENT)
    for at in (entries[0].offset + entries[0].nbytes // 2, padding):
        write(buffer, 4)
        assert_holds(buffer, 4)
        fd = os.open(path, os.O_RDWR)
        byte = os.pread(fd, 1, HEADER_BYTES + at)
        os.pwrite(fd, bytes([byte[0] ^ 0x10]), HEADER_BYTES + at)
        os.close(fd)
        assert buffer.read() is None, f"a byte flipped at {at} of {nbytes}"
        assert buffer.sealed_meta() == {"step": 4, "generation": 3}
    buffer.begin(0)
    assert buffer.sealed_meta() is None
    buffer.close()


def test_begin_grows_and_shrinks_the_buffer_but_never_under_a_view_still_held(keeper):
    path = keeper.paths[1].parity[0]
    buffer = KeeperBuffer(path)
    buffer.begin(100).fill_(1)
    buffer.seal({"size": 100})
    big = buffer.begin(1 << 20)
    big.fill_(2)
    buffer.seal({"size": 1 << 20})
    assert os.stat(path).st_size == HEADER_BYTES + (1 << 20)
    meta, payload = buffer.read()
    assert meta == {"size": 1 << 20} and torch.equal(payload, big)
    small = buffer.begin(10)
    assert os.stat(path).st_size == HEADER_BYTES + (1 << 20)  # `big` still maps it: shrinking would SIGBUS
    assert big[-1].item() == 2 and mappings(path) == 2
    small.fill_(3)
    buffer.seal({"size": 10})
    del big, payload
    assert mappings(path) == 1
    meta, payload = buffer.read()
    assert meta == {"size": 10} and payload.tolist() == [3] * 10
    assert buffer.begin(10) is not None and os.stat(path).st_size == HEADER_BYTES + 10
    buffer.close()
    assert payload.tolist() == [3] * 10 and mappings(path) == 1  # a view outlives its buffer
    del payload, small
    assert mappings(path) == 0


# -- buffers across processes -------------------------------------------------------------


@pytest.mark.timeout(60)
def test_a_sealed_buffer_reads_back_equal_in_a_process_that_did_not_inherit_its_fd(keeper):
    path = keeper.paths[0].data[1]
    buffer = KeeperBuffer(path)
    write(buffer, 7)
    fds = [int(p.rsplit("/", 1)[1]) for slot in keeper.paths for p in (*slot.data, *slot.parity)]
    reader = f"""
        import json, os
        from test_snapshot_keeper import layout, snapshot
        from odyssey_megatron.snapshot.keeper import KeeperBuffer, unpack
        inherited = []
        for fd in {fds!r}:
            try:
                inherited.append(os.readlink(f"/proc/self/fd/{{fd}}"))
            except FileNotFoundError:
                pass
        meta, payload = KeeperBuffer({path!r}).read()
        tensors = unpack(payload, layout(snapshot(0))[0])
        print(json.dumps({{"inherited": inherited, "meta": meta,
                           "tensors": {{key: tensor.tolist() for key, tensor in tensors.items()}}}}))
    """
    with child(reader) as proc:
        out, _ = proc.communicate()
    assert proc.returncode == 0
    got = json.loads(out)
    assert not [link for link in got["inherited"] if "memfd:" in link]
    assert got["meta"] == {"step": 7, "generation": 3}
    expected = snapshot(7)
    assert got["tensors"] == {key: tensor.tolist() for key, tensor in expected.items()}
    buffer.close()


@pytest.mark.timeout(60)
def test_a_snapshot_sealed_before_its_writer_is_killed_stays_readable_while_the_keeper_lives(keeper):
    path = keeper.paths[1].data[0]
    writer = f"""
        import time
        from test_snapshot_keeper import write
        from odyssey_megatron.snapshot.keeper import KeeperBuffer
        write(KeeperBuffer({path!r}), 11)
        print("sealed", flush=True)
        time.sleep(60)
    """
    with child(writer) as proc:
        assert proc.stdout.readline() == "sealed\n"
        kill(proc)
    buffer = KeeperBuffer(path)
    assert_holds(buffer, 11)
    buffer.close()


@pytest.mark.timeout(60)
def test_a_writer_killed_mid_write_leaves_no_torn_snapshot_and_its_other_buffer_intact(keeper):
    first, second = keeper.paths[0].data
    writer = f"""
        import time, torch
        from test_snapshot_keeper import layout, snapshot, write
        from odyssey_megatron.snapshot.keeper import KeeperBuffer, pack
        first, second = KeeperBuffer({first!r}), KeeperBuffer({second!r})
        write(second, 1)
        write(first, 2)
        entries, nbytes = layout(snapshot(3))
        whole = torch.zeros(nbytes, dtype=torch.uint8)
        pack(snapshot(3), entries, whole)
        second.begin(nbytes)[:nbytes // 2].copy_(whole[:nbytes // 2])
        print("half", flush=True)
        time.sleep(60)
    """
    with child(writer) as proc:
        assert proc.stdout.readline() == "half\n"
        kill(proc)
    entries, nbytes = layout(snapshot(3))
    whole = torch.zeros(nbytes, dtype=torch.uint8)
    pack(snapshot(3), entries, whole)
    fd = os.open(second, os.O_RDONLY)
    written = os.pread(fd, nbytes, HEADER_BYTES)
    os.close(fd)
    assert written[:nbytes // 2] == whole[:nbytes // 2].numpy().tobytes()  # the torn payload is there
    assert written[nbytes // 2:] != whole[nbytes // 2:].numpy().tobytes()
    torn, intact = KeeperBuffer(second), KeeperBuffer(first)
    assert torn.read() is None
    assert_holds(intact, 2)
    torn.close()
    intact.close()


@pytest.mark.timeout(60)
def test_killing_the_keeper_with_every_process_holding_its_buffers_leaves_no_memory_behind():
    name = f"odyssey-test-{uuid.uuid4().hex[:12]}"
    launcher = f"""
        import dataclasses, json, time
        from odyssey_megatron.snapshot.keeper import NodeKeeper
        print(json.dumps(dataclasses.asdict(NodeKeeper(1, name={name!r}).paths[0])), flush=True)
        time.sleep(60)
    """
    with child(launcher, process_group=0) as node:
        paths = json.loads(node.stdout.readline())
        worker = f"""
            import time
            from test_snapshot_keeper import write
            from odyssey_megatron.snapshot.keeper import KeeperBuffer
            buffer = KeeperBuffer({paths["data"][0]!r})
            write(buffer, 4)
            view = buffer.read()
            print("sealed", flush=True)
            time.sleep(60)
        """
        with child(worker, process_group=node.pid) as proc:
            assert proc.stdout.readline() == "sealed\n"
            assert holders(name) == {node.pid, proc.pid}
            os.killpg(node.pid, signal.SIGKILL)
            assert proc.wait() == -signal.SIGKILL
        assert node.wait() == -signal.SIGKILL
    assert holders(name) == set()
    with pytest.raises(FileNotFoundError):
        KeeperBuffer(paths["data"][0])

