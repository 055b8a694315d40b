"""The ``odyssey`` command line.

``odyssey plan --config FILE [--failed 3,7] [--failed-nodes 1] [--json] [key=value ...]``
prints the plan the decision center picks after the given failures, the alternatives it
beat and its estimates. ``odyssey simulate --scenario FILE [--seed N] [--out DIR] [--json]``
compares the fault-tolerance systems over a failure scenario. User errors print one line
and exit 2; an unrecoverable failure exits 3.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Sequence

from odyssey_megatron.config import ConfigError, load_config
from odyssey_megatron.planner import Candidate, Decision, UnrecoverableFailure

GIB = 1024**3
EXIT_USAGE = 2
EXIT_UNRECOVERABLE = 3


def _int_list(flag: str):
    def parse(text: str) -> list[int]:
        try:
            return [int(x) for x in text.split(",") if x.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(f"{flag} takes comma-separated integers like 3,7; got {text!r}") from None
    return parse


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="odyssey", description="Odyssey fault tolerance for Megatron-Core.")
    commands = parser.add_subparsers(dest="command", required=True)
    plan = commands.add_parser("plan", help="show the plan chosen after failures")
    plan.add_argument("--config", required=True, help="recipe YAML (model, parallel, training, cluster, odyssey)")
    plan.add_argument("--failed", type=_int_list("--failed"), default=[], metavar="RANKS", help="failed ranks, e.g. 3,7")
    plan.add_argument("--failed-nodes", type=_int_list("--failed-nodes"), default=[], metavar="NODES",
                      help="failed nodes (all their ranks), e.g. 1")
    plan.add_argument("--json", action="store_true", help="print one JSON object")
    plan.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides, e.g. odyssey.policy=reroute")
    sim = commands.add_parser("simulate", help="compare Odyssey with Oobleck, ReCycle and checkpoint-restart")
    sim.add_argument("--scenario", required=True, help="scenario YAML (see configs/scenarios/)")
    sim.add_argument("--seed", type=int, default=None, help="override the scenario's seed")
    sim.add_argument("--out", default=None, help="output directory (default: runs/simulate/<scenario>-seed<N>)")
    sim.add_argument("--json", action="store_true", help="print one JSON object")
    sim.add_argument("overrides", nargs="*", metavar="key=value", help="scenario overrides, e.g. duration_hours=2")
    return parser


def _candidate_json(c: Candidate) -> dict:
    return {
        "policy": c.policy,
        "layout": c.layout,
        "est_step_time_s": c.estimate.step_time_s,
        "est_transition_s": c.transition_s,
        "samples_per_s": c.estimate.samples_per_s,
        "score": c.score,
    }


def decision_json(decision: Decision) -> dict:
    chosen = decision.chosen
    plan = chosen.plan
    plan_dict = plan.to_dict()
    return {
        "policy": chosen.policy,
        "generation": plan.generation,
        "pipelines": plan_dict["pipelines"],
        "reroutes": plan_dict["reroutes"],
        "est_step_time_s": chosen.estimate.step_time_s,
        "est_pipeline_time_s": chosen.estimate.pipeline_time_s,
        "est_sync_time_s": chosen.estimate.sync_time_s,
        "est_transition_s": chosen.transition_s,
        "est_peak_memory_bytes": [list(stages) for stages in chosen.estimate.peak_memory_bytes],
        "memory_budget_bytes": chosen.estimate.memory_budget_bytes,
        "samples_per_s": chosen.estimate.samples_per_s,
        "tokens_per_s": chosen.estimate.tokens_per_s,
        "score": chosen.score,
        "transfers": plan_dict["transfers"],
        "sync_units": plan_dict["sync_units"],
        "comm_rounds": plan_dict["comm_rounds"],
        "search_time_s": decision.search_time_s,
        "expected_interval_s": decision.expected_interval_s,
        "candidates_considered": decision.candidates_considered,
        "candidates": [_candidate_json(c) for c in decision.alternatives],
        "note": decision.note,
    }


def _describe(decision: Decision, failed: str) -> str:
    c = decision.chosen
    plan, est = c.plan, c.estimate
    moved = sum(t.bytes for t in plan.transfers)
    lines = [
        f"after failure of {failed}: {c.policy} (plan generation {plan.generation}), layout {c.layout}",
        f"  step time   {est.step_time_s:.3f} s = pipeline {est.pipeline_time_s:.3f} s + DP sync {est.sync_time_s:.3f} s"
        f"  ({est.samples_per_s:.2f} samples/s, {est.tokens_per_s:,.0f} tokens/s)",
        f"  transition  {c.transition_s:.2f} s  ({len(plan.transfers)} transfers, {moved / GIB:.2f} GiB moved)",
        f"  Eq. 8 score {c.score:.3f}  (expected time to next failure {decision.expected_interval_s / 3600:.2f} h)",
        f"  DP sync     {len(plan.sync_units)} units in {len(plan.comm_rounds)} rounds",
        "  pipelines (stage: ranks layers peak GiB):",
    ]
    for pi, pipeline in enumerate(plan.pipelines):
        stages = []
        for stage, peak in zip(pipeline.stages, est.peak_memory_bytes[pi]):
            owner = "failed" if stage.worker is None else ",".join(map(str, plan.ranks(stage.worker)))
            memory = "-" if peak is None else f"{peak / GIB:.1f}"
            stages.append(f"[{owner}] {stage.layers[0]}-{stage.layers[1]} {memory}")
        lines.append(f"    p{pi} ({len(pipeline.micro_batches)} mb): " + " | ".join(stages))
    for r in plan.reroutes:
        lines.append(f"    reroute p{r.pipeline} stage {r.stage}: {len(r.micro_batches)} mb -> ranks {plan.ranks(r.worker)}")
    lines.append(f"  memory budget {est.memory_budget_bytes / GIB:.1f} GiB per device")
    if decision.alternatives:
        lines.append("alternatives:")
        for alt in decision.alternatives:
            lines.append(
                f"  {alt.policy:<13} {alt.layout}: step {alt.estimate.step_time_s:.3f} s, "
                f"transition {alt.transition_s:.2f} s, score {alt.score:.3f}"
            )
    lines.append(f"search: {decision.search_time_s * 1e3:.1f} ms over {decision.candidates_considered} candidates")
    if decision.note:
        lines.append(f"note: {decision.note}")
    return "\n".join(lines)


def _plan_command(args: argparse.Namespace) -> int:
    from odyssey_megatron.decision_center import DecisionCenter

    config = load_config(args.config, args.overrides)
    try:
        center = DecisionCenter.from_recipe(config)
    except ValueError as exc:
        raise ConfigError("parallel", str(exc)) from None
    world = config.parallel.num_ranks
    bad = [r for r in args.failed if not 0 <= r < world]
    if bad:
        raise ConfigError("--failed", f"ranks must lie in 0..{world - 1}; got {bad}")
    nodes = center.cluster.num_nodes
    bad = [n for n in args.failed_nodes if not 0 <= n < nodes]
    if bad:
        raise ConfigError("--failed-nodes", f"nodes must lie in 0..{nodes - 1}; got {bad}")
    decision = center.on_failure(ranks=args.failed, nodes=args.failed_nodes)
    if args.json:
        print(json.dumps(decision_json(decision)))
    else:
        what = ", ".join(filter(None, [
            f"ranks {args.failed}" if args.failed else "",
            f"nodes {args.failed_nodes}" if args.failed_nodes else "",
        ])) or "nothing"
        print(_describe(decision, what))
    return 0


def _simulate_command(args: argparse.Namespace) -> int:
    from pathlib import Path

    from odyssey_megatron.simulator.report import log_to_wandb, summary_json, system_series, write_outputs
    from odyssey_megatron.simulator.run import simulate
    from odyssey_megatron.simulator.scenario import load_scenario

    overrides = list(args.overrides) + ([f"seed={args.seed}"] if args.seed is not None else [])
    scenario = load_scenario(args.scenario, overrides)
    out = Path(args.out or f"runs/simulate/{Path(args.scenario).stem}-seed{scenario.config.seed}")
    bars = []

    def progress(name: str, num_events: int):
        from tqdm import tqdm

        if bars:
            bars[-1].close()
        bars.append(tqdm(total=num_events, desc=f"{name:<10}", unit="event", file=sys.stderr, leave=True))
        return bars[-1].update

    result = simulate(scenario, progress=None if args.json else progress)
    for bar in bars:
        bar.close()
    series = system_series(result)
    write_outputs(result, series, out)
    wandb_dir = log_to_wandb(result, series, out)
    if args.json:
        print(json.dumps(summary_json(result)))
        return 0
    print(f"{len(result.events)} cluster events over {scenario.config.duration_hours:g} h on "
          f"{scenario.recipe.parallel.num_ranks} devices; fault-free {result.fault_free_throughput:.2f} samples/s, "
          f"fault-scaled ideal {result.ideal_throughput:.2f}")
    print(f"{'system':<11} {'samples/s':>9} {'of ideal':>9} {'of fault-free':>13} {'paused (s)':>10}  odyssey/x")
    for name, s in result.summaries.items():
        ratio = result.ratios.get(name)
        print(f"{name:<11} {s.avg_throughput:9.3f} {s.fraction_of_ideal:9.3f} {s.fraction_of_fault_free:13.3f} "
              f"{s.transition_time_s:10.0f}  {'' if ratio is None else f'{ratio:.3f}x'}")
    print(f"outputs: {out}" + (f"; W&B run: {wandb_dir}" if wandb_dir else ""))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.command == "plan":
            return _plan_command(args)
        if args.command == "simulate":
            return _simulate_command(args)
    except ConfigError as exc:
        print(f"odyssey: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except UnrecoverableFailure as exc:
        print(f"odyssey: unrecoverable: {exc}", file=sys.stderr)
        return EXIT_UNRECOVERABLE
    except BrokenPipeError:  # output piped into `head` and friends: not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
