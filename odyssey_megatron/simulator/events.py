"""Cluster events: seeded failure and repair processes, or a trace file.

Each failure unit (a device, or a node) draws a lifetime; when it fails it may come back
after a repair time and draw a new lifetime. Units failing at the same instant (a node)
form one event. Everything comes from one numpy Generator seeded by the scenario, so a
seed fixes the run.
"""

from __future__ import annotations

import csv
import heapq
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from odyssey_megatron.config import ConfigError
from odyssey_megatron.simulator.scenario import FailureConfig, RepairConfig

FAIL = "fail"
JOIN = "join"


@dataclass(frozen=True)
class ClusterEvent:
    time_s: float
    kind: str
    """fail or join."""
    devices: tuple[int, ...]


def _lifetime_h(rng: np.random.Generator, failures: FailureConfig, rate_per_unit_hour: float) -> float:
    mean = 1.0 / rate_per_unit_hour
    if failures.process == "weibull":
        k = failures.weibull_shape
        from math import gamma

        return float(rng.weibull(k) * mean / gamma(1 + 1 / k))
    return float(rng.exponential(mean))


def generate_events(
    *,
    failures: FailureConfig,
    repairs: RepairConfig,
    num_devices: int,
    devices_per_node: int,
    duration_s: float,
    seed: int,
) -> list[ClusterEvent]:
    """Failure (and repair) events within ``duration_s``, in time order."""
    rng = np.random.default_rng(seed)
    if failures.unit == "node":
        units = [tuple(range(n, min(n + devices_per_node, num_devices))) for n in range(0, num_devices, devices_per_node)]
        rate = failures.rate_per_device_hour * devices_per_node
    else:
        units = [(d,) for d in range(num_devices)]
        rate = failures.rate_per_device_hour
    queue = [(_lifetime_h(rng, failures, rate) * 3600.0, FAIL, i) for i in range(len(units))]
    heapq.heapify(queue)
    events = []
    while queue:
        t, kind, unit = heapq.heappop(queue)
        if t >= duration_s:
            continue
        events.append(ClusterEvent(t, kind, units[unit]))
        if kind == FAIL and repairs.enabled:
            heapq.heappush(queue, (t + rng.exponential(repairs.mean_hours) * 3600.0, JOIN, unit))
        elif kind == JOIN:
            heapq.heappush(queue, (t + _lifetime_h(rng, failures, rate) * 3600.0, FAIL, unit))
    return events


def read_trace(path: Path, *, num_devices: int) -> list[ClusterEvent]:
    """Events from a CSV trace (time_s,device,event); rows at the same time and of the same
    kind become one event."""
    if not path.is_file():
        raise ConfigError("failures.trace", f"no such file: {path}")
    grouped: dict[tuple[float, str], list[int]] = {}
    with path.open(newline="") as handle:
        reader = csv.DictReader(handle)
        missing = {"time_s", "device", "event"} - set(reader.fieldnames or [])
        if missing:
            raise ConfigError("failures.trace", f"{path} lacks columns {', '.join(sorted(missing))}")
        for line, row in enumerate(reader, start=2):
            try:
                time_s, device = float(row["time_s"]), int(row["device"])
            except ValueError:
                raise ConfigError("failures.trace", f"{path}:{line}: time_s must be a number and device an integer") from None
            if row["event"] not in (FAIL, JOIN):
                raise ConfigError("failures.trace", f"{path}:{line}: event must be fail or join, got {row['event']!r}")
            if not 0 <= device < num_devices:
                raise ConfigError("failures.trace", f"{path}:{line}: device must lie in 0..{num_devices - 1}")
            grouped.setdefault((time_s, row["event"]), []).append(device)
    return [ClusterEvent(t, kind, tuple(sorted(devs))) for (t, kind), devs in sorted(grouped.items())]
