"""The report's figures, drawn with seaborn from the tables of analysis.py: one function per figure.

A figure function takes the prepared run table (analysis.prepare, with analysis.add_step_figures), the
per-step table and the configurations (analysis.configurations) and returns a seaborn grid, or a string
saying why there is nothing to draw (the page prints that note instead of an empty axis); the note
names what is really missing. Per-configuration figures get a panel per model and per dataset when
there are several. Whiskers and error bars are the 95% intervals the report ranks with.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import matplotlib

matplotlib.use("Agg")  # no display on cluster nodes and CI

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
import seaborn as sns  # noqa: E402
from matplotlib.lines import Line2D  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402

from ftbench.report import analysis, quality_target, scaling
from ftbench import atomic  # noqa: E402
from ftbench.report.analysis import measured_runs, ok_runs  # noqa: E402

METHOD_COLOURS = {"full": "#4c72b0", "lora": "#dd8452", "qlora": "#55a868"}
OTHER_COLOUR = "#8172b3"
IDEAL = "ideal (linear from single on 1 GPU)"
PARALLEL_COLOURS = {"single": "#4c72b0", "dp": "#c44e52", "ddp": "#55a868", "fsdp": "#8172b3", "fsdp+offload": "#937860",
                    IDEAL: "#888888"}
CAPACITY_COLOUR = "#c44e52"
DOT_COLOUR = "#222222"
TIMEOUT_COLOUR = "#c44e52"
INTERVAL_COLOUR = "#777777"
EACH_RUN = {"each run": Line2D([], [], marker="o", linestyle="", color=DOT_COLOUR, markersize=4)}
TIMED_OUT = {"timed out (its measured steps)": Line2D([], [], marker="X", linestyle="", color=TIMEOUT_COLOUR, markersize=6)}


def _palette(methods) -> dict[str, str]:
    return {method: METHOD_COLOURS.get(method, OTHER_COLOUR) for method in methods}


def _method_legend(grid: sns.FacetGrid, methods, **extra) -> None:
    """One legend for the whole figure: a patch per method, then any extra entries (label -> handle)."""
    handles = {method: Patch(color=colour) for method, colour in _palette(methods).items()}
    grid.add_legend(legend_data={**handles, **extra}, title="method")


def _panel_titles(grid: sns.FacetGrid, layout: dict) -> None:
    """A (model, dataset) panel is titled with the pair alone, not 'panel = ...'."""
    if layout.get("col") == analysis.PANEL:
        grid.set_titles("{col_name}")


def _height(rows: int) -> float:
    """Figure height (inches) for a panel listing ``rows`` configurations."""
    return min(1.6 + 0.38 * rows, 24.0)


# ---------------------------------------------------------------------------------------------------
# Bars per configuration: the configuration's figure, its 95% interval, a dot per repeat


def _statuses_in_label(runs: pd.DataFrame, shown: pd.DataFrame, status_free: set[str]) -> pd.DataFrame:
    """``shown`` with each configuration that has no run of ``status_free`` statuses labelled with its
    runs' statuses ('full-b64 (oom)'), so a bar from unfinished runs says so."""
    statuses = runs.groupby("config_key")["status"].agg(lambda s: "/".join(sorted(set(s.astype(str)))))
    plain = set(runs.loc[runs["status"].isin(status_free), "config_key"])
    marked = ~shown["config_key"].isin(plain)
    shown = shown.copy()
    shown.loc[marked, "config_label"] += " (" + shown.loc[marked, "config_key"].map(statuses) + ")"
    return shown


