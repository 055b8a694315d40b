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

4. The live worker's whole fault-free step against Megatron-Core's own, on the same 4
   ranks (DP2 x PP2), with Llama-2 7B-shaped stages: one 7B layer (h4096, ffn 11008, 32
   heads; 202M parameters) a stage, 4 micro-batches of 1 x 16 tokens, vocabulary 1024
   (``SEVEN_B_OVERRIDES``; ``--only-overhead`` runs this section alone). Plugin: the
   step exactly as ``Worker`` takes it, through the code it runs
   (``runtime.rank.live_step``): ``PlanRunner.forward_backward`` (the schedule the worker
   gets for this plan: Megatron's 1F1B function, as the program has whole backwards and
   no staggering), ``finish_step`` with the layer-wise DP sync, global-norm clipping and,
   before Adam, the real commit: the ``StepReport`` (from the op timers,
   ``odyssey.online_profile``) appended to the TCPStore the benchmark's parent hosts as
   the controller hosts it, ``NodeLedger.count_in`` and ``wait_decided`` on clones of
   that connection (it stands in for the node's store too: one node); the ``CollectiveGuard`` installed and tracking the groups, as the
   worker does; the phase hooks firing an empty fault injector. (Not included: the
   heartbeat thread, which beats from its own thread and connection.) Megatron: its
   stage model in Megatron's ``DistributedDataParallel``, the schedule
   ``get_forward_backward_func`` returns (1F1B, the DP all-reduce in
   ``finalize_model_grads``) and ``get_megatron_optimizer``'s optimizer, the guard not
   installed. Device-time emulation through Megatron's own timer hooks (``forward-compute``,
   ``backward-compute``), both sides alike: each forward and backward takes the emulated
   device's time from its start, its real work inside; that time is ``SEVEN_B_PACE``
   times the slowest rank's mean real op in an unpaced Megatron step at the start
   (``calibrated_seconds``; an ``odyssey profile`` of this shape takes over ten minutes
   on this shared machine). Messages, all-reduces, Adam and all host work run in real
   time, so whatever either side does beyond Megatron's work shows. Both sides do not fit
   in memory at once (about 4 GB a rank each), so each round runs one side in a world of
   its own processes (a warm-up and ``--steps-per-round`` timed steps), then the other,
   the first side alternating by round; step i of the plugin in a round is paired with step i of
   Megatron in the same round, and the overhead is the median of the pairs' ratios.
   Target: at most 1 %. Printed beside it, measured separately: the commit of the last
   rank to count in (it waits for no one, so it is the store's round trips) and the
   guard's cost (its ``Work.wait`` calls a step times what its helper-thread hand-off
   adds to one wait, measured on small all-reduces).
   Measured 2026-11-27 after the in-place DP sync (shared 2-core CPU, nothing else running,
   load average 2.4-3.3, ``--rounds 6 --steps-per-round 2``: 12 pairs): Megatron 23.80 s a
   step, the worker's step 23.69 s, overhead -2.06 % (pairs from -12.9 to +15.0 %,
   quartiles -8.4 / +3.8 %; 16 paced ops overran; paced forward/backward 0.99 / 4.18 s);
   the commit 0.6 ms a step (0.003 %), the guard about 0.5 ms a step. With tests running
   beside it (load 3-6, 8 pairs): +4.90 % (-29.7 to +34.2 %). Before, the layer-wise DP
   sync copied every gradient into a fresh flat tensor and back (+17.6 % over 8 pairs).

Prints medians and the ratios. Run: .venv/bin/python benchmarks/executor_overhead.py [--only-overhead] [--rounds 4 --steps-per-round 3]
Absolute times on a shared 2-core machine are noise; read the ratios.
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import time
from dataclasses import replace
from pathlib import Path

import torch
from megatron.core.optimizer import OptimizerConfig

