"""The report's intervals (scripts/ftbench/report/uncertainty.py) on hand-made numbers with known answers."""

from __future__ import annotations

import math

import pytest

from ftbench.report import uncertainty


@pytest.mark.parametrize(("proportion", "n", "low", "high"), [
    (0.5, 100, 0.4038, 0.5962),   # the textbook example
    (0.0, 10, 0.0, 0.2775),       # no success: the interval still has width (a normal interval would be [0, 0])
    (1.0, 10, 0.7225, 1.0),
    (0.75, 1000, 0.7222, 0.7758),  # ~ +/-2.7 points on 1,000 eval rows
])
def test_wilson_interval(proportion, n, low, high):
    assert uncertainty.wilson(proportion, n) == pytest.approx((low, high), abs=1e-4)


def test_wilson_needs_trials():
    with pytest.raises(ValueError):
        uncertainty.wilson(0.5, 0)


@pytest.mark.parametrize(("df", "critical"), [(1, 12.7062), (2, 4.3027), (3, 3.1824), (4, 2.7764), (9, 2.2622),
                                              (29, 2.0452), (100, 1.9840)])
def test_t_quantile_matches_the_tables(df, critical):
    assert uncertainty.t_quantile(df) == pytest.approx(critical, abs=1e-4)
    assert uncertainty.t_quantile(df, 0.90) < critical


def test_mean_interval():
    mean, low, high = uncertainty.mean_interval([1, 2, 3, 4, 5])
    half = 2.7764 * math.sqrt(2.5) / math.sqrt(5)  # t(4) x sd / sqrt(n)
    assert (mean, low, high) == pytest.approx((3, 3 - half, 3 + half), abs=1e-4)
    with pytest.raises(ValueError):
        uncertainty.mean_interval([1.0])


def test_ratio_interval_of_a_window():
    # 100 tokens a step in 0.9 s and 1.1 s alternately: R = 100 tokens/s; residuals +-10, sum of squares
    # 400, se = sqrt(400 / (4 x 3)) / 1.0 = 5.774, t(3) = 3.1824 -> half-width 18.37
    ratio, low, high = uncertainty.ratio_interval([100] * 4, [0.9, 1.1, 0.9, 1.1])
    assert (ratio, low, high) == pytest.approx((100, 81.63, 118.37), abs=0.01)
    # steady steps: no spread, no width
    assert uncertainty.ratio_interval([50, 50, 50], [0.5, 0.5, 0.5]) == pytest.approx((100, 100, 100))
    # tokens that follow the step time (longer batches take longer) are not noise
    assert uncertainty.ratio_interval([50, 100, 150], [0.5, 1.0, 1.5]) == pytest.approx((100, 100, 100))


def test_trimmed_mean_drops_the_fastest_and_the_slowest():
    assert uncertainty.trimmed_mean([400, 100, 380, 390, 1000]) == pytest.approx(390)
    with pytest.raises(ValueError):
        uncertainty.trimmed_mean([1, 2])


def test_overlap():
    assert uncertainty.overlap((1, 2), (2, 3)) and uncertainty.overlap((1, 5), (2, 3))
    assert not uncertainty.overlap((1, 2), (2.1, 3))


def test_repeats_to_separate():
    # means 10 apart, each spreading with sd 5: t(n-1) x 10 / sqrt(n) < 10 first holds at n = 7
    # (t(6) = 2.447 < sqrt(7) = 2.646; t(5) = 2.571 > sqrt(6) = 2.449)
    assert uncertainty.repeats_to_separate(10, 5, 5) == 7
    assert uncertainty.repeats_to_separate(-10, 5, 5) == 7
    assert uncertainty.repeats_to_separate(100, 1, 1) == 2
    assert uncertainty.repeats_to_separate(0.001, 5, 5) is None  # more than 1,000
    assert uncertainty.repeats_to_separate(0, 5, 5) is None


def test_scale_to_separate():
    # half-widths 3 and 3 at a difference of 4: (6 / 4)^2 = 2.25 times the sample
    assert uncertainty.scale_to_separate(4, 3, 3) == pytest.approx(2.25)
    assert uncertainty.scale_to_separate(0, 3, 3) == math.inf


def test_quotient_interval_divides_the_ends_crosswise():
    # per-GPU 21,000 (20,000-22,000) over a single GPU's 20,000 (16,000-25,000): 0.8 to 1.375
    assert uncertainty.quotient_interval((20000.0, 22000.0), (16000.0, 25000.0)) == pytest.approx((0.8, 1.375))
    # it reaches 1 exactly when the intervals overlap: the report's tie rule as a ratio
    apart, touching = (10.0, 11.0), (11.0, 12.0)
    assert uncertainty.quotient_interval(apart, (12.0, 13.0))[1] < 1
    assert uncertainty.quotient_interval(apart, touching)[1] == 1 and uncertainty.overlap(apart, touching)
    assert uncertainty.quotient_interval((1.0, 2.0), (0.0, 3.0)) == (pytest.approx(1 / 3), math.inf)
    with pytest.raises(ValueError, match="must reach above 0"):
        uncertainty.quotient_interval((1.0, 2.0), (0.0, 0.0))
