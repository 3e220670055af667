"""Scaling over GPUs: throughput and memory per GPU against the GPU count for each parallel mode, the scaling
efficiency with its 95% interval, and the cheapest mode of each configuration (no drawing, no HTML).

The terms, stated once:

- A *series* is a configuration without the settings that spread it over GPUs (PARALLEL_SETTINGS: parallel,
  num_gpus, num_nodes, the fsdp options) on one GPU model: what a scaling line follows. Its *points* are its
  configurations as analysis.configurations scores them (repeats scored, 95% throughput interval), so the
  numbers here are the configurations table's.
- A *mode* is how a point is spread: ``single`` (one GPU, no parallel wrapper), ``dp``, ``ddp``, ``fsdp``, an
  fsdp option that changes the work as a suffix (``fsdp+offload``, ``fsdp+noreshard``, ``fsdp+reduce-fp32``),
  and the nodes beyond one.
- GPUs: the devices that trained together, as the cost counts them (cost.billed_devices: the recorded world_size).
- Throughput: ``tokens_per_s`` is global (all the run's GPUs together) as everywhere in the report;
  ``tokens_per_s_per_gpu`` is it over the GPUs. No column or axis mixes the two.
- Memory per GPU: the configuration's median peak CUDA reserved and allocated, which are already per GPU (a
  process measures its own GPUs and ranks are merged by their maximum: the most loaded GPU).
- Scaling efficiency at N GPUs: per-GPU tokens/s over the tokens/s of the same series in mode single on one
  GPU (its *baseline*); 1.0 is linear scaling. Its interval divides the ends of the two throughput intervals
  crosswise (uncertainty.quotient_interval): it reaches 1.0 exactly when per-GPU and single-GPU throughput tie
  by the report's rule. A series without a baseline gets no efficiency, never an estimated one. A one-GPU point
  of another mode (fsdp on one GPU) is read against the same baseline: its efficiency is that mode's overhead.
- Cheapest mode: within a series, the lowest $ per 1M tokens (cost.py's: the global throughput and the price of
  every GPU held); modes whose cost interval overlaps the pick's are a tie with it (analysis.ranked). Without a
  price the highest per-GPU throughput stands in: one GPU model costs the same per GPU-hour, so it orders the
  modes the same way.
"""

from __future__ import annotations

import math
import re

import pandas as pd

from ftbench.report import analysis, uncertainty
from ftbench.report.analysis import CONFIG_COLUMNS, is_missing
from ftbench.report.cost import billed_devices

SINGLE = "single"
MODE_ORDER = (SINGLE, "dp", "ddp", "fsdp")
# The settings that say how a configuration is spread over GPUs rather than what it trains.
PARALLEL_SETTINGS = ("parallel", "num_gpus", "num_nodes", "fsdp_reshard_after_forward", "fsdp_cpu_offload", "fsdp_reduce_dtype")
SERIES_COLUMNS = [c for c in CONFIG_COLUMNS if c not in PARALLEL_SETTINGS] + ["device_name"]
# The parts of a readable run name that PARALLEL_SETTINGS write (runspec's name_part): a series' label drops them.
PARALLEL_NAME_PARTS = r"-(?:(?:dp|ddp|fsdp)\d+|offload|noreshard|n\d+)(?=-|$)"
# The configurations' figures a point takes over as they are (analysis.configurations).
CONFIG_FIGURES = ["configuration", "config_key", "method", "measured", "interval_basis", "tokens_per_s", "tokens_per_s_low",
                  "tokens_per_s_high", "cost_per_1m_tokens", "cost_low", "cost_high", "peak_memory_reserved_mb",
                  "peak_memory_allocated_mb"]
POINT_COLUMNS = ["series", "series_label", "model", "model_params", "device_name", "mode", "gpus", *CONFIG_FIGURES,
                 "tokens_per_s_per_gpu", "tokens_per_s_per_gpu_low", "tokens_per_s_per_gpu_high",
                 "baseline", "has_baseline", "efficiency", "efficiency_low", "efficiency_high"]
CHEAPEST_COLUMNS = ["series", "series_label", "model", "model_params", "device_name", "basis", "cheapest", "cost_per_1m_tokens",
                    "cost_low", "cost_high", "tokens_per_s_per_gpu", "within_noise", "beyond_noise", "points"]


def mode_of(row) -> str:
    """A run's parallel mode (see the module's docstring): 'ddp', 'fsdp+offload', 'ddp over 2 nodes'."""
    mode = SINGLE if is_missing(row["parallel"]) else str(row["parallel"])
    if mode == "fsdp":
        if not is_missing(row["fsdp_cpu_offload"]) and bool(row["fsdp_cpu_offload"]):
            mode += "+offload"
        if not is_missing(row["fsdp_reshard_after_forward"]) and not bool(row["fsdp_reshard_after_forward"]):
            mode += "+noreshard"
        if not is_missing(row["fsdp_reduce_dtype"]):
            mode += f"+reduce-{row['fsdp_reduce_dtype']}"
    nodes = row["num_nodes"]
    return mode if is_missing(nodes) or int(nodes) <= 1 else f"{mode} over {int(nodes)} nodes"


