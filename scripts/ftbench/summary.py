"""The end of an invocation in one screen: how many runs ended how, why each that is not ok, where to read
more. Written by collect (results/summary.txt) and printed by the Snakefile when Snakemake ends."""

from __future__ import annotations

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