from odyssey_megatron.config import ModelConfig, TrainingConfig, load_config
from odyssey_megatron.data import SyntheticTokens
from odyssey_megatron.hooks.grad_sync import clip_scale
from odyssey_megatron.hooks.lr_schedule import LrSchedule
from odyssey_megatron.hooks.process_groups import RankMap
from odyssey_megatron.phases import Phase
from odyssey_megatron.plan import ExecutionPlan, SyncUnit
from odyssey_megatron.estimator.program import step_program
from odyssey_megatron.estimator.step_schedule import step_schedule, step_time
from odyssey_megatron.planner.reroute import reroute_plan
from odyssey_megatron.profile import ModelProfile, uniform_profile
from odyssey_megatron.restorer import with_sync
from odyssey_megatron.runtime.rank.op_timers import BACKWARD, FORWARD, OpTimers
from odyssey_megatron.settings import Pricing
from odyssey_megatron.testing.local_world import run_world
from odyssey_megatron.testing.plans import pipelines_plan

MODEL = ModelConfig(num_layers=8, hidden_size=256, ffn_hidden_size=688, num_attention_heads=8, num_query_groups=8,
                    vocab_size=1024, seq_length=128, params_dtype="fp32")
SMOKE_MODEL = replace(MODEL, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4, num_query_groups=4,
                      vocab_size=128, seq_length=16)
"""``--smoke``'s model for sections 1-3: MODEL's layers at the tests' tiny shape."""
MICRO_BATCH_SIZE = 2
CLIP_GRAD = 1.0

def _plan(splits, micro_batches, workers_of=None) -> ExecutionPlan:
    plan = pipelines_plan(splits, micro_batches, worker_of=workers_of)
    return with_sync(plan, uniform_profile(num_layers=MODEL.num_layers))


def one_layer_at_a_time(plan: ExecutionPlan) -> ExecutionPlan:
    """Every block its own unit, each all-reduce in a round of its own, in model order."""
    units = tuple(SyncUnit((b,), u.workers) for u in plan.sync_units for b in u.blocks)
    rounds = tuple((i,) for i, u in enumerate(units) if len(u.workers) > 1)
    return replace(plan, sync_units=units, comm_rounds=rounds)


def _runner(plan, rank, world, model, schedule="auto", overlap=False, staggered=False):
    """A rank of ``plan`` running the step program the decision center would publish
    (split backwards where they pay; never for Megatron's 1F1B), from the seed's state."""
    from odyssey_megatron.runtime.rank.plan_runner import PlanRunner, RunnerSettings, initial_state

    pricing = Pricing(decouple=schedule != "megatron", staggered=staggered)
    program = step_program(plan, uniform_profile(num_layers=MODEL.num_layers), pricing=pricing)
    ranks = RankMap.identity(world, 1)
    return PlanRunner(plan=plan, program=program, rank=rank, ranks=ranks,
                      state=initial_state(plan=plan, rank=rank, ranks=ranks, model=model, seed=1),
                      settings=RunnerSettings(model=model, micro_batch_size=MICRO_BATCH_SIZE,
                                              optimizer=OptimizerConfig(lr=1e-4),
                                              lr_schedule=LrSchedule.of(TrainingConfig(lr=1e-4)), schedule=schedule,
                                              overlap_grad_sync=overlap))


def executor_vs_megatron(rank: int, world: int, plan_json: str, steps: int,
                         model: ModelConfig) -> dict[str, list[float]]:
    plan = ExecutionPlan.from_json(plan_json)
    runners = {
        "megatron": _runner(plan, rank, world, model, "megatron"),
        "odyssey": _runner(plan, rank, world, model, "odyssey"),
        "megatron+overlap": _runner(plan, rank, world, model, "megatron", overlap=True),
    }
    return _alternate(runners, steps, model)


def staggered_vs_synchronous(rank: int, world: int, plan_json: str, steps: int,
                             model: ModelConfig) -> dict[str, list[float]]:
    plan = ExecutionPlan.from_json(plan_json)
    runners = {
        "synchronous": _runner(plan, rank, world, model, "odyssey"),
        "staggered": _runner(plan, rank, world, model, "odyssey", staggered=True),
    }
    times = _alternate(runners, steps, model)
    runners["staggered"].settle()
    return times


