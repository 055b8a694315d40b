"""Schedules: a plan compiled into per-worker op lists (``ops``) and the step program the
decision center publishes with each plan (``program``).

The same op lists feed the estimator's pipeline programme (Eq. 10-11), the simulator
and the rank's executor (``runtime.rank.executor``), so an estimate is of what actually
runs. Pure Python: no torch.
"""

from odyssey_megatron.schedules.ops import Op, dependency, one_f_one_b, stream_sources

__all__ = ["Op", "dependency", "one_f_one_b", "stream_sources"]
