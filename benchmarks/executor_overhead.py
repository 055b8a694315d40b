"""Executor overhead and coloured DP sync, measured on CPU ranks (gloo, real compute).

1. Step time of the Odyssey op-list executor against Megatron-Core's own 1F1B schedule on
   the same symmetric DP2 x PP2 plan, same world, steps alternated so all see the same
   machine noise. Target: overhead under 2 %. Also Megatron's schedule with the DP sync
   overlapped with backward.
2. What staggered optimizer steps cost on the same plan rerouted after a last stage
   failed (3 ranks): the host snapshot, run in line on CPU, and the settle wait. On 2
   cores the ranks share the CPU, so the bubbles staggering fills are not idle time and
   no gain can show; the estimator's predicted gain is printed beside it.
3. Gradient-sync time on an asymmetric plan ([4,4] and [3,3,2] over 5 ranks): the
   restorer's coloured rounds (blocks with the same holders fused, disjoint units
   concurrent) against one all-reduce per layer, one after another.

4. The plugin's whole fault-free step against Megatron-Core's own, on the DP2 x PP2 plan
   in device-time emulation (``--only-overhead`` runs this section alone). Plugin: the
   ``PlanRunner`` (op-list executor, layer-wise DP sync, global-norm clipping, Adam) and
   what the worker adds per step (phase hooks, op timers, the step report appended to
   the store). Megatron: its stage model in Megatron's ``DistributedDataParallel``, the
   schedule ``get_forward_backward_func`` returns (1F1B, the DP all-reduce in
   ``finalize_model_grads``) and ``get_megatron_optimizer``'s optimizer. Both are paced
   through Megatron's own timer hooks (``forward-compute``, ``backward-compute``): each
   forward and backward takes the profile's time (this machine's profile, ``PACE``
   times slower) from its start, its real work inside; messages, all-reduces, the
   optimizer and all host work run in real time, so whatever either side does beyond
   Megatron's work shows. Target: overhead at most 1 %. The plugin in its own emulation
   mode (``cluster.emulate_device``, which also paces messages and all-reduces and hides
   host work behind the padding) is printed beside it.
   Overhead is the median over steps of the plugin's step over Megatron's step run just
   before it (steps alternate), which cancels the machine's drift. Measured (8 steps):
   Megatron 5394.0 ms/step, plugin 5387.2 ms/step, overhead -0.03 % (the steps' ratios
   from -0.64 to +0.51 %), no paced op overran; a second run +0.07 % (from -1.06 to
   +0.46 %). Earlier runs, as the ratio of medians of 3-5 steps: -0.22, +0.15 and
   +1.15 %: single steps on this shared machine vary by about 1 % either way. The plugin
   in its own emulation mode took 5555.4 ms (the estimator: 5545.6 ms); that is not
   overhead: it also paces messages, all-reduces and Adam to the 8x slower profile,
   which the paced runs do in real time.

Prints medians and the ratios. Run: .venv/bin/python benchmarks/executor_overhead.py [--only-overhead]
Absolute times on a shared 2-core machine are noise; read the ratios.
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import replace
from pathlib import Path

import torch
from megatron.core.optimizer import OptimizerConfig

from odyssey_megatron.cluster import ClusterState
from odyssey_megatron.config import ModelConfig, load_config
from odyssey_megatron.data import SyntheticTokens
from odyssey_megatron.hooks.grad_sync import clip_scale
from odyssey_megatron.hooks.process_groups import RankMap
from odyssey_megatron.plan import ExecutionPlan, SyncUnit
from odyssey_megatron.estimator import estimate_plan
from odyssey_megatron.estimator.program import step_program
from odyssey_megatron.estimator.step_schedule import step_schedule, step_time
from odyssey_megatron.planner.reroute import reroute_plan
from odyssey_megatron.profile import ModelProfile, uniform_profile
from odyssey_megatron.profiler import measure_profile
from odyssey_megatron.restorer import with_sync
from odyssey_megatron.runtime.rank.emulation import DeviceEmulation
from odyssey_megatron.runtime.rank.op_timers import BACKWARD, FORWARD, OpTimers
from odyssey_megatron.settings import Pricing
from odyssey_megatron.testing.local_world import run_world
from odyssey_megatron.testing.plans import pipelines_plan
from odyssey_megatron.testing.slow_device import slowed

MODEL = ModelConfig(num_layers=8, hidden_size=256, ffn_hidden_size=688, num_attention_heads=8, num_query_groups=8,
                    vocab_size=1024, seq_length=128, params_dtype="fp32")
MICRO_BATCH_SIZE = 2
RECIPE_OVERRIDES = ["model.hidden_size=256", "model.ffn_hidden_size=688", "model.num_attention_heads=8",
                    "model.num_query_groups=8", "model.vocab_size=1024", "model.seq_length=128",
                    "parallel.pipeline_model_parallel_size=2", "training.global_batch_size=32"]
"""The recipe of ``MODEL`` on DP2 x PP2 with 16 micro-batches, for ``odyssey profile``."""
CLIP_GRAD = 1.0
PACE = 8.0
"""How much slower than this machine's one-thread profile the paced ops run: 4 ranks share
2 cores, with other work on the machine: an op's real work takes up to 4x its profiled time."""


