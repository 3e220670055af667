"""Merge result sets from different machines or clusters into one table and report.

Each result set is a ``metrics.parquet`` written by ``collect``; every row carries its environment
(host, device, driver, library versions), so sets from anywhere can be put side by side:

- the same configuration across GPUs: median tokens/s per device model, its ratio to the baseline
  device (the first set's), and $ per 1M tokens (re-priced with one price table by default, so the
  costs are comparable);
- node-to-node variance: the same configuration on the same device model on different hosts; a
  coefficient of variation (std / mean of the hosts' medians) above the threshold (default 5%) is flagged.

A configuration is what a run's settings say without its repeat index and seed (figures.CONFIG_COLUMNS).
"""

from __future__ import annotations

import hashlib
import math
import sys
import warnings
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # no display on cluster nodes and CI

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402

from . import atomic, cost, figures, report  # noqa: E402
from .collect import typed  # noqa: E402
from .columns import COLUMNS  # noqa: E402
from .errors import FtbenchError  # noqa: E402
from .figures import ok_runs, short_device  # noqa: E402

SET_COLUMN = "result_set"


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
    merged.attrs["sources"] = sources  # result set name -> the file it came from
    if prices is not None:
        old_gpu_hours = merged["projected_gpu_hours"].copy()
        repriced, price_warnings = cost.add_costs(merged.drop(columns=[SET_COLUMN]), prices, warn=False)
        # Projections made from a budget at collect time keep their GPU-hours; only the price changes.
        keep = repriced["projected_gpu_hours"].isna() & old_gpu_hours.notna()
        repriced.loc[keep, "projected_gpu_hours"] = old_gpu_hours[keep]
        repriced.loc[keep, "projected_cost"] = old_gpu_hours[keep] * repriced.loc[keep, "price_per_device_hour"]
        merged = pd.concat([merged[[SET_COLUMN]], typed(repriced)], axis=1)
        merged.attrs["sources"] = sources
        notes.extend(sorted(set(price_warnings)))
    return merged, notes


def _configs(runs: pd.DataFrame) -> pd.Series:
    """A device-independent configuration key per run, from the settings columns (not config_id, whose
    hash covers machine-specific details such as a model's local path)."""
    return figures.settings_key(runs).map(lambda key: hashlib.sha256(key.encode()).hexdigest()[:8])


def _config_labels(runs: pd.DataFrame) -> pd.Series:
    return figures.strip_id(runs["run_id"])


def across_devices(runs: pd.DataFrame) -> pd.DataFrame:
    """One row per (configuration, device model): median tokens/s and $ per 1M tokens at that median, with ratios to the
    baseline device (the device of the first result set that ran this configuration)."""
    ok = ok_runs(runs)
    ok = ok[ok["tokens_per_s"].notna()].copy()
    columns = ["configuration", "device", "result_sets", "hosts", "runs", "tokens_per_s", "throughput_ratio",
               "cost_per_1m_tokens", "cost_ratio", "baseline_device"]
    if ok.empty:
        return pd.DataFrame(columns=columns)
    ok["device"] = ok["device_name"].fillna("unknown device").map(short_device)
    ok["cfg"] = _configs(ok)
    ok["configuration"] = _config_labels(ok)
    set_order = {name: index for index, name in enumerate(runs[SET_COLUMN].unique())}
    rows = []
    for key, group in ok.groupby("cfg", sort=False):
        per_device = []
        for device, runs_on in group.groupby("device", sort=False):
            per_device.append({
                "configuration": runs_on["configuration"].iloc[0],
                "device": device,
                "result_sets": ", ".join(sorted(runs_on[SET_COLUMN].unique(), key=set_order.get)),
                "first_set": min(set_order[s] for s in runs_on[SET_COLUMN].unique()),
                "hosts": runs_on["host"].nunique(),
                "runs": len(runs_on),
                "tokens_per_s": float(runs_on["tokens_per_s"].astype(float).median()),
                # at the median throughput, so cost_ratio = price ratio / throughput ratio exactly
                "cost_per_1m_tokens": _nan(cost.cost_per_1m_tokens(report._median(runs_on, "price_per_hour"),
                                                                    float(runs_on["tokens_per_s"].astype(float).median()))),
            })
        baseline = min(per_device, key=lambda row: row["first_set"])
        for row in per_device:
            row["baseline_device"] = baseline["device"]
            row["throughput_ratio"] = row["tokens_per_s"] / baseline["tokens_per_s"] if baseline["tokens_per_s"] else math.nan
            row["cost_ratio"] = (row["cost_per_1m_tokens"] / baseline["cost_per_1m_tokens"]
                                 if baseline["cost_per_1m_tokens"] and not math.isnan(baseline["cost_per_1m_tokens"]) else math.nan)
            rows.append(row)
    return pd.DataFrame(rows)[columns]


