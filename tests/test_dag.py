"""DAG tests: snakemake dry-run job counts, nothing to do on a second run, an edited run re-runs alone.

The real run is the session fixture ``snakemake_run`` (shared with test_e2e.py); tests that change the
config work on a copy of its folder.
"""

from __future__ import annotations

import copy
import json
import re

import pandas as pd
import pytest

from conftest import copy_workflow, job_counts, snakemake_failure, train_run_ids, write_config
from ftbench.experiment import base_evaluation, matrix

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
    """The default experiment's DAG: one preparation shared by every run, one evaluation before training for the
    fp32 base model (full fine-tuning and both LoRA runs start from it) and one for QLoRA's 4-bit base, then
    collect and report."""
    from conftest import ROOT
    from ftbench.experiment import config as ftbench_config

    configfile = tmp_path / "config.yaml"
    configfile.write_text((ROOT / "config" / "config.yaml").read_text())
    runs = matrix.expand_runs(ftbench_config.load_config(configfile))
    process = dry_run(snakemake_runner, tmp_path)
    assert job_counts(process) == {"prepare_data": 1, "base_eval": 2, "train": len(runs), "collect": 1, "report": 1, "all": 1}
    assert train_run_ids(process) == {run.run_id for run in runs}
    assert len(base_evaluation.shared_evaluations(runs)) == 2 and {run.method for run in runs} == {"full", "lora", "qlora"}


def test_a_second_experiment_from_the_same_weights_reuses_the_shared_evaluation(tmp_path, tiny_config_factory,
                                                                               snakemake_runner):
    """The evaluation before training is a step of its own, shared across experiments of the folder: a second
    experiment whose run starts from the first's weights (another LoRA rank and learning rate) trains its run and
    scores no base model again; its row carries the shared figures, as the first's runs do."""
    defaults = {**tiny_config_factory()["defaults"], "eval_before_training": True}
    first = tiny_config_factory(defaults=defaults)  # full and lora
    second = tiny_config_factory(defaults={**defaults, "lora_rank": 8, "learning_rate": 0.002},
                                 matrix={"model": ["tiny"], "dataset": ["tiny"], "method": ["lora"]})
    first_file, second_file = write_config(tmp_path, first, "first.yaml"), write_config(tmp_path, second, "second.yaml")
    process = snakemake_runner(tmp_path, configfile=first_file)
    assert process.returncode == 0, snakemake_failure(process)
    assert job_counts(process)["base_eval"] == 1  # full and LoRA: one base model
    planned = snakemake_runner(tmp_path, "-n", configfile=second_file)
    assert planned.returncode == 0, snakemake_failure(planned)
    assert job_counts(planned) == {"train": 1, "collect": 1, "report": 1, "all": 1}  # no base_eval, no prepare_data
    process = snakemake_runner(tmp_path, configfile=second_file)
    assert process.returncode == 0, snakemake_failure(process)
    (shared,) = (tmp_path / "results" / "base_eval").glob("*.json")
    figures = json.loads(shared.read_text())["figures"]
    rows = [json.loads(path.read_text())["metrics"] for path in (tmp_path / "results" / "runs").glob("*/metrics.json")]
    assert len(rows) == 3 and {row["base_eval_accuracy"] for row in rows} == {figures["eval_accuracy"]}


