"""The end of an invocation in one screen: how many runs ended how, why each that is not ok, where to read
more. Written by collect (results/summary.txt) and printed by the Snakefile when Snakemake ends."""

from __future__ import annotations

import sys
from pathlib import Path

import pandas as pd

# The order a user reads outcomes in: what worked, then what stopped early, then what did not run.
OUTCOMES = ("ok", "timeout", "oom", "diverged", "unsupported", "failed")
# Runs listed by name at most (the table has them all), and characters of each reason.
MAX_LISTED = 15
REASON_CHARS = 160


def outcome_summary(frame: pd.DataFrame, table_path: str) -> str:
    counts = frame["status"].value_counts()
    others = sorted(set(counts.index) - set(OUTCOMES))
    tally = ", ".join(f"{int(counts.get(status, 0))} {status}" for status in (*OUTCOMES, *others))
    lines = [f"ftbench: {len(frame)} runs: {tally}"]
    not_ok = frame[frame["status"] != "ok"].copy()
    not_ok["order"] = not_ok["status"].map({status: i for i, status in enumerate(OUTCOMES)}).fillna(len(OUTCOMES))
    for _, row in not_ok.sort_values(["order", "run_id"]).head(MAX_LISTED).iterrows():
        reason = " ".join(row["status_reason"].split()) if pd.notna(row["status_reason"]) else "(no reason recorded)"
        if len(reason) > REASON_CHARS:
            reason = reason[: REASON_CHARS - 3] + "..."
        lines.append(f"  {row['status']:<11} {row['run_id']}: {reason}")
    if len(not_ok) > MAX_LISTED:
        lines.append(f"  ... and {len(not_ok) - MAX_LISTED} more not ok: see the status column of the table")
    lines += dropped_rows_lines(frame)
    lines.append(f"table: {table_path}")
    return "\n".join(lines) + "\n"


def dropped_rows(frame: pd.DataFrame) -> list[tuple[str, str]]:
    """(dataset, rows its preparation left out by rule, e.g. ``duplicates 12, also_in_train 3``) for each
    dataset of the runs whose data was cleaned (synthetic data has no rows_dropped figures). Datasets
    prepared more than once (several tokenizers or sequence lengths) show each distinct tally."""
    rules = [column for column in frame.columns if column.startswith("rows_dropped_") and column != "rows_dropped_total"]
    if "rows_dropped_total" not in frame.columns or "dataset" not in frame.columns:
        return []
    rows = []
    for dataset, runs in frame[frame["rows_dropped_total"].notna()].groupby("dataset", sort=True):
        tallies = []
        for _, run in runs[rules].drop_duplicates().iterrows():
            parts = [f"{rule.removeprefix('rows_dropped_')} {int(run[rule])}" for rule in rules if pd.notna(run[rule]) and run[rule]]
            tallies.append(", ".join(parts) or "none")
        rows.append((str(dataset), "; ".join(dict.fromkeys(tallies))))
    return rows


def dropped_rows_lines(frame: pd.DataFrame) -> list[str]:
    return [f"data {dataset}: rows dropped at preparation: {tally}" for dataset, tally in dropped_rows(frame)]


def print_outcome(started: float, failed_jobs: bool) -> None:
    """The end of an invocation, on the terminal (the Snakefile's onsuccess/onerror): the summary collect
    wrote this time, where the report is, and whether jobs failed. ``started``: when the invocation began
    (time.time()), so a summary left by an earlier invocation is not shown as this one's."""
    summary, report = Path("results/summary.txt"), Path("results/report.html")
    lines = ["", "=" * 100]
    if summary.is_file() and (summary.stat().st_mtime >= started or not failed_jobs):
        lines.append(summary.read_text(encoding="utf-8").rstrip("\n"))
    else:
        lines.append("ftbench: no table from this invocation: a job failed before collect (see its error above)")
    lines.append(f"report: {report.resolve()}" if report.is_file() else "report: not built")
    if failed_jobs:
        lines.append("ftbench: some jobs failed (their logs are named above); rerun snakemake to retry them")
    lines.append("=" * 100)
    print("\n".join(lines), file=sys.stderr, flush=True)
