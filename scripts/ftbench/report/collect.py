"""Gather every run's metrics.json into one table: ``metrics.parquet`` plus a CSV twin.

Costs are computed here (scripts/ftbench/report/cost.py) from the measured throughput and the price table, and
MFU from the achieved TFLOP/s and the GPU peak table (config/gpus.yaml), so a price or peak change
re-runs this step and the report, never a training run. Each run's 95% intervals and stability come from
its row and its steps.parquet through analysis.run_figures, the report's own functions.
"""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path

import pandas as pd

from ftbench import atomic
from ftbench.report import analysis, cost, projection, quality_target, summary
from ftbench.measure import gpu_table, metrics
from ftbench.report.columns import COLUMNS, row_from_result


def typed(frame: pd.DataFrame) -> pd.DataFrame:
    """Exactly the documented columns, in order, with their dtypes (missing ones become null)."""
    frame = frame.reindex(columns=list(COLUMNS))
    return frame.astype({name: dtype for name, (dtype, _) in COLUMNS.items()})


def build_table(result_files: list[str | Path], prices: cost.Prices | None = None, budget: dict | None = None,
                warnings_out: list[str] | None = None, gpu_peaks: str | Path | None = None,
                target: dict | None = None) -> pd.DataFrame:
    results = [json.loads(Path(path).read_text(encoding="utf-8")) for path in result_files]
    rows = [row_from_result(result) for result in results]
    if gpu_peaks is not None:
        add_mfu(rows, gpu_peaks, warnings_out)
    frame = typed(pd.DataFrame(rows, columns=list(COLUMNS)))
    # A budget in the run's own spec wins over the experiment-wide one.
    budgets = [result.get("spec", {}).get("budget") or budget for result in results]
    frame = typed(projection.add_projections(frame, budgets))
    if prices is not None:
        frame, cost_warnings = cost.add_costs(frame, prices, budgets, warn=False)
        frame = typed(frame)
        if warnings_out is not None:
            warnings_out.extend(cost_warnings)
    # The intervals and stability the report shows, from each run's steps.parquet (beside its metrics.json)
    steps = analysis.read_steps([Path(path).with_name("steps.parquet") for path in result_files])
    frame = frame.assign(**analysis.run_figures(frame, steps))
    # The quality target: when each run reached it, from the evals.parquet beside its metrics.json.
    return typed(quality_target.add_to_target(frame, result_files, target))


def add_mfu(rows: list[dict], gpu_peaks: str | Path, warnings_out: list[str] | None = None) -> None:
    """Fill each row's MFU columns from the peak table at ``gpu_peaks``; a GPU or dtype the table lacks
    gets null and a warning naming the run."""

    peaks = gpu_table.load_peaks(gpu_peaks)
    for row in rows:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            row.update(metrics.mfu(row, peaks))
        if warnings_out is not None:
            warnings_out.extend(f"run {row['run_id']}: {warning.message}" for warning in caught)


def collect(result_files: list[str | Path], parquet_path: str | Path, csv_path: str | Path,
            prices: cost.Prices | None = None, budget: dict | None = None,
            gpu_peaks: str | Path | None = None, summary_path: str | Path | None = None,
            target: dict | None = None) -> pd.DataFrame:
    """Write the table (Parquet and CSV) and, with ``summary_path``, the outcome summary (summary.py)."""
    messages: list[str] = []
    frame = build_table(result_files, prices, budget, messages, gpu_peaks, target)
    for warning in messages:
        print(f"warning: {warning}", file=sys.stderr)
    atomic.write_parquet(parquet_path, frame)
    atomic.write_csv(csv_path, frame)
    if summary_path is not None:
        text = summary.outcome_summary(frame, str(parquet_path)) + summary.target_summary(frame)
        atomic.write_text(summary_path, text)
        print(text, end="")
    return frame
