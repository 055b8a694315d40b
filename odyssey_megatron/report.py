"""Plots and a text summary of one ``odyssey train`` run, from its run directory's files
alone (``config.yaml``, ``events.jsonl``, ``samples.jsonl``), so a run can be read after the
fact, on another machine, without W&B or the code that ran it.

Everything is derived from wall-clock stamps the controller wrote: throughput from the gaps
between successive commits (a gap that spans a recovery shows as a dip), measured step time
from gaps between successive commits of one plan generation, recovery phases from each
recovery's ``failed_at``, ``detected_at``, ``decided_at``, ``ready_at`` and
``first_step_at``, and each join (workers taken back) from its ``decided_at`` to its
``first_step_at``. Fields a run may lack (estimates on plan or step events) are read with
``.get`` and their series left out. Unreadable records are one ``ConfigError`` naming the
argument the directory came from; a torn last line (the run was killed mid-append) is
skipped (``run_dir.read_jsonl``).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from omegaconf import DictConfig

from odyssey_megatron.errors import ConfigError
from odyssey_megatron.input_files import load_yaml_mapping
from odyssey_megatron.run_dir import read_jsonl

__all__ = ["PHASES", "PLOTS", "RunRecords", "phase_seconds", "read_run", "samples_account", "summary_text",
           "write_report"]

PHASES = ("detection", "decision", "entering the plan", "first step")
"""A recovery's phases, in order: failed -> detected -> decided -> ready -> first step committed."""
_PHASE_STAMPS = ("failed_at", "detected_at", "decided_at", "ready_at", "first_step_at")
PLOTS = ("throughput.png", "loss.png", "recovery_phases.png", "step_time.png")

_NUMBERS = {
    "step": ("step", "generation", "loss"),
    "plan": ("generation",),
    "profile": ("generation",),
    "failure": ("failed_at",),
    "recovery": ("generation", "start_step") + _PHASE_STAMPS,
    "join": ("decided_at",),
}
"""Per event kind, the numeric fields the report reads without ``.get``."""
_LISTS = {"plan": ("workers",), "failure": ("ranks",), "recovery": ("failed_ranks",), "join": ("workers",)}
_POLICY_COLOURS = {"reroute": "tab:orange", "reparallelize": "tab:purple"}


@dataclass(frozen=True)
class RunRecords:
    """The records of one run directory, checked to have the fields the report reads."""

    directory: Path
    seq_length: int
    global_batch_size: int
    events: tuple[dict, ...]
    """Every event in file order (a resumed run appends to the same file)."""
    samples: dict[int, list[int]]
    """Committed step -> its sample ids (a step committed again after a resume: the last)."""

    def kind(self, name: str) -> list[dict]:
        return [e for e in self.events if e["event"] == name]

    @property
    def commits(self) -> list[dict]:
        """Step events in time order."""
        return sorted(self.kind("step"), key=lambda e: e["time"])

    @property
    def losses(self) -> dict[int, float]:
        """Step -> loss, the last commit of a step winning."""
        return {e["step"]: e["loss"] for e in self.commits}


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check_events(events: list[dict], path: Path, key: str) -> None:
    for number, event in enumerate(events, 1):
        kind = event.get("event")
        bad = [] if _is_number(event.get("time")) and isinstance(kind, str) else ["event", "time"]
        bad += [f for f in _NUMBERS.get(kind, ()) if not _is_number(event.get(f))]
        bad += [f for f in _LISTS.get(kind, ()) if not isinstance(event.get(f), list)]
        if bad:
            raise ConfigError(key, f"{path} record {number} ({kind or 'no kind'}) lacks a valid {', '.join(bad)}; "
                                   "the run's records are damaged")


def _positive_int(config, section: str, name: str, path: Path, key: str) -> int:
    block = config.get(section)
    value = block.get(name) if isinstance(block, DictConfig) else None
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ConfigError(key, f"{path} has no positive integer {section}.{name}; it is not an odyssey train "
                               "run's resolved recipe")
    return value


