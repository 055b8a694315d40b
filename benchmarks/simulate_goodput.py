"""Which fault-tolerance approach trains the most per device-hour paid (issue 33).

Llama-2 7B (Ascend 910B, TP1 x PP4, 8 micro-batches per pipeline) and 70B (H100, TP8 x
PP8, 64 per pipeline) at 1,024 and 16,384 devices; failure rates from Llama 3's 16k-GPU
run (419 unexpected interruptions in 54 days on 16,384 GPUs: 1.97e-5 per GPU-hour) and
from paper 001 (10 % per device-hour); device or node failures; without and with repairs
(mean 2 h). Every cell runs every system on the same seeded events. Durations scale with
the rate (``cell_hours``): the shortest time that holds --failures expected failure events
and --repairs expected completed repairs (with and without repairs alike, so the two rows
cover the same hours), at most a week; the hours column says what each cell covers. Cells with the same inputs (with and
without repairs, where no repair comes within the cell) are simulated once. --cells
picks cells by label (e.g. "7B 1024 L3 node"), to re-run part of the grid.
Prints goodput (samples per device-hour paid) per system; like against like, Odyssey's
goodput over the best batch-keeping system's and Odyssey with the opt-in smaller batch
(odyssey_shrink) over replica drop's; the samples each batch-shrinking system dropped, and
the ETTR; writes a markdown table and a figure of goodput relative to Odyssey per cell.
Run: .venv/bin/python benchmarks/simulate_goodput.py [--jobs 2] [--failures 4] [--repairs 4] [--out runs/goodput]
"""

from __future__ import annotations

import argparse
import itertools
import math
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path

from odyssey_megatron.errors import ConfigError
from odyssey_megatron.simulator.run import scenario_events, simulate
from odyssey_megatron.simulator.scenario import load_scenario

LLAMA3_RATE = 419 / (54 * 24 * 16384)
"""Llama 3 (Meta, 2024): 419 unexpected interruptions in 54 days on 16,384 H100s."""
PAPER_RATE = 0.1
"""Paper 001, section V-B: 10 % failures per device-hour."""
MODELS = {  # name: (recipe relative to the scenario, TP * PP, micro-batches per pipeline)
    "7B": ("../../recipes/llama2_7b/ascend_910b_32.yaml", 4, 8),
    "70B": ("../llama2_70b_h100_1024.yaml", 64, 64),
}
SYSTEMS = ("odyssey", "checkpoint", "replica_drop", "redistribute", "dp_scale_in", "hot_spares", "odyssey_shrink")
BATCH_KEEPING = ("checkpoint", "redistribute", "dp_scale_in", "hot_spares")
"""The systems Odyssey (``odyssey.batch_on_failure: keep``) is compared with: like it, they
train the job's whole batch. Odyssey with ``shrink`` is compared with replica drop: both
train a smaller batch after a failure."""
WEEK_H = 168.0
MEAN_REPAIR_H = 2.0
"""The scenario's repairs.mean_hours (configs/scenarios/paper_32npu.yaml's default)."""


def expected_repairs(hours: float, events_per_hour: float) -> float:
    """Repairs (exponential, mean MEAN_REPAIR_H) expected to complete within ``hours`` of
    failures at ``events_per_hour``: each failure at t is back by ``hours`` with
    probability 1 - exp(-(hours - t) / mean)."""
    return events_per_hour * (hours - MEAN_REPAIR_H * (1.0 - math.exp(-hours / MEAN_REPAIR_H)))


def cell_hours(devices: int, rate: float, *, failures: float, repairs: float) -> float:
    """Hours a cell covers, scaled with the rate: the shortest time in which ``failures``
    failure events are expected (a node fails 8x as often as a device, with 1/8 as many
    units: the same count either way) and ``repairs`` repairs are expected to complete,
    at most a week. With and without repairs alike, so the two rows cover the same hours."""
    events_per_hour = devices * rate
    if events_per_hour * WEEK_H < failures or expected_repairs(WEEK_H, events_per_hour) < repairs:
        return WEEK_H
    low, high = 0.0, WEEK_H  # both counts grow with the hours: bisect for the shortest
    for _ in range(60):
        middle = (low + high) / 2
        if events_per_hour * middle >= failures and expected_repairs(middle, events_per_hour) >= repairs:
            high = middle
        else:
            low = middle
    return high


