"""What each consumer reads of a recipe's ``odyssey:`` section, as a small frozen view the
section builds (``OdysseyConfig.pricing``, ``.search``, ``.decisions``), as it builds the
runtime's ``Timeouts``. The fields are documented on ``OdysseyConfig``, under the names
given here. They sit below ``config``, so the estimator and the planner take them without
importing the recipe."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["PLAIN", "DecisionSettings", "Pricing", "SearchSettings"]


@dataclass(frozen=True)
class Pricing:
    """How a plan's step is priced, and so run: the estimator's schedule options."""

    decouple: bool = False
    """Split backwards where they pay (``odyssey.decoupled_weight_grads``)."""
    staggered: bool = False
    """Staggered optimizer steps where they pay (``odyssey.staggered_optimizer``)."""
    distributed_optimizer: bool = False
    """Optimizer state sharded over DP peers: the stepped weights are all-gathered after
    every step (``odyssey.distributed_optimizer``)."""


PLAIN = Pricing()
"""Plain 1F1B op lists and optimizer steps after the global norm."""


@dataclass(frozen=True)
class SearchSettings:
    """What drafting candidates and weighing them by Eq. 8 read (``planner.decide``); no
    defaults here: ``OdysseyConfig`` holds them."""

    policy: str
    dp_search_radius: int
    pp_search_radius: int
    length_sweep: str
    batch_on_failure: str
    max_layer_splits: int
    storage_bandwidth_gb_s: float
    reroute_restart_s: float
    reparallelize_restart_s: float
    checkpoint_restart_penalty_s: float
    pricing: Pricing


@dataclass(frozen=True)
class DecisionSettings:
    """What the decision center reads (``decision_center``): the search's settings, the
    failure rate Eq. 8 starts from and whether it learns, and the memory its decisions
    prepared in advance may take."""

    search: SearchSettings
    device_mtbf_hours: float
    learn_failure_rate: bool
    prepared_decisions_mib: float
