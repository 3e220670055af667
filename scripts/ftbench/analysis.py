"""The run table's analysis, for the figures, the report and compare: no drawing, no HTML.

A *configuration* is what the repeats of one setting share: the run's ``config_id`` (its settings
without repeat index and seed, hashed with the model's and dataset's definitions). Runs of one
configuration on different device models are kept apart (``config_key``). Result sets from different
machines are matched by their settings columns instead (``across_machines``): config_id's hash also
covers what differs between machines without changing the run, such as a model's local path or the
ftbench spec version. Its readable label is made of the settings that tell the configurations apart.
"""

from __future__ import annotations

import hashlib
import math
import re
from pathlib import Path

import numpy as np
import pandas as pd
import yaml

from .columns import SPEC_COLUMNS
from .errors import FtbenchError

METHOD_ORDER = ["full", "lora", "qlora"]
# The settings columns of a configuration: the run's settings without its repeat index and seed.
CONFIG_COLUMNS = [c for c in SPEC_COLUMNS if c not in ("repeat", "seed")]
# A configuration whose repeats vary more than this (coefficient of variation of tokens/s) is unstable.
CV_THRESHOLD = 0.05


def is_missing(value) -> bool:
    """True for None, pandas' NA and NaN; False for any other value (strings and lists included)."""
    if value is None or value is pd.NA:
        return True
    try:
        return bool(pd.isna(value))
    except (TypeError, ValueError):  # lists and other containers: a value, not a missing one
        return False


def ok_runs(runs: pd.DataFrame) -> pd.DataFrame:
    """The runs that finished (status ok); a null status is not ok."""
    return runs[runs["status"].isin(["ok"])]


def method_order(methods) -> list[str]:
    """The methods present, in the order full, lora, qlora, then any other alphabetically."""
    present = set(pd.Series(methods).dropna())
    return [m for m in METHOD_ORDER if m in present] + sorted(present - set(METHOD_ORDER))


# ---------------------------------------------------------------------------------------------------
# Configurations and their labels


def short_device(name) -> str:
    """A device's name without the vendor's prefix: 'NVIDIA H100 80GB HBM3' -> 'H100 80GB HBM3'."""
    if not isinstance(name, str) or not name:
        return "?"
    return re.sub(r"^(NVIDIA|Tesla)\s+", "", name).replace("GeForce ", "").strip()


def strip_id(ids: pd.Series) -> pd.Series:
    """A run or config id without its hash (and repeat) suffix: the readable part."""
    return ids.astype(str).str.replace(r"(-rep\d+)?-[0-9a-f]{8}$", "", regex=True)


def shorten(labels: pd.Series) -> pd.Series:
    """Drop the name parts every label shares (the one model, dataset, precision, ...): what is left is
    what tells the configurations apart. Labels are kept whole when that would leave one empty."""
    if len(labels.unique()) < 2:
        return labels
    parts = labels.str.split("-")
    common = set.intersection(*(set(p) for p in parts))
    short = parts.map(lambda p: "-".join(x for x in p if x not in common))
    return labels if (short == "").any() else short


def common_parts(runs: pd.DataFrame) -> str:
    """The name parts all configurations share (what shorten() dropped from their labels)."""
    parts = strip_id(runs["run_id"]).str.split("-")
    if parts.empty or len(set(map(tuple, parts))) < 2:
        return ""
    common = set.intersection(*(set(p) for p in parts))
    return " ".join(x for x in parts.iloc[0] if x in common)


def _hash(keys: pd.Series) -> pd.Series:
    return keys.map(lambda key: hashlib.sha256(key.encode()).hexdigest()[:8])


def _joined(columns: pd.DataFrame) -> pd.Series:
    """Each row's values as one string: a key for the settings in ``columns``."""
    rows = columns.astype("string").fillna("-").itertuples(index=False)
    return pd.Series(["|".join(row) for row in rows], index=columns.index, dtype=object)




