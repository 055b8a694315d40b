"""``missed_beat`` tells a store read that timed out (a beat missed: staleness decides)
from a connection that closed (the controller is gone) by the error's type, as a real
TCPStore raises them: a read past its timeout, and a server killed under its clients."""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import signal

import pytest
import torch.distributed as dist

from odyssey_megatron.runtime.protocol.liveness import missed_beat

pytestmark = pytest.mark.timeout(60)


def _host(ports: mp.Queue) -> None:
    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False)
    ports.put(store.port)
    signal.pause()


def _raised(call) -> BaseException:
    try:
        call()
    except BaseException as exc:  # noqa: BLE001 - what the store raised is the subject
        return exc
    raise AssertionError("the store call returned")


def test_a_read_past_its_timeout_is_a_missed_beat_and_a_killed_store_server_is_not():
    ctx = mp.get_context("spawn")
    ports = ctx.Queue()
    server = ctx.Process(target=_host, args=(ports,))
    server.start()
    try:
        port = ports.get(timeout=30)
        store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=0.3))
        late = _raised(lambda: store.get("never-written"))
        assert missed_beat(late), repr(late)
        assert missed_beat(_raised(lambda: store.wait(["never-written"], datetime.timedelta(seconds=0.2))))
        waiting = store.clone()
        os.kill(server.pid, signal.SIGKILL)
        server.join()
        for gone in (_raised(lambda: store.get("never-written")), _raised(lambda: waiting.wait(["never-written"])),
                     _raised(lambda: store.add("n", 1)),
                     _raised(lambda: dist.TCPStore("127.0.0.1", port, is_master=False,
                                                   timeout=datetime.timedelta(seconds=0.3)))):
            assert not missed_beat(gone), repr(gone)
    finally:
        server.kill()
        server.join()


def test_a_store_timeout_is_a_missed_beat_whatever_its_words():
    assert missed_beat(dist.DistStoreError("wait for ['key'] gave up after 300ms"))
    assert not missed_beat(dist.DistNetworkError("Failed to recv, got 0 bytes: the store's timeout"))
    assert not missed_beat(RuntimeError("timeout"))
