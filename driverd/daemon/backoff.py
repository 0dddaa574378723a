"""Retry delays after a failed or blocked reconcile: capped exponential (min, 2*min, 4*min ... max),
reset by the next converged reconcile. A host that cannot converge is retried, never crash-looped."""
from __future__ import annotations


class Backoff:
    def __init__(self, min_s: float, max_s: float) -> None:
        self.min_s = max(1.0, float(min_s))
        self.max_s = max(self.min_s, float(max_s))
        self.failures = 0

    def next(self) -> float:
        """The delay before the next attempt after one more failure."""
        self.failures += 1
        return min(self.max_s, self.min_s * (2 ** min(self.failures - 1, 30)))

    def reset(self) -> None:
        self.failures = 0
