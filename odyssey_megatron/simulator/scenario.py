"""Simulation scenarios: the job, the failure and repair processes, the costs, the systems.

A scenario YAML names a recipe (the job and its Odyssey settings) and adds what only a
simulation needs. Loaded like recipes (structured omegaconf, one-line errors naming the
key), so a typo in a scenario never silently falls back to a default.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import List, Optional, Sequence

from odyssey_megatron import limits
from odyssey_megatron.config import RecipeConfig, load_config, require_wandb_project
from odyssey_megatron.errors import ConfigError
from odyssey_megatron.profile import ModelProfile
from odyssey_megatron.profile_file import recipe_profile
from odyssey_megatron.typed_yaml import (
    Choice,
    choice,
    load_structured,
    require,
    require_at_most,
    require_non_negative,
    require_plain_numbers,
    require_positive,
)
from odyssey_megatron.units import SECONDS_PER_HOUR

SYSTEMS = ("odyssey", "oobleck", "recycle", "recycle_1f1b", "checkpoint", "oracle",
           "replica_drop", "redistribute", "dp_scale_in", "hot_spares", "odyssey_shrink")
BASELINES = ("oobleck", "recycle", "recycle_1f1b", "checkpoint", "replica_drop", "redistribute", "dp_scale_in",
             "hot_spares")
"""The systems Odyssey is compared with; the others are Odyssey itself and its variants."""
System = Choice("System", [(name, name) for name in SYSTEMS], module=__name__)
OPT_IN = ("odyssey_shrink",)
"""Systems a scenario runs only where its ``systems`` name them: Odyssey with
``odyssey.batch_on_failure: shrink``, which trains a smaller batch than the others."""


class FailureProcess(Choice):
    exponential = "exponential"
    weibull = "weibull"
    trace = "trace"


class FailureUnit(Choice):
    device = "device"
    node = "node"


class RestartLayouts(Choice):
    """Which layouts a checkpoint restart resumes on (``simulator.restart``)."""

    megatron = "megatron"
    varuna = "varuna"


class ReplicaPlacement(Choice):
    """Where the replica systems place their replicas (``simulator.replicas``)."""

    node_aligned = "node_aligned"
    stage_major = "stage_major"


class WandbMode(Choice):
    offline = "offline"
    online = "online"
    disabled = "disabled"


@dataclass
class FailureConfig:
    """When devices fail."""

    process: FailureProcess = FailureProcess.exponential
    """exponential or weibull lifetimes per failure unit, or trace (read ``trace``)."""
    rate_per_device_hour: float = 0.1
    """Failures per device per hour; the paper's '10% per hour' read per device."""
    weibull_shape: float = 1.0
    """Weibull k (k < 1: infant mortality, k > 1: wear-out); the mean lifetime stays 1/rate."""
    unit: FailureUnit = FailureUnit.device
    """device (its TP group goes down) or node (every device of a machine at once)."""
    trace: Optional[str] = None
    """CSV with columns time_s,device,event (event: fail or join); relative to the scenario file."""

    def __post_init__(self) -> None:
        require_plain_numbers("failures", self)
        self.process = choice("failures.process", FailureProcess, self.process)
        self.unit = choice("failures.unit", FailureUnit, self.unit)
        require_positive("failures", self, "rate_per_device_hour")
        require_at_most("failures", self, 1e6, "a failure every 3.6 ms", "rate_per_device_hour")
        require(0.1 <= self.weibull_shape <= 20, "failures.weibull_shape",
                f"must lie in 0.1..20 (beyond, the mean-preserving scale overflows); got {self.weibull_shape}")
        require(self.process != "trace" or bool(self.trace), "failures.trace",
                "must name a CSV file when failures.process is trace")
        require(self.trace is None or self.process == "trace", "failures.trace",
                f"is only read when failures.process is trace (it is {self.process}); set both or neither")


