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
  split: a fresh rendezvous. Nor can a shrink make a world that loses none (torch refuses
  an empty exclusion).
- Where the group must become the world's default one (a generation's world: every other
  group is made from it), only a shrink's does; a split's is a subgroup beside a parent
  that stays the default: a fresh rendezvous instead of a split.

NCCL's shrink leaves the old communicator allocated (``ncclCommAbort`` is still needed),
so ``survivor_group`` aborts it once the new one exists.

Entering a generation (``runtime.rank.entering``), survivors whose every rank still holds
the last generation's healthy default group (one that ended without an abort: an abort
frees NCCL's communicators) take the next world from it (``next_world``); gloo always meets
afresh.
"""

from __future__ import annotations

import enum
import logging
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d  # the shrink flags: torch.distributed does not export them

from odyssey_megatron.hooks.process_groups import RankMap

__all__ = ["GroupSource", "KeptWorld", "group_source", "keeps_parent", "next_world", "runtime_nccl_version",
           "survivor_group", "torch_offers"]

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
                 loses_ranks: bool, as_default: bool, offered: frozenset[str]) -> GroupSource:
    """Where the survivors' communicator comes from (pure: see the module's rules).
    ``nccl_version``: the NCCL that runs (None: none); ``parent_healthy``: no member of the
    old world died; ``gains_ranks`` / ``loses_ranks``: the new world has a rank the old one
    lacked / lacks one the old one had; ``as_default``: it becomes the default group;
    ``offered``: which of ``shrink_group`` and ``split_group`` this torch has."""
    if backend != "nccl" or nccl_version is None or gains_ranks:
        return GroupSource.rendezvous
    can_shrink = loses_ranks and "shrink_group" in offered and nccl_version >= SHRINK_FROM
    if not parent_healthy:
        return GroupSource.shrink_abort if can_shrink and nccl_version < SHRINK_ABORT_HANGS_FROM \
            else GroupSource.rendezvous
    if can_shrink:
        return GroupSource.shrink
    if not as_default and "split_group" in offered and nccl_version >= SPLIT_FROM:
        return GroupSource.split
    return GroupSource.rendezvous


def keeps_parent(*, backend: str, nccl_version: Optional[NcclVersion], offered: frozenset[str]) -> bool:
    """Whether a generation that ended without an abort keeps its default group for the
    next one: a next world that only loses ranks could shrink it."""
    return group_source(backend=backend, nccl_version=nccl_version, parent_healthy=True, gains_ranks=False,
                        loses_ranks=True, as_default=True, offered=offered) is not GroupSource.rendezvous


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
        flags = c10d.SHRINK_ABORT if source is GroupSource.shrink_abort else c10d.SHRINK_DEFAULT
        group = dist.shrink_group(sorted(excluded), group=parent, shrink_flags=flags)
    try:
        parent.abort()  # ncclCommAbort: NCCL's shrink leaves the old communicator's memory allocated
    except Exception as exc:  # noqa: BLE001 - the new group exists; the failure is said, not dropped
        log.warning("aborting the old communicator after its %s failed: %s: %s", source.value,
                    type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "")
    return group


@dataclass(frozen=True)
class KeptWorld:
    """A generation's default group, kept past its healthy end (``keeps_parent``), and its world."""

    group: dist.ProcessGroup
    ranks: RankMap


def next_world(kept: KeptWorld, *, ranks: RankMap, held_everywhere: bool, backend: str,
               nccl_version: Optional[NcclVersion], offered: frozenset[str]) -> Optional[dist.ProcessGroup]:
    """A generation's default group (world ``ranks``) from the last generation's, ``kept``,
    where ``group_source`` says it can come from it; else None: the kept group is destroyed
    and the caller meets afresh. Called by every rank of ``ranks``; ``held_everywhere``:
    each of them kept its last generation's group."""
    parent, parent_ranks = kept.group, kept.ranks
    old, new = set(parent_ranks.workers), set(ranks.workers)
    source = group_source(backend=backend, nccl_version=nccl_version, parent_healthy=True,
                          gains_ranks=bool(new - old), loses_ranks=bool(old - new), as_default=True,
                          offered=offered) if held_everywhere else GroupSource.rendezvous
    tp = ranks.tensor_parallel_size
    excluded = [parent_ranks.rank(w, k) for w in sorted(old - new) for k in range(tp)]
    survivors = [parent_ranks.rank(w, k) for w in ranks.workers if w in old for k in range(tp)]
    group = survivor_group(source, parent=parent, excluded=excluded, survivors=survivors)
    if group is None:
        dist.destroy_process_group(parent)
    else:
        log.info("generation's world of %d ranks from a %s of the last one's %d", ranks.world_size, source.value,
                 parent_ranks.world_size)
    return group
