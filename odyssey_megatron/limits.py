"""How much ``odyssey plan`` and ``odyssey simulate`` take on: the size and cost limits.

They are checked while a recipe or scenario is validated, before any work starts, so
nothing begins that cannot finish in bounded time and memory; each refusal says the limit
and why. The figures behind them were measured on a shared 2-core machine (Llama-2 7B on 910Bs);
raise a limit only with a new measurement.
"""

from __future__ import annotations

from odyssey_megatron.errors import ConfigError
from odyssey_megatron.units import SECONDS_PER_HOUR

MAX_WORKERS = 16_384
"""TP groups the decision center plans over. Planning grows faster than linearly with
them: one failure at 16,384 (PP 4, 8 micro-batches per pipeline) takes about 2 minutes
and 4.3 GB; 40,000 ranks took 22 GB before the kernel killed the process."""
MAX_MICRO_BATCHES_PER_PIPELINE = 1_024
"""Op lists grow with micro-batches per pipeline and their pricing faster still: 256 per
pipeline plan in 4 s and 1,024 in 43 s on 32 devices; a batch of 10^9 ran out of memory."""
MAX_MICRO_BATCHES = 65_536
"""global_batch_size / micro_batch_size: every micro-batch is an entry in the plan."""
MAX_LAYERS = 1_024
"""Transfers, sync units and their colouring are per layer; Llama-2 70B has 80."""
MAX_MODEL_DIMENSION = 2**20
"""hidden, FFN and vocabulary sizes, heads and sequence length: sizes past this overflow
the analytic profile's byte counts, and no model comes near."""
MAX_DEVICES_PER_NODE = 1_024
MAX_SEARCH_RADIUS = 64
"""Algorithm 1's R_dp and R_pp: candidates grow with their product."""
MAX_LAYER_SPLITS = 65_536
"""Remainder placements priced per pipeline length."""
MAX_SECONDS = 365 * 24 * SECONDS_PER_HOUR
"""Any time or cost in seconds (restarts, penalties, checkpoint intervals): a year."""
MAX_HOURS = 365 * 24.0
"""Simulated duration, MTBF, repair time: a year of training."""
MAX_SAMPLES = 100_000
"""Series rows per system (duration_hours * 3600 / sample_interval_s): series.json and the
plots stay under about 100 MB."""
MAX_EVENTS = 20_000
"""Cluster events (failures and joins) one simulation lives through: each makes every
system re-plan."""
MAX_WORKER_EVENTS = 1_000_000
"""Events times workers: a re-plan costs more the more workers it spans, so large
clusters get fewer events (1,024 workers: about 1,000 events)."""
INT64 = 2**63 - 1
"""Integers written to JSON, W&B or torch must fit a signed 64-bit integer."""


def require_at_most(key: str, value: float, limit: float, why: str) -> None:
    """Refuse ``value`` above ``limit`` with a line saying the limit and why."""
    if value > limit:
        raise ConfigError(key, f"must be <= {_number(limit)} ({why}); got {_number(value)}")


def _number(value: float) -> str:
    return f"{int(value):,}" if float(value).is_integer() and abs(value) < 1e15 else f"{value:g}"


def check_plan_size(*, workers: int, micro_batches: int, micro_batches_per_pipeline: int) -> None:
    """The recipe's cluster and batch are within what one decision can handle."""
    if workers > MAX_WORKERS:
        raise ConfigError(
            "parallel", f"{workers:,} TP groups (data * pipeline parallel size) exceed the {MAX_WORKERS:,} "
            "the decision center plans over in bounded time and memory",
        )
    require_at_most("training.global_batch_size", micro_batches, MAX_MICRO_BATCHES,
                    "in micro-batches: global_batch_size / micro_batch_size, each an entry in the plan")
    if micro_batches_per_pipeline > MAX_MICRO_BATCHES_PER_PIPELINE:
        raise ConfigError(
            "training.global_batch_size",
            f"gives {micro_batches_per_pipeline:,} micro-batches per pipeline; at most "
            f"{MAX_MICRO_BATCHES_PER_PIPELINE:,} are planned in bounded time (raise micro_batch_size or "
            "data_parallel_size)",
        )


def check_simulation_size(*, events: int, workers: int) -> None:
    """The drawn or traced events are within what one simulation can live through."""
    if events > MAX_EVENTS:
        raise ConfigError(
            "failures", f"more than {MAX_EVENTS:,} cluster events in this scenario; each makes every system "
            "re-plan, so lower failures.rate_per_device_hour or duration_hours, lengthen repairs.mean_hours, "
            "or shorten the trace",
        )
    if events * workers > MAX_WORKER_EVENTS:
        raise ConfigError(
            "failures", f"{events:,} events on {workers:,} workers is past the {MAX_WORKER_EVENTS:,} worker-events "
            "a simulation handles in bounded time (each event re-plans over every worker); lower the rate or "
            "the duration, or simulate a smaller cluster",
        )
