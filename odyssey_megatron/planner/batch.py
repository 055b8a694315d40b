"""Batch distribution over pipelines of different lengths (paper 001, IV-A)."""

from __future__ import annotations

from typing import Sequence


def distribute_batch(num_micro_batches: int, pipeline_sizes: Sequence[int]) -> list[int]:
    """Micro-batches per pipeline, proportional to its workers, none idle.

    Pre-allocate floor(N_m * n_j / N); hand out the rest one at a time, largest pipelines
    first; then, while a pipeline has none, move one from the largest share to it.
    """
    if not pipeline_sizes or min(pipeline_sizes) <= 0:
        raise ValueError(f"pipeline sizes must be positive, got {list(pipeline_sizes)}")
    if num_micro_batches < len(pipeline_sizes):
        raise ValueError(f"{num_micro_batches} micro-batches cannot keep {len(pipeline_sizes)} pipelines busy")
    total = sum(pipeline_sizes)
    shares = [num_micro_batches * size // total for size in pipeline_sizes]
    order = sorted(range(len(pipeline_sizes)), key=lambda j: (-pipeline_sizes[j], j))
    remaining = num_micro_batches - sum(shares)
    while remaining:
        for j in order[:remaining]:
            shares[j] += 1
        remaining = num_micro_batches - sum(shares)
    while 0 in shares:
        donor = max(range(len(shares)), key=lambda j: (shares[j], -j))
        shares[donor] -= 1
        shares[shares.index(0)] = 1
    return shares


def assign_micro_batch_ids(shares: Sequence[int]) -> list[tuple[int, ...]]:
    """Contiguous global micro-batch ids per pipeline, so every sample is used once."""
    ids, start = [], 0
    for count in shares:
        ids.append(tuple(range(start, start + count)))
        start += count
    return ids