def _unique_labels(labels: pd.Series, keys: pd.Series) -> pd.Series:
    """Labels with the key's first characters added where one label would name several keys."""
    keys_per_label = keys.groupby(labels).transform("nunique")
    return labels.where(keys_per_label == 1, labels + " [" + keys.str[:4] + "]")


def prepare(runs: pd.DataFrame, across_machines: bool = False, gpu_table: list[dict] | None = None) -> pd.DataFrame:
    """The run table (with the documented columns: collect.typed) plus, per run:

    - ``config``: its configuration (see the module's docstring), the same on every device model;
    - ``config_key``: the configuration on its device model (repeats share it);
    - ``config_name``: readable, unique per configuration; ``config_label``: the name with its device
      when the table has several device models, unique per config_key;
    - ``quality``: the accuracy that judges it (see quality_column);
    - ``device_memory_mb``: its device's memory (gpu_capacity_mb), null when unknown.
    """
    runs = runs.copy().reset_index(drop=True)
    has_config_id = runs["config_id"].notna().all()  # tables written before config_id existed have none
    identity = runs["config_id"].astype(str) if has_config_id and not across_machines else _joined(runs[CONFIG_COLUMNS])
    readable = strip_id(runs["config_id"] if has_config_id else runs["run_id"])
    device = runs["device_name"].astype("string").fillna("-")
    runs["config"] = _hash(identity)
    runs["config_key"] = _hash(identity + "|" + device)
    name = shorten(readable)
    runs["config_name"] = _unique_labels(name, runs["config"])
    if device[device != "-"].nunique() > 1:
        name = name + " @ " + runs["device_name"].map(short_device)
    runs["config_label"] = _unique_labels(name, runs["config_key"])
    runs["quality"], _ = quality_column(runs)
    runs["device_memory_mb"] = pd.array([gpu_capacity_mb(d, gpu_table or []) for d in runs["device_name"]], dtype="Float64")
    return runs


def quality_column(runs: pd.DataFrame) -> tuple[pd.Series, str]:
    """(the accuracy of each run, its axis name): classification accuracy where the run has one, else the
    token accuracy of a language-model run (next-token / target-token). Both are 'higher is better' in [0, 1]."""
    accuracy, token = runs["eval_accuracy"].astype("Float64"), runs["eval_token_accuracy"].astype("Float64")
    has_accuracy, has_token = accuracy.notna().any(), (token.notna() & accuracy.isna()).any()
    if has_accuracy and has_token:
        name = "eval accuracy (token accuracy for LM runs)"
    elif has_token:
        name = "eval token accuracy"
    else:
        name = "eval accuracy"
    return accuracy.fillna(token), name


def run_labels(runs: pd.DataFrame) -> pd.Series:
    """A label per run (indexed by run_id): its configuration's, with ``#repeat`` where the configuration
    has several runs."""
    repeats = runs.groupby("config_key")["run_id"].transform("size")
    labels = runs["config_label"].where(repeats == 1, runs["config_label"] + " #" + runs["repeat"].astype("string").fillna("?"))
    return pd.Series(labels.to_numpy(), index=runs["run_id"])


def panels(runs: pd.DataFrame) -> dict[str, str | None]:
    """How a per-configuration figure splits into panels: a column per model and a row per dataset, where
    the table has several (accuracy and cost compare within one model and dataset)."""
    def several(column: str) -> str | None:
        return column if runs[column].nunique() > 1 else None

    return {"col": several("model"), "row": several("dataset")}


# ---------------------------------------------------------------------------------------------------
# Medians and spread over repeats


CONFIG_SUMMARY_COLUMNS = [
    "configuration", "config_key", "method", "runs", "ok", "tokens_per_s", "tokens_per_s_iqr", "tokens_per_s_cv",
    "unstable", "cost_per_1m_tokens", "accuracy", "peak_memory_mb", "projected_hours", "projected_cost",
]


