"""Run a scenario: build the job's context, generate events, live through them with every
system, and summarise against the fault-free and fault-scaled ideals and per device-hour
paid (goodput)."""

from __future__ import annotations

import bisect
from dataclasses import dataclass, replace
from typing import Callable

from odyssey_megatron import limits
from odyssey_megatron.cluster import ClusterState
from odyssey_megatron.config import BatchOnFailure
from odyssey_megatron.errors import ConfigError
from odyssey_megatron.simulator.checkpoint import CheckpointRestartSystem
from odyssey_megatron.simulator.dp_scale_in import DpScaleInSystem
from odyssey_megatron.simulator.engine import Timeline, run_system
from odyssey_megatron.simulator.events import FAIL, ClusterEvent, generate_events, read_trace
from odyssey_megatron.simulator.hot_spares import HotSparesSystem, spare_devices_for
from odyssey_megatron.simulator.odyssey import OdysseySystem, scenario_failure_model
from odyssey_megatron.simulator.oobleck import OobleckSystem
from odyssey_megatron.simulator.recycle import ReCycleSystem
from odyssey_megatron.simulator.redistribute import RedistributeSystem
from odyssey_megatron.simulator.replica_drop import ReplicaDropSystem
from odyssey_megatron.simulator.scenario import Scenario
from odyssey_megatron.simulator.system import RECOVERING, RESTARTING, TRAINING, Horizon, SimulationContext
from odyssey_megatron.units import SECONDS_PER_HOUR


@dataclass(frozen=True)
class SystemSummary:
    avg_throughput: float
    """Samples/s over the whole run, rollbacks subtracted."""
    tokens_per_s: float
    transition_time_s: float
    """Time paused: recovering in memory or restarting from a checkpoint."""
    restart_time_s: float
    fraction_of_ideal: float
    """Of the fault-scaled ideal (``fault_scaled_ideal``); never above 1."""
    fraction_of_fault_free: float
    lost_samples: float
    goodput: float
    """Samples trained (rollbacks subtracted) per device-hour paid: the job's devices and
    the system's spares, for the whole run."""
    paid_devices: int
    ettr: float
    """Effective training time ratio: the share of wall time spent on steps that were
    kept (not paused, stopped, saving checkpoints or rolled back), at whatever rate."""
    dropped_samples: float
    """Samples the steps lacked against the job's global batch (a system that shrinks the
    batch); 0 for the others."""
    horizons: tuple[Horizon, ...] = ()
    """Each Eq. 8 decision's horizon and where its failure rate came from (Odyssey's
    systems); empty for the others."""


@dataclass
class SimulationResult:
    scenario: Scenario
    events: list[ClusterEvent]
    fault_free_throughput: float
    ideal_throughput: float
    timelines: dict[str, Timeline]
    summaries: dict[str, SystemSummary]

    @property
    def ratios(self) -> dict[str, float | None]:
        """Odyssey's goodput over each other system's (its throughput ratio where both pay
        for the same devices); None where that system trained nothing (the ratio has no
        finite value)."""
        odyssey = self.summaries["odyssey"].goodput if "odyssey" in self.summaries else None
        if odyssey is None:
            return {}
        return {name: odyssey / s.goodput if s.goodput > 0 else None
                for name, s in self.summaries.items() if name != "odyssey"}


def simulation_context(scenario: Scenario) -> SimulationContext:
    config = scenario.config
    recipe, costs = scenario.recipe, config.costs
    return SimulationContext(
        profile=scenario.profile,
        num_layers=recipe.model.num_layers,
        tensor_parallel_size=recipe.parallel.tensor_model_parallel_size,
        pipeline_parallel_size=recipe.parallel.pipeline_model_parallel_size,
        data_parallel_size=recipe.parallel.data_parallel_size,
        num_micro_batches=recipe.training.num_micro_batches,
        devices_per_node=recipe.cluster.devices_per_node,
        restart_s=costs.restart_s,
        checkpoint_interval_s=costs.checkpoint_interval_min * 60,
        checkpoint_save_s=costs.checkpoint_save_s,
        checkpoint_load_s=costs.checkpoint_load_s,
        pricing=recipe.odyssey.pricing,
        detection_s=costs.detection_s,
        restart_layouts=str(config.restart_layouts),
        replica_placement=str(config.replica_placement),
    )


