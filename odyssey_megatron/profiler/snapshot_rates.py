"""What an in-memory snapshot's own work runs at on this machine, for the estimator's
snapshot pricing (``estimator.snapshot``) and so for Young's interval: the copy of a share
from the device into keeper memory, the way a snapshot makes it (``snapshot.keeper_copy``:
a side stream into the registered mapping on an accelerator, a plain copy on CPU), and the
XOR a parity encode or rebuild runs over host memory (``parity.xor_into``, in the encode's
pieces). The network part of the parity crosses nodes, which one machine cannot measure:
the recipe's inter-node bandwidth prices it.
"""

from __future__ import annotations

import statistics
import time

import torch

from odyssey_megatron.hooks.accelerator import Accelerator
from odyssey_megatron.snapshot.keeper import KeeperBuffer, NodeKeeper, payload_layout
from odyssey_megatron.snapshot.keeper_copy import KeeperCopier
from odyssey_megatron.snapshot.parity import ENCODE_PIECE_BYTES, xor_into

__all__ = ["SNAPSHOT_SAMPLE_BYTES", "measure_snapshot_rates"]

SNAPSHOT_SAMPLE_BYTES = 128 * 2**20
"""Bytes of the share copied and XORed: large enough to run at the rate a whole share runs at."""


def measure_snapshot_rates(accelerator: Accelerator, *, repeats: int = 3) -> tuple[float, float]:
    """(copy, XOR) bytes/s: a share's copy into a keeper buffer and an XOR into host memory,
    each the median of ``repeats`` after one warm-up (which maps and registers the buffer, as
    a generation's first snapshot does)."""
    size = SNAPSHOT_SAMPLE_BYTES
    source = torch.ones(size // 4, dtype=torch.float32, device=accelerator.device(0))
    entries, total = payload_layout([("share", source.dtype, tuple(source.shape))])
    keeper = NodeKeeper(1, name="odyssey-profile-snapshot")
    buffer = KeeperBuffer(keeper.paths[0].data[0])
    copier = KeeperCopier()
    try:
        def copy() -> float:
            started = time.perf_counter()
            copying = copier.start({"share": source}, entries, buffer.begin(total))
            copying.run()
            copying.wait_on_host()
            return time.perf_counter() - started

        copy_s = _median(copy, repeats)
    finally:
        copier.close()
        buffer.close()
        keeper.close()
    target, other = torch.zeros(size, dtype=torch.uint8), torch.ones(size, dtype=torch.uint8)
    xor_s = _median(lambda: _timed(lambda: _xor_in_pieces(target, other)), repeats)
    return size / copy_s, size / xor_s


def _xor_in_pieces(target: torch.Tensor, source: torch.Tensor) -> None:
    """XOR as ``parity.encode`` does, one ``ENCODE_PIECE_BYTES`` piece at a time (a rebuild's
    larger pieces, cut across threads, XOR at least as fast: this rate prices it safely)."""
    for start in range(0, source.numel(), ENCODE_PIECE_BYTES):
        xor_into(target[start:start + ENCODE_PIECE_BYTES], source[start:start + ENCODE_PIECE_BYTES])


def _median(run, repeats: int) -> float:
    run()
    return statistics.median(run() for _ in range(repeats))


def _timed(work) -> float:
    started = time.perf_counter()
    work()
    return time.perf_counter() - started
