"""What a full training run would take, projected from a run's measured window.

The budget is experiment-wide (config key ``budget``): ``tokens`` or ``samples``, times ``epochs``.
It is applied when results are collected, so changing it retrains nothing.
- tokens of the budget: tokens x epochs, or samples x epochs x the run's measured tokens per sample;
- projected_hours = budget tokens / measured tokens_per_s (global throughput of the run's devices);
- projected_pflops = budget tokens x the run's analytic model FLOPs per token (scripts/ftbench/measure/flops.py).
A run without a measured window (oom, unsupported, ...) gets nulls.
"""

from __future__ import annotations

import math

import pandas as pd

PROJECTION_COLUMNS = ("projected_tokens", "projected_hours", "projected_pflops")


def _number(value) -> float | None:
    if value is None or value is pd.NA:
        return None
    value = float(value)
    return None if math.isnan(value) else value


def budget_tokens(budget: dict | None, row: dict) -> float | None:
    if not budget:
        return None
    epochs = float(budget.get("epochs") or 1)
    if budget.get("tokens") is not None:
        return float(budget["tokens"]) * epochs
    tokens, samples = _number(row.get("tokens_per_s")), _number(row.get("samples_per_s"))
    if budget.get("samples") is not None and tokens and samples:
        return float(budget["samples"]) * epochs * tokens / samples
    return None


def project(row: dict, budget: dict | None) -> dict:
    tokens = budget_tokens(budget, row)
    rate = _number(row.get("tokens_per_s"))
    tflops = _number(row.get("tflops_per_s"))
    out = dict.fromkeys(PROJECTION_COLUMNS)
    if tokens is None or not rate:
        return out
    out["projected_tokens"] = tokens
    out["projected_hours"] = tokens / rate / 3600.0
    if tflops is not None:
        out["projected_pflops"] = tokens * (tflops * 1e12 / rate) / 1e15
    return out


def add_projections(frame: pd.DataFrame, budgets: dict | list | None) -> pd.DataFrame:
    """Projection columns for every row; ``budgets`` is one budget for all rows or one per row."""
    rows = frame.to_dict("records")
    per_row = budgets if isinstance(budgets, list) else [budgets] * len(rows)
    projected = [project(row, budget) for row, budget in zip(rows, per_row)]
    frame = frame.copy()
    for column in PROJECTION_COLUMNS:
        frame[column] = [values[column] for values in projected]
    return frame
