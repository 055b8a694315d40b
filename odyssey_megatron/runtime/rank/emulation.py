"""Device-time emulation: every op of a step takes the time a profile gives it.

On a CPU machine eight ranks share two cores, so real compute time says nothing about a
plan's structure. In emulation (``cluster.emulate_device``) each forward, backward and
weight-gradient op, each P2P message and each DP all-reduce does its real work and then
waits until the profile's time for it has passed since it could start (on the worker's
emulated timeline: when the worker was free and its input there). Ranks so behave
like devices of that profile wherever its times exceed the real ones; an op whose real
work takes longer *overruns* (``EmulatedClock.overruns`` counts them, and a run with
overruns is not a faithful emulation). Figures from this mode are emulated, not measured.

The executor (``runtime.rank.executor``), the gradient sync (``hooks.grad_sync``) and the
runner's optimizer phase (``runtime.rank.plan_runner``) call an ``OpClock``
(``hooks.op_clock``, below them all). The base class is real time: its hooks do nothing and cost nothing. ``EmulatedClock`` pads, with
the estimator's own cost of each op, so an emulated step runs what the estimator prices:
a stage's forward, backward, and split backward's B and W ops take
``ModelProfile.stage_times`` (the fixed cost per op and the measured weight-gradient
share included), a message takes ``estimator.replay.p2p_time`` from the end of the op
that produced it (the sender posts that moment beside the tensor; every rank reads one
monotonic clock, so emulation runs on one host), a sync unit's all-reduce takes
``estimator.communication.unit_sync_time`` from the moment its last member started it
(an all-reduce of the members' start times, MAX, tells every member), and the optimizer
phase ``estimator.optimizer``'s times: the global norm's all-reduce from when the last
rank finished its sync (the same MAX), then the rank's own Adam step. A staggered step's
norm all-reduce runs beside the next step and is not padded; nor is its retake snapshot.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator, Sequence

import torch
import torch.distributed as dist

from odyssey_megatron.cluster import ClusterState
from odyssey_megatron.config import RecipeConfig
from odyssey_megatron.estimator.communication import unit_sync_time
from odyssey_megatron.estimator.optimizer import norm_allreduce_time
from odyssey_megatron.estimator.replay import p2p_time
from odyssey_megatron.hooks.op_clock import OpClock
from odyssey_megatron.hooks.process_groups import RankMap
from odyssey_megatron.plan import ExecutionPlan
from odyssey_megatron.profile import ModelProfile
from odyssey_megatron.profile_file import emulated_profile
from odyssey_megatron.schedules.ops import BACKWARD, FORWARD, WEIGHT_GRAD, Op

__all__ = ["DeviceEmulation", "EmulatedClock", "STAMP_TAG_OFFSET", "recipe_emulation"]

STAMP_TAG_OFFSET = 1 << 24
"""Added to a message's tag for its send-time stamp: above every tag the executor uses
(8 per micro-batch at most, and ``limits.MAX_MICRO_BATCHES`` is 65,536)."""


class EmulatedClock(OpClock):
    """Pads one worker's ops to a profile's times (see the module docstring); one per plan
    generation. It keeps the worker's emulated timeline: an op starts when the worker is
    free and its input has arrived there, as on a device, so the host's own cost between
    ops (Python, allocation, posting sends) is absorbed as long as the padding covers it."""

    def __init__(self, *, profile: ModelProfile, cluster: ClusterState, plan: ExecutionPlan, ranks: RankMap,
                 worker: int, ops: Sequence[Op], device: torch.device, distributed_optimizer: bool = False):
        split = any(op.kind == WEIGHT_GRAD for op in ops)
        self._seconds: dict[tuple[str, int, int], float] = {}
        for pi, si, stage in plan.stage_positions():
            times = profile.stage_times(*stage.layers, first=si == 0, last=si == plan.pipelines[pi].num_stages - 1)
            self._seconds[FORWARD, pi, si] = times.forward_s
            self._seconds[BACKWARD, pi, si] = times.input_grad_s if split else times.backward_s
            self._seconds[WEIGHT_GRAD, pi, si] = times.weight_grad_s
        self._link_s = {rank: p2p_time(profile, same_node=cluster.same_node(ranks.worker(rank), worker))
                        for rank in range(ranks.world_size)}
        self._sync_s = {index: unit_sync_time(unit, profile, cluster) for index, unit in enumerate(plan.sync_units)}
        self._norm_s = norm_allreduce_time(plan, profile, cluster)
        self._adam_s = profile.optimizer_s(plan.holdings(profile).get(worker, ()),
                                           plan.holder_counts(profile) if distributed_optimizer else None)
        self._device = device
        self._free_at = time.monotonic()
        """When the worker's last op ends on the emulated timeline."""
        self._ready_at = 0.0
        """When the next op's input arrives on it (0: it needs none)."""
        self._computing = False
        self.overruns = 0
        """Ops whose real work took longer than the profile gives them."""
        self.worst_overrun_s = 0.0
        """By how much the worst of them overran."""

    def resume(self) -> None:
        self._free_at, self._ready_at = time.monotonic(), 0.0

    @contextmanager
    def compute(self, op: Op) -> Iterator[None]:
        start = max(self._free_at, self._ready_at)
        self._ready_at, self._computing = 0.0, True
        try:
            yield
        finally:
            self._computing = False
        self._free_at = self._until(start + self._seconds[op.kind, op.pipeline, op.stage], busy_since=start)

    def sent(self, dst: int, tag: int) -> list[tuple[dist.Work, torch.Tensor]]:
        """Post the end of the op whose result the message carries."""
        stamp = torch.tensor([self._free_at], dtype=torch.float64, device=self._device)
        return [(dist.isend(stamp, dst, tag=tag + STAMP_TAG_OFFSET), stamp)]

    @contextmanager
    def receiving(self, src: int, tag: int) -> Iterator[None]:
        yield
        stamp = torch.empty(1, dtype=torch.float64, device=self._device)
        dist.recv(stamp, src, tag=tag + STAMP_TAG_OFFSET)
        self._ready_at = max(self._ready_at, float(stamp) + self._link_s[src])

    def collective_started(self, unit: int, group: dist.ProcessGroup) -> tuple[dist.Work, torch.Tensor, float]:
        """Post when this member starts: now within an op (a sync overlapped with backward),
        else when its last op ended."""
        start = time.monotonic() if self._computing else self._free_at
        stamp = torch.tensor([start], dtype=torch.float64, device=self._device)
        return dist.all_reduce(stamp, op=dist.ReduceOp.MAX, group=group, async_op=True), stamp, self._sync_s[unit]

    def collective_finished(self, started: tuple[dist.Work, torch.Tensor, float]) -> None:
        waiting_since = time.monotonic()
        work, stamp, seconds = started
        work.wait()
        end = self._until(float(stamp) + seconds, busy_since=waiting_since)
        if not self._computing:  # the next all-reduce or the optimizer starts after this one
            self._free_at = max(self._free_at, end)

    @contextmanager
    def optimizer_step(self, norm_group: dist.ProcessGroup | None) -> Iterator[None]:
        """The norm's all-reduce from when the last rank is ready for it, then Adam."""
        start = self._free_at
        if norm_group is not None:
            stamp = torch.tensor([start], dtype=torch.float64, device=self._device)
            dist.all_reduce(stamp, op=dist.ReduceOp.MAX, group=norm_group)
            start = float(stamp) + self._norm_s
        busy_since = time.monotonic()
        yield
        self._free_at = self._until(start + self._adam_s, busy_since=max(busy_since, start))

    def _until(self, deadline: float, *, busy_since: float) -> float:
        """Wait for ``deadline`` and return when the op ended. Past it already, the op
        *overran* if it was busy at the deadline (working since ``busy_since``, or waiting
        for its all-reduce): its real cost exceeds the profile's."""
        now = time.monotonic()
        if now < deadline:
            time.sleep(deadline - now)
            return deadline
        if deadline > busy_since:
            self.overruns += 1
            self.worst_overrun_s = max(self.worst_overrun_s, now - deadline)
        return now


