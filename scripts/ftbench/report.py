"""The self-contained HTML report: summary, recommendation, runs table, figures, environment.

The figures are drawn by scripts/ftbench/figures.py; the HTML embeds them as data URIs, and the page has
no external script, style or font, so it opens from disk with no server and no network.
"""

from __future__ import annotations

import base64
import html
import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # no display on cluster nodes and CI

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402

from . import atomic, figures  # noqa: E402
from .collect import typed  # noqa: E402
from .columns import COLUMNS  # noqa: E402
from .figures import FIGURES, is_value, ok_runs, prepare  # noqa: E402

# A configuration whose repeats vary more than this (coefficient of variation of tokens/s) is unstable.
CV_THRESHOLD = 0.05

# The runs table: these columns when the table has data in them (status and its reason always).
TABLE_COLUMNS = [
    "run_id", "status", "status_reason", "method", "precision", "batch_size", "seq_len", "lora_rank",
    "num_gpus", "parallel", "repeat", "device_name", "tokens_per_s", "samples_per_s", "step_time_median_s",
    "peak_memory_mb", "memory_estimate_mb", "eval_accuracy", "eval_token_accuracy", "eval_perplexity",
    "mfu", "cost_per_1m_tokens", "cost_per_1k_samples", "projected_hours", "projected_gpu_hours",
    "projected_cost", "energy_j_per_token", "energy_cost_per_1m_tokens", "trainable_params", "wall_time_s",
]
ALWAYS_SHOWN = {"run_id", "status", "status_reason"}
WRAPPED = {"status_reason", "host_medians", "price_source"}
ENVIRONMENT_COLUMNS = [
    "host", "device_name", "gpu_names", "gpu_driver", "cuda_version", "cpu", "torch_version",
    "transformers_version", "peft_version", "bitsandbytes_version", "git_commit", "slurm_job_id", "price_source",
]


# ---------------------------------------------------------------------------------------------------
# Formatting


def is_missing(value) -> bool:
    if value is None or value is pd.NA:
        return True
    try:
        return bool(pd.isna(value))
    except (TypeError, ValueError):
        return False


def fmt(value, column: str = "") -> str:
    if is_missing(value):
        return ""
    if isinstance(value, (bool, np.bool_)):
        return "yes" if value else "no"
    if column.endswith("_cv") or column == "cv":
        return f"{float(value):.1%}"
    if column.startswith(("cost_", "projected_cost", "projected_energy_cost", "energy_cost_", "price_per")):
        return money(value)
    if isinstance(value, float):
        if value == 0:
            return "0"
        if abs(value) >= 1000:
            return f"{value:,.0f}"
        return f"{value:.4g}"
    if isinstance(value, int) and abs(value) >= 100000:
        return f"{value:,}"
    return str(value)


def money(value) -> str:
    """Dollars: cents from $1 up, three significant digits below (costs per token are small)."""
    if is_missing(value):
        return ""
    value = float(value)
    if value >= 100:
        return f"${value:,.0f}"
    if value >= 1 or value == 0:
        return f"${value:.2f}"
    return f"${value:.3g}"


def esc(value) -> str:
    return html.escape(str(value), quote=True)


def table_html(frame: pd.DataFrame, columns: list[str], table_id: str | None = None, row_class=None,
               titles: dict[str, str] | None = None) -> str:
    """A sortable table (click a header); each cell keeps its raw value in data-value for sorting."""
    titles = titles or {}
    head = "".join(f'<th title="{esc(titles.get(c, COLUMNS.get(c, ("", c))[1]))}">{esc(c)}</th>' for c in columns)
    body = []
    for _, row in frame.iterrows():
        cells = []
        for column in columns:
            value = row[column]
            raw = "" if is_missing(value) else (f"{float(value):.12g}" if isinstance(value, (int, float)) and not isinstance(value, bool) else str(value))
            css = "wrap" if column in WRAPPED else "text" if isinstance(value, str) else None
            attributes = f' data-value="{esc(raw)}"' + (f' class="{css}"' if css else "")
            cells.append(f"<td{attributes}>{esc(fmt(value, column))}</td>")
        css = f' class="{esc(row_class(row))}"' if row_class else ""
        body.append(f"<tr{css}>{''.join(cells)}</tr>")
    ident = f' id="{esc(table_id)}"' if table_id else ""
    return f'<table class="sortable"{ident}><thead><tr>{head}</tr></thead><tbody>{"".join(body)}</tbody></table>'


