"""What each rank writes when the controller is lost (issue 42): before, every rank wrote
every block it held; now each (block, TP rank) is written by one replica, spread over the
data-parallel replicas by bytes as the in-memory snapshots are (``snapshot.shards.owners``,
the rule ``runtime.rank.stopping.save_held`` follows).

1. Llama-2 7B at PP2 (``recipes/llama2_7b/gpu_h100_8.yaml``: DP4 x PP2 x TP1, its starting
   plan as ``DecisionCenter.from_recipe`` builds it): per rank, the bytes of the blocks it
   writes, each block's state as the transfers and snapshots emulate it
   (``blocks.block_bytes``: fp32 weights and both Adam moments of its TP shard, and the step
   counter), for every block held (before) and for the rank's share (after).
2. Measured on disk: the same two choices written as the worker writes them
   (``runtime.checkpoint.save_part``, DCP files and the part's manifest) for the same
   layout at a model this machine's disk holds (7B's 32 layers at hidden ``--hidden``, 128
   by default, its FFN and vocabulary scaled alike; ``--smoke``: the tiny CPU recipe's
   model), the bytes of each rank's part directory summed.

Measured 2026-11-28 (this machine, 38 s): 7B, 8 ranks: before 40.43 GB on every rank (a
stage: 16 layers of 2.43 GB and the embedding or the output block of 1.57 GB), after at
most 11.29 GB (four layers and the embedding; the other replicas 9.71 GB): 0.279 of
before, against 1/DP = 0.250 (the blocks do not split evenly four ways). On disk at
hidden 128: the largest part 40.10 MB before, 11.19 MB after (0.279); all parts 320.74 MB
before, 80.19 MB after.

Run: .venv/bin/python benchmarks/controller_loss_save.py [--hidden H] [--smoke]
It ends with one JSON line: {"controller_loss_save": {...}}.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from odyssey_megatron.blocks import StageSpec, block_bytes, worker_blocks
from odyssey_megatron.config import load_config
from odyssey_megatron.decision_center import DecisionCenter
from odyssey_megatron.hooks.training_state import TrainingState
from odyssey_megatron.run_dir import private_directory
from odyssey_megatron.runtime.checkpoint import save_part
from odyssey_megatron.snapshot.shards import owners

ROOT = Path(__file__).resolve().parents[1]
SEVEN_B = ROOT / "recipes/llama2_7b/gpu_h100_8.yaml"
TINY = ROOT / "recipes/llama2_7b/tiny_cpu.yaml"


def starting_plan(config):
    """The recipe's symmetric DP x PP plan (``DecisionCenter.from_recipe``'s)."""
    return DecisionCenter.from_recipe(config).plan


def choices(plan, model) -> dict[int, tuple[list, list]]:
    """Worker -> (every block it holds, the blocks it writes now)."""
    writers = owners(plan, model)
    return {w: (worker_blocks(plan, w, tied=model.tie_embeddings),
                [b for b, writer in writers.items() if writer == w]) for w in plan.workers}


def computed(config) -> dict:
    """Part 1: per worker, the bytes before and after, from the blocks' emulated state."""
    plan, model, tp = starting_plan(config), config.model, config.parallel.tensor_model_parallel_size
    rows = {}
    for worker, (held, mine) in choices(plan, model).items():
        rows[worker] = (sum(block_bytes(model, b, tp) for b in held), sum(block_bytes(model, b, tp) for b in mine))
    return rows


def on_disk(config) -> dict:
    """Part 2: per worker, the bytes of the part ``save_part`` writes, before and after."""
    plan, model = starting_plan(config), config.model
    rows = {}
    with tempfile.TemporaryDirectory() as scratch:
        for side in ("before", "after"):
            run_dir = Path(scratch) / side
            private_directory(run_dir)
            for worker, (held, mine) in choices(plan, model).items():
                state = TrainingState.initial(model, StageSpec.of_worker(plan, worker), seed=1, tp_rank=0, tp_size=1)
                save_part(run_dir, state, held if side == "before" else mine, step=0, rank=worker, tp_rank=0,
                          tp_size=1, model=model)
                part = run_dir / "checkpoint" / "step-0" / f"rank-{worker}"
                written = sum(f.stat().st_size for f in part.rglob("*") if f.is_file())
                rows.setdefault(worker, [0, 0])[0 if side == "before" else 1] = written
    return rows


def scaled_down(model, hidden: int) -> list[str]:
    """Overrides for ``model`` at ``hidden``, its FFN and vocabulary scaled alike: a layer
    grows with hidden squared and the embedding with vocabulary times hidden, so the
    embedding weighs against the layers as in the model itself."""
    return [f"model.hidden_size={hidden}", f"model.ffn_hidden_size={model.ffn_hidden_size * hidden // model.hidden_size}",
            f"model.vocab_size={model.vocab_size * hidden // model.hidden_size}", "model.num_attention_heads=4",
            "model.num_query_groups=4", "model.params_dtype=fp32"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=128, help="hidden size of the model written to disk")
    parser.add_argument("--smoke", action="store_true", help="the tiny CPU recipe's model on disk (seconds)")
    args = parser.parse_args()
    seven_b = load_config(SEVEN_B)
    par = seven_b.parallel
    dp = par.data_parallel_size
    print(f"controller-loss save, Llama-2 7B ({SEVEN_B.relative_to(ROOT)}): DP{dp} x "
          f"PP{par.pipeline_model_parallel_size} x TP{par.tensor_model_parallel_size}, each block's state as "
          f"blocks.block_bytes emulates it")
    rows = computed(seven_b)
    print(f"{'worker':>6} {'before GB':>10} {'after GB':>9}")
    for worker, (before, after) in sorted(rows.items()):
        print(f"{worker:>6} {before / 1e9:>10.2f} {after / 1e9:>9.2f}")
    most_before, most_after = max(b for b, _ in rows.values()), max(a for _, a in rows.values())
    ratio = most_after / most_before
    print(f"largest per rank: before {most_before / 1e9:.2f} GB, after {most_after / 1e9:.2f} GB: {ratio:.3f} of "
          f"before (1/DP = {1 / dp:.3f})")
    if args.smoke:
        small = load_config(TINY, [f"parallel.data_parallel_size={dp}",
                                   f"parallel.pipeline_model_parallel_size={par.pipeline_model_parallel_size}"])
    else:
        small = load_config(SEVEN_B, scaled_down(seven_b.model, args.hidden))
    disk = on_disk(small)
    disk_before, disk_after = max(b for b, _ in disk.values()), max(a for _, a in disk.values())
    disk_ratio = disk_after / disk_before
    print(f"on disk (save_part, hidden {small.model.hidden_size}, {small.model.num_layers} layers): largest part "
          f"before {disk_before / 1e6:.2f} MB, after {disk_after / 1e6:.2f} MB: {disk_ratio:.3f} of before; all "
          f"parts {sum(b for b, _ in disk.values()) / 1e6:.2f} MB before, {sum(a for _, a in disk.values()) / 1e6:.2f}"
          f" MB after")
    print(json.dumps({"controller_loss_save": {
        "model": "llama2-7b", "dp": dp, "pp": par.pipeline_model_parallel_size,
        "max_bytes_per_rank_before": most_before, "max_bytes_per_rank_after": most_after, "ratio": ratio,
        "one_over_dp": 1 / dp, "disk_hidden": small.model.hidden_size, "disk_max_bytes_before": disk_before,
        "disk_max_bytes_after": disk_after, "disk_ratio": disk_ratio}}))


if __name__ == "__main__":
    main()
