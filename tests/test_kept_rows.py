"""A run's row kept where Snakemake does not delete it (cluster/kept_rows.py), and the train job's use of it
(train/job.py): a job that the scheduler ended after writing its row, or at its time limit, leaves a `timeout` row
that the next job of the run keeps instead of training, not nothing."""

from __future__ import annotations

import json
import os
import signal
import time

import pytest

from ftbench import errors
from ftbench.cluster import job_clock, kept_rows
from ftbench.experiment import matrix
from ftbench.train import job, trainer

CPU = {"device": "cpu", "num_gpus": 0, "max_steps": 50, "warmup_steps": 1}


@pytest.fixture
def spec(tiny_config_factory):
    config = tiny_config_factory(defaults={**tiny_config_factory()["defaults"], **CPU},
                                 matrix={"model": ["tiny"], "dataset": ["tiny"], "method": ["lora"]})
    (run,) = matrix.expand_runs(config)
    return run


@pytest.fixture
def keep_sigterm():
    previous = signal.getsignal(signal.SIGTERM)
    yield
    signal.signal(signal.SIGTERM, previous)


def write_kept(out, spec_dict, status="timeout"):
    folder = kept_rows.kept_dir(out)
    folder.mkdir(parents=True)
    (folder / "steps.parquet").write_bytes(b"steps")
    (folder / "evals.parquet").write_bytes(b"evals")
    (folder / "metrics.json").write_text(json.dumps({"spec": spec_dict, "metrics": {"status": status}}))


def test_a_kept_row_is_published_where_the_outputs_were_deleted(tmp_path, spec):
    out = tmp_path / "runs" / spec.run_id / "metrics.json"
    write_kept(out, spec.to_dict())
    result = kept_rows.adopt(out, spec.to_dict())
    assert result["metrics"] == {"status": "timeout"}
    assert out.with_name("steps.parquet").read_bytes() == b"steps" and out.with_name("evals.parquet").read_bytes() == b"evals"
    assert json.loads(out.read_text())["metrics"]["status"] == "timeout"
    assert kept_rows.adopt(out, spec.to_dict()) is None  # the outputs are there now: nothing to adopt


def test_a_kept_row_of_other_settings_or_incomplete_is_not_adopted(tmp_path, spec):
    out = tmp_path / "runs" / spec.run_id / "metrics.json"
    write_kept(out, {**spec.to_dict(), "learning_rate": 0.5})
    assert kept_rows.adopt(out, spec.to_dict()) is None
    assert not kept_rows.kept_dir(out).exists() and not out.exists()  # dropped: the run trains
    write_kept(out, spec.to_dict())
    (kept_rows.kept_dir(out) / "evals.parquet").unlink()
    assert kept_rows.adopt(out, spec.to_dict()) is None and not out.exists()


def test_a_kept_row_older_than_its_data_is_not_adopted(tmp_path, spec):
    """Its data was prepared again since (a new manifest): the row measured the old data, so the run trains."""
    out = tmp_path / "runs" / spec.run_id / "metrics.json"
    manifest = tmp_path / "data" / "manifest.json"
    manifest.parent.mkdir()
    manifest.write_text("{}")
    write_kept(out, spec.to_dict())
    assert kept_rows.adopt(out, spec.to_dict(), inputs=[manifest]) is not None  # kept after the data: adopted
    out.unlink()
    write_kept_again = kept_rows.kept_dir(out) / "metrics.json"
    os.utime(write_kept_again, (manifest.stat().st_mtime - 60,) * 2)
    assert kept_rows.adopt(out, spec.to_dict(), inputs=[manifest]) is None and not kept_rows.kept_dir(out).exists()


def test_rows_whose_outputs_are_there_are_forgotten_when_the_next_invocation_starts(tmp_path, spec):
    published, lost = tmp_path / "a" / "metrics.json", tmp_path / "b" / "metrics.json"
    for out in (published, lost):
        write_kept(out, spec.to_dict())
    published.write_text("{}")
    assert kept_rows.forget_published([published, lost, tmp_path / "c" / "metrics.json"]) == 1
    assert not kept_rows.kept_dir(published).exists() and kept_rows.kept_dir(lost).is_dir()


def test_the_job_keeps_a_kept_row_instead_of_training(tmp_path, spec, monkeypatch, capfd, keep_sigterm):
    out = tmp_path / "runs" / spec.run_id / "metrics.json"
    write_kept(out, json.loads(spec.to_json()))
    monkeypatch.setattr(trainer, "train_run", lambda *a, **k: pytest.fail("a kept row is not trained again"))
    metrics = job.run_job(spec, str(tmp_path / "no-data"), out=out, time_limit_s=600)
    assert metrics == {"status": "timeout"} and out.is_file()
    assert f"ftbench: run {spec.run_id}: kept the row (status timeout)" in capfd.readouterr().out