# ---------------------------------------------------------------------------------------------------
# Content


def read_steps(step_files: list[str | Path]) -> pd.DataFrame:
    frames = []
    for path in step_files:
        path = Path(path)
        if not path.is_file():
            continue
        frame = pd.read_parquet(path)
        frame["run_id"] = path.parent.name
        frames.append(frame)
    frames = [f for f in frames if not f.empty]
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame(columns=["run_id", "step", "measured", "step_time_s", "loss"])


def render_figures(runs: pd.DataFrame, steps: pd.DataFrame, figures_dir: str | Path) -> dict[str, Path | str]:
    """Write one PNG per figure that has data; for the others, the note saying why it is left out."""
    figures_dir = Path(figures_dir)
    figures_dir.mkdir(parents=True, exist_ok=True)
    written: dict[str, Path | str] = {}
    for spec in FIGURES:
        result = figures.draw(spec, runs, steps)
        if isinstance(result, str):
            written[spec.name] = result
            continue
        path = figures_dir / f"{spec.name}.png"
        with atomic.atomic_path(path) as tmp:
            result.savefig(tmp, format="png", dpi=100)
        plt.close(result)
        written[spec.name] = path
    return written


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
        median = speed.median() if len(speed) else math.nan
        cv = speed.std(ddof=1) / speed.mean() if len(speed) > 1 and speed.mean() > 0 else math.nan
        rows.append({
            "configuration": group["config_label"].iloc[0],
            "config_key": key,
            "method": group["method"].iloc[0],
            "runs": len(group),
            "ok": len(ok),
            "tokens_per_s": median,
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
    if column not in frame:
        return math.nan
    values = frame[column].dropna().astype(float)
    return float(values.median()) if len(values) else math.nan


def recommend(configs: pd.DataFrame, min_accuracy: float | None = None, max_memory_mb: float | None = None) -> dict:
    """The cheapest finished configuration per method, and the cheapest meeting the floor and ceiling.

    Cheapest = lowest median $ per 1M tokens (the same training budget costs proportionally); when no
    configuration has a price, the fastest (highest tokens/s) stands in and ``basis`` says so.
    """
    done = configs[configs["ok"] > 0].copy()
    priced = done["cost_per_1m_tokens"].notna().any() if not done.empty else False
    if priced:
        done = done[done["cost_per_1m_tokens"].notna()]
        done["_rank"] = done["cost_per_1m_tokens"]
        basis = "cost"
    else:
        done["_rank"] = -done["tokens_per_s"].fillna(-math.inf)
        basis = "throughput"
    done = done.sort_values("_rank", kind="stable")
    per_method = done.groupby("method", sort=False).head(1)
    per_method = per_method.set_index("method").reindex([m for m in figures.METHOD_ORDER if m in set(per_method["method"])] + sorted(set(per_method["method"]) - set(figures.METHOD_ORDER))).reset_index()
    eligible = done
    if min_accuracy is not None:
        eligible = eligible[eligible["accuracy"].notna() & (eligible["accuracy"] >= min_accuracy)]
    if max_memory_mb is not None:
        eligible = eligible[eligible["peak_memory_mb"].notna() & (eligible["peak_memory_mb"] <= max_memory_mb)]
    best = eligible.iloc[0].to_dict() if not eligible.empty else None
    return {"basis": basis, "per_method": per_method.drop(columns="_rank"), "best": best, "candidates": len(done)}


def _summary_html(runs: pd.DataFrame, configs: pd.DataFrame, warnings: list[str]) -> str:
    counts = runs["status"].value_counts().to_dict()
    statuses = ", ".join(f"{count} {status}" for status, count in sorted(counts.items()))
    parts = [f"<p><b>{len(runs)}</b> runs of <b>{len(configs)}</b> configurations ({esc(statuses)})"]
    for column, name in (("model", "models"), ("dataset", "datasets"), ("method", "methods"), ("device_name", "devices")):
        values = sorted(runs[column].dropna().astype(str).unique()) if column in runs else []
        if values:
            parts.append(f"; {name}: {esc(', '.join(values))}")
    parts.append(".</p>")
    ok = configs[configs["ok"] > 0]
    facts = []
    if not ok.empty and ok["tokens_per_s"].notna().any():
        row = ok.loc[ok["tokens_per_s"].idxmax()]
        facts.append(f"Fastest: <b>{esc(row['configuration'])}</b> at {fmt(row['tokens_per_s'])} tokens/s.")
    if not ok.empty and ok["cost_per_1m_tokens"].notna().any():
        row = ok.loc[ok["cost_per_1m_tokens"].idxmin()]
        facts.append(f"Cheapest: <b>{esc(row['configuration'])}</b> at {money(row['cost_per_1m_tokens'])} per 1M tokens.")
    if not ok.empty and ok["accuracy"].notna().any():
        row = ok.loc[ok["accuracy"].idxmax()]
        facts.append(f"Most accurate: <b>{esc(row['configuration'])}</b> at {row['accuracy']:.3f}.")
    if not ok.empty and ok["peak_memory_mb"].notna().any():
        row = ok.loc[ok["peak_memory_mb"].idxmin()]
        facts.append(f"Smallest memory: <b>{esc(row['configuration'])}</b> at {fmt(row['peak_memory_mb'])} MiB.")
    if not ok.empty and ok["projected_cost"].notna().any():
        row = ok.loc[ok["projected_cost"].idxmin()]
        hours = f"{row['projected_hours']:.3g} h, " if not is_missing(row["projected_hours"]) else ""
        facts.append(f"The configured training budget costs from {money(row['projected_cost'])} ({hours}{esc(row['configuration'])}).")
    if ok.empty:
        facts.append("No run finished: there is nothing to compare (see the status of each run below).")
    if facts:
        parts.append("<ul>" + "".join(f"<li>{fact}</li>" for fact in facts) + "</ul>")
    notes = list(warnings)
    bad = runs[~is_value(runs["status"], "ok")]
    if not bad.empty:
        notes.append(f"{len(bad)} run(s) did not finish normally ({', '.join(sorted(bad['status'].astype(str).unique()))}): "
                     "they are in the table with their reason, left out of the figures that need a finished run.")
    unstable = configs[configs["unstable"].eq(True)] if "unstable" in configs else configs.iloc[0:0]
    for _, row in unstable.iterrows():
        notes.append(f"Unstable: {row['configuration']} varies by {row['tokens_per_s_cv']:.1%} (CV of tokens/s over "
                     f"{row['ok']} repeats, threshold {CV_THRESHOLD:.0%}); compare it with care.")
    if notes:
        parts.append('<div class="notes"><b>Notes</b><ul>' + "".join(f"<li>{esc(n)}</li>" for n in notes) + "</ul></div>")
    return "".join(parts)


def _recommendation_html(configs: pd.DataFrame, settings: dict) -> str:
    min_accuracy = settings.get("min_accuracy")
    max_memory = settings.get("max_memory_mb")
    result = recommend(configs, min_accuracy, max_memory)
    if result["candidates"] == 0:
        return "<p>No finished configuration to recommend.</p>"
    criterion = "lowest $ per 1M training tokens" if result["basis"] == "cost" else "highest tokens/s (no configuration has a price)"
    parts = [f"<p>Ranked by {esc(criterion)}; the median over repeats.</p>"]
    wanted = []
    if min_accuracy is not None:
        wanted.append(f"accuracy &ge; {min_accuracy:g}")
    if max_memory is not None:
        wanted.append(f"peak memory &le; {max_memory:g} MiB")
    condition = " and ".join(wanted)
    best = result["best"]
    if not wanted:
        parts.append('<p class="pick">Set <code>recommend: {min_accuracy, max_memory_mb}</code> in the experiment config '
                     "to get the cheapest configuration that meets your accuracy floor and memory ceiling.</p>")
    elif best is None:
        parts.append(f'<p class="pick">No finished configuration meets {condition}. '
                     + esc(_closest(configs, min_accuracy, max_memory)) + "</p>")
    else:
        cost_text = f"{money(best['cost_per_1m_tokens'])} per 1M tokens, " if not is_missing(best["cost_per_1m_tokens"]) else ""
        budget = f", {money(best['projected_cost'])} for the training budget" if not is_missing(best.get("projected_cost")) else ""
        parts.append(
            f'<p class="pick">Cheapest meeting {condition}: <b>{esc(best["configuration"])}</b> &mdash; {cost_text}'
            f"{fmt(best['tokens_per_s'])} tokens/s, accuracy {fmt(best['accuracy'])}, peak memory {fmt(best['peak_memory_mb'])} MiB{budget}.</p>"
        )
    per_method = result["per_method"]
    columns = ["method", "configuration", "cost_per_1m_tokens", "tokens_per_s", "accuracy", "peak_memory_mb", "projected_cost"]
    columns = [c for c in columns if c in ("method", "configuration") or per_method[c].notna().any()]
    parts.append("<h3>Cheapest configuration per method</h3>")
    parts.append(table_html(per_method, columns, table_id="recommend-per-method", titles=_CONFIG_TITLES))
    return "".join(parts)


def _closest(configs: pd.DataFrame, min_accuracy, max_memory) -> str:
    done = configs[configs["ok"] > 0]
    said = []
    if min_accuracy is not None and done["accuracy"].notna().any():
        said.append(f"The best accuracy was {done['accuracy'].max():.3f}")
    if max_memory is not None and done["peak_memory_mb"].notna().any():
        said.append(f"the smallest peak memory {done['peak_memory_mb'].min():,.0f} MiB")
    return (", ".join(said) + ".") if said else ""


_CONFIG_TITLES = {
    "configuration": "runs that differ only in their repeat index share a configuration",
    "runs": "runs of this configuration (repeats)",
    "ok": "runs that finished with status ok",
    "tokens_per_s": "median real tokens per second over the finished repeats",
    "tokens_per_s_iqr": "interquartile range of tokens/s over the repeats",
    "tokens_per_s_cv": "coefficient of variation of tokens/s (std / mean) over the repeats",
    "unstable": f"CV above {CV_THRESHOLD:.0%}",
    "cost_per_1m_tokens": "median $ per million training tokens",
    "accuracy": "median eval accuracy (token accuracy for language-model runs)",
    "peak_memory_mb": "median peak memory (MiB)",
    "projected_hours": "median projected wall hours of the training budget",
    "projected_cost": "median $ of the training budget",
}


def _runs_table(runs: pd.DataFrame) -> str:
    columns = [c for c in TABLE_COLUMNS if c in runs and (c in ALWAYS_SHOWN or runs[c].notna().any())]
    return table_html(runs, columns, table_id="runs", row_class=lambda row: f"status-{row['status']}")


def _environment_html(runs: pd.DataFrame) -> str:
    rows = []
    for column in ENVIRONMENT_COLUMNS:
        if column not in runs:
            continue
        values = runs[column].dropna().astype(str)
        if values.empty:
            continue
        counts = values.value_counts()
        text = "; ".join(f"{value} ({count} runs)" if len(counts) > 1 else value for value, count in counts.items())
        rows.append(f"<tr><th>{esc(column)}</th><td>{esc(text)}</td></tr>")
    if not rows:
        return "<p>No environment recorded.</p>"
    return f'<table class="env">{"".join(rows)}</table>'


CONVENTIONS = [
    "Throughput: real (unpadded) tokens over the measured window (warmup steps excluded, device synchronised "
    "before each clock read), all devices together; per-device throughput is a separate column.",
    "Peak memory: CUDA max_memory_reserved on a GPU; the process's peak resident memory on a CPU (model loading included).",
    "Accuracy: classification accuracy on the held-out split; for language-model runs the next-token (or target-token) accuracy.",
    "MFU: analytic model FLOP/s (6N per token for full fine-tuning, 4N + 2N_trainable with adapters, plus attention; "
    "recomputation not counted) over the dense peak of the run's dtype in config/gpus.yaml, times the GPUs.",
    "Cost: $ per device-hour (config/prices.yaml or the experiment's prices key) x devices held, divided by the measured "
    "tokens (or samples) per hour; a CPU run pays for one machine. A device without a price gets no cost, never a guess.",
    "Budget: projected wall hours of the configured training budget at the measured throughput; GPU-hours = hours x GPUs; "
    "energy cost = NVML J per token x tokens x $ per kWh (GPU boards only).",
]

STYLE = """
body { font-family: system-ui, -apple-system, 'Segoe UI', sans-serif; margin: 2em auto; max-width: 1300px; padding: 0 1em; color: #222; }
h1 { margin-bottom: 0.2em; } h2 { border-bottom: 1px solid #ddd; padding-bottom: 0.2em; margin-top: 1.6em; }
nav a { margin-right: 1em; }
table { border-collapse: collapse; font-size: 0.82em; margin: 0.5em 0; }
th, td { border: 1px solid #ccc; padding: 3px 6px; text-align: right; vertical-align: top; }
table.sortable th { background: #f0f0f0; cursor: pointer; position: sticky; top: 0; }
table.sortable th[data-order=asc]::after { content: " \\25B2"; } table.sortable th[data-order=desc]::after { content: " \\25BC"; }
td:first-child, th:first-child { text-align: left; }
td { white-space: nowrap; } td.text { text-align: left; } td.wrap { white-space: normal; min-width: 16em; max-width: 32em; text-align: left; }
table.env th { text-align: left; background: #f6f6f6; } table.env td { text-align: left; }
.scroll { overflow-x: auto; max-height: 70vh; overflow-y: auto; }
tr.status-oom, tr.status-failed, tr.status-diverged { background: #fde2e2; }
tr.status-unsupported, tr.status-timeout { background: #fff4d6; }
.notes { background: #fff8e6; border-left: 4px solid #e0a800; padding: 0.4em 1em; margin: 1em 0; font-size: 0.92em; }
.pick { background: #e8f4ea; border-left: 4px solid #3a9d4f; padding: 0.6em 1em; }
figure { margin: 1.5em 0; } figcaption { font-size: 0.9em; color: #444; max-width: 60em; }
img { max-width: 100%; height: auto; }
.left-out { color: #666; font-style: italic; }
"""

SORT_SCRIPT = """
document.querySelectorAll('table.sortable').forEach(table => {
  table.querySelectorAll('th').forEach((th, col) => th.addEventListener('click', () => {
    const body = table.tBodies[0];
    const asc = th.dataset.order !== 'asc';
    table.querySelectorAll('th').forEach(other => delete other.dataset.order);
    th.dataset.order = asc ? 'asc' : 'desc';
    const key = row => row.cells[col].dataset.value;
    const rows = Array.from(body.rows).sort((a, b) => {
      const x = key(a), y = key(b);
      if (x === '' || y === '') return (x === '') - (y === '');  // empty cells last
      const nx = Number(x), ny = Number(y);
      const cmp = (!isNaN(nx) && !isNaN(ny)) ? nx - ny : x.localeCompare(y);
      return asc ? cmp : -cmp;
    });
    rows.forEach(row => body.appendChild(row));
  }));
});
"""


def page(title: str, sections: list[str]) -> str:
    # The empty data: favicon stops the browser asking the file system for /favicon.ico.
    return (
        f'<!DOCTYPE html><html lang="en"><head><meta charset="utf-8"><title>{esc(title)}</title>'
        '<link rel="icon" href="data:,"><meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<style>{STYLE}</style></head><body>{''.join(sections)}<script>{SORT_SCRIPT}</script></body></html>\n"
    )


def figures_html_one(name: str, title: str, caption: str, path: Path) -> str:
    encoded = base64.b64encode(Path(path).read_bytes()).decode("ascii")
    return (
        f'<figure id="figure-{esc(name)}"><img alt="{esc(title)}" src="data:image/png;base64,{encoded}">'
        f"<figcaption><b>{esc(title)}.</b> {esc(caption)}</figcaption></figure>"
    )


def figures_html(written: dict[str, Path | str]) -> str:
    parts = []
    for spec in FIGURES:
        result = written[spec.name]
        if isinstance(result, str):
            parts.append(f'<p class="left-out"><b>{esc(spec.title)}</b>: left out, {esc(result)}.</p>')
        else:
            parts.append(figures_html_one(spec.name, spec.title, spec.caption, result))
    return "".join(parts)


def build_report(metrics_path, step_files, figures_dir, html_path, title: str = "ftbench report",
                 recommend_settings: dict | None = None) -> dict:
    """Write the figures and report.html; return what was drawn (figure name -> PNG path or left-out note)."""
    # typed(): a table from an older ftbench gets the columns it lacks, as nulls
    runs = prepare(typed(pd.read_parquet(metrics_path)))
    steps = read_steps(step_files)
    written = render_figures(runs, steps, figures_dir)
    configs = configurations(runs)
    warnings = []
    if "price_source" in runs and "gpu_model" in runs:
        unpriced = runs[runs["device"].notna() & runs["price_per_hour"].isna() & runs["price_source"].notna()]
        for source in sorted(unpriced["price_source"].astype(str).unique()):
            warnings.append(f"No cost for some runs: {source}.")
    sections = [
        f"<h1>{esc(title)}</h1>",
        '<nav><a href="#summary">Summary</a><a href="#recommendation">Recommendation</a><a href="#configurations">Configurations</a>'
        '<a href="#runs-section">Runs</a><a href="#figures">Figures</a><a href="#environment">Environment</a></nav>',
        '<h2 id="summary">Summary</h2>', _summary_html(runs, configs, warnings),
        '<h2 id="recommendation">Recommendation</h2>', _recommendation_html(configs, recommend_settings or {}),
        '<h2 id="configurations">Configurations</h2>',
        "<p>Runs that differ only in their repeat index share a configuration; medians over the finished repeats.</p>",
        table_html(configs, [c for c in ["configuration", "method", "runs", "ok", "tokens_per_s", "tokens_per_s_iqr", "tokens_per_s_cv",
                                         "unstable", "cost_per_1m_tokens", "accuracy", "peak_memory_mb", "projected_hours", "projected_cost"]
                             if c in ("configuration", "method", "runs", "ok") or configs[c].notna().any()],
                   table_id="configurations-table", titles=_CONFIG_TITLES),
        '<h2 id="runs-section">Runs</h2><p>One row per run. Click a column header to sort; hover it for its definition. '
        "Rows that did not finish (oom, diverged, unsupported, timeout, failed) are shaded, with the reason.</p>",
        f'<div class="scroll">{_runs_table(runs)}</div>',
        '<h2 id="figures">Figures</h2>', figures_html(written),
        '<h2 id="environment">Environment</h2>', _environment_html(runs),
        "<h3>How the numbers are taken</h3><ul>" + "".join(f"<li>{esc(c)}</li>" for c in CONVENTIONS) + "</ul>",
    ]
    atomic.write_text(html_path, page(title, sections))
    return written
