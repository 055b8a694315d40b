"""The paper's closed forms (001, Eq. 9, 12, 13, 14) for textbook pipelines.

They assume identical stages and free links; the op-list programme in ``pipeline``
generalises them and equals them in that case (the tests check both ways).
"""

from __future__ import annotations

from typing import Sequence


def symmetric_step_time(*, num_stages: int, num_micro_batches: int, forward_s: float, backward_s: float) -> float:
    """Eq. 9: (N_pp + N_m - 1)(T_f + T_b); N_m is micro-batches per pipeline."""
    return (num_stages + num_micro_batches - 1) * (forward_s + backward_s)


def reroute_step_time(
    *,
    num_stages: int,
    num_micro_batches: int,
    data_parallel_size: int,
    failed_per_stage: Sequence[int],
    forward_s: float,
    backward_s: float,
) -> float | None:
    """Eq. 13 (Eq. 12 when one stage has one failure): each failed worker's N_m micro-batches
    spread over the N_dp - F_i survivors of its stage. None when a stage has no survivor."""
    if len(failed_per_stage) != num_stages:
        raise ValueError(f"failed_per_stage needs {num_stages} entries, got {len(failed_per_stage)}")
    extra = 0.0
    for failed in failed_per_stage:
        if failed >= data_parallel_size:
            return None
        if failed > 0:
            extra += num_micro_batches * failed / (data_parallel_size - failed)
    return (num_stages + num_micro_batches - 1 + extra) * (forward_s + backward_s)


def stage_peak_memory(
    *,
    stage: int,
    num_stages: int,
    num_layers: int,
    param_bytes: float,
    optimizer_bytes: float,
    grad_bytes: float,
    activation_bytes: float,
) -> float:
    """Eq. 14 for 0-based stage i: N_l (m_p + m_o + m_g) + (N_pp - i) N_l m_a."""
    return num_layers * (param_bytes + optimizer_bytes + grad_bytes) + (num_stages - stage) * num_layers * activation_bytes