def read_run(directory: str | Path, *, key: str) -> RunRecords:
    """The records of the run in ``directory``; ``key`` (the argument it came from) names it
    in errors. A missing ``samples.jsonl`` means no step was committed."""
    directory = Path(directory)
    if not directory.is_dir():
        problem = "is not a directory" if directory.exists() else "does not exist"
        raise ConfigError(key, f"{directory} {problem}; give the run directory of odyssey train")
    for name in ("events.jsonl", "config.yaml"):
        if not (directory / name).is_file():
            raise ConfigError(key, f"{directory} holds no {name}; give the run directory of odyssey train")
    config = load_yaml_mapping(directory / "config.yaml", key=key)
    seq_length = _positive_int(config, "model", "seq_length", directory / "config.yaml", key)
    global_batch = _positive_int(config, "training", "global_batch_size", directory / "config.yaml", key)
    events = read_jsonl(directory / "events.jsonl", key=key)
    _check_events(events, directory / "events.jsonl", key)
    samples = {}
    if (directory / "samples.jsonl").is_file():
        for number, row in enumerate(read_jsonl(directory / "samples.jsonl", key=key), 1):
            ids = row.get("samples")
            if not isinstance(row.get("step"), int) or not isinstance(ids, list):
                raise ConfigError(key, f"{directory / 'samples.jsonl'} record {number} lacks a step or its "
                                       "samples; the run's records are damaged")
            samples[row["step"]] = ids
    return RunRecords(directory, seq_length, global_batch, tuple(events), samples)


def phase_seconds(recovery: dict) -> dict[str, float]:
    """Seconds spent in each of ``PHASES`` (between successive stamps of the recovery)."""
    stamps = [recovery[s] for s in _PHASE_STAMPS]
    return {phase: end - start for phase, start, end in zip(PHASES, stamps, stamps[1:])}


def _throughput(run: RunRecords) -> list[tuple[float, float, float]]:
    """(previous commit time, commit time, samples/s) per pair of successive steps."""
    commits = run.commits
    return [(a["time"], b["time"], run.global_batch_size / (b["time"] - a["time"]))
            for a, b in zip(commits, commits[1:]) if b["step"] == a["step"] + 1 and b["time"] > a["time"]]


def _measured_step_s(run: RunRecords) -> dict[int, float]:
    """Step -> seconds since the previous step's commit, within one plan generation."""
    commits = run.commits
    return {b["step"]: b["time"] - a["time"] for a, b in zip(commits, commits[1:])
            if b["step"] == a["step"] + 1 and b["generation"] == a["generation"]}


def _estimated_step_s(run: RunRecords) -> dict[int, float]:
    """Committed step -> the estimate of its step time then: its plan's (the plan event's
    ``estimated_step_s``, else the recovery's chosen candidate's), or the latest the
    online profile made for that plan before the step (``profile`` events)."""
    chosen = {r["generation"]: r.get("chosen", {}).get("step_time_s") for r in run.kind("recovery")}
    current: dict[int, float] = {g: s for g, s in chosen.items() if _is_number(s)}
    estimates = {}
    for event in run.events:
        if event["event"] in ("plan", "profile") and _is_number(event.get("estimated_step_s")):
            current[event["generation"]] = event["estimated_step_s"]
        elif event["event"] == "step" and event["generation"] in current:
            estimates[event["step"]] = current[event["generation"]]
    return estimates


def _active_ranks(run: RunRecords) -> list[tuple[float, int]]:
    """(time, ranks training) at every plan and failure (when it happened, not when it was
    recorded): a plan's workers, less those failed since."""
    points, workers = [], set()
    for event in run.events:
        if event["event"] == "plan":
            workers = set(event["workers"])
            points.append((event["time"], len(workers)))
        elif event["event"] == "failure":
            workers -= set(event["ranks"])
            points.append((event["failed_at"], len(workers)))
    return sorted(points)


@dataclass(frozen=True)
class SamplesAccount:
    steps: int
    expected: int
    """Global batch size x committed steps."""
    distinct: int
    lost: int
    """Expected samples never seen in a committed step."""
    doubled: int
    """Sample ids seen more than once."""


def samples_account(run: RunRecords) -> SamplesAccount:
    ids = [i for step in run.samples.values() for i in step]
    counts = Counter(ids)
    expected = run.global_batch_size * len(run.samples)
    return SamplesAccount(steps=len(run.samples), expected=expected, distinct=len(counts),
                          lost=max(0, expected - len(counts)), doubled=sum(1 for c in counts.values() if c > 1))


