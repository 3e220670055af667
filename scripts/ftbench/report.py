"""Figures and the self-contained HTML report.

Each figure is one function that takes the run table and returns a matplotlib Figure, or None when there
is nothing to show (the report then says so instead of drawing an empty axis). The HTML embeds the
PNGs as data URIs so the file opens from disk with no server and no network.
"""

from __future__ import annotations

import base64
import html
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import matplotlib

matplotlib.use("Agg")  # no display on cluster nodes and CI

import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402
import seaborn as sns  # noqa: E402

from . import atomic  # noqa: E402
from .columns import COLUMNS  # noqa: E402

METHOD_ORDER = ["full", "lora", "qlora"]


@dataclass
class Figure:
    name: str
    title: str
    caption: str
    draw: Callable[[pd.DataFrame, pd.DataFrame], "plt.Figure | None"]


def _ok_runs(runs: pd.DataFrame) -> pd.DataFrame:
    return runs[runs["status"] == "ok"]


def _bar_by_run(runs: pd.DataFrame, column: str, xlabel: str):
    data = runs.dropna(subset=[column]).sort_values(column)
    if data.empty:
        return None
    fig, ax = plt.subplots(figsize=(8, 0.45 * len(data) + 1.5))
    sns.barplot(data=data, y="run_id", x=column, hue="method", hue_order=[m for m in METHOD_ORDER if m in set(data["method"])],
                dodge=False, ax=ax, orient="h")
    ax.set_xlabel(xlabel)
    ax.set_ylabel("")
    fig.tight_layout()
    return fig


def figure_peak_memory(runs, steps):
    return _bar_by_run(runs, "peak_memory_mb", "peak memory (MiB): CUDA reserved on GPU, process RSS on CPU")


def figure_throughput(runs, steps):
    return _bar_by_run(_ok_runs(runs), "tokens_per_s", "tokens/s (real tokens, measured window, all devices)")


def figure_accuracy(runs, steps):
    return _bar_by_run(_ok_runs(runs), "eval_accuracy", "eval accuracy")


def figure_loss_curves(runs, steps):
    if steps.empty:
        return None
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for run_id, group in steps.groupby("run_id", sort=True):
        ax.plot(group["step"], group["loss"], label=run_id, linewidth=1.2)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("training loss")
    ax.legend(fontsize=7, loc="upper right")
    fig.tight_layout()
    return fig


FIGURES = [
    Figure("peak_memory", "Peak memory", "Peak memory of each run: CUDA reserved memory on a GPU, the process's peak resident memory on a CPU.", figure_peak_memory),
    Figure("throughput", "Throughput", "Training throughput in real (unpadded) tokens per second over the measured window, warmup excluded.", figure_throughput),
    Figure("accuracy", "Accuracy", "Accuracy of each finished run on the held-out eval split.", figure_accuracy),
    Figure("loss_curves", "Loss curves", "Training loss at every optimizer step, warmup steps included.", figure_loss_curves),
]


def read_steps(step_files: list[str | Path]) -> pd.DataFrame:
    frames = []
    for path in step_files:
        frame = pd.read_parquet(path)
        frame["run_id"] = Path(path).parent.name
        frames.append(frame)
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame(columns=["run_id", "step", "loss"])


def render_figures(runs: pd.DataFrame, steps: pd.DataFrame, figures_dir: str | Path) -> dict[str, Path | None]:
    """Write one PNG per figure that has data; None for those left out."""
    figures_dir = Path(figures_dir)
    figures_dir.mkdir(parents=True, exist_ok=True)
    written = {}
    for figure in FIGURES:
        fig = figure.draw(runs, steps)
        if fig is None:
            written[figure.name] = None
            continue
        path = figures_dir / f"{figure.name}.png"
        with atomic.atomic_path(path) as tmp:
            fig.savefig(tmp, format="png", dpi=110)
        plt.close(fig)
        written[figure.name] = path
    return written


TABLE_COLUMNS = [
    "run_id", "status", "method", "precision", "batch_size", "seq_len", "lora_rank", "device_name",
    "tokens_per_s", "samples_per_s", "step_time_median_s", "peak_memory_mb", "eval_accuracy",
    "trainable_params", "wall_time_s", "status_reason",
]


