"""Where a recovery's survivors get their next world's communicator: from the one they
have (``dist.shrink_group``, NCCL's ``ncclCommShrink``; ``dist.split_group``,
``ncclCommSplit``), which skips a rendezvous of every rank (seconds at 1,000+ ranks), or
from a fresh rendezvous on the generation's store prefix, which always works.

What may be asked of the old communicator depends on its backend, on the NCCL that runs
and on whether the old communicator is healthy:

- gloo and HCCL: neither offers a shrink or a split through torch.distributed (torch 2.13
  raises ``TypeError`` for gloo): a fresh rendezvous.
- NCCL, healthy (every member alive: a straggler removed, a node drained): a shrink that
  waits for nothing in flight (``SHRINK_DEFAULT``, NCCL >= 2.27), else a split (NCCL >=
  2.18, every member of the old world calling, the removed ones too).
- NCCL after a member died (the communicator errored): only a shrink that aborts what is
  in flight (``SHRINK_ABORT``) works there, and it hangs the survivors on NCCL >= 2.31
  (reported upstream in 2026, pytorch #194679): below 2.31, that shrink; from 2.31 on, a
  fresh rendezvous.
- A world that gains a rank (a joiner, a replacement node) cannot come from a shrink or a
  split: a fresh rendezvous.

NCCL's shrink leaves the old communicator allocated (``ncclCommAbort`` is still needed),
so ``survivor_group`` aborts it once the new one exists.
"""

from __future__ import annotations

import enum
import logging
from typing import Optional

import torch
import torch.distributed as dist

__all__ = ["GroupSource", "group_source", "runtime_nccl_version", "survivor_group", "torch_offers"]

log = logging.getLogger(__name__)

NcclVersion = tuple[int, int, int]

SHRINK_FROM: NcclVersion = (2, 27, 0)
"""The first NCCL with ``ncclCommShrink``."""
SPLIT_FROM: NcclVersion = (2, 18, 0)
"""The first NCCL with ``ncclCommSplit``."""
SHRINK_ABORT_HANGS_FROM: NcclVersion = (2, 31, 0)
"""From this NCCL on, ``shrink_group(SHRINK_ABORT)`` hangs the survivors (pytorch #194679)."""


class GroupSource(enum.Enum):
    """Where the survivors' next communicator comes from."""

    rendezvous = "rendezvous"
    """A fresh ``init_process_group`` of the new world on the generation's store prefix."""
    shrink = "shrink"
    """``dist.shrink_group`` of the healthy old communicator, waiting for what is in flight."""
    shrink_abort = "shrink_abort"
    """``dist.shrink_group(SHRINK_ABORT)`` of an errored one, aborting what is in flight."""
    split = "split"
    """``dist.split_group`` of the healthy old communicator (every old member calls)."""


def group_source(*, backend: str, nccl_version: Optional[NcclVersion], parent_healthy: bool, gains_ranks: bool,
                 offered: frozenset[str]) -> GroupSource:
    """Where the survivors' communicator comes from (pure: see the module's rules).
    ``nccl_version``: the NCCL that runs (None: none); ``parent_healthy``: no member of the
    old world died; ``gains_ranks``: the new world has a rank the old one lacked;
    ``offered``: which of ``shrink_group`` and ``split_group`` this torch has."""
    if backend != "nccl" or nccl_version is None or gains_ranks:
        return GroupSource.rendezvous
    can_shrink = "shrink_group" in offered and nccl_version >= SHRINK_FROM
    if not parent_healthy:
        return GroupSource.shrink_abort if can_shrink and nccl_version < SHRINK_ABORT_HANGS_FROM \
            else GroupSource.rendezvous
    if can_shrink:
        return GroupSource.shrink
    if "split_group" in offered and nccl_version >= SPLIT_FROM:
        return GroupSource.split
    return GroupSource.rendezvous


def torch_offers() -> frozenset[str]:
    """Which of ``shrink_group`` and ``split_group`` this torch.distributed has."""
    return frozenset(name for name in ("shrink_group", "split_group") if hasattr(dist, name))


def runtime_nccl_version() -> Optional[NcclVersion]:
    """The NCCL this process runs (major, minor, patch), or None where torch has no CUDA."""
    if not torch.cuda.is_available():
        return None
    version = torch.cuda.nccl.version()
    return tuple(int(part) for part in version[:3]) if isinstance(version, tuple) else \
        (version // 10000, version // 100 % 100, version % 100)  # an old torch's packed integer


def survivor_group(source: GroupSource, *, parent: dist.ProcessGroup, excluded: list[int],
                   survivors: list[int]) -> Optional[dist.ProcessGroup]:
    """The survivors' group made from ``parent`` as ``source`` says (called by every
    survivor, and for a split by ``excluded`` ranks too), the parent aborted after (a
    shrink does not free it); None for a rendezvous, which the caller makes itself.
    ``excluded`` and ``survivors``: ranks of ``parent``."""
    if source is GroupSource.rendezvous:
        return None
    if source is GroupSource.split:
        group = dist.split_group(parent, split_ranks=[survivors])
    else:
        flags = dist.SHRINK_ABORT if source is GroupSource.shrink_abort else dist.SHRINK_DEFAULT
        group = dist.shrink_group(sorted(excluded), group=parent, shrink_flags=flags)
    try:
        parent.abort()  # ncclCommAbort: NCCL's shrink leaves the old communicator's memory allocated
    except Exception as exc:  # noqa: BLE001 - the new group exists; the failure is said, not dropped
        log.warning("aborting the old communicator after its %s failed: %s: %s", source.value,
                    type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "")
    return group
