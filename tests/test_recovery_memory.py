"""Memory is released across recoveries: a survivor that enters ten plan generations in
turn (fresh process groups, its stage rebuilt from its blocks, a step, everything torn
down) holds no more after the tenth than after the first, within 10 %."""

from __future__ import annotations

import json

import pytest

from helpers import symmetric_plan
from odyssey_megatron.estimator.program import step_program
from odyssey_megatron.cluster import ClusterState
from odyssey_megatron.profile import uniform_profile
from odyssey_megatron.schedules.program import publish
from odyssey_megatron.settings import PLAIN
from odyssey_megatron.testing.local_world import run_world
from runtime_cases import repeated_generations

GENERATIONS = 10


@pytest.mark.timeout(600)
def test_resident_memory_stays_flat_over_ten_recoveries():
    plan = symmetric_plan(dp=2, pp=2, num_layers=4, micro_batches_per_pipeline=2)
    program = step_program(plan, uniform_profile(num_layers=4), ClusterState(world_size=4), pricing=PLAIN)
    per_rank = run_world(repeated_generations, 4, json.dumps(publish(plan, program)), GENERATIONS, timeout=500)
    for rank, resident in enumerate(per_rank):
        first, last = resident[0], resident[-1]  # after the first generation ended, after the tenth
        assert last <= 1.10 * first, f"rank {rank}: {first / 2**20:.1f} MiB -> {last / 2**20:.1f} MiB: {resident}"
