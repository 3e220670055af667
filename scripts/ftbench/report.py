"""The self-contained HTML report: summary, recommendation, configurations, runs, figures, environment.

The numbers come from analysis.py, the figures from figures.py, the page from templates/report.html.j2
(pages.py): images are embedded, so it opens from disk with no server and no network.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from . import analysis, figures, pages
from .analysis import CV_THRESHOLD, is_missing
from .collect import typed
from .pages import fmt, money

# The runs table: these columns when the table has data in them (status and its reason always).
TABLE_COLUMNS = [
    "run_id", "status", "status_reason", "method", "precision", "batch_size", "seq_len", "lora_rank",
    "num_gpus", "parallel", "repeat", "device_name", "tokens_per_s", "samples_per_s", "step_time_median_s",
    "peak_memory_mb", "memory_estimate_mb", "eval_accuracy", "eval_token_accuracy", "eval_perplexity",
    "mfu", "cost_per_1m_tokens", "cost_per_1k_samples", "projected_hours", "projected_gpu_hours",
    "projected_cost", "energy_j_per_token", "energy_cost_per_1m_tokens", "trainable_params", "wall_time_s",
]
ALWAYS_SHOWN = {"run_id", "status", "status_reason"}
CONFIG_TABLE_COLUMNS = ["configuration", "method", "runs", "ok", "tokens_per_s", "tokens_per_s_iqr", "tokens_per_s_cv",
                        "unstable", "cost_per_1m_tokens", "accuracy", "peak_memory_mb", "projected_hours", "projected_cost"]
RECOMMEND_TABLE_COLUMNS = ["method", "configuration", "cost_per_1m_tokens", "tokens_per_s", "accuracy", "peak_memory_mb",
                           "projected_cost"]
ENVIRONMENT_COLUMNS = [
    "host", "device_name", "gpu_names", "gpu_driver", "cuda_version", "cpu", "torch_version",
    "transformers_version", "peft_version", "bitsandbytes_version", "git_commit", "slurm_job_id", "price_source",
]
CONFIG_TITLES = {
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
STEP_COLUMNS = ["run_id", "step", "measured", "step_time_s", "loss"]


def read_steps(step_files: list[str | Path]) -> pd.DataFrame:
    frames = []
    for path in map(Path, step_files):
        if path.is_file():
            frame = pd.read_parquet(path)
            frame["run_id"] = path.parent.name
            frames.append(frame)
    frames = [f for f in frames if not f.empty]
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame(columns=STEP_COLUMNS)


def shown_columns(frame: pd.DataFrame, columns: list[str], always: set[str]) -> list[str]:
    """The columns of ``columns`` the table has and has data in (those in ``always`` regardless)."""
    return [c for c in columns if c in frame and (c in always or frame[c].notna().any())]


def runs_table(runs: pd.DataFrame, columns: list[str]) -> pages.Table:
    return pages.table(runs, columns, table_id="runs", row_class=lambda row: f"status-{row['status']}")


def figure_blocks(written: dict[str, Path | str], captions: dict[str, str]) -> list[pages.FigureBlock]:
    titles = {spec.name: spec.title for spec in [*figures.FIGURES, figures.THROUGHPUT_RATIO]}
    return [pages.figure_block(name, titles[name], result, captions) for name, result in written.items()]


# ---------------------------------------------------------------------------------------------------
# The sections' content


def summary(runs: pd.DataFrame, configs: pd.DataFrame, warnings: list[str]) -> dict:
    """Counts, what the runs cover, one fact per question (fastest, cheapest, ...), notes to read first."""
    counts = runs["status"].value_counts().to_dict()
    scope = []
    for column, name in (("model", "models"), ("dataset", "datasets"), ("method", "methods"), ("device_name", "devices")):
        values = sorted(runs[column].dropna().astype(str).unique()) if column in runs else []
        if values:
            scope.append((name, ", ".join(values)))
    ok = configs[configs["ok"] > 0]
    facts = []
    questions = [
        ("Fastest", "tokens_per_s", "idxmax", lambda row: f"at {fmt(row['tokens_per_s'])} tokens/s"),
        ("Cheapest", "cost_per_1m_tokens", "idxmin", lambda row: f"at {money(row['cost_per_1m_tokens'])} per 1M tokens"),
        ("Most accurate", "accuracy", "idxmax", lambda row: f"at {row['accuracy']:.3f}"),
        ("Smallest memory", "peak_memory_mb", "idxmin", lambda row: f"at {fmt(row['peak_memory_mb'])} MiB"),
        ("Cheapest training budget", "projected_cost", "idxmin",
         lambda row: f"at {money(row['projected_cost'])}" + (f" ({row['projected_hours']:.3g} h)" if not is_missing(row["projected_hours"]) else "")),
    ]
    for lead, column, pick, detail in questions:
        if ok[column].notna().any():
            row = ok.loc[getattr(ok[column], pick)()]
            facts.append({"lead": lead, "configuration": row["configuration"], "detail": detail(row)})
    notes = list(warnings)
    bad = runs[~runs["status"].isin(["ok"])]
    if not bad.empty:
        notes.append(f"{len(bad)} run(s) did not finish normally ({', '.join(sorted(bad['status'].astype(str).unique()))}): "
                     "they are in the table with their reason, left out of the figures that need a finished run.")
    for _, row in configs[configs["unstable"].eq(True)].iterrows():
        notes.append(f"Unstable: {row['configuration']} varies by {row['tokens_per_s_cv']:.1%} (CV of tokens/s over "
                     f"{row['ok']} repeats, threshold {CV_THRESHOLD:.0%}); compare it with care.")
    return {
        "runs": len(runs), "configurations": len(configs), "scope": scope, "facts": facts, "notes": notes,
        "statuses": ", ".join(f"{count} {status}" for status, count in sorted(counts.items())),
        "nothing_finished": ok.empty,
    }


def recommendation(configs: pd.DataFrame, settings: dict) -> dict:
    """The recommendation (analysis.recommend) with the settings it answers and what came closest."""
    min_accuracy, max_memory = settings.get("min_accuracy"), settings.get("max_memory_mb")
    result = analysis.recommend(configs, min_accuracy, max_memory)
    closest = []
    if min_accuracy is not None and not is_missing(result["closest"]["accuracy"]):
        closest.append(f"The best accuracy was {result['closest']['accuracy']:.3f}")
    if max_memory is not None and not is_missing(result["closest"]["peak_memory_mb"]):
        closest.append(f"the smallest peak memory {result['closest']['peak_memory_mb']:,.0f} MiB")
    per_method = result["per_method"]
    columns = [c for c in RECOMMEND_TABLE_COLUMNS if c in ("method", "configuration") or per_method[c].notna().any()]
    best = result["best"]
    return {
        "basis": result["basis"], "candidates": result["candidates"], "closest": closest,
        "min_accuracy": min_accuracy, "max_memory_mb": max_memory,
        "best": {key: None if is_missing(value) else value for key, value in best.items()} if best else None,
        "per_method": pages.table(per_method, columns, table_id="recommend-per-method", titles=CONFIG_TITLES),
    }


def environment(runs: pd.DataFrame) -> list[tuple[str, str]]:
    """(column, its values with their run counts where they differ) for each recorded environment column."""
    rows = []
    for column in ENVIRONMENT_COLUMNS:
        values = runs[column].dropna().astype(str) if column in runs else pd.Series(dtype=str)
        if values.empty:
            continue
        counts = values.value_counts()
        rows.append((column, "; ".join(f"{value} ({count} runs)" if len(counts) > 1 else value for value, count in counts.items())))
    return rows


def price_warnings(runs: pd.DataFrame) -> list[str]:
    """One line per reason some runs have no cost (their device is not in the price table, ...)."""
    unpriced = runs[runs["device"].notna() & runs["price_per_hour"].isna() & runs["price_source"].notna()]
    return [f"No cost for some runs: {source}." for source in sorted(unpriced["price_source"].astype(str).unique())]


def build_report(metrics_path, step_files, figures_dir, html_path, title: str = "ftbench report",
                 recommend_settings: dict | None = None, captions: dict[str, str] | None = None,
                 gpu_table: str | Path | None = None) -> dict:
    """Write the figures and report.html; return what was drawn (figure name -> PNG path or left-out note).

    ``captions``: figure name -> its one-sentence caption (the rule passes rules/captions/figures/).
    ``gpu_table``: config/gpus.yaml, for the memory capacity of GPUs whose name does not give it.
    """
    # typed(): a table from an older ftbench gets the columns it lacks, as nulls
    runs = analysis.prepare(typed(pd.read_parquet(metrics_path)),
                            gpu_table=analysis.read_gpu_table(gpu_table) if gpu_table else None)
    steps = read_steps(step_files)
    shared = analysis.common_parts(runs)
    written = figures.save({spec.name: figures.draw(spec, runs, steps, shared=shared) for spec in figures.FIGURES}, figures_dir)
    configs = analysis.configurations(runs)
    pages.render(
        "report.html.j2", html_path,
        title=title,
        summary=summary(runs, configs, price_warnings(runs)),
        recommendation=recommendation(configs, recommend_settings or {}),
        shared=shared,
        configurations=pages.table(configs, shown_columns(configs, CONFIG_TABLE_COLUMNS, {"configuration", "method", "runs", "ok"}),
                                   table_id="configurations-table", titles=CONFIG_TITLES),
        runs=runs_table(runs, shown_columns(runs, TABLE_COLUMNS, ALWAYS_SHOWN)),
        figures=figure_blocks(written, captions or {}),
        environment=environment(runs),
        conventions=CONVENTIONS,
    )
    return written
