"""A train job's clock: when the scheduler started the job, and the times its walltime leaves it.

Why from the scheduler's start: SLURM counts a job's walltime from when it started the job, not from when the
train process inside it is ready. Between the two lie the job's own Snakemake, `srun`, a second Snakemake and the
imports: 7-11 s on a test cluster, more on a busy file system. A job that counted its limit from its own start
stopped that much too late, and SLURM ended it before its row was on disk.

The times, counted from the start (``job_times``):

    started_at ......... deadline ........... ends_at ......... killed_at
    (scheduler start)    (last step starts    (row on disk)     (the scheduler's limit: SIGTERM, then SIGKILL)
                          before this)
                         |<-- margin: evaluation and writing -->|<-- exit: the process and the job's
                                                                     Snakemake ending, before the limit

Locally nobody ends a job at its limit: the limit is the job's own, counted from when it started, with no exit
allowance. Under SLURM a run stopped anyway (a job slower to start than this allows, a limit shortened by an
administrator) is recognised by its termination (``termination_cause``): its row is kept where Snakemake does not
delete it (cluster/kept_rows.py), and its line says how much more time to ask for.
"""

from __future__ import annotations

import math
import os
import re
import subprocess
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Callable, Mapping

from ftbench.errors import FtbenchError
from ftbench.measure import environment

# The scheduler's start of the job (seconds since the epoch), handed by the job to its DDP ranks (and settable by
# hand); read before anything else.
STARTED_AT_ENV = "FTBENCH_JOB_STARTED_AT"
# Set ("1") by the workflow inside a job a cluster executor submitted for one rule (rules/common.smk): its walltime
# is the rule's runtime, counted from the job's start. A workflow run locally inside an allocation (salloc, an
# sbatch script running `snakemake --cores N`) is not that: its jobs count their limit from their own start.
SCHEDULED_ENV = "FTBENCH_SCHEDULED_JOB"
# The shortest walltime (minutes) a scheduled train job may have: about a minute for the job to start (the job's
# Snakemake twice, imports, a small model's load) and the rest to stop, evaluate what it trained and write its row
# before the limit. A shorter one is refused when the workflow is planned (check_walltime).
MIN_WALLTIME_MIN = 2
# Seconds kept after the row is written for the job to end (the train process, then the job's Snakemake checking
# its outputs) before the scheduler's limit: 2% of the walltime, at least 15 s and at most 2 minutes.
EXIT_MIN_S, EXIT_SHARE, EXIT_MAX_S = 15.0, 0.02, 120.0
# Evaluation and writing after the last step: 10% of what is left, at least 60 s, at most half of it.
MARGIN_MIN_S, MARGIN_SHARE = 60.0, 0.1
# The scheduler's start time is given to the second: counted a second early.
START_RESOLUTION_S = 1.0
# A SIGTERM this close to the scheduler's limit (or after it) is the limit's, where the scheduler cannot say.
AT_LIMIT_S = 5.0

# Words the job's last line uses, which the end of an invocation reads (report/summary.py).
CANCELLED_WORDS = "cancelled or preempted"
TIME_LIMIT_WORDS = "reached its time limit"


@dataclass(frozen=True)
class JobTimes:
    """A job's times, in seconds since the epoch (``job_times``)."""

    started_at: float
    deadline: float  # the last training step starts before this
    ends_at: float  # evaluation stops and the row is written before this
    killed_at: float  # the walltime's end: the scheduler's limit
    margin: float  # ends_at - deadline

    def monotonic(self, at: float, now_wall: float | None = None, now_monotonic: float | None = None) -> float:
        """``at`` (epoch seconds) on time.monotonic()'s clock, which the training loop reads."""
        now_wall = time.time() if now_wall is None else now_wall
        now_monotonic = time.monotonic() if now_monotonic is None else now_monotonic
        return now_monotonic + (at - now_wall)