def _alternate(runners: dict, steps: int, model: ModelConfig) -> dict[str, list[float]]:
    """Seconds per step of each runner, their steps alternated."""
    import torch.distributed as dist

    data = SyntheticTokens(model.vocab_size, model.seq_length, MICRO_BATCH_SIZE)
    times: dict[str, list[float]] = {name: [] for name in runners}
    for step in range(steps + 1):
        for name, runner in runners.items():
            dist.barrier()
            started = time.perf_counter()
            runner.train_step(lambda m, step=step: data.micro_batch(step, m), step=step)
            dist.barrier()
            if step:  # the first step warms up allocators and gloo connections
                times[name].append(time.perf_counter() - started)
    return times


def sync_rounds(rank: int, world: int, plan_json: str, repeats: int, model: ModelConfig) -> dict[str, list[float]]:
    import torch.distributed as dist

    plan = ExecutionPlan.from_json(plan_json)
    variants = {"coloured": plan, "per-layer": one_layer_at_a_time(plan)}
    data = SyntheticTokens(model.vocab_size, model.seq_length, MICRO_BATCH_SIZE)
    times: dict[str, list[float]] = {name: [] for name in variants}
    runners = {name: _runner(p, rank, world, model, "odyssey") for name, p in variants.items()}
    for runner in runners.values():
        runner.train_step(lambda m: data.micro_batch(0, m), step=0, apply=False)
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

    def take(self) -> dict[str, tuple[float, int]]:
        """The op times since the last take, as the worker's ``OpTimers`` gives them."""
        return self.op_timers.take()

    def counting_in(self) -> None:
        """The rank counts into the step's commit (``OpTimers.counting_in``)."""
        self.op_timers.counting_in()

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


# -- section 4: the live worker's whole step against Megatron-Core's, 7B-shaped stages ------

SEVEN_B_OVERRIDES = ["model.num_layers=2", "model.hidden_size=4096", "model.ffn_hidden_size=11008",
                     "model.num_attention_heads=32", "model.num_query_groups=32", "model.vocab_size=1024",
                     "model.seq_length=16", "parallel.pipeline_model_parallel_size=2",
                     "parallel.data_parallel_size=2", "training.micro_batch_size=1",
                     "training.global_batch_size=4"]
"""Llama-2 7B's layer (h4096, ffn 11008, 32 heads) in 2 layers on DP2 x PP2, one layer a
stage (202M parameters, 3.2 GB with gradients and Adam's moments), 4 micro-batches of
1 x 16 tokens, a vocabulary of 1024 (7B's 32,000 would put 131M more parameters on the
first and last stages, more than this machine's memory holds): over ``tiny_cpu.yaml``."""
SEVEN_B_PACE = 1.5
"""The emulated device's forward and backward against the slowest rank's mean real op
measured here at the start (``calibrated_seconds``): the margin for the machine's noise."""
COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=300)


