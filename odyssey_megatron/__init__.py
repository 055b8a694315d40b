"""odyssey-megatron: backup-free fault tolerance for Megatron-Core pretraining.

The decision center (``planner``, ``estimator``, ``restorer``, ``schedules``) is pure
Python and never imports torch; the runtime (``hooks``) is where Megatron-Core lives.
"""

__version__ = "0.1.0"
