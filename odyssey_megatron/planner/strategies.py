"""Candidate DP/PP strategies over the surviving workers (paper 001, Algorithm 1 lines 1-7).

A strategy is the multiset of pipeline lengths: ``(4, 4, 3)`` is three pipelines of
4, 4 and 3 stages over 11 workers. DP degrees stay within a radius of the current one
and pipeline lengths within a radius of the even split (Algorithm 1's R_dp and R_pp).
Strategies mix at most two pipeline lengths: a third shape adds DP sync units and rounds
and another layer split without balancing load any better, and leaving it out keeps the
search linear in the DP range (8,000 partitions of 1,023 workers become ~40).

The window around the current DP degree is the paper's. A decision off the critical path
(workers rejoined, the current plan keeps training meanwhile) also sweeps every pipeline
length once (``pipeline_length_sweep``) so the plan can travel far from the current DP
degree, which the window alone only does two steps per decision.
"""

from __future__ import annotations


def two_length_partitions(total: int, parts: int, low: int, high: int) -> list[tuple[int, ...]]:
    """Non-increasing tuples of ``parts`` lengths in [low, high], at most two distinct,
    summing to ``total``."""
    found = []
    for short in range(max(low, 1), high + 1):
        if short * parts == total:
            found.append((short,) * parts)
        for long in range(short + 1, high + 1):
            count_long, rest = divmod(total - short * parts, long - short)
            if rest == 0 and 0 < count_long < parts:
                found.append((long,) * count_long + (short,) * (parts - count_long))
    return sorted(found, reverse=True)


def parallel_strategies(
    *,
    num_workers: int,
    current_dp: int,
    dp_radius: int,
    pp_radius: int,
    max_stages: int,
    max_idle: int = 0,
) -> list[tuple[int, ...]]:
    """All strategies using ``num_workers`` workers, or up to ``max_idle`` fewer but always
    fewer idle than their shortest pipeline, within the search ranges. Leaving a few workers
    idle can beat a lopsided split that uses them all (127 workers at DP 31: 31 pipelines
    of 4 and 3 idle rather than three of them 5 stages long)."""
    strategies = []
    for used in range(num_workers, max(0, num_workers - max_idle - 1), -1):
        for dp in range(max(1, current_dp - dp_radius), min(used, current_dp + dp_radius) + 1):
            low = max(1, used // dp - pp_radius)
            high = min(max_stages, -(-used // dp) + pp_radius)
            strategies.extend(
                s for s in two_length_partitions(used, dp, low, high) if num_workers - used < min(s)
            )
    return strategies


def pipeline_length_sweep(*, num_workers: int, max_stages: int, max_idle: int = 0) -> list[tuple[int, ...]]:
    """One DP degree per pipeline length L (as many pipelines of L or L+1 stages as fit),
    each using every worker or leaving fewer than L idle: a coarse grid over all DP degrees."""
    strategies = set()
    for length in range(1, max_stages + 1):
        for used in range(num_workers, max(0, num_workers - min(max_idle, length - 1) - 1), -1):
            dp = used // length
            if dp >= 1:
                strategies.update(two_length_partitions(used, dp, length, min(max_stages, length + 1)))
    return sorted(strategies, reverse=True)
