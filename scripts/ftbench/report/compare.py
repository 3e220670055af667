"""Merge result sets from different machines or clusters into one table and report.

Each result set is a ``metrics.parquet`` written by ``collect``; every row carries its environment
(host, device, driver, library versions), so sets from anywhere can be put side by side:

- the same configuration across GPUs: median tokens/s per device model, its ratio to the baseline
  device (the first set's), and $ per 1M tokens (re-priced with one price table by default, so the
  costs are comparable);
- node-to-node variance: the same configuration on the same device model on different hosts; a
  coefficient of variation (std / mean of the hosts' medians) above the threshold (default 5%) is flagged.

Configurations are matched across sets by their settings (analysis.prepare with across_machines).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pandas as pd

from ftbench.report import analysis, cost, figures, pages, report_page
from ftbench import atomic
from ftbench.measure import gpu_table as gpu_tables
from ftbench.report.analysis import measured_runs
from ftbench.report.collect import typed
from ftbench.report.columns import COLUMNS
from ftbench.errors import FtbenchError

SET_COLUMN = "result_set"
# The report's figures that compare drawn over every set's runs too.
SHARED_FIGURES = ("throughput", "cost", "accuracy_vs_cost", "peak_memory")
TITLES = {
    "throughput_ratio": "median tokens/s on this device / on the baseline device",
    "cost_ratio": "$ per 1M tokens on this device / on the baseline device",
    "cv": "std / mean of the hosts' median tokens/s",
    "host_medians": "median tokens/s per host",
}


def set_name(path: Path) -> str:
    """A result set's default name: the folder holding ``results/`` (or holding the file itself)."""
    path = path.resolve()
    folder = path.parent
    if folder.name == "results" and folder.parent.name:
        folder = folder.parent
    return folder.name or str(path)


def load_set(name: str | None, path: str | Path) -> tuple[str, pd.DataFrame, list[str]]:
    """(name, the set's table with exactly the documented columns, notes about columns it lacked)."""
    path = Path(path)
    if not path.is_file():
        raise FtbenchError(f"compare: result set {path} not found (expected a metrics.parquet written by collect)")
    frame = pd.read_parquet(path)
    missing = [c for c in COLUMNS if c not in frame]
    notes = []
    if "run_id" in missing or "status" in missing:
        raise FtbenchError(f"compare: {path} is not an ftbench metrics table (no run_id/status columns)")
    if missing:
        notes.append(f"{path}: written by an older ftbench, lacks {len(missing)} column(s) ({', '.join(missing[:6])}"
                     f"{', ...' if len(missing) > 6 else ''}); they are empty")
    name = name or set_name(path)
    return name, typed(frame), notes


def merge(sets: list[tuple[str | None, str | Path]], prices: cost.Prices | None = None) -> tuple[pd.DataFrame, list[str]]:
    """All sets in one table (the documented columns plus ``result_set``), re-priced when ``prices`` is given."""
    frames, notes, names, sources = [], [], [], {}
    for name, path in sets:
        name, frame, set_notes = load_set(name, path)
        if name in names:
            name = f"{name}-{len(names) + 1}"
        names.append(name)
        sources[name] = str(path)
        frame.insert(0, SET_COLUMN, name)
        frames.append(frame)
        notes.extend(set_notes)
    merged = pd.concat(frames, ignore_index=True)
    if prices is not None:
        old_gpu_hours = merged["projected_gpu_hours"].copy()
        repriced, price_warnings = cost.add_costs(merged.drop(columns=[SET_COLUMN]), prices, warn=False)
        # Projections made from a budget at collect time keep their GPU-hours; only the price changes.
        keep = repriced["projected_gpu_hours"].isna() & old_gpu_hours.notna()
        repriced.loc[keep, "projected_gpu_hours"] = old_gpu_hours[keep]
        repriced.loc[keep, "projected_cost"] = old_gpu_hours[keep] * repriced.loc[keep, "price_per_device_hour"]
        merged = pd.concat([merged[[SET_COLUMN]], typed(repriced)], axis=1)
        notes.extend(sorted(set(price_warnings)))
    merged.attrs["sources"] = sources  # result set name -> the file it came from
    return merged, notes


