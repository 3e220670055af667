"""The 95% interval of a proportion (Wilson's), shared by the evaluations during training (train/) and the
report (report/uncertainty.py, which has the other intervals)."""

from __future__ import annotations

import math
from statistics import NormalDist

CONFIDENCE = 0.95


def z(confidence: float) -> float:
    """The two-sided standard normal critical value (1.96 at 95%)."""
    return NormalDist().inv_cdf(0.5 + confidence / 2)


def wilson(proportion: float, n: int, confidence: float = CONFIDENCE) -> tuple[float, float]:
    """(low, high) of the Wilson score interval of ``proportion`` observed on ``n`` trials. Unlike the
    normal approximation it stays inside [0, 1] and is sound near 0 and 1 and for small n."""
    if n <= 0:
        raise ValueError(f"wilson: n must be positive, got {n}")
    z2 = z(confidence) ** 2
    centre = (proportion + z2 / (2 * n)) / (1 + z2 / n)
    half = math.sqrt(z2) / (1 + z2 / n) * math.sqrt(proportion * (1 - proportion) / n + z2 / (4 * n * n))
    return max(0.0, centre - half), min(1.0, centre + half)
