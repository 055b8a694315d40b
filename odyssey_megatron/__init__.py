"""odyssey-megatron: backup-free fault tolerance for Megatron-Core pretraining.

The decision center (``planner``, ``estimator``, ``restorer``, ``schedules.ops``) and the
``simulator`` are pure Python and never import torch (a test checks it); ``hooks`` is where
Megatron-Core lives, and ``runtime`` runs one rank's training under a plan on it.
"""

__version__ = "0.1.0"
