"""Rank functions for the runtime tests (importable by spawned processes)."""

from __future__ import annotations

import json

import torch

from megatron.core.optimizer import OptimizerConfig

from odyssey_megatron.config import ModelConfig, TrainingConfig
from odyssey_megatron.data import SyntheticTokens
from odyssey_megatron.blocks import StageSpec
from odyssey_megatron.hooks.global_weights import global_name
from odyssey_megatron.hooks.model import build_stage_model
from odyssey_megatron.hooks.process_groups import RankMap
from odyssey_megatron.schedules.program import read_published

TINY = dict(num_layers=6, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4, num_query_groups=2,
            vocab_size=128, seq_length=16, params_dtype="fp32")
MICRO_BATCH_SIZE = 2
SEED = 11
LR = 1e-3
MAX_GRAD_NORM = 0.5
WEIGHT_DECAY = 0.1
OPTIMIZER = OptimizerConfig(lr=LR, clip_grad=MAX_GRAD_NORM, weight_decay=WEIGHT_DECAY)
"""What every rank's Megatron optimizer runs with: AdamW, norms and biases without decay."""
LR_SCHEDULE_TRAINING = TrainingConfig(lr=LR, weight_decay=WEIGHT_DECAY)
"""A recipe's training section with that learning rate and weight decay, constant."""
STEPS = 3


def tiny_model(num_layers: int, tie_embeddings: bool = False) -> ModelConfig:
    return ModelConfig(**{**TINY, "num_layers": num_layers, "tie_embeddings": tie_embeddings})


def runner_settings(model: ModelConfig, **fields):
    """``PlanRunner``'s settings for ``model`` at the tests' micro-batch size and optimizer;
    ``fields`` sets the others (schedule, emulation, ...)."""
    from odyssey_megatron.hooks.lr_schedule import LrSchedule
    from odyssey_megatron.runtime.rank.plan_runner import RunnerSettings

    return RunnerSettings(model=model, micro_batch_size=MICRO_BATCH_SIZE, optimizer=OPTIMIZER,
                          lr_schedule=LrSchedule.of(LR_SCHEDULE_TRAINING), **fields)


def data() -> SyntheticTokens:
    return SyntheticTokens(TINY["vocab_size"], TINY["seq_length"], MICRO_BATCH_SIZE, seed=SEED)


def _snapshot(model: torch.nn.Module, layer_offset: int, grads: bool) -> dict[str, torch.Tensor]:
    tied = getattr(model, "share_embeddings_and_output_weights", False)
    return {
        global_name(name, layer_offset, tied=tied): (p.grad if grads else p).detach().clone()
        for name, p in model.named_parameters()
    }


def reference(rank: int, world_size: int, num_layers: int, num_micro_batches: int, tie_embeddings: bool,
              steps: int = STEPS) -> dict:
    """One process, the whole model, every micro-batch: loss / M per micro-batch, global
    norm clipping (first-step grads are taken after it), AdamW with decay on matrices only
    (final moments too)."""
    import torch.distributed as dist
    from megatron.core.process_groups_config import ProcessGroupCollection

    one = dist.new_group([0])
    pgc = ProcessGroupCollection(tp=one, cp=one, pp=one, ep=one, expt_dp=one, embd=None, pos_embd=None,
                                 dp=one, dp_cp=one)
    model = build_stage_model(tiny_model(num_layers, tie_embeddings), StageSpec((0, num_layers), True, True), pg_collection=pgc,
                              seed=SEED)
    matrices = [p for p in model.parameters() if p.dim() > 1]
    vectors = [p for p in model.parameters() if p.dim() == 1]
    optimizer = torch.optim.AdamW([{"params": matrices, "weight_decay": WEIGHT_DECAY},
                                   {"params": vectors, "weight_decay": 0.0}], lr=LR)
    source, losses, first_grads, clipped = data(), [], None, 0
    for step in range(steps):
        optimizer.zero_grad(set_to_none=True)
        step_losses = {}
        for m in range(num_micro_batches):
            batch = source.micro_batch(step, m)
            logits = model(batch["tokens"], batch["position_ids"], None)
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), batch["labels"].reshape(-1))
            (loss / num_micro_batches).backward()
            step_losses[m] = loss.item()
        losses.append(step_losses)
        clipped += float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_GRAD_NORM)) > MAX_GRAD_NORM
        if first_grads is None:
            first_grads = _snapshot(model, 0, grads=True)
        optimizer.step()
    moments = {kind: {global_name(name, 0, tied=tie_embeddings): optimizer.state[p][kind].clone()
                      for name, p in model.named_parameters()} for kind in ("exp_avg", "exp_avg_sq")}
    return {"losses": losses, "grads": first_grads, "params": _snapshot(model, 0, grads=False), "clipped": clipped,
            **moments}