def _s(seconds: float) -> str:
    return f"{seconds:.3f} s"


def summary_text(run: RunRecords) -> str:
    """The report's text: run, failures, recoveries by policy, time and samples lost."""
    commits, recoveries, failures = run.commits, run.kind("recovery"), run.kind("failure")
    start = run.events[0]["time"] if run.events else 0.0
    losses = run.losses
    lines = [f"run {run.directory}: {len(losses)} steps committed"
             + (f" (steps {min(losses)}-{max(losses)}), loss {losses[min(losses)]:.4f} -> "
                f"{losses[max(losses)]:.4f}" if losses else "")]
    if commits:
        rates = _throughput(run)
        span = commits[-1]["time"] - commits[0]["time"]
        line = f"time: {_s(commits[0]['time'] - start)} from the controller's start to the first commit"
        if rates and span > 0:
            mean = run.global_batch_size * len(rates) / span
            line += (f", then {_s(span)} for {len(rates)} more steps: {mean:.2f} samples/s, "
                     f"{mean * run.seq_length:,.0f} tokens/s on average")
        lines.append(line)
    end = run.kind("run_end")
    if end:
        lines.append(f"outcome: {end[-1].get('message', 'status ' + str(end[-1].get('status')))}")
    lines.append(f"failures: {len(failures)}")
    for f in failures:
        detected = f.get("detected_at")
        lines.append(f"  ranks {f['ranks']} ({f.get('cause', 'unknown cause')}) at +{_s(f['failed_at'] - start)}"
                     + (f", detected {_s(detected - f['failed_at'])} later" if _is_number(detected) else ""))
    by_policy = Counter(r.get("policy", "unknown") for r in recoveries)
    lines.append(f"recoveries: {len(recoveries)}"
                 + (" (" + ", ".join(f"{p} {n}" for p, n in sorted(by_policy.items())) + ")" if recoveries else ""))
    for r in recoveries:
        phases = phase_seconds(r)
        moved = r.get("transfer_bytes")
        source = f" ({r['decision_source']} decision)" if r.get("decision_source") else ""
        lines.append(f"  generation {r['generation']}: {r.get('policy', 'unknown')}{source} from step "
                     f"{r['start_step']} after ranks {r['failed_ranks']} failed: "
                     + " + ".join(f"{name} {_s(s)}" for name, s in phases.items())
                     + f" = {_s(sum(phases.values()))}"
                     + (f"; {r.get('transfers', 0)} transfers, {moved / 2**20:.2f} MiB moved" if _is_number(moved)
                        else "")
                     + (f"; rolled back to the in-memory snapshot of step {r['snapshot_step']} "
                        f"({r.get('replayed_steps')} steps trained again, {r.get('rebuilt_shards')} shards rebuilt "
                        "from parity)" if r.get("snapshot_step") is not None else ""))
    lost = sum(r["first_step_at"] - r["failed_at"] for r in recoveries)
    lines.append(f"time lost to recoveries: {_s(lost)} (from each failure to the first step committed after it)")
    lines += _join_lines(run.kind("join"))
    account = samples_account(run)
    lines.append(f"samples: {account.expected} expected ({run.global_batch_size} x {account.steps} committed steps), "
                 f"{account.distinct} distinct seen; samples lost: {account.lost}; samples doubled: {account.doubled}")
    return "\n".join(lines)


def _join_lines(joins: list[dict]) -> list[str]:
    """Workers taken back: the plan grown onto them, or kept where Eq. 8 said so."""
    grown = [j for j in joins if j.get("grew")]
    lines = [f"joins: {len(grown)} grown" + (f", {len(joins) - len(grown)} kept the plan" if len(joins) > len(grown)
                                             else "")] if joins else []
    for j in joins:
        if not j.get("grew"):
            lines.append(f"  workers {j['workers']} back: Eq. 8 kept the plan")
            continue
        moved = j.get("transfer_bytes")
        lines.append(f"  generation {j.get('generation')}: workers {j['workers']} back -> {j.get('policy', 'unknown')} "
                     f"with {j.get('training_ranks')} ranks training from step {j.get('start_step')}"
                     + (f", {moved / 2**20:.2f} MiB moved" if _is_number(moved) else "")
                     + (f", {_s(j['first_step_at'] - j['decided_at'])} from the decision to its first step"
                        if _is_number(j.get("first_step_at")) else ""))
    return lines


