"""Blocks whose chosen writer died with the controller, written by another replica.

A worker that lost the controller writes its share of what it holds (``stopping.save_held``),
each block to one of its replicas as the controller would have chosen; nobody is left to say
which of those replicas died too, and a dead writer's blocks were missing from that step's
checkpoint (``--resume`` then took an older one, or none). The run directory every node
sees can say it: each writer first claims what it is about to write (``<part>.claim``
beside the parts of the step's checkpoint), then writes it. A replica holding a block it
was not chosen for waits ``grace_s`` for a claim or a part of that block (every writer
found the controller gone within about a heartbeat of the others: a closed socket, or the
same silence), then its turn: the other holders follow the chosen writer by worker id, each
``stagger_s`` after the one before, so that the first alive one's claim is seen before the
next one's turn comes. At its turn with neither, it claims and writes the block itself, and
also where a claimed block's part has not appeared within ``claim_wait_s`` (its writer died
writing). Healthy writers cost their replicas only the wait for their parts; a dead one,
``grace_s`` and the turns before the first alive replica's. All of it must fit in the time
a worker has to save after the controller's loss (the collective timeout). A block written
twice is harmless: a part is read per block.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

from odyssey_megatron.blocks import Block
from odyssey_megatron.run_dir import write_json
from odyssey_megatron.runtime.checkpoint_index import checkpoint_directory, checkpoint_parts

__all__ = ["Replica", "claim", "fill_in"]

CLAIM_SUFFIX = ".claim"


@dataclass(frozen=True)
class Replica:
    """A block this worker holds at ``step`` steps and was not chosen to write: ``turn`` is
    its place among the block's holders (1: first after the chosen writer)."""

    block: Block
    step: int
    turn: int


def claim(run_dir: Path, *, step: int, part: str, blocks: Iterable[Block], tp_rank: int) -> None:
    """Say that the part ``part`` of step ``step``'s checkpoint is about to hold ``blocks``."""
    directory = checkpoint_directory(run_dir, step)
    directory.mkdir(parents=True, exist_ok=True)
    write_json(directory / f"{part}{CLAIM_SUFFIX}", {"blocks": [str(b) for b in blocks], "tp_rank": tp_rank})


def _named(directory: Path, tp_rank: int) -> tuple[set[str], set[str]]:
    """(blocks some part holds, blocks some claim names) for TP rank ``tp_rank`` under ``directory``."""
    if not directory.is_dir():
        return set(), set()
    written = {b for _, part in checkpoint_parts(directory) if part["tp_rank"] == tp_rank for b in part["blocks"]}
    claimed = set()
    for path in directory.glob(f"*{CLAIM_SUFFIX}"):
        try:
            named = json.loads(path.read_text())
        except (OSError, ValueError):  # being replaced: read at the next look
            continue
        if named["tp_rank"] == tp_rank:
            claimed.update(named["blocks"])
    return written, claimed


def fill_in(run_dir: Path, replicas: list[Replica], *, part: str, tp_rank: int,
            write: Callable[[list[Block], int, str], None], grace_s: float, stagger_s: float, claim_wait_s: float,
            clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep,
            poll_s: float = 0.05) -> list[Replica]:
    """Wait for the writers of ``replicas`` and write those nobody wrote by this worker's
    turn (``write(blocks, step, part)``: parts ``<part>-0``, ``<part>-1``... one a round, so
    none replaces another); the replicas it wrote."""
    started, pending, claimed_at, wrote, rounds = clock(), list(replicas), {}, [], 0
    while pending:
        now, due = clock(), {}
        for replica in list(pending):
            written, claimed = _named(checkpoint_directory(run_dir, replica.step), tp_rank)
            name = str(replica.block)
            if name in written:
                pending.remove(replica)
            elif name in claimed:
                seen = claimed_at.setdefault(replica, now)
                if now - seen >= claim_wait_s:
                    due.setdefault(replica.step, []).append(replica)
            elif now - started >= grace_s + (replica.turn - 1) * stagger_s:
                due.setdefault(replica.step, []).append(replica)
        for step, overdue in sorted(due.items()):
            blocks, name = [r.block for r in overdue], f"{part}-{rounds}"
            rounds += 1
            claim(run_dir, step=step, part=name, blocks=blocks, tp_rank=tp_rank)
            write(blocks, step, name)
            wrote += overdue
            pending = [r for r in pending if r not in overdue]
        if pending:
            sleep(poll_s)
    return wrote