def run_plan(
    rank: int, world_size: int, published: str, workers: tuple[int, ...], schedule: str, tie_embeddings: bool,
    overlap: bool, distributed_optimizer: bool = False,
) -> dict:
    """Train STEPS steps of the ``published`` plan (its JSON alone: the plan and its step
    program) on this rank; report losses, first-step grads (synced and clipped;
    staggered: synced, and clipped only later, if at all), final params, and how many
    elements the optimizer steps here against the stage's parameters."""
    from odyssey_megatron.runtime.rank.plan_runner import PlanRunner, initial_state

    plan, program = read_published(json.loads(published))
    ranks, model = RankMap.of(workers, plan.tensor_parallel_size), tiny_model(plan.num_layers, tie_embeddings)
    runner = PlanRunner(
        plan=plan,
        program=program,
        rank=rank,
        ranks=ranks,
        state=initial_state(plan=plan, rank=rank, ranks=ranks, model=model, seed=SEED),
        settings=runner_settings(model, schedule=schedule, overlap_grad_sync=overlap,
                                 distributed_optimizer=distributed_optimizer),
    )
    source, losses, first_grads, early = data(), [], None, []
    for step in range(STEPS):
        step_losses = runner.forward_backward(lambda m, step=step: source.micro_batch(step, m))
        early.append((runner.grad_sync.in_flight, runner.grad_sync.num_units))
        result = runner.finish_step(step_losses, step=step)
        losses.append(result.losses)
        if first_grads is None:
            first_grads = _snapshot(runner.model, runner.stage.layers[0], grads=True)
    runner.settle()
    return {
        "losses": losses,
        "grads": first_grads,
        "params": _snapshot(runner.model, runner.stage.layers[0], grads=False),
        "tp_rank": runner.tp_rank,
        "tp_size": plan.tensor_parallel_size,
        "ops": len(runner.ops),
        "weight_grad_ops": sum(op.kind == "W" for op in runner.ops),
        "started_during_backward": early,
        "retaken_steps": runner.retaken_steps,
        "stepped_elements": (sum(p.numel() for p in runner.optimizer.megatron.get_parameters()),
                             sum(p.numel() for p in runner.model.parameters())),
    }


def last_stage_steps_first(rank: int, world_size: int, published: str, marker: str) -> bool:
    """The last stage writes ``marker`` once it has taken its first optimizer step; the
    first stages, before taking their own, wait for the marker (a few seconds when no
    staggering is expected). Returns whether this rank saw it (a last stage: False)."""
    import os
    import time

    from odyssey_megatron.runtime.rank.plan_runner import PlanRunner, initial_state

    plan, program = read_published(json.loads(published))
    ranks, model = RankMap.identity(world_size, 1), tiny_model(plan.num_layers)
    runner = PlanRunner(
        plan=plan, program=program, rank=rank, ranks=ranks,
        state=initial_state(plan=plan, rank=rank, ranks=ranks, model=model, seed=SEED),
        settings=runner_settings(model),
    )
    source, seen = data(), False
    losses = runner.forward_backward(lambda m: source.micro_batch(0, m))
    if runner.stage.last:
        runner.finish_step(losses, step=0)
        with open(marker, "w"):
            pass
    else:
        deadline = time.monotonic() + (60 if program.staggered_optimizer else 3)
        while not (seen := os.path.exists(marker)) and time.monotonic() < deadline:
            time.sleep(0.05)
        runner.finish_step(losses, step=0)
    runner.train_step(lambda m: source.micro_batch(1, m), step=1)
    runner.settle()
    return seen


def timed_steps(rank: int, world_size: int, cases: list) -> list[dict]:
    """For each (published plan JSON, ``runtime.rank.emulation.DeviceEmulation`` or None), two
    training steps, each timed from a barrier to the end of its optimizer step; reports
    the second step's seconds and how far the worst op overran its emulated time."""
    import time

    import torch.distributed as dist

    from odyssey_megatron.runtime.rank.plan_runner import PlanRunner, initial_state

    results = []
    for published, emulation in cases:
        plan, program = read_published(json.loads(published))
        ranks, model = RankMap.identity(world_size, 1), tiny_model(plan.num_layers)
        runner = PlanRunner(
            plan=plan, program=program, rank=rank, ranks=ranks,
            state=initial_state(plan=plan, rank=rank, ranks=ranks, model=model, seed=SEED),
            settings=runner_settings(model, emulation=emulation),
        )
        source, seconds = data(), []
        for step in range(2):
            dist.barrier()
            start = time.monotonic()
            runner.train_step(lambda m, step=step: source.micro_batch(step, m), step=step)
            seconds.append(time.monotonic() - start)
        results.append({"step_s": seconds[-1], "worst_overrun_s": getattr(runner.clock, "worst_overrun_s", 0.0)})
        runner.groups.destroy()
    return results