def configurations(runs: pd.DataFrame) -> pd.DataFrame:
    """One row per configuration: its runs, how many finished, median tokens/s, IQR, CV, cost, accuracy."""
    rows = []
    for key, group in runs.groupby("config_key", sort=False):
        ok = ok_runs(group)
        speed = ok["tokens_per_s"].dropna().astype(float)
        cv = speed.std(ddof=1) / speed.mean() if len(speed) > 1 and speed.mean() > 0 else math.nan
        rows.append({
            "configuration": group["config_label"].iloc[0],
            "config_key": key,
            "method": group["method"].iloc[0],
            "runs": len(group),
            "ok": len(ok),
            "tokens_per_s": _median(ok, "tokens_per_s"),
            "tokens_per_s_iqr": speed.quantile(0.75) - speed.quantile(0.25) if len(speed) > 1 else math.nan,
            "tokens_per_s_cv": cv,
            "unstable": bool(cv > CV_THRESHOLD) if not math.isnan(cv) else None,
            "cost_per_1m_tokens": _median(ok, "cost_per_1m_tokens"),
            "accuracy": _median(ok, "quality"),
            "peak_memory_mb": _median(ok, "peak_memory_mb"),
            "projected_hours": _median(ok, "projected_hours"),
            "projected_cost": _median(ok, "projected_cost"),
        })
    return pd.DataFrame(rows, columns=CONFIG_SUMMARY_COLUMNS)


def _median(frame: pd.DataFrame, column: str) -> float:
    """The median of a column's values; NaN when it has none."""
    values = frame[column].dropna().astype(float)
    return float(values.median()) if len(values) else math.nan


# ---------------------------------------------------------------------------------------------------
# The recommendation and the Pareto front


def recommend(configs: pd.DataFrame, min_accuracy: float | None = None, max_memory_mb: float | None = None) -> dict:
    """The cheapest finished configuration per method, and the cheapest meeting the floor and ceiling.

    Cheapest = lowest median $ per 1M tokens (the same training budget costs proportionally); when no
    configuration has a price, the fastest (highest tokens/s) stands in and ``basis`` says so.
    ``closest``: the best accuracy and the smallest peak memory any finished configuration reached.
    """
    done = configs[configs["ok"] > 0].copy()
    closest = {"accuracy": done["accuracy"].max(), "peak_memory_mb": done["peak_memory_mb"].min()}
    priced = done["cost_per_1m_tokens"].notna().any()
    if priced:
        done = done[done["cost_per_1m_tokens"].notna()]
        done["_rank"] = done["cost_per_1m_tokens"]
    else:
        done["_rank"] = -done["tokens_per_s"].fillna(-math.inf)
    done = done.sort_values("_rank", kind="stable").drop(columns="_rank")
    per_method = done.groupby("method", sort=False).head(1).set_index("method")
    per_method = per_method.reindex(method_order(per_method.index)).reset_index()
    eligible = done
    if min_accuracy is not None:
        eligible = eligible[eligible["accuracy"].notna() & (eligible["accuracy"] >= min_accuracy)]
    if max_memory_mb is not None:
        eligible = eligible[eligible["peak_memory_mb"].notna() & (eligible["peak_memory_mb"] <= max_memory_mb)]
    best = eligible.iloc[0].to_dict() if not eligible.empty else None
    return {"basis": "cost" if priced else "throughput", "per_method": per_method, "best": best,
            "candidates": len(done), "closest": closest}


def pareto_front(points: pd.DataFrame, cost: str = "cost", quality: str = "quality") -> pd.DataFrame:
    """Points no other point beats on both axes (lower or equal cost and higher or equal accuracy, one
    strictly better), sorted by cost."""
    ordered = points.sort_values([cost, quality], ascending=[True, False])
    front, best = [], -np.inf
    for index, row in ordered.iterrows():
        if row[quality] > best:
            front.append(index)
            best = row[quality]
    return ordered.loc[front]


