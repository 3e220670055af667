"""Load and validate an experiment configuration.

Validation happens when Snakemake parses the workflow, before any job starts. Every problem is
reported as one line that names the key path (``matrix.method[1]``) and what is allowed there.
The JSON Schema in ``config/schema.yaml`` checks shape and types; ``check_references`` checks what a
schema cannot (names that must exist, sources that must be on disk).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable

import jsonschema
import yaml

from .errors import ConfigError

SCHEMA_PATH = Path(__file__).resolve().parents[2] / "config" / "schema.yaml"


def load_schema(path: Path = SCHEMA_PATH) -> dict:
    with open(path, encoding="utf-8") as handle:
        return yaml.safe_load(handle)


def load_config(path: str | Path) -> dict:
    """Read a YAML experiment file and validate it; raise ConfigError with one line on any problem."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {path}: not found")
    try:
        with open(path, encoding="utf-8") as handle:
            config = yaml.safe_load(handle)
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file {path}: not valid YAML ({' '.join(str(exc).split())})") from None
    validate_config(config)
    return config


def validate_config(config: Any, schema: dict | None = None) -> None:
    """Schema check plus cross-references. Raises ConfigError naming the first offending key."""
    if not isinstance(config, dict):
        raise ConfigError("config: expected a mapping at the top level (models, datasets, matrix, ...)")
    schema = schema or load_schema()
    validator = jsonschema.Draft202012Validator(schema)
    errors = list(validator.iter_errors(config))
    if errors:
        raise ConfigError(describe_schema_error(_most_specific(errors), schema))
    check_references(config)


def key_path(parts: Iterable[Any]) -> str:
    """Render a jsonschema path as ``matrix.method[1]``."""
    text = ""
    for part in parts:
        if isinstance(part, int):
            text += f"[{part}]"
        else:
            text += f".{part}" if text else str(part)
    return text or "(top level)"


def _most_specific(errors: list[jsonschema.ValidationError]) -> jsonschema.ValidationError:
    # best_match prefers the error deepest in the document, descending into oneOf branches, which is
    # the one that names the key the user actually got wrong.
    return jsonschema.exceptions.best_match(errors)


def describe_schema_error(error: jsonschema.ValidationError, schema: dict) -> str:
    path = key_path(error.absolute_path)
    kind = error.validator
    if kind == "additionalProperties":
        allowed = sorted(error.schema.get("properties", {}))
        unknown = sorted(set(error.instance) - set(allowed))
        where = f"{path}." if error.absolute_path else ""
        names = ", ".join(f"{where}{name}" for name in unknown)
        if allowed:
            return f"config key {names}: unknown key; allowed here: {', '.join(allowed)}"
        return f"config key {names}: unknown key"
    if kind == "enum":
        allowed = ", ".join(repr(value) for value in error.validator_value)
        return f"config key {path}: {error.instance!r} is not allowed; expected one of {allowed}"
    if kind == "const":
        return f"config key {path}: expected {error.validator_value!r}, got {error.instance!r}"
    if kind == "type":
        expected = error.validator_value
        expected = " or ".join(expected) if isinstance(expected, list) else expected
        return f"config key {path}: expected {expected}, got {type(error.instance).__name__} {error.instance!r}"
    if kind in ("minItems", "minProperties"):
        if error.validator_value > 1:
            return f"config key {path}: needs at least {error.validator_value} entries, got {len(error.instance)}"
        return f"config key {path}: must not be empty"
    if kind == "required":
        return f"config key {path}: {error.message}"
    if kind in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"):
        bound = {"minimum": ">=", "maximum": "<=", "exclusiveMinimum": ">", "exclusiveMaximum": "<"}[kind]
        return f"config key {path}: {error.instance!r} is out of range; expected a value {bound} {error.validator_value}"
    if kind == "uniqueItems":
        return f"config key {path}: values must be unique"
    if kind == "pattern":
        return f"config key {path}: {error.instance!r} must match {error.validator_value}"
    if kind == "propertyNames":
        return f"config key {path}: name {error.instance!r} must be letters, digits, '_' or '.'"
    if kind == "oneOf":
        allowed = " or ".join(describe_allowed(option) for option in error.validator_value)
        return f"config key {path}: {error.instance!r} is not allowed; expected {allowed}"
    return f"config key {path}: {' '.join(error.message.split())}"


