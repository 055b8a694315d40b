"""Planner: candidate execution plans after a failure and the policy choice (paper 001, IV-A, Eq. 8)."""

from odyssey_megatron.planner.batch import distribute_batch
from odyssey_megatron.planner.decide import (
    Candidate,
    Decision,
    Drafts,
    PricingInterrupted,
    UnrecoverableFailure,
    choose,
    draft_candidates,
)
from odyssey_megatron.planner.initial import initial_plan
from odyssey_megatron.planner.policy import FailureRateModel, eq8_horizon_s, policy_score
from odyssey_megatron.planner.reroute import reroute_plan

__all__ = [
    "Candidate",
    "Decision",
    "Drafts",
    "FailureRateModel",
    "PricingInterrupted",
    "UnrecoverableFailure",
    "choose",
    "distribute_batch",
    "eq8_horizon_s",
    "draft_candidates",
    "initial_plan",
    "policy_score",
    "reroute_plan",
]
