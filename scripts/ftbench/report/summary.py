"""The end of an invocation in one screen: how many runs ended how, why each that is not ok, where to read
more. Written by collect (results/summary.txt) and printed by the Snakefile when Snakemake ends."""

from __future__ import annotations

import re
import sys
import time
from pathlib import Path

import pandas as pd

from ftbench.cluster import job_clock, progress_relay

# The order a user reads outcomes in: what worked, then what stopped early, then what did not run.
OUTCOMES = ("ok", "timeout", "oom", "diverged", "unsupported", "failed")
# Runs listed by name at most (the table has them all), and characters of each reason.
MAX_LISTED = 15
REASON_CHARS = 160


# What a run that is not ok needs, by outcome. Its row is its result: rerunning snakemake alone never trains
# it again (a changed setting does, being another run). Only a cause that can pass is worth another try.
RUN_IN_THE_LOG = "logs/train/<run_id>.log"
UNEXPECTED = "failed, unexpected error"
ADVICE = {
    # Its row is kept whatever walltime a rerun gets: only a removed row trains again (the commands: retrain_lines).
    # Its walltime may have been the estimate, a --set-resources or an administrator's: the cause names none of them.
    "timeout": "retry with more time: its job's walltime ended it before all its steps, and a rerun keeps its row "
               "whatever walltime it gets: remove the row, then rerun with --set-resources train:runtime= the minutes "
               "its steps need (the commands below)",
    "oom": "fix, a retry would run out again: a smaller batch_size, gradient_checkpointing: true, auto_batch_size: true "
           "or a GPU with more memory",
    "diverged": "fix, a retry would diverge again (same seed): a lower learning_rate, or bf16 / fp32 instead of fp16",
    "unsupported": "fix, a retry would be refused again: run it on a machine that can (its reason says what it lacks), "
                   "or leave it out of the experiment (exclude)",
    "failed": "fix, a retry would fail again: its reason names the setting or data to change (README: Troubleshooting); "
              "a changed setting trains it by itself, a repaired data file once results/runs/<run_id>/ is deleted",
    UNEXPECTED: f"retry if its cause has passed: an unexpected error, traceback in {RUN_IN_THE_LOG}; if it was a passing "
               "fault (a node, driver or network), delete results/runs/<run_id>/ and rerun snakemake to retry it",
}
# measure.metrics.failed_metrics ends the reason of an error ftbench did not name (no FtbenchError) with this:
# its cause is unknown, so it may be a passing fault. A named error (config, source, manifest) is not.
UNEXPECTED_MARK = "(traceback in the job log)"


def advice_kind(status, reason) -> str:
    """The ADVICE entry for a run that is not ok: its status, or UNEXPECTED for a failed run whose error
    ftbench did not name (UNEXPECTED_MARK) and for an unknown status."""
    if status == "failed" and isinstance(reason, str) and reason.endswith(UNEXPECTED_MARK):
        return UNEXPECTED
    return status if status in ADVICE else UNEXPECTED


def advice_lines(not_ok: pd.DataFrame) -> list[str]:
    """One line per kind of advice the runs that are not ok need, naming (a few of) their runs; a timed-out run
    with the walltime to ask for (more_time)."""
    kinds = pd.Series([advice_kind(status, reason) for status, reason in zip(not_ok["status"], not_ok["status_reason"])],
                      index=not_ok.index, dtype=object)
    lines = []
    for kind in (k for k in ADVICE if k in set(kinds)):
        rows = not_ok.loc[kinds == kind]
        runs = [f"{run_id}: runtime={more_time(row)}" if kind == "timeout" and more_time(row) else str(run_id)
                for run_id, (_, row) in zip(rows["run_id"], rows.iterrows())]
        named = ", ".join(runs[:3]) + (f" and {len(runs) - 3} more" if len(runs) > 3 else "")
        lines.append(f"  -> {kind} ({named}): {ADVICE[kind]}")
        if kind == "timeout":
            lines += retrain_lines([(run_id, more_time(row)) for run_id, (_, row) in zip(rows["run_id"], rows.iterrows())])
    return lines


def retrain_lines(runs: list[tuple[str, int | None]]) -> list[str]:
    """The commands that train (a few of) these runs again with more time, each with its walltime in minutes (None:
    unknown): its row removed first, since a rerun keeps a run's row whatever walltime it gets."""
    lines = [f"       rm -r results/runs/{run_id}/ && snakemake <your arguments> --set-resources "
             f"train:runtime={minutes if minutes is not None else '<minutes, more than it had>'}" for run_id, minutes in runs[:3]]
    if len(runs) > 3:
        lines.append(f"       ... and {len(runs) - 3} more the same way (the table's status_reason names each one's walltime)")
    return lines


