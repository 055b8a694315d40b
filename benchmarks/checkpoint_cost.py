"""What the default disk checkpoint costs the step, as a share of it (issue 42: at most 1 %).

One CPU process plays the rank that writes the largest share of the recipe's checkpoint
(``snapshot.shards.owners``: its worker's blocks, as ``runtime.rank.training_loop`` picks
them), its blocks drawn at the recipe's shapes (``TrainingState.initial``). A step is a
fixed amount of real compute (matmuls of the model's hidden size, calibrated once to last
the estimator's step time for the recipe, at least ``MIN_STEP_S``), followed by an in-place
update of every block tensor (the optimizer step, which the checkpoint's copy must not see).
With checkpoints, every ``interval`` steps (the recipe's default: ``decision_center.
checkpoint_interval``, Young's, or ``--interval``) the step starts with the package's
``CheckpointWriter.start`` (the copy into its reused host buffers: plain CPU memory here,
pinned on a GPU), whose thread then writes the part (``write_part``: DCP, fsynced, manifest
last) into a temporary run directory while the steps go on. Without: the same steps.
Each round times ``interval x --intervals`` steps on each side, the first side alternating;
the figure is the median over rounds of (with / without - 1). Beside it: the copy's seconds
(what the step waits for), the background write's, and the share the copy alone predicts
(copy / (interval x step)).

Measured 2026 (shared 2-core CPU, other sessions' tests beside it, load average about 2.5;
defaults: tiny_cpu.yaml, Young's interval 143 steps, 5 rounds of 286 steps a side, 1 min 44 s):
the rank writing the largest share (worker 6, 0.99 MB) steps in 32.8 ms without checkpoints
and 33.7 ms with: +1.02 % (an earlier run under heavier load: +0.51 %). The copy the step
waits for takes 0.74 ms, which predicts 0.016 % (copy / (143 x 32.8 ms)); the background
write takes 11.5 ms alone, 0.25 % of the interval if it took a core from the steps outright:
the rest of the figure is the noise of a shared machine, as the two runs' spread shows.

Not included: a device's copy to pinned memory (there is no device here: the copy is a host
memcpy), a parallel filesystem (the write goes to this machine's disk), the other ranks of
the node sharing its disk bandwidth.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

from odyssey_megatron.blocks import StageSpec, block_bytes
from odyssey_megatron.config import load_config
from odyssey_megatron.decision_center import DecisionCenter, checkpoint_interval
from odyssey_megatron.hooks.accelerator import select_accelerator
from odyssey_megatron.hooks.training_state import TrainingState
from odyssey_megatron.run_dir import private_directory
from odyssey_megatron.runtime.rank.checkpoint_writer import CheckpointWriter
from odyssey_megatron.snapshot.shards import owners, shard_blocks

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes" / "llama2_7b" / "tiny_cpu.yaml"
MIN_STEP_S = 0.02
"""The shortest step timed: below it, timer noise and the scheduler's turns dominate."""


class Step:
    """A fixed amount of compute lasting about ``seconds`` alone, then the optimizer's update."""

    def __init__(self, hidden: int, seconds: float, tensors: list[torch.Tensor]):
        size = max(hidden, 256)  # a tiny model's matmuls are too short to time
        self.a, self.b = torch.rand(size, size), torch.rand(size, size)
        self.tensors = tensors
        calls, started = 0, time.perf_counter()
        while time.perf_counter() - started < 0.2:
            torch.mm(self.a, self.b)
            calls += 1
        self.repeats = max(1, round(seconds / ((time.perf_counter() - started) / calls)))

    def run(self) -> None:
        for _ in range(self.repeats):
            torch.mm(self.a, self.b)
        for tensor in self.tensors:
            tensor.mul_(0.999)