def _finished(runs: pd.DataFrame) -> pd.DataFrame:
    """The runs with a measured throughput (finished or timed out: analysis.measured_runs), with their
    short ``device`` name."""
    ok = measured_runs(runs).copy()
    ok["device"] = ok["device_name"].fillna("unknown device").map(analysis.short_device)
    ok["tokens_per_s"] = ok["tokens_per_s"].astype(float)
    return ok


def across_devices(runs: pd.DataFrame) -> pd.DataFrame:
    """One row per (configuration, device model) of prepared runs: median tokens/s and $ per 1M tokens at that
    median, with ratios to the baseline device (the device of the first result set that ran this configuration)."""
    columns = ["configuration", "device", "result_sets", "hosts", "runs", "tokens_per_s", "throughput_ratio",
               "cost_per_1m_tokens", "cost_ratio", "baseline_device"]
    ok = _finished(runs)
    if ok.empty:
        return pd.DataFrame(columns=columns)
    set_order = {name: index for index, name in enumerate(runs[SET_COLUMN].unique())}
    ok["set_index"] = ok[SET_COLUMN].map(set_order)
    table = ok.groupby(["config", "device"], sort=False).agg(
        configuration=("config_name", "first"),
        result_sets=(SET_COLUMN, lambda s: ", ".join(sorted(s.unique(), key=set_order.get))),
        first_set=("set_index", "min"),
        hosts=("host", "nunique"),
        runs=("run_id", "size"),
        tokens_per_s=("tokens_per_s", "median"),
        price_per_hour=("price_per_hour", "median"),
    ).reset_index()
    # at the median throughput, so cost_ratio = price ratio / throughput ratio exactly
    table["cost_per_1m_tokens"] = [cost.cost_per_1m_tokens(None if analysis.is_missing(price) else float(price), speed)
                                   for price, speed in zip(table["price_per_hour"], table["tokens_per_s"])]
    table["cost_per_1m_tokens"] = table["cost_per_1m_tokens"].astype(float)
    baseline = table.loc[table.groupby("config", sort=False)["first_set"].idxmin()].set_index("config")
    table["baseline_device"] = table["config"].map(baseline["device"])
    table["throughput_ratio"] = table["tokens_per_s"] / table["config"].map(baseline["tokens_per_s"])
    table["cost_ratio"] = table["cost_per_1m_tokens"] / table["config"].map(baseline["cost_per_1m_tokens"])
    return table[columns]


def node_variance(runs: pd.DataFrame, threshold: float = 0.05) -> pd.DataFrame:
    """Same configuration, same device model, different hosts: the hosts' median tokens/s and their CV."""
    columns = ["configuration", "device", "hosts", "host_medians", "tokens_per_s", "cv", "flagged"]
    ok = _finished(runs)
    ok["node"] = ok["host"].fillna(ok[SET_COLUMN])
    rows = []
    for _, group in ok.groupby("config_key", sort=False):
        medians = group.groupby("node", sort=True)["tokens_per_s"].median()
        if len(medians) < 2:
            continue
        cv = float(medians.std(ddof=1) / medians.mean()) if medians.mean() > 0 else float("nan")
        rows.append({
            "configuration": group["config_name"].iloc[0],
            "device": group["device"].iloc[0],
            "hosts": len(medians),
            "host_medians": "; ".join(f"{host}: {value:,.0f}" for host, value in medians.items()),
            "tokens_per_s": float(medians.median()),
            "cv": cv,
            "flagged": bool(cv > threshold),
        })
    return pd.DataFrame(rows, columns=columns)


