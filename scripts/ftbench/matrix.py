"""Expand an experiment's axes into one run spec per combination, each with a stable run id.

A run spec is a flat, JSON-serialisable dict holding everything the training job needs: its settings,
the definitions of its model and dataset, and the id of its prepared data. The run id is readable
(``minilm-rt-lora-r8-fp32-b32-s64``) plus a short hash of the normalised spec, so that editing one
run's settings gives it a new id (it alone is trained again) while the others keep theirs.
"""

from __future__ import annotations

import hashlib
import itertools
import json
from typing import Any

# Settings a run has when neither `defaults` nor the matrix gives them. One place, so the schema
# comments, the README and the code agree on what an unset key means.
RUN_DEFAULTS: dict[str, Any] = {
    "method": "lora",
    "precision": "fp32",
    "batch_size": 32,
    "seq_len": 128,
    "lora_rank": 8,
    "lora_alpha": None,  # None: 2 x rank, the common choice that keeps the update scale stable
    "lora_dropout": 0.05,
    "lora_targets": "all-linear",
    "learning_rate": 5e-4,
    "lr_warmup_steps": 0,
    "weight_decay": 0.0,
    "optimizer": "adamw",  # adamw (fused on CUDA) | adamw_8bit | paged_adamw_8bit (bitsandbytes) | sgd
    "grad_accum_steps": 1,
    "compile": False,
    "attn_implementation": None,  # None: the model's default (sdpa where supported)
    "qlora_quant_type": "nf4",
    "qlora_double_quant": True,
    "qlora_compute_dtype": None,  # None: the run's precision
    "data_source": "memory",  # memory: shards decoded into RAM before training; disk: read per batch
    "device": "auto",  # auto: the GPUs asked for, or the CPU for a 1-GPU run on a machine without one
    "epochs": 1,
    "max_steps": None,
    "warmup_steps": 3,
    "eval_batch_size": 64,
    "max_eval_samples": None,
    "gradient_checkpointing": False,
    "auto_batch_size": False,  # True: measure at the largest batch that fits, searched from batch_size
    "auto_batch_size_max": 1024,  # the largest per-device batch that search tries
    "num_gpus": 1,
    "parallel": "single",
    "seed": 0,
    # NVML sampling period during the measured window (utilisation, memory, power); a measuring knob, but
    # part of the spec so the run records how it was measured. 0.5 s: at 0.1 s an H100 run lost 3.5% of
    # its throughput to sampling (scripts/benchmark_overhead.py); the driver averages utilisation over
    # 1/6 to 1 s anyway, and energy comes from the driver's counter whatever the interval.
    "gpu_sample_interval_s": 0.5,
}

LORA_KEYS = ("lora_rank", "lora_alpha", "lora_dropout", "lora_targets")
QLORA_KEYS = ("qlora_quant_type", "qlora_double_quant", "qlora_compute_dtype")

# Bumping this changes every run id: do it when the meaning of a spec key changes.
SPEC_VERSION = 1


def expand_runs(config: dict) -> list[dict]:
    """All runs of an experiment, in matrix order, without duplicates."""
    base = {**RUN_DEFAULTS, **config.get("defaults", {})}
    axes = config["matrix"]
    names = list(axes)
    settings_list = []
    for values in itertools.product(*(axes[name] for name in names)):
        settings = {**base, **dict(zip(names, values))}
        for override in config.get("overrides", []):
            if _matches(settings, override["when"]):
                settings.update(override["set"])
        if any(_matches(settings, rule) for rule in config.get("exclude", [])):
            continue
        settings_list.append(settings)
    for extra in config.get("include", []):
        settings_list.append({**base, **extra})

    runs: dict[str, dict] = {}
    repeats = config.get("repeats", 1)
    for settings in settings_list:
        for repeat in range(repeats):
            spec = make_spec(settings, config, repeat=repeat, repeats=repeats)
            runs.setdefault(spec["run_id"], spec)
    return list(runs.values())


def _matches(settings: dict, pattern: dict) -> bool:
    return all(settings.get(key) == value for key, value in pattern.items())


