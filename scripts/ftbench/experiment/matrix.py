"""Expand an experiment's axes into one run spec per combination, each with a stable run id.

A run spec (``runspec.RunSpec``) holds everything the training job needs: its settings,
the definitions of its model and dataset, and the id of its prepared data. The run id is readable
(``minilm-rt-lora-r8-fp32-b32-s64``) plus a short hash of the normalised spec, so that editing one
run's settings gives it a new id (it alone is trained again) while the others keep theirs.
"""

from __future__ import annotations

import hashlib
import itertools
import json
from typing import Any

from ftbench.tasks import registry
from ftbench.runspec import RUN_DEFAULTS, SPEC_VERSION, RunSpec, normalise, readable_name

# Target size of one Parquet shard of prepared data (config key data.shard_size_mb).
DEFAULT_SHARD_SIZE_MB = 128


def expand_runs(config: dict) -> list[RunSpec]:
    """All runs of an experiment, in matrix order, without duplicates."""
    return _expand(config)[0]


def unused_entries(config: dict) -> dict[str, list[int]]:
    """Entries of the experiment that change nothing, most likely by mistake: ``exclude`` entries that
    match no run of the matrix (a misspelt value), ``include`` entries that repeat a run the matrix already
    has, and ``overrides`` whose ``when`` matches no run. Indexes into each list."""
    return _expand(config)[1]


def _expand(config: dict) -> tuple[list[RunSpec], dict[str, list[int]]]:
    base = {**RUN_DEFAULTS, **config.get("defaults", {})}
    axes = config["matrix"]
    names = list(axes)
    excludes, overrides = config.get("exclude", []), config.get("overrides", [])
    excludes_used, overrides_used = set(), set()
    settings_list = []
    for values in itertools.product(*(axes[name] for name in names)):
        settings = {**base, **dict(zip(names, values))}
        for index, override in enumerate(overrides):
            if _matches(settings, override["when"]):
                settings.update(override["set"])
                overrides_used.add(index)
        matched = [index for index, rule in enumerate(excludes) if _matches(settings, rule)]
        excludes_used.update(matched)
        if not matched:
            settings_list.append(settings)
    from_matrix = len(settings_list)
    for extra in config.get("include", []):
        settings_list.append({**base, **extra})

    runs: dict[str, RunSpec] = {}
    duplicate_includes = []
    repeats = config.get("repeats", 1)
    for position, settings in enumerate(settings_list):
        for repeat in range(repeats):
            spec = make_spec(settings, config, repeat=repeat, repeats=repeats)
            if spec.run_id in runs and position >= from_matrix and repeat == 0:
                duplicate_includes.append(position - from_matrix)
            runs.setdefault(spec.run_id, spec)
    unused = {
        "exclude": [index for index in range(len(excludes)) if index not in excludes_used],
        "include": duplicate_includes,
        "overrides": [index for index in range(len(overrides)) if index not in overrides_used],
    }
    return list(runs.values()), unused


def _matches(settings: dict, pattern: dict) -> bool:
    return all(settings.get(key) == value for key, value in pattern.items())


def make_spec(settings: dict, config: dict, repeat: int = 0, repeats: int = 1) -> RunSpec:
    model_def = config["models"][settings["model"]]
    settings = registry.without_others_settings(normalise(settings), registry.model_family(model_def))
    dataset_def = config["datasets"][settings["dataset"]]
    spec = {
        **settings,
        "spec_version": SPEC_VERSION,
        "repeat": repeat,
        "seed": settings["seed"] + repeat,
        "model_def": model_def,
        "dataset_def": dataset_def,
        "data_id": data_id(settings["dataset"], dataset_def, model_def, settings["seq_len"], config, settings.get("image_size")),
        # Only a run that stops at the target carries it: changing the target retrains no other run.
        "target": config.get("target") if settings.get("stop_at_target") else None,
    }
    name = RunSpec(**spec)
    # Repeats of one configuration share a config id (the spec without repeat and seed), so their
    # spread can be summarised; each repeat still has its own run id.
    configuration = {key: value for key, value in spec.items() if key not in ("repeat", "seed")}
    spec["config_id"] = f"{readable_name(name, 1)}-{short_hash(configuration)}"
    spec["run_id"] = f"{readable_name(name, repeats)}-{short_hash(spec)}"
    return RunSpec(**spec)


