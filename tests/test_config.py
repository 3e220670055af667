"""Schema and reference errors (scripts/ftbench/experiment/config.py): one line, naming the key path and what is allowed."""

from __future__ import annotations

import copy
import subprocess
import sys

import pytest
import yaml

from conftest import MINILM_SOURCE, ROOT, job_counts, snakemake_failure, tiny_dataset_def
from ftbench.tasks import registry
from ftbench.experiment import config as ftbench_config
from ftbench.data import prepared
from ftbench.errors import ConfigError


@pytest.fixture
def valid(tiny_config_factory):
    config = tiny_config_factory()
    config["models"]["minilm"] = {"source": dict(MINILM_SOURCE), "task": "classification"}
    ftbench_config.validate_config(config)  # the baseline every case below breaks in one place
    return config


def assert_one_line(message: str, key_path: str, *allowed: str) -> None:
    assert "\n" not in message and "\r" not in message, message
    assert message.startswith(f"config key {key_path}:"), message
    for fragment in allowed:
        assert fragment in message, f"{fragment!r} not in {message!r}"


def error_of(config: dict) -> str:
    with pytest.raises(ConfigError) as caught:
        ftbench_config.validate_config(config)
    return str(caught.value)


def set_in(config: dict, path: tuple, value) -> None:
    node = config
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value


