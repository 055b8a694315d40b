"""The ``odyssey`` command line.

``odyssey plan --config FILE [--failed 3,7] [--failed-nodes 1] [--json] [key=value ...]``
prints the plan the decision center picks after the given failures, the alternatives it
beat, its estimates and its host memory per node (refused over ``cluster.host_memory_gib``,
which ``odyssey train`` checks too). ``odyssey simulate --scenario FILE [--seed N] [--out DIR [--force]]
[--json]`` compares the fault-tolerance systems over a failure scenario. ``odyssey profile
--config FILE [--out FILE [--force]] [--repeats N] [key=value ...]`` measures the recipe's
model on this machine and writes the profile file ``odyssey.profile`` reads. ``odyssey report
RUN_DIR [--baseline RUN_DIR] [--out DIR]`` draws an ``odyssey train`` run's plots and summary. With
``--print-config``, ``plan`` and ``simulate`` print their config as resolved (YAML) and do
nothing else.

``main`` is the one place user errors become output: every ConfigError (a file, YAML,
value, flag, output location or environment problem), argparse's complaints included,
prints one line and exits 2; an unrecoverable failure exits 3; results written whose W&B
logging then failed exit 4, kept on disk; anything else is a bug and keeps its traceback. Flags given twice either accumulate (``--failed``, ``--failed-nodes``)
or are refused, and JSON output never holds NaN or Infinity.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn, Sequence

from odyssey_megatron import limits
from odyssey_megatron.config import BatchOnFailure, DType, RecipeConfig, config_yaml, load_config, load_recipe
from odyssey_megatron.profile_file import emulated_profile, optimizer_bytes_per_rank
from odyssey_megatron.errors import ConfigError
from odyssey_megatron.estimator.memory import optimizer_state_per_rank
from odyssey_megatron.optimizer_shards import REPLICAS
from odyssey_megatron.planner import Candidate, Decision, UnrecoverableFailure
from odyssey_megatron.plotting import pyplot
from odyssey_megatron.runtime.control.launch_config import LAUNCH_FLAGS, SLURM_VARIABLES, LaunchConfig
from odyssey_megatron.settings import PLAIN, Pricing
from odyssey_megatron.units import GIB, SECONDS_PER_HOUR

if TYPE_CHECKING:
    from odyssey_megatron.decision_center import DecisionCenter
    from odyssey_megatron.plan import ExecutionPlan
    from odyssey_megatron.profile import ModelProfile
    from odyssey_megatron.estimator.host_memory import HostMemory

EXIT_USAGE = 2
EXIT_UNRECOVERABLE = 3
EXIT_WANDB = 4
"""The run's results were written but logging them to W&B failed."""
EXIT_INTERRUPTED = 130


class _Parser(argparse.ArgumentParser):
    """argparse, with its usage-plus-message complaints turned into one ConfigError."""

    def error(self, message: str) -> NoReturn:
        key, _, problem = message.partition(": ")
        if key.startswith("argument ") and problem:
            raise ConfigError(key.removeprefix("argument "), problem)
        raise ConfigError(self.prog, message)


class _Once(argparse.Action):
    """Store a flag's value (or ``const`` for a switch); a second occurrence is an error
    rather than silently replacing the first."""

    def __call__(self, parser, namespace, values, option_string=None):
        given = namespace.__dict__.setdefault("_given", set())
        if self.dest in given:
            parser.error(f"argument {option_string}: given twice; give it once")
        given.add(self.dest)
        setattr(namespace, self.dest, self.const if self.nargs == 0 else values)


def _int_list(text: str) -> list[int]:
    """``3,7`` as [3, 7]; empty lists and empty items are errors, not 'no failures'."""
    items = [item.strip() for item in text.split(",")]
    if not any(items):
        raise argparse.ArgumentTypeError(f"needs at least one integer, like 3 or 3,7; got {text!r}")
    if not all(items):
        raise argparse.ArgumentTypeError(f"has an empty item in {text!r}; separate integers with single commas")
    try:
        return [int(item) for item in items]
    except ValueError:
        raise argparse.ArgumentTypeError(f"takes comma-separated integers like 3,7; got {text!r}") from None