@dataclass(frozen=True)
class DeviceEmulation:
    """What to emulate: a profile's device, on a cluster's nodes (which links are intra-node)."""

    profile: ModelProfile
    cluster: ClusterState

    def clock(self, *, plan: ExecutionPlan, ranks: RankMap, worker: int, ops: Sequence[Op],
              device: torch.device, distributed_optimizer: bool = False) -> EmulatedClock:
        """The clock of ``worker``, running ``ops`` of ``plan`` (its Adam step over its owned
        ranges alone with the ``distributed_optimizer``, as ``estimator.optimizer`` prices it)."""
        return EmulatedClock(profile=self.profile, cluster=self.cluster, plan=plan, ranks=ranks, worker=worker,
                             ops=ops, device=device, distributed_optimizer=distributed_optimizer)


def recipe_emulation(config: RecipeConfig) -> DeviceEmulation | None:
    """The emulation ``cluster.emulate_device`` asks for (None: off): a shipped device's
    analytic profile of the recipe's model, or a profile file measured for it."""
    profile = emulated_profile(config)
    if profile is None:
        return None
    par = config.parallel
    cluster = ClusterState(world_size=par.num_ranks, tensor_parallel_size=par.tensor_model_parallel_size,
                           devices_per_node=config.cluster.devices_per_node)
    return DeviceEmulation(profile=profile, cluster=cluster)