def count(number: int, noun: str) -> str:
    """``1 run``, ``2 runs``."""
    return f"{number} {noun}{'' if number == 1 else 's'}"


def more_time(row) -> int | None:
    """The walltime (minutes) a timed-out run needs for all its steps at the pace it trained (job_clock.more_time_minutes);
    None where its status reason names no walltime."""
    limit = job_clock.limit_minutes_in(row.get("status_reason") if isinstance(row.get("status_reason"), str) else "")
    if limit is None:
        return None
    figures = {name: row.get(name) for name in ("last_step", "total_steps", "train_time_s", "wall_time_s")}
    figures = {name: None if pd.isna(value) else float(value) for name, value in figures.items()}
    done = figures["last_step"] + 1 if figures["last_step"] is not None else None
    return job_clock.more_time_minutes(limit, done, figures["total_steps"], figures["train_time_s"], figures["wall_time_s"])


def outcome_summary(frame: pd.DataFrame, table_path: str) -> str:
    counts = frame["status"].value_counts()
    others = sorted(set(counts.index) - set(OUTCOMES))
    tally = ", ".join(f"{int(counts.get(status, 0))} {status}" for status in (*OUTCOMES, *others))
    lines = [f"ftbench: {count(len(frame), 'run')}: {tally}"]
    not_ok = frame[frame["status"] != "ok"].copy()
    not_ok["order"] = not_ok["status"].map({status: i for i, status in enumerate(OUTCOMES)}).fillna(len(OUTCOMES))
    for _, row in not_ok.sort_values(["order", "run_id"]).head(MAX_LISTED).iterrows():
        reason = " ".join(row["status_reason"].split()) if pd.notna(row["status_reason"]) else "(no reason recorded)"
        if len(reason) > REASON_CHARS:
            reason = reason[: REASON_CHARS - 3] + "..."
        lines.append(f"  {row['status']:<11} {row['run_id']}: {reason}")
    if len(not_ok) > MAX_LISTED:
        lines.append(f"  ... and {len(not_ok) - MAX_LISTED} more not ok: see the status column of the table")
    lines.extend(advice_lines(not_ok))
    lines += dropped_rows_lines(frame)
    lines.append(f"table: {table_path}")
    return "\n".join(lines) + "\n"


# A failed job (no row: Snakemake reports it) ends its log with ftbench's one line where ftbench could write it:
# a named error (a config, source or data problem: cli.run), to fix before a rerun can pass; a run cancelled or
# preempted (errors.TerminatedError), which a rerun trains again; a run the scheduler's walltime ended, whose line
# names the walltime to ask for. A job killed outright (SIGKILL: out of host memory, a node's end) has no line.
FIX, CANCELLED, TIME_LIMIT, KILLED = "fix", "cancelled", "time limit", "no line"
JOB_ADVICE = {
    FIX: "fix what its line names, then rerun snakemake (a rerun alone fails again)",
    TIME_LIMIT: "its walltime ended it: rerun snakemake with the walltime its line gives (--set-resources "
                "train:runtime=N, after the targets)",
    CANCELLED: "cancelled or preempted, nothing to fix: a rerun trains it again",
    KILLED: "killed without a word (out of host memory, a node or network fault): a rerun retries it; its log shows "
            "how far it got",
}
# Lines starting "ftbench: " that are not a job's last word: warnings, test-only fault announcements.
NOT_AN_ENDING = ("ftbench: warning", "ftbench: FTBENCH_INJECT_FAULT")
# How long the end of an invocation waits for a failed job's line still being written (Snakemake may report a
# cancelled job before the job has written it): until no such log has changed for SETTLE_S, at most WAIT_S.
SETTLE_S, WAIT_S = 2.0, 10.0
# Characters of a failed job's line shown: ftbench's own lines say what to do at their end (the walltime to ask for).
JOB_LINE_CHARS = 500


def job_ending(log: Path) -> tuple[str, str]:
    """(kind, line) of a failed job's log: its last line if that is ftbench's (FIX, CANCELLED or TIME_LIMIT), else
    (KILLED, its last line)."""
    lines = [line for line in log.read_text(encoding="utf-8", errors="replace").splitlines() if line.strip()]
    last = lines[-1] if lines else ""
    if not last.startswith("ftbench: ") or last.startswith(NOT_AN_ENDING):
        return KILLED, last
    if job_clock.TIME_LIMIT_WORDS in last:
        return TIME_LIMIT, last
    if "(SIGTERM)" in last:
        return CANCELLED, last
    return FIX, last