def sets_table(merged: pd.DataFrame) -> pd.DataFrame:
    """One row per result set: its file, runs, finished runs, hosts, devices, commits and torch versions."""
    def joined(values: pd.Series) -> str:
        return ", ".join(sorted(values.dropna().astype(str).unique()))

    table = merged.groupby(SET_COLUMN, sort=False).agg(
        runs=("run_id", "size"),
        ok=("status", lambda s: int(s.isin(["ok"]).sum())),
        hosts=("host", joined),
        devices=("device_name", joined),
        git_commit=("git_commit", lambda s: joined(s.astype("string").str[:10])),
        torch_version=("torch_version", joined),
    ).reset_index()
    table.insert(1, "file", table[SET_COLUMN].map(merged.attrs["sources"]))
    return table


def compare(sets: list[tuple[str | None, str | Path]], out: str | Path, prices: cost.Prices | None = None,
            threshold: float = 0.05, title: str = "ftbench comparison", captions: dict[str, str] | None = None,
            gpu_table: str | Path | None = None) -> dict:
    """Write compare.parquet, compare.csv, figures/ and compare.html into ``out``; ``captions`` and
    ``gpu_table`` as for report_page.build_report."""
    out = Path(out)
    merged, notes = merge(sets, prices)
    for note in notes:
        print(f"note: {note}", file=sys.stderr)
    atomic.write_parquet(out / "compare.parquet", merged)
    atomic.write_csv(out / "compare.csv", merged)
    # Result sets carry no per-step records: a run's within-run interval and stability are the ones collect stored
    # from its steps (sets from an older ftbench have none); configurations with three repeats get theirs from the repeats.
    steps = pd.DataFrame(columns=report_page.STEP_COLUMNS)
    runs = analysis.add_step_figures(analysis.prepare(merged, across_machines=True,
                                                      gpu_table=gpu_tables.load_peaks(gpu_table) if gpu_table else None), steps)
    configs = analysis.configurations(runs)
    devices = across_devices(runs)
    variance = node_variance(runs, threshold)
    shared = analysis.common_parts(runs)
    drawn = {figures.THROUGHPUT_RATIO.name: figures.draw(figures.THROUGHPUT_RATIO, devices) if not devices.empty
             else "no run measured a throughput"}
    drawn.update({spec.name: figures.draw(spec, runs, steps, configs, shared=shared)
                  for spec in figures.FIGURES if spec.name in SHARED_FIGURES})
    written = figures.save(drawn, out / "figures")

    shown = report_page.with_display_columns(runs)
    table_columns = [SET_COLUMN] + report_page.shown_columns(shown, report_page.TABLE_COLUMNS, report_page.ALWAYS_SHOWN)
    for column in ("host", "gpu_model"):
        if column not in table_columns:
            table_columns.insert(table_columns.index("device_name") + 1 if "device_name" in table_columns else 1, column)
    html_path = out / "compare.html"
    pages.render(
        "compare.html.j2", html_path,
        title=title,
        sets=pages.table(sets_table(merged), ["result_set", "file", "runs", "ok", "hosts", "devices", "git_commit", "torch_version"],
                         table_id="sets"),
        run_count=len(merged),
        price_note=(f"Costs re-priced with {prices.table_path} ({prices.label}) so they are comparable." if prices is not None
                    else "Costs as each set's own collect computed them (--keep-prices)."),
        threshold=f"{threshold:.0%}",
        flagged=variance[variance["flagged"]].to_dict("records"),
        notes_list=notes,
        shared=shared,
        across_devices=pages.table(devices, list(devices.columns), table_id="across-devices", titles=TITLES),
        node_variance=pages.table(variance, list(variance.columns), table_id="node-variance",
                                  titles={**TITLES, "flagged": f"cv above {threshold:.0%}"}),
        figures=report_page.figure_blocks(written, captions or {}, report_page.throughput_notes(runs)),
        runs=report_page.runs_table(shown, table_columns),
        conventions=report_page.CONVENTIONS,
    )
    return {"html": html_path, "runs": len(merged), "sets": merged[SET_COLUMN].nunique(), "across_devices": devices,
            "node_variance": variance, "figures": written, "notes": notes}
