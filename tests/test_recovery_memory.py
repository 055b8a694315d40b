"""Memory is released across recoveries: a survivor that enters ten plan generations in
turn (fresh process groups, its stage rebuilt from its blocks, a step, everything torn
down) holds less than one more copy of its stage's parameters after the tenth than after
the first. The model is wide enough that its state is most of each process, so a stage
(or its optimizer) kept alive by each recovery, or even once, shows. Counted, not only
weighed: the tensors alive after each generation stay as many as after the first, and no
process group of a generation outlives it (Megatron's rotary embedding cache kept each
stage's rotary embedding, with its tensors and its context-parallel group, alive)."""

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
WIDE = {"hidden_size": 1024, "ffn_hidden_size": 2816}
"""The tiny model's other fields: ~24 M parameters (94 MiB) per stage of two layers."""


@pytest.mark.timeout(600)
def test_resident_memory_grows_by_less_than_one_model_copy_over_ten_recoveries():
    plan = symmetric_plan(dp=2, pp=2, num_layers=4, micro_batches_per_pipeline=2)
    program = step_program(plan, uniform_profile(num_layers=4), ClusterState(world_size=4), pricing=PLAIN)
    per_rank = run_world(repeated_generations, 4, json.dumps(publish(plan, program)), GENERATIONS, json.dumps(WIDE),
                         timeout=500)
    for rank, result in enumerate(per_rank):
        resident, copy = result["resident"], result["copy_bytes"]
        first, last = resident[0], resident[-1]  # after the first generation ended, after the tenth
        trace = f"rank {rank}: one copy {copy / 2**20:.1f} MiB; resident MiB {[r // 2**20 for r in resident]}"
        # Parameters and Adam's two moments, kept between generations, are over a third of the process.
        assert 3 * copy > first / 3, trace
        assert last - first < copy, trace
        assert max(result["tensors"]) == result["tensors"][0], f"rank {rank}: tensors alive {result['tensors']}"
        # Alive after each release: the generation's default group alone, which the next destroys first.
        assert result["groups"] == [1] * GENERATIONS, f"rank {rank}: groups alive {result['groups']}"
