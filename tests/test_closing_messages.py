"""The end of an invocation names only what helps (report/summary.py): a cancelled or preempted run is never an
error to fix, a run its walltime ended gets the walltime to ask for, each failed job's own line is on the terminal
whatever Snakemake printed before it, and a timed-out run that reached the quality target is counted."""

from __future__ import annotations

import os
import threading
import time

import pandas as pd

from ftbench.report import summary

CANCELLED_LINE = ("ftbench: run r2 was terminated (SIGTERM) at step 3 of 20 (cancelled or preempted: nothing to fix): no "
                  "result written; Snakemake submits it again if it has retries left (profiles/slurm: retries), else the "
                  "next invocation trains it again")
TIME_LIMIT_LINE = ("ftbench: run r3 reached its time limit (2 min) before its first training step: no row; give it more "
                   "time: --set-resources train:runtime=4 (after the targets)")


def write_log(root, path: str, *lines: str, mtime: float | None = None) -> None:
    target = root / path
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text("\n".join(["loading", *lines]) + "\n")
    if mtime is not None:
        os.utime(target, (mtime, mtime))


def test_a_cancelled_run_is_not_an_error_to_fix_and_its_line_is_shown(tmp_path, monkeypatch, capsys):
    """The issue: with --retries 0, a scancelled run ended the invocation with "some jobs failed on an error to fix
    ... (a rerun alone fails again)", though a rerun trained it fine."""
    monkeypatch.chdir(tmp_path)
    started = time.time() - 60
    write_log(tmp_path, "logs/train/r2.log", "progress: step 3 of 20 (15%), 10 tokens/s", CANCELLED_LINE, mtime=started + 30)
    summary.print_outcome(started, failed_jobs=True)
    told = capsys.readouterr().err
    assert "error to fix" not in told and "a rerun alone fails again" not in told
    assert f"  cancelled logs/train/r2.log: {CANCELLED_LINE[:summary.REASON_CHARS]}" in told
    assert "  -> cancelled (1): cancelled or preempted, nothing to fix: a rerun trains it again" in told
    assert told.rstrip("=\n").endswith("ftbench: some jobs failed, nothing to fix (listed above): rerun snakemake to retry them")