@dataclass
class RepairConfig:
    enabled: bool = False
    """Failed units come back after a repair time (exponential)."""
    mean_hours: float = 2.0

    def __post_init__(self) -> None:
        require_plain_numbers("repairs", self)
        require_positive("repairs", self, "mean_hours")
        require_at_most("repairs", self, limits.MAX_HOURS, "a year", "mean_hours")


@dataclass
class CostConfig:
    """Costs every system pays alike."""

    detection_s: float = 5.0
    """From a failure to the survivors knowing about it."""
    restart_s: float = 120.0
    """Relaunch processes and rebuild model and optimizer when a job restarts."""
    checkpoint_interval_min: float = 30.0
    checkpoint_save_s: float = 20.0
    """Training time each checkpoint blocks (charged to every system)."""
    checkpoint_load_s: float = 60.0
    decision_s: float = 0.05
    """Modelled plan-search time for Odyssey (measured: benchmarks/plan_search.py); a fixed
    value keeps results identical under a seed."""

    def __post_init__(self) -> None:
        require_plain_numbers("costs", self)
        seconds = ("detection_s", "restart_s", "checkpoint_save_s", "checkpoint_load_s", "decision_s")
        require_positive("costs", self, "checkpoint_interval_min")
        require_non_negative("costs", self, *seconds)
        require_at_most("costs", self, limits.MAX_SECONDS, "a year, in seconds", *seconds)
        require_at_most("costs", self, limits.MAX_SECONDS / 60, "a year, in minutes", "checkpoint_interval_min")
        require(self.checkpoint_save_s < self.checkpoint_interval_min * 60, "costs.checkpoint_save_s",
                 "must be shorter than the checkpoint interval")


@dataclass
class HotSparesConfig:
    """The ``hot_spares`` system: warm spare nodes and its in-job restart."""

    restart_s: float = 30.0
    """From detection to training again on a spare (TrainMover about 20 s, DeadPool under 40 s)."""
    rack_devices: int = 72
    """Devices per rack, spares included."""
    spares_per_rack: int = 8
    """Spare devices held in each rack the job fills (about 8 of 72 reported), rounded up to whole nodes."""

    def __post_init__(self) -> None:
        require_plain_numbers("hot_spares", self)
        require_non_negative("hot_spares", self, "restart_s")
        require_at_most("hot_spares", self, limits.MAX_SECONDS, "a year, in seconds", "restart_s")
        require_positive("hot_spares", self, "rack_devices", "spares_per_rack")
        require_at_most("hot_spares", self, limits.MAX_WORKERS * limits.MAX_DEVICES_PER_NODE,
                        "more devices than any job has", "rack_devices")
        require(self.spares_per_rack < self.rack_devices, "hot_spares.spares_per_rack",
                f"must be below hot_spares.rack_devices ({self.rack_devices}), or no device trains; "
                f"got {self.spares_per_rack}")