def test_two_experiments_sharing_data_in_one_folder_rerun_nothing(tmp_path, tiny_config_factory, tiny_model_dir,
                                                                   snakemake_runner):
    """Two experiment files in one folder on one dataset, tokenizer and seq_len, naming different models (the
    second a config-built BERT on the first's tokenizer): the second prepares nothing and retrains none of the
    first's runs, and the first again trains nothing (collect and report make the folder's table the first's
    again). A third naming a model whose vocab_size its tokenizer contradicts is refused before anything runs,
    in one line naming the key, and the shared data stays as it was."""
    tokenizer = {"kind": "path", "path": str(tiny_model_dir)}
    shape = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2, "intermediate_size": 128,
             "max_position_embeddings": 128}

    def config_model(**overrides):
        return {"source": {"kind": "config", "architecture": "BertConfig", "tokenizer": tokenizer,
                           "overrides": {**shape, **overrides}}, "task": "classification"}

    first = tiny_config_factory()
    second = tiny_config_factory(models={"wide": config_model()},
                                 matrix={"model": ["wide"], "dataset": ["tiny"], "method": ["lora", "full"]})
    third = tiny_config_factory(models={"wide": config_model(), "bad_vocab": config_model(vocab_size=7)},
                                matrix={"model": ["wide", "bad_vocab"], "dataset": ["tiny"], "method": ["lora"]})
    first_file, second_file = write_config(tmp_path, first, "first.yaml"), write_config(tmp_path, second, "second.yaml")
    third_file = write_config(tmp_path, third, "third.yaml")
    data_ids = {run.data_id for run in matrix.expand_runs(first) + matrix.expand_runs(second) + matrix.expand_runs(third)}
    assert len(data_ids) == 1

    def run(configfile, *args):
        process = snakemake_runner(tmp_path, *args, configfile=configfile)
        assert process.returncode == 0, snakemake_failure(process)
        return process

    run(first_file)
    data = tmp_path / "results" / "data" / data_ids.pop()
    stamps = {path: path.stat().st_mtime_ns for path in [data, *data.iterdir()]}
    trained = {path: path.stat().st_mtime_ns for path in (tmp_path / "results" / "runs").glob("*/metrics.json")}
    assert len(trained) == 2

    assert job_counts(run(second_file, "-n")) == {"train": 2, "collect": 1, "report": 1, "all": 1}
    run(second_file)
    assert {path: path.stat().st_mtime_ns for path in [data, *data.iterdir()]} == stamps  # not prepared again
    table = pd.read_parquet(tmp_path / "results" / "metrics.parquet")
    assert set(table["model"]) == {"wide"} and (table["status"] == "ok").all(), table["status_reason"].tolist()

    # A model whose vocabulary contradicts its tokenizer: refused at parse time, never by failing the shared data.
    refused = snakemake_runner(tmp_path, configfile=third_file)
    assert refused.returncode != 0
    assert "ftbench: config key models.bad_vocab.source.overrides.vocab_size: 7" in refused.stderr + refused.stdout
    assert {path: path.stat().st_mtime_ns for path in [data, *data.iterdir()]} == stamps

    assert job_counts(run(first_file, "-n")) == {"collect": 1, "report": 1, "all": 1}  # no prepare_data, no train
    run(first_file)
    assert {path: path.stat().st_mtime_ns for path in trained} == trained  # the first's runs were never retrained
    assert {path: path.stat().st_mtime_ns for path in [data, *data.iterdir()]} == stamps
    process = run(first_file, "-n")
    assert job_counts(process) == {} and "Nothing to be done" in process.stdout + process.stderr


def test_the_printed_runtime_is_the_time_limit_the_job_gets(tmp_path, tiny_config_factory, snakemake_runner, monkeypatch):
    """One time limit per job: the runtime `snakemake -n` shows (what sbatch -t gets) is the --time-limit-s of
    the job's command, and it is the same whether the speed was decided here or handed down to a job's own
    Snakemake (FTBENCH_TRAIN_SPEED, set by the planning Snakemake), with or without a GPU where it runs."""
    from ftbench.cluster import resources

    defaults = {**tiny_config_factory()["defaults"], "max_steps": 200_000}  # long enough to leave the floor on a CPU
    config = tiny_config_factory(defaults=defaults, matrix={"model": ["tiny"], "dataset": ["tiny"], "num_gpus": [0, 1]})
    write_config(tmp_path, config)
    runs = {run.run_id: run for run in matrix.expand_runs(config)}
    limits = {}
    for speed in ("gpu", "cpu"):
        monkeypatch.setenv(resources.TRAIN_SPEED_ENV, speed)
        process = snakemake_runner(tmp_path, "-n", "-p")
        assert process.returncode == 0, snakemake_failure(process)
        for block in (process.stdout + process.stderr).split("rule train:")[1:]:
            run_id = re.search(r"wildcards: run_id=(\S+)", block).group(1)
            runtime = int(re.search(r"resources: .*\bruntime=(\d+)", block).group(1))
            assert re.search(rf"--time-limit-s \$\(\( {runtime} \* 60 \)\)", block), block
            assert runtime == resources.train_runtime_minutes(runs[run_id], environ={resources.TRAIN_SPEED_ENV: speed})
            limits[speed, runs[run_id].num_gpus] = runtime
    assert len(limits) == 4
    assert limits["gpu", 1] < limits["cpu", 1] == limits["cpu", 0] == limits["gpu", 0]