def mode_rank(mode: str) -> tuple[int, str]:
    """Sort key of a mode: single, dp, ddp, fsdp (its variants after it), then any other alphabetically."""
    base = re.split(r"[+ ]", mode)[0]
    return (MODE_ORDER.index(base) if base in MODE_ORDER else len(MODE_ORDER), mode)


def point_name(mode: str, gpus: int) -> str:
    """'ddp ×2': a mode on a GPU count, as the tables and notes name a point."""
    return f"{mode} \u00d7{int(gpus)}"


def gpu_runs(runs: pd.DataFrame) -> pd.DataFrame:
    """The prepared runs that trained on GPUs and measured a throughput (analysis.measured_runs), each with its
    ``mode``, ``gpus``, ``series`` (a short hash of SERIES_COLUMNS) and readable ``series_label``."""
    gpu = analysis.measured_runs(runs)
    gpu = gpu[gpu["device"].eq("cuda").fillna(False).astype(bool)].copy()
    gpu["mode"] = pd.Series([mode_of(row) for _, row in gpu.iterrows()], index=gpu.index, dtype=object)
    gpu["gpus"] = pd.Series([billed_devices(row) for row in gpu.to_dict("records")], index=gpu.index, dtype="int64")
    gpu["series"] = analysis.short_hash(analysis.settings_key(gpu[SERIES_COLUMNS]))
    named = gpu["config_id"].where(gpu["config_id"].notna(), gpu["run_id"])
    label = analysis.strip_id(named).str.replace(PARALLEL_NAME_PARTS, "", regex=True)
    if gpu["device_name"].nunique() > 1:
        label = label + " @ " + gpu["device_name"].map(analysis.short_device)
    # two series whose settings differ only where the readable name says nothing (a learning rate) are told apart
    gpu["series_label"] = analysis.unique_labels(label, gpu["series"])
    return gpu


def several_gpu_counts(runs: pd.DataFrame) -> bool:
    """Whether the GPU runs with a measured throughput used more than one GPU count: what scaling needs."""
    return gpu_runs(runs)["gpus"].nunique() > 1


def _points(gpu: pd.DataFrame, configs: pd.DataFrame) -> pd.DataFrame:
    """One row per GPU configuration: its series, mode, GPUs and model size beside its configurations() figures."""
    if gpu.empty:
        return pd.DataFrame(columns=[c for c in POINT_COLUMNS if c not in CONFIG_FIGURES] + CONFIG_FIGURES)
    sizes = gpu.groupby("model")["total_params"].median()
    where = gpu.groupby("config_key", sort=False).agg(
        series=("series", "first"), series_label=("series_label", "first"), model=("model", "first"),
        device_name=("device_name", "first"), mode=("mode", "first"), gpus=("gpus", "max"))
    where["model_params"] = where["model"].map(sizes).astype(float)
    return where.reset_index().merge(configs[CONFIG_FIGURES], on="config_key", how="inner")


def _add_efficiency(points: pd.DataFrame) -> pd.DataFrame:
    """Per-GPU throughput, and each point's efficiency against its series' baseline (single on one GPU) with
    its interval; null where the series has no baseline. The baseline itself is 1 by definition, with no
    interval (it is the same measurement on both sides of the ratio)."""
    for end in ("", "_low", "_high"):
        points[f"tokens_per_s_per_gpu{end}"] = points[f"tokens_per_s{end}"].astype(float) / points["gpus"]
    points["baseline"] = points["mode"].eq(SINGLE) & points["gpus"].eq(1)
    # one baseline per series: two would be the same settings on differently defined models (a local copy)
    baselines = points[points["baseline"]].drop_duplicates("series").set_index("series")
    points["has_baseline"] = points["series"].isin(baselines.index)
    base = {end: points["series"].map(baselines[f"tokens_per_s{end}"].astype(float)) for end in ("", "_low", "_high")}
    points["efficiency"] = points["tokens_per_s_per_gpu"] / base[""]
    bounds = [_efficiency_bounds((low, high), (base_low, base_high)) for low, high, base_low, base_high in
              zip(points["tokens_per_s_per_gpu_low"], points["tokens_per_s_per_gpu_high"], base["_low"], base["_high"])]
    points["efficiency_low"] = [low for low, _ in bounds]
    points["efficiency_high"] = [high for _, high in bounds]
    points.loc[points["baseline"], ["efficiency_low", "efficiency_high"]] = math.nan
    return points