def timed_steps(step: Step, steps: int, *, at_start=None) -> float:
    started = time.perf_counter()
    for i in range(steps):
        if at_start is not None and i % at_start[0] == 0:
            at_start[1](i)
        step.run()
    return time.perf_counter() - started


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", type=Path, default=RECIPE)
    parser.add_argument("--interval", type=int, default=None, help="steps between checkpoints (default: the recipe's)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--intervals", type=int, default=2, help="checkpoint intervals timed per side and round")
    parser.add_argument("--smoke", action="store_true", help="one round of one interval of at most 20 steps")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    config = load_config(args.recipe)
    center = DecisionCenter.from_recipe(config)
    default, how = checkpoint_interval(config, center)
    interval = args.interval or default
    if args.smoke:
        args.rounds, args.intervals, interval = 1, 1, min(interval, 20)
    if interval <= 0:
        print(f"the recipe takes no checkpoints ({how})", file=sys.stderr)
        return 2
    plan, model = center.plan, config.model
    owned = owners(plan, model)
    tp = plan.tensor_parallel_size
    share = {w: sum(block_bytes(model, b, tp) for b in shard_blocks(owned, w)) for w in set(owned.values())}
    worker = max(share, key=lambda w: (share[w], -w))
    blocks = shard_blocks(owned, worker)
    state = TrainingState.initial(model, StageSpec.of_worker(plan, worker), seed=1, tp_rank=0, tp_size=tp)
    tensors = [t for b in state.held() for t in state.export(b).values() if t.is_floating_point()]
    step_s = max(MIN_STEP_S, center.estimate.step_time_s)
    step = Step(model.hidden_size, step_s, tensors)
    cpu = select_accelerator("cpu")
    with tempfile.TemporaryDirectory() as scratch:
        run_dir = Path(scratch) / "run"
        private_directory(run_dir)
        writer = CheckpointWriter(run_dir, rank=0, tp_rank=0, tp_size=tp, model=model, store=dist.HashStore(),
                                  host_buffer=cpu.host_buffer, synchronize=cpu.synchronize)
        copies: list[float] = []
        writes: list[float] = []

        def checkpoint(i: int) -> None:
            started = time.perf_counter()
            writer.start(state, blocks, step=i + 1, generation=len(copies))
            copies.append(time.perf_counter() - started)

        def write_alone() -> float:
            started = time.perf_counter()
            writer.wait()
            return time.perf_counter() - started

        checkpoint(0)  # the buffers are made once: the first copy allocates them
        writes.append(write_alone())
        steps = interval * args.intervals
        ratios, without_s, with_s = [], [], []
        for round_ in range(args.rounds):
            sides = {}
            for side in (("without", "with") if round_ % 2 == 0 else ("with", "without")):
                at_start = (interval, checkpoint) if side == "with" else None
                sides[side] = timed_steps(step, steps, at_start=at_start)
                if side == "with":
                    writer.wait()
            ratios.append(sides["with"] / sides["without"] - 1)
            without_s.append(sides["without"] / steps)
            with_s.append(sides["with"] / steps)
        checkpoint(0)
        writes.append(write_alone())
    step_measured = statistics.median(without_s)
    copy_s = statistics.median(copies[1:])
    summary = {"checkpoint_cost_pct": round(100 * statistics.median(ratios), 3), "target_pct": 1.0,
               "interval": interval, "interval_chosen": how, "step_s": round(step_measured, 4),
               "step_with_s": round(statistics.median(with_s), 4), "copy_s": round(copy_s, 5),
               "copy_predicted_pct": round(100 * copy_s / (interval * step_measured), 3),
               "write_alone_s": round(min(writes), 4), "share_bytes": share[worker], "rounds": args.rounds,
               "steps_per_side": steps, "recipe": args.recipe.name}
    print(f"checkpoint every {interval} steps ({how}); worker {worker} writes {share[worker] / 1e6:.2f} MB")
    print(f"step {step_measured * 1e3:.1f} ms without, {statistics.median(with_s) * 1e3:.1f} ms with; copy "
          f"{copy_s * 1e3:.2f} ms, background write {min(writes) * 1e3:.1f} ms alone")
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