@dataclass
class ScenarioConfig:
    recipe: str = "recipes/llama2_7b/ascend_910b_32.yaml"
    """The job: a recipe YAML, relative to the scenario file or the working directory."""
    recipe_overrides: List[str] = field(default_factory=list)
    """Dotlist overrides applied to the recipe, e.g. parallel.data_parallel_size=16."""
    duration_hours: float = 9.0
    seed: int = 0
    failures: FailureConfig = field(default_factory=FailureConfig)
    repairs: RepairConfig = field(default_factory=RepairConfig)
    costs: CostConfig = field(default_factory=CostConfig)
    hot_spares: HotSparesConfig = field(default_factory=HotSparesConfig)
    systems: List[System] = field(default_factory=lambda: [s for s in System if s.value not in OPT_IN])
    """The systems to simulate; default all but ``OPT_IN``'s. ``odyssey`` decides with the
    recipe's ``odyssey:`` section, ``odyssey_shrink`` with it and ``batch_on_failure: shrink``."""
    oobleck_tolerated_failures: int = 2
    """Oobleck's f: it needs (f+1) * n0 workers and gives up below that."""
    odyssey_learns_failure_rate: bool = False
    """Odyssey's Eq. 8 learns the failure rate from the failures it sees, from the recipe's
    ``odyssey.device_mtbf_hours``, as a live run does; false: it uses ``failures.rate_per_device_hour``,
    the truth the scenario draws from. A trace has no such rate: Odyssey learns from it."""
    restart_layouts: RestartLayouts = RestartLayouts.megatron
    """megatron: a checkpoint restart resumes on a layout stock Megatron runs (DP divides
    the global batch's micro-batches); varuna: any DP, the micro-batches split unevenly."""
    replica_placement: ReplicaPlacement = ReplicaPlacement.node_aligned
    """node_aligned: each replica of replica_drop, redistribute and dp_scale_in on whole
    nodes of its own, as torchft deploys replica groups; stage_major: the job's plan's
    placement (Megatron's rank order), a node holding one stage of several replicas."""
    sample_interval_s: float = 60.0
    wandb_mode: WandbMode = WandbMode.offline
    """offline (a local run directory, the default), online, or disabled."""
    wandb_project: str = "odyssey-simulator"

    def __post_init__(self) -> None:
        require_plain_numbers("", self)
        require_positive("", self, "duration_hours", "sample_interval_s")
        require_non_negative("", self, "seed", "oobleck_tolerated_failures")
        require_at_most("", self, limits.MAX_HOURS, "a year", "duration_hours")
        samples = self.duration_hours * SECONDS_PER_HOUR / self.sample_interval_s
        require(samples <= limits.MAX_SAMPLES, "sample_interval_s",
                f"gives {samples:,.0f} samples over duration_hours={self.duration_hours:g}; at most "
                f"{limits.MAX_SAMPLES:,} per system are written; got {self.sample_interval_s:g}")
        require(bool(self.systems), "systems", f"must list at least one of {', '.join(SYSTEMS)}")
        self.systems = [choice("systems", System, name) for name in self.systems]
        twice = sorted({name for name in self.systems if self.systems.count(name) > 1})
        require(not twice, "systems", f"lists {', '.join(twice)} more than once; list each system once")
        require(bool(self.recipe), "recipe", "must name a recipe YAML")
        self.wandb_mode = choice("wandb_mode", WandbMode, self.wandb_mode)
        self.restart_layouts = choice("restart_layouts", RestartLayouts, self.restart_layouts)
        self.replica_placement = choice("replica_placement", ReplicaPlacement, self.replica_placement)
        require_wandb_project("wandb_project", self.wandb_project)


@dataclass(frozen=True)
class Scenario:
    config: ScenarioConfig
    recipe: RecipeConfig
    profile: ModelProfile
    """The job's profile (``profile_file.recipe_profile``), read with the scenario so a
    bad ``odyssey.profile`` is refused before anything runs."""
    base_dir: Path
    """Where relative paths in the scenario (recipe, trace) are resolved first."""

    def resolve(self, path: str) -> Path:
        candidate = self.base_dir / path
        return candidate if candidate.exists() else Path(path)


def load_scenario(path: str | Path | None, overrides: Sequence[str] = ()) -> Scenario:
    """Load and validate a scenario and its recipe; raises ConfigError naming the key."""
    config: ScenarioConfig = load_structured(ScenarioConfig, path, overrides, flag="--scenario")
    base = Path(path).parent if path is not None else Path(".")
    recipe_path = base / config.recipe if (base / config.recipe).exists() else Path(config.recipe)
    if not recipe_path.exists():
        raise ConfigError("recipe", f"no such recipe file: {config.recipe}")
    recipe = load_config(recipe_path, config.recipe_overrides, flag="recipe")
    return Scenario(config=config, recipe=recipe, profile=recipe_profile(recipe), base_dir=base)