def _efficiency_bounds(per_gpu: tuple[float, float], single: tuple[float, float]) -> tuple[float, float]:
    """uncertainty.quotient_interval where both intervals are known; (nan, nan) otherwise."""
    if any(is_missing(end) or math.isnan(float(end)) for end in (*per_gpu, *single)) or float(single[1]) <= 0:
        return math.nan, math.nan
    return uncertainty.quotient_interval((float(per_gpu[0]), float(per_gpu[1])), (float(single[0]), float(single[1])))


def scaling_table(runs: pd.DataFrame, configs: pd.DataFrame) -> pd.DataFrame:
    """The points of every GPU series (POINT_COLUMNS; see the module's docstring): global and per-GPU tokens/s
    with their 95% intervals, peak memory per GPU, $ per 1M tokens and the scaling efficiency with its interval.
    ``runs``: analysis.prepare's (with add_step_figures for the within-run intervals); ``configs``: their
    analysis.configurations. Series measured on one GPU in mode single alone are left out. Sorted by model
    size, series, mode and GPU count."""
    points = _add_efficiency(_points(gpu_runs(runs), configs))
    # a series measured only as single on one GPU has nothing to scale (it stays in the configurations table)
    spread = points.groupby("series")["baseline"].transform(lambda baseline: not baseline.all()).astype(bool)
    points = points[spread]
    if points.empty:
        return points.reindex(columns=POINT_COLUMNS)
    order = points.assign(_mode=points["mode"].map(mode_rank), _size=points["model_params"].fillna(math.inf))
    order = order.sort_values(["_size", "model", "series_label", "_mode", "gpus"], kind="stable")
    return order[POINT_COLUMNS].reset_index(drop=True)


def cheapest_modes(table: pd.DataFrame) -> pd.DataFrame:
    """One row per series of ``table`` (scaling_table's), in its order (model size first): the cheapest point
    (CHEAPEST_COLUMNS: its mode and GPUs, its $ per 1M tokens with the interval), the points within noise of it
    and those beyond, each named with its figure, and the basis: 'cost' or 'per-GPU throughput' (no price)."""
    rows = [_cheapest(series) for _, series in table.groupby("series", sort=False)]
    return pd.DataFrame(rows, columns=CHEAPEST_COLUMNS)


def _cheapest(series: pd.DataFrame) -> dict:
    priced = series["cost_per_1m_tokens"].notna().any()
    if priced:
        order = analysis.ranked(series, "cost_per_1m_tokens", higher_is_better=False)
    else:  # ranked() reads tokens_per_s and its interval: hand it the per-GPU figures under those names
        per_gpu = series.assign(**{f"tokens_per_s{end}": series[f"tokens_per_s_per_gpu{end}"] for end in ("", "_low", "_high")})
        order = analysis.ranked(per_gpu, "tokens_per_s", higher_is_better=True)
    pick, others = order.iloc[0], order.iloc[1:]

    def named(points: pd.DataFrame) -> str | None:
        shown = [f"{point_name(p['mode'], p['gpus'])} ({_figure(p, priced)})" for _, p in points.iterrows()]
        return ", ".join(shown) or None

    return {**{column: pick[column] for column in ("series", "series_label", "model", "model_params", "device_name",
                                                     "cost_per_1m_tokens", "cost_low", "cost_high", "tokens_per_s_per_gpu")},
            "basis": "cost" if priced else "per-GPU throughput", "cheapest": point_name(pick["mode"], pick["gpus"]),
            "within_noise": named(others[others["tied"]]), "beyond_noise": named(others[~others["tied"]]), "points": len(order)}


def _figure(point: pd.Series, priced: bool) -> str:
    """The figure a point is ranked by, as text: '$0.0406' (per 1M tokens) or '21,882 tokens/s per GPU'."""
    if priced:
        return f"${float(point['cost_per_1m_tokens']):.3g}"
    return f"{float(point['tokens_per_s_per_gpu']):,.0f} tokens/s per GPU"


def without_baseline(table: pd.DataFrame) -> list[str]:
    """The series labels with a point on several GPUs but no baseline: their efficiency is left out."""
    missing = table[~table["has_baseline"].astype(bool)]
    return list(dict.fromkeys(missing["series_label"]))


def unmeasured_multi_gpu(runs: pd.DataFrame) -> list[str]:
    """'<run_id> (<status>)' for each run meant for several GPUs that measured no throughput (it failed, ran
    out of memory, ...): a mode the scaling tables cannot show."""
    measured = set(analysis.measured_runs(runs)["run_id"])
    left = runs[~runs["run_id"].isin(measured) & runs["device"].ne("cpu").fillna(True).astype(bool)]
    return [f"{row['run_id']} ({row['status']})" for row in left.to_dict("records")
            if billed_devices({k: None if is_missing(v) else v for k, v in row.items()}) > 1]