def scenario_of(model: str, devices: int, rate: float, unit: str, repairs: bool, *, failures: float,
                expected_repairs: float, seed: int):
    """A cell's scenario and the hours it covers."""
    recipe, model_parallel, per_pipeline = MODELS[model]
    dp = devices // model_parallel
    hours = cell_hours(devices, rate, failures=failures, repairs=expected_repairs)
    scenario = load_scenario("configs/scenarios/paper_32npu.yaml", [
        f"recipe={recipe}",
        f"recipe_overrides=[parallel.data_parallel_size={dp},training.global_batch_size={per_pipeline * dp}]",
        f"failures.rate_per_device_hour={rate}", f"failures.unit={unit}", f"repairs.enabled={str(repairs).lower()}",
        f"repairs.mean_hours={MEAN_REPAIR_H}", f"duration_hours={hours}", f"seed={seed}", "wandb_mode=disabled",
        f"systems=[{','.join(SYSTEMS)}]",
    ])
    return scenario, hours


def cell(model: str, devices: int, rate: float, unit: str, repairs: bool, **lengths):
    scenario, hours = scenario_of(model, devices, rate, unit, repairs, **lengths)
    started = time.perf_counter()
    result = simulate(scenario)
    failures = sum(1 for e in result.events if e.kind == "fail")
    return hours, failures, result.summaries, result.ratios, time.perf_counter() - started


def distinct_cells(cells, **lengths) -> tuple[dict, dict]:
    """Each cell -> the first cell with the same inputs, simulated once for both: with and
    without repairs differ only in their events, the same where no repair comes within the
    hours a cell covers; and each cell past what a simulation lives through in bounded
    time (``limits.check_simulation_size``) -> why, not simulated."""
    inputs, refused = {}, {}
    for c in cells:
        try:
            inputs[c] = (*c[:4], tuple(scenario_events(scenario_of(*c, **lengths)[0])))
        except ConfigError as exc:
            refused[c] = str(exc)
    first = {}
    for c in inputs:
        first.setdefault(inputs[c], c)
    return {c: first[inputs[c]] for c in inputs}, refused


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--failures", type=float, default=4.0, help="expected failure events a cell holds at least")
    parser.add_argument("--repairs", type=float, default=4.0,
                        help="repairs a cell is expected to hold at least (where a week can hold them)")
    parser.add_argument("--cells", nargs="*", default=None,
                        help="only the cells with these labels, as the figure names them (e.g. '7B 1k L3 n')")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--jobs", type=int, default=1, help="cells simulated in parallel processes")
    parser.add_argument("--out", type=Path, default=Path("runs/goodput"), help="where table.md and goodput.png go")
    parser.add_argument("--smoke", action="store_true",
                        help="CI's check that it runs: one cell per model at 128 devices (70B's DP 2), paper 001's "
                             "rate, device failures, no repairs, one expected failure")
    args = parser.parse_args()
    started = time.perf_counter()
    if args.smoke:
        args.failures, args.repairs = 1.0, 0.0
        cells = list(itertools.product(MODELS, (128,), (PAPER_RATE,), ("device",), (False,)))
    else:
        cells = list(itertools.product(MODELS, (1024, 16384), (LLAMA3_RATE, PAPER_RATE), ("device", "node"),
                                       (False, True)))
    if args.cells is not None:
        cells = [c for c in cells if label(*c) in args.cells]
    lengths = dict(failures=args.failures, expected_repairs=args.repairs, seed=args.seed)
    same_as, refused = distinct_cells(cells, **lengths)
    for c, why in refused.items():
        print(f"not simulated: {label(*c)}: {why}")
    cells = [c for c in cells if c in same_as]
    distinct = sorted(dict.fromkeys(same_as.values()), key=lambda c: -c[1])  # the long 16,384-device cells first
    header = ("| model | devices | rate | unit | repairs | hours | failures | "
              + " | ".join(SYSTEMS) + " | best batch-keeping | odyssey/best | ETTR odyssey / best | "
              "odyssey_shrink/replica_drop | dropped samples |")
    with ProcessPoolExecutor(max_workers=args.jobs) as pool:
        futures = {pool.submit(cell, *c, **lengths): c for c in distinct}
        for done in as_completed(futures):  # each row as its cell ends: a long grid shows its progress
            print(f"{done.result()[4]:.0f} s: {row(futures[done], done.result())}", flush=True)
        result_of = {c: f.result() for f, c in futures.items()}
    results = [result_of[same_as[c]] for c in cells]
    lines = [header, "|" + "---|" * (header.count("|") - 1)] + [row(c, r) for c, r in zip(cells, results)]
    table = "\n".join(lines)
    print("goodput: samples trained per device-hour paid (spares included)")
    print(table)
    print(f"simulated {len(distinct)} distinct cells in {sum(r[4] for r in result_of.values()):.0f} s "
          f"of cell time, {time.perf_counter() - started:.0f} s of wall time")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "table.md").write_text(table + "\n")
    draw(cells, results, args.out / "goodput.png")
    print(f"wrote {args.out / 'table.md'} and {args.out / 'goodput.png'}")


