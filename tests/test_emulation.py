"""Device-time emulation: each op takes the time the profile gives it, not its real
compute time, so ranks sharing two cores step as fast as devices of the profile would,
and as the estimator predicts from the same profile.

Timing tolerances: a sleep ends up to a few ms late on a loaded machine, and the
optimizer step and global-norm all-reduce, which the estimator does not price, run in
real time (about a millisecond on the tiny model)."""

from __future__ import annotations

import time
from dataclasses import replace

import pytest
import torch

from helpers import lost_last_pipeline, symmetric_plan
from odyssey_megatron.cli import dumps
from odyssey_megatron.cluster import ClusterState
from odyssey_megatron.config import load_config
from odyssey_megatron.errors import ConfigError
from odyssey_megatron.estimator import estimate_plan
from odyssey_megatron.estimator.optimizer import optimizer_time
from odyssey_megatron.estimator.program import step_program
from odyssey_megatron.hooks.process_groups import RankMap
from odyssey_megatron.profile import BlockCost, ModelProfile
from odyssey_megatron.profile_file import (
    analytic_recipe_profile,
    profile_json,
    recipe_measured_for,
    recipe_profile,
    write_profile,
)
from odyssey_megatron.restorer import with_sync
from odyssey_megatron.runtime.rank.emulation import DeviceEmulation, EmulatedClock, recipe_emulation
from odyssey_megatron.schedules.ops import BACKWARD, FORWARD, WEIGHT_GRAD, Op
from odyssey_megatron.schedules.program import publish
from odyssey_megatron.settings import Pricing
from odyssey_megatron.testing.local_world import run_world
from runtime_cases import timed_steps

pytestmark = pytest.mark.timeout(600)
TINY = "recipes/llama2_7b/tiny_cpu.yaml"
SLACK_S = 0.008
"""How late a padded op may end: sleep wake-up latency on a loaded 2-core machine."""


def known_profile(num_layers: int, *, forward_s: float, weight_grad_s: float | None = None,
                  op_overhead_s: float = 0.0, optimizer_s_per_layer: float = 0.0) -> ModelProfile:
    """Layers of ``forward_s`` (backward twice that) with 1 MB of parameters and 4 MB of
    gradients, a free embedding and head, 2 MB activations over a 100 MB/s link with
    1 ms latency."""
    layer = BlockCost(forward_s=forward_s, backward_s=2 * forward_s, param_bytes=1_000_000, grad_bytes=4_000_000,
                      optimizer_bytes=0, activation_bytes=0, weight_grad_s=weight_grad_s)
    free = BlockCost(0.0, 0.0, 0, 0, 0, 0)
    return ModelProfile(layers=(layer,) * num_layers, embedding=free, output=free, tie_embeddings=False,
                        p2p_bytes=2_000_000, intra_node_bandwidth=1e8, inter_node_bandwidth=1e8, link_latency_s=1e-3,
                        memory_budget_bytes=1 << 40, samples_per_micro_batch=2, tokens_per_sample=16,
                        op_overhead_s=op_overhead_s, optimizer_s_per_param_byte=optimizer_s_per_layer / 1_000_000)


def test_an_op_takes_the_profiles_time_and_a_longer_one_overruns():
    """Ops back to back end at the profile's times on the worker's timeline; the host's own
    time between them is absorbed; an op whose work takes longer overruns."""
    plan = symmetric_plan(dp=1, pp=1, num_layers=1, micro_batches_per_pipeline=1)
    profile = known_profile(1, forward_s=0.05, weight_grad_s=0.04)
    ops = [Op(FORWARD, 0, 0, 0), Op(BACKWARD, 0, 0, 0), Op(WEIGHT_GRAD, 0, 0, 0)]
    clock = EmulatedClock(profile=profile, cluster=ClusterState(world_size=1), plan=plan,
                          ranks=RankMap.identity(1, 1), worker=0, ops=ops, device=torch.device("cpu"))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as a rank of a shared machine runs: no thread pool to wake
    try:
        work = torch.randn(64, 64)
        work @ work  # the first product sets up the BLAS library
        clock.resume()
        start, ends, timeline = time.monotonic(), [], []
        for op in ops:
            time.sleep(0.005)  # host work between ops, which a device's timeline does not see
            with clock.compute(op):
                real = time.monotonic()
                work @ work
                real = time.monotonic() - real
            ends.append(time.monotonic() - start)
            timeline.append(clock._free_at - start)
            assert real < 0.01, "the real work is a small part of the op's time"
    finally:
        torch.set_num_threads(threads)
    # F, then B without its weight-gradient part, then the W op
    # on the timeline exactly (a late wake-up of the host's sleep, which a loaded machine
    # gives, delays the host only: the next op still ends at its own time), and never early
    for end, on_timeline, expected in zip(ends, timeline, (0.05, 0.05 + 0.06, 0.05 + 0.06 + 0.04)):
        assert expected <= end, ends
        assert on_timeline == pytest.approx(expected, abs=0.002), timeline
    assert clock.overruns == 0
    with clock.compute(Op(FORWARD, 0, 0, 1)):
        time.sleep(0.08)
    # overran by what passed its 0.05 s, not by the op's whole 0.08 s (however late the sleep wakes)
    assert clock.overruns == 1 and 0.03 <= clock.worst_overrun_s < 0.08, clock.worst_overrun_s