def scenario_events(scenario: Scenario) -> list[ClusterEvent]:
    """The scenario's events (drawn or traced), refused when more than a simulation can
    live through in bounded time (``limits.check_simulation_size``)."""
    config, recipe = scenario.config, scenario.recipe
    devices = recipe.parallel.num_ranks
    duration = config.duration_hours * SECONDS_PER_HOUR
    if config.failures.process == "trace":
        events = read_trace(scenario.resolve(config.failures.trace), num_devices=devices)
    else:
        events = generate_events(
            failures=config.failures, repairs=config.repairs, num_devices=devices,
            devices_per_node=recipe.cluster.devices_per_node, duration_s=duration,
            seed=config.seed, max_events=limits.MAX_EVENTS + 1,
        )
    workers = devices // recipe.parallel.tensor_model_parallel_size
    limits.check_simulation_size(events=len(events), workers=workers)
    return events


def _build_systems(scenario: Scenario, context: SimulationContext, events: list[ClusterEvent],
                   cluster: ClusterState) -> list:
    """Every system of the scenario, before any runs: a job Oobleck cannot take is a
    scenario error found now, not after the other systems were simulated."""
    try:
        systems = list(_systems(scenario, context, events))
    except ValueError as exc:  # only Oobleck refuses a job when built
        raise ConfigError("oobleck_tolerated_failures", f"oobleck cannot run this job: {exc}") from None
    for system in systems:
        if isinstance(system, OobleckSystem) and len(cluster.alive_workers) < system.min_workers:
            raise ConfigError(
                "oobleck_tolerated_failures",
                f"oobleck cannot run this job: it needs (f+1)*n0 = {system.min_workers} workers to tolerate "
                f"{system.tolerated_failures} "
                f"failure(s) and the job has {len(cluster.alive_workers)}; lower it or drop oobleck from systems",
            )
    return systems


REPLICA_SYSTEMS = {system.name: system for system in (ReplicaDropSystem, RedistributeSystem, DpScaleInSystem)}


def _systems(scenario: Scenario, context: SimulationContext, events: list[ClusterEvent]):
    config = scenario.config
    costs = config.costs
    duration = config.duration_hours * SECONDS_PER_HOUR
    for name in config.systems:
        if name in ("odyssey", "oracle", "odyssey_shrink"):
            # What a checkpoint restart really costs in this scenario.
            penalty = costs.restart_s + costs.checkpoint_load_s + costs.checkpoint_interval_min * 30
            settings = replace(scenario.recipe.odyssey, checkpoint_restart_penalty_s=penalty)
            if name == "odyssey_shrink":
                settings = replace(settings, batch_on_failure=BatchOnFailure.shrink)
            yield OdysseySystem(
                context, settings=settings, detection_s=costs.detection_s,
                decision_s=costs.decision_s, name=name,
                event_times=[e.time_s for e in events] if name == "oracle" else None, horizon_s=duration,
                failure_model=scenario_failure_model(config.failures, learn=config.odyssey_learns_failure_rate),
                repairs=config.repairs.enabled, mean_repair_s=config.repairs.mean_hours * SECONDS_PER_HOUR,
                failure_unit=str(config.failures.unit),
            )
        elif name in ("recycle", "recycle_1f1b"):
            yield ReCycleSystem(context, detection_s=costs.detection_s, name=name, decoupled=name == "recycle",
                                reroute_s=scenario.recipe.odyssey.reroute_restart_s)
        elif name == "checkpoint":
            yield CheckpointRestartSystem(context)  # detection: context.detection_s, in the restart
        elif name == "oobleck":
            yield OobleckSystem(context, tolerated_failures=config.oobleck_tolerated_failures,
                                detection_s=costs.detection_s, start_on_job_plan=True)
        elif name in REPLICA_SYSTEMS:
            # A replica rejoins, or leaves, after the communicator rebuild every in-memory system pays.
            yield REPLICA_SYSTEMS[name](context, detection_s=costs.detection_s,
                                        reconfigure_s=scenario.recipe.odyssey.reroute_restart_s)
        elif name == "hot_spares":
            spares = config.hot_spares
            devices = scenario.recipe.parallel.num_ranks
            yield HotSparesSystem(context, detection_s=costs.detection_s, restart_s=spares.restart_s,
                                  spare_devices=spare_devices_for(devices, rack_devices=spares.rack_devices,
                                                                  spares_per_rack=spares.spares_per_rack,
                                                                  devices_per_node=context.devices_per_node))