def describe_allowed(schema: dict) -> str:
    """A short phrase for what one (sub)schema accepts, e.g. ``null`` or ``integer >= 1``."""
    if "const" in schema:
        return repr(schema["const"])
    if "enum" in schema:
        return "one of " + ", ".join(repr(value) for value in schema["enum"])
    kind = schema.get("type", "value")
    text = " or ".join(kind) if isinstance(kind, list) else kind
    if kind == "array":
        text = "a non-empty list" if schema.get("minItems", 0) >= 1 else "a list"
        item_type = schema.get("items", {}).get("type")
        if item_type:
            text += f" of {item_type}s"
    for key, symbol in (("minimum", ">="), ("exclusiveMinimum", ">"), ("maximum", "<="), ("exclusiveMaximum", "<")):
        if key in schema:
            text += f" {symbol} {schema[key]}"
    return text


def check_references(config: dict) -> None:
    """What the schema cannot say: named models/datasets exist, sources exist, seq_len fits the model."""
    # Imported here: sources pulls in nothing heavy, but matrix imports this module.
    from . import matrix, sources

    models = config["models"]
    datasets = config["datasets"]
    for where, settings in _settings_blocks(config):
        for key, name in _indexed(settings.get("model"), f"{where}.model"):
            if name not in models:
                raise ConfigError(
                    f"config key {key}: unknown model {name!r}; defined models: {', '.join(sorted(models))}"
                )
        for key, name in _indexed(settings.get("dataset"), f"{where}.dataset"):
            if name not in datasets:
                raise ConfigError(
                    f"config key {key}: unknown dataset {name!r}; defined datasets: {', '.join(sorted(datasets))}"
                )
    for name, model in models.items():
        sources.check_source(model["source"], f"models.{name}.source", role="model")
    for name, dataset in datasets.items():
        sources.check_source(dataset["source"], f"datasets.{name}.source", role="dataset")
        if "train_split" in dataset and "train_size" in dataset:
            raise ConfigError(
                f"config key datasets.{name}: give either train_split/eval_split (splits the source has) "
                "or train_size/eval_size (a seeded split made here), not both"
            )

    runs = matrix.expand_runs(config)
    if not runs:
        raise ConfigError("config key matrix: every combination was excluded; no run is left to measure")
    check_dataset_columns(config, runs)
    for run in runs:
        check_run(run, config)
        limit = sources.model_max_seq_len(models[run["model"]])
        if limit is not None and run["seq_len"] > limit:
            raise ConfigError(
                f"config key {_setting_key(config, 'seq_len', run['seq_len'])}: {run['seq_len']} exceeds model "
                f"{run['model']!r} maximum of {limit} positions; expected a value <= {limit}"
            )


def check_run(run: dict, config: dict | None = None) -> None:
    """Combinations that the schema allows key by key but that cannot work together."""
    config = config or {"matrix": {}}
    from .tasks import TASKS, model_task

    task = model_task(run["model_def"])
    dataset_def = run["dataset_def"]
    where = f"datasets.{run['dataset']}"
    model_source = run["model_def"]["source"]
    if dataset_def["source"]["kind"] != "synthetic" and model_source["kind"] == "config" and "tokenizer" not in model_source:
        raise ConfigError(
            f"config key models.{run['model']}.source.tokenizer: required to tokenise dataset {run['dataset']!r} "
            "(without a tokenizer a config model trains on synthetic data only)"
        )
    if dataset_def["source"]["kind"] != "synthetic":
        for key in ("text_column", *TASKS[task].needs):
            if key not in dataset_def:
                raise ConfigError(f"config key {where}.{key}: required to train model {run['model']!r} ({task})")
    if run["max_steps"] is not None and run["warmup_steps"] >= run["max_steps"]:
        raise ConfigError(
            f"config key {_setting_key(config, 'warmup_steps', run['warmup_steps'])}: {run['warmup_steps']} leaves nothing to measure in run {run['run_id']} "
            f"(max_steps {run['max_steps']}); expected warmup_steps < max_steps"
        )
    if run["compile"] and run["warmup_steps"] < 1:
        raise ConfigError(
            f"config key {_setting_key(config, 'warmup_steps', run['warmup_steps'])}: run {run['run_id']} compiles; expected warmup_steps >= 1 so compilation is not measured"
        )
    if run["parallel"] in ("dp", "ddp") and run["num_gpus"] < 2 and run["device"] != "cpu":
        raise ConfigError(f"config key {_setting_key(config, 'num_gpus', run['num_gpus'])}: run {run['run_id']} uses parallel {run['parallel']!r}; expected num_gpus >= 2")