def test_the_emulated_adam_step_is_the_estimators_owned_share_under_the_distributed_optimizer():
    """Three holders of a layer, one failed: each survivor pads Adam to the seconds
    ``optimizer_time`` prices for it (the share at the plan's two holders: all of it), and
    with all three holders 2/3 of the layer."""
    profile = known_profile(1, forward_s=0.0, optimizer_s_per_layer=0.03)
    whole = symmetric_plan(dp=3, pp=1, num_layers=1, micro_batches_per_pipeline=1)
    for plan, adam_s in ((whole, 0.02), (lost_last_pipeline(whole), 0.03)):
        clock = EmulatedClock(profile=profile, cluster=ClusterState(world_size=3), plan=plan,
                              ranks=RankMap.identity(3, 1), worker=0, ops=[], device=torch.device("cpu"),
                              distributed_optimizer=True)
        assert clock._adam_s == pytest.approx(adam_s)
        assert clock._adam_s == pytest.approx(optimizer_time(plan, profile, None, staggered=True, sharded=True))


def test_emulated_steps_take_the_estimated_time():
    """DP2 (an all-reduce of 4 MB at 100 MB/s) and PP2 (2 MB messages, split backwards)
    on two gloo ranks, with a fixed cost per op and an optimizer step: each step takes
    what the estimator predicts from the profile emulated, far longer than its real
    compute."""
    profile = known_profile(2, forward_s=0.1, op_overhead_s=0.01, optimizer_s_per_layer=0.02)
    cluster = ClusterState(world_size=2)
    emulation = DeviceEmulation(profile=profile, cluster=cluster)
    cases, predicted = [], []
    for plan in (symmetric_plan(dp=2, pp=1, num_layers=1, micro_batches_per_pipeline=2),
                 symmetric_plan(dp=1, pp=2, num_layers=2, micro_batches_per_pipeline=4)):
        plan_profile = replace(profile, layers=profile.layers[:plan.num_layers])
        plan = with_sync(plan, plan_profile)
        program = step_program(plan, plan_profile, cluster, pricing=Pricing(decouple=True))
        published = dumps(publish(plan, program))
        cases += [(published, replace(emulation, profile=plan_profile)), (published, None)]
        predicted.append(estimate_plan(plan, plan_profile, cluster, pricing=Pricing(decouple=True)).step_time_s)
    # two micro-batches of F and B (each op 10 ms beyond its layer), the ring all-reduce,
    # the global norm's (8 bytes, two latencies) and Adam over the one layer
    assert predicted[0] == pytest.approx(2 * (0.11 + 0.21) + 0.042 + (0.002 + 8e-8) + 0.02)

    results = run_world(timed_steps, 2, cases)
    for index, expected in enumerate(predicted):
        emulated = [r[2 * index] for r in results]
        real = [r[2 * index + 1] for r in results]
        measured = max(r["step_s"] for r in emulated)
        assert max(r["worst_overrun_s"] for r in emulated) <= 2 * SLACK_S
        assert expected <= measured + SLACK_S and measured <= expected * 1.03 + 2 * SLACK_S, (measured, expected)
        assert max(r["step_s"] for r in real) < measured / 2


def test_the_recipe_names_a_device_or_a_profile_file(tmp_path):
    config = load_config(TINY, ["cluster.emulate_device=a100-80gb"])
    emulation = recipe_emulation(config)
    assert emulation.profile == analytic_recipe_profile(config, device="a100-80gb")
    assert emulation.cluster.devices_per_node == 8 and emulation.cluster.world_size == 8
    assert recipe_emulation(load_config(TINY)) is None

    base = load_config(TINY)
    path = tmp_path / "p.json"
    write_profile(path, profile_json(recipe_profile(base), measured_for=recipe_measured_for(base), source={}))
    assert recipe_emulation(load_config(TINY, [f"cluster.emulate_device={path}"])).profile == recipe_profile(base)

    for value, problem in (("a100", "no such file: a100"), (str(path), "measured for model.num_layers")):
        with pytest.raises(ConfigError) as info:
            recipe_emulation(load_config(TINY, [f"cluster.emulate_device={value}", "model.num_layers=4",
                                                "parallel.pipeline_model_parallel_size=2"]))
        assert info.value.key == "cluster.emulate_device" and problem in str(info.value)
