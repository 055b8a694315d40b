"""The policy objective (paper 001, Eq. 8) and the failure-rate model it needs.

    score = B / t_step  *  t_next / (t_transition + t_next)

where t_transition + t_next is the time until the next failure. Eq. 8 is myopic about
that next failure: a plan that leaves some layer on a single worker (DP = 1 anywhere)
turns the next failure of that worker into a checkpoint restart. We charge the expected
cost of that, ``fatal_share * restart_penalty_s``, inside the interval (``restart_penalty_s``
= 0 gives the paper's Eq. 8 exactly). That interval is
1 / (rate per device * surviving devices), the rate from ``FailureRateModel``; where no
worker comes back, the horizon is also cut at the run's end (``eq8_horizon_s``).
"""

from __future__ import annotations

from dataclasses import dataclass

from odyssey_megatron.units import SECONDS_PER_HOUR


def policy_score(*, samples_per_s: float, transition_s: float, interval_s: float, risk_s: float = 0.0) -> float:
    """Eq. 8: throughput times the effective-time ratio of the interval to the next failure,
    less ``risk_s``, the expected time the next failure costs beyond an in-memory recovery."""
    effective = max(0.0, interval_s - transition_s - risk_s) / interval_s
    return samples_per_s * effective


def sole_holders(holdings: dict[int, list]) -> int:
    """Workers that are the only live holder of some block: if the next failure hits one,
    no in-memory recovery exists."""
    holders: dict = {}
    for worker, blocks in holdings.items():
        for block in blocks:
            holders.setdefault(block, set()).add(worker)
    return len({next(iter(ws)) for ws in holders.values() if len(ws) == 1})


def fatal_share(sole_holders: int, alive_workers: int) -> float:
    """Chance that the next failure hits a sole holder of a block: such workers over all
    live workers."""
    return sole_holders / alive_workers if alive_workers else 1.0


def eq8_horizon_s(*, interval_s: float, time_left_s: float | None) -> float:
    """The seconds Eq. 8 weighs a plan over: the expected interval to the next failure,
    but not past the run's end where no worker comes back (``time_left_s``: the run's
    seconds left, given only then). Without repairs the plan chosen now runs until the
    next failure or the run's end, whichever comes first, so a transition is paid back
    over at most the time left. With repairs, ``time_left_s`` is None and the interval is
    the horizon, as in the paper. A run at or past its end (a live run's estimate of the
    time left ran out) has nothing left to weigh by: the interval again."""
    if time_left_s is None or time_left_s <= 0:
        return interval_s
    return min(interval_s, time_left_s)


@dataclass
class FailureRateModel:
    """Per-device failure rate: the given MTBF until the first failure is seen, then the
    failures seen over the device-hours exposed since the run started.

    Why not a prior blended with the evidence: the prior (``odyssey.device_mtbf_hours``,
    the paper's 10 h by default) is a guess, often far off (Llama 3 saw one failure per
    ~50,000 device-hours, 5,000 times fewer), and a gamma prior worth even one failure
    keeps dragging the rate towards it for as long as the run has seen few failures: the
    very runs where the rate matters most for Eq. 8. The maximum-likelihood rate of an
    exponential lifetime, failures over exposure, is what the run has shown; counting the
    exposure from the run's start, not from the last failure, keeps the failure-free
    hours before the first failure as evidence. ``learn=False`` keeps the given rate
    throughout: the simulator's scenario, whose rate is the truth its failures are drawn
    from (``given_by`` then names it)."""

    device_mtbf_hours: float
    learn: bool = True
    given_by: str = ""
    """Where ``device_mtbf_hours`` comes from, in words; default the recipe's prior."""
    observed_failures: int = 0
    observed_device_hours: float = 0.0

    def observe(self, *, failures: int, device_hours: float) -> None:
        """Record ``failures`` seen over ``device_hours`` of exposure (devices x hours)."""
        if failures < 0 or device_hours < 0:
            raise ValueError("failures and device_hours must be >= 0")
        self.observed_failures += failures
        self.observed_device_hours += device_hours

    @property
    def _from_evidence(self) -> bool:
        return self.learn and self.observed_failures > 0 and self.observed_device_hours > 0

    @property
    def rate_per_device_hour(self) -> float:
        if self._from_evidence:
            return self.observed_failures / self.observed_device_hours
        return 1.0 / self.device_mtbf_hours

    @property
    def source(self) -> str:
        """Where the rate comes from, in words: the prior, the scenario's rate, or the
        failures seen."""
        if self._from_evidence:
            return f"{self.observed_failures} failure(s) seen over {self.observed_device_hours:.4g} device-hours"
        return self.given_by or f"the prior odyssey.device_mtbf_hours={self.device_mtbf_hours:g}"

    def expected_interval_s(self, alive_devices: int) -> float:
        """Expected seconds until the next failure among ``alive_devices``."""
        return SECONDS_PER_HOUR / (self.rate_per_device_hour * max(alive_devices, 1))
