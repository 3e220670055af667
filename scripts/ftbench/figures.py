"""The report's figures: one function per figure, each with a one-sentence caption.

A figure function takes the prepared run table and the per-step table and returns a matplotlib Figure,
or a string saying why there is nothing to draw (the report prints that note instead of an empty axis).
Captions live in rules/captions/figures/<name>.rst, one file per figure, shared by the HTML report and
Snakemake's own report (``snakemake --report``).

Runs share a *configuration* when they differ only in ``repeat`` (and its seed), and, across result
sets, when they ran on the same device model: repeats are drawn as the spread of one configuration.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import matplotlib

matplotlib.use("Agg")  # no display on cluster nodes and CI

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
import yaml  # noqa: E402

from .columns import SPEC_COLUMNS  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
CAPTIONS_DIR = ROOT / "rules" / "captions" / "figures"
GPUS_PATH = ROOT / "config" / "gpus.yaml"

METHOD_ORDER = ["full", "lora", "qlora"]
METHOD_COLOURS = {"full": "#4c72b0", "lora": "#dd8452", "qlora": "#55a868"}
PARALLEL_COLOURS = {"single": "#4c72b0", "dp": "#c44e52", "ddp": "#55a868"}
OTHER_COLOUR = "#8172b3"
# Columns that make a configuration: the run's settings without its repeat index and seed.
CONFIG_COLUMNS = [c for c in SPEC_COLUMNS if c not in ("repeat", "seed")]


# ---------------------------------------------------------------------------------------------------
# Preparation shared by the figures, the report and compare


def quality_column(runs: pd.DataFrame) -> tuple[pd.Series, str]:
    """(the accuracy of each run, its axis name): classification accuracy where the run has one, else the
    token accuracy of a language-model run (next-token / target-token). Both are 'higher is better' in [0, 1]."""
    acc = runs["eval_accuracy"].astype("Float64") if "eval_accuracy" in runs else pd.Series(pd.NA, index=runs.index, dtype="Float64")
    tok = runs["eval_token_accuracy"].astype("Float64") if "eval_token_accuracy" in runs else pd.Series(pd.NA, index=runs.index, dtype="Float64")
    quality = acc.fillna(tok)
    has_acc, has_tok = acc.notna().any(), (tok.notna() & acc.isna()).any()
    if has_acc and has_tok:
        name = "eval accuracy (token accuracy for LM runs)"
    elif has_tok:
        name = "eval token accuracy"
    else:
        name = "eval accuracy"
    return quality, name


def short_device(name: str | None) -> str:
    if not isinstance(name, str) or not name:
        return "?"
    return re.sub(r"^(NVIDIA|Tesla)\s+", "", name).replace("GeForce ", "").strip()


def shorten(labels: pd.Series) -> pd.Series:
    """Drop the name parts every label shares (the one model, dataset, precision, ...): what is left is
    what tells the configurations apart. Labels are kept whole when that would leave one empty."""
    parts = labels.str.split("-")
    if len(labels.unique()) < 2:
        return labels
    common = set.intersection(*(set(p) for p in parts))
    short = parts.map(lambda p: "-".join(x for x in p if x not in common))
    return labels if (short == "").any() else short


def common_parts(runs: pd.DataFrame) -> str:
    """The name parts all configurations share (what shorten() dropped), for a figure's subtitle."""
    parts = strip_id(runs["run_id"]).str.split("-")
    if parts.empty or len(set(map(tuple, parts))) < 2:
        return ""
    common = set.intersection(*(set(p) for p in parts))
    return " ".join(x for x in parts.iloc[0] if x in common)


def strip_id(ids: pd.Series) -> pd.Series:
    """A run or config id without its hash (and repeat) suffix: the readable part."""
    return ids.astype(str).str.replace(r"(-rep\d+)?-[0-9a-f]{8}$", "", regex=True)


def settings_key(runs: pd.DataFrame) -> pd.Series:
    """A configuration key from the settings columns alone (comparable across machines and versions)."""
    columns = [c for c in CONFIG_COLUMNS if c in runs]
    if not columns:
        return pd.Series("", index=runs.index)
    return runs[columns].astype("string").fillna("-").agg("|".join, axis=1)


