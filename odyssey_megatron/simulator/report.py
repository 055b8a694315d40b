"""Simulation output: per-system time series, the summary, Fig. 7/8-style plots, W&B.

Series are sampled every ``sample_interval_s``: the average throughput over the window
(so a short pause shows as a dip), the devices alive at its end and the state there.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

from odyssey_megatron.errors import ConfigError
from odyssey_megatron.simulator.engine import Timeline
from odyssey_megatron.simulator.run import SimulationResult
from odyssey_megatron.simulator.scenario import ScenarioConfig
from odyssey_megatron.units import SECONDS_PER_HOUR


def sample_series(timeline: Timeline, *, interval_s: float, duration_s: float) -> list[dict]:
    rows, segments, index = [], timeline.segments, 0
    t = 0.0
    while t < duration_s - 1e-9:
        end = min(t + interval_s, duration_s)
        samples, state, devices = 0.0, None, 0
        while index < len(segments) and segments[index].end_s <= t:
            index += 1
        j = index
        while j < len(segments) and segments[j].start_s < end:
            seg = segments[j]
            overlap = min(seg.end_s, end) - max(seg.start_s, t)
            samples += overlap * seg.samples_per_s
            state, devices = seg.state, seg.active_devices
            j += 1
        rows.append({"time_s": end, "samples_per_s": samples / (end - t), "active_devices": devices, "state": state})
        t = end
    return rows


def system_series(result: SimulationResult) -> dict[str, list[dict]]:
    """Every system's sampled series, at the scenario's interval."""
    config = result.scenario.config
    duration = config.duration_hours * SECONDS_PER_HOUR
    return {name: sample_series(t, interval_s=config.sample_interval_s, duration_s=duration)
            for name, t in result.timelines.items()}


def summary_json(result: SimulationResult) -> dict:
    return {
        "scenario": {
            "duration_hours": result.scenario.config.duration_hours,
            "seed": result.scenario.config.seed,
            "devices": result.scenario.recipe.parallel.num_ranks,
            "failures": sum(1 for e in result.events if e.kind == "fail"),
            "repairs": sum(1 for e in result.events if e.kind == "join"),
        },
        "fault_free_throughput": result.fault_free_throughput,
        "ideal_throughput": result.ideal_throughput,
        "systems": {name: asdict(s) for name, s in result.summaries.items()},
        "ratios": result.ratios,
    }


def write_outputs(result: SimulationResult, series: dict[str, list[dict]], out_dir: Path) -> dict[str, Path]:
    """series.json, summary.json, active_devices.png and throughput.png under ``out_dir``."""
    from odyssey_megatron.plotting import pyplot

    plt = pyplot()

    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"series": out_dir / "series.json", "summary": out_dir / "summary.json"}
    paths["series"].write_text(json.dumps(series, allow_nan=False))
    paths["summary"].write_text(json.dumps(summary_json(result), indent=2, allow_nan=False))

    figure, axis = plt.subplots(figsize=(7, 3.5))
    first = next(iter(series.values()))
    axis.step([r["time_s"] / SECONDS_PER_HOUR for r in first], [r["active_devices"] for r in first], where="post")
    axis.set(xlabel="time (h)", ylabel="active devices", title="Active devices over time")
    figure.tight_layout()
    paths["active_devices"] = out_dir / "active_devices.png"
    figure.savefig(paths["active_devices"], dpi=120)
    plt.close(figure)

    figure, axis = plt.subplots(figsize=(7, 3.5))
    for name, rows in series.items():
        axis.plot([r["time_s"] / SECONDS_PER_HOUR for r in rows], [r["samples_per_s"] for r in rows], label=name, linewidth=1)
    axis.axhline(result.fault_free_throughput, color="grey", linestyle=":", label="fault-free")
    axis.set(xlabel="time (h)", ylabel="samples/s", title="Training throughput over time")
    axis.legend(fontsize=8)
    figure.tight_layout()
    paths["throughput"] = out_dir / "throughput.png"
    figure.savefig(paths["throughput"], dpi=120)
    plt.close(figure)
    return paths


def start_wandb(config: ScenarioConfig, out_dir: Path):
    """The W&B run (None when disabled), started before the simulation so that a bad mode,
    project or WANDB_* environment variable is a one-line error, not lost results."""
    if config.wandb_mode == "disabled":
        return None
    try:
        import wandb
    except ImportError:
        raise ConfigError("wandb_mode", f"{config.wandb_mode} needs the wandb package; install it or set "
                                        "wandb_mode=disabled") from None
    try:
        return wandb.init(project=config.wandb_project, mode=config.wandb_mode.value, dir=str(out_dir),
                          config={"duration_hours": config.duration_hours, "seed": config.seed},
                          job_type="simulate", reinit="finish_previous")
    except Exception as exc:  # wandb raises its own errors, pydantic's and OSError for bad settings
        problem = " ".join(str(exc).split(" For further information")[0].split())[:200]
        raise ConfigError("wandb_mode", f"W&B could not start a run in {config.wandb_mode} mode (check "
                                        "wandb_project and the WANDB_* environment variables, or set "
                                        f"wandb_mode=disabled): {problem}") from None


def log_to_wandb(run, result: SimulationResult, series: dict[str, list[dict]]) -> Path:
    """The same series and summary into ``run``, finished; returns its directory."""
    run.config.update(summary_json(result)["scenario"], allow_val_change=True)
    times = [row["time_s"] for row in next(iter(series.values()))]
    run.define_metric("time_h")  # simulated hours: the x-axis of every series
    for name in series:
        run.define_metric(f"{name}/*", step_metric="time_h")
    for i, time_s in enumerate(times):
        row = {"time_h": time_s / SECONDS_PER_HOUR}
        for name, rows in series.items():
            row[f"{name}/samples_per_s"] = rows[i]["samples_per_s"]
            row[f"{name}/active_devices"] = rows[i]["active_devices"]
        run.log(row, step=i)
    for name, summary in result.summaries.items():
        for key, value in asdict(summary).items():
            run.summary[f"{name}/{key}"] = value
    for name, ratio in result.ratios.items():
        run.summary[f"ratio/odyssey_over_{name}"] = ratio
    location = Path(run.dir)
    run.finish()
    return location
