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
    lines.append(f"table: {table_path}")
    return "\n".join(lines) + "\n"


def target_summary(frame: pd.DataFrame) -> str:
    """One line on the quality target (experiment key target), when there is one: how many finished runs
    reached it, and which never did."""
    if "target_metric" not in frame or frame["target_metric"].isna().all():
        return ""
    ok = frame[frame["status"] == "ok"]
    never = ok[ok["target_reached"].eq(False).fillna(False)]["run_id"].tolist()
    reached = int(ok["target_reached"].eq(True).fillna(False).sum())
    head = f"target {frame['target_metric'].dropna().iloc[0]} {frame['target_value'].dropna().iloc[0]:g}: {reached} of {len(ok)} finished runs reached it"
    listed = ", ".join(never[:MAX_LISTED]) + (f" and {len(never) - MAX_LISTED} more" if len(never) > MAX_LISTED else "")
    return head + (f"; never reached by {listed}\n" if never else "\n")


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