def test_a_job_written_row_goes_to_kept_first_then_to_the_outputs(tmp_path, spec, monkeypatch, keep_sigterm):
    out = tmp_path / "runs" / spec.run_id / "metrics.json"
    order = []
    publish = kept_rows.publish
    monkeypatch.setattr(kept_rows, "publish", lambda target: (order.append(kept_rows.kept_dir(target).is_dir()), publish(target)))
    monkeypatch.setattr(trainer, "train_run", lambda *a, **k: ({"run_id": spec.run_id, "status": "ok"}, []))
    job.run_job(spec, str(tmp_path), out=out, time_limit_s=600)
    assert order == [True]
    assert json.loads(out.read_text()) == json.loads((kept_rows.kept_dir(out) / "metrics.json").read_text())


def test_a_run_the_time_limit_ends_keeps_a_timeout_row_for_the_next_job(tmp_path, spec, monkeypatch, keep_sigterm, capfd):
    """SLURM's limit (a SIGTERM at it) ends the job mid-run: no outputs (Snakemake deletes a failed job's), but a
    `timeout` row of its steps in kept/, a line naming the walltime to ask for, and the next job keeps that row,
    saying the first job's line again (Snakemake's retry writes the run's log anew)."""
    out = tmp_path / "runs" / spec.run_id / "metrics.json"
    monkeypatch.setenv("SLURM_JOB_START_TIME", repr(time.time() - 118))  # 2 minutes, 2 s left
    monkeypatch.setenv("SLURM_JOB_ID", "7")
    monkeypatch.setenv(job_clock.SCHEDULED_ENV, "1")  # a job the workflow's SLURM executor submitted
    monkeypatch.setattr(job_clock, "_scontrol_fields", lambda *a: {})  # no scontrol here: the time says it

    def stopped_by_the_limit(run_spec, data_dir, stop):
        stop.terminate()
        steps = [{"step": i, "measured": i > 0, "tokens": 100, "samples": 8, "step_time_s": 0.1} for i in range(3)]
        return {"run_id": run_spec.run_id, "status": "timeout", "total_steps": 50, "last_step": 2,
                "status_reason": "terminated (SIGTERM) at step 3 of 50"}, steps

    monkeypatch.setattr(trainer, "train_run", stopped_by_the_limit)
    with pytest.raises(errors.TerminatedError) as ended:
        job.run_job(spec, str(tmp_path), out=out, time_limit_s=120)
    line = str(ended.value)
    assert f"run {spec.run_id} reached its time limit (2 min) before it stopped itself" in line
    assert "before it stopped itself: give it more time: --set-resources train:runtime=4;" in line
    assert "(3 steps, not evaluated)" in line
    assert not out.exists()
    kept = json.loads((kept_rows.kept_dir(out) / "metrics.json").read_text())["metrics"]
    assert kept["status"] == "timeout" and kept["status_reason"].startswith("the scheduler's time limit (2 min) ended its job after 3 of 50 steps")

    monkeypatch.setattr(trainer, "train_run", lambda *a, **k: pytest.fail("the kept row is kept, not trained again"))
    capfd.readouterr()
    assert job.run_job(spec, str(tmp_path), out=out, time_limit_s=240)["status"] == "timeout"
    assert out.is_file()
    retry_log = capfd.readouterr().out
    assert f"ftbench: an earlier job of this run ended: {line}\n" in retry_log
    assert retry_log.index("an earlier job of this run ended") < retry_log.index(f"run {spec.run_id}: kept the row")


def test_a_cancelled_run_is_not_an_error_and_keeps_nothing(tmp_path, spec, monkeypatch, keep_sigterm):
    out = tmp_path / "runs" / spec.run_id / "metrics.json"
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)

    def cancelled(run_spec, data_dir, stop):
        stop.terminate()
        return {"run_id": run_spec.run_id, "status": "timeout", "last_step": 2,
                "status_reason": "terminated (SIGTERM) at step 3 of 50"}, [{"step": 0}]

    monkeypatch.setattr(trainer, "train_run", cancelled)
    with pytest.raises(errors.TerminatedError, match=r"was terminated \(SIGTERM\) at step 3 of 50 \(cancelled or preempted: "
                                                     r"nothing to fix\): no result written"):
        job.run_job(spec, str(tmp_path), out=out, time_limit_s=600)
    assert not out.exists() and not kept_rows.kept_dir(out).exists()