def test_a_run_its_walltime_ended_is_told_the_walltime_to_ask_for(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    started = time.time() - 60
    write_log(tmp_path, "logs/train/r3.log", TIME_LIMIT_LINE, mtime=started + 30)
    summary.print_outcome(started, failed_jobs=True)
    told = capsys.readouterr().err
    assert "  time limit logs/train/r3.log: ftbench: run r3 reached its time limit (2 min)" in told
    assert "--set-resources train:runtime=4" in told and "error to fix" not in told
    assert "rerun snakemake with the walltime their lines give to retry them" in told


def test_a_run_slurm_ended_after_keeping_its_row_is_told_what_trains_it_again(tmp_path, monkeypatch, capsys):
    """SLURM's limit ended the job (every retry too) after it kept a timeout row: a rerun keeps that row whatever
    walltime it gets, so the closing lines say to remove the row, with the walltime the job's line names."""
    monkeypatch.chdir(tmp_path)
    started = time.time() - 60
    line = ("ftbench: run r9 reached its time limit (1 min) before it stopped itself: give it more time: --set-resources "
            "train:runtime=7; its timeout row (3 steps, not evaluated) is kept in results/runs/r9/kept and a rerun keeps "
            "it instead of training (delete results/runs/r9/ to train the run again)")
    write_log(tmp_path, "logs/train/r9.log", line, mtime=started + 30)
    (tmp_path / "results" / "runs" / "r9" / "kept").mkdir(parents=True)
    summary.print_outcome(started, failed_jobs=True)
    told = capsys.readouterr().err
    assert "1 run kept a timeout row, which a rerun keeps whatever walltime it gets: remove the row" in told
    assert "       rm -r results/runs/r9/ && snakemake <your arguments> --set-resources train:runtime=7\n" in told
    assert "runtime=<" not in told and "1 runs" not in told
    assert told.rstrip("=\n").endswith("the runs that kept a timeout row train again only once it is removed (the "
                                        "commands above)")


def test_one_run_is_one_run():
    frame = pd.DataFrame([{"run_id": "a", "status": "ok", "status_reason": None}])
    assert summary.outcome_summary(frame, "t").startswith("ftbench: 1 run: 1 ok, ")
    assert summary.outcome_summary(pd.concat([frame, frame]), "t").startswith("ftbench: 2 runs: 2 ok, ")


def test_a_job_killed_without_a_word_and_a_named_error_each_get_their_own_advice(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    started = time.time() - 60
    write_log(tmp_path, "logs/train/r4.log", "progress: step 9 of 20 (45%), 10 tokens/s",
              "ftbench: FTBENCH_INJECT_FAULT (test-only): SIGKILL at step 9 (pid 1, rank 0)", mtime=started + 30)
    write_log(tmp_path, "logs/prepare_data/d.log", "ftbench: config key datasets.d.source: no such file", mtime=started + 30)
    write_log(tmp_path, "logs/prepare_data/fine.log", "prepared d", mtime=started + 30)  # a job that succeeded
    summary.print_outcome(started, failed_jobs=True)
    told = capsys.readouterr().err
    assert "  no line logs/train/r4.log: ftbench: FTBENCH_INJECT_FAULT" in told
    assert "  fix logs/prepare_data/d.log: ftbench: config key datasets.d.source: no such file" in told
    assert "fine.log" not in told
    assert "  -> no line (1): killed without a word" in told and "  -> fix (1): fix what its line names" in told
    assert "ftbench: some jobs failed on an error to fix (listed above)" in told


def test_a_line_written_after_snakemake_gave_up_on_the_job_still_reaches_the_terminal(tmp_path, monkeypatch):
    """Snakemake may report a cancelled job (and print its log) before the job has written its last line: the end
    of the invocation waits, briefly, for a failed train job's log that is still changing."""
    monkeypatch.chdir(tmp_path)
    started = time.time() - 60
    write_log(tmp_path, "logs/train/r2.log", "progress: step 3 of 20 (15%), 10 tokens/s")

    def finish_later():
        time.sleep(0.8)
        with open(tmp_path / "logs/train/r2.log", "a") as handle:
            handle.write(CANCELLED_LINE + "\n")

    writer = threading.Thread(target=finish_later)
    writer.start()
    jobs = summary.failed_jobs(started)
    writer.join()
    assert jobs == [(pathlib_path("logs/train/r2.log"), summary.CANCELLED, CANCELLED_LINE)]


def test_a_dead_jobs_log_is_not_waited_for_long(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    started = time.time() - 60
    write_log(tmp_path, "logs/train/r5.log", "progress: step 3 of 20 (15%), 10 tokens/s")
    began = time.monotonic()
    ((_, kind, _),) = summary.failed_jobs(started)
    assert kind == summary.KILLED and time.monotonic() - began < summary.SETTLE_S + 1.5


def pathlib_path(text):
    from pathlib import Path

    return Path(text)


def target_frame(rows):
    base = {"target_metric": "eval_accuracy", "target_value": 0.7, "status_reason": None}
    return pd.DataFrame([{**base, **row} for row in rows])


def test_a_lone_timeout_row_that_reached_the_target_is_counted():
    """The issue: a lone timeout row at 0.717 against a 0.70 target read "0 of 0 finished runs reached it"."""
    line = summary.target_summary(target_frame([{"run_id": "a", "status": "timeout", "target_reached": True}]))
    assert "0 of 0" not in line
    assert line == ("target eval_accuracy 0.7: no run finished; 1 of 1 timed-out runs reached it before their time limit "
                    "(not ranked in the report: cut short)\n")


def test_finished_runs_are_counted_as_before_and_timeouts_apart():
    line = summary.target_summary(target_frame([
        {"run_id": "a", "status": "ok", "target_reached": True},
        {"run_id": "b", "status": "ok", "target_reached": False},
        {"run_id": "c", "status": "timeout", "target_reached": False},
        {"run_id": "d", "status": "timeout", "target_reached": None},  # never evaluated: not counted
        {"run_id": "e", "status": "oom", "target_reached": None},
    ]))
    assert line == ("target eval_accuracy 0.7: 1 of 2 finished runs reached it; 0 of 1 timed-out runs reached it before "
                    "their time limit (not ranked in the report: cut short); never reached by b\n")


def test_a_timed_out_run_is_told_the_walltime_its_steps_need():
    """2 minutes, 10 of 1000 steps in 40 s of training, 30 s outside the loop: 1000 steps need 4000 s + 30 s,
    a quarter more for the margin: 84 minutes."""
    row = {"run_id": "slow", "status": "timeout", "status_reason": "stopped before the job's time limit (2 min) at step 10 of 1000",
           "last_step": 9, "total_steps": 1000, "train_time_s": 40.0, "wall_time_s": 70.0}
    assert summary.more_time(pd.Series(row)) == 84
    advice, command = summary.advice_lines(pd.DataFrame([row]))
    assert advice.startswith("  -> timeout (slow: runtime=84): retry with more time")
    # A rerun keeps the row whatever walltime it gets: what retrains it, with the number in the command. The walltime
    # may have been the user's or an administrator's: the cause blames no estimate.
    assert command == "       rm -r results/runs/slow/ && snakemake <your arguments> --set-resources train:runtime=84"
    assert "estimate" not in advice and "<minutes>" not in advice
    unknown = {**row, "train_time_s": None}
    assert summary.more_time(pd.Series(unknown)) == 4  # twice what it had
    assert summary.more_time(pd.Series({**row, "status_reason": "stopped before the job's time limit at step 10 of 1000"})) is None


def test_where_ftbench_could_not_say_slurms_own_log_tells_a_cancel_from_a_time_limit(tmp_path, monkeypatch, capsys):
    """A scancel, or the walltime, during the job's start (before the train process could answer SIGTERM): its log
    has no line of ftbench's, and SLURM's log of the job (what slurmstepd wrote) says which, with the walltime the
    job's Snakemake printed among its resources."""
    monkeypatch.chdir(tmp_path)
    started = time.time() - 60
    for run_id, job_id, end in (("r6", 31, "DUE TO TIME LIMIT "), ("r7", 32, ""), ("r8", 33, None)):
        write_log(tmp_path, f"logs/train/{run_id}.log", "Loading weights", mtime=started + 30)
        slurm = ["rule train:", "    resources: tmpdir=<TBD>, mem_mb=8017, runtime=3, slurm_partition=gpu"]
        if end is not None:
            slurm.append(f"slurmstepd-vm: error: *** JOB {job_id} ON vm CANCELLED AT 2026-11-29T03:34:07 {end}***")
        write_log(tmp_path, f".snakemake/slurm_logs/rule_train/{run_id}/{job_id}.log", *slurm, mtime=started + 31)
    summary.print_outcome(started, failed_jobs=True)
    told = capsys.readouterr().err
    assert ("  time limit logs/train/r6.log: SLURM: JOB 31 ON vm CANCELLED AT 2026-11-29T03:34:07 DUE TO TIME LIMIT "
            "(reached its time limit before it could write a row); give it more time: --set-resources train:runtime=6") in told
    assert "  cancelled logs/train/r7.log: SLURM: JOB 32 ON vm CANCELLED AT 2026-11-29T03:34:07" in told
    assert "  no line logs/train/r8.log: Loading weights" in told
    assert "error to fix" not in told