def prepare(runs: pd.DataFrame) -> pd.DataFrame:
    """The run table plus ``config_key`` (the configuration, and its device when several were used),
    ``config_label`` (readable, unique per key) and ``quality`` (see quality_column)."""
    runs = runs.copy().reset_index(drop=True)
    if "config_id" in runs and runs["config_id"].notna().all():
        ident, readable = runs["config_id"].astype(str), strip_id(runs["config_id"])
    else:  # tables written before config_id existed
        ident, readable = settings_key(runs), strip_id(runs["run_id"])
    device = runs["device_name"].astype("string").fillna("-") if "device_name" in runs else pd.Series("-", index=runs.index)
    runs["config_key"] = (ident + "|" + device).map(lambda key: hashlib.sha256(key.encode()).hexdigest()[:8])
    base = shorten(readable)
    if device[device != "-"].nunique() > 1:
        base = base + " @ " + runs["device_name"].map(short_device)
    labels = {}
    for label, group in runs.groupby(base, sort=False):
        keys_here = group["config_key"].unique()
        for key in keys_here:
            labels[key] = label if len(keys_here) == 1 else f"{label} [{key[:4]}]"
    runs["config_label"] = runs["config_key"].map(labels)
    runs["quality"], _ = quality_column(runs)
    return runs


def by_config(runs: pd.DataFrame, column: str, ok_only: bool = True) -> pd.DataFrame:
    """One row per configuration with data in ``column``: n, median, min, max, q1, q3, and its method."""
    data = ok_runs(runs) if ok_only else runs
    data = data[data[column].notna()]
    if data.empty:
        return pd.DataFrame(columns=["config_key", "config_label", "method", "n", "median", "min", "max", "q1", "q3"])
    values = data[column].astype(float)
    grouped = values.groupby(data["config_key"])
    out = pd.DataFrame({
        "n": grouped.size(),
        "median": grouped.median(),
        "min": grouped.min(),
        "max": grouped.max(),
        "q1": grouped.quantile(0.25),
        "q3": grouped.quantile(0.75),
    })
    first = data.drop_duplicates("config_key").set_index("config_key")
    out["config_label"] = first["config_label"]
    out["method"] = first["method"]
    return out.reset_index()


def gpu_capacity_mb(device_name: str | None, path: Path = GPUS_PATH) -> float | None:
    """Memory of one device (MiB): the size in the device's own name ("A100-SXM4-40GB", "H100 80GB HBM3")
    when it has one, else config/gpus.yaml's memory_gb for the first entry whose ``match`` fits; None
    when unknown."""
    if not isinstance(device_name, str):
        return None
    named = re.search(r"(\d+)\s*GB\b", device_name, flags=re.IGNORECASE)
    if named:
        return float(named.group(1)) * 1024
    if not path.is_file():
        return None
    try:
        entries = yaml.safe_load(path.read_text(encoding="utf-8")).get("gpus", [])
    except (OSError, yaml.YAMLError, AttributeError):
        return None
    for entry in entries:
        if re.search(entry.get("match", "$^"), device_name, flags=re.IGNORECASE):
            memory = entry.get("memory_gb")
            return float(memory) * 1024 if memory else None
    return None


def is_value(series: pd.Series, value) -> pd.Series:
    """A plain boolean mask ``series == value``, with null as False (pandas' nullable == gives NA)."""
    return series.eq(value).fillna(False).astype(bool)


def ok_runs(runs: pd.DataFrame) -> pd.DataFrame:
    return runs[is_value(runs["status"], "ok")]


def _by_method(frame: pd.DataFrame):
    """(method, rows) in the order full, lora, qlora, then any other."""
    methods = list(frame["method"].dropna().unique())
    for method in [m for m in METHOD_ORDER if m in methods] + sorted(set(methods) - set(METHOD_ORDER)):
        yield method, frame[is_value(frame["method"], method)]


def _method_colour(method) -> str:
    return METHOD_COLOURS.get(method, OTHER_COLOUR)


def _method_legend(ax, methods) -> None:
    from matplotlib.patches import Patch

    present = [m for m in METHOD_ORDER if m in set(methods)] + sorted(set(methods) - set(METHOD_ORDER))
    ax.legend(handles=[Patch(color=_method_colour(m), label=m) for m in present], title="method", fontsize=8, loc="best")


def _height(n: int) -> float:
    return min(2.0 + 0.42 * n, 24.0)


# ---------------------------------------------------------------------------------------------------
# The figures


