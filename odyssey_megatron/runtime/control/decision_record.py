"""A decision as the run directory's events and the W&B trace record it: the policy, the
alternatives Eq. 8 weighed and the horizon it weighed them over (with where its failure
rate came from), the samples a step drops (``odyssey.batch_on_failure``), the bytes moved
and, for a rollback, what it trains again. Recoveries and joins both record their
decisions this way."""

from __future__ import annotations

from odyssey_megatron.decision_center import DecisionCenter
from odyssey_megatron.planner import Decision
from odyssey_megatron.restorer import mapping_bytes

__all__ = ["decision_record"]


def decision_record(decision: Decision, center: DecisionCenter, *, start_step: int, committed: int) -> dict:
    """``decision``'s record; the plan it publishes starts at ``start_step``, and
    ``committed`` steps were committed when its recovery began (a rollback trains again
    those after its snapshot)."""

    def candidate(c) -> dict:
        return {"policy": c.policy, "layout": c.layout, "step_time_s": c.estimate.step_time_s,
                "transition_s": c.transition_s, "score": c.score, "dropped_samples_per_step": c.dropped_samples_per_step}

    plan = decision.chosen.plan
    chosen_bytes, naive_bytes = mapping_bytes(before=decision.replaced, after=plan, cluster=center.cluster,
                                              profile=center.profile)
    return {"policy": decision.chosen.policy, "mapping_bytes": chosen_bytes, "naive_mapping_bytes": naive_bytes,
            "chosen": candidate(decision.chosen),
            "alternatives": [candidate(c) for c in decision.alternatives],
            "search_time_s": decision.search_time_s, "decision_source": decision.source,
            "expected_interval_s": decision.expected_interval_s, "horizon_s": decision.horizon_s,
            "interval_source": decision.interval_source,
            "dropped_samples_per_step": decision.chosen.dropped_samples_per_step,
            "batch_horizon_s": decision.batch_horizon_s,
            "start_step": start_step,
            "transfers": len(plan.transfers), "transfer_bytes": sum(t.bytes for t in plan.transfers),
            **_rollback_record(decision, center, committed=committed, start_step=start_step)}


def _rollback_record(decision: Decision, center: DecisionCenter, *, committed: int, start_step: int) -> dict:
    """What a rollback costs: the snapshot's step (or whether it went back to the run's
    start, ``start_step`` then), the steps trained again and their estimated seconds on
    the new plan, the shards rebuilt from parity, and the failed ranks whose shards were
    read from their node's keeper."""
    restore = decision.rollback
    if restore is None:
        replayed = committed - start_step if decision.from_start else 0
        return {"snapshot_step": None, "replayed_steps": replayed,
                "replay_s": replayed * decision.chosen.estimate.step_time_s, "rebuilt_shards": 0,
                "read_for_failed_ranks": [], "rolled_back_to_start": decision.from_start}
    replayed = committed - restore.step
    failed = center.cluster.failed_ranks
    return {"snapshot_step": restore.step, "replayed_steps": replayed,
            "replay_s": replayed * decision.chosen.estimate.step_time_s, "rebuilt_shards": len(restore.rebuilds),
            "read_for_failed_ranks": sorted(r.owner for r in restore.reads if r.owner in failed),
            "rolled_back_to_start": False}