def normalise_settings(settings: dict) -> dict:
    """Drop what does not affect a run so that equivalent runs share one id."""
    settings = dict(settings)
    if settings["method"] == "full":
        for key in LORA_KEYS:
            settings[key] = None
    elif settings["lora_alpha"] is None:
        settings["lora_alpha"] = 2 * settings["lora_rank"]
    if settings["method"] != "qlora":
        for key in QLORA_KEYS:
            settings[key] = None
    if settings["max_steps"] is not None:
        settings["epochs"] = None  # max_steps wins; epochs no longer matters
    if not settings.get("auto_batch_size"):
        settings["auto_batch_size_max"] = None  # no search, no limit to it
    if settings["parallel"] == "single":
        settings["num_gpus"] = min(settings["num_gpus"], 1)
    return settings


def make_spec(settings: dict, config: dict, repeat: int = 0, repeats: int = 1) -> dict:
    settings = normalise_settings(settings)
    model_def = config["models"][settings["model"]]
    dataset_def = config["datasets"][settings["dataset"]]
    spec = {
        **settings,
        "spec_version": SPEC_VERSION,
        "repeat": repeat,
        "seed": settings["seed"] + repeat,
        "model_def": model_def,
        "dataset_def": dataset_def,
        "data_id": data_id(settings["dataset"], dataset_def, model_def, settings["seq_len"], config),
    }
    # Repeats of one configuration share a config id (the spec without repeat and seed), so their
    # spread can be summarised; each repeat still has its own run id.
    configuration = {key: value for key, value in spec.items() if key not in ("repeat", "seed")}
    spec["config_id"] = f"{readable_name(settings, 0, 1)}-{short_hash(configuration)}"
    digest = short_hash(spec)
    spec["run_id"] = f"{readable_name(settings, repeat, repeats)}-{digest}"
    return spec


def readable_name(settings: dict, repeat: int, repeats: int) -> str:
    parts = [settings["model"], settings["dataset"], settings["method"]]
    if settings["method"] != "full":
        parts.append(f"r{settings['lora_rank']}")
    if settings["method"] == "qlora" and settings["qlora_quant_type"] != "nf4":
        parts.append(settings["qlora_quant_type"])
    if settings["method"] == "qlora" and not settings["qlora_double_quant"]:
        parts.append("nodq")
    parts += [settings["precision"], f"b{settings['batch_size']}", f"s{settings['seq_len']}"]
    if settings["grad_accum_steps"] > 1:
        parts.append(f"ga{settings['grad_accum_steps']}")
    if settings["optimizer"] != "adamw":
        parts.append(settings["optimizer"])
    if settings["gradient_checkpointing"]:
        parts.append("gc")
    if settings.get("auto_batch_size"):
        parts.append("autobs")
    if settings["compile"]:
        parts.append("compiled")
    if settings["data_source"] == "disk":
        parts.append("disk")
    if settings["parallel"] != "single":
        parts.append(f"{settings['parallel']}{settings['num_gpus']}")
    if repeats > 1:
        parts.append(f"rep{repeat}")
    return "-".join(str(part) for part in parts)


def data_id(dataset_name: str, dataset_def: dict, model_def: dict, seq_len: int, config: dict) -> str:
    """One prepared dataset per (dataset, tokenizer, sequence length): shared by every run that needs it."""
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
    return f"{dataset_name}-s{seq_len}-{short_hash(key)}"


def shard_size_mb(config: dict) -> float:
    return config.get("data", {}).get("shard_size_mb", 128)


def short_hash(value: Any) -> str:
    text = json.dumps(value, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:8]


def data_tasks(runs: list[dict]) -> dict[str, dict]:
    """The distinct data preparations the runs need, keyed by data id."""
    tasks = {}
    for run in runs:
        tasks.setdefault(
            run["data_id"],
            {
                "data_id": run["data_id"],
                "dataset": run["dataset"],
                "dataset_def": run["dataset_def"],
                "model_def": run["model_def"],
                "seq_len": run["seq_len"],
            },
        )
    return tasks