# (case id, where to set, value, key path in the message, fragments saying what is allowed)
CASES = [
    # unknown keys, at every depth
    ("unknown-top-level", ("epochs",), 3, "epochs", ["unknown key", "allowed here:", "matrix", "defaults"]),
    ("unknown-defaults-key", ("defaults", "lora_rnk"), 4, "defaults.lora_rnk", ["unknown key", "lora_rank"]),
    ("unknown-matrix-axis", ("matrix", "lr"), [0.1], "matrix.lr", ["unknown key", "learning_rate"]),
    ("unknown-source-key", ("models", "tiny", "source", "pth"), "x", "models.tiny.source.pth", ["unknown key", "path"]),
    ("unknown-dataset-key", ("datasets", "tiny", "text_col"), "t", "datasets.tiny.text_col", ["unknown key", "text_column"]),
    ("unknown-data-key", ("data", "shard_mb"), 1, "data.shard_mb", ["unknown key", "shard_size_mb"]),
    ("unknown-override-key", ("overrides",), [{"when": {"method": "full"}, "set": {"lr": 0.1}}], "overrides[0].set.lr",
     ["unknown key", "learning_rate"]),
    ("unknown-include-key", ("include",), [{"model": "tiny", "dataset": "tiny", "rank": 4}], "include[0].rank", ["unknown key"]),
    # wrong types
    ("string-batch-size", ("defaults", "batch_size"), "32", "defaults.batch_size", ["expected integer", "'32'"]),
    ("float-rank", ("defaults", "lora_rank"), 2.5, "defaults.lora_rank", ["expected integer"]),
    ("bool-batch-size", ("defaults", "batch_size"), True, "defaults.batch_size", ["expected integer"]),
    ("axis-not-a-list", ("matrix", "method"), "lora", "matrix.method", ["expected array"]),
    ("wrong-type-in-axis", ("matrix", "batch_size"), [8, "x"], "matrix.batch_size[1]", ["expected integer"]),
    ("string-max-steps", ("defaults", "max_steps"), "many", "defaults.max_steps", ["null", "integer >= 1"]),
    ("bad-lora-targets", ("defaults", "lora_targets"), "all", "defaults.lora_targets", ["'all-linear'", "list"]),
    ("defaults-not-a-mapping", ("defaults",), [1], "defaults", ["expected object"]),
    # out of range
    ("lora-rank-0", ("matrix", "lora_rank"), [4, 0], "matrix.lora_rank[1]", ["out of range", ">= 1"]),
    ("batch-size-0", ("defaults", "batch_size"), 0, "defaults.batch_size", ["out of range", ">= 1"]),
    ("learning-rate-0", ("defaults", "learning_rate"), 0, "defaults.learning_rate", ["> 0"]),
    ("seq-len-4", ("matrix", "seq_len"), [4], "matrix.seq_len[0]", [">= 8"]),
    ("dropout-1", ("defaults", "lora_dropout"), 1.0, "defaults.lora_dropout", ["<= 0.9"]),
    ("repeats-0", ("repeats",), 0, "repeats", [">= 1"]),
    ("shard-size-0", ("data", "shard_size_mb"), 0, "data.shard_size_mb", ["> 0"]),
    ("max-steps-0-in-axis", ("matrix", "max_steps"), [0], "matrix.max_steps[0]", [">= 1"]),
    ("one-label", ("datasets", "tiny", "labels"), ["neg"], "datasets.tiny.labels", ["at least 2"]),
    # empty or repeated axes
    ("empty-axis", ("matrix", "method"), [], "matrix.method", ["must not be empty"]),
    ("empty-models", ("models",), {}, "models", ["must not be empty"]),
    ("repeated-axis-value", ("matrix", "lora_rank"), [4, 4], "matrix.lora_rank", ["unique"]),
    # names outside the allowed sets
    ("unknown-method", ("matrix", "method"), ["full", "lorra"], "matrix.method[1]", ["'lorra'", "'full', 'lora', 'qlora'"]),
    ("unknown-precision", ("defaults", "precision"), "fp8", "defaults.precision", ["expected one of", "'fp32'", "'fp16'", "'bf16'"]),
    ("unknown-optimizer", ("defaults", "optimizer"), "adam", "defaults.optimizer", ["expected one of", "'adamw'", "'sgd'"]),
    ("unknown-parallel", ("matrix", "parallel"), ["zero3"], "matrix.parallel[0]", ["expected one of", "'single'", "'dp'", "'ddp'"]),
    ("unknown-source-kind", ("models", "tiny", "source", "kind"), "s3", "models.tiny.source.kind", ["expected one of", "'hub'", "'path'", "'package'"]),
    # references the schema cannot check
    ("unknown-model-in-matrix", ("matrix", "model"), ["tiny", "bert"], "matrix.model[1]", ["'bert'", "defined models: minilm, tiny"]),
    ("unknown-dataset-in-matrix", ("matrix", "dataset"), ["imdb"], "matrix.dataset[0]", ["'imdb'", "defined datasets: tiny"]),
    ("unknown-model-in-include", ("include",), [{"model": "gpt", "dataset": "tiny"}], "include[0].model", ["defined models"]),
    ("unknown-model-in-defaults", ("defaults", "model"), "gpt", "defaults.model", ["defined models"]),
    ("missing-dataset-file", ("datasets", "tiny", "source", "path"), "/nonexistent/tiny.csv", "datasets.tiny.source.path",
     ["/nonexistent/tiny.csv", "does not exist"]),
    ("missing-model-folder", ("models", "tiny", "source", "path"), "/nonexistent/model", "models.tiny.source.path", ["does not exist"]),
    ("model-folder-without-config", ("models", "tiny", "source", "path"), "/", "models.tiny.source.path", ["config.json"]),
    ("missing-package", ("models", "tiny", "source"), {"kind": "package", "package": "no-such-package-ftbench"},
     "models.tiny.source.package", ["not installed"]),
    ("hub-source-without-name", ("models", "tiny", "source"), {"kind": "hub"}, "models.tiny.source.name", ["required"]),
    ("split-sizes-and-split-names", ("datasets", "tiny", "train_split"), "train", "datasets.tiny", ["either", "not both"]),
    ("minilm-seq-len-above-512", ("matrix",), {"model": ["minilm"], "dataset": ["tiny"], "seq_len": [128, 1024]},
     "matrix.seq_len[1]", ["1024", "'minilm'", "512"]),
    ("tiny-seq-len-in-defaults", ("defaults", "seq_len"), 256, "defaults.seq_len", ["256", "128"]),
    ("warmup-not-below-max-steps", ("defaults", "warmup_steps"), 6, "defaults.warmup_steps", ["warmup_steps < max_steps"]),
    ("warmup-axis-not-below-max-steps", ("matrix", "warmup_steps"), [2, 6], "matrix.warmup_steps[1]", ["max_steps 6"]),
    ("dp-with-one-gpu", ("matrix", "parallel"), ["single", "dp"], "defaults.num_gpus", ["'dp'", "num_gpus >= 2"]),
    ("everything-excluded", ("exclude",), [{"model": "tiny"}], "matrix", ["excluded"]),
    ("missing-matrix-model", ("matrix",), {"dataset": ["tiny"]}, "matrix", ["'model'", "required"]),
]