def _nan(value: float | None) -> float:
    return math.nan if value is None or (isinstance(value, float) and math.isnan(value)) else float(value)


def node_variance(runs: pd.DataFrame, threshold: float = 0.05) -> pd.DataFrame:
    """Same configuration, same device model, different hosts: the hosts' median tokens/s and their CV."""
    ok = ok_runs(runs)
    ok = ok[ok["tokens_per_s"].notna()].copy()
    columns = ["configuration", "device", "hosts", "host_medians", "tokens_per_s", "cv", "flagged"]
    if ok.empty:
        return pd.DataFrame(columns=columns)
    ok["device"] = ok["device_name"].fillna("unknown device").map(short_device)
    ok["node"] = ok["host"].fillna(ok[SET_COLUMN])
    ok["cfg"] = _configs(ok)
    ok["configuration"] = _config_labels(ok)
    rows = []
    for (_, device), group in ok.groupby(["cfg", "device"], sort=False):
        medians = group.groupby("node", sort=True)["tokens_per_s"].median().astype(float)
        if len(medians) < 2:
            continue
        cv = float(medians.std(ddof=1) / medians.mean()) if medians.mean() > 0 else math.nan
        rows.append({
            "configuration": group["configuration"].iloc[0],
            "device": device,
            "hosts": len(medians),
            "host_medians": "; ".join(f"{host}: {value:,.0f}" for host, value in medians.items()),
            "tokens_per_s": float(medians.median()),
            "cv": cv,
            "flagged": bool(cv > threshold),
        })
    return pd.DataFrame(rows, columns=columns)


def figure_throughput_ratio(table: pd.DataFrame):
    """Throughput of each configuration on each device relative to the baseline device."""
    data = table[table["device"] != table["baseline_device"]]
    if data.empty:
        return "every configuration ran on one device model only"
    data = data.sort_values("throughput_ratio")
    labels = data["configuration"] + " @ " + data["device"] + " vs " + data["baseline_device"]
    fig, ax = plt.subplots(figsize=(9, figures._height(len(data))))
    y = np.arange(len(data))
    ax.barh(y, data["throughput_ratio"], color=["#55a868" if r >= 1 else "#c44e52" for r in data["throughput_ratio"]])
    ax.axvline(1.0, color="#222", linewidth=1)
    for yi, value in zip(y, data["throughput_ratio"]):
        ax.text(value, yi, f" {value:.2f}x", va="center", fontsize=8)
    ax.set_yticks(y, labels, fontsize=8)
    ax.set_xlabel("tokens/s relative to the baseline device (1.0 = same)")
    ax.set_xlim(0, float(data["throughput_ratio"].max()) * 1.2)
    fig.tight_layout()
    return fig


COMPARE_FIGURES = [
    ("throughput_ratio", "Throughput ratio across GPUs",
     "Median tokens/s of each configuration on each device model divided by its median on the baseline device "
     "(the first result set's), so 2.0x means twice as fast.", figure_throughput_ratio),
]
SHARED_FIGURES = ("throughput", "cost", "accuracy_vs_cost", "peak_memory")


