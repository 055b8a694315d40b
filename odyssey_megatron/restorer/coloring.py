"""Asymmetric DP gradient sync: layer-granular all-reduce units and their rounds.

Paper IV-B: once pipelines differ in their stage boundaries, a block's DP peers are no
longer "the same stage in every pipeline", so gradients are all-reduced per group of
blocks held by the same workers (a sync unit). Two units that share a worker cannot run
at once on it, so scheduling them is graph colouring: units are vertices, shared workers
are edges, colours are communication rounds. The paper colours greedily; we run exact
DSATUR branch and bound (Brélaz 1979) for the minimum number of rounds, which these
small graphs (one vertex per distinct holder set, at most a few hundred) afford.
"""

from __future__ import annotations

import dataclasses
from typing import Iterable, Optional, Sequence

from odyssey_megatron.blocks import Block, block_sort_key
from odyssey_megatron.plan import ExecutionPlan, SyncUnit
from odyssey_megatron.profile import ModelProfile


def sync_units(plan: ExecutionPlan, profile: ModelProfile) -> tuple[SyncUnit, ...]:
    """One unit per distinct set of live holders, in model order of first block.

    Single-holder units stay in: they need no all-reduce, but the runtime still scales
    their gradients. Workers are gathered per distinct stage (layers and pipeline
    position), whose blocks are listed once: at scale thousands hold the same stage.
    """
    by_stage: dict[tuple[int, int, bool, bool], list[int]] = {}
    for pipeline in plan.pipelines:
        last = len(pipeline.stages) - 1
        for si, stage in enumerate(pipeline.stages):
            if stage.worker is not None:
                by_stage.setdefault((*stage.layers, si == 0, si == last), []).append(stage.worker)
    holders: dict[Block, list[int]] = {}
    for (start, end, first, last), workers in by_stage.items():
        for b in profile.stage_blocks(start, end, first=first, last=last):
            holders.setdefault(b, []).extend(workers)
    groups: dict[tuple[int, ...], list[Block]] = {}
    for b in sorted(holders, key=block_sort_key):
        groups.setdefault(tuple(sorted(holders[b])), []).append(b)
    return tuple(SyncUnit(blocks=tuple(blocks), workers=workers) for workers, blocks in groups.items())


def color_rounds(units: Sequence[SyncUnit], *, node_limit: int = 200_000) -> tuple[tuple[int, ...], ...]:
    """Fewest rounds of concurrent all-reduces, as sorted unit indices per round.

    Units with two or more workers conflict when they share a worker. Exact DSATUR
    branch and bound stops when it meets a clique lower bound; after ``node_limit``
    branch nodes it returns the best (still valid) colouring found so far. Rounds are
    ordered by their smallest unit index.
    """
    vertices = [index for index, unit in enumerate(units) if len(unit.workers) >= 2]
    on_worker: dict[int, int] = {}
    for v, index in enumerate(vertices):
        for worker in units[index].workers:
            on_worker[worker] = on_worker.get(worker, 0) | 1 << v
    neighbours = [
        _bits(_union(on_worker[w] for w in units[index].workers) & ~(1 << v)) for v, index in enumerate(vertices)
    ]
    lower_bound = max(_greedy_clique_size(neighbours), max((m.bit_count() for m in on_worker.values()), default=0))
    colors = _dsatur_branch_and_bound(neighbours, lower_bound=lower_bound, node_limit=node_limit)

    rounds: dict[int, list[int]] = {}
    for v, color in enumerate(colors):
        rounds.setdefault(color, []).append(vertices[v])
    return tuple(sorted((tuple(r) for r in rounds.values()), key=lambda r: r[0]))


def is_valid_coloring(units: Sequence[SyncUnit], rounds: Sequence[Sequence[int]]) -> bool:
    """Every multi-worker unit in exactly one round, no round touching a worker twice,
    and no single-worker unit scheduled."""
    scheduled = [index for r in rounds for index in r]
    expected = [index for index, unit in enumerate(units) if len(unit.workers) >= 2]
    if sorted(scheduled) != expected:
        return False
    for r in rounds:
        workers = [w for index in r for w in units[index].workers]
        if len(workers) != len(set(workers)):
            return False
    return True


def with_sync(plan: ExecutionPlan, profile: ModelProfile) -> ExecutionPlan:
    """The plan with its sync units and communication rounds filled in."""
    units = sync_units(plan, profile)
    return dataclasses.replace(plan, sync_units=units, comm_rounds=color_rounds(units))


def _union(masks: Iterable[int]) -> int:
    result = 0
    for mask in masks:
        result |= mask
    return result


def _bits(mask: int) -> tuple[int, ...]:
    return tuple(v for v in range(mask.bit_length()) if mask >> v & 1)


def _greedy_clique_size(neighbours: Sequence[Sequence[int]]) -> int:
    """Largest clique found by growing one from every vertex, highest degree first."""
    by_degree = sorted(range(len(neighbours)), key=lambda v: (-len(neighbours[v]), v))
    adjacent = [set(n) for n in neighbours]
    best = 0
    for seed in range(len(neighbours)):
        clique = [seed]
        for v in by_degree:
            if all(v in adjacent[member] for member in clique):
                clique.append(v)
        best = max(best, len(clique))
    return best


def _dsatur_branch_and_bound(
    neighbours: Sequence[Sequence[int]], *, lower_bound: int, node_limit: int
) -> list[int]:
    """Minimum colouring of the graph, or the best found within ``node_limit`` nodes.

    Branch on the uncoloured vertex with the most distinct neighbour colours (then most
    uncoloured neighbours, then lowest index), trying existing colours before one new
    colour; the first descent is plain greedy DSATUR, so a colouring always exists.
    """
    n = len(neighbours)
    colors = [-1] * n
    neighbour_color_count = [[0] * n for _ in range(n)]
    saturation = [0] * n
    uncolored_degree = [len(nb) for nb in neighbours]
    best: Optional[list[int]] = None
    best_count = n + 1
    nodes = 0

    def paint(v: int, color: int) -> None:
        colors[v] = color
        for u in neighbours[v]:
            if neighbour_color_count[u][color] == 0:
                saturation[u] += 1
            neighbour_color_count[u][color] += 1
            uncolored_degree[u] -= 1

    def unpaint(v: int, color: int) -> None:
        colors[v] = -1
        for u in neighbours[v]:
            neighbour_color_count[u][color] -= 1
            if neighbour_color_count[u][color] == 0:
                saturation[u] -= 1
            uncolored_degree[u] += 1

    def search(colored: int, used: int) -> bool:
        """Extend the partial colouring; True means stop (optimal or out of nodes)."""
        nonlocal best, best_count, nodes
        if colored == n:
            best, best_count = colors.copy(), used
            return used <= lower_bound
        if best is not None and nodes >= node_limit:
            return True
        nodes += 1
        v = max(
            (u for u in range(n) if colors[u] < 0),
            key=lambda u: (saturation[u], uncolored_degree[u], -u),
        )
        for color in range(used + 1):
            if max(used, color + 1) >= best_count:
                break
            if neighbour_color_count[v][color]:
                continue
            paint(v, color)
            stop = search(colored + 1, max(used, color + 1))
            unpaint(v, color)
            if stop:
                return True
        return False

    search(0, 0)
    assert best is not None, "the first descent always reaches a full colouring"
    return best
