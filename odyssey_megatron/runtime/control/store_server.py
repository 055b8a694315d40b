"""A TCPStore server bound to one address: the controller's (the run's store, on the
address the recipe names) and each launcher's (its node's store, on the loopback
address). TCPStore binds every interface when it opens its own socket, so the socket is
opened here and handed over."""

from __future__ import annotations

import datetime
import socket

import torch.distributed as dist

__all__ = ["StoreServer"]


def _listening_socket(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    sock.listen(socket.SOMAXCONN)
    return sock


class StoreServer:
    """Serves a TCPStore on ``host:port`` (port 0: a free one, see ``port``) for as long
    as this object lives; ``store`` is the server's own client connection."""

    store: dist.TCPStore
    host: str
    port: int

    def __init__(self, host: str, port: int, *, timeout: float):
        sock = _listening_socket(host, port)
        self.host, self.port = host, sock.getsockname()[1]
        try:
            self.store = dist.TCPStore(host, self.port, is_master=True, wait_for_workers=False, use_libuv=True,
                                       master_listen_fd=sock.fileno(),
                                       timeout=datetime.timedelta(seconds=timeout))
        except BaseException:
            sock.close()
            raise
        # The server owns the descriptor now and closes it when it stops (from its own
        # thread, whenever that is): a Python owner closing it too could close a file
        # opened meanwhile under the same number.
        sock.detach()