def _configuration_bars(runs: pd.DataFrame, value: str, xlabel: str, largest_first: bool,
                        summary: pd.DataFrame | None = None, decorate: Callable | None = None,
                        legend_extra: dict | None = None) -> sns.FacetGrid:
    """Horizontal bars of ``value`` per configuration label, coloured by method, a dot per run (an X per
    timed-out run). With ``summary`` (indexed by config_key: ``value``, ``low``, ``high``) the bar is the
    configuration's figure and the whiskers its 95% interval; without, the bar is the median of the
    runs and the whiskers their range. ``decorate(ax, panel_data, order)`` adds to each panel."""
    runs, layout = analysis.faceted(runs.assign(**{value: runs[value].astype(float)}))
    methods = analysis.method_order(runs["method"])
    keys = analysis.panel_columns(layout)
    per_panel = runs.groupby(keys)["config_label"].nunique().max() if keys else runs["config_label"].nunique()
    width = 9.0 if layout["col"] is None else 6.0
    height = _height(per_panel)
    grid = sns.FacetGrid(runs, **layout, sharey=False, height=height, aspect=width / height, margin_titles=True)
    timed_out = runs["status"].eq("timeout").any()

    def draw(data: pd.DataFrame, **_) -> None:
        """One panel: ``data`` holds its runs (FacetGrid passes it by that name)."""
        panel, ax = data, plt.gca()
        if summary is None:
            bars = panel.groupby("config_label", as_index=False).agg(**{value: (value, "median"), "method": ("method", "first")})
        else:
            labels = panel.groupby("config_key")["config_label"].first()
            bars = summary.loc[labels.index].assign(config_label=labels).reset_index(drop=True)
        bars = bars.sort_values(value, ascending=not largest_first, kind="stable")
        order = list(bars["config_label"])
        sns.barplot(bars, x=value, y="config_label", order=order, hue="method", hue_order=methods, palette=_palette(methods),
                    errorbar=None, dodge=False, legend=False, ax=ax)
        if summary is None:
            spans = panel.groupby("config_label")[value].agg(["min", "max"]).reindex(order).to_numpy()
        else:
            spans = bars[["low", "high"]].to_numpy(dtype=float)
        for position, (low, high) in enumerate(spans):
            if pd.notna(low) and pd.notna(high):
                # Lines, not a collection: the collections of the axis are the dots, one per run.
                ax.plot([low, high], [position, position], color=DOT_COLOUR, linewidth=1)
                for end in (low, high):
                    ax.plot([end, end], [position - 0.15, position + 0.15], color=DOT_COLOUR, linewidth=1)
        normal = panel[~panel["status"].eq("timeout")]
        if not normal.empty:
            sns.stripplot(normal, x=value, y="config_label", order=order, color=DOT_COLOUR, size=3.5, jitter=0.12, ax=ax)
        if timed_out and panel["status"].eq("timeout").any():
            sns.stripplot(panel[panel["status"].eq("timeout")], x=value, y="config_label", order=order, color=TIMEOUT_COLOUR,
                          marker="X", size=6, jitter=0.12, ax=ax)
        if decorate:
            decorate(ax, panel, order)

    grid.map_dataframe(draw)
    _panel_titles(grid, layout)
    grid.set_axis_labels(xlabel, "")
    each_run = EACH_RUN if not runs["status"].eq("timeout").all() else {}
    _method_legend(grid, methods, **each_run, **(TIMED_OUT if timed_out else {}), **(legend_extra or {}))
    return grid


def _summary(configs: pd.DataFrame, value: str, low: str, high: str) -> pd.DataFrame:
    """The configurations' ``value`` with its interval as ``low`` and ``high``, by config_key."""
    return configs.set_index("config_key")[[value, low, high, "method"]].rename(columns={low: "low", high: "high"})


def _bar_label(configs: pd.DataFrame, what: str) -> str:
    """An axis label saying what the bar and the whiskers of a configuration are."""
    scoring = analysis.REPEAT_SCORING[configs.attrs.get("scoring", "median")]
    return (f"{what}: bar {scoring}, whiskers 95% interval (t over 3+ repeats, else within-run)")


def _no_throughput(runs: pd.DataFrame, where: str = "") -> str:
    """Why no run has a throughput to draw: the statuses of the runs, each with its count."""
    counts = analysis.unmeasured_counts(runs)
    statuses = ", ".join(f"{count} {status}" for status, count in counts.items())
    return f"no run measured a throughput{where} ({statuses}; their reasons are in the runs table)"