# What slurmstepd writes into a SLURM job's own log (.snakemake/slurm_logs/rule_train/<run_id>/<job id>.log) when it
# ends the job, and the walltime the job's Snakemake printed with its resources.
SLURM_ENDED = re.compile(r"\*\*\* JOB \S+ ON \S+ CANCELLED AT \S+(?: DUE TO (?P<cause>[A-Z ]+?))? \*\*\*")
SLURM_RUNTIME = re.compile(r"resources: .*\bruntime=(\d+)")


def slurm_ending(run_id: str, started: float, slurm_logs: Path = Path(".snakemake/slurm_logs")) -> tuple[str, str] | None:
    """(kind, line) from SLURM's log of the run's latest train job of this invocation, where SLURM ended the job
    before ftbench could say why (a scancel or the walltime during the job's start): CANCELLED (scancel,
    preemption) or TIME_LIMIT, with the walltime to ask for. None where there is no such log or line."""
    logs = [log for log in (slurm_logs / "rule_train" / run_id).glob("*.log") if log.stat().st_mtime >= started]
    if not logs:
        return None
    text = max(logs, key=lambda log: log.stat().st_mtime).read_text(encoding="utf-8", errors="replace")
    ended = SLURM_ENDED.search(text)
    if not ended:
        return None
    said = f"SLURM: {ended.group(0).strip('* ')}"
    if ended["cause"] != "TIME LIMIT":
        return CANCELLED, said
    runtimes = SLURM_RUNTIME.findall(text)
    more = f"; give it more time: --set-resources train:runtime={job_clock.more_time_minutes(int(runtimes[-1]))}" if runtimes else ""
    return TIME_LIMIT, f"{said} ({job_clock.TIME_LIMIT_WORDS} before it could write a row){more}"


def failed_jobs(started: float, logs: Path = Path("logs"), results: Path = Path("results"),
                clock=time.time, sleep=time.sleep) -> list[tuple[Path, str, str]]:
    """(log, kind, line) of each job of this invocation (log written since ``started``) that failed: a train job
    without its run's metrics.json (a run that wrote its row, a failed one too, ended well), any other job whose
    log ends on ftbench's line. Waits (SETTLE_S, WAIT_S) for the lines of train jobs still writing their end."""
    deadline = clock() + WAIT_S
    while True:
        found = []
        for log in sorted(logs.rglob("*.log")) if logs.is_dir() else []:
            modified = log.stat().st_mtime
            if modified < started:
                continue
            kind, line = job_ending(log)
            train = log.parent.name == "train"
            if train and (results / "runs" / log.stem / "metrics.json").is_file():
                continue
            if train or kind != KILLED:
                found.append((log, kind, line, modified))
        writing = [modified for _, kind, _, modified in found if kind == KILLED and clock() - modified < SETTLE_S]
        if not writing or clock() >= deadline:
            return [(log, *_told_by_slurm(log, kind, line, started)) for log, kind, line, _ in found]
        sleep(0.5)


def _told_by_slurm(log: Path, kind: str, line: str, started: float) -> tuple[str, str]:
    """A train job with no line of ftbench's: what SLURM's own log of it says, where it says (slurm_ending)."""
    if kind != KILLED or log.parent.name != "train":
        return kind, line
    return slurm_ending(log.stem, started) or (kind, line)


def _runtime_in(line: str) -> int | None:
    """The walltime (minutes) a job's line asks for (``--set-resources train:runtime=N``), or None."""
    found = re.search(r"train:runtime=(\d+)", line)
    return int(found.group(1)) if found else None


