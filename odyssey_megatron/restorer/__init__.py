"""Restorer (paper IV-B): make a new execution plan cheap to enter and cheap to run.

Entering a plan means moving weights and optimizer state: ``plan_weight_transfer``
matches survivors to the new plan's stages with Kuhn-Munkres so the fewest bytes move,
then spreads the sending across holders and expands moves to TP-rank shards;
``plan_transfers`` does the same for a plan whose workers are already chosen (a
normalization swap, an idle worker taking over a stage). Both read what survivors hold
*before* the plan (``live_holdings``), and ``check_transfers`` proves the result
delivers every block from a real holder. Running an asymmetric plan means DP all-reduces
over blocks whose holders differ from pipeline to pipeline: ``sync_units`` groups blocks
by holder set and ``color_rounds`` schedules the groups into the fewest rounds of
concurrent all-reduces (exact graph colouring); ``with_sync`` fills both into a plan.
"""

from odyssey_megatron.restorer.coloring import color_rounds, is_valid_coloring, sync_units, with_sync
from odyssey_megatron.restorer.transfer import (
    TransferPlan,
    assignment_cost,
    live_holdings,
    mapping_bytes,
    plan_transfers,
    plan_weight_transfer,
)
from odyssey_megatron.restorer.transfer_check import TransferError, check_transfers

__all__ = [
    "TransferError",
    "TransferPlan",
    "assignment_cost",
    "check_transfers",
    "color_rounds",
    "is_valid_coloring",
    "live_holdings",
    "mapping_bytes",
    "plan_transfers",
    "plan_weight_transfer",
    "sync_units",
    "with_sync",
]