def figure_peak_memory(runs: pd.DataFrame, steps: pd.DataFrame, configs: pd.DataFrame):
    measured = runs[runs["peak_memory_mb"].notna()]
    if measured.empty:
        return "no run recorded its peak memory"
    # A configuration with no finished run (an OOM near the limit, say) says so in its label.
    measured = _statuses_in_label(runs, measured, {"ok"})
    # The estimate models allocated memory: the allocated peak is drawn beside it; the bar is reserved.
    markers = {}
    if measured["peak_memory_allocated_mb"].notna().any():
        markers["peak_memory_allocated_mb"] = ("allocated peak (CUDA)", {"marker": "|", "s": 160, "linewidth": 2, "color": DOT_COLOUR})
    if measured["memory_estimate_mb"].notna().any():
        markers["memory_estimate_mb"] = ("estimate before training (models allocated)",
                                         {"marker": "D", "s": 30, "facecolor": "white", "edgecolor": DOT_COLOUR})

    def decorate(ax, panel: pd.DataFrame, order: list[str]) -> None:
        for column, (_, style) in markers.items():
            values = panel.groupby("config_label")[column].median().astype(float).reindex(order)
            drawn = values.notna().to_numpy()
            if drawn.any():  # a panel of runs without the figure (no estimate for their task) has no marker
                ax.scatter(values[drawn].to_numpy(), np.arange(len(order))[drawn], zorder=4, **style)
        gpus = panel[panel["device"].isin(["cuda"]) & panel["device_memory_mb"].notna()]
        for capacity, names in gpus.groupby("device_memory_mb")["device_name"].unique().items():
            ax.axvline(capacity, color=CAPACITY_COLOUR, linestyle="--", linewidth=1.2)
            ax.text(capacity, len(order) - 0.6, f"{', '.join(map(analysis.short_device, names))}: {capacity / 1024:.0f} GiB ",
                    color=CAPACITY_COLOUR, fontsize=8, va="bottom", ha="right", rotation=90)

    extra = {label: Line2D([], [], linestyle="", marker=style["marker"], markersize=9 if style["marker"] == "|" else 5,
                           markeredgewidth=2 if style["marker"] == "|" else 1, color=DOT_COLOUR,
                           markerfacecolor=style.get("facecolor", DOT_COLOUR))
             for label, style in markers.values()}
    return _configuration_bars(measured, "peak_memory_mb",
                               "peak memory (MiB): bar CUDA reserved (peak RSS on a CPU), median of repeats, whiskers min-max",
                               largest_first=True, decorate=decorate, legend_extra=extra)


def figure_throughput(runs: pd.DataFrame, steps: pd.DataFrame, configs: pd.DataFrame):
    measured = measured_runs(runs)
    if measured.empty:
        return _no_throughput(runs)
    measured = _statuses_in_label(runs, measured, {"ok"})
    return _configuration_bars(measured, "tokens_per_s", _bar_label(configs, "tokens/s, all devices"), largest_first=True,
                               summary=_summary(configs, "tokens_per_s", "tokens_per_s_low", "tokens_per_s_high"))


def figure_cost(runs: pd.DataFrame, steps: pd.DataFrame, configs: pd.DataFrame):
    measured = measured_runs(runs)
    if measured.empty:
        return _no_throughput(runs)
    priced = measured[measured["cost_per_1m_tokens"].notna()]
    if priced.empty:
        return "no run with a measured throughput has a price (the notes name the devices missing from the price table)"
    priced = _statuses_in_label(runs, priced, {"ok"})

    def label_bars(ax, panel: pd.DataFrame, order: list[str]) -> None:
        for container in ax.containers:
            if hasattr(container, "datavalues"):  # the bars (the whiskers are lines)
                ax.bar_label(container, labels=[f"${v:.3g}" for v in container.datavalues], label_type="center",
                             fontsize=8, color="white", fontweight="bold")

    return _configuration_bars(priced, "cost_per_1m_tokens", _bar_label(configs, "$ per 1M training tokens"), largest_first=False,
                               summary=_summary(configs, "cost_per_1m_tokens", "cost_low", "cost_high"), decorate=label_bars)


# ---------------------------------------------------------------------------------------------------
# Accuracy against memory and cost


def _no_quality(runs: pd.DataFrame, also: str) -> str:
    """Why no run has a quality figure (and ``also``) to draw: none finished (only a finished run's
    quality judges its configuration), the finished ones trained on synthetic data, or they lack ``also``."""
    ok = ok_runs(runs)
    if ok.empty:
        statuses = ", ".join(f"{count} {status}" for status, count in sorted(runs["status"].astype(str).value_counts().items()))
        return f"no run finished, and only a finished run's quality is compared ({statuses})"
    if ok["data_kind"].eq(analysis.SYNTHETIC).all():
        return "every finished run trained on synthetic (random-token) data, whose accuracy measures nothing"
    if ok["quality"].isna().all():
        return "no finished run has a quality figure for its task"
    return f"no finished run has both a quality figure and {also}"