def failed_jobs_lines(started: float, results: Path = Path("results")) -> list[str]:
    """This invocation's failed jobs, each with its own last line, and what each kind needs: only a named error is
    one to fix; a cancelled or preempted run is not; a run its walltime ended gets the walltime to ask for."""
    jobs = failed_jobs(started, results=results)
    lines = [f"  {kind} {log}: {' '.join(line.split())[:JOB_LINE_CHARS] or '(empty log)'}" for log, kind, line in jobs[:MAX_LISTED]]
    if len(jobs) > MAX_LISTED:
        lines.append(f"  ... and {len(jobs) - MAX_LISTED} more failed jobs")
    kinds = [kind for _, kind, _ in jobs]
    # A run whose timeout row its job kept (cluster/kept_rows.py) is not trained by a rerun, whatever its walltime.
    kept = [(log.stem, _runtime_in(line)) for log, kind, line in jobs
            if kind == TIME_LIMIT and log.parent.name == "train" and (results / "runs" / log.stem / "kept").is_dir()]
    for kind in (k for k in JOB_ADVICE if k in kinds):
        advice = JOB_ADVICE[kind]
        if kind == TIME_LIMIT and kept:
            advice += (f"; {count(len(kept), 'run')} kept a timeout row, which a rerun keeps whatever walltime it gets: "
                       "remove the row to train it again")
        lines.append(f"  -> {kind} ({kinds.count(kind)}): {advice}")
        if kind == TIME_LIMIT and kept:
            lines += retrain_lines(kept)
    if FIX in kinds:
        lines.append("ftbench: some jobs failed on an error to fix (listed above): fix what each names, then rerun "
                     "snakemake (a rerun alone fails again); any other failed job is retried by that rerun")
    elif jobs:
        more = " with the walltime their lines give" if TIME_LIMIT in kinds else ""
        rows = "; the runs that kept a timeout row train again only once it is removed (the commands above)" if kept else ""
        lines.append(f"ftbench: some jobs failed, nothing to fix (listed above): rerun snakemake{more} to retry them{rows}")
    else:
        lines.append("ftbench: some jobs failed (their logs are named above), none on an error ftbench named (killed, out "
                     "of host memory, a node or network fault): rerun snakemake to retry them")
    return lines


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


def target_summary(frame: pd.DataFrame) -> str:
    """One line on the quality target (experiment key target), when there is one: how many finished runs reached
    it, and which never did; timed-out runs evaluated on it counted apart (the report ranks finished runs only:
    a run cut short is not the trained model)."""
    if "target_metric" not in frame or frame["target_metric"].isna().all():
        return ""
    ok = frame[frame["status"] == "ok"]
    never = ok[ok["target_reached"].eq(False).fillna(False)]["run_id"].tolist()
    reached = int(ok["target_reached"].eq(True).fillna(False).sum())
    name = f"target {frame['target_metric'].dropna().iloc[0]} {frame['target_value'].dropna().iloc[0]:g}"
    parts = [f"{reached} of {len(ok)} finished runs reached it"] if len(ok) else ["no run finished"]
    cut = frame[frame["status"].eq("timeout") & frame["target_reached"].notna()]
    if len(cut):
        cut_reached = int(cut["target_reached"].eq(True).sum())
        parts.append(f"{cut_reached} of {len(cut)} timed-out runs reached it before their time limit (not ranked in the "
                     "report: cut short)")
    listed = ", ".join(never[:MAX_LISTED]) + (f" and {len(never) - MAX_LISTED} more" if len(never) > MAX_LISTED else "")
    return f"{name}: {'; '.join(parts)}" + (f"; never reached by {listed}\n" if never else "\n")


def print_outcome(started: float, failed_jobs: bool) -> None:
    """The end of an invocation, on the terminal (the Snakefile's onsuccess/onerror): the summary collect
    wrote this time, where the report is, and whether jobs failed. ``started``: when the invocation began
    (time.time()), so a summary left by an earlier invocation is not shown as this one's."""
    progress_relay.stop()  # the jobs' progress lines end before this
    summary, report = Path("results/summary.txt"), Path("results/report.html")
    lines = ["", "=" * 100]
    if summary.is_file() and (summary.stat().st_mtime >= started or not failed_jobs):
        lines.append(summary.read_text(encoding="utf-8").rstrip("\n"))
    else:
        lines.append("ftbench: no table from this invocation: a job failed before collect (see its error above)")
    lines.append(report_line(report, started, failed_jobs))
    if failed_jobs:
        lines.extend(failed_jobs_lines(started))
    lines.append("=" * 100)
    print("\n".join(lines), file=sys.stderr, flush=True)


def report_line(report: Path, started: float, failed_jobs: bool) -> str:
    """Where this invocation's report is. After a failed job it was not built (it needs every run), and the
    file there is an earlier invocation's, perhaps of another experiment in this folder: say so, not its path."""
    if not report.is_file():
        return "report: not built"
    if failed_jobs and report.stat().st_mtime < started:
        return (f"report: not built for this invocation (a job failed first); {report} is an earlier invocation's, "
                "perhaps of another experiment in this folder")
    return f"report: {report.resolve()}"