def job_times(limit_s: float, started_at: float, scheduled: bool) -> JobTimes:
    """The times a walltime of ``limit_s`` seconds leaves a job the scheduler started at ``started_at`` (epoch).
    ``scheduled``: a scheduler ends the job at its limit, so the job keeps time to end before it (and the start,
    given to the second, is counted a second early); a local job's limit is its own."""
    exit_s = min(max(EXIT_MIN_S, EXIT_SHARE * limit_s), EXIT_MAX_S) if scheduled else 0.0
    start = started_at - (START_RESOLUTION_S if scheduled else 0.0)
    killed_at = start + limit_s
    ends_at = killed_at - exit_s
    usable = max(0.0, ends_at - start)
    margin = min(max(MARGIN_MIN_S, MARGIN_SHARE * usable), 0.5 * usable)
    return JobTimes(started_at=start, deadline=ends_at - margin, ends_at=ends_at, killed_at=killed_at, margin=margin)


def check_walltime(minutes, key: str) -> None:
    """Refuse a scheduled train job's walltime too short to produce a row (MIN_WALLTIME_MIN), naming ``key``."""
    if isinstance(minutes, (int, float)) and minutes < MIN_WALLTIME_MIN:
        raise FtbenchError(
            f"{key}={minutes:g}: a train job needs a walltime of at least {MIN_WALLTIME_MIN} minutes (about one to start: "
            f"Snakemake, imports, loading; the rest to stop, evaluate and write its row before SLURM's limit); "
            f"give {key}={MIN_WALLTIME_MIN} or more")


def minutes_words(limit_s: float) -> str:
    """A walltime as the job's lines give it: "2 min"."""
    return f"{limit_s / 60:g} min"


LIMIT_IN_WORDS = re.compile(r"time limit \((?P<minutes>[0-9.]+) min\)")


def limit_minutes_in(text: str) -> float | None:
    """The walltime a status reason or job line names (minutes_words), or None."""
    match = LIMIT_IN_WORDS.search(text or "")
    return float(match["minutes"]) if match else None


def more_time_minutes(limit_min: float, steps_done: int | None = None, total_steps: int | None = None,
                      train_s: float | None = None, wall_s: float | None = None) -> int:
    """The walltime (minutes) to ask for after a job that its limit ended: what all its steps need at the pace it
    trained (its time outside the loop, start, loading and evaluation, plus ``total_steps`` at ``train_s`` per
    ``steps_done``), a quarter more for the margin the job keeps; at least twice what it had. Twice what it had
    where the pace is not known."""
    floor = max(MIN_WALLTIME_MIN, math.ceil(2 * limit_min))
    known = [value for value in (steps_done, total_steps, train_s, wall_s) if value is not None and value == value]
    if len(known) < 4 or not steps_done or steps_done < 0 or not train_s:
        return floor
    needed_s = max(0.0, wall_s - train_s) + train_s / steps_done * total_steps
    return max(floor, math.ceil(1.25 * needed_s / 60))


# -- where the start comes from -------------------------------------------------------------------------------


