"""A train job's clock (cluster/job_clock.py): the deadline counted from when the scheduler started the job, where
that start comes from, the shortest walltime accepted, and how a SIGTERM is told apart."""

from __future__ import annotations

import os
import subprocess
import time

import pytest

from ftbench.cluster import job_clock
from ftbench.errors import FtbenchError
from ftbench.train import job


def test_a_scheduled_jobs_times_count_from_the_schedulers_start_not_from_now():
    """SLURM started the job at t=1000 with 2 minutes; the train process is ready at t=1011 (the job's Snakemake,
    srun, imports). Its row must be on disk before 1120 less the job's exit: the stop is counted from 1000."""
    times = job_clock.job_times(120, started_at=1000.0, scheduled=True)
    assert times.started_at == 999.0  # the start, given to the second, counted a second early
    assert times.killed_at == 1119.0
    assert times.ends_at == 1119.0 - 15  # 15 s to exit (2% of 120 s is less)
    assert times.margin == pytest.approx(0.5 * (1104 - 999))  # evaluation and writing: half of what is left
    assert times.deadline == pytest.approx(times.ends_at - times.margin)
    # A process counting from its own start (t=1011) would have stopped 11 s later and written after 1119.
    assert times.ends_at < 1011 + 120 - 15


def test_long_walltimes_keep_ten_percent_for_evaluation_and_a_bounded_exit():
    hours = job_clock.job_times(10 * 3600, started_at=0.0, scheduled=True)
    assert hours.killed_at - hours.ends_at == job_clock.EXIT_MAX_S  # 2% of 10 h is 720 s: capped at 2 minutes
    assert hours.margin == pytest.approx(0.1 * (hours.ends_at - hours.started_at))
    ten = job_clock.job_times(600, started_at=0.0, scheduled=True)
    assert ten.killed_at - ten.ends_at == 15.0 and ten.margin == 60.0


def test_a_local_job_counts_from_now_with_no_exit_allowance():
    """Nobody ends a local job at its limit: the limit is its own (what the job's --time-limit-s always meant)."""
    times = job_clock.job_times(8, started_at=50.0, scheduled=False)
    assert (times.started_at, times.ends_at, times.killed_at) == (50.0, 58.0, 58.0)
    assert times.margin == 4.0 and times.deadline == 54.0


def test_the_times_are_handed_to_the_loops_monotonic_clock():
    times = job_clock.job_times(120, started_at=1000.0, scheduled=True)
    assert times.monotonic(times.deadline, now_wall=1010.0, now_monotonic=5.0) == pytest.approx(5.0 + times.deadline - 1010.0)


class Scontrol:
    """A fake `scontrol -o show job` (what subprocess.run returns)."""

    def __init__(self, stdout="", returncode=0):
        self.stdout, self.returncode, self.calls = stdout, returncode, []

    def __call__(self, command, **kwargs):
        self.calls.append((command, kwargs.get("env", {}).get("SLURM_TIME_FORMAT")))
        return subprocess.CompletedProcess(command, self.returncode, self.stdout, "")


SCHEDULED = {job_clock.SCHEDULED_ENV: "1", "SLURM_JOB_ID": "7"}


def test_the_start_comes_from_the_job_then_slurm_then_scontrol():
    scontrol = Scontrol("JobId=7 JobName=x JobState=RUNNING StartTime=1764400000 EndTime=1764400120")
    assert job_clock.scheduler_start({}, scontrol) is None and not scontrol.calls  # not a SLURM job: no scontrol
    # A workflow run locally inside an allocation (salloc): its jobs are not the allocation, and start now.
    assert job_clock.scheduler_start({"SLURM_JOB_ID": "7", "SLURM_JOB_START_TIME": "1764399999"}, scontrol) is None
    assert not scontrol.calls
    assert job_clock.scheduler_start({job_clock.STARTED_AT_ENV: "123.5", **SCHEDULED}, scontrol) == (123.5, job_clock.STARTED_AT_ENV)
    assert job_clock.scheduler_start({"SLURM_JOB_START_TIME": "1764399999", **SCHEDULED}, scontrol) == (
        1764399999.0, "SLURM_JOB_START_TIME")
    assert job_clock.scheduler_start(SCHEDULED, scontrol) == (1764400000.0, "scontrol")
    (command, time_format), = scontrol.calls
    assert command == ["scontrol", "-o", "show", "job", "7"] and time_format == "%s"  # seconds since the epoch


def test_a_start_time_in_slurms_own_format_is_local_time():
    started = job_clock.scheduler_start(SCHEDULED, Scontrol("JobId=7 StartTime=2026-11-29T10:00:03 EndTime=x"))
    assert started == (time.mktime(time.strptime("2026-11-29T10:00:03", "%Y-%m-%dT%H:%M:%S")), "scontrol")


