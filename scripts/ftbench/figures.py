"""The report's figures, drawn with seaborn from the tables of analysis.py: one function per figure.

A figure function takes the prepared run table (analysis.prepare) and the per-step table and returns a
seaborn grid, or a string saying why there is nothing to draw (the page prints that note instead of an
empty axis). Per-configuration figures get a panel per model and per dataset when there are several.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import matplotlib

matplotlib.use("Agg")  # no display on cluster nodes and CI

import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402
import seaborn as sns  # noqa: E402
from matplotlib.lines import Line2D  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402

from . import analysis, atomic  # noqa: E402
from .analysis import ok_runs  # noqa: E402

METHOD_COLOURS = {"full": "#4c72b0", "lora": "#dd8452", "qlora": "#55a868"}
OTHER_COLOUR = "#8172b3"
IDEAL = "ideal (linear from 1 GPU)"
PARALLEL_COLOURS = {"dp": "#c44e52", "ddp": "#55a868", IDEAL: "#888888"}
CAPACITY_COLOUR = "#c44e52"
DOT_COLOUR = "#222222"
EACH_RUN = {"each run": Line2D([], [], marker="o", linestyle="", color=DOT_COLOUR, markersize=4)}


def _palette(methods) -> dict[str, str]:
    return {method: METHOD_COLOURS.get(method, OTHER_COLOUR) for method in methods}


def _method_legend(grid: sns.FacetGrid, methods, **extra) -> None:
    """One legend for the whole figure: a patch per method, then any extra entries (label -> handle)."""
    handles = {method: Patch(color=colour) for method, colour in _palette(methods).items()}
    grid.add_legend(legend_data={**handles, **extra}, title="method")


def _height(rows: int) -> float:
    """Figure height (inches) for a panel listing ``rows`` configurations."""
    return min(1.6 + 0.38 * rows, 24.0)


# ---------------------------------------------------------------------------------------------------
# Bars per configuration: median of the repeats, whiskers min to max, a dot per repeat


def _configuration_bars(runs: pd.DataFrame, value: str, xlabel: str, largest_first: bool,
                        decorate: Callable | None = None, legend_extra: dict | None = None) -> sns.FacetGrid:
    """Bars of the median of ``value`` per configuration label, coloured by method; the whiskers span the
    repeats (min to max) and a dot marks each. ``decorate(ax, panel_data, order)`` adds to each panel."""
    runs = runs.assign(**{value: runs[value].astype(float)})
    methods = analysis.method_order(runs["method"])
    layout = analysis.panels(runs)
    keys = [column for column in layout.values() if column]
    per_panel = runs.groupby(keys)["config_label"].nunique().max() if keys else runs["config_label"].nunique()
    width = 9.0 if layout["col"] is None else 6.0
    height = _height(per_panel)
    grid = sns.FacetGrid(runs, **layout, sharey=False, height=height, aspect=width / height, margin_titles=True)

    def draw(data: pd.DataFrame, **_) -> None:
        """One panel: ``data`` holds its runs (FacetGrid passes it by that name)."""
        panel, ax = data, plt.gca()
        order = list(panel.groupby("config_label")[value].median().sort_values(ascending=not largest_first).index)
        sns.barplot(panel, x=value, y="config_label", order=order, hue="method", hue_order=methods, palette=_palette(methods),
                    estimator="median", errorbar=("pi", 100), capsize=0.3, err_kws={"color": DOT_COLOUR, "linewidth": 1},
                    dodge=False, legend=False, ax=ax)
        sns.stripplot(panel, x=value, y="config_label", order=order, color=DOT_COLOUR, size=3.5, jitter=0.12, ax=ax)
        if decorate:
            decorate(ax, panel, order)

    grid.map_dataframe(draw)
    grid.set_axis_labels(xlabel, "")
    _method_legend(grid, methods, **EACH_RUN, **(legend_extra or {}))
    return grid


def figure_peak_memory(runs: pd.DataFrame, steps: pd.DataFrame):
    measured = runs[runs["peak_memory_mb"].notna()].copy()
    if measured.empty:
        return "no run recorded its peak memory"
    # A configuration with no finished run (an OOM near the limit, say) says so in its label.
    finished = set(ok_runs(runs)["config_key"])
    statuses = runs.groupby("config_key")["status"].agg(lambda s: "/".join(sorted(set(s.astype(str)))))
    unfinished = ~measured["config_key"].isin(finished)
    measured.loc[unfinished, "config_label"] += " (" + measured.loc[unfinished, "config_key"].map(statuses) + ")"
    has_estimate = measured["memory_estimate_mb"].notna().any()

    def decorate(ax, panel: pd.DataFrame, order: list[str]) -> None:
        if has_estimate:
            estimate = panel.groupby("config_label")["memory_estimate_mb"].median().astype(float).reindex(order)
            ax.scatter(estimate.to_numpy(), range(len(order)), marker="D", s=30, facecolor="white", edgecolor=DOT_COLOUR, zorder=4)
        gpus = panel[panel["device"].isin(["cuda"]) & panel["device_memory_mb"].notna()]
        for capacity, names in gpus.groupby("device_memory_mb")["device_name"].unique().items():
            ax.axvline(capacity, color=CAPACITY_COLOUR, linestyle="--", linewidth=1.2)
            ax.text(capacity, len(order) - 0.6, f"{', '.join(map(analysis.short_device, names))}: {capacity / 1024:.0f} GiB ",
                    color=CAPACITY_COLOUR, fontsize=8, va="bottom", ha="right", rotation=90)

    estimate_entry = {"estimate (before training)": Line2D([], [], marker="D", linestyle="", markerfacecolor="white",
                                                            markeredgecolor=DOT_COLOUR, markersize=5)}
    return _configuration_bars(measured, "peak_memory_mb", "peak memory (MiB): bar median of repeats, whiskers min-max",
                               largest_first=True, decorate=decorate, legend_extra=estimate_entry if has_estimate else None)


def figure_throughput(runs: pd.DataFrame, steps: pd.DataFrame):
    ok = ok_runs(runs)
    ok = ok[ok["tokens_per_s"].notna()]
    if ok.empty:
        return "no run finished with a measured throughput"
    return _configuration_bars(ok, "tokens_per_s", "tokens/s, all devices: bar median of repeats, whiskers min-max",
                               largest_first=True)


def figure_cost(runs: pd.DataFrame, steps: pd.DataFrame):
    ok = ok_runs(runs)
    ok = ok[ok["cost_per_1m_tokens"].notna()]
    if ok.empty:
        return "no finished run has a price (see the warnings: its device is not in the price table)"

    def label_bars(ax, panel: pd.DataFrame, order: list[str]) -> None:
        for container in ax.containers:
            if hasattr(container, "datavalues"):  # the bars (the whiskers are lines)
                ax.bar_label(container, labels=[f"${v:.3g}" for v in container.datavalues], label_type="center",
                             fontsize=8, color="white", fontweight="bold")

    return _configuration_bars(ok, "cost_per_1m_tokens", "$ per 1M training tokens: bar median of repeats, whiskers min-max",
                               largest_first=False, decorate=label_bars)


# ---------------------------------------------------------------------------------------------------
# Accuracy against memory and cost


def figure_accuracy_vs_memory(runs: pd.DataFrame, steps: pd.DataFrame):
    ok = ok_runs(runs)
    ok = ok[ok["quality"].notna() & ok["peak_memory_mb"].notna()]
    if ok.empty:
        return "no finished run has both an accuracy and a peak memory"
    _, name = analysis.quality_column(ok)
    ok = ok.astype({"quality": float, "peak_memory_mb": float})
    methods = analysis.method_order(ok["method"])
    grid = sns.relplot(ok, kind="scatter", x="peak_memory_mb", y="quality", hue="method", hue_order=methods,
                       palette=_palette(methods), s=60, alpha=0.85, height=5, aspect=1.5, **analysis.panels(ok))
    grid.set_axis_labels("peak memory (MiB)", name)
    return grid


def figure_accuracy_vs_cost(runs: pd.DataFrame, steps: pd.DataFrame):
    points = analysis.accuracy_and_cost(runs)
    if points.empty:
        return "no finished run has both an accuracy and a cost"
    _, name = analysis.quality_column(runs[runs["config_key"].isin(points.index)])
    methods = analysis.method_order(points["method"])
    grid = sns.relplot(points, kind="scatter", x="cost", y="quality", hue="method", hue_order=methods, palette=_palette(methods),
                       s=60, alpha=0.85, height=5, aspect=1.5, zorder=3, legend=False, **analysis.panels(points))

    def front(data: pd.DataFrame, **_) -> None:
        line = data[data["on_front"]].sort_values("cost")
        ax = plt.gca()
        ax.plot(line["cost"], line["quality"], color=DOT_COLOUR, linewidth=1.2, drawstyle="steps-post", zorder=2)
        ax.scatter(line["cost"], line["quality"], facecolor="none", edgecolor=DOT_COLOUR, s=160, linewidth=1.4, zorder=4)
        for _, row in line.iterrows():
            ax.annotate(row["label"], (row["cost"], row["quality"]), fontsize=7, xytext=(7, -11), textcoords="offset points")

    grid.map_dataframe(front)
    grid.set_axis_labels("$ per 1M training tokens (median of repeats)", f"{name} (median of repeats)")
    _method_legend(grid, methods, **{"Pareto front": Line2D([], [], color=DOT_COLOUR, marker="o", markerfacecolor="none")})
    return grid


# ---------------------------------------------------------------------------------------------------
# Scaling, step times, loss curves


def figure_scaling(runs: pd.DataFrame, steps: pd.DataFrame):
    gpu = analysis.scaling(runs)
    if gpu.empty:
        return "no finished run trained on a GPU"
    if gpu["devices"].nunique() < 2:
        return "every GPU run used the same number of GPUs"
    lines = analysis.scaling_lines(gpu)
    if lines.empty:
        return "no configuration was measured at more than one GPU count"
    lines["parallel"] = lines["parallel"].replace({"ideal": IDEAL})
    modes = [mode for mode in PARALLEL_COLOURS if mode in set(lines["parallel"])]
    several = lines["series"].nunique() > 1
    grid = sns.relplot(lines, kind="line", x="devices", y="tokens_per_s", hue="parallel", hue_order=modes,
                       palette=PARALLEL_COLOURS, style="parallel", style_order=modes,
                       dashes={m: (4, 2) if m == IDEAL else "" for m in modes}, markers={m: "o" for m in modes},
                       col="series_label" if several else None, col_wrap=3 if several else None,
                       height=4.5, aspect=1.4, facet_kws={"sharey": False})
    grid.set(xticks=sorted(lines["devices"].unique()))
    grid.set_axis_labels("GPUs", "tokens/s, all GPUs together (median of repeats)")
    if several:
        grid.set_titles("{col_name}")
    return grid


def figure_step_time(runs: pd.DataFrame, steps: pd.DataFrame):
    if steps.empty or "step_time_s" not in steps:
        return "no per-step records"
    measured = steps[steps["measured"].astype(bool)] if "measured" in steps else steps
    # Only finished runs: a diverged or timed-out run's steps are not a configuration's step time.
    measured = measured[measured["run_id"].isin(ok_runs(runs)["run_id"])]
    if measured.empty:
        return "no finished run has measured steps"
    labels = analysis.run_labels(runs)
    methods_of = runs.set_index("run_id")["method"]
    data = measured.assign(run=measured["run_id"].map(labels), method=measured["run_id"].map(methods_of),
                           step_time_s=measured["step_time_s"].astype(float))
    order = list(data.groupby("run")["step_time_s"].median().sort_values().index)
    methods = analysis.method_order(data["method"])
    grid = sns.FacetGrid(data, height=_height(len(order)), aspect=9 / _height(len(order)))
    grid.map_dataframe(sns.boxplot, x="step_time_s", y="run", order=order, hue="method", hue_order=methods,
                       palette=_palette(methods), dodge=False, fliersize=3, width=0.6, legend=False)
    grid.set_axis_labels("seconds per optimizer step (measured window)", "")
    _method_legend(grid, methods)
    return grid


def figure_loss_curves(runs: pd.DataFrame, steps: pd.DataFrame):
    if steps.empty or "loss" not in steps:
        return "no per-step records"
    steps = steps[steps["run_id"].isin(runs["run_id"]) & steps["loss"].notna()]
    if steps.empty:
        return "no run recorded a training loss"
    labels = analysis.run_labels(runs)
    data = steps.assign(run=steps["run_id"].map(labels), method=steps["run_id"].map(runs.set_index("run_id")["method"]),
                        loss=steps["loss"].astype(float))
    methods = analysis.method_order(data["method"])
    # A legend entry per run while it stays readable; beyond that the colours say the method.
    per_run = data["run"].nunique() <= 16
    grid = sns.relplot(data, kind="line", x="step", y="loss", hue="method", hue_order=methods, palette=_palette(methods),
                       style="run" if per_run else None, units=None if per_run else "run_id", estimator=None,
                       linewidth=1.2, height=5, aspect=1.8)
    grid.set_axis_labels("optimizer step", "training loss")
    return grid


# ---------------------------------------------------------------------------------------------------
# compare: throughput on each device relative to the baseline device


def figure_throughput_ratio(devices: pd.DataFrame):
    """``devices``: compare.across_devices' table."""
    data = devices[devices["device"] != devices["baseline_device"]]
    if data.empty:
        return "every configuration ran on one device model only"
    data = data.assign(pair=data["configuration"] + " @ " + data["device"] + " vs " + data["baseline_device"],
                       faster=data["throughput_ratio"] >= 1).sort_values("throughput_ratio", ascending=False)
    grid = sns.FacetGrid(data, height=_height(len(data)), aspect=9 / _height(len(data)))
    grid.map_dataframe(sns.barplot, x="throughput_ratio", y="pair", hue="faster", palette={True: "#55a868", False: "#c44e52"},
                       errorbar=None, dodge=False, legend=False)
    for ax in grid.axes.flat:
        ax.axvline(1.0, color=DOT_COLOUR, linewidth=1)
        for container in ax.containers:
            ax.bar_label(container, fmt=" %.2fx", fontsize=8)
        ax.set_xlim(0, float(data["throughput_ratio"].max()) * 1.2)
    grid.set_axis_labels("tokens/s relative to the baseline device (1.0 = same)", "")
    return grid