def _plan(splits, micro_batches, workers_of=None) -> ExecutionPlan:
    plan = pipelines_plan(splits, micro_batches, worker_of=workers_of)
    return with_sync(plan, uniform_profile(num_layers=MODEL.num_layers))


def one_layer_at_a_time(plan: ExecutionPlan) -> ExecutionPlan:
    """Every block its own unit, each all-reduce in a round of its own, in model order."""
    units = tuple(SyncUnit((b,), u.workers) for u in plan.sync_units for b in u.blocks)
    rounds = tuple((i,) for i, u in enumerate(units) if len(u.workers) > 1)
    return replace(plan, sync_units=units, comm_rounds=rounds)


def _runner(plan, rank, world, schedule="auto", overlap=False, staggered=False):
    """A rank of ``plan`` running the step program the decision center would publish
    (split backwards where they pay; never for Megatron's 1F1B), from the seed's state."""
    from odyssey_megatron.runtime.rank.plan_runner import PlanRunner, initial_state

    pricing = Pricing(decouple=schedule != "megatron", staggered=staggered)
    program = step_program(plan, uniform_profile(num_layers=MODEL.num_layers), pricing=pricing)
    ranks = RankMap.identity(world, 1)
    return PlanRunner(plan=plan, program=program, rank=rank, ranks=ranks, model=MODEL,
                      micro_batch_size=MICRO_BATCH_SIZE,
                      state=initial_state(plan=plan, rank=rank, ranks=ranks, model=MODEL, seed=1),
                      optimizer=OptimizerConfig(lr=1e-4),
                      schedule=schedule, overlap_grad_sync=overlap)


def executor_vs_megatron(rank: int, world: int, plan_json: str, steps: int) -> dict[str, list[float]]:
    plan = ExecutionPlan.from_json(plan_json)
    runners = {
        "megatron": _runner(plan, rank, world, "megatron"),
        "odyssey": _runner(plan, rank, world, "odyssey"),
        "megatron+overlap": _runner(plan, rank, world, "megatron", overlap=True),
    }
    return _alternate(runners, steps)


def staggered_vs_synchronous(rank: int, world: int, plan_json: str, steps: int) -> dict[str, list[float]]:
    plan = ExecutionPlan.from_json(plan_json)
    runners = {
        "synchronous": _runner(plan, rank, world, "odyssey"),
        "staggered": _runner(plan, rank, world, "odyssey", staggered=True),
    }
    times = _alternate(runners, steps)
    runners["staggered"].settle()
    return times


