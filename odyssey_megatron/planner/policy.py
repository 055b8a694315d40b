"""The policy objective (paper 001, Eq. 8) and the failure-rate model it needs.

    score = B / t_step  *  t_next / (t_transition + t_next)

where t_transition + t_next is the time until the next failure. Eq. 8 is myopic about
that next failure: a plan that leaves some layer on a single worker (DP = 1 anywhere)
turns the next failure of that worker into a checkpoint restart. We charge the expected
cost of that, ``fatal_share * restart_penalty_s``, inside the interval (``restart_penalty_s``
= 0 gives the paper's Eq. 8 exactly). That interval is
1 / (rate per device * surviving devices); the rate starts from the configured MTBF and,
if asked, learns from failures seen so far (gamma prior worth one failure, exponential
likelihood), so a cluster that fails more often than configured favours cheap transitions.
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


@dataclass
class FailureRateModel:
    """Per-device failure rate: prior from the MTBF, posterior mean from observations."""

    device_mtbf_hours: float
    learn: bool = True
    prior_failures: float = 1.0
    observed_failures: int = 0
    observed_device_hours: float = 0.0

    def observe(self, *, failures: int, device_hours: float) -> None:
        """Record ``failures`` seen over ``device_hours`` of exposure (devices x hours)."""
        if failures < 0 or device_hours < 0:
            raise ValueError("failures and device_hours must be >= 0")
        self.observed_failures += failures
        self.observed_device_hours += device_hours

    @property
    def rate_per_device_hour(self) -> float:
        prior_hours = self.prior_failures * self.device_mtbf_hours
        if not self.learn:
            return 1.0 / self.device_mtbf_hours
        return (self.prior_failures + self.observed_failures) / (prior_hours + self.observed_device_hours)

    @property
    def source(self) -> str:
        """Where the rate comes from, in words: the prior alone or the failures seen."""
        prior = f"the prior odyssey.device_mtbf_hours={self.device_mtbf_hours:g}"
        if not self.learn or not self.observed_failures:
            return prior
        return (f"{self.observed_failures} failure(s) seen over {self.observed_device_hours:.4g} device-hours, "
                f"with {prior} worth {self.prior_failures:g}")

    def expected_interval_s(self, alive_devices: int) -> float:
        """Expected seconds until the next failure among ``alive_devices``."""
        return SECONDS_PER_HOUR / (self.rate_per_device_hour * max(alive_devices, 1))