def layer_overrides(hidden: int) -> list[str]:
    """``SEVEN_B_OVERRIDES`` with a Llama-2 layer of ``hidden`` (7B's is 4096): FFN 2.6875 x
    hidden (7B's 11008) and heads of 128 (7B's 32)."""
    shape = {"model.hidden_size": hidden, "model.ffn_hidden_size": hidden * 43 // 16,
             "model.num_attention_heads": hidden // 128, "model.num_query_groups": hidden // 128}
    return [f"{key}={shape[key]}" if key in shape else f"{key}={value}"
            for key, value in (item.split("=", 1) for item in SEVEN_B_OVERRIDES)]


SMOKE_HIDDEN = 128
"""``--smoke``'s layer for section 4 (and snapshot_overhead's): one head of 128."""


def seven_b_recipe(overrides: list[str] = SEVEN_B_OVERRIDES):
    return load_config(str(Path(__file__).resolve().parents[1] / "recipes/llama2_7b/tiny_cpu.yaml"), overrides)


class _IndexedSamples:
    """``SyntheticTokens`` with the ``sample_ids`` that ``IndexedTokens`` gives the worker."""

    def __init__(self, model: ModelConfig, micro_batch_size: int):
        self.tokens, self.size = SyntheticTokens(model.vocab_size, model.seq_length, micro_batch_size), micro_batch_size

    def micro_batch(self, step: int, micro_batch: int) -> dict[str, torch.Tensor]:
        first = (step * 1024 + micro_batch) * self.size
        return {**self.tokens.micro_batch(step, micro_batch), "sample_ids": torch.arange(first, first + self.size)}


class MegatronStep:
    """One rank's training step as Megatron-Core runs it: the stage model wrapped in
    Megatron's DistributedDataParallel, Megatron's optimizer, and the pipeline schedule
    ``get_forward_backward_func`` returns, whose ``finalize_model_grads`` all-reduces the
    DP gradients. For a plan whose pipelines' ranks ascend (Megatron's layout)."""

    def __init__(self, plan: ExecutionPlan, rank: int, timers: PacedTimers, *, model: ModelConfig = MODEL,
                 micro_batch_size: int = MICRO_BATCH_SIZE, optimizer: OptimizerConfig | None = None):
        import torch.distributed as dist
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.distributed.finalize_model_grads import finalize_model_grads
        from megatron.core.optimizer import get_megatron_optimizer
        from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator
        from megatron.core.process_groups_config import ProcessGroupCollection

        from odyssey_megatron.blocks import StageSpec
        from odyssey_megatron.hooks.model import build_stage_model

        optimizer = optimizer or OptimizerConfig(optimizer="adam", lr=1e-4, clip_grad=CLIP_GRAD)
        self.model_config, self.micro_batch_size, self.clip_grad = model, micro_batch_size, optimizer.clip_grad
        pipelines = [[s.worker for s in p.stages] for p in plan.pipelines]
        stages = [list(ranks) for ranks in zip(*pipelines)]
        groups = {tuple(r): dist.new_group(r) for r in pipelines + stages + [[r] for r in range(dist.get_world_size())]}
        pipeline = next(r for r in pipelines if rank in r)
        pp, dp, one = groups[tuple(pipeline)], groups[next(tuple(r) for r in stages if rank in r)], groups[(rank,)]
        self.stage = StageSpec.of_worker(plan, rank)
        gpt = build_stage_model(model, self.stage, seed=1, pg_collection=ProcessGroupCollection(
            tp=one, cp=one, pp=one, ep=one, expt_dp=one, embd=None, pos_embd=None, dp=one, dp_cp=one))
        self.groups = ProcessGroupCollection(tp=one, cp=one, pp=pp, ep=one, expt_dp=None, embd=None, pos_embd=None,
                                             dp=dp, dp_cp=dp, mp=pp, tp_ep_pp=None)
        self.all_groups = list(groups.values())
        gpt.config.timers = timers
        gpt.config.finalize_model_grads_func = finalize_model_grads
        self.model = DistributedDataParallel(config=gpt.config, ddp_config=DistributedDataParallelConfig(),
                                             module=gpt, pg_collection=self.groups)
        self.optimizer = get_megatron_optimizer(optimizer, [self.model], pg_collection=self.groups,
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
            model=self.model, num_microbatches=len(self.micro_batches), seq_length=self.model_config.seq_length,
            micro_batch_size=self.micro_batch_size, p2p_communicator=self.p2p, pg_collection=self.groups)
        # Megatron's step, but its clipping (which asserts CUDA tensors) done by hand.
        self.optimizer.prepare_grads()
        scale = clip_scale(self.optimizer.get_grad_norm(), self.clip_grad)
        for param in self.optimizer.get_parameters() if scale is not None else ():
            param.grad.mul_(scale)
        self.optimizer.step_with_ready_grads()

    def close(self) -> None:
        import torch.distributed as dist

        for group in self.all_groups:
            dist.destroy_process_group(group)


class LiveWorkerStep:
    """The plugin's step exactly as the worker (``runtime.rank.training_loop``) takes it, through
    the same code (``runtime.rank.live_step``): ``PlanRunner.forward_backward`` and
    ``finish_step`` with the real commit, whose ``StepReport`` (from the op timers) goes to
    the TCPStore the parent hosts, as the controller hosts it, on a client connection of
    its own (the worker's controller link), and whose ``NodeLedger`` counts in and waits on
    clones of it (the worker's group store, and the node's store, which it stands in for: one node); the ``CollectiveGuard`` installed, tracking
    the default group and the runner's, as the worker does; the phase hook firing a fault
    injector that holds no fault. One instance is one plan generation, with its own keys."""

    def __init__(self, *, plan: ExecutionPlan, program, rank: int, world: int, generation: int, port: int,
                 timers: PacedTimers, recipe):
        import os

        import torch.distributed as dist

        from odyssey_megatron.hooks.collective_guard import CollectiveGuard, prepare_backend
        from odyssey_megatron.hooks.stage_optimizer import optimizer_config
        from odyssey_megatron.runtime.rank.fault_injection import FaultInjector
        from odyssey_megatron.runtime.rank.plan_runner import PlanRunner, RunnerSettings, initial_state
        from odyssey_megatron.runtime.rank.node_ledger import NodeLedger
        from odyssey_megatron.runtime.step_ledger import StepLedger

        self.rank, self.timers, self.phase, self.step = rank, timers, Phase.recovery, 0
        self.store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=COLLECTIVE_TIMEOUT)
        group_store = self.store.clone()
        group_store.set_timeout(COLLECTIVE_TIMEOUT)
        self.ledger = NodeLedger(StepLedger(group_store, generation=generation, training_ranks=world),
                                 self._node_store, node_ranks=world, check_s=0.1)  # one node: every rank
        self.guard = CollectiveGuard(backend="gloo", timeout_s=COLLECTIVE_TIMEOUT.total_seconds())
        prepare_backend("gloo")
        self.guard.install()
        self.guard.reopen(generation)
        self.guard.track([dist.distributed_c10d._get_default_group()])
        self.injector = FaultInjector((), rank=rank, node=0, local_rank=rank, launcher_pid=os.getppid())
        model, ranks = recipe.model, RankMap.identity(world, 1)
        self.data = _IndexedSamples(model, recipe.training.micro_batch_size)
        settings = RunnerSettings(model=model, micro_batch_size=recipe.training.micro_batch_size,
                                  optimizer=optimizer_config(recipe.training, model.params_dtype),
                                  lr_schedule=LrSchedule.of(recipe.training), op_timers=timers,
                                  collective_timeout=COLLECTIVE_TIMEOUT)
        self.runner = PlanRunner(plan=plan, program=program, rank=rank, ranks=ranks,
                                 state=initial_state(plan=plan, rank=rank, ranks=ranks, model=model, seed=1),
                                 settings=settings, on_phase=self._on_phase)
        self.guard.track(self.runner.groups.owned)
        self.commit_s: list[float] = []
        """Per step: this rank's commit (report, count in, wait for the decision)."""

    def _node_store(self):
        """The node's store stands in on the parent's (one node): a connection of its own."""
        store = self.store.clone()
        store.set_timeout(COLLECTIVE_TIMEOUT)
        return store

    def _on_phase(self, phase: Phase) -> None:
        self.phase = phase
        self.injector.fire(phase, self.step)

    def train_step(self, step: int) -> None:
        from odyssey_megatron.runtime.rank.live_step import train_step

        self.step, self.phase = step, Phase.forward
        train_step(self.runner, step=step, load=self.data.micro_batch, commit=self._commit)

    def _commit(self, step: int, losses: dict[int, float], samples: dict[int, list[int]]) -> None:
        from odyssey_megatron.runtime.rank.live_step import commit_step

        started = time.perf_counter()
        if not commit_step(ledger=self.ledger, rank=self.rank, step=step, losses=losses, samples=samples,
                           lr=self.runner.optimizer.lr, op_timers=self.timers, timeout=COLLECTIVE_TIMEOUT).committed:
            raise RuntimeError(f"step {step} did not commit")
        self.commit_s.append(time.perf_counter() - started)

    def close(self) -> None:
        self.guard.abandon()
        self.runner.release(abandoned=False)
        self.guard.uninstall()


