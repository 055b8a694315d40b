"""The store server's listening socket has one owner: the TCPStore, which closes it when
it stops, from its own thread, whenever that is. A second owner closing it too closed a
file opened meanwhile under the same number (seen in CI: the controller's events file
failed with EBADF as a launcher's node store went away)."""

from __future__ import annotations

import gc
import os
import time

import pytest

from odyssey_megatron.runtime.control import store_server
from odyssey_megatron.runtime.control.store_server import StoreServer

pytestmark = pytest.mark.timeout(60)


def _closed(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return True
    return False


def test_a_file_opened_under_the_servers_old_descriptor_survives_the_server(monkeypatch, tmp_path):
    listening: list[int] = []

    def recording(host, port):
        sock = _listening_socket(host, port)
        listening.append(sock.fileno())
        return sock

    _listening_socket = store_server._listening_socket
    monkeypatch.setattr(store_server, "_listening_socket", recording)
    server = StoreServer("127.0.0.1", 0, timeout=5.0)
    server.store.set("key", "value")
    (fd,) = listening

    del server.store  # the TCPStore stops and closes its socket
    gc.collect()
    deadline = time.monotonic() + 10.0
    while not _closed(fd) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert _closed(fd), "the stopped TCPStore still holds its listening socket"

    events = os.open(tmp_path / "events.jsonl", os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    if events != fd:  # a file that got the freed number
        os.dup2(events, fd)
        os.close(events)
    del server
    gc.collect()
    assert not _closed(fd), "the server's object closed a descriptor it no longer owned"
    os.write(fd, b"{}\n")
    os.close(fd)
    assert (tmp_path / "events.jsonl").read_bytes() == b"{}\n"