def _format(value) -> str:
    if value is None or (isinstance(value, float) and pd.isna(value)) or value is pd.NA:
        return ""
    if isinstance(value, float):
        return f"{value:.4g}" if abs(value) < 1000 else f"{value:,.0f}"
    return str(value)


def runs_table_html(runs: pd.DataFrame) -> str:
    head = "".join(f'<th title="{html.escape(COLUMNS[c][1])}">{html.escape(c)}</th>' for c in TABLE_COLUMNS)
    body = []
    for _, row in runs.iterrows():
        cells = "".join(
            f'<td data-value="{html.escape(_format(row[c]))}">{html.escape(_format(row[c]))}</td>' for c in TABLE_COLUMNS
        )
        body.append(f'<tr class="status-{html.escape(str(row["status"]))}">{cells}</tr>')
    return f'<table id="runs"><thead><tr>{head}</tr></thead><tbody>{"".join(body)}</tbody></table>'


SORT_SCRIPT = """
document.querySelectorAll('#runs th').forEach((th, col) => th.addEventListener('click', () => {
  const body = th.closest('table').tBodies[0];
  const asc = th.dataset.order !== 'asc';
  th.dataset.order = asc ? 'asc' : 'desc';
  const key = r => r.cells[col].dataset.value;
  const rows = Array.from(body.rows).sort((a, b) => {
    const x = key(a), y = key(b), nx = parseFloat(x.replace(/,/g, '')), ny = parseFloat(y.replace(/,/g, ''));
    const cmp = (!isNaN(nx) && !isNaN(ny)) ? nx - ny : x.localeCompare(y);
    return asc ? cmp : -cmp;
  });
  rows.forEach(r => body.appendChild(r));
}));
"""

STYLE = """
body { font-family: system-ui, sans-serif; margin: 2em; color: #222; }
table { border-collapse: collapse; font-size: 0.85em; }
th, td { border: 1px solid #ccc; padding: 3px 6px; text-align: right; }
th { background: #f0f0f0; cursor: pointer; position: sticky; top: 0; }
td:first-child, th:first-child { text-align: left; }
tr.status-oom, tr.status-failed, tr.status-diverged { background: #fde2e2; }
tr.status-unsupported, tr.status-timeout { background: #fff4d6; }
figure { margin: 1.5em 0; }
figcaption { font-size: 0.9em; color: #555; }
img { max-width: 100%; }
"""


def build_report(metrics_path, step_files, figures_dir, html_path, title: str = "ftbench report") -> None:
    runs = pd.read_parquet(metrics_path)
    steps = read_steps(step_files)
    written = render_figures(runs, steps, figures_dir)
    counts = runs["status"].value_counts().to_dict()
    summary = ", ".join(f"{count} {status}" for status, count in sorted(counts.items()))
    sections = [f"<h1>{html.escape(title)}</h1>", f"<p>{len(runs)} runs: {html.escape(summary) or 'none'}.</p>"]
    sections.append("<h2>Runs</h2><p>Click a column header to sort. Hover a header for its definition.</p>")
    sections.append(runs_table_html(runs))
    sections.append("<h2>Figures</h2>")
    for figure in FIGURES:
        path = written[figure.name]
        if path is None:
            sections.append(f"<p><b>{html.escape(figure.title)}</b>: left out, no run has data for it.</p>")
            continue
        encoded = base64.b64encode(Path(path).read_bytes()).decode("ascii")
        sections.append(
            f'<figure><img alt="{html.escape(figure.title)}" src="data:image/png;base64,{encoded}">'
            f"<figcaption><b>{html.escape(figure.title)}.</b> {html.escape(figure.caption)}</figcaption></figure>"
        )
    page = (
        f'<!DOCTYPE html><html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>'
        f"<style>{STYLE}</style></head><body>{''.join(sections)}<script>{SORT_SCRIPT}</script></body></html>\n"
    )
    atomic.write_text(html_path, page)