def calibrated_seconds(rank: int, world: int, plan_json: str, overrides: list[str], pace: float) -> dict[str, float]:
    """The emulated device's forward and backward: ``pace`` times the slowest rank's mean
    op in a Megatron step unpaced on these ranks (after a warm-up step), so that the real
    work of ranks sharing the cores fits inside the paced time."""
    import torch.distributed as dist

    from odyssey_megatron.hooks.stage_optimizer import optimizer_config

    plan, recipe, timers = ExecutionPlan.from_json(plan_json), seven_b_recipe(overrides), PacedTimers({})
    megatron = MegatronStep(plan, rank, timers, model=recipe.model, micro_batch_size=recipe.training.micro_batch_size,
                            optimizer=optimizer_config(recipe.training, recipe.model.params_dtype))
    data = _IndexedSamples(recipe.model, recipe.training.micro_batch_size)
    for step in range(2):
        timers.take()
        megatron.train_step(lambda m, step=step: data.micro_batch(step, m))
    times = timers.take()
    mean = torch.tensor([times[name][0] / times[name][1] for name in (FORWARD, BACKWARD)], dtype=torch.float64)
    dist.all_reduce(mean, op=dist.ReduceOp.MAX)
    return {FORWARD: pace * float(mean[0]), BACKWARD: pace * float(mean[1])}