def _alternate(runners: dict, steps: int) -> dict[str, list[float]]:
    """Seconds per step of each runner, their steps alternated."""
    import torch.distributed as dist

    data = SyntheticTokens(MODEL.vocab_size, MODEL.seq_length, MICRO_BATCH_SIZE)
    times: dict[str, list[float]] = {name: [] for name in runners}
    for step in range(steps + 1):
        for name, runner in runners.items():
            dist.barrier()
            started = time.perf_counter()
            runner.train_step(lambda m, step=step: data.micro_batch(step, m))
            dist.barrier()
            if step:  # the first step warms up allocators and gloo connections
                times[name].append(time.perf_counter() - started)
    return times


def sync_rounds(rank: int, world: int, plan_json: str, repeats: int) -> dict[str, list[float]]:
    import torch.distributed as dist

    plan = ExecutionPlan.from_json(plan_json)
    variants = {"coloured": plan, "per-layer": one_layer_at_a_time(plan)}
    data = SyntheticTokens(MODEL.vocab_size, MODEL.seq_length, MICRO_BATCH_SIZE)
    times: dict[str, list[float]] = {name: [] for name in variants}
    runners = {name: _runner(p, rank, world, "odyssey") for name, p in variants.items()}
    for runner in runners.values():
        runner.train_step(lambda m: data.micro_batch(0, m), apply=False)
    for _ in range(repeats):
        for name, runner in runners.items():
            dist.barrier()
            started = time.perf_counter()
            runner.grad_sync.sync()
            dist.barrier()
            times[name].append(time.perf_counter() - started)
    return times


def _medians(per_rank: list[dict[str, list[float]]]) -> dict[str, float]:
    names = per_rank[0].keys()
    return {name: statistics.median(max(r[name][i] for r in per_rank) for i in range(len(per_rank[0][name])))
            for name in names}



class PacedTimers:
    """Megatron's ``timers`` protocol that paces: each forward and backward ends no sooner
    than the given seconds after it started (device-time emulation through the hooks
    Megatron's schedules call); every name is also timed by ``OpTimers``, as the
    worker's online profile times it."""

    def __init__(self, seconds: dict[str, float]):
        self.op_timers = OpTimers(torch.device("cpu"))
        self._paced = {name: _PacedTimer(self.op_timers(name), s) for name, s in seconds.items()}

    def __call__(self, name: str, log_level: int | None = None):
        return self._paced.get(name) or self.op_timers(name, log_level)

    @property
    def overruns(self) -> int:
        """Ops whose real work took longer than their paced time."""
        return sum(t.overruns for t in self._paced.values())


class _PacedTimer:
    def __init__(self, timer, seconds: float):
        self._timer, self._seconds, self._started, self.overruns = timer, seconds, 0.0, 0

    def start(self, barrier: bool = False) -> None:
        self._started = time.perf_counter()
        self._timer.start()

    def stop(self, barrier: bool = False) -> None:
        self._timer.stop()
        left = self._started + self._seconds - time.perf_counter()
        if left > 0:
            time.sleep(left)
        else:
            self.overruns += 1


def _paced_seconds(plan: ExecutionPlan, profile: ModelProfile, worker: int) -> dict[str, float]:
    pi, si, stage = next(p for p in plan.stage_positions() if p[2].worker == worker)
    times = profile.stage_times(*stage.layers, first=si == 0, last=si == plan.pipelines[pi].num_stages - 1)
    return {FORWARD: times.forward_s, BACKWARD: times.backward_s}