def accuracy_and_cost(runs: pd.DataFrame) -> pd.DataFrame:
    """One point per finished configuration with both: median cost, median accuracy, method, label, model,
    dataset, and ``on_front``: whether it is on the Pareto front of its model and dataset."""
    ok = ok_runs(runs)
    ok = ok[ok["quality"].notna() & ok["cost_per_1m_tokens"].notna()]
    points = ok.groupby("config_key").agg(
        cost=("cost_per_1m_tokens", "median"), quality=("quality", "median"), method=("method", "first"),
        label=("config_label", "first"), model=("model", "first"), dataset=("dataset", "first"))
    points = points.astype({"cost": float, "quality": float})
    fronts = [pareto_front(panel).index for _, panel in points.groupby(["model", "dataset"], dropna=False)]
    points["on_front"] = points.index.isin([key for front in fronts for key in front])
    return points


# ---------------------------------------------------------------------------------------------------
# Scaling over GPUs


def scaling(runs: pd.DataFrame) -> pd.DataFrame:
    """Finished GPU runs with a throughput, with ``devices`` (GPUs used), ``series`` (the configuration
    without its GPU count and parallel mode: what a scaling line follows) and its readable ``series_label``."""
    gpu = ok_runs(runs)
    gpu = gpu[gpu["device"].isin(["cuda"]) & gpu["tokens_per_s"].notna()].copy()
    gpu["devices"] = gpu["world_size"].fillna(1).astype(int)
    base = [c for c in CONFIG_COLUMNS if c not in ("num_gpus", "parallel")] + ["device_name"]
    gpu["series"] = _joined(gpu[base])
    gpu["series_label"] = gpu["config_label"].str.replace(r"-(dp|ddp)\d+", "", regex=True)
    gpu["tokens_per_s"] = gpu["tokens_per_s"].astype(float)
    return gpu


def scaling_lines(gpu: pd.DataFrame) -> pd.DataFrame:
    """Median tokens/s per (series, parallel mode, GPU count) for the series measured at two or more GPU
    counts. Each multi-GPU mode's line starts from the series' single-GPU median, and ``parallel`` =
    'ideal' is that median times the GPU count."""
    medians = gpu.groupby(["series", "series_label", "parallel", "devices"], as_index=False)["tokens_per_s"].median()
    lines = []
    for _, series in medians.groupby("series", sort=False):
        if series["devices"].nunique() < 2:
            continue
        single = series[series["devices"] == 1]
        for parallel in series.loc[series["devices"] > 1, "parallel"].unique():
            lines.append(pd.concat([single.assign(parallel=parallel), series[series["parallel"] == parallel]]))
        if not single.empty:
            counts = sorted(series["devices"].unique())
            start = single["tokens_per_s"].median()
            lines.append(pd.DataFrame({"series": single["series"].iloc[0], "series_label": single["series_label"].iloc[0],
                                       "parallel": "ideal", "devices": counts, "tokens_per_s": [start * n for n in counts]}))
    columns = ["series", "series_label", "parallel", "devices", "tokens_per_s"]
    return pd.concat(lines, ignore_index=True)[columns] if lines else pd.DataFrame(columns=columns)


# ---------------------------------------------------------------------------------------------------
# Device memory


def read_gpu_table(path: str | Path) -> list[dict]:
    """The ``gpus`` entries of a GPU table (config/gpus.yaml): name, match, memory_gb, ..."""
    path = Path(path)
    try:
        entries = yaml.safe_load(path.read_text(encoding="utf-8"))["gpus"]
    except (OSError, yaml.YAMLError, TypeError, KeyError) as exc:
        raise FtbenchError(f"GPU table {path}: cannot read its `gpus` list ({exc})") from exc
    return entries


def gpu_capacity_mb(device_name, gpu_table: list[dict]) -> float | None:
    """Memory of one device (MiB): the size in the device's own name ("A100-SXM4-40GB", "H100 80GB HBM3")
    when it has one, else the memory_gb of the first GPU table entry whose ``match`` fits; None when unknown."""
    if not isinstance(device_name, str):
        return None
    named = re.search(r"(\d+)\s*GB\b", device_name, flags=re.IGNORECASE)
    if named:
        return float(named.group(1)) * 1024
    for entry in gpu_table:
        if re.search(entry.get("match", "$^"), device_name, flags=re.IGNORECASE):
            memory = entry.get("memory_gb")
            return float(memory) * 1024 if memory else None
    return None