def one_side(rank: int, world: int, plan_json: str, overrides: list[str], side: str, seconds: dict[str, float],
             steps: int, generation: int) -> dict:
    """One side of a round in a world of its own (both sides do not fit in memory at once,
    and a process's exit is the one sure way to free a side): ``side`` (megatron or
    plugin) built, one warm-up step, then ``steps`` timed ones (barrier to barrier, the
    same on every rank). The plugin's runs as plan generation ``generation``."""
    import torch.distributed as dist

    from odyssey_megatron.hooks.stage_optimizer import optimizer_config

    plan = ExecutionPlan.from_json(plan_json)
    recipe = seven_b_recipe(overrides)
    timers = PacedTimers(seconds)
    if side == "megatron":
        data = _IndexedSamples(recipe.model, recipe.training.micro_batch_size)
        runner = MegatronStep(plan, rank, timers, model=recipe.model, micro_batch_size=recipe.training.micro_batch_size,
                              optimizer=optimizer_config(recipe.training, recipe.model.params_dtype))
        run = lambda s: runner.train_step(lambda m: data.micro_batch(s, m))  # noqa: E731
    else:
        # The worker's program for this plan (whole backwards, as Megatron's 1F1B; not staggered, as odyssey train).
        program = step_program(plan, uniform_profile(num_layers=recipe.model.num_layers),
                               pricing=Pricing(decouple=False, staggered=False))
        port = dist.distributed_c10d._get_default_store().underlying_store.port
        runner = LiveWorkerStep(plan=plan, program=program, rank=rank, world=world, generation=generation, port=port,
                                timers=timers, recipe=recipe)
        run = runner.train_step
    waits, guarded = [0], dist.Work.wait

    def counting(work, *args):
        waits[0] += 1
        return guarded(work, *args)

    times = []
    for step in range(steps + 1):
        dist.barrier()
        dist.Work.wait = counting if step else guarded
        started = time.perf_counter()
        run(step)
        ended = time.perf_counter()
        dist.Work.wait = guarded
        dist.barrier()
        if step:  # the first step warms up allocators and gloo connections
            times.append(ended - started)
    return {"times": times, "overruns": timers.overruns, "waits": waits[0] / steps,
            "commit": runner.commit_s[1:] if side == "plugin" else []}


def guard_wait_cost(rank: int, world: int, repeats: int) -> dict[str, float]:
    """Seconds one ``Work.wait`` of a small all-reduce costs, guarded and not (the guard's
    helper-thread hand-off), median of ``repeats`` each, alternated."""
    import torch.distributed as dist

    from odyssey_megatron.hooks.collective_guard import CollectiveGuard

    guard = CollectiveGuard(backend="gloo", timeout_s=COLLECTIVE_TIMEOUT.total_seconds())
    tensor = torch.ones(16)
    times: dict[str, list[float]] = {"direct": [], "guarded": []}
    for _ in range(repeats):
        for name in times:
            dist.barrier()
            if name == "guarded":
                guard.install()
            started = time.perf_counter()
            dist.all_reduce(tensor, async_op=True).wait()
            times[name].append(time.perf_counter() - started)
            guard.uninstall()
    return {name: statistics.median(t) for name, t in times.items()}