class MegatronStep:
    """One rank's training step as Megatron-Core runs it: the stage model wrapped in
    Megatron's DistributedDataParallel, Megatron's optimizer, and the pipeline schedule
    ``get_forward_backward_func`` returns, whose ``finalize_model_grads`` all-reduces the
    DP gradients. For a plan whose pipelines' ranks ascend (Megatron's layout)."""

    def __init__(self, plan: ExecutionPlan, rank: int, timers: PacedTimers):
        import torch.distributed as dist
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.distributed.finalize_model_grads import finalize_model_grads
        from megatron.core.optimizer import get_megatron_optimizer
        from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator
        from megatron.core.process_groups_config import ProcessGroupCollection

        from odyssey_megatron.hooks.model import StageSpec, build_stage_model

        pipelines = [[s.worker for s in p.stages] for p in plan.pipelines]
        stages = [list(ranks) for ranks in zip(*pipelines)]
        groups = {tuple(r): dist.new_group(r) for r in pipelines + stages + [[r] for r in range(dist.get_world_size())]}
        pipeline = next(r for r in pipelines if rank in r)
        pp, dp, one = groups[tuple(pipeline)], groups[next(tuple(r) for r in stages if rank in r)], groups[(rank,)]
        self.stage = StageSpec.of_worker(plan, rank)
        gpt = build_stage_model(MODEL, self.stage, seed=1, pg_collection=ProcessGroupCollection(
            tp=one, cp=one, pp=one, ep=one, expt_dp=one, embd=None, pos_embd=None, dp=one, dp_cp=one))
        self.groups = ProcessGroupCollection(tp=one, cp=one, pp=pp, ep=one, expt_dp=None, embd=None, pos_embd=None,
                                             dp=dp, dp_cp=dp, mp=pp, tp_ep_pp=None)
        gpt.config.timers = timers
        gpt.config.finalize_model_grads_func = finalize_model_grads
        self.model = DistributedDataParallel(config=gpt.config, ddp_config=DistributedDataParallelConfig(),
                                             module=gpt, pg_collection=self.groups)
        self.optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-4, clip_grad=CLIP_GRAD),
                                                [self.model], pg_collection=self.groups,
                                                use_gloo_process_groups=False)
        self.p2p = P2PCommunicator(pp, gpt.config)
        self.micro_batches = next(p.micro_batches for p in plan.pipelines if rank in {s.worker for s in p.stages})

    def train_step(self, batches) -> None:
        from functools import partial

        from megatron.core.pipeline_parallel import get_forward_backward_func

        from odyssey_megatron.hooks.stage_step import stage_forward

        first, last = self.stage.first, self.stage.last
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        get_forward_backward_func(pp_size=self.groups.pp.size())(
            forward_step_func=partial(stage_forward, first=first, last=last),
            data_iterator=(batches(m) for m in self.micro_batches) if first or last else None,
            model=self.model, num_microbatches=len(self.micro_batches), seq_length=MODEL.seq_length,
            micro_batch_size=MICRO_BATCH_SIZE, p2p_communicator=self.p2p, pg_collection=self.groups)
        # Megatron's step, but its clipping (which asserts CUDA tensors) done by hand.
        self.optimizer.prepare_grads()
        scale = clip_scale(self.optimizer.get_grad_norm(), CLIP_GRAD)
        for param in self.optimizer.get_parameters() if scale is not None else ():
            param.grad.mul_(scale)
        self.optimizer.step_with_ready_grads()


class WorkerStep:
    """The plugin's step as the worker takes it (``runtime.rank.worker``): the runner's
    step with the phase hooks and op timers on, then the step report appended to the store."""

    def __init__(self, runner, timers: PacedTimers | None, rank: int):
        import torch.distributed as dist

        self.runner, self.timers, self.rank, self.step = runner, timers, rank, 0
        self.store = dist.distributed_c10d._get_default_store()

    def train_step(self, batches) -> None:
        from odyssey_megatron.runtime.protocol import StepReport, step_report_key
        from odyssey_megatron.runtime.rank import op_timers

        samples: dict[int, list[int]] = {}

        def batch(m: int):
            samples[m] = list(range(m * MICRO_BATCH_SIZE, (m + 1) * MICRO_BATCH_SIZE))
            return batches(m)

        result = self.runner.train_step(batch)
        self.runner.settle()
        order = sorted(result.losses)
        times = self.timers.op_timers.take() if self.timers else dict.fromkeys(op_timers.TIMED, (0.0, 0))
        report = StepReport(self.rank, tuple(order), tuple(result.losses[m] for m in order),
                            tuple(i for m in order for i in samples[m]), *times[op_timers.FORWARD],
                            *times[op_timers.BACKWARD], *times[op_timers.WEIGHT_GRAD],
                            times[op_timers.OPTIMIZER][0])
        self.store.append(step_report_key(0, self.step), report.to_json() + "\n")
        self.step += 1