def scheduled(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether this is a job a cluster executor submitted for its rule, in a SLURM job (SCHEDULED_ENV)."""
    return environ.get(SCHEDULED_ENV) == "1" and bool(environ.get("SLURM_JOB_ID") or environ.get("SLURM_JOBID"))


def scheduler_start(environ: Mapping[str, str] = os.environ, run: Callable = subprocess.run) -> tuple[float, str] | None:
    """(when this job started, in seconds since the epoch; where that came from), or None: not known. In order:
    STARTED_AT_ENV (the job's own, handed to its ranks); then for a scheduled job only (``scheduled``):
    SLURM_JOB_START_TIME (SLURM 23.02 and later), the job's StartTime from scontrol, the start of the oldest process
    of this job step."""
    value = _seconds(environ.get(STARTED_AT_ENV))
    if value is not None:
        return value, STARTED_AT_ENV
    if not scheduled(environ):
        return None
    value = _seconds(environ.get("SLURM_JOB_START_TIME"))
    if value is not None:
        return value, "SLURM_JOB_START_TIME"
    job_id = environ.get("SLURM_JOB_ID") or environ.get("SLURM_JOBID")
    started = _scontrol_field(job_id, "StartTime", run)
    value = _seconds(started) if started else None
    if value is None and started:
        value = _local_time(started)
    if value is not None:
        return value, "scontrol"
    value = first_process_start()
    return (value, "first process") if value is not None else None


def _seconds(text: str | None) -> float | None:
    try:
        value = float(text) if text else None
    except ValueError:
        return None
    return value if value and value > 0 else None


def _local_time(text: str) -> float | None:
    try:
        return datetime.fromisoformat(text).timestamp()  # SLURM's own format: local time, to the second
    except ValueError:
        return None


def _scontrol_fields(job_id: str, run: Callable) -> dict[str, str]:
    """`scontrol show job` as {field: value} (times in seconds since the epoch: SLURM_TIME_FORMAT=%s); {} where it
    cannot be asked."""
    try:
        out = run(["scontrol", "-o", "show", "job", str(job_id)], capture_output=True, text=True, timeout=10,
                  env={**os.environ, "SLURM_TIME_FORMAT": "%s"})
    except (OSError, subprocess.SubprocessError):
        return {}
    if out.returncode != 0:
        return {}
    return {key: value for key, value in re.findall(r"(\w+)=(\S*)", out.stdout)
            if value not in ("Unknown", "None", "(null)", "")}


def _scontrol_field(job_id: str, field: str, run: Callable) -> str | None:
    return _scontrol_fields(job_id, run).get(field)


def first_process_start(pid: int | None = None, proc: Path = Path("/proc")) -> float | None:
    """When the oldest process above ``pid`` (default: this one) that SLURM's step daemon started began, in seconds
    since the epoch; None off Linux or outside a job step."""
    pid = os.getpid() if pid is None else pid
    top = None
    for _ in range(64):  # a chain of parents: never longer than this in a job
        parent = _parent(pid, proc)
        if parent is None or parent <= 1:
            return None
        if _name(parent, proc) == "slurmstepd":
            top = pid
            break
        pid = parent
    started = environment.process_started_s(top) if top is not None else None
    if started is None:
        return None
    return time.time() - (time.clock_gettime(time.CLOCK_BOOTTIME) - started)


def _parent(pid: int, proc: Path) -> int | None:
    try:
        return int((proc / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def _name(pid: int, proc: Path) -> str:
    try:
        return (proc / str(pid) / "comm").read_text().strip()
    except OSError:
        return ""


# -- how a job was ended ----------------------------------------------------------------------------------------


def termination_cause(times: JobTimes | None, terminated_at: float | None, environ: Mapping[str, str] = os.environ,
                      run: Callable = subprocess.run) -> tuple[str, float | None]:
    """Why a SIGTERM came, and the walltime the scheduler held the job to (seconds; None where not known):
    "time limit" (the scheduler's walltime ended), else "cancelled" (scancel, preemption, Ctrl-C, a node drained).
    SLURM says so itself: while the job ends its state is COMPLETING with Reason=TimeLimit (TIMEOUT once ended), a
    scancelled job's reason is None; its TimeLimit may be shorter than the job was given (an administrator's
    `scontrol update`). Where it cannot be asked, a SIGTERM at the limit (AT_LIMIT_S before it or later: SLURM checks
    limits every few tens of seconds) is the limit's."""
    job_id = environ.get("SLURM_JOB_ID") or environ.get("SLURM_JOBID")
    fields = _scontrol_fields(job_id, run) if job_id else {}
    if fields.get("JobState"):
        limited = fields["JobState"].startswith("TIMEOUT") or fields.get("Reason") == "TimeLimit"
        return ("time limit" if limited else "cancelled"), slurm_duration_s(fields.get("TimeLimit", ""))
    if times is not None and terminated_at is not None and terminated_at >= times.killed_at - AT_LIMIT_S:
        return "time limit", None
    return "cancelled", None


def slurm_duration_s(text: str) -> float | None:
    """SLURM's [days-]hours:minutes:seconds (or minutes:seconds) in seconds; None for anything else (UNLIMITED)."""
    match = re.fullmatch(r"(?:(\d+)-)?(?:(\d+):)?(\d+):(\d+)", text or "")
    if not match:
        return None
    days, hours, minutes, seconds = (int(part or 0) for part in match.groups())
    return float(((days * 24 + hours) * 60 + minutes) * 60 + seconds)