def row(cell_inputs, result) -> str:
    """A cell's line of the table."""
    model, devices, rate, unit, repairs = cell_inputs
    hours, failures, summaries, ratios, _ = result
    best = max(BATCH_KEEPING, key=lambda s: summaries[s].goodput)
    ratio = ratios[best]
    drop = summaries["replica_drop"].goodput
    shrink_ratio = f"{summaries['odyssey_shrink'].goodput / drop:.3f}" if drop > 0 else "-"
    rate_name = "Llama 3" if rate == LLAMA3_RATE else "paper"
    return (f"| {model} | {devices:,} | {rate_name} | {unit} | {'yes' if repairs else 'no'} | {hours:.2f} | "
            f"{failures} | " + " | ".join(f"{summaries[s].goodput:,.0f}" for s in SYSTEMS)
            + f" | {best} | {'-' if ratio is None else f'{ratio:.3f}'} | "
            f"{summaries['odyssey'].ettr:.3f} / {summaries[best].ettr:.3f} | {shrink_ratio} | {dropped(summaries)} |")


def label(model: str, devices: int, rate: float, unit: str, repairs: bool) -> str:
    """A cell's short name, as the figure prints it and --cells reads it."""
    return f"{model} {devices // 1024}k {'L3' if rate == LLAMA3_RATE else 'p'} {unit[0]}{' +r' if repairs else ''}"


def dropped(summaries) -> str:
    """The samples each system that shrank its batch left out, beside its goodput."""
    shrinking = [f"{name} {summaries[name].dropped_samples / 1e6:.2f} M" for name in SYSTEMS
                 if summaries[name].dropped_samples > 0]
    return ", ".join(shrinking) or "-"


def draw(cells, results, path: Path) -> None:
    """Each system's goodput over Odyssey's, one group of bars per cell."""
    from odyssey_megatron.plotting import pyplot

    plt = pyplot()
    figure, axis = plt.subplots(figsize=(14, 4.5))
    width = 0.8 / (len(SYSTEMS) - 1)
    others = [s for s in SYSTEMS if s != "odyssey"]
    for k, system in enumerate(others):
        values = [r[2][system].goodput / r[2]["odyssey"].goodput if r[2]["odyssey"].goodput > 0 else 0.0
                  for r in results]
        axis.bar([i + k * width for i in range(len(cells))], values, width, label=system)
    axis.axhline(1.0, color="grey", linestyle=":", label="odyssey")
    labels = [label(*c) for c in cells]
    axis.set_xticks([i + 0.4 - width / 2 for i in range(len(cells))], labels, rotation=90, fontsize=7)
    axis.set(ylabel="goodput / Odyssey's", title="Samples per device-hour paid, relative to Odyssey")
    axis.legend(fontsize=7, ncol=len(SYSTEMS))
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


if __name__ == "__main__":
    main()
