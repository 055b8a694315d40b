"""Cluster events: seeded failure and repair processes, or a trace file.

Each failure unit (a device, or a node) draws a lifetime; when it fails it may come back
after a repair time and draw a new lifetime. Units failing at the same instant (a node)
form one event. Everything comes from one numpy Generator seeded by the scenario, so a
seed fixes the run.
"""

from __future__ import annotations

import csv
import heapq
import io
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from odyssey_megatron import limits
from odyssey_megatron.errors import ConfigError
from odyssey_megatron.input_files import read_text
from odyssey_megatron.simulator.scenario import FailureConfig, RepairConfig
from odyssey_megatron.units import SECONDS_PER_HOUR

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
    max_events: int | None = None,
) -> list[ClusterEvent]:
    """Failure (and repair) events within ``duration_s``, in time order; at most
    ``max_events`` of them (the caller refuses a scenario that reaches it), so a huge rate
    with quick repairs cannot grow the list without bound."""
    rng = np.random.default_rng(seed)
    if failures.unit == "node":
        units = [tuple(range(n, min(n + devices_per_node, num_devices))) for n in range(0, num_devices, devices_per_node)]
        rate = failures.rate_per_device_hour * devices_per_node
    else:
        units = [(d,) for d in range(num_devices)]
        rate = failures.rate_per_device_hour
    queue = [(_lifetime_h(rng, failures, rate) * SECONDS_PER_HOUR, FAIL, i) for i in range(len(units))]
    heapq.heapify(queue)
    events = []
    while queue and (max_events is None or len(events) < max_events):
        t, kind, unit = heapq.heappop(queue)
        if t >= duration_s:
            continue
        events.append(ClusterEvent(t, kind, units[unit]))
        if kind == FAIL and repairs.enabled:
            heapq.heappush(queue, (t + rng.exponential(repairs.mean_hours) * SECONDS_PER_HOUR, JOIN, unit))
        elif kind == JOIN:
            heapq.heappush(queue, (t + _lifetime_h(rng, failures, rate) * SECONDS_PER_HOUR, FAIL, unit))
    return events


TRACE_COLUMNS = ("time_s", "device", "event")


def read_trace(path: Path, *, num_devices: int) -> list[ClusterEvent]:
    """Events from a CSV trace (time_s,device,event), checked row by row (a finite,
    non-negative time, a known device and event) with the line in every error; rows may
    come in any order, and those at the same time and of the same kind become one event."""
    key = "failures.trace"
    text = read_text(path, key=key)
    reader = csv.reader(io.StringIO(text, newline=""))
    try:
        header = [name.strip() for name in next(reader, [])]
        missing = [name for name in TRACE_COLUMNS if name not in header]
        if missing:
            raise ConfigError(key, f"{path}:1: the header lacks {', '.join(missing)}; it must name time_s,device,event")
        columns = [header.index(name) for name in TRACE_COLUMNS]
        grouped: dict[tuple[float, str], set[int]] = {}
        for row in reader:
            if not any(cell.strip() for cell in row):
                continue
            time_s, device, kind = _trace_row(row, columns, f"{path}:{reader.line_num}", len(header), num_devices)
            grouped.setdefault((time_s, kind), set()).add(device)
            if len(grouped) > limits.MAX_EVENTS:
                raise ConfigError(key, f"{path} holds more than {limits.MAX_EVENTS:,} events, the most one "
                                       "simulation lives through (each makes every system re-plan)")
    except csv.Error as exc:
        raise ConfigError(key, f"{path}:{reader.line_num}: not CSV: {exc}") from None
    if not grouped:
        raise ConfigError(key, f"{path} holds no events; a trace needs at least one row after the header")
    return [ClusterEvent(t, kind, tuple(sorted(devs))) for (t, kind), devs in sorted(grouped.items())]


def _trace_row(row: list[str], columns: list[int], where: str, width: int, num_devices: int) -> tuple[float, int, str]:
    key = "failures.trace"
    if len(row) != width:
        raise ConfigError(key, f"{where}: has {len(row)} fields, the header {width}")
    time_text, device_text, kind = (row[i].strip() for i in columns)
    try:
        time_s = float(time_text)
    except ValueError:
        raise ConfigError(key, f"{where}: time_s must be a number of seconds; got {time_text!r}") from None
    if not math.isfinite(time_s) or time_s < 0:
        raise ConfigError(key, f"{where}: time_s must be finite and >= 0; got {time_text!r}")
    try:
        device = int(device_text)
    except ValueError:
        raise ConfigError(key, f"{where}: device must be an integer; got {device_text!r}") from None
    if not 0 <= device < num_devices:
        raise ConfigError(key, f"{where}: device must lie in 0..{num_devices - 1}; got {device}")
    if kind not in (FAIL, JOIN):
        raise ConfigError(key, f"{where}: event must be fail or join; got {kind!r}")
    return time_s, device, kind
