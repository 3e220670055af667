"""Gather every run's metrics.json into one table: ``metrics.parquet`` plus a CSV twin.

Costs are computed here (scripts/ftbench/cost.py) from the measured throughput and the price table, so
a price change re-runs this step and the report, never a training run.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pandas as pd

from . import atomic, cost, projection
from .columns import COLUMNS, row_from_result


def typed(frame: pd.DataFrame) -> pd.DataFrame:
    """Exactly the documented columns, in order, with their dtypes (missing ones become null)."""
    frame = frame.reindex(columns=list(COLUMNS))
    return frame.astype({name: dtype for name, (dtype, _) in COLUMNS.items()})


def build_table(result_files: list[str | Path], prices: cost.Prices | None = None, budget: dict | None = None,
                warnings_out: list[str] | None = None) -> pd.DataFrame:
    results = [json.loads(Path(path).read_text(encoding="utf-8")) for path in result_files]
    rows = [row_from_result(result) for result in results]
    frame = typed(pd.DataFrame(rows, columns=list(COLUMNS)))
    # A budget in the run's own spec wins over the experiment-wide one.
    budgets = [result.get("spec", {}).get("budget") or budget for result in results]
    frame = typed(projection.add_projections(frame, budgets))
    if prices is not None:
        frame, warnings = cost.add_costs(frame, prices, budgets, warn=False)
        frame = typed(frame)
        if warnings_out is not None:
            warnings_out.extend(warnings)
    return frame


def collect(result_files: list[str | Path], parquet_path: str | Path, csv_path: str | Path,
            prices: cost.Prices | None = None, budget: dict | None = None) -> pd.DataFrame:
    warnings: list[str] = []
    frame = build_table(result_files, prices, budget, warnings)
    for warning in warnings:
        print(f"warning: {warning}", file=sys.stderr)
    atomic.write_parquet(parquet_path, frame)
    atomic.write_csv(csv_path, frame)
    return frame