def _mark_joins(axis, joins: list[dict], *, start: float) -> None:
    """Shade each join carried out, from its decision to its first step on the grown plan."""
    for i, j in enumerate(j for j in joins if j.get("grew") and _is_number(j.get("first_step_at"))):
        axis.axvspan(j["decided_at"] - start, j["first_step_at"] - start, color="tab:green", alpha=0.2,
                     label=None if i else "join (workers back)")


def _mark_recoveries(axis, recoveries: list[dict], *, start: float | None = None) -> None:
    """Shade each recovery from failure to first step (``start``: time origin), or, with
    ``start`` None, draw a line between the last step of the old plan and the first of the
    new; one legend entry per policy."""
    labelled = set()
    for r in recoveries:
        policy = r.get("policy", "unknown")
        colour = _POLICY_COLOURS.get(policy, "tab:grey")
        label = None if policy in labelled else f"{policy} recovery"
        labelled.add(policy)
        if start is None:
            axis.axvline(r["start_step"] - 0.5, color=colour, linestyle="--", label=label)
        else:
            axis.axvspan(r["failed_at"] - start, r["first_step_at"] - start, color=colour, alpha=0.25, label=label)


def _legend(axis, **placement) -> None:
    """A legend where there is something to name (a run without steps has nothing)."""
    if axis.get_legend_handles_labels()[0]:
        axis.legend(fontsize=8, **placement)


def _no_data(axis, text: str) -> None:
    axis.text(0.5, 0.5, text, ha="center", va="center", transform=axis.transAxes)


def _plot_throughput(plt, run: RunRecords, path: Path) -> None:
    start = run.events[0]["time"] if run.events else 0.0
    figure, axis = plt.subplots(figsize=(8, 4))
    rates = _throughput(run)
    if rates:
        times = [rates[0][0] - start] + [b - start for _, b, _ in rates]
        values = [rates[0][2]] + [rate for _, _, rate in rates]
        axis.step(times, values, where="pre", color="tab:blue", label="samples/s (between commits)")
        axis.set_xlim(left=rates[0][0] - start - (rates[0][1] - rates[0][0]))
    else:
        _no_data(axis, "fewer than two successive steps committed")
    axis.set_ylim(bottom=0)
    axis.set(xlabel="time since the controller started (s)", ylabel="throughput (samples/s)",
             title=f"Throughput and training ranks ({run.seq_length} tokens per sample)")
    _mark_recoveries(axis, run.kind("recovery"), start=start)
    _mark_joins(axis, run.kind("join"), start=start)
    ranks = _active_ranks(run)
    if ranks:
        end = max(e["time"] for e in run.events)
        twin = axis.twinx()
        twin.step([t - start for t, _ in ranks] + [end - start], [n for _, n in ranks] + [ranks[-1][1]],
                  where="post", color="tab:green", label="training ranks")
        twin.set_ylim(0, max(n for _, n in ranks) + 1)
        twin.set_ylabel("ranks training (count)")
        twin.yaxis.get_major_locator().set_params(integer=True)
        handles, labels = axis.get_legend_handles_labels()
        more, more_labels = twin.get_legend_handles_labels()
        axis.legend(handles + more, labels + more_labels, loc="lower left", fontsize=8)
    _save(plt, figure, path)


def _plot_loss(plt, run: RunRecords, baseline: RunRecords | None, path: Path) -> None:
    figure, axis = plt.subplots(figsize=(8, 4))
    losses = run.losses
    if baseline is not None:
        base = baseline.losses
        axis.plot(sorted(base), [base[s] for s in sorted(base)], color="tab:grey", linestyle=":", marker=".",
                  label=f"baseline {baseline.directory.name}")
    if losses:
        axis.plot(sorted(losses), [losses[s] for s in sorted(losses)], color="tab:blue", marker=".",
                  label=f"this run ({run.directory.name})")
    else:
        _no_data(axis, "no committed steps")
    _mark_recoveries(axis, run.kind("recovery"))
    axis.xaxis.get_major_locator().set_params(integer=True)
    axis.set(xlabel="step", ylabel="loss (cross-entropy, nats)", title="Training loss per step")
    _legend(axis)
    _save(plt, figure, path)