def plugin_vs_megatron(rank: int, world: int, plan_json: str, profile: ModelProfile, steps: int) -> dict:
    from odyssey_megatron.runtime.rank.plan_runner import PlanRunner, initial_state

    plan = ExecutionPlan.from_json(plan_json)
    ranks = RankMap.identity(world, 1)
    seconds = _paced_seconds(plan, profile, rank)
    phase = {}

    def runner(timers: PacedTimers | None, emulation: DeviceEmulation | None) -> PlanRunner:
        return PlanRunner(plan=plan, program=step_program(plan, profile), rank=rank, ranks=ranks, model=MODEL,
                          micro_batch_size=MICRO_BATCH_SIZE,
                          state=initial_state(plan=plan, rank=rank, ranks=ranks, model=MODEL, seed=1),
                          optimizer=OptimizerConfig(lr=1e-4, clip_grad=CLIP_GRAD), schedule="odyssey",
                          on_phase=lambda p: phase.__setitem__("now", p), op_timers=timers,
                          emulation=emulation)

    timers = {name: PacedTimers(seconds) for name in ("megatron", "plugin")}
    emulation = DeviceEmulation(profile=profile, cluster=ClusterState(world_size=world))
    steps_of = {
        "megatron": MegatronStep(plan, rank, timers["megatron"]),
        "plugin": WorkerStep(runner(timers["plugin"], None), timers["plugin"], rank),
        "plugin, own emulation": WorkerStep(runner(None, emulation), None, rank),
    }
    times = _alternate(steps_of, steps)
    times["overruns"] = [float(t.overruns) for t in timers.values()]
    times["emulation overruns"] = [float(steps_of["plugin, own emulation"].runner.clock.overruns)]
    return times


def paced_profile() -> ModelProfile:
    """This machine's profile of ``MODEL`` (``odyssey profile``), ``PACE`` times slower."""
    config = load_config(str(Path(__file__).resolve().parents[1] / "recipes/llama2_7b/tiny_cpu.yaml"),
                         RECIPE_OVERRIDES)
    return slowed(measure_profile(config, repeats=5).profile, PACE)