# ---------------------------------------------------------------------------------------------------
# The list of figures, drawing and saving


@dataclass(frozen=True)
class FigureSpec:
    name: str
    title: str
    draw: Callable[..., "sns.FacetGrid | str"]


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
THROUGHPUT_RATIO = FigureSpec("throughput_ratio", "Throughput ratio across GPUs", figure_throughput_ratio)


def draw(spec: FigureSpec, *tables: pd.DataFrame, shared: str = ""):
    """Draw one figure from its tables: a grid, or the note saying why it is left out. ``shared``: what
    all the configurations share (the name parts their labels leave out), shown as its subtitle."""
    with sns.axes_style("whitegrid"), sns.plotting_context("notebook", font_scale=0.85):
        result = spec.draw(*tables)
    if not isinstance(result, str) and shared:
        result.figure.suptitle(f"all runs: {shared}", x=0.01, ha="left", fontsize=9, color="#444")
    return result


def save(drawn: dict[str, "sns.FacetGrid | str"], folder: str | Path) -> dict[str, Path | str]:
    """Write one PNG per drawn figure into ``folder`` (the notes of the others pass through): name -> PNG
    path or the note saying why the figure is left out."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    written: dict[str, Path | str] = {}
    for name, result in drawn.items():
        if isinstance(result, str):
            written[name] = result
            continue
        result.tight_layout()
        path = folder / f"{name}.png"
        with atomic.atomic_path(path) as tmp:
            result.figure.savefig(tmp, format="png", dpi=100)
        plt.close(result.figure)
        written[name] = path
    return written