def figure_peak_memory(runs: pd.DataFrame, steps: pd.DataFrame):
    measured = by_config(runs, "peak_memory_mb", ok_only=False)
    if measured.empty:
        return "no run recorded its peak memory"
    has_estimate = "memory_estimate_mb" in runs and runs["memory_estimate_mb"].notna().any()
    estimate = by_config(runs, "memory_estimate_mb", ok_only=False).set_index("config_key")["median"] if has_estimate else pd.Series(dtype=float)
    measured = measured.sort_values("median")
    # A configuration with no finished run (an OOM near the limit, say) says so in its label.
    finished = set(ok_runs(runs)["config_key"])
    statuses = runs.groupby("config_key")["status"].agg(lambda s: "/".join(sorted(set(s.astype(str)))))
    measured["config_label"] = [label if key in finished else f"{label} ({statuses[key]})"
                                for key, label in zip(measured["config_key"], measured["config_label"])]
    fig, ax = plt.subplots(figsize=(9, _height(len(measured))))
    y = np.arange(len(measured))
    width = 0.4 if has_estimate else 0.7
    ax.barh(y + (width / 2 if has_estimate else 0), measured["median"], height=width,
            color=[_method_colour(m) for m in measured["method"]], label="measured peak")
    if has_estimate:
        values = measured["config_key"].map(estimate).astype(float)
        ax.barh(y - width / 2, values, height=width, color="none", edgecolor="#555", hatch="///", label="estimate (before training)")
    capacities = {}
    gpu_runs = runs[is_value(runs["device"], "cuda")] if "device" in runs else runs.iloc[0:0]
    for name in gpu_runs["device_name"].dropna().unique():
        capacity = gpu_capacity_mb(name)
        if capacity:
            capacities.setdefault(capacity, []).append(short_device(name))
    for capacity, names in capacities.items():
        ax.axvline(capacity, color="#c44e52", linestyle="--", linewidth=1.2)
        ax.text(capacity, -0.45, f"{', '.join(names)}: {capacity / 1024:.0f} GiB ", color="#c44e52",
                fontsize=8, va="bottom", ha="right", rotation=90)
    ax.set_yticks(y, measured["config_label"], fontsize=8)
    ax.set_xlabel("peak memory (MiB), median of repeats")
    from matplotlib.patches import Patch

    handles = [Patch(color=_method_colour(m), label=f"measured: {m}") for m in METHOD_ORDER if m in set(measured["method"])]
    if has_estimate:
        handles.append(Patch(facecolor="none", edgecolor="#555", hatch="///", label="estimate"))
    ax.legend(handles=handles, fontsize=8, loc="lower right")
    fig.tight_layout()
    return fig


def figure_throughput(runs: pd.DataFrame, steps: pd.DataFrame):
    summary = by_config(runs, "tokens_per_s")
    if summary.empty:
        return "no run finished with a measured throughput"
    summary = summary.sort_values("median")
    fig, ax = plt.subplots(figsize=(9, _height(len(summary))))
    y = np.arange(len(summary))
    ax.barh(y, summary["median"], color=[_method_colour(m) for m in summary["method"]], alpha=0.85)
    spread = summary["n"] > 1
    if spread.any():
        ax.errorbar(summary.loc[spread, "median"], y[spread.to_numpy()],
                    xerr=[summary.loc[spread, "median"] - summary.loc[spread, "min"], summary.loc[spread, "max"] - summary.loc[spread, "median"]],
                    fmt="none", ecolor="#222", capsize=3, linewidth=1)
    ok = ok_runs(runs)
    ok = ok[ok["tokens_per_s"].notna()]
    position = dict(zip(summary["config_key"], y))
    ax.scatter(ok["tokens_per_s"].astype(float), ok["config_key"].map(position), color="#222", s=12, zorder=3, label="each repeat")
    ax.set_yticks(y, summary["config_label"], fontsize=8)
    ax.set_xlabel("tokens/s, all devices (bar: median of repeats; whiskers: min-max)")
    _method_legend(ax, summary["method"])
    fig.tight_layout()
    return fig


