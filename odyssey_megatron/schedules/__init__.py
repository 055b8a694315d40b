"""Schedules: a plan compiled into per-worker op lists.

The same op lists feed the estimator's pipeline programme (Eq. 10-11), the simulator
and the Megatron executor, so an estimate is of what actually runs.
"""

from odyssey_megatron.schedules.ops import Op, compile_streams, dependency, one_f_one_b

__all__ = ["Op", "compile_streams", "dependency", "one_f_one_b"]