def data_id(dataset_name: str, dataset_def: dict, model_def: dict, seq_len: int, config: dict,
            image_size: int | None = None) -> str:
    """One prepared dataset per (dataset, what of the model shapes the data, sequence length, image size, data
    settings): shared by every run, of any experiment in the folder, that needs the same. The hash covers
    exactly what the preparation job receives (``preparation``), so equal ids always mean equal data."""
    task, shaping = data_model(model_def)
    key = {
        "dataset": dataset_def,
        "task": task,
        "tokenizer": shaping,  # the key's name from when only tokenizers were hashed: text data ids stay as they were
        "seq_len": seq_len,
        "shard_size_mb": shard_size_mb(config),
        "spec_version": SPEC_VERSION,
    }
    if image_size is not None:
        key["image_size"] = image_size  # only when set: the ids of text data stay as they were
    key.update(registry.model_family(model_def).data_key(dataset_def, dataset_name))  # files the settings name
    return f"{dataset_name}-s{seq_len}{f'-i{image_size}' if image_size else ''}-{short_hash(key)}"


def data_model(model_def: dict) -> tuple[str, dict]:
    """(task, source) of what of a model shapes its prepared data, and nothing else (not its name, not the
    size of its architecture). Text tasks: the tokenizer's source (a checkpoint's own source, a config-built
    model's ``tokenizer``); a config-built model without a tokenizer gets synthetic tokens below its
    ``vocab_size``, the one part of its architecture that shapes its data. Image tasks: the model's source
    as it is (its config and processor give the image size, normalisation and image tokens).

    Checks of one model alone (a vocab_size beside a tokenizer, its positions) belong to that model's checks
    and its own job: data shared by several models never fails, or is prepared again, for one of them."""
    family = registry.model_family(model_def)
    source = model_def["source"]
    if family.modality == "image" or source["kind"] != "config":
        return family.name, source
    if source.get("tokenizer") is not None:
        return family.name, source["tokenizer"]
    vocab = source.get("overrides", {}).get("vocab_size")
    return family.name, {"kind": "config", "overrides": {} if vocab is None else {"vocab_size": vocab}}


def preparation_model_def(model_def: dict) -> dict:
    """The model definition the preparation job gets: data_model's parts as a model definition (a text
    task's tokenizer as a config-built model's ``tokenizer``), the same for every model that shares the data."""
    task, shaping = data_model(model_def)
    if registry.family(task).modality != "image" and shaping["kind"] != "config":
        shaping = {"kind": "config", "tokenizer": shaping}
    return {"task": task, "source": shaping}


def shard_size_mb(config: dict) -> float:
    return config.get("data", {}).get("shard_size_mb", DEFAULT_SHARD_SIZE_MB)


def short_hash(value: Any) -> str:
    text = json.dumps(value, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:8]


def data_preparations(runs: list[RunSpec]) -> dict[str, dict]:
    """The distinct data preparations (prepare_data jobs) the runs need, keyed by data id: exactly what the
    data id hashes, so a preparation is the same whichever model or experiment first asks for it (its
    JSON is the prepare_data rule's param: no model name, nothing that another experiment names otherwise)."""
    preparations = {}
    for run in runs:
        preparations.setdefault(
            run.data_id,
            {
                "data_id": run.data_id,
                "dataset": run.dataset,
                "dataset_def": run.dataset_def,
                "model_def": preparation_model_def(run.model_def),
                "seq_len": run.seq_len,
                "image_size": run.image_size,
            },
        )
    return preparations