def test_without_scontrol_the_oldest_process_of_the_job_step_is_the_start(tmp_path):
    """/proc as a job step has it: slurmstepd (10) -> snakemake (11) -> bash (12) -> python (13)."""
    boot_now = time.clock_gettime(time.CLOCK_BOOTTIME)
    tick = os.sysconf("SC_CLK_TCK")
    for pid, parent, name, age in ((10, 1, "slurmstepd", 40), (11, 10, "snakemake", 30), (12, 11, "bash", 5), (13, 12, "python", 3)):
        folder = tmp_path / str(pid)
        folder.mkdir()
        fields = ["S", str(parent)] + ["0"] * 17 + [str(int((boot_now - age) * tick))]
        (folder / "stat").write_text(f"{pid} ({name}) " + " ".join(fields))
        (folder / "comm").write_text(name + "\n")
    from ftbench.measure import environment

    original = environment.process_start_ticks
    environment.process_start_ticks = lambda pid: int((tmp_path / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[19])
    try:
        started = job_clock.first_process_start(13, proc=tmp_path)
    finally:
        environment.process_start_ticks = original
    assert started == pytest.approx(time.time() - 30, abs=1.0)  # snakemake's start, not python's
    assert job_clock.first_process_start(99, proc=tmp_path) is None  # no such process: not known


def test_a_walltime_too_short_for_a_row_is_refused_naming_the_key_and_the_minimum():
    with pytest.raises(FtbenchError) as refused:
        job_clock.check_walltime(1, "--set-resources train:runtime")
    line = str(refused.value)
    assert line.startswith("--set-resources train:runtime=1: ") and "at least 2 minutes" in line
    assert line.endswith("give --set-resources train:runtime=2 or more")
    job_clock.check_walltime(job_clock.MIN_WALLTIME_MIN, "k")  # the minimum itself passes
    job_clock.check_walltime("1h", "k")  # not a number of minutes: Snakemake's to read


def test_a_sigterm_is_the_time_limits_when_slurm_says_so_or_when_it_comes_at_the_limit():
    times = job_clock.job_times(120, started_at=1000.0, scheduled=True)
    slurm = {"SLURM_JOB_ID": "7"}
    # What SLURM 22.05 shows while the job ends (seen on the test cluster): COMPLETING, and the reason.
    # The limit SLURM held it to (shortened from 2 minutes to 1 by `scontrol update`): what its line names.
    shown = "JobId=7 JobState=COMPLETING Reason=TimeLimit RunTime=00:01:13 TimeLimit=00:01:00"
    assert job_clock.termination_cause(times, 1050.0, slurm, Scontrol(shown)) == ("time limit", 60.0)
    assert job_clock.termination_cause(times, 1050.0, slurm, Scontrol("JobId=7 JobState=TIMEOUT Reason=TimeLimit")) == ("time limit", None)
    cancelled = "JobId=7 JobState=COMPLETING Reason=None TimeLimit=1-02:00:00"
    assert job_clock.termination_cause(times, 1119.5, slurm, Scontrol(cancelled)) == ("cancelled", 26 * 3600.0)
    unanswered = Scontrol(returncode=1)
    assert job_clock.termination_cause(times, 1116.0, slurm, unanswered) == ("time limit", None)
    assert job_clock.termination_cause(times, 1050.0, slurm, unanswered) == ("cancelled", None)
    assert job_clock.termination_cause(None, None, {}, unanswered) == ("cancelled", None)
    assert [job_clock.slurm_duration_s(t) for t in ("10:00", "02:00:00", "UNLIMITED")] == [600.0, 7200.0, None]


def test_the_job_counts_its_limit_from_the_schedulers_start(capfd, keep_sigterm):
    """stop_signal in a SLURM job started 30 s ago with 2 minutes: the deadline and the end of evaluation are
    where job_times puts them from that start, on the monotonic clock."""
    started = time.time() - 30
    environ = {**SCHEDULED, "SLURM_JOB_START_TIME": repr(started)}
    stop = job.stop_signal(120, environ)
    expected = job_clock.job_times(120, started, scheduled=True)
    assert stop.times == expected and stop.walltime_s == 120
    assert stop.limit - time.monotonic() == pytest.approx(expected.ends_at - time.time(), abs=0.5)
    assert stop.deadline - time.monotonic() == pytest.approx(expected.deadline - time.time(), abs=0.5)
    assert "counted from the scheduler's start (SLURM_JOB_START_TIME, 30 s ago)" in capfd.readouterr().out


@pytest.fixture
def keep_sigterm():
    import signal

    previous = signal.getsignal(signal.SIGTERM)
    yield
    signal.signal(signal.SIGTERM, previous)


def test_the_walltime_to_ask_for_is_what_all_steps_need_at_the_pace_trained():
    """1 minute held; 40 of 1000 steps in 40 s of training, 20 s outside it: 1000 s + 20 s, a quarter more."""
    assert job_clock.more_time_minutes(1, 40, 1000, 40.0, 60.0) == 22
    assert job_clock.more_time_minutes(10, 900, 1000, 40.0, 60.0) == 20  # nearly done: twice what it had
    assert job_clock.more_time_minutes(3) == 6 and job_clock.more_time_minutes(0.5) == job_clock.MIN_WALLTIME_MIN
    assert job_clock.more_time_minutes(1, 0, 1000, 0.0, 5.0) == 2  # no step done: no pace