def _plot_phases(plt, run: RunRecords, path: Path) -> None:
    recoveries = run.kind("recovery")
    figure, axis = plt.subplots(figsize=(8, 2 + 0.6 * max(1, len(recoveries))))
    if not recoveries:
        _no_data(axis, "no recoveries in this run")
        axis.set_yticks([])
    names = [f"gen {r['generation']}: {r.get('policy', 'unknown')}\nranks {r['failed_ranks']}" for r in recoveries]
    left = [0.0] * len(recoveries)
    for phase, colour in zip(PHASES, ("tab:red", "tab:orange", "tab:purple", "tab:green")):
        widths = [phase_seconds(r)[phase] for r in recoveries]
        if recoveries:
            axis.barh(names, widths, left=left, color=colour, label=phase)
        left = [a + b for a, b in zip(left, widths)]
    for row, total in enumerate(left):
        axis.text(total, row, f" {total:.3f} s", va="center", fontsize=8)
    if recoveries:
        axis.set_xlim(right=max(left) * 1.2)
        axis.invert_yaxis()
        axis.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1))
    axis.set(xlabel="seconds from the failure", title="Recovery time by phase")
    _save(plt, figure, path)


def _plot_step_time(plt, run: RunRecords, path: Path) -> None:
    figure, axis = plt.subplots(figsize=(10, 4))
    measured = _measured_step_s(run)
    generation_of = {e["step"]: e["generation"] for e in run.commits}
    for n, generation in enumerate(sorted({generation_of[s] for s in measured})):
        steps = sorted(s for s in measured if generation_of[s] == generation)
        axis.plot(steps, [measured[s] for s in steps], marker="o", color="tab:blue",
                  label="measured (gap between commits)" if n == 0 else None)
    if not measured:
        _no_data(axis, "no two successive commits of one plan")
    reported = {e["step"]: e["step_time_s"] for e in run.commits if _is_number(e.get("step_time_s"))}
    if reported:
        axis.plot(sorted(reported), [reported[s] for s in sorted(reported)], marker="x", color="tab:cyan",
                  label="measured by the ranks")
    estimates = _estimated_step_s(run)
    for n, step in enumerate(sorted(estimates)):
        axis.hlines(estimates[step], step - 0.4, step + 0.4, color="tab:red",
                    label="estimated (decision, then online profile)" if n == 0 else None)
    _mark_recoveries(axis, run.kind("recovery"))
    axis.set_ylim(bottom=0)
    axis.xaxis.get_major_locator().set_params(integer=True)
    missing = sorted({e["generation"] for e in run.commits if e["step"] not in estimates})
    axis.set(xlabel="step", ylabel="step time (s)", title="Estimated vs measured step time"
             + (f" (no estimate for generation {', '.join(map(str, missing))})" if missing else ""))
    _legend(axis, loc="upper left", bbox_to_anchor=(1.01, 1))
    _save(plt, figure, path)


def _save(plt, figure, path: Path) -> None:
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def write_report(run: RunRecords, out: Path, *, baseline: RunRecords | None = None) -> dict[str, Path]:
    """``PLOTS`` and ``report.txt`` under ``out`` (replacing an earlier report's); returns
    their paths by file name."""
    from odyssey_megatron.plotting import pyplot

    plt = pyplot()

    out = Path(out)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        raise ConfigError("--out", f"{out} is a file; give a directory") from None
    except OSError as exc:
        raise ConfigError("--out", f"cannot create {out}: {exc.strerror}") from None
    paths = {name: out / name for name in (*PLOTS, "report.txt")}
    _plot_throughput(plt, run, paths["throughput.png"])
    _plot_loss(plt, run, baseline, paths["loss.png"])
    _plot_phases(plt, run, paths["recovery_phases.png"])
    _plot_step_time(plt, run, paths["step_time.png"])
    paths["report.txt"].write_text(summary_text(run) + "\n")
    return paths