def fault_scaled_ideal(
    fault_free: float, cluster: ClusterState, events: list[ClusterEvent], timelines: list[Timeline], duration_s: float
) -> float:
    """Average samples/s of a system that never pauses: at every moment the fault-free
    throughput times the share of devices healthy then (a device counts while its TP
    group is whole), or, where a system trains faster than that share (losing a worker
    of a pipeline with bubbles costs less than its share), that system's rate. No system
    can exceed it: its rate is below this one at every moment."""
    world = cluster.world_size
    healthy = [(0.0, cluster.alive_devices)]  # (from, devices) steps
    for event in events:
        if event.time_s >= duration_s:
            break
        cluster = cluster.fail_ranks(event.devices) if event.kind == FAIL else cluster.repair_ranks(event.devices)
        healthy.append((event.time_s, cluster.alive_devices))
    bounds = sorted({0.0, duration_s, *(t for t, _ in healthy),
                     *(b for line in timelines for seg in line.segments for b in (seg.start_s, seg.end_s))})
    steps = [t for t, _ in healthy]
    segment_starts = [[seg.start_s for seg in line.segments] for line in timelines]
    total = 0.0
    for start, end in zip(bounds, bounds[1:]):
        if start >= duration_s:
            break
        rate = fault_free * healthy[bisect.bisect_right(steps, start) - 1][1] / world
        for line, starts in zip(timelines, segment_starts):
            index = bisect.bisect_right(starts, start) - 1
            if index >= 0 and line.segments[index].end_s > start:
                rate = max(rate, line.segments[index].samples_per_s)
        total += rate * (end - start)
    return total / duration_s


def simulate(
    scenario: Scenario,
    *,
    events: list[ClusterEvent] | None = None,
    progress: Callable[[str, int], Callable[[], None]] | None = None,
) -> SimulationResult:
    """Run every system of ``scenario`` through ``events`` (default: ``scenario_events``).
    ``progress(name, num_events)`` is called as each system starts and returns the
    callback to call after each of its events."""
    config, recipe = scenario.config, scenario.recipe
    context = simulation_context(scenario)
    events = scenario_events(scenario) if events is None else events
    duration = config.duration_hours * SECONDS_PER_HOUR
    cluster = ClusterState(
        world_size=recipe.parallel.num_ranks,
        tensor_parallel_size=recipe.parallel.tensor_model_parallel_size,
        devices_per_node=recipe.cluster.devices_per_node,
    )
    duty = 1.0 - context.checkpoint_save_s / context.checkpoint_interval_s
    timelines, paid = {}, {}
    for system in _build_systems(scenario, context, events, cluster):
        paid[system.name] = cluster.world_size + system.spare_devices
        on_event = progress(system.name, len(events)) if progress is not None else None
        timelines[system.name] = run_system(system, cluster=cluster, events=events, duration_s=duration,
                                            checkpoint_duty=duty, on_event=on_event)
    fault_free = CheckpointRestartSystem(context).start(cluster) * duty
    ideal = fault_scaled_ideal(fault_free, cluster, events, list(timelines.values()), duration)
    tokens = recipe.model.seq_length
    summaries = {}
    for name, timeline in timelines.items():
        avg = timeline.samples / duration
        summaries[name] = SystemSummary(
            avg_throughput=avg,
            tokens_per_s=avg * tokens,
            transition_time_s=timeline.time_in(RECOVERING, RESTARTING),
            restart_time_s=timeline.time_in(RESTARTING),
            fraction_of_ideal=avg / ideal if ideal > 0 else 0.0,
            fraction_of_fault_free=avg / fault_free if fault_free > 0 else 0.0,
            lost_samples=timeline.lost_samples,
            goodput=timeline.samples / (paid[name] * config.duration_hours),
            paid_devices=paid[name],
            ettr=duty * (timeline.time_in(TRAINING) - timeline.lost_time_s) / duration,
            dropped_samples=timeline.dropped_samples,
            horizons=tuple(timeline.horizons),
        )
    return SimulationResult(scenario, events, fault_free, ideal, timelines, summaries)