def print_overhead(blocks: int, steps_per_block: int, overrides: list[str] = SEVEN_B_OVERRIDES) -> None:
    recipe = seven_b_recipe(overrides)
    plan = with_sync(pipelines_plan([(1, 1)] * 2, [2, 2], worker_of=lambda d, s: s * 2 + d),
                     uniform_profile(num_layers=recipe.model.num_layers))
    seconds = run_world(calibrated_seconds, 4, plan.to_json(), overrides, SEVEN_B_PACE, timeout=3000)[0]
    sides: dict[str, list[list[dict]]] = {"megatron": [], "plugin": []}
    for block in range(blocks):
        for side in ("megatron", "plugin") if block % 2 == 0 else ("plugin", "megatron"):
            sides[side].append(run_world(one_side, 4, plan.to_json(), overrides, side, seconds, steps_per_block, block,
                                         timeout=3000))
    per_rank = [{"megatron": [t for b in sides["megatron"] for t in b[r]["times"]],
                 "plugin": [t for b in sides["plugin"] for t in b[r]["times"]],
                 "commit": [t for b in sides["plugin"] for t in b[r]["commit"]],
                 "overruns": [b[r]["overruns"] for side in sides.values() for b in side],
                 "waits": [b[r]["waits"] for b in sides["plugin"]],
                 "paced": [seconds[FORWARD], seconds[BACKWARD]]} for r in range(4)]
    overruns = sum(sum(r["overruns"]) for r in per_rank)
    megatron, plugin = per_rank[0]["megatron"], per_rank[0]["plugin"]  # barrier to barrier: the same on every rank
    # Step i of each side ran in the same round, the sides' order alternating: pairs cancel the drift.
    paired = sorted(p / m - 1 for p, m in zip(plugin, megatron))
    n = len(paired)
    # The last rank to count in waits for no one: its commit is the store's round trips.
    last_commit = statistics.median(min(r["commit"][i] for r in per_rank) for i in range(len(per_rank[0]["commit"])))
    waits = max(statistics.median(r["waits"]) for r in per_rank)
    wait_cost = run_world(guard_wait_cost, 2, 400, timeout=600)[0]
    guard_s = waits * (wait_cost["guarded"] - wait_cost["direct"])
    step_s = statistics.median(megatron)
    forward_s, backward_s = per_rank[0]["paced"]
    m = recipe.model
    print(f"DP2xPP2, Llama-2 7B-shaped layers (h{m.hidden_size}, ffn {m.ffn_hidden_size}, {m.num_attention_heads} "
          f"heads), one a stage, {plan.num_micro_batches} micro-batches of {recipe.training.micro_batch_size}x"
          f"{m.seq_length} tokens; forward/backward paced to {forward_s * 1e3:.0f} / {backward_s * 1e3:.0f} ms "
          f"(EMULATED: {SEVEN_B_PACE:g}x the slowest rank's real op here); {blocks} rounds x {steps_per_block} "
          f"steps = {n} pairs:")
    print(f"  Megatron (1F1B, DDP, its optimizer)     {step_s * 1e3:9.1f} ms/step")
    print(f"  plugin, the live worker's whole step    {statistics.median(plugin) * 1e3:9.1f} ms/step")
    print(f"  overhead  {statistics.median(paired) * 100:+6.2f} % (median of {n} paired ratios, from "
          f"{paired[0] * 100:+.2f} to {paired[-1] * 100:+.2f} %, quartiles {_quartiles(paired)}; target at most 1 %; "
          f"{overruns:.0f} paced ops overran)")
    print(f"  commit (report, count in, decision) of the last rank to count in: {last_commit * 1e3:.2f} ms a step "
          f"({last_commit / step_s * 100:.3f} %)")
    print(f"  guard: {waits:.0f} Work.waits a step on the busiest rank; one guarded wait {wait_cost['guarded'] * 1e6:.0f} "
          f"us against {wait_cost['direct'] * 1e6:.0f} us direct (a small all-reduce on 2 ranks): about "
          f"{guard_s * 1e3:.1f} ms a step ({guard_s / step_s * 100:.3f} %)")


