"""What every simulated fault-tolerance system implements.

A system owns its current layout and answers each cluster event with an ``Outcome``:
how long training pauses, what throughput follows (possibly after a ramp of phases, when
part of the job trains while another part restarts), and how much already-trained time
is lost (rolled back). Step times come from the shared estimator and profile, priced with
the job's one set of schedule options, so with no failures every system trains alike
and the systems differ only by how they handle failures.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import AbstractSet, Optional, Protocol

from odyssey_megatron.cluster import ClusterState
from odyssey_megatron.plan import ExecutionPlan
from odyssey_megatron.planner import initial_plan
from odyssey_megatron.profile import ModelProfile
from odyssey_megatron.settings import PLAIN, Pricing

TRAINING = "training"
RECOVERING = "recovering"
RESTARTING = "restarting"
STOPPED = "stopped"

MEGATRON_LAYOUTS = "megatron"
"""Restart layouts stock Megatron runs: every pipeline gets the same number of the global
batch's micro-batches, so DP divides them."""
VARUNA_LAYOUTS = "varuna"
"""Restart layouts of any DP, the micro-batches split unevenly (Varuna-style)."""
NODE_ALIGNED = "node_aligned"
"""Each replica on whole nodes of its own, as torchft deploys replica groups."""
STAGE_MAJOR = "stage_major"
"""The job's plan's placement (Megatron's rank order: stage s of replica d on worker
s * DP + d), so one node holds one stage of several replicas."""


@dataclass(frozen=True)
class Phase:
    """A stretch of fixed throughput between an event's pause and its final throughput."""

    duration_s: float
    samples_per_s: float
    """0: paused (in ``state``)."""
    dropped_per_s: float = 0.0
    """Samples/s the job's global batch lacks while this phase trains (``Outcome.dropped_per_s``)."""
    state: str = RECOVERING
    """What a paused phase is: RECOVERING, or RESTARTING (from a checkpoint)."""


@dataclass(frozen=True)
class Horizon:
    """The horizon an Eq. 8 decision weighed its candidates over (``planner.Decision``)."""

    time_s: float
    """When the event it answered struck, in seconds since the start."""
    expected_interval_s: float
    """The expected seconds to the next failure (the next event, for the oracle)."""
    source: str
    """Where the failure rate behind it came from (``Decision.interval_source``)."""
    horizon_s: float
    """The seconds Eq. 8 weighed the candidates over (``Decision.horizon_s``): the expected
    interval, cut at the run's end where no worker comes back."""


@dataclass(frozen=True)
class Outcome:
    pause_s: float
    """Seconds with zero throughput before training resumes (decide, move, restart)."""
    samples_per_s: float
    """Throughput once training resumes; 0 when the system cannot train at all."""
    lost_s: float = 0.0
    """Seconds of training before the event whose progress is thrown away (a partial step,
    or everything since the last checkpoint)."""
    pause_state: str = RECOVERING
    """RECOVERING (in-memory recovery) or RESTARTING (from a checkpoint)."""
    note: str = ""
    ramp: tuple[Phase, ...] = ()
    """Phases after the pause and before ``samples_per_s``: a replica restarting in the
    background while the others train, then the pause that admits it."""
    dropped_per_s: float = 0.0
    """Samples/s by which the steps at ``samples_per_s`` fall short of the job's global
    batch: a system that shrinks the batch (replica drop) trains them nowhere."""
    horizon: Optional[Horizon] = None
    """A system that decides by Eq. 8 (Odyssey): the horizon it weighed the event over."""


@dataclass(frozen=True)
class SimulationContext:
    """Everything a system may read: the job, the hardware and the shared cost model."""

    profile: ModelProfile
    num_layers: int
    tensor_parallel_size: int
    pipeline_parallel_size: int
    data_parallel_size: int
    num_micro_batches: int
    devices_per_node: int
    restart_s: float
    """Process restart and model/optimizer rebuild when a system restarts a job."""
    checkpoint_interval_s: float
    checkpoint_save_s: float
    """Training time each checkpoint costs (synchronous save)."""
    checkpoint_load_s: float
    pricing: Pricing = PLAIN
    """How every system's steps run and are priced (``OdysseyConfig.pricing``): split
    backwards and staggered optimizer steps wherever they pay, on every system's plans."""
    detection_s: float = 0.0
    """From a failure to the survivors knowing about it (``costs.detection_s``): the shared
    checkpoint restart charges it, so a restart after a failure pays it as every
    in-memory recovery does."""
    restart_layouts: str = MEGATRON_LAYOUTS
    """Which DP x PP layouts a checkpoint restart may resume on (``restart_layouts``):
    MEGATRON_LAYOUTS (DP divides the micro-batches) or VARUNA_LAYOUTS (any DP)."""
    replica_placement: str = NODE_ALIGNED
    """Where the replica systems' replicas sit (``replica_placement``): NODE_ALIGNED or
    STAGE_MAJOR (``simulator.replicas``)."""


def initial_layout(context: SimulationContext, *, max_layer_splits: int = 256) -> ExecutionPlan:
    """The job's failure-free DP x PP plan, where every system starts."""
    return initial_plan(
        data_parallel_size=context.data_parallel_size,
        pipeline_parallel_size=context.pipeline_parallel_size,
        tensor_parallel_size=context.tensor_parallel_size,
        num_micro_batches=context.num_micro_batches,
        profile=context.profile,
        max_layer_splits=max_layer_splits,
        pricing=context.pricing,
    )


class System(Protocol):
    name: str
    spare_devices: int
    """Devices paid for beyond the job's own, idle until a failure (hot spares)."""

    def start(self, cluster: ClusterState) -> float:
        """Failure-free throughput (samples/s) on ``cluster``."""

    def on_failure(self, cluster: ClusterState, failed: AbstractSet[int], now_s: float) -> Outcome:
        """``failed`` workers just died; ``cluster`` already marks them."""

    def on_join(self, cluster: ClusterState, joined: AbstractSet[int], now_s: float) -> Outcome:
        """``joined`` workers came back (repaired); ``cluster`` already marks them alive."""
