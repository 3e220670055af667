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
    settings = normalise(settings)
    model_def = config["models"][settings["model"]]
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
    """One prepared dataset per (dataset, tokenizer or image processor, sequence length, image size): shared
    by every run that needs it."""
    source = model_def["source"]
    # A config-built model without a tokenizer: its architecture (vocab size) defines the token data.
    tokenizer_source = source.get("tokenizer", source) if source["kind"] == "config" else source
    key = {
        "dataset": dataset_def,
        "task": model_def.get("task", "classification"),
        "tokenizer": tokenizer_source,
        "seq_len": seq_len,
        "shard_size_mb": shard_size_mb(config),
        "spec_version": SPEC_VERSION,
    }
    if image_size is not None:
        key["image_size"] = image_size  # only when set: the ids of text data stay as they were
    return f"{dataset_name}-s{seq_len}{f'-i{image_size}' if image_size else ''}-{short_hash(key)}"


def shard_size_mb(config: dict) -> float:
    return config.get("data", {}).get("shard_size_mb", DEFAULT_SHARD_SIZE_MB)


def short_hash(value: Any) -> str:
    text = json.dumps(value, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:8]


def data_preparations(runs: list[RunSpec]) -> dict[str, dict]:
    """The distinct data preparations (prepare_data jobs) the runs need, keyed by data id."""
    preparations = {}
    for run in runs:
        preparations.setdefault(
            run.data_id,
            {
                "data_id": run.data_id,
                "dataset": run.dataset,
                "dataset_def": run.dataset_def,
                "model": run.model,  # the first model that reads it: error messages name its config keys
                "model_def": run.model_def,
                "seq_len": run.seq_len,
                "image_size": run.image_size,
            },
        )
    return preparations