def _error_bars(ax, data: pd.DataFrame, x: str, y: str, x_span: tuple[str, str] | None, y_span: tuple[str, str]) -> None:
    """Grey 95% interval bars behind the points (a missing end draws no bar)."""
    def offsets(centre: str, span: tuple[str, str]):
        low, high = data[span[0]].astype(float), data[span[1]].astype(float)
        return [(data[centre] - low).clip(lower=0).fillna(0).to_numpy(), (high - data[centre]).clip(lower=0).fillna(0).to_numpy()]

    ax.errorbar(data[x], data[y], xerr=offsets(x, x_span) if x_span else None, yerr=offsets(y, y_span), fmt="none",
                ecolor=INTERVAL_COLOUR, elinewidth=0.9, capsize=2, zorder=1)


def figure_accuracy_vs_memory(runs: pd.DataFrame, steps: pd.DataFrame, configs: pd.DataFrame):
    ok = ok_runs(runs)
    ok = ok[ok["quality"].notna() & ok["peak_memory_mb"].notna()]
    if ok.empty:
        return _no_quality(runs, "a peak memory")
    _, name = analysis.quality_column(ok)
    ok = ok.astype({"quality": float, "peak_memory_mb": float, "quality_low": float, "quality_high": float})
    methods = analysis.method_order(ok["method"])
    ok, layout = analysis.faceted(ok)
    grid = sns.relplot(ok, kind="scatter", x="peak_memory_mb", y="quality", hue="method", hue_order=methods,
                       palette=_palette(methods), s=60, alpha=0.85, height=5, aspect=1.5, zorder=3, **layout)
    _panel_titles(grid, layout)
    grid.map_dataframe(lambda data, **_: _error_bars(plt.gca(), data, "peak_memory_mb", "quality", None,
                                                     ("quality_low", "quality_high")))
    grid.set_axis_labels("peak memory (MiB): CUDA reserved, peak RSS on a CPU", f"{name} (bars: 95% Wilson interval)")
    return grid


def figure_accuracy_vs_cost(runs: pd.DataFrame, steps: pd.DataFrame, configs: pd.DataFrame):
    points = analysis.accuracy_and_cost(configs)
    if points.empty:
        measured = measured_runs(runs)
        if not measured.empty and measured["cost_per_1m_tokens"].isna().all():
            return "no run with a measured throughput has a price (the notes name the devices missing from the price table)"
        return _no_quality(runs, "a cost") if not measured.empty else _no_throughput(runs)
    _, name = analysis.quality_column(runs[runs["config_key"].isin(points.index)])
    methods = analysis.method_order(points["method"])
    points, layout = analysis.faceted(points)
    grid = sns.relplot(points, kind="scatter", x="cost", y="quality", hue="method", hue_order=methods, palette=_palette(methods),
                       s=60, alpha=0.85, height=5, aspect=1.5, zorder=3, legend=False, **layout)
    _panel_titles(grid, layout)

    def front(data: pd.DataFrame, **_) -> None:
        ax = plt.gca()
        _error_bars(ax, data, "cost", "quality", ("cost_low", "cost_high"), ("quality_low", "quality_high"))
        line = data[data["on_front"]].sort_values("cost")
        ax.plot(line["cost"], line["quality"], color=DOT_COLOUR, linewidth=1.2, drawstyle="steps-post", zorder=2)
        ax.scatter(line["cost"], line["quality"], facecolor="none", edgecolor=DOT_COLOUR, s=160, linewidth=1.4, zorder=4)
        near = data[data["near_front"]]
        ax.scatter(near["cost"], near["quality"], facecolor="none", edgecolor=DOT_COLOUR, s=160, linewidth=1.2,
                   linestyle="--", zorder=4)
        for _, row in pd.concat([line, near]).iterrows():
            ax.annotate(row["label"], (row["cost"], row["quality"]), fontsize=7, xytext=(7, -11), textcoords="offset points")

    grid.map_dataframe(front)
    scoring = analysis.REPEAT_SCORING[configs.attrs.get("scoring", "median")]
    grid.set_axis_labels(f"$ per 1M training tokens ({scoring})", f"{name} (median of repeats)")
    _method_legend(grid, methods, **{
        "Pareto front": Line2D([], [], color=DOT_COLOUR, marker="o", markerfacecolor="none"),
        "within noise of the front": Line2D([], [], color=DOT_COLOUR, marker="o", markerfacecolor="none", linestyle="--"),
        "95% intervals": Line2D([], [], color=INTERVAL_COLOUR, linewidth=0.9)})
    return grid


