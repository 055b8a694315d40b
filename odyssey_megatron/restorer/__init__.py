"""Restorer (paper IV-B): make a new execution plan cheap to enter and cheap to run.

Entering a plan means moving weights and optimizer state: ``plan_weight_transfer``
matches survivors to the new plan's stages with Kuhn-Munkres so the fewest bytes move,
then spreads the sending across holders and expands moves to TP-rank shards. Running an
asymmetric plan means DP all-reduces over blocks whose holders differ from pipeline to
pipeline: ``sync_units`` groups blocks by holder set and ``color_rounds`` schedules the
groups into the fewest rounds of concurrent all-reduces (exact graph colouring);
``with_sync`` fills both into a plan.
"""

from odyssey_megatron.restorer.coloring import color_rounds, is_valid_coloring, sync_units, with_sync
from odyssey_megatron.restorer.transfer import TransferPlan, assignment_cost, plan_weight_transfer

__all__ = [
    "TransferPlan",
    "assignment_cost",
    "color_rounds",
    "is_valid_coloring",
    "plan_weight_transfer",
    "sync_units",
    "with_sync",
]