def check_dataset_columns(config: dict, runs: list[dict]) -> None:
    """The columns a dataset's runs read (text_column, label_column for classification, target_column
    for seq2seq) exist in its file. Only the header is read, and only for local CSV/TSV, JSON Lines
    and Parquet files; other sources (hub, folders, JSON arrays) are checked when they are prepared."""
    import pandas as pd
    import pyarrow.parquet as pq

    from . import sources
    from .tasks import model_task

    keys = {"classification": ("text_column", "label_column"), "seq2seq": ("text_column", "target_column")}
    needed: dict[str, dict[str, str]] = {}  # dataset -> {key: column}
    for run in runs:
        dataset_def = run["dataset_def"]
        if dataset_def["source"]["kind"] in ("hub", "config", "synthetic"):
            continue
        for key in keys.get(model_task(run["model_def"]), ("text_column",)):
            if key in dataset_def:
                needed.setdefault(run["dataset"], {})[key] = dataset_def[key]
    for name, columns in needed.items():
        dataset_def = config["datasets"][name]
        location = Path(sources.resolve_location(dataset_def["source"]))
        if not location.is_file():
            continue
        try:
            data_format = sources.dataset_format(location, dataset_def.get("format"))
            suffixes = [suffix.lower() for suffix in location.suffixes]
            if data_format == "csv":
                header = pd.read_csv(location, sep="\t" if ".tsv" in suffixes else ",", nrows=0).columns
            elif data_format == "parquet":
                header = pq.read_schema(location).names
            elif data_format == "json" and ".jsonl" in suffixes:
                header = pd.read_json(location, lines=True, nrows=1).columns
            else:
                continue
        except Exception:  # noqa: BLE001 - unreadable here: prepare_data reports it with its own message
            continue
        for key, column in columns.items():
            if column not in header:
                raise ConfigError(
                    f"config key datasets.{name}.{key}: column {column!r} is not in {location}; "
                    f"expected one of its columns: {', '.join(map(str, header))}"
                )


def check_gpu_limit(config: dict, limit: int | None) -> None:
    """No run asks for more GPUs than this invocation may use (``--resources gpu=N``, given on the
    command line or by a profile). Snakemake would otherwise shrink the job's request to N silently."""
    if limit is None:
        return
    from . import matrix

    for run in matrix.expand_runs(config):
        if run["device"] != "cpu" and run["num_gpus"] > limit:
            raise ConfigError(
                f"config key {_setting_key(config, 'num_gpus', run['num_gpus'])}: run {run['run_id']} asks for "
                f"{run['num_gpus']} GPUs but this invocation allows {limit} (resources gpu={limit}, from the "
                f"command line or a profile); expected num_gpus <= {limit}"
            )


def _settings_blocks(config: dict):
    yield "matrix", config["matrix"]
    if "defaults" in config:
        yield "defaults", config["defaults"]
    for index, entry in enumerate(config.get("include", [])):
        yield f"include[{index}]", entry
    for index, entry in enumerate(config.get("overrides", [])):
        yield f"overrides[{index}].set", entry["set"]


def _indexed(value: Any, key: str) -> list[tuple[str, Any]]:
    """(key path, value) pairs: ``matrix.model[1]`` for a list (an axis), the key itself for one value."""
    if value is None:
        return []
    if isinstance(value, list):
        return [(f"{key}[{index}]", item) for index, item in enumerate(value)]
    return [(key, value)]


def _setting_key(config: dict, name: str, value: Any) -> str:
    """The config key a run's setting came from (matrix axis, include, override or defaults)."""
    for where, settings in _settings_blocks(config):
        for key, item in _indexed(settings.get(name), f"{where}.{name}"):
            if item == value:
                return key
    return f"defaults.{name}"