@pytest.mark.parametrize("where, value, key_path, allowed", [case[1:] for case in CASES], ids=[case[0] for case in CASES])
def test_invalid_config_gives_one_line_naming_the_key(valid, where, value, key_path, allowed):
    config = copy.deepcopy(valid)
    set_in(config, where, value)
    assert_one_line(error_of(config), key_path, *allowed)


def test_missing_required_section(valid):
    del valid["datasets"]
    message = error_of(valid)
    assert "\n" not in message and "datasets" in message and "required" in message


def test_config_that_is_not_a_mapping():
    with pytest.raises(ConfigError, match="mapping"):
        ftbench_config.validate_config(["models"])


def test_every_allowed_value_passes(valid):
    """The schema must not reject what the docs allow (guards against an over-strict schema)."""
    valid["matrix"].update(
        method=["full", "lora", "qlora"], precision=["fp32", "bf16", "fp16"], optimizer=["adamw", "sgd"],
        parallel=["single", "dp", "ddp"], lora_targets=["all-linear", ["query", "value"]], lora_alpha=[None, 8.0],
        max_steps=[None, 5],
    )
    valid["defaults"]["num_gpus"] = 2  # dp and ddp need two or more
    valid.update(repeats=2, exclude=[{"method": "full", "precision": "fp16"}],
                 include=[{"model": "minilm", "dataset": "tiny", "seq_len": 512}])
    ftbench_config.validate_config(valid)


# ---------------------------------------------------------------------------------------------------
# load_config: the file layer


def test_load_config_reports_unknown_key_in_file(tmp_path, valid):
    valid["defaults"]["warmup_step"] = 3
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(valid))
    with pytest.raises(ConfigError) as caught:
        ftbench_config.load_config(path)
    assert_one_line(str(caught.value), "defaults.warmup_step", "unknown key", "warmup_steps")


def test_load_config_reports_bad_yaml_on_one_line(tmp_path):
    path = tmp_path / "config.yaml"
    path.write_text("models:\n  tiny: [unclosed\n  other: 1\n")
    with pytest.raises(ConfigError) as caught:
        ftbench_config.load_config(path)
    message = str(caught.value)
    assert "\n" not in message and str(path) in message and "YAML" in message


def test_load_config_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        ftbench_config.load_config(tmp_path / "nope.yaml")


def test_shipped_default_config_is_valid():
    config = ftbench_config.load_config(ROOT / "config" / "config.yaml")
    assert config["matrix"]["model"] and config["matrix"]["dataset"]


# ---------------------------------------------------------------------------------------------------
# Errors only the data can reveal: raised when the dataset is read


def test_missing_label_column_names_the_key_and_the_columns(tiny_csv):
    dataset_def = tiny_dataset_def(tiny_csv, label_column="sentiment")
    with pytest.raises(ConfigError) as caught:
        prepared.load_raw_splits(dataset_def, "tiny")
    assert_one_line(str(caught.value), "datasets.tiny.label_column", "'sentiment'", "text", "label")


def test_missing_text_column_stops_prepare(tiny_csv, tmp_path):
    dataset_def = tiny_dataset_def(tiny_csv, text_column="review")
    with pytest.raises(ConfigError) as caught:
        registry.prepare("tiny", dataset_def, {"source": MINILM_SOURCE}, 32, tmp_path / "out")
    assert_one_line(str(caught.value), "datasets.tiny.text_column", "'review'")
    assert not (tmp_path / "out" / prepared.MANIFEST_NAME).exists()