def figure_quality_vs_cost(runs: pd.DataFrame, evals: pd.DataFrame):
    """The quality each configuration had reached against what its training had cost by then: a curve per
    configuration through its evaluations (quality_target.curves), its band their 95% intervals, a square at
    the final evaluation on the whole eval split, and the experiment's target as a horizontal line."""
    points, unit = quality_target.curves(runs, evals)
    if points.empty:
        if evals.empty:
            return "no run recorded evaluations (results/runs/<run>/evals.parquet)"
        return "no finished run with a measured throughput was evaluated on the figure"
    target = quality_target.target_of(runs)
    points, layout = analysis.faceted(points)
    labels = list(dict.fromkeys(points["config_label"]))
    colours = dict(zip(labels, sns.color_palette("tab10" if len(labels) <= 10 else "husl", len(labels))))
    grid = sns.FacetGrid(points, **layout, height=5, aspect=1.6, sharex=False, sharey=False)

    def draw(data: pd.DataFrame, **_) -> None:
        ax = plt.gca()
        for label, curve in data.groupby("config_label", sort=False):
            ax.plot(curve["x"], curve["value"], color=colours[label], marker="o", markersize=3, linewidth=1.3)
            band = curve.dropna(subset=["low", "high"])
            if not band.empty:
                ax.fill_between(band["x"].astype(float), band["low"].astype(float), band["high"].astype(float),
                                color=colours[label], alpha=0.12, linewidth=0)
            final = curve[curve["scope"] == "full"]
            ax.scatter(final["x"], final["value"], color=colours[label], marker="s", s=40, edgecolor=DOT_COLOUR, zorder=4)
        if target:
            ax.axhline(target["value"], color=TIMEOUT_COLOUR, linestyle="--", linewidth=1.2)

    grid.map_dataframe(draw)
    _panel_titles(grid, layout)
    metric = str(points["metric"].iloc[0]) if points["metric"].nunique() == 1 else "eval quality (each task's figure)"
    spent = "$ spent on training" if unit == "$" else "GPU-hours of training (no price)"
    grid.set_axis_labels(f"{spent}, at the measured rate (evaluation off the clock)", f"{metric} (band: 95% interval)")
    extra = {"final evaluation (whole eval split)": Line2D([], [], marker="s", linestyle="", color="#bbbbbb",
                                                         markeredgecolor=DOT_COLOUR)}
    if target:
        extra[f"target {target['metric']} {target['value']:g}"] = Line2D([], [], color=TIMEOUT_COLOUR, linestyle="--")
    grid.add_legend(legend_data={**{label: Line2D([], [], color=colour, marker="o") for label, colour in colours.items()},
                                 **extra}, title="configuration")
    return grid


# ---------------------------------------------------------------------------------------------------
# Scaling, step times, loss curves


def figure_scaling(runs: pd.DataFrame, steps: pd.DataFrame, configs: pd.DataFrame):
    """Global tokens/s (all GPUs together) against the GPU count, a line per parallel mode, for each series measured
    at two GPU counts or more (scaling.py), with the ideal line: the single-GPU throughput times the GPU count."""
    gpu = scaling.gpu_runs(runs)
    if gpu.empty:
        if measured_runs(runs).empty:
            return _no_throughput(runs, " on a GPU")
        return "no run with a measured throughput trained on a GPU"
    if gpu["gpus"].nunique() < 2:
        return "every GPU run used the same number of GPUs"
    table = scaling.scaling_table(runs, configs)
    table = table[table.groupby("series")["gpus"].transform("nunique") > 1]
    if table.empty:
        return "no configuration was measured at more than one GPU count"
    baseline = table["tokens_per_s"].where(table["baseline"]).groupby(table["series"]).transform("max")
    lines = _scaling_panels(table, {"tokens_per_s": ("tokens/s, all GPUs together (global)", baseline * table["gpus"])})
    return _mode_lines(lines, table)


def figure_scaling_per_gpu(table: pd.DataFrame):
    """``table``: scaling.scaling_table's. Per series, tokens/s per GPU and peak memory per GPU against the GPU
    count, a line per parallel mode; the ideal per-GPU throughput is the single-GPU one, whatever the count."""
    if table.empty:
        return "no configuration was measured beyond one GPU in mode single"
    baseline = table["tokens_per_s"].where(table["baseline"]).groupby(table["series"]).transform("max")
    lines = _scaling_panels(table, {
        "tokens_per_s_per_gpu": ("tokens/s per GPU (global / GPUs)", baseline),
        "peak_memory_reserved_mb": ("peak memory per GPU (MiB, CUDA reserved)", None),
    })
    return _mode_lines(lines, table)


