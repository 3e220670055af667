"""DAG tests: snakemake dry-run job counts, nothing to do on a second run, an edited run re-runs alone.

The real run is the session fixture ``snakemake_run`` (shared with test_e2e.py); tests that change the
config work on a copy of its folder.
"""

from __future__ import annotations

import copy

import pandas as pd
import pytest

from conftest import copy_workflow, job_counts, snakemake_failure, train_run_ids, write_config
from ftbench.experiment import matrix

pytestmark = pytest.mark.slow


def dry_run(snakemake_runner, workdir, config=None):
    if config is not None:
        write_config(workdir, config)
    process = snakemake_runner(workdir, "-n")
    assert process.returncode == 0, snakemake_failure(process)
    return process


def expected_ids(config: dict) -> set[str]:
    return {run.run_id for run in matrix.expand_runs(config)}


def test_dry_run_job_counts_for_a_small_matrix(tmp_path, tiny_config_factory, snakemake_runner):
    # 3 methods x 2 ranks: full is not multiplied by rank -> 1 + 2 + 2 train jobs, one shared preparation
    config = tiny_config_factory(
        matrix={"model": ["tiny"], "dataset": ["tiny"], "method": ["full", "lora", "qlora"], "lora_rank": [4, 8]}
    )
    process = dry_run(snakemake_runner, tmp_path, config)
    assert job_counts(process) == {"prepare_data": 1, "train": 5, "collect": 1, "report": 1, "all": 1}
    assert train_run_ids(process) == expected_ids(config)
    assert not (tmp_path / "results").exists()  # a dry run writes no results


def test_dry_run_one_preparation_per_seq_len(tmp_path, tiny_config_factory, snakemake_runner):
    config = tiny_config_factory(
        matrix={"model": ["tiny"], "dataset": ["tiny"], "method": ["lora"], "lora_rank": [4, 8], "seq_len": [16, 32]}
    )
    process = dry_run(snakemake_runner, tmp_path, config)
    counts = job_counts(process)
    assert counts["train"] == 4
    assert counts["prepare_data"] == 2


def test_dry_run_with_repeats(tmp_path, tiny_config_factory, snakemake_runner):
    config = tiny_config_factory(repeats=3)  # methods full, lora
    process = dry_run(snakemake_runner, tmp_path, config)
    assert job_counts(process)["train"] == 6
    assert job_counts(process)["prepare_data"] == 1


def test_second_run_has_nothing_to_do(snakemake_run, snakemake_runner):
    workdir, _, _ = snakemake_run
    process = dry_run(snakemake_runner, workdir)
    assert job_counts(process) == {}, process.stdout
    assert "Nothing to be done" in process.stdout + process.stderr


def test_editing_one_run_reruns_only_that_run(snakemake_run, snakemake_runner, tmp_path):
    """Change one run's setting (an override that matches only the LoRA run): it alone trains again."""
    source, config, _ = snakemake_run
    workdir = copy_workflow(source, tmp_path / "edited")
    before = {run.method: run.run_id for run in matrix.expand_runs(config)}

    edited = copy.deepcopy(config)
    edited["overrides"].append({"when": {"method": "lora"}, "set": {"learning_rate": 0.002}})
    after = {run.method: run.run_id for run in matrix.expand_runs(edited)}
    assert after["full"] == before["full"] and after["qlora"] == before["qlora"]
    assert after["lora"] != before["lora"]

    process = dry_run(snakemake_runner, workdir, edited)
    assert job_counts(process) == {"train": 1, "collect": 1, "report": 1, "all": 1}
    assert train_run_ids(process) == {after["lora"]}


def test_adding_an_include_entry_runs_it_alone_for_real(snakemake_run, snakemake_runner, tmp_path):
    source, config, _ = snakemake_run
    workdir = copy_workflow(source, tmp_path / "included")
    old_ids = expected_ids(config)
    kept = {run_id: (workdir / "results" / "runs" / run_id / "metrics.json") for run_id in old_ids}
    stamps = {run_id: (path.stat().st_mtime_ns, path.read_bytes()) for run_id, path in kept.items()}
    data_folders = sorted(p.name for p in (workdir / "results" / "data").iterdir())

    edited = copy.deepcopy(config)
    edited["include"] = [{"model": "tiny", "dataset": "tiny", "method": "lora", "lora_rank": 8}]
    new_ids = expected_ids(edited) - old_ids
    assert len(new_ids) == 1

    process = dry_run(snakemake_runner, workdir, edited)
    assert job_counts(process) == {"train": 1, "collect": 1, "report": 1, "all": 1}
    assert train_run_ids(process) == new_ids

    process = snakemake_runner(workdir)
    assert process.returncode == 0, snakemake_failure(process)
    for run_id, path in kept.items():  # the other runs' results were not touched
        assert (path.stat().st_mtime_ns, path.read_bytes()) == stamps[run_id], run_id
    assert sorted(p.name for p in (workdir / "results" / "data").iterdir()) == data_folders  # data reused
    table = pd.read_parquet(workdir / "results" / "metrics.parquet")
    assert set(table["run_id"]) == old_ids | new_ids
    assert (table["status"] == "ok").all()
    assert job_counts(dry_run(snakemake_runner, workdir)) == {}


def test_adding_an_axis_value_keeps_existing_runs(snakemake_run, snakemake_runner, tmp_path):
    """lora_rank [4] is the default; making it an axis [4, 8] adds the r8 runs and keeps the r4 ones."""
    source, config, _ = snakemake_run
    workdir = copy_workflow(source, tmp_path / "axis")
    edited = copy.deepcopy(config)
    edited["matrix"]["lora_rank"] = [4, 8]
    new_ids = expected_ids(edited) - expected_ids(config)
    assert len(new_ids) == 2  # lora r8 and qlora r8; full is not multiplied

    process = dry_run(snakemake_runner, workdir, edited)
    assert job_counts(process) == {"train": 2, "collect": 1, "report": 1, "all": 1}
    assert train_run_ids(process) == new_ids


def test_removing_a_run_retrains_nothing(snakemake_run, snakemake_runner, tmp_path):
    source, config, _ = snakemake_run
    workdir = copy_workflow(source, tmp_path / "removed")
    edited = copy.deepcopy(config)
    edited["exclude"] = [{"method": "qlora"}]
    process = dry_run(snakemake_runner, workdir, edited)
    assert job_counts(process) == {"collect": 1, "report": 1, "all": 1}


def test_changing_the_dataset_prepares_again_and_retrains_its_runs(snakemake_run, snakemake_runner, tmp_path):
    source, config, _ = snakemake_run
    workdir = copy_workflow(source, tmp_path / "dataset")
    edited = copy.deepcopy(config)
    edited["datasets"]["tiny"]["split_seed"] = 1
    process = dry_run(snakemake_runner, workdir, edited)
    assert job_counts(process) == {"prepare_data": 1, "train": 3, "collect": 1, "report": 1, "all": 1}


def test_dry_run_of_the_shipped_default_experiment(tmp_path, snakemake_runner):
    """The default experiment's DAG: one preparation shared by every run, then collect and report."""
    from conftest import ROOT
    from ftbench.experiment import config as ftbench_config

    configfile = tmp_path / "config.yaml"
    configfile.write_text((ROOT / "config" / "config.yaml").read_text())
    runs = matrix.expand_runs(ftbench_config.load_config(configfile))
    process = dry_run(snakemake_runner, tmp_path)
    assert job_counts(process) == {"prepare_data": 1, "train": len(runs), "collect": 1, "report": 1, "all": 1}
    assert train_run_ids(process) == {run.run_id for run in runs}