def test_split_sizes_larger_than_the_data(tiny_csv):
    dataset_def = tiny_dataset_def(tiny_csv, train_size=180, eval_size=50)
    with pytest.raises(ConfigError) as caught:
        prepared.load_raw_splits(dataset_def, "tiny")
    assert_one_line(str(caught.value), "datasets.tiny.train_size", "230", "200")


# ---------------------------------------------------------------------------------------------------
# snakemake -n on a bad config: non-zero exit, the one line on stderr, no job


@pytest.mark.slow
def test_snakemake_dry_run_stops_on_bad_config(tmp_path, valid, config_writer, snakemake_runner):
    valid["matrix"]["method"] = ["full", "lorra"]
    config_writer(tmp_path, valid)
    process = snakemake_runner(tmp_path, "-n")
    assert process.returncode != 0, snakemake_failure(process)
    ours = [line for line in process.stderr.splitlines() if line.startswith("ftbench:")]
    assert ours == [
        "ftbench: config key matrix.method[1]: 'lorra' is not allowed; expected one of 'full', 'lora', 'qlora'"
    ], process.stderr
    assert "Traceback" not in process.stderr
    assert job_counts(process) == {}
    assert "rule " not in process.stdout + process.stderr
    assert not (tmp_path / "results").exists() and not (tmp_path / "logs").exists()


# ---------------------------------------------------------------------------------------------------
# The schema comes from RunSpec; config/schema.yaml is its readable copy


def test_config_schema_yaml_is_the_generated_schema():
    """config/schema.yaml is what `python -m ftbench schema` writes: regenerate it after editing
    ftbench/runspec.py or ftbench/experiment_schema.yaml."""
    assert (ROOT / "config" / "schema.yaml").read_text(encoding="utf-8") == ftbench_config.schema_yaml()


def test_every_run_setting_is_a_schema_key_and_an_axis():
    from ftbench import runspec

    schema = ftbench_config.load_schema()
    names = [f.name for f in runspec.settings_fields()]
    assert list(schema["$defs"]["run_settings"]["properties"]) == names
    assert list(schema["properties"]["matrix"]["properties"]) == names
    assert set(runspec.RUN_DEFAULTS) == set(names) - {"model", "dataset"}


def test_validating_a_config_imports_no_torch():
    """Parsing an experiment (snakemake -n) must not pay for importing torch."""
    code = ("import sys, yaml; from ftbench.experiment import config, matrix; "
            "c = yaml.safe_load(open(sys.argv[1])); config.validate_config(c); matrix.expand_runs(c); "
            "print(sorted(m for m in ('torch', 'transformers', 'peft') if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", code, str(ROOT / "config" / "config.yaml")],
                            capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"


def test_every_example_config_validates_with_torch_blocked():
    """The task-family registry is torch-free at import: every example config, multimodal included, validates
    (schema, references, each run's family rules, resource estimates) in a process where torch cannot load."""
    code = ("import sys, glob; sys.modules['torch'] = None\n"
            "from ftbench.experiment import config, matrix\n"
            "from ftbench.cluster import resources\n"
            "for path in sorted(glob.glob(sys.argv[1] + '/*.yaml')):\n"
            "    c = config.load_config(path)\n"
            "    for run in matrix.expand_runs(c): resources.train_compute_seconds(run)\n"
            "print('ok')")
    result = subprocess.run([sys.executable, "-c", code, str(ROOT / "config" / "examples")],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().endswith("ok")


def test_the_registry_names_every_family_and_refuses_an_unknown_one():
    assert registry.NAMES == ("classification", "causal_lm", "instruction", "seq2seq", "image_classification",
                              "image_text_retrieval", "vision_language")
    assert registry.IMAGE_FAMILIES == ("image_classification", "image_text_retrieval", "vision_language")
    assert registry.model_family({}).name == "classification"
    assert [registry.family(name).packable for name in registry.NAMES] == [False, True, True, False, False, False, False]
    with pytest.raises(ConfigError, match="not a task family"):
        registry.family("regression")