def _scaling_panels(table: pd.DataFrame, quantities: dict[str, tuple[str, pd.Series | None]]) -> pd.DataFrame:
    """The long frame _mode_lines draws: a row per point and quantity (column -> (axis label, ideal values or
    None)), with the 95% interval where the quantity has one (``<column>_low`` / ``_high``)."""
    frames = []
    for column, (label, ideal) in quantities.items():
        low, high = (table[f"{column}{end}"] if f"{column}{end}" in table else table[column] for end in ("_low", "_high"))
        frames.append(pd.DataFrame({"series_label": table["series_label"], "quantity": label, "mode": table["mode"],
                                    "gpus": table["gpus"].astype(int), "value": table[column].astype(float),
                                    "low": low.astype(float), "high": high.astype(float),
                                    "ideal": ideal.astype(float) if ideal is not None else np.nan, "has_ideal": ideal is not None}))
    return pd.concat(frames, ignore_index=True)


def _mode_palette(modes: list[str]) -> dict[str, str]:
    """The parallel modes' colours: fixed for the common ones, the rest from seaborn's palette."""
    spare = iter(sns.color_palette("tab10").as_hex()[5:])
    return {mode: PARALLEL_COLOURS.get(mode) or next(spare, OTHER_COLOUR) for mode in modes}


def _mode_lines(lines: pd.DataFrame, table: pd.DataFrame) -> sns.FacetGrid:
    """A panel per series (rows) and quantity (columns): each mode's points joined by GPU count with their 95%
    interval as error bars, and the dashed ideal line where the quantity has one."""
    modes = sorted(lines["mode"].unique(), key=scaling.mode_rank)
    palette = _mode_palette(modes)
    several = lines["series_label"].nunique() > 1
    quantities = lines["quantity"].nunique() > 1
    grid = sns.FacetGrid(lines, row="series_label" if several else None, col="quantity" if quantities else None,
                         sharey=False, height=3.6, aspect=1.5, margin_titles=True)

    def draw(data: pd.DataFrame, **_) -> None:
        ax = plt.gca()
        for mode in modes:
            line = data[data["mode"] == mode].sort_values("gpus")
            if line.empty:
                continue
            spread = [(line["value"] - line["low"]).clip(lower=0).fillna(0), (line["high"] - line["value"]).clip(lower=0).fillna(0)]
            ax.errorbar(line["gpus"], line["value"], yerr=spread, color=palette[mode], marker="o", capsize=3, linewidth=1.5)
        # the ideal is given at every point of a series with a baseline (none without: nothing is invented)
        ideal = data.dropna(subset=["ideal"]).drop_duplicates("gpus").sort_values("gpus")
        if len(ideal) > 1:
            ax.plot(ideal["gpus"], ideal["ideal"], color=PARALLEL_COLOURS[IDEAL], linestyle="--", linewidth=1.2)
        elif data["has_ideal"].all() and ideal.empty:
            ax.text(0.02, 0.04, "no baseline (single on 1 GPU): no ideal line", transform=ax.transAxes, fontsize=8,
                    color=INTERVAL_COLOUR)
        ax.set_xticks(sorted(table["gpus"].unique()))
        ax.set_ylabel(data["quantity"].iloc[0])
        ax.set_ylim(bottom=0)

    grid.map_dataframe(draw)
    if several or quantities:
        grid.set_titles(row_template="{row_name}", col_template="")
    if not several:  # one series: its name over the panels (the y labels say the quantity)
        for ax in grid.axes.flat:
            ax.set_title(lines["series_label"].iloc[0])
    grid.set_xlabels("GPUs")
    legend = {mode: Line2D([], [], color=colour, marker="o") for mode, colour in palette.items()}
    legend[IDEAL] = Line2D([], [], color=PARALLEL_COLOURS[IDEAL], linestyle="--")
    grid.add_legend(legend_data=legend, title="parallel mode (bars: 95% interval)")
    return grid


