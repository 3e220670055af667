"""The intervals the report compares numbers with, and how much more data would separate two of them.

Plain numbers in, plain numbers out (no pandas): analysis.py applies them to the run table.

- ``wilson``: the 95% Wilson score interval of a proportion (an accuracy on n eval rows). Unlike the
  normal approximation it stays inside [0, 1] and is sound near 0 and 1 and for small n.
- ``mean_interval``: the Student-t interval of a mean (the mean of a configuration's repeats).
- ``ratio_interval``: the interval of sum(x) / sum(y) over a window of steps (tokens over seconds),
  by linearisation: the residuals x - R y carry the step-to-step spread of both.
- ``quotient_interval``: the interval of a / b from the intervals of a and b (scaling efficiency: per-GPU
  throughput over the single-GPU throughput), by their ends, so that it reaches 1 exactly where they overlap.
- ``trimmed_mean``: MLPerf's scoring of repeats: drop the fastest and the slowest, average the rest.
- ``repeats_to_separate`` / ``scale_to_separate``: roughly how many repeats (or how many times the
  sample) would make two intervals stop overlapping at the observed difference.
"""

from __future__ import annotations

import math

from ftbench.measure.intervals import CONFIDENCE, wilson  # noqa: F401 - wilson is part of this module's interface
from ftbench.measure.intervals import z as _z


def _t_two_sided_mass(t: float, df: int) -> float:
    """P(|T| < t) for Student's t with an integer ``df`` (Abramowitz & Stegun 26.7.3 and 26.7.4: finite
    series in cos(theta), exact for integer degrees of freedom, so no special-function library is needed)."""
    theta = math.atan(t / math.sqrt(df))
    c2 = math.cos(theta) ** 2
    term, total = 1.0, 1.0
    for k in range(3 if df % 2 else 2, df, 2):
        term *= c2 * (k - 1) / k
        total += term
    if df % 2 == 0:
        return math.sin(theta) * total
    if df == 1:
        return 2 / math.pi * theta
    return 2 / math.pi * (theta + math.sin(theta) * math.cos(theta) * total)


def t_quantile(df: int, confidence: float = CONFIDENCE) -> float:
    """The two-sided Student-t critical value: P(|T| < t) = confidence (2.776 for df 4 at 95%)."""
    if df < 1:
        raise ValueError(f"t_quantile: df must be at least 1, got {df}")
    low, high = 0.0, 1.0
    while _t_two_sided_mass(high, df) < confidence:
        high *= 2
    for _ in range(100):  # bisection to well below any printed digit
        middle = (low + high) / 2
        low, high = (middle, high) if _t_two_sided_mass(middle, df) < confidence else (low, middle)
    return (low + high) / 2


def mean_interval(values: list[float], confidence: float = CONFIDENCE) -> tuple[float, float, float]:
    """(mean, low, high): the Student-t interval of the mean of ``values`` (at least two)."""
    n = len(values)
    if n < 2:
        raise ValueError("mean_interval: needs at least two values")
    mean = sum(values) / n
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
    half = t_quantile(n - 1, confidence) * sd / math.sqrt(n)
    return mean, mean - half, mean + half


def ratio_interval(numerators: list[float], denominators: list[float],
                   confidence: float = CONFIDENCE) -> tuple[float, float, float]:
    """(R, low, high) for R = sum(numerators) / sum(denominators) over n paired observations (n >= 2):
    tokens per second of a window of steps, each with its tokens and seconds. The standard error is the
    linearised one of a ratio estimator, sqrt(sum(e^2) / (n (n - 1))) / mean(denominator) with residuals
    e = numerator - R denominator, and the interval uses Student's t with n - 1 degrees of freedom."""
    n = len(numerators)
    if n < 2 or len(denominators) != n:
        raise ValueError("ratio_interval: needs at least two paired observations")
    ratio = sum(numerators) / sum(denominators)
    residuals = [x - ratio * y for x, y in zip(numerators, denominators)]
    se = math.sqrt(sum(e * e for e in residuals) / (n * (n - 1))) / (sum(denominators) / n)
    half = t_quantile(n - 1, confidence) * se
    return ratio, ratio - half, ratio + half


def quotient_interval(numerator: tuple[float, float], denominator: tuple[float, float]) -> tuple[float, float]:
    """(low, high) of a / b from the (low, high) intervals of two positive figures measured apart: the ends
    divided crosswise (a's low over b's high, a's high over b's low), as a cost's interval follows its
    throughput's. It holds every quotient of values inside both intervals, so it is wider than a 95% interval
    of the quotient would need to be; in exchange it contains 1 exactly when the two intervals overlap,
    which is the report's tie rule (``overlap``) read as a ratio. A denominator interval reaching 0 leaves
    the high end unbounded (inf)."""
    (a_low, a_high), (b_low, b_high) = numerator, denominator
    if b_high <= 0:
        raise ValueError(f"quotient_interval: the denominator's interval ({b_low}, {b_high}) must reach above 0")
    return a_low / b_high, a_high / b_low if b_low > 0 else math.inf


def trimmed_mean(values: list[float]) -> float:
    """MLPerf-style score of repeats: the mean without the fastest and the slowest (needs three or more)."""
    if len(values) < 3:
        raise ValueError("trimmed_mean: needs at least three values")
    kept = sorted(values)[1:-1]
    return sum(kept) / len(kept)


def overlap(a: tuple[float, float], b: tuple[float, float]) -> bool:
    """Whether two (low, high) intervals share a point."""
    return a[0] <= b[1] and b[0] <= a[1]


def repeats_to_separate(difference: float, sd_a: float, sd_b: float, confidence: float = CONFIDENCE,
                        limit: int = 1000) -> int | None:
    """The fewest repeats per configuration whose t-intervals of the mean no longer overlap when the
    means differ by ``difference`` and the repeats spread as ``sd_a`` and ``sd_b`` did: the smallest n
    with t(n - 1) (sd_a + sd_b) / sqrt(n) < |difference|. None when it takes more than ``limit``."""
    if difference == 0:
        return None
    # t > z, so no n below the normal approximation's answer can do: start there.
    start = max(2, math.ceil((_z(confidence) * (sd_a + sd_b) / abs(difference)) ** 2))
    for n in range(start, limit + 1):
        if t_quantile(n - 1, confidence) * (sd_a + sd_b) / math.sqrt(n) < abs(difference):
            return n
    return None


def scale_to_separate(difference: float, half_a: float, half_b: float) -> float:
    """How many times the present sample (eval rows, measured steps) two intervals that shrink as
    1 / sqrt(sample) need to stop overlapping at ``difference``: ((half_a + half_b) / difference)^2."""
    if difference == 0:
        return math.inf
    return ((half_a + half_b) / abs(difference)) ** 2