def compare(sets: list[tuple[str | None, str | Path]], out: str | Path, prices: cost.Prices | None = None,
            threshold: float = 0.05, title: str = "ftbench comparison") -> dict:
    out = Path(out)
    merged, notes = merge(sets, prices)
    for note in notes:
        print(f"note: {note}", file=sys.stderr)
    atomic.write_parquet(out / "compare.parquet", merged)
    atomic.write_csv(out / "compare.csv", merged)
    devices = across_devices(merged)
    variance = node_variance(merged, threshold)
    runs = figures.prepare(merged.drop(columns=[SET_COLUMN]))
    runs.insert(0, SET_COLUMN, merged[SET_COLUMN].to_numpy())
    fig_dir = out / "figures"
    fig_dir.mkdir(parents=True, exist_ok=True)
    written: dict[str, Path | str] = {}
    blocks = []
    for name, heading, caption, draw in COMPARE_FIGURES:
        result = draw(devices) if not devices.empty else "no finished run has a throughput"
        blocks.append(_figure_block(name, heading, caption, result, fig_dir, written))
    steps = pd.DataFrame(columns=["run_id", "step", "measured", "step_time_s", "loss"])
    for spec in figures.FIGURES:
        if spec.name in SHARED_FIGURES:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                result = figures.draw(spec, runs, steps)
            blocks.append(_figure_block(spec.name, spec.title, spec.caption, result, fig_dir, written))

    sets_table = merged.groupby(SET_COLUMN, sort=False).agg(
        runs=("run_id", "size"),
        ok=("status", lambda s: int((s == "ok").sum())),
        hosts=("host", lambda s: ", ".join(sorted(s.dropna().astype(str).unique()))),
        devices=("device_name", lambda s: ", ".join(sorted(s.dropna().astype(str).unique()))),
        git_commit=("git_commit", lambda s: ", ".join(sorted(s.dropna().astype(str).str[:10].unique()))),
        torch_version=("torch_version", lambda s: ", ".join(sorted(s.dropna().astype(str).unique()))),
    ).reset_index()
    sets_table.insert(1, "file", sets_table[SET_COLUMN].map(merged.attrs["sources"]))
    flagged = variance[variance["flagged"]] if not variance.empty else variance
    price_note = (f"Costs re-priced with {prices.table_path} ({prices.label}) so they are comparable."
                  if prices is not None else "Costs as each set's own collect computed them (--keep-prices).")
    summary = [f"<p><b>{len(sets_table)}</b> result sets, <b>{len(merged)}</b> runs. {report.esc(price_note)}</p>"]
    if not flagged.empty:
        summary.append(f'<div class="notes"><b>Node-to-node variation above {threshold:.0%}</b><ul>'
                       + "".join(f"<li>{report.esc(r['configuration'])} on {report.esc(r['device'])}: CV {r['cv']:.1%} "
                                 f"({report.esc(r['host_medians'])})</li>" for _, r in flagged.iterrows()) + "</ul></div>")
    if notes:
        summary.append('<div class="notes"><b>Notes</b><ul>' + "".join(f"<li>{report.esc(n)}</li>" for n in notes) + "</ul></div>")
    titles = {
        "throughput_ratio": "median tokens/s on this device / on the baseline device",
        "cost_ratio": "$ per 1M tokens on this device / on the baseline device",
        "cv": "std / mean of the hosts' median tokens/s",
        "flagged": f"cv above {threshold:.0%}",
        "host_medians": "median tokens/s per host",
    }
    table_columns = [SET_COLUMN] + [c for c in report.TABLE_COLUMNS if c in runs and (c in report.ALWAYS_SHOWN or runs[c].notna().any())]
    for column in ("host", "gpu_model"):
        if column not in table_columns and column in runs:
            table_columns.insert(table_columns.index("device_name") + 1 if "device_name" in table_columns else 1, column)
    runs_table = report.table_html(runs, table_columns, table_id="runs", row_class=lambda row: "status-" + str(row["status"]))
    sections = [
        f"<h1>{report.esc(title)}</h1>",
        "<h2>Result sets</h2>", "".join(summary),
        report.table_html(sets_table, list(sets_table.columns), table_id="sets"),
        "<h2>The same configuration across GPUs</h2>",
        table_html_or_note(devices, "across-devices", titles, "no finished run has a throughput"),
        f"<h2>Node-to-node variance (flag &gt; {threshold:.0%})</h2>",
        table_html_or_note(variance, "node-variance", titles,
                           "no configuration ran on the same device model on more than one host"),
        "<h2>Figures</h2>", "".join(blocks),
        "<h2>All runs</h2><p>One row per run of every set.</p>",
        f'<div class="scroll">{runs_table}</div>',
        "<h3>How the numbers are taken</h3><ul>" + "".join(f"<li>{report.esc(c)}</li>" for c in report.CONVENTIONS) + "</ul>",
    ]
    html_path = out / "compare.html"
    atomic.write_text(html_path, report.page(title, sections))
    return {"html": html_path, "runs": len(merged), "sets": len(sets_table), "across_devices": devices,
            "node_variance": variance, "figures": written, "notes": notes}


def table_html_or_note(frame: pd.DataFrame, table_id: str, titles: dict, note: str) -> str:
    if frame.empty:
        return f'<p class="left-out">Nothing to show: {report.esc(note)}.</p>'
    return report.table_html(frame, list(frame.columns), table_id=table_id, titles=titles)


def _figure_block(name, heading, caption, result, fig_dir: Path, written: dict) -> str:
    if isinstance(result, str):
        written[name] = result
        return f'<p class="left-out"><b>{report.esc(heading)}</b>: left out, {report.esc(result)}.</p>'
    path = fig_dir / f"{name}.png"
    with atomic.atomic_path(path) as tmp:
        result.savefig(tmp, format="png", dpi=100)
    plt.close(result)
    written[name] = path
    return report.figures_html_one(name, heading, caption, path)