def figure_step_time(runs: pd.DataFrame, steps: pd.DataFrame, configs: pd.DataFrame):
    counted = measured_runs(runs)
    if counted.empty:
        return _no_throughput(runs)
    if steps.empty or "step_time_s" not in steps:
        return "no per-step records (results/runs/<run>/steps.parquet)"
    measured = steps[steps["measured"].astype(bool)] if "measured" in steps else steps
    # Only the measured runs: a diverged or failed run's steps are not a configuration's step time.
    measured = measured[measured["run_id"].isin(counted["run_id"])]
    if measured.empty:
        return "the runs with a measured throughput have no per-step records"
    runs = runs.set_index("run_id")
    # The run's label says what the reader must know before comparing it: timed out, unstable.
    marks = (runs["status"].eq("timeout").map({True: " (timeout)", False: ""})
             + runs["unstable"].eq(True).fillna(False).map({True: " (unstable)", False: ""}))
    labels = analysis.run_labels(runs.reset_index()) + marks
    data = measured.assign(run=measured["run_id"].map(labels), method=measured["run_id"].map(runs["method"]),
                           step_time_s=measured["step_time_s"].astype(float))
    order = list(data.groupby("run")["step_time_s"].median().sort_values().index)
    methods = analysis.method_order(data["method"])
    grid = sns.FacetGrid(data, height=_height(len(order)), aspect=9 / _height(len(order)))
    grid.map_dataframe(sns.boxplot, x="step_time_s", y="run", order=order, hue="method", hue_order=methods,
                       palette=_palette(methods), dodge=False, fliersize=3, width=0.6, legend=False)
    grid.set_axis_labels("seconds per optimizer step (measured window)", "")
    _method_legend(grid, methods)
    return grid


def figure_loss_curves(runs: pd.DataFrame, steps: pd.DataFrame, configs: pd.DataFrame):
    if steps.empty or "loss" not in steps:
        return "no per-step records (results/runs/<run>/steps.parquet)"
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


def figure_budget_cost(table: pd.DataFrame):
    """The budget's dollars per configuration (rows) on each GPU of the table (columns), from
    report/prediction.py's section table: measured where it ran there (marked (m), as the price matrix marks it;
    its * is the cheapest GPU that fits), else predicted; a GPU the
    configuration does not fit is left blank, and the figure's note names them."""
    cost = table["cost_of_budget_measured"].fillna(table["cost_of_budget_predicted"])
    shown = table.assign(cost=cost.astype(float))[table["fits"].isin(["yes", "borderline"]) & cost.notna()]
    if shown.empty:
        return "no configuration has a budget $ on a GPU it fits (no budget, or no price for the GPUs it fits)"
    grid = shown.pivot_table(index="configuration", columns="GPU", values="cost", aggfunc="first", sort=False)
    marks = shown.assign(mark=shown["cost_of_budget_measured"].notna()).pivot_table(
        index="configuration", columns="GPU", values="mark", aggfunc="first", sort=False).reindex_like(grid)
    text = grid.map(lambda value: "" if pd.isna(value) else f"${value:,.0f}" if value >= 100
                    else f"${value:.2f}" if value >= 1 else f"${value:.3g}")
    text = text.where(marks.isna() | ~marks.astype("boolean").fillna(False), text + "(m)")
    figure, ax = plt.subplots(figsize=(1.6 + 0.9 * grid.shape[1], _height(grid.shape[0])))
    sns.heatmap(np.log10(grid.astype(float)), annot=text, fmt="", cmap="viridis_r", cbar=False, ax=ax,
                linewidths=0.5, linecolor="white", annot_kws={"fontsize": 7})
    ax.set_xlabel("GPU (blank: does not fit)")
    ax.set_ylabel("")
    ax.set_title("$ of the budget's training steps ((m) measured, others predicted)", fontsize=9)
    return figure


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
# Drawn from scaling.scaling_table, in the report's scaling section (only where the runs used several GPU counts).
SCALING_PER_GPU = FigureSpec("scaling_per_gpu", "Throughput and memory per GPU", figure_scaling_per_gpu)
THROUGHPUT_RATIO = FigureSpec("throughput_ratio", "Throughput ratio across GPUs", figure_throughput_ratio)
# Drawn from report/prediction.py's section table, in the report's predicted speed and cost section.
BUDGET_COST = FigureSpec("budget_cost", "Budget $ per configuration and GPU", figure_budget_cost)
# Drawn from the runs and their evaluations (read_evals), not the steps: report_page draws it beside FIGURES.
QUALITY_VS_COST = FigureSpec("quality_vs_cost", "Quality vs cost to reach it", figure_quality_vs_cost)


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