def _seed(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer; got {text!r}") from None
    if not 0 <= value <= limits.INT64:
        raise argparse.ArgumentTypeError(f"must lie in 0..2**63-1; got {value}")
    return value


DEFAULT_REPEATS = 20
MAX_REPEATS = 10_000


def _repeats(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer; got {text!r}") from None
    if not 1 <= value <= MAX_REPEATS:
        raise argparse.ArgumentTypeError(f"must lie in 1..{MAX_REPEATS}; got {value}")
    return value


def _parsers() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    parser = _Parser(prog="odyssey", description="Odyssey fault tolerance for Megatron-Core.", allow_abbrev=False)
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    plan = commands.add_parser("plan", help="show the plan chosen after failures", allow_abbrev=False)
    plan.add_argument("--config", required=True, action=_Once,
                      help="recipe YAML (model, parallel, training, cluster, odyssey; or Megatron-Bridge's layout)")
    plan.add_argument("--failed", type=_int_list, action="extend", default=[], metavar="RANKS",
                      help="failed ranks, e.g. 3,7; repeat to add more")
    plan.add_argument("--failed-nodes", type=_int_list, action="extend", default=[], metavar="NODES",
                      help="failed nodes (all their ranks), e.g. 1; repeat to add more")
    plan.add_argument("--json", action=_Once, nargs=0, const=True, default=False, help="print one JSON object")
    plan.add_argument("--print-config", action=_Once, nargs=0, const=True, default=False,
                      help="print the recipe as resolved (YAML: defaults, model spec, overrides, derived sizes) and exit")
    plan.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides, e.g. odyssey.policy=reroute")
    sim = commands.add_parser("simulate", allow_abbrev=False,
                              help="compare Odyssey with Oobleck, ReCycle, checkpoint-restart, replica drop, "
                                   "redistribution, DP scale-in and hot spares")
    sim.add_argument("--scenario", required=True, action=_Once, help="scenario YAML (see configs/scenarios/)")
    sim.add_argument("--seed", type=_seed, action=_Once, default=None, help="override the scenario's seed")
    sim.add_argument("--out", action=_Once, default=None,
                     help="output directory (default: runs/simulate/<scenario>-seed<N>, numbered if taken)")
    sim.add_argument("--force", action=_Once, nargs=0, const=True, default=False,
                     help="replace --out if it holds an earlier run")
    sim.add_argument("--json", action=_Once, nargs=0, const=True, default=False, help="print one JSON object")
    sim.add_argument("--print-config", action=_Once, nargs=0, const=True, default=False,
                     help="print the scenario and its recipe as resolved (YAML) and exit")
    sim.add_argument("overrides", nargs="*", metavar="key=value", help="scenario overrides, e.g. duration_hours=2")
    prof = commands.add_parser("profile", help="measure the recipe's model on this machine: a profile file",
                               allow_abbrev=False)
    prof.add_argument("--config", required=True, action=_Once, help="recipe YAML (model, parallel, training, cluster)")
    prof.add_argument("--out", action=_Once, default=None, help="profile JSON to write (default: print it)")
    prof.add_argument("--force", action=_Once, nargs=0, const=True, default=False,
                      help="replace --out if it holds an earlier profile")
    prof.add_argument("--repeats", type=_repeats, action=_Once, default=DEFAULT_REPEATS,
                      help=f"timed passes per measurement, after the warm-up (default {DEFAULT_REPEATS})")
    prof.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides, e.g. model.num_layers=4")
    train = commands.add_parser("train", help="train the recipe, surviving rank and node failures",
                                allow_abbrev=False)
    train.add_argument("--config", action=_Once, default=None, help="recipe YAML (not with --resume)")
    train.add_argument("--run-dir", action=_Once, default=None,
                       help="where the run's records go (default: runs/<recipe>-<time>)")
    train.add_argument("--resume", action=_Once, default=None, metavar="RUN_DIR",
                       help="continue a run that stopped with exit 3 from its checkpoint")
    for field, (flag, env) in LAUNCH_FLAGS.items():
        if field != "nproc_per_node":
            slurm = f", then ${SLURM_VARIABLES[field]}" if field in SLURM_VARIABLES else ""
            train.add_argument(flag, action=_Once, default=None, dest=field,
                               help=f"torchrun's {flag} (else ${env}{slurm})")
    train.add_argument("overrides", nargs="*", metavar="key=value",
                       help="config overrides, e.g. 'odyssey.faults=[{rank: 5, step: 2, phase: backward, action: kill}]'")
    report = commands.add_parser("report", help="plots and a summary of an odyssey train run", allow_abbrev=False)
    report.add_argument("run_dir", metavar="RUN_DIR", help="the run directory odyssey train wrote")
    report.add_argument("--baseline", action=_Once, default=None, metavar="RUN_DIR",
                        help="a failure-free run whose loss is drawn beside this one's")
    report.add_argument("--out", action=_Once, default=None, help="where the plots and report.txt go "
                                                                   "(default: RUN_DIR/report)")
    return parser, {"plan": plan, "simulate": sim, "profile": prof, "train": train, "report": report}


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    """The command and its arguments; options and ``key=value`` overrides may interleave."""
    parser, commands = _parsers()
    if not argv or argv[0] not in commands:
        return parser.parse_args(argv)  # help, or a one-line error naming the commands
    return commands[argv[0]].parse_intermixed_args(argv[1:], argparse.Namespace(command=argv[0]))


def dumps(value) -> str:
    """JSON as the commands print and write it: never NaN or Infinity (those are bugs)."""
    return json.dumps(value, allow_nan=False)


def _candidate_json(c: Candidate) -> dict:
    return {
        "policy": c.policy,
        "layout": c.layout,
        "est_step_time_s": c.estimate.step_time_s,
        "est_transition_s": c.transition_s,
        "samples_per_s": c.estimate.samples_per_s,
        "score": c.score,
        "dropped_micro_batches": c.dropped_micro_batches,
        "dropped_samples_per_step": c.dropped_samples_per_step,
        "batch_score": c.batch_score,
    }


def decision_json(decision: Decision, published: dict) -> dict:
    """The chosen plan as published (``DecisionCenter.published``: with its step program,
    so a rank can run it from this JSON alone) and what the decision weighed."""
    chosen = decision.chosen
    return {
        **published,
        "est_step_time_s": chosen.estimate.step_time_s,
        "est_pipeline_time_s": chosen.estimate.pipeline_time_s,
        "est_sync_time_s": chosen.estimate.sync_time_s,
        "est_param_gather_time_s": chosen.estimate.param_gather_time_s,
        "est_transition_s": chosen.transition_s,
        "est_peak_memory_bytes": [list(stages) for stages in chosen.estimate.peak_memory_bytes],
        "memory_budget_bytes": chosen.estimate.memory_budget_bytes,
        "samples_per_s": chosen.estimate.samples_per_s,
        "tokens_per_s": chosen.estimate.tokens_per_s,
        "score": chosen.score,
        "search_time_s": decision.search_time_s,
        "expected_interval_s": decision.expected_interval_s,
        "expected_interval_source": decision.interval_source,
        "horizon_s": decision.horizon_s,
        "dropped_micro_batches": chosen.dropped_micro_batches,
        "dropped_samples_per_step": chosen.dropped_samples_per_step,
        "batch_horizon_s": decision.batch_horizon_s,
        "candidates_considered": decision.candidates_considered,
        "candidates": [_candidate_json(c) for c in decision.alternatives],
        "note": decision.note,
    }


def _optimizer_line(plan: ExecutionPlan, profile: ModelProfile, pricing: Pricing) -> str:
    """The most optimizer state a rank of ``plan`` keeps, beside a full copy's: under the
    distributed optimizer at each block's holder count in this plan, which a failure lowers."""
    kept = max(optimizer_state_per_rank(plan, profile, pricing=pricing).values(), default=0)
    if not pricing.distributed_optimizer:
        return f"  optimizer   {kept / GIB:.1f} GiB per rank (a full copy of its stage's state)"
    full = max(optimizer_state_per_rank(plan, profile, pricing=PLAIN).values(), default=0)
    counts = sorted(set(plan.holder_counts(profile).values()))
    holders = f"{counts[0]}" if len(counts) == 1 else f"{counts[0]}-{counts[-1]}"
    return (f"  optimizer   {kept / GIB:.1f} GiB per rank of the {full / GIB:.1f} GiB a full copy holds "
            f"(distributed optimizer: every part on {REPLICAS} of each block's {holders} holders)")


def _describe(decision: Decision, failed: str, snapshots: str, checkpoints: str, host: list[str],
              optimizer: str) -> str:
    c = decision.chosen
    plan, est = c.plan, c.estimate
    moved = sum(t.bytes for t in plan.transfers)
    lines = [
        f"after failure of {failed}: {c.policy} (plan generation {plan.generation}), layout {c.layout}",
        f"  step time   {est.step_time_s:.3f} s = pipeline {est.pipeline_time_s:.3f} s + DP sync {est.sync_time_s:.3f} s"
        + (f" + weight all-gather {est.param_gather_time_s:.3f} s" if est.param_gather_time_s else "") +
        f"  ({est.samples_per_s:.2f} samples/s, {est.tokens_per_s:,.0f} tokens/s)",
        f"  transition  {c.transition_s:.2f} s  ({len(plan.transfers)} transfers, {moved / GIB:.2f} GiB moved)",
        f"  Eq. 8 score {c.score:.3f}  (over {decision.horizon_s / SECONDS_PER_HOUR:.2f} h; expected time to next "
        f"failure {decision.expected_interval_s / SECONDS_PER_HOUR:.2f} h, from {decision.interval_source})",
        *([f"  batch       drops {c.dropped_micro_batches} micro-batches ({c.dropped_samples_per_step} samples) a "
           f"step (odyssey.batch_on_failure=shrink)"] if c.dropped_micro_batches else []),
        *([f"  smaller batch weighed against the whole one over {decision.batch_horizon_s / SECONDS_PER_HOUR:.2f} h"]
          if decision.batch_horizon_s else []),
        f"  DP sync     {len(plan.sync_units)} units in {len(plan.comm_rounds)} rounds",
        "  pipelines (stage: worker layers peak GiB):",
    ]
    for pi, pipeline in enumerate(plan.pipelines):
        stages = []
        for stage, peak in zip(pipeline.stages, est.peak_memory_bytes[pi]):
            owner = "failed" if stage.worker is None else str(stage.worker)
            memory = "-" if peak is None else f"{peak / GIB:.1f}"
            stages.append(f"[{owner}] {stage.layers[0]}-{stage.layers[1]} {memory}")
        lines.append(f"    p{pi} ({len(pipeline.micro_batches)} mb): " + " | ".join(stages))
    for r in plan.reroutes:
        lines.append(f"    reroute p{r.pipeline} stage {r.stage}: {len(r.micro_batches)} mb -> worker {r.worker}")
    lines.append(f"  memory budget {est.memory_budget_bytes / GIB:.1f} GiB per device")
    lines.append(optimizer)
    lines.append(f"  snapshots   {snapshots}")
    lines.append(f"  checkpoints {checkpoints}")
    lines.extend(host)
    if decision.alternatives:
        lines.append("alternatives:")
        for alt in decision.alternatives:
            lines.append(
                f"  {alt.policy:<13} {alt.layout}: step {alt.estimate.step_time_s:.3f} s, "
                f"transition {alt.transition_s:.2f} s, score {alt.score:.3f}"
                + (f", drops {alt.dropped_micro_batches} micro-batches" if alt.dropped_micro_batches else "")
            )
    lines.append(f"search: {decision.search_time_s * 1e3:.1f} ms over {decision.candidates_considered} candidates")
    if decision.note:
        lines.append(f"note: {decision.note}")
    return "\n".join(lines)


def _plan_command(args: argparse.Namespace) -> int:
    from odyssey_megatron.decision_center import DecisionCenter, checkpoint_interval
    from odyssey_megatron.profile_file import recipe_profile

    config, bridge = _load_recipe(args.config, args.overrides)
    if args.print_config:
        print(config_yaml(config), end="")
        return 0
    profile = recipe_profile(config)
    try:
        center = DecisionCenter.from_recipe(config, profile=profile)
    except ValueError as exc:
        raise (bridge.plan_error(str(exc), optimizer_bytes_per_rank(config)) if bridge
               else ConfigError("parallel", str(exc))) from None
    failed, failed_nodes = sorted(set(args.failed)), sorted(set(args.failed_nodes))
    world = config.parallel.num_ranks
    bad = [r for r in failed if not 0 <= r < world]
    if bad:
        raise ConfigError("--failed", f"ranks must lie in 0..{world - 1}; got {bad}")
    nodes = center.cluster.num_nodes
    bad = [n for n in failed_nodes if not 0 <= n < nodes]
    if bad:
        raise ConfigError("--failed-nodes", f"nodes must lie in 0..{nodes - 1}; got {bad}")
    configured = config.odyssey.snapshot_interval
    nodes_per_group = config.odyssey.snapshot_parity_nodes
    interval = configured if configured is not None else center.snapshot_interval(nodes_per_group=nodes_per_group)
    snapshots = f"every {interval} steps{'' if configured is not None else ' (Young)'}" if interval else "none"
    checkpoints = checkpoint_interval(config, center)[1]
    decision = center.on_failure(ranks=failed, nodes=failed_nodes)
    per_node = _checked_host_memory(config, center)
    if args.json:
        kept = optimizer_state_per_rank(decision.chosen.plan, center.profile, pricing=config.odyssey.pricing)
        print(dumps({**decision_json(decision, center.published()),
                     "est_optimizer_state_bytes": max(kept.values(), default=0),
                     "host_memory_bytes": {str(node): {**held.parts(), "total": held.total}
                                           for node, held in per_node.items()},
                     "host_memory_budget_gib": config.cluster.host_memory_gib}))
    else:
        what = ", ".join(filter(None, [
            f"ranks {failed}" if failed else "",
            f"nodes {failed_nodes}" if failed_nodes else "",
        ])) or "nothing"
        print(_describe(decision, what, snapshots, checkpoints, _host_memory_lines(config, per_node),
                        _optimizer_line(decision.chosen.plan, center.profile, config.odyssey.pricing)))
    return 0


def _checked_host_memory(config: RecipeConfig, center: DecisionCenter) -> dict[int, HostMemory]:
    """Node -> ``estimator.host_memory.HostMemory`` of ``center``'s current plan on its
    cluster; ConfigError naming ``cluster.host_memory_gib`` where a node needs more."""
    from odyssey_megatron.estimator.host_memory import budget_problem, run_host_memory

    per_node = run_host_memory(config, center.plan, center.cluster)
    problem = budget_problem(per_node, config.cluster.host_memory_gib)
    if problem is not None:
        raise ConfigError("cluster.host_memory_gib", problem)
    return per_node


def _host_memory_lines(config: RecipeConfig, per_node: dict[int, HostMemory]) -> list[str]:
    """The plan's host memory per node, nodes that need the same listed together."""
    gib = config.cluster.host_memory_gib
    budget = "not checked: set cluster.host_memory_gib" if gib is None else f"of cluster.host_memory_gib={gib:g}"
    alike: dict[HostMemory, list[int]] = {}
    for node, held in per_node.items():
        alike.setdefault(held, []).append(node)
    lines = [f"  host memory per node ({budget}):"]
    for held, nodes in sorted(alike.items(), key=lambda item: item[1][0]):
        lines.append(f"    node{'s' if len(nodes) > 1 else ''} {_node_ranges(nodes)}: {held.total / GIB:.2f} GiB = "
                     f"{held.describe()}")
    return lines


def _node_ranges(nodes: list[int]) -> str:
    """[0, 1, 2, 5] as '0-2, 5'."""
    runs: list[list[int]] = []
    for node in nodes:
        if runs and node == runs[-1][1] + 1:
            runs[-1][1] = node
        else:
            runs.append([node, node])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def _simulate_command(args: argparse.Namespace) -> int:
    from odyssey_megatron.run_dir import RunDir
    from odyssey_megatron.simulator.report import (
        log_to_wandb,
        start_wandb,
        summary_json,
        system_series,
        write_outputs,
    )
    from odyssey_megatron.simulator.run import scenario_events, simulate
    from odyssey_megatron.simulator.scenario import load_scenario

    if args.seed is not None and any(o.partition("=")[0].strip() == "seed" for o in args.overrides):
        raise ConfigError("seed", "given both as --seed and as seed=...; give it once")
    if args.force and args.out is None:
        raise ConfigError("--force", "replaces an earlier run's --out directory; give --out with it")
    overrides = list(args.overrides) + ([f"seed={args.seed}"] if args.seed is not None else [])
    scenario = load_scenario(args.scenario, overrides)
    if args.print_config:
        print(config_yaml({"scenario": scenario.config, "recipe": scenario.recipe}), end="")
        return 0
    pyplot()  # before hours of simulation: a bad MPLBACKEND is one line
    events = scenario_events(scenario)
    default_out = Path("runs/simulate") / f"{Path(args.scenario).stem}-seed{scenario.config.seed}"
    run_dir = RunDir.prepare(args.out or default_out, key="--out", explicit=args.out is not None, force=args.force)
    bars = []

    def progress(name: str, num_events: int):
        from tqdm import tqdm

        if bars:
            bars[-1].close()
        bars.append(tqdm(total=num_events, desc=f"{name:<10}", unit="event", file=sys.stderr, leave=True))
        return bars[-1].update

    try:
        wandb_run = start_wandb(scenario.config, run_dir.staging)
        result = simulate(scenario, events=events, progress=None if args.json else progress)
        for bar in bars:
            bar.close()
        series = system_series(result)
        write_outputs(result, series, run_dir.staging)
    except BaseException:
        run_dir.discard()
        raise
    wandb_dir = wandb_error = None
    if wandb_run is not None:
        try:
            wandb_dir = log_to_wandb(wandb_run, result, series)
        except Exception as exc:  # noqa: BLE001 - W&B's own failure must not cost the results written
            wandb_error = f"{type(exc).__name__}: {exc}".splitlines()[0]
    out = run_dir.commit()
    if wandb_error is not None:
        print(f"odyssey: error: W&B logging failed ({wandb_error}); the results are in {out}", file=sys.stderr)
        return EXIT_WANDB
    if args.json:
        print(dumps(summary_json(result)))
        return 0
    print(f"{len(result.events)} cluster events over {scenario.config.duration_hours:g} h on "
          f"{scenario.recipe.parallel.num_ranks} devices; fault-free {result.fault_free_throughput:.2f} samples/s, "
          f"fault-scaled ideal {result.ideal_throughput:.2f}")
    print(f"{'system':<12} {'samples/s':>9} {'of ideal':>9} {'of fault-free':>13} {'paused (s)':>10} "
          f"{'samples/dev-h paid':>18} {'ETTR':>6} {'dropped':>9}  odyssey/x (goodput)")
    for name, s in result.summaries.items():
        ratio = result.ratios.get(name)
        print(f"{name:<12} {s.avg_throughput:9.3f} {s.fraction_of_ideal:9.3f} {s.fraction_of_fault_free:13.3f} "
              f"{s.transition_time_s:10.0f} {s.goodput:18.1f} {s.ettr:6.3f} {s.dropped_samples:9.0f}  "
              f"{'' if ratio is None else f'{ratio:.3f}x'}")
    wandb_note = f"; W&B run: {out / wandb_dir.relative_to(run_dir.staging)}" if wandb_dir else ""
    print(f"outputs: {out}{wandb_note}")
    return 0


def _profile_command(args: argparse.Namespace) -> int:
    from odyssey_megatron.profile_file import check_output, profile_json, write_profile

    if args.force and args.out is None:
        raise ConfigError("--force", "replaces an earlier profile at --out; give --out with it")
    config = _load_recipe(args.config, args.overrides)[0]
    out = check_output(args.out, key="--out", force=args.force) if args.out is not None else None
    from odyssey_megatron.profiler import (
        measure_profile,  # torch and Megatron: once the arguments are good
    )

    measured = measure_profile(config, repeats=args.repeats)
    data = profile_json(measured.profile, measured_for=measured.measured_for, source=measured.source)
    if out is None:
        print(dumps(data))
        return 0
    write_profile(out, data)
    print(_describe_profile(measured, out))
    return 0


def _describe_profile(measured, out: Path) -> str:
    profile, source = measured.profile, measured.source
    ms = lambda seconds: f"{seconds * 1e3:.3f} ms"  # noqa: E731
    lines = [f"profiled on {source['device']} in {source['seconds']:.1f} s ({source['timer']}, "
             f"median of {source['repeats']} after {source['warmup']} warm-up)"]
    for name, block in (("layer", profile.layers[0]), ("embedding", profile.embedding), ("output", profile.output)):
        lines.append(f"  {name:<9} forward {ms(block.forward_s)}, backward {ms(block.backward_s)} (weight gradients "
                     f"{ms(block.weight_grad_s)}), activations {block.activation_bytes / 2**20:.2f} MiB, state "
                     f"{block.state_bytes / 2**20:.2f} MiB")
    lines.append(f"  links     P2P {profile.intra_node_bandwidth / 1e9:.2f} GB/s + {profile.link_latency_s * 1e6:.0f} us;"
                 f" all-reduce {(profile.allreduce_bandwidth or profile.intra_node_bandwidth) / 1e9:.2f} GB/s + "
                 f"{(profile.allreduce_latency_s or profile.link_latency_s) * 1e6:.0f} us ({source['links']})")
    lines.append(f"  per op    {ms(profile.op_overhead_s)} fixed; optimizer step "
                 f"{profile.optimizer_s_per_param_byte * 2**30:.3f} s per GiB of parameters")
    lines.append(f"written to {out}; use it with odyssey.profile={out}")
    return "\n".join(lines)


def _train_command(args: argparse.Namespace) -> int:
    import time

    from odyssey_megatron.runtime.checkpoint_index import latest_checkpoint
    from odyssey_megatron.runtime.control.console import log_to_terminal
    from odyssey_megatron.runtime.control.fork_server import WORKER_PRELOAD, start_fork_server

    no_checkpoint = ConfigError("--resume", f"{args.resume} holds no complete checkpoint of an odyssey train run "
                                            "(odyssey.checkpoint_interval was 0, or the run ended before one was due)")
    if args.resume is not None:
        if args.config is not None or args.run_dir is not None:
            raise ConfigError("--resume", "continues RUN_DIR with its own config.yaml; give neither --config nor "
                                          "--run-dir with it")
        if not (Path(args.resume) / "config.yaml").is_file():
            raise no_checkpoint
        # Faults injected into the first run are not injected again.
        config = load_config(Path(args.resume) / "config.yaml", ["odyssey.faults=[]", *args.overrides])
    elif args.config is None:
        raise ConfigError("--config", "is required (or --resume RUN_DIR)")
    else:
        config = _load_recipe(args.config, args.overrides)[0]
    flags = {field: getattr(args, field) for field in LAUNCH_FLAGS if field != "nproc_per_node"}
    flags["nproc_per_node"] = str(config.cluster.devices_per_node)
    launch = LaunchConfig.resolve(flags, os.environ, dedicated_controller=config.cluster.dedicated_controller)
    if args.resume is not None:
        run_dir = Path(args.resume)
    elif args.run_dir is not None:
        run_dir = Path(args.run_dir)
    else:
        run_dir = Path("runs") / f"{Path(args.config).stem}-{time.strftime('%Y%m%d-%H%M%S')}"
    if args.resume is None and run_dir.exists() and any(run_dir.iterdir()) and launch.node_rank == 0:
        raise ConfigError("--run-dir", f"{run_dir} already holds files; give a new directory")
    resume = None
    if args.resume is not None and (resume := latest_checkpoint(Path(args.resume))) is None:
        raise no_checkpoint
    _check_launch(config, launch)
    if config.cluster.host_memory_gib is not None:  # every node, before any of its ranks starts
        from odyssey_megatron.decision_center import DecisionCenter

        _checked_host_memory(config, DecisionCenter.from_recipe(config))
    start_fork_server(WORKER_PRELOAD)  # its import of the workers' modules overlaps with this process's own below
    from odyssey_megatron.runtime.train import train_node

    pyplot()  # the report drawn at the end
    log_to_terminal()  # progress, failures, recoveries and warnings; the rest to RUN_DIR/logs/node-<n>.log
    outcome = train_node(config, launch, run_dir=run_dir, resume=resume)
    print(outcome.message, file=sys.stderr if outcome.status else sys.stdout)
    if launch.node_rank != 0:
        return outcome.status
    _print_report(run_dir)
    if outcome.wandb_error is not None:
        print(f"odyssey: W&B logging failed ({outcome.wandb_error}); the run's records are in {run_dir}",
              file=sys.stderr)
        return outcome.status or EXIT_WANDB
    print(f"W&B run: {outcome.wandb_dir}")
    return outcome.status


def _check_launch(config: RecipeConfig, launch: LaunchConfig) -> None:
    """The nodes must hold exactly the recipe's ranks, in a precision the workers train."""
    if config.model.params_dtype == DType.fp16:
        raise ConfigError("model.params_dtype", "odyssey train runs fp32 or bf16 (fp16 needs loss scaling, "
                                                "which its executors do not apply)")
    if config.odyssey.batch_on_failure != BatchOnFailure.keep:
        raise ConfigError("odyssey.batch_on_failure", "odyssey train keeps the recipe's batch (keep); shrink is "
                                                      "for odyssey plan and odyssey simulate")
    emulated_profile(config)  # the workers pace their ops to it: refused here, not in every worker
    ranks = config.parallel.num_ranks
    if launch.world_size != ranks:
        controller = " beside the controller's (cluster.dedicated_controller)" if launch.dedicated_controller else ""
        raise ConfigError("--nnodes", f"{launch.nnodes - launch.first_worker_node} node(s){controller} of "
                                      f"cluster.devices_per_node={launch.nproc_per_node} give {launch.world_size} "
                                      f"ranks; the recipe has {ranks} (TP * PP * DP)")


def _report_command(args: argparse.Namespace) -> int:
    _print_report(args.run_dir, baseline=args.baseline, out=args.out)
    return 0


def _print_report(run_dir, *, baseline=None, out=None) -> None:
    """Write the run's plots (``RUN_DIR/report`` unless ``out``) and print its summary."""
    from odyssey_megatron.report import read_run, summary_text, write_report

    run = read_run(run_dir, key="RUN_DIR")
    against = read_run(baseline, key="--baseline") if baseline is not None else None
    paths = write_report(run, Path(out) if out is not None else run.directory / "report", baseline=against)
    print(summary_text(run))
    print(f"report: {', '.join(str(p) for p in paths.values())}")


def _load_recipe(path, overrides) -> tuple:
    """``config.load_recipe``, then a Megatron-Bridge recipe's notes, one line each on stderr:
    what the plugin does not use, and what its full optimizer copy per rank costs."""
    config, bridge = load_recipe(path, overrides)
    if bridge is not None:
        for note in bridge.notes(optimizer_bytes_per_rank(config)):
            logging.getLogger(__name__).warning(note)
    return config, bridge


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; user errors print one line and return 2 (see the module docstring)."""
    try:
        args = parse_args(sys.argv[1:] if argv is None else list(argv))
        if args.command == "plan":
            return _plan_command(args)
        if args.command == "profile":
            return _profile_command(args)
        if args.command == "train":
            return _train_command(args)
        if args.command == "report":
            return _report_command(args)
        return _simulate_command(args)
    except ConfigError as exc:
        print(f"odyssey: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except UnrecoverableFailure as exc:
        print(f"odyssey: unrecoverable: {exc}", file=sys.stderr)
        return EXIT_UNRECOVERABLE
    except KeyboardInterrupt:
        print("odyssey: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:  # output piped into `head` and friends: not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())