def _quartiles(values: list[float]) -> str:
    q = statistics.quantiles(values, n=4) if len(values) > 1 else values * 3
    return f"{q[0] * 100:+.2f} / {q[2] * 100:+.2f} %"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=4, help="section 4's rounds (each builds both sides)")
    parser.add_argument("--steps-per-round", type=int, default=3, help="section 4's timed steps per side and round")
    parser.add_argument("--only-overhead", action="store_true", help="run section 4 only")
    parser.add_argument("--smoke", action="store_true",
                        help=f"CI's check that it runs: sections 1-3 on h{SMOKE_MODEL.hidden_size} layers, section 4 "
                             f"on an h{SMOKE_HIDDEN} one, one step or repeat each, one round")
    args = parser.parse_args()
    model, overrides = MODEL, SEVEN_B_OVERRIDES
    if args.smoke:
        model, overrides = SMOKE_MODEL, layer_overrides(SMOKE_HIDDEN)
        args.steps, args.repeats, args.rounds, args.steps_per_round = 1, 1, 1, 1
    if args.only_overhead:
        print_overhead(args.rounds, args.steps_per_round, overrides)
        return

    symmetric = _plan([(4, 4)] * 2, [8, 8], workers_of=lambda d, s: s * 2 + d)
    step = _medians(run_world(executor_vs_megatron, 4, symmetric.to_json(), args.steps, model, timeout=900))
    print(f"DP2xPP2, 8 layers h{model.hidden_size}, 16 micro-batches, {args.steps} steps (median of slowest rank):")
    print(f"  Megatron 1F1B   {step['megatron'] * 1e3:8.1f} ms/step")
    print(f"  Odyssey ops     {step['odyssey'] * 1e3:8.1f} ms/step")
    print(f"  overhead        {(step['odyssey'] / step['megatron'] - 1) * 100:+8.2f} %")
    print(f"  Megatron 1F1B with DP sync overlapped: {step['megatron+overlap'] * 1e3:.1f} ms/step "
          f"({(step['megatron+overlap'] / step['megatron'] - 1) * 100:+.2f} %)")

    profile = uniform_profile(num_layers=MODEL.num_layers)
    rerouted = with_sync(reroute_plan(symmetric, failed_workers={3}, profile=profile), profile)
    timing = step_schedule(rerouted, profile, pricing=Pricing(decouple=True, staggered=True))
    predicted = step_time(rerouted, profile, None, timing, staggered=True) / timing.makespan_s - 1
    stagger = _medians(run_world(staggered_vs_synchronous, 3, rerouted.to_json(), args.steps, model, timeout=900))
    print("The same plan, its last stage of pipeline 1 failed and rerouted, 3 ranks, split backwards:")
    print(f"  synchronous steps {stagger['synchronous'] * 1e3:8.1f} ms/step")
    print(f"  staggered steps   {stagger['staggered'] * 1e3:8.1f} ms/step "
          f"({(stagger['staggered'] / stagger['synchronous'] - 1) * 100:+.2f} %; the estimator predicts "
          f"{predicted * 100:+.2f} % for these op lists on dedicated devices, uniform layer times)")

    asymmetric = _plan([(4, 4), (3, 3, 2)], [6, 4])
    per_layer = one_layer_at_a_time(asymmetric)
    sync = _medians(run_world(sync_rounds, 5, asymmetric.to_json(), args.repeats, model, timeout=900))
    print(f"[4,4] + [3,3,2] over 5 ranks, DP gradient sync ({args.repeats} repeats):")
    print(f"  coloured rounds {sync['coloured'] * 1e3:8.1f} ms  ({len(asymmetric.comm_rounds)} rounds, "
          f"{sum(len(u.workers) > 1 for u in asymmetric.sync_units)} all-reduces)")
    print(f"  per layer       {sync['per-layer'] * 1e3:8.1f} ms  ({len(per_layer.comm_rounds)} all-reduces in a row)")
    print(f"  speed-up        {sync['per-layer'] / sync['coloured']:8.2f} x")

    print_overhead(args.rounds, args.steps_per_round, overrides)


if __name__ == "__main__":
    main()