def print_overhead(steps: int) -> None:
    plan = _plan([(4, 4)] * 2, [8, 8], workers_of=lambda d, s: s * 2 + d)
    profile = paced_profile()
    per_rank = run_world(plugin_vs_megatron, 4, plan.to_json(), profile, steps, timeout=900)
    overruns = sum(sum(r.pop("overruns")) for r in per_rank)
    emulation_overruns = sum(sum(r.pop("emulation overruns")) for r in per_rank)
    step = _medians(per_rank)
    slowest = {name: [max(r[name][i] for r in per_rank) for i in range(steps)] for name in step}
    # Step i of each runner ran back to back: their ratio cancels the machine's drift.
    paired = sorted(p / m - 1 for p, m in zip(slowest["plugin"], slowest["megatron"]))
    predicted = estimate_plan(plan, profile, ClusterState(world_size=4)).step_time_s
    print(f"DP2xPP2, 8 layers h{MODEL.hidden_size}, 16 micro-batches, ops paced to this machine's profile x{PACE:g} "
          f"(EMULATED), {steps} steps (median of slowest rank):")
    print(f"  Megatron (1F1B, DDP, its optimizer)  {step['megatron'] * 1e3:8.1f} ms/step")
    print(f"  plugin whole step                    {step['plugin'] * 1e3:8.1f} ms/step")
    print(f"  overhead                             {statistics.median(paired) * 100:+8.2f} % "
          f"(median of the steps' paired ratios, from {paired[0] * 100:+.2f} to {paired[-1] * 100:+.2f} %; "
          f"target at most 1 %; {overruns} paced ops overran)")
    print(f"  plugin in its own emulation mode     {step['plugin, own emulation'] * 1e3:8.1f} ms/step "
          f"({(step['plugin, own emulation'] / step['megatron'] - 1) * 100:+.2f} %; the estimator predicts "
          f"{predicted * 1e3:.1f} ms; {emulation_overruns} ops overran)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--overhead-steps", type=int, default=8, help="section 4's steps (each some seconds)")
    parser.add_argument("--only-overhead", action="store_true", help="run section 4 only")
    args = parser.parse_args()
    if args.only_overhead:
        print_overhead(args.overhead_steps)
        return

    symmetric = _plan([(4, 4)] * 2, [8, 8], workers_of=lambda d, s: s * 2 + d)
    step = _medians(run_world(executor_vs_megatron, 4, symmetric.to_json(), args.steps, timeout=900))
    print(f"DP2xPP2, 8 layers h{MODEL.hidden_size}, 16 micro-batches, {args.steps} steps (median of slowest rank):")
    print(f"  Megatron 1F1B   {step['megatron'] * 1e3:8.1f} ms/step")
    print(f"  Odyssey ops     {step['odyssey'] * 1e3:8.1f} ms/step")
    print(f"  overhead        {(step['odyssey'] / step['megatron'] - 1) * 100:+8.2f} %")
    print(f"  Megatron 1F1B with DP sync overlapped: {step['megatron+overlap'] * 1e3:.1f} ms/step "
          f"({(step['megatron+overlap'] / step['megatron'] - 1) * 100:+.2f} %)")

    profile = uniform_profile(num_layers=MODEL.num_layers)
    rerouted = with_sync(reroute_plan(symmetric, failed_workers={3}, profile=profile), profile)
    timing = step_schedule(rerouted, profile, pricing=Pricing(decouple=True, staggered=True))
    predicted = step_time(rerouted, profile, None, timing, staggered=True) / timing.makespan_s - 1
    stagger = _medians(run_world(staggered_vs_synchronous, 3, rerouted.to_json(), args.steps, timeout=900))
    print("The same plan, its last stage of pipeline 1 failed and rerouted, 3 ranks, split backwards:")
    print(f"  synchronous steps {stagger['synchronous'] * 1e3:8.1f} ms/step")
    print(f"  staggered steps   {stagger['staggered'] * 1e3:8.1f} ms/step "
          f"({(stagger['staggered'] / stagger['synchronous'] - 1) * 100:+.2f} %; the estimator predicts "
          f"{predicted * 100:+.2f} % for these op lists on dedicated devices, uniform layer times)")

    asymmetric = _plan([(4, 4), (3, 3, 2)], [6, 4])
    per_layer = one_layer_at_a_time(asymmetric)
    sync = _medians(run_world(sync_rounds, 5, asymmetric.to_json(), args.repeats, timeout=900))
    print(f"[4,4] + [3,3,2] over 5 ranks, DP gradient sync ({args.repeats} repeats):")
    print(f"  coloured rounds {sync['coloured'] * 1e3:8.1f} ms  ({len(asymmetric.comm_rounds)} rounds, "
          f"{sum(len(u.workers) > 1 for u in asymmetric.sync_units)} all-reduces)")
    print(f"  per layer       {sync['per-layer'] * 1e3:8.1f} ms  ({len(per_layer.comm_rounds)} all-reduces in a row)")
    print(f"  speed-up        {sync['per-layer'] / sync['coloured']:8.2f} x")

    print_overhead(args.overhead_steps)


if __name__ == "__main__":
    main()