def figure_accuracy_vs_memory(runs: pd.DataFrame, steps: pd.DataFrame):
    ok = ok_runs(runs)
    ok = ok[ok["quality"].notna() & ok["peak_memory_mb"].notna()]
    if ok.empty:
        return "no finished run has both an accuracy and a peak memory"
    _, name = quality_column(ok)
    fig, ax = plt.subplots(figsize=(8, 5))
    for method, group in _by_method(ok):
        ax.scatter(group["peak_memory_mb"].astype(float), group["quality"].astype(float), color=_method_colour(method), label=method, s=40, alpha=0.85)
    ax.set_xlabel("peak memory (MiB)")
    ax.set_ylabel(name)
    ax.legend(title="method", fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return fig


def figure_cost(runs: pd.DataFrame, steps: pd.DataFrame):
    if "cost_per_1m_tokens" not in runs:
        return "the table has no cost columns"
    summary = by_config(runs, "cost_per_1m_tokens")
    if summary.empty:
        return "no finished run has a price (see the warnings: its device is not in the price table)"
    summary = summary.sort_values("median", ascending=False)
    fig, ax = plt.subplots(figsize=(9, _height(len(summary))))
    y = np.arange(len(summary))
    ax.barh(y, summary["median"], color=[_method_colour(m) for m in summary["method"]])
    for yi, value in zip(y, summary["median"]):
        ax.text(value, yi, f" ${value:.3g}", va="center", fontsize=8)
    ax.set_yticks(y, summary["config_label"], fontsize=8)
    ax.set_xlabel("$ per 1M training tokens (median of repeats)")
    ax.set_xlim(0, float(summary["median"].max()) * 1.18)
    _method_legend(ax, summary["method"])
    fig.tight_layout()
    return fig


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


def figure_accuracy_vs_cost(runs: pd.DataFrame, steps: pd.DataFrame):
    if "cost_per_1m_tokens" not in runs:
        return "the table has no cost columns"
    ok = ok_runs(runs)
    ok = ok[ok["quality"].notna() & ok["cost_per_1m_tokens"].notna()]
    if ok.empty:
        return "no finished run has both an accuracy and a cost"
    _, name = quality_column(ok)
    points = ok.groupby("config_key").agg(
        cost=("cost_per_1m_tokens", "median"), quality=("quality", "median"), method=("method", "first"), label=("config_label", "first"))
    points = points.astype({"cost": float, "quality": float})
    front = pareto_front(points)
    fig, ax = plt.subplots(figsize=(8, 5))
    for method, group in _by_method(points):
        ax.scatter(group["cost"], group["quality"], color=_method_colour(method), label=method, s=40, alpha=0.85, zorder=3)
    ax.plot(front["cost"], front["quality"], color="#222", linewidth=1.2, drawstyle="steps-post", zorder=2, label="Pareto front")
    ax.scatter(front["cost"], front["quality"], facecolor="none", edgecolor="#222", s=140, linewidth=1.4, zorder=4)
    for _, row in front.iterrows():
        ax.annotate(row["label"], (row["cost"], row["quality"]), fontsize=7, xytext=(6, -10), textcoords="offset points")
    ax.set_xlabel("$ per 1M training tokens")
    ax.set_ylabel(name)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return fig


def figure_scaling(runs: pd.DataFrame, steps: pd.DataFrame):
    gpu = ok_runs(runs)
    gpu = gpu[is_value(gpu["device"], "cuda") & gpu["tokens_per_s"].notna()].copy()
    if gpu.empty:
        return "no finished run trained on a GPU"
    gpu["devices"] = gpu["world_size"].fillna(1).astype(int)
    if gpu["devices"].nunique() < 2:
        return "every GPU run used the same number of GPUs"
    base_columns = [c for c in CONFIG_COLUMNS if c not in ("num_gpus", "parallel") and c in gpu] + ["device_name"]
    gpu["base"] = gpu[base_columns].astype("string").fillna("-").agg("|".join, axis=1)
    gpu["base_label"] = gpu["config_label"].str.replace(r"-(dp|ddp)\d+", "", regex=True)
    fig, ax = plt.subplots(figsize=(8, 5))
    drawn = False
    multi_base = gpu["base"].nunique() > 1
    for base, group in gpu.groupby("base", sort=False):
        if group["devices"].nunique() < 2:
            continue
        medians = group.groupby(["parallel", "devices"])["tokens_per_s"].median().astype(float)
        single = group[group["devices"] == 1]["tokens_per_s"].astype(float)
        prefix = f"{group['base_label'].iloc[0]}: " if multi_base else ""
        for parallel in medians.index.get_level_values(0).unique():
            series = medians.loc[parallel]
            if parallel != "single" and not single.empty:
                series = pd.concat([pd.Series({1: single.median()}), series]).sort_index()
            ax.plot(series.index, series.values, marker="o", color=PARALLEL_COLOURS.get(parallel, OTHER_COLOUR), label=f"{prefix}{parallel}")
        if not single.empty:
            counts = np.array(sorted(group["devices"].unique()))
            ax.plot(counts, single.median() * counts, linestyle="--", color="#888", label=f"{prefix}ideal (linear from 1 GPU)")
        drawn = True
    if not drawn:
        return "no configuration was measured at more than one GPU count"
    ax.set_xlabel("GPUs")
    ax.set_ylabel("tokens/s, all GPUs together")
    ax.set_xticks(sorted(gpu["devices"].unique()))
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return fig


def figure_step_time(runs: pd.DataFrame, steps: pd.DataFrame):
    if steps.empty or "step_time_s" not in steps:
        return "no per-step records"
    measured = steps[steps["measured"].astype(bool)] if "measured" in steps else steps
    # Only finished runs: a diverged or timed-out run's steps are not a configuration's step time.
    measured = measured[measured["run_id"].isin(runs.loc[runs["status"] == "ok", "run_id"])]
    if measured.empty:
        return "no finished run has measured steps"
    order = (measured.groupby("run_id")["step_time_s"].median().sort_values().index.tolist())
    labels = runs.set_index("run_id")
    data = [measured.loc[measured["run_id"] == run_id, "step_time_s"].astype(float).to_numpy() for run_id in order]
    fig, ax = plt.subplots(figsize=(9, _height(len(order))))
    parts = ax.boxplot(data, vert=False, widths=0.6, patch_artist=True, showfliers=True, flierprops={"markersize": 3})
    for patch, run_id in zip(parts["boxes"], order):
        patch.set_facecolor(_method_colour(labels.loc[run_id, "method"]))
        patch.set_alpha(0.8)
    ax.set_yticks(np.arange(1, len(order) + 1), [_run_label(labels, run_id) for run_id in order], fontsize=8)
    ax.set_xlabel("seconds per optimizer step (measured window)")
    _method_legend(ax, labels.loc[order, "method"])
    fig.tight_layout()
    return fig


def _run_label(labels: pd.DataFrame, run_id: str) -> str:
    row = labels.loc[run_id]
    repeats = (labels["config_key"] == row["config_key"]).sum()
    return f"{row['config_label']} #{row['repeat']}" if repeats > 1 else row["config_label"]


def figure_loss_curves(runs: pd.DataFrame, steps: pd.DataFrame):
    if steps.empty or "loss" not in steps:
        return "no per-step records"
    steps = steps[steps["run_id"].isin(runs["run_id"]) & steps["loss"].notna()]
    if steps.empty:
        return "no run recorded a training loss"
    labels = runs.set_index("run_id")
    fig, ax = plt.subplots(figsize=(9, 5))
    styles = ["-", "--", ":", "-."]
    for index, (run_id, group) in enumerate(steps.groupby("run_id", sort=True)):
        method = labels.loc[run_id, "method"]
        ax.plot(group["step"], group["loss"].astype(float), linewidth=1.2, color=_method_colour(method),
                linestyle=styles[index % len(styles)], label=_run_label(labels, run_id))
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("training loss")
    ax.grid(alpha=0.3)
    count = steps["run_id"].nunique()
    if count <= 16:
        ax.legend(fontsize=7, loc="upper right")
    fig.tight_layout()
    return fig


@dataclass(frozen=True)
class FigureSpec:
    name: str
    title: str
    draw: Callable[[pd.DataFrame, pd.DataFrame], "plt.Figure | str"]

    @property
    def caption(self) -> str:
        return caption(self.name)


FIGURES = [
    FigureSpec("peak_memory", "Peak memory", figure_peak_memory),
    FigureSpec("throughput", "Throughput", figure_throughput),
    FigureSpec("accuracy_vs_memory", "Accuracy vs peak memory", figure_accuracy_vs_memory),
    FigureSpec("cost", "Cost per 1M tokens", figure_cost),
    FigureSpec("accuracy_vs_cost", "Accuracy vs cost", figure_accuracy_vs_cost),
    FigureSpec("scaling", "Scaling", figure_scaling),
    FigureSpec("step_time", "Step-time distribution", figure_step_time),
    FigureSpec("loss_curves", "Loss curves", figure_loss_curves),
]


def draw(spec: FigureSpec, runs: pd.DataFrame, steps: pd.DataFrame):
    """Draw one figure (a Figure, or the note saying why it is left out), titled with what all the
    configurations share (the parts their labels leave out)."""
    result = spec.draw(runs, steps)
    if not isinstance(result, str):
        shared = common_parts(runs)
        if shared and result.axes:
            result.axes[0].set_title(f"all runs: {shared}", loc="left", fontsize=9, color="#444")
            result.tight_layout()
    return result


def caption(name: str) -> str:
    """The figure's one-sentence caption (rules/captions/figures/<name>.rst), as plain text."""
    text = (CAPTIONS_DIR / f"{name}.rst").read_text(encoding="utf-8")
    return " ".join(text.split())


def captions() -> dict[str, str]:
    return {figure.name: figure.caption for figure in FIGURES}