def resident_bytes() -> int:
    """This process's resident memory (Linux)."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def repeated_generations(rank: int, world_size: int, published: str, generations: int,
                         model_fields: str = "{}") -> dict:
    """What a survivor does on every recovery, ``generations`` times: a fresh default
    group on the generation's store prefix, the stage built from the blocks it holds, a
    step, then the groups destroyed and the stage dropped (``PlanRunner.release``, as the
    training worker does). ``model_fields`` (JSON) overrides fields of the tiny model.
    Returns ``resident``, the resident bytes after each release, ``copy_bytes``, the
    bytes of one copy of the stage's parameters, and after each release ``tensors``, the
    tensors alive (made since the long-lived objects were frozen), and ``groups``, the
    process groups of every generation so far that are still alive (each group is seen in
    torch's registry while its generation runs, then weakly held)."""
    import ctypes
    import datetime
    import gc
    import weakref

    import torch.distributed as dist

    from odyssey_megatron.runtime.protocol.keys import process_group_prefix
    from odyssey_megatron.runtime.rank.plan_runner import PlanRunner, initial_state

    # Tensors over 128 KiB from mmap, whose free returns them to the kernel: glibc's
    # default raises that threshold as they are freed, after which their reuse fragments
    # the heap and resident memory grows (~15 MiB a generation on a 90 MiB stage) with no
    # object kept alive. Here resident memory measures what stays referenced.
    ctypes.CDLL("libc.so.6").mallopt(-3, 128 * 1024)  # M_MMAP_THRESHOLD
    plan, program = read_published(json.loads(published))
    ranks = RankMap.identity(world_size, 1)
    model = ModelConfig(**{**TINY, "num_layers": plan.num_layers, **json.loads(model_fields)})
    store = dist.distributed_c10d._get_default_store()
    state = initial_state(plan=plan, rank=rank, ranks=ranks, model=model, seed=SEED)
    settings = runner_settings(model)
    source, resident, copy_bytes = data(), [], 0
    tensors, groups, seen = [], [], weakref.WeakSet()
    gc.freeze()  # as the worker does once its long-lived objects are loaded
    for generation in range(1, generations + 1):
        dist.destroy_process_group()
        dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=120),
                                store=dist.PrefixStore(process_group_prefix(generation), store))
        runner = PlanRunner(plan=plan, program=program, rank=rank, ranks=ranks, state=state, settings=settings)
        runner.train_step(lambda m, step=generation: source.micro_batch(step, m), step=generation)
        runner.settle()
        copy_bytes = sum(p.numel() * p.element_size() for p in runner.model.parameters())
        seen.update(dist.distributed_c10d._world.pg_map)
        state = runner.release(abandoned=generation % 2 == 0)
        del runner
        gc.collect()
        resident.append(resident_bytes())
        tensors.append(sum(isinstance(o, torch.Tensor) for o in gc.get_objects()))
        groups.append(len(seen))
    return {"resident": resident, "copy_bytes": copy_bytes, "tensors": tensors, "groups": groups}


def op_times(rank: int, world_size: int, published: str, schedule: str) -> dict:
    """Two training steps with ``runtime.rank.op_timers`` hooked into Megatron's configs;
    what the timers took after each step, and where they placed the rank (``position``)."""
    from odyssey_megatron.runtime.rank.op_timers import OpTimers
    from odyssey_megatron.runtime.rank.plan_runner import PlanRunner, initial_state

    plan, program = read_published(json.loads(published))
    ranks, model = RankMap.identity(world_size, 1), tiny_model(plan.num_layers)
    timers = OpTimers(torch.device("cpu"))
    runner = PlanRunner(
        plan=plan, program=program, rank=rank, ranks=ranks,
        state=initial_state(plan=plan, rank=rank, ranks=ranks, model=model, seed=SEED),
        settings=runner_settings(model, schedule=schedule, op_timers=timers),
    )
    source, taken, positions = data(), [], []
    for step in range(2):
        timers.begin_step(step)
        runner.train_step(lambda m, step=step: source.micro_batch(step, m), step=step)
        runner.settle()
        taken.append(timers.take())
        positions.append(timers.position)
    runner.groups.destroy()
    return {"worker": runner.worker, "executor": type(runner.executor).__name__, "taken": taken,
            "positions": positions, "ops": len(program.ops_of(runner.worker))}
