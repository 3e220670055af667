"""The self-contained HTML report: summary, recommendation, configurations, runs, figures, environment.

The numbers come from analysis.py, the figures from figures.py, the page from templates/report.html.j2
(pages.py): images are embedded, so it opens from disk with no server and no network.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from ftbench.experiment import memory_plan
from ftbench.measure import memory_estimate
from ftbench.report import analysis, figures, headline, pages, prediction_section, quality_target, scaling
from ftbench.report import summary as summary_text
from ftbench.measure import gpu_table as gpu_tables
from ftbench.report.analysis import CV_THRESHOLD, is_missing
from ftbench.report.collect import typed
from ftbench.report.pages import fmt, money
from ftbench.recipe import RECIPE_COLUMNS, recipe_text

# The runs table: these columns when the table has data in them (status and its reason always).
TABLE_COLUMNS = [
    "run_id", "status", "status_reason", "method", "precision", "recipe", "batch_size", "seq_len", "lora_rank",
    "num_gpus", "parallel", "repeat", "device_name", "steps", "tokens_per_s", "tokens_per_s_ci95", "unstable",
    "unstable_reason", "samples_per_s", "images_per_s", "image_tokens_per_s", "text_tokens_per_s", "trained_tokens_per_s", "step_time_median_s",
    "peak_memory_allocated_mb", "peak_memory_reserved_mb", "peak_rss_mb", "memory_estimate_mb", "estimate_over_allocated",
    "estimate_over_rss", "eval_accuracy", "eval_recall_at_1_i2t", "eval_recall_at_1_t2i", "eval_token_accuracy", "eval_generation_score",
    "quality_ci95", "quality_vs_base", "eval_perplexity", "base_eval_perplexity", "eval_loss", "base_eval_loss", "eval_samples",
    "eval_majority_class_rate", "eval_generation_s", "eval_generation_rows", "eval_generated_tokens", "mfu", "cost_per_1m_tokens", "cost_ci95",
    "cost_per_1m_trained_tokens", "cost_per_1k_samples", "cost_per_1k_images",
    "projected_hours", "projected_gpu_hours", "projected_cost", "projected_cost_ci95", "energy_j_per_token", "energy_cost_per_1m_tokens",
    "trainable_params", "wall_time_s",
]
ALWAYS_SHOWN = {"run_id", "status", "status_reason"}
# The runs table's interval text of each cost figure (analysis.RUN_PER_THROUGHPUT), as the configurations table names it.
RUN_INTERVAL_TEXT = {"cost_per_1m_tokens": "cost_ci95", "projected_cost": "projected_cost_ci95"}
RUN_TITLES = {
    "recipe": "which dtype each kind of tensor was kept in (the row's recipe_* columns): the frozen base, the trained "
              "parameters (fp32 masters under mixed precision), autocast, the optimizer's state",
    "steps": "optimizer steps: the measured window (timed) + the warmup before it (not timed), and the planned total "
             "when the run stopped early",
    "tokens_per_s_ci95": "95% interval of tokens/s from the step-time spread of this run's measured window (ratio "
                         "interval over its steps): the measurement noise of this process, not run-to-run variation",
    "unstable": f"window-mean tokens/s and the median-based figure (tokens per step / median step time) differ by more "
                f"than {analysis.MEAN_MEDIAN_THRESHOLD:.0%}, or the median step time of the window's halves by more than "
                f"{analysis.DRIFT_THRESHOLD:.0%}: the window mean is not a stable figure",
    "unstable_reason": "what made the run unstable",
    "estimate_over_allocated": "memory estimate / CUDA peak allocated (what the estimate models); reserved adds the allocator's cache",
    "estimate_over_rss": "memory estimate / the process's peak resident memory (CPU runs)",
    "quality_ci95": "95% Wilson interval of the run's quality on its eval rows (sequences for language models, prompts "
                    "answered for a generation score)",
    "eval_generation_score": "share of the eval prompts whose greedily generated answer matches the reference completion "
                             "(the run's answer_metric, after normalisation)",
    "eval_generation_s": "seconds the final evaluation spent generating answers (device synchronised), within eval_time_s; "
                         "no evaluation is in the training clock or tokens/s",
    "eval_generation_rows": "eval prompts answered by generation (the n of the generation score's interval)",
    "eval_generated_tokens": "tokens generated for those answers, each up to the token that ended it (no padding)",
    "quality_vs_base": "whether fine-tuning helped: the run's quality beside the model's before training (base: "
                       "eval_before_training, on the same eval rows) and, for classification, the accuracy of always "
                       "answering the scored rows' most common class (majority)",
    "base_eval_perplexity": "eval perplexity of the model before training (eval_before_training), on the same eval rows",
    "base_eval_loss": "eval loss of the model before training (eval_before_training), on the same eval rows",
    "cost_ci95": "95% interval of the run's $ per 1M tokens: its within-run throughput interval's ends (cost = price / throughput)",
    "projected_cost_ci95": "95% interval of the run's training-budget cost, from its within-run throughput interval",
}
CONFIG_TABLE_COLUMNS = ["configuration", "method", "recipe", "runs", "ok", "measured", "tokens_per_s", "tokens_per_s_ci95", "interval_basis",
                        "tokens_per_s_cv", "unstable", "unstable_runs", "cost_per_1m_tokens", "cost_ci95", "QUALITY", "quality_ci95",
                        "quality_vs_base", "eval_perplexity", "base_eval_perplexity", "peak_memory_allocated_mb", "peak_memory_reserved_mb", "peak_rss_mb", "memory_estimate_mb",
                        "projected_hours", "projected_cost", "projected_cost_ci95"]
RECOMMEND_TABLE_COLUMNS = ["method", "configuration", "cost_per_1m_tokens", "cost_ci95", "tokens_per_s", "tokens_per_s_ci95",
                           "tied_with", "QUALITY", "quality_ci95", "peak_memory_mb", "projected_cost"]
ENVIRONMENT_COLUMNS = [
    "host", "device_name", "gpu_names", "gpu_driver", "cuda_version", "cpu", "torch_version",
    "transformers_version", "peft_version", "bitsandbytes_version", "git_commit", "slurm_job_id", "price_source",
]


def config_titles(scoring: str) -> dict[str, str]:
    """The configuration table's header tooltips; ``scoring`` is how repeats became one figure."""
    scored = analysis.REPEAT_SCORING[scoring]
    return {
        "configuration": "runs that differ only in their repeat index share a configuration",
        "runs": "runs of this configuration (repeats)",
        "ok": "runs that finished with status ok",
        "measured": "runs with a measured throughput: finished, or timed out after measuring steps",
        "tokens_per_s": f"real tokens per second, {scored} (finished and timed-out runs)",
        "tokens_per_s_ci95": "95% interval of tokens/s (see interval_basis)",
        "interval_basis": "repeats: Student-t interval of the mean of 3 or more repeats (run-to-run variation); within-run: "
                          "the span of the runs' window intervals (measurement noise of each process only)",
        "tokens_per_s_cv": "coefficient of variation of tokens/s (std / mean) over the repeats",
        "unstable": f"CV above {CV_THRESHOLD:.0%}",
        "unstable_runs": "runs whose measured window is unstable (see the runs table)",
        "cost_per_1m_tokens": f"$ per million training tokens, {scored}",
        "cost_ci95": "95% interval of the cost: the throughput interval's ends (cost = price / throughput)",
        "quality_ci95": "95% Wilson interval of the median quality on n eval rows (sequences for language models); "
                        "repeats score the same rows, so they do not narrow it",
        "quality_vs_base": "whether fine-tuning helped: the median quality beside the median of the model before training "
                           "(base: eval_before_training) and, for classification, the majority-class rate (majority)",
        "eval_perplexity": "median eval perplexity (language models)",
        "base_eval_perplexity": "median eval perplexity of the model before training (eval_before_training)",
        "peak_memory_mb": "median peak memory (MiB): CUDA reserved on a GPU, peak RSS on a CPU",
        "peak_memory_allocated_mb": "median CUDA peak allocated (MiB): what the memory estimate models",
        "peak_memory_reserved_mb": "median CUDA peak reserved (MiB): allocated plus the allocator's cache; what the GPU must hold",
        "peak_rss_mb": "median peak resident memory of the process (MiB), model loading included",
        "memory_estimate_mb": "memory estimated before training (MiB); compare with allocated",
        "projected_hours": f"projected wall hours of the training budget, {scored}",
        "projected_cost": f"$ of the training budget, {scored}",
        "projected_cost_ci95": "95% interval of the training budget's cost (from the throughput interval)",
        "tied_with": "configurations of the same method whose interval overlaps this one's: a tie, not a ranking",
    }


CONVENTIONS = [
    "Throughput: real (unpadded) tokens over the measured window (warmup steps excluded, device synchronised "
    "before each clock read), all devices together; per-device throughput is a separate column. A run stopped by its "
    "time limit (timeout) keeps the throughput of the steps it measured.",
    "Intervals (95%): accuracy, the Wilson score interval on the eval rows (sequences for language models: the scored "
    "tokens are not counted, and tokens of one sequence are not independent). Throughput with 3 or more repeats, the "
    "Student-t interval of their mean; with fewer, each run's within-run interval from the spread of its measured "
    "steps (ratio of sums, t on the steps), which bounds that process's measurement noise, not run-to-run variation. "
    "Cost follows throughput (price / throughput).",
    "Ties: configurations whose 95% intervals overlap are called within noise of each other, never ranked.",
    f"Unstable run: window-mean and median-based tokens/s differ by more than {analysis.MEAN_MEDIAN_THRESHOLD:.0%}, or the "
    f"window's second-half median step time differs from its first half's by more than {analysis.DRIFT_THRESHOLD:.0%}.",
    "Peak memory: CUDA max_memory_allocated and max_memory_reserved on a GPU (reserved adds the caching allocator's "
    "free blocks; the estimate models allocated); the process's peak resident memory on a CPU (model loading included).",
    "Quality: per task - classification accuracy on the held-out split; for language-model runs the next-token (or "
    "target-token) accuracy and perplexity; for image-text retrieval recall@1, the mean of image->text and text->image "
    "recall@1 over the eval split (a retrieved item is right when its caption text is the query's). Runs on synthetic "
    "(random-token) data show none. Whether fine-tuning helped (quality_vs_base): the quality beside the model's before "
    "training (base, with eval_before_training: the same eval rows, scored before the first step) and, for "
    "classification, the accuracy of always answering the scored rows' most common class (majority).",
    "MFU: analytic model FLOP/s (6N per token for full fine-tuning, 4N + 2N_trainable with adapters, plus attention; "
    "recomputation not counted) over the dense peak of the run's dtype in config/gpus.yaml, times the GPUs.",
    "Cost: $ per device-hour (config/prices.yaml or the experiment's prices key) x devices held, divided by the measured "
    "tokens (or samples) per hour; a CPU run pays for one machine. A device without a price gets no cost, never a guess.",
    "Budget: projected wall hours of the configured training budget at the measured throughput; GPU-hours = hours x GPUs; "
    "energy cost = NVML J per token x tokens x $ per kWh (GPU boards only).",
]
# The per-step records: read once per report (analysis.read_steps), as collect reads them.
STEP_COLUMNS, read_steps = analysis.STEP_COLUMNS, analysis.read_steps


def shown_columns(frame: pd.DataFrame, columns: list[str], always: set[str]) -> list[str]:
    """The columns of ``columns`` the table has and has data in (those in ``always`` regardless); the
    QUALITY marker stands for the table's quality columns (quality_columns)."""
    expanded = [name for c in columns for name in (quality_columns(frame) if c == QUALITY else [c])]
    return [c for c in expanded if c in frame and (c in always or frame[c].notna().any())]


# In a column list: one column per quality figure the table's tasks have (accuracy, token_accuracy, ...).
QUALITY = "QUALITY"


def quality_columns(frame: pd.DataFrame) -> list[str]:
    """The per-task quality columns with_display_columns made: one per quality figure, named after it."""
    return [name for name in frame.columns if name in {q.name.replace(" ", "_") for q in analysis.QUALITIES}]


def span(low, high, column: str) -> str | None:
    """An interval as text, written like its column's values ('19,750-20,250', '$0.041-$0.042')."""
    if is_missing(low) or is_missing(high):
        return None
    if column in ("accuracy", "quality"):
        return f"{low:.3f}\u2013{high:.3f}"
    return f"{fmt(float(low), column)}\u2013{fmt(float(high), column) if high != float('inf') else 'unbounded'}"


def read_against(base, majority) -> str:
    """What a quality is read against, in words: 'base 0.510, majority 0.580' (the model before training, always
    answering the majority class), the parts there are; '' without either."""
    parts = [f"{name} {float(value):.3f}" for name, value in (("base", base), ("majority", majority)) if not is_missing(value)]
    return ", ".join(parts)


def against_base(quality, base, majority) -> str | None:
    """A quality with what it is read against: '0.764 (base 0.510, majority 0.580)'. None without a quality or
    without anything to read it against (the column then stays out of the table)."""
    against = read_against(base, majority)
    return f"{float(quality):.3f} ({against})" if against and not is_missing(quality) else None


def steps_text(row: pd.Series) -> str | None:
    """'50 measured + 10 warmup', with the planned total when the run stopped before it."""
    measured, warmup, total = row["measured_steps"], row["warmup_steps"], row["total_steps"]
    if is_missing(measured) or is_missing(warmup):
        return None
    text = f"{measured} measured + {warmup} warmup"
    return text if is_missing(total) or measured + warmup == total else f"{text} of {total} planned"


def recipes_of(runs: pd.DataFrame) -> pd.Series:
    """Each run's recipe in one line (recipe.recipe_text), from its recipe columns; null where a row has none."""
    def value(row, name):
        found = row.get(name)
        return None if is_missing(found) else found

    names = list(RECIPE_COLUMNS)
    texts = [recipe_text(*(value(row, name) for name in names[:5])) for _, row in runs.iterrows()]
    return pd.Series(pd.array(texts, dtype="string"), index=runs.index)


def with_display_columns(runs: pd.DataFrame) -> pd.DataFrame:
    """The runs (add_step_figures) with the runs table's text columns: steps, intervals, the memory
    estimate over its like, and the quality interval."""
    runs = runs.copy()
    runs["steps"] = pd.array([steps_text(row) for _, row in runs.iterrows()], dtype="string")
    runs["recipe"] = recipes_of(runs)
    runs["tokens_per_s_ci95"] = [span(low, high, "tokens_per_s")
                                 for low, high in zip(runs["tokens_per_s_low"], runs["tokens_per_s_high"])]
    runs["quality_ci95"] = [span(low, high, "quality") for low, high in zip(runs["quality_low"], runs["quality_high"])]
    runs["quality_vs_base"] = [against_base(*values) for values in
                               zip(runs["quality"], runs["base_quality"], runs["eval_majority_class_rate"])]
    for column, (low_column, high_column) in analysis.RUN_PER_THROUGHPUT.items():
        runs[RUN_INTERVAL_TEXT[column]] = [span(low, high, column) for low, high in zip(runs[low_column], runs[high_column])]
    gpu = runs["device"].eq("cuda").fillna(False).astype(bool)
    runs["estimate_over_allocated"] = runs["memory_estimate_ratio"].where(gpu)
    runs["estimate_over_rss"] = runs["memory_estimate_ratio"].where(~gpu)
    return runs


def configuration_rows(configs: pd.DataFrame, runs: pd.DataFrame | None = None) -> pd.DataFrame:
    """Configurations (or recommendation rows) with their intervals as text and a quality column per task's figure;
    with ``runs`` (with_display_columns), each configuration's recipe (its runs share it)."""
    configs = configs.copy()
    if runs is not None and "config_key" in runs and "config_key" in configs:
        configs["recipe"] = configs["config_key"].map(runs.groupby("config_key")["recipe"].first())
    for column, (low, high) in analysis.INTERVALS.items():
        name = "quality_ci95" if column == "accuracy" else f"{column.removesuffix('_per_1m_tokens')}_ci95"
        configs[name] = [span(a, b, column) for a, b in zip(configs[low], configs[high])]
    configs["quality_vs_base"] = [against_base(*values) for values in
                                  zip(configs["accuracy"], configs["base_accuracy"], configs["majority_rate"])]
    # "accuracy" is both the configurations' quality column and classification's figure: read it first.
    value = configs["accuracy"].copy()
    for quality in dict.fromkeys(q.name for q in analysis.QUALITIES):
        configs[quality.replace(" ", "_")] = value.where(configs["quality_metric"].eq(quality))
    return configs


def runs_table(runs: pd.DataFrame, columns: list[str]) -> pages.Table:
    return pages.table(runs, columns, table_id="runs", row_class=lambda row: f"status-{row['status']}", titles=RUN_TITLES)


def figure_blocks(written: dict[str, Path | str], captions: dict[str, str],
                  notes: dict[str, str] | None = None) -> list[pages.FigureBlock]:
    """``notes``: figure name -> what the drawn figure leaves out (runs without a valid throughput, ...)."""
    titles = {spec.name: spec.title for spec in [*figures.FIGURES, figures.THROUGHPUT_RATIO, figures.QUALITY_VS_COST,
                                                 figures.SCALING_PER_GPU]}
    notes = notes or {}
    return [pages.figure_block(name, titles[name], result, captions, notes.get(name)) for name, result in written.items()]


def throughput_notes(runs: pd.DataFrame) -> dict[str, str]:
    """For the figures drawn from measured throughputs: which runs they leave out and why."""
    left_out = analysis.unmeasured_counts(runs)
    if not left_out:
        return {}
    note = ("Not shown: " + ", ".join(f"{count} {status}" for status, count in left_out.items())
            + " run(s), whose steps are not a configuration's speed (their reasons are in the runs table).")
    return {name: note for name in ("throughput", "cost", "step_time", "scaling", "accuracy_vs_cost")}


# ---------------------------------------------------------------------------------------------------
# The sections' content: ties instead of rankings where intervals overlap


def separation(a: pd.Series, b: pd.Series, column: str) -> str:
    """What would tell two tied configurations apart on ``column`` (analysis.to_separate), in words."""
    need = analysis.to_separate(a, b, column)
    if "same" in need:
        return "they measured the same value"
    if "eval_rows" in need:
        return (f"about {need['eval_rows']:,} eval rows (not more repeats: they score the same rows) would separate "
                f"{a['configuration']} and {b['configuration']}")
    if "repeats" in need:
        if need["repeats"] is None:
            return "more than 1,000 repeats each would be needed: the difference is deep inside their spread"
        return (f"about {need['repeats']} repeats each would separate {a['configuration']} and {b['configuration']}, from "
                "the spread their repeats showed")
    return f"about {need['window']:.1f}x longer measured windows would separate these"


def ranked_fact(lead: str, candidates: pd.DataFrame, column: str, higher_is_better: bool, describe,
                context=lambda row: "") -> dict | None:
    """One summary line: the best configuration on ``column`` with its interval, or - when others'
    intervals overlap the best's - the tie, named as such, with what would separate the first two.
    ``context``: what a figure was measured on (' on 1,000 eval rows; ...'), said once for a tie that shares it."""
    order = analysis.ranked(candidates, column, higher_is_better)
    if order.empty:
        return None
    tied = order[order["tied"]]
    contexts = [context(row) for _, row in tied.iterrows()]
    shared = contexts[0] if len(set(contexts)) == 1 and len(contexts) > 1 else None
    entries = [{"configuration": name_of(row), "detail": describe(row) + ("" if shared is not None else said)}
               for (_, row), said in zip(tied.iterrows(), contexts)]
    fact = {"lead": lead, "configuration": entries[0]["configuration"], "detail": entries[0]["detail"], "tied": [], "separate": None,
            "context": f"all{shared}" if shared else None}
    if len(tied) > 1 and column not in analysis.INTERVALS:
        fact.update(tied=entries, why="they measured the same", separate="they measured the same")
    elif len(tied) > 1:
        fact.update(tied=entries, why="their 95% intervals overlap", separate=separation(tied.iloc[0], tied.iloc[1], column))
    return fact


def name_of(row: pd.Series) -> str:
    """A configuration's name, marked when no run of it finished (its figures come from timed-out runs)."""
    return row["configuration"] + (" (timed out)" if row["ok"] == 0 else "")


def summary(runs: pd.DataFrame, configs: pd.DataFrame, warnings: list[str]) -> dict:
    """Counts, what the runs cover, one fact per question (fastest, cheapest, ...) - a tie where the
    intervals overlap - and notes to read first."""
    counts = runs["status"].value_counts().to_dict()
    ok, measured = configs[configs["ok"] > 0], configs[configs["measured"] > 0]
    notes = list(warnings)
    facts = summary_facts(configs, ok, measured, notes)
    notes += run_notes(runs, configs)
    if measured["interval_basis"].astype(str).str.startswith("within-run").any():
        notes.append(WITHIN_RUN_NOTE)
    return {
        "runs": len(runs), "configurations": len(configs), "scope": scope(runs), "facts": [f for f in facts if f],
        "notes": notes, "statuses": ", ".join(f"{count} {status}" for status, count in sorted(counts.items())),
        "nothing_finished": ok.empty, "measured_only": len(measured) if ok.empty else 0,
    }


# Said once, for every throughput and cost interval of configurations with fewer than 3 repeats.
WITHIN_RUN_NOTE = ("Fewer than 3 repeats: a throughput or cost interval bounds one run's measurement noise, not run-to-run "
                   "variation; 3 or more repeats each would tell whether a difference holds from run to run.")


def scope(runs: pd.DataFrame) -> list[tuple[str, str]]:
    """What the runs cover: (models, "a, b"), (datasets, ...), ... for the columns that have values."""
    covered = []
    for column, name in (("model", "models"), ("dataset", "datasets"), ("method", "methods"), ("device_name", "devices")):
        values = sorted(runs[column].dropna().astype(str).unique()) if column in runs else []
        if values:
            covered.append((name, ", ".join(values)))
    return covered


def _with_span(value: str, row: pd.Series, column: str) -> str:
    low, high = analysis.INTERVALS[column]
    text = span(row[low], row[high], column)
    return f"{value} (95% interval {text})" if text else value


def _memory(row: pd.Series) -> str:
    if is_missing(row["peak_memory_reserved_mb"]):
        return f"{fmt(row['peak_memory_mb'])} MiB peak RSS"
    return f"{fmt(row['peak_memory_mb'])} MiB CUDA reserved, {fmt(row['peak_memory_allocated_mb'])} MiB allocated"


def _quality(row: pd.Series) -> str:
    return _with_span(f"{row['accuracy']:.3f} {row['quality_metric']}", row, "accuracy")


def _quality_context(row: pd.Series) -> str:
    """' on 1,000 eval rows; base 0.523, majority 0.575': what a quality was scored on and is read against."""
    counted = next(q.n_note for q in analysis.QUALITIES if q.name == row["quality_metric"])
    rows = f" on {int(row['quality_n']):,} {counted}" if not is_missing(row["quality_n"]) else ""
    against = read_against(row["base_accuracy"], row["majority_rate"])  # whether fine-tuning helped
    return f"{rows}; {against}" if against else rows


def _budget(row: pd.Series) -> str:
    hours = f" ({row['projected_hours']:.3g} h)" if not is_missing(row["projected_hours"]) else ""
    return _with_span(money(row["projected_cost"]), row, "projected_cost") + hours


def summary_facts(configs: pd.DataFrame, ok: pd.DataFrame, measured: pd.DataFrame, notes: list[str]) -> list:
    """One ranked fact per question (None where nothing answers it); a quality metric every configuration
    scored 0 gets a note in ``notes`` instead of a fact."""
    facts = [
        ranked_fact("Fastest", measured, "tokens_per_s", True,
                    lambda row: _with_span(f"{fmt(row['tokens_per_s'])} tokens/s", row, "tokens_per_s")),
        ranked_fact("Cheapest", measured, "cost_per_1m_tokens", False,
                    lambda row: _with_span(f"{money(row['cost_per_1m_tokens'])} per 1M tokens", row, "cost_per_1m_tokens")),
    ]
    metrics = ok["quality_metric"].dropna().unique()
    for metric in metrics:
        scored = ok[ok["quality_metric"].eq(metric)]
        if scored["accuracy"].max() == 0:
            notes.append(f"Every evaluated configuration scored {metric} 0: there is no most accurate one.")
            continue
        facts.append(ranked_fact("Most accurate" + (f" ({metric})" if len(metrics) > 1 else ""), scored, "accuracy", True, _quality,
                                 _quality_context))
    facts.append(ranked_fact("Smallest memory", configs, "peak_memory_mb", False, _memory))
    facts.append(ranked_fact("Cheapest training budget", measured, "projected_cost", False, _budget))
    return facts


def run_notes(runs: pd.DataFrame, configs: pd.DataFrame) -> list[str]:
    """Notes to read before the figures: runs cut short, not finished, on synthetic data, or unstable."""
    notes = []
    timed_out = runs[runs["status"].eq("timeout")]
    if not timed_out.empty:
        with_steps = int(timed_out["tokens_per_s"].notna().sum())
        notes.append(f"{len(timed_out)} run(s) timed out, {with_steps} of them after measuring steps: their throughput and cost "
                     "are shown (marked timeout); their quality is not compared, since a run cut short is not the trained model.")
    bad = runs[~runs["status"].isin(analysis.MEASURED_STATUSES)]
    if not bad.empty:
        notes.append(f"{len(bad)} run(s) did not finish ({', '.join(sorted(bad['status'].astype(str).unique()))}): "
                     "they are in the table with their reason, left out of the throughput and quality figures.")
    synthetic = runs["data_kind"].eq(analysis.SYNTHETIC).fillna(False)
    if synthetic.any():
        notes.append(f"{int(synthetic.sum())} run(s) trained on synthetic (random-token) data: no quality figure is shown "
                     "for them, since their accuracy measures nothing.")
    notes += unstable_notes(runs)
    for _, row in configs[configs["unstable"].eq(True)].iterrows():
        notes.append(f"Unstable: {row['configuration']} varies by {row['tokens_per_s_cv']:.1%} (CV of tokens/s over "
                     f"{row['measured']} repeats, threshold {CV_THRESHOLD:.0%}); compare it with care.")
    return notes


def unstable_notes(runs: pd.DataFrame) -> list[str]:
    """A note per unstable run, with its two figures; where every measured run of a device kind (every CPU run,
    every GPU run, or every run) is unstable, one note says so for all of them instead."""
    windowed = runs[runs["unstable"].notna()]
    unstable = windowed["unstable"].eq(True)
    notes, said = [], pd.Series(False, index=windowed.index)
    devices = windowed["device"].astype("string").fillna("")
    kinds = {"Every run's": pd.Series(True, index=windowed.index)}
    if devices.nunique() > 1 and not unstable.all():
        kinds = {f"Every {label} run's": devices.eq(device) for device, label in (("cpu", "CPU"), ("cuda", "GPU"))}
    for who, of_kind in kinds.items():
        if of_kind.sum() > 1 and unstable[of_kind].all():
            notes.append(f"{who} measured window is unstable ({int(of_kind.sum())} runs: window-mean and "
                         f"median-based tokens/s differ by more than {analysis.MEAN_MEDIAN_THRESHOLD:.0%}, or step time drifts "
                         f"by more than {analysis.DRIFT_THRESHOLD:.0%} across the window; each run's reason is in the runs "
                         "table): read their throughput and cost with care.")
            said |= of_kind
    for _, row in windowed[unstable & ~said].iterrows():
        if row.get("unstable_reason") == analysis.TOO_SHORT_REASON:
            notes.append(f"Run {row['run_id']}: {analysis.TOO_SHORT_REASON}; read its tokens/s ({fmt(row['tokens_per_s'])}) "
                         "and $ as a single step's, not a measured rate.")
            continue
        notes.append(f"Unstable run {row['run_id']}: {row['unstable_reason']}; its window-mean tokens/s ({fmt(row['tokens_per_s'])}, "
                     f"median-based {fmt(row['tokens_per_s_median_based'])}) is not a stable figure.")
    return notes


def recommendation(configs: pd.DataFrame, settings: dict) -> dict:
    """The recommendation (analysis.recommend) with the settings it answers, what came closest, the
    configurations within noise of the pick and whether the pick's accuracy interval clears the floor."""
    min_accuracy, max_memory = settings.get("min_accuracy"), settings.get("max_memory_mb")
    result = analysis.recommend(configs, min_accuracy, max_memory)
    closest = []
    if min_accuracy is not None and not is_missing(result["closest"]["accuracy"]):
        closest.append(f"The best accuracy was {result['closest']['accuracy']:.3f}")
    if max_memory is not None and not is_missing(result["closest"]["peak_memory_mb"]):
        closest.append(f"the smallest peak memory {result['closest']['peak_memory_mb']:,.0f} MiB")
    per_method = configuration_rows(result["per_method"])
    columns = [c for c in shown_columns(per_method, RECOMMEND_TABLE_COLUMNS, {"method", "configuration"})]
    best, notes = result["best"], []
    if best is not None:
        best_row = pd.Series(best)
        tied = result["tied"]
        if not tied.empty:
            notes.append(f"Within noise of it (their 95% intervals of {'$ per 1M tokens' if result['basis'] == 'cost' else 'tokens/s'} "
                         f"overlap): {', '.join(tied['configuration'])}. That is a tie, not a ranking: "
                         f"{separation(best_row, tied.iloc[0], result['column'])}.")
        low = best.get("accuracy_low")
        if min_accuracy is not None and not is_missing(low) and low < min_accuracy:
            notes.append(f"Its accuracy interval ({span(low, best['accuracy_high'], 'accuracy')} on {int(best['quality_n']):,} eval rows) "
                         f"reaches below the floor of {min_accuracy:g}: the floor is met at the point estimate, not beyond noise.")
        best = {key: None if is_missing(value) else value for key, value in best.items()}
        best["spans"] = {column: span(best_row[low_column], best_row[high_column], column)
                         for column, (low_column, high_column) in analysis.INTERVALS.items()}
    return {
        "basis": result["basis"], "candidates": result["candidates"], "closest": closest,
        "min_accuracy": min_accuracy, "max_memory_mb": max_memory, "best": best, "notes": notes,
        "per_method": pages.table(per_method, columns, table_id="recommend-per-method", titles=config_titles(configs.attrs.get("scoring", "median"))),
    }


TO_TARGET_COLUMNS = ["configuration", "method", "runs", "reached", "cost_to_target", "cost_to_target_ci95", "within_noise",
                     "gpu_hours_to_target", "tokens_to_target", "cost_per_1m_tokens", "projected_cost"]
TO_TARGET_TITLES = {
    "reached": "finished runs of the configuration that reached the target",
    "cost_to_target": "$ of the training until the target: tokens to it (interpolated between the evaluations that straddle "
                      "it) at the measured rate and price; median of the runs that reached it",
    "cost_to_target_ci95": "95% interval: where the ends of the evaluations' intervals reach the target, widened by the "
                           "throughput interval ('unbounded': the pessimistic end never reaches it)",
    "within_noise": "its interval overlaps the cheapest's: a tie with it, not a ranking",
    "gpu_hours_to_target": "device-hours until the target at the measured rate",
    "tokens_to_target": "training tokens until the target",
    "projected_cost": "$ of the configured training budget (another question: a fixed amount of training)",
}


def to_target(configs: pd.DataFrame, runs: pd.DataFrame) -> dict | None:
    """The section on the quality target (quality_target): the configurations that reached it ranked by cost to
    target, ties within noise named, those that never reached it, and how it differs from the budget projection.
    None without a target."""
    target = quality_target.target_of(runs)
    if target is None:
        return None
    result = quality_target.rank_to_target(quality_target.configurations_to_target(configs, runs))
    ranked = result["ranked"]
    shown = ranked.assign(cost_to_target_ci95=[span(low, high, "cost_to_target") for low, high in
                                                zip(ranked["cost_to_target_low"], ranked["cost_to_target_high"])],
                          within_noise=ranked["tied"] if "tied" in ranked else [])
    leaders = shown[shown["within_noise"].eq(True)]["configuration"].tolist() if not shown.empty else []
    columns = shown_columns(shown, TO_TARGET_COLUMNS, {"configuration", "reached"})
    return {
        "metric": target["metric"], "value": target["value"], "basis": result["basis"], "leaders": leaders,
        "never": result["never"], "projection": quality_target.PROJECTION_VS_TARGET,
        "table": pages.table(shown, columns, table_id="to-target", titles=TO_TARGET_TITLES),
    }


def target_notes(section: dict | None) -> list[str]:
    """The summary's notes on the target: which configurations never reached it."""
    if not section or not section["never"]:
        return []
    return [f"Never reached the target ({section['metric']} {section['value']:g}) in the evaluations of their finished runs: "
            f"{', '.join(section['never'])}."]


SCALING_POINT_COLUMNS = ["configuration", "mode", "gpus", "tokens_per_s_all_gpus", "tokens_per_s_all_gpus_ci95", "tokens_per_s_per_gpu",
                         "tokens_per_s_per_gpu_ci95", "efficiency", "efficiency_ci95", "peak_memory_per_gpu_mb",
                         "peak_allocated_per_gpu_mb", "cost_per_1m_tokens", "cost_ci95", "measured", "interval_basis"]
CHEAPEST_MODE_COLUMNS = ["model", "params", "configuration", "gpu", "cheapest", "cost_per_1m_tokens", "cost_ci95", "within_noise",
                         "beyond_noise", "basis"]
SCALING_TITLES = {
    "configuration": "the configuration without its parallel settings (parallel, num_gpus, num_nodes, fsdp options): "
                     "what is followed across GPU counts",
    "mode": "how the run was spread: single (one GPU, no wrapper), dp, ddp, fsdp, with fsdp options as +suffix",
    "gpus": "GPUs that trained together (the recorded world size; what the cost pays for)",
    "tokens_per_s_all_gpus": "global throughput: real tokens per second of all the run's GPUs together",
    "tokens_per_s_all_gpus_ci95": "95% interval of the global throughput (see interval_basis)",
    "tokens_per_s_per_gpu": "per-GPU throughput: the global throughput / GPUs",
    "tokens_per_s_per_gpu_ci95": "95% interval of the per-GPU throughput: the global interval / GPUs",
    "efficiency": "scaling efficiency: tokens/s per GPU / tokens/s of the same configuration in mode single on one GPU "
                  "(1.0 = linear scaling)",
    "efficiency_ci95": "95% interval of the efficiency: the ends of the two throughput intervals divided crosswise; it reaches "
                       "1.0 exactly when the two are within noise of each other",
    "peak_memory_per_gpu_mb": "peak CUDA reserved per GPU (MiB): the most loaded GPU, median of repeats",
    "peak_allocated_per_gpu_mb": "peak CUDA allocated per GPU (MiB): the most loaded GPU, median of repeats",
    "cost_per_1m_tokens": "$ per million tokens: the price of every GPU held over the global throughput",
    "cost_ci95": "95% interval of the cost (from the throughput interval)",
    "measured": "runs with a measured throughput",
    "params": "the model's parameters (all, 4-bit weights counted as the values they represent)",
    "gpu": "the GPU model",
    "cheapest": "the mode and GPU count with the lowest $ per 1M tokens (highest tokens/s per GPU where no run has a price)",
    "within_noise": "other points whose interval overlaps the cheapest's: a tie with it, not a ranking",
    "beyond_noise": "points more expensive beyond noise",
    "basis": "what the points are ranked by: cost, or per-GPU throughput when no run has a price",
}


def scaling_section(table: pd.DataFrame, runs: pd.DataFrame, figure: pages.FigureBlock | None) -> dict:
    """The section on scaling over GPUs (scaling.py): the cheapest mode per model size with its ties, every
    point's global and per-GPU throughput, memory per GPU and efficiency, the figure, and notes saying which
    configurations have no single-GPU baseline and which multi-GPU runs measured nothing."""
    cheapest = scaling.cheapest_modes(table)
    notes = [f"{row['series_label']}: {row['cheapest']} ({_ranked_figure(row)}) and {row['within_noise']} are within noise of each other "
             f"(their 95% intervals of {'$ per 1M tokens' if row['basis'] == 'cost' else 'tokens/s per GPU'} overlap): "
             "a tie, not a ranking." for _, row in cheapest[cheapest["within_noise"].notna()].iterrows()]
    notes += [f"No baseline for {label}: it was not measured in mode single on one GPU, so its scaling efficiency is "
              "left out rather than estimated." for label in scaling.without_baseline(table)]
    unmeasured = scaling.unmeasured_multi_gpu(runs)
    if unmeasured:
        notes.append(f"Meant for several GPUs, measured no throughput (not in the tables; reasons in the runs table): "
                     f"{', '.join(unmeasured)}.")
    cheapest = cheapest.assign(params=cheapest["model_params"].map(_parameters), configuration=cheapest["series_label"],
                               gpu=cheapest["device_name"].map(analysis.short_device),
                               cost_ci95=[span(low, high, "cost_per_1m_tokens") for low, high in zip(cheapest["cost_low"], cheapest["cost_high"])])
    points = _scaling_rows(table)
    return {
        "cheapest": pages.table(cheapest, shown_columns(cheapest, CHEAPEST_MODE_COLUMNS, {"model", "configuration", "cheapest"}),
                                table_id="scaling-cheapest", titles=SCALING_TITLES),
        "points": pages.table(points, shown_columns(points, SCALING_POINT_COLUMNS, {"configuration", "mode", "gpus", "efficiency_ci95"}),
                              table_id="scaling-points", titles=SCALING_TITLES),
        "notes": notes, "figure": figure,
    }


def _scaling_rows(table: pd.DataFrame) -> pd.DataFrame:
    """scaling_table's points under the section's column names, with their intervals as text; the efficiency's
    interval column says 'baseline' or 'no baseline' where there is no interval to give."""
    rows = table.assign(configuration=table["series_label"], tokens_per_s_all_gpus=table["tokens_per_s"],
                        peak_memory_per_gpu_mb=table["peak_memory_reserved_mb"], peak_allocated_per_gpu_mb=table["peak_memory_allocated_mb"])
    rows["tokens_per_s_all_gpus_ci95"] = [span(a, b, "tokens_per_s") for a, b in zip(table["tokens_per_s_low"], table["tokens_per_s_high"])]
    rows["tokens_per_s_per_gpu_ci95"] = [span(a, b, "tokens_per_s")
                                         for a, b in zip(table["tokens_per_s_per_gpu_low"], table["tokens_per_s_per_gpu_high"])]
    rows["cost_ci95"] = [span(a, b, "cost_per_1m_tokens") for a, b in zip(table["cost_low"], table["cost_high"])]
    rows["efficiency_ci95"] = [
        "baseline" if baseline else "no baseline (no single run on 1 GPU)" if not has_baseline else span(a, b, "efficiency")
        for baseline, has_baseline, a, b in zip(table["baseline"], table["has_baseline"], table["efficiency_low"], table["efficiency_high"])]
    return rows


def _ranked_figure(row: pd.Series) -> str:
    """The figure a cheapest-mode row was picked on, written as scaling.cheapest_modes writes the others'."""
    return money(row["cost_per_1m_tokens"]) if row["basis"] == "cost" else f"{fmt(row['tokens_per_s_per_gpu'])} tokens/s per GPU"


def _parameters(count) -> str | None:
    """A parameter count as people say it: '1.24B', '124M'."""
    if is_missing(count):
        return None
    return f"{count / 1e9:.3g}B" if count >= 1e9 else f"{count / 1e6:.3g}M"


def what_fits(runs: pd.DataFrame, gpus: list[dict]) -> pages.Table | None:
    """The section on what fits: each configuration's memory estimate (made before training, per GPU) against
    every GPU of the table with a memory size: yes / borderline / no, allowing for the estimate's error band
    (memory_plan's rule, the one `python -m ftbench plan` and a train job's refusal use). None without estimates."""
    sized = [gpu for gpu in gpus if gpu.get("memory_gb")]
    estimated = runs[runs["memory_estimate_mb"].notna()].drop_duplicates("config_id")
    if estimated.empty or not sized:
        return None
    names = estimated["config_label"] if "config_label" in estimated else estimated["config_id"]  # as Configurations names them
    rows = pd.DataFrame({"configuration": names, "estimate MiB per GPU": estimated["memory_estimate_mb"],
                         "measured / estimate": 1 / estimated["memory_estimate_ratio"]})
    titles = {}
    for gpu in sized:
        capacity = memory_plan.capacity_mib(gpu)
        rows[gpu["name"]] = [memory_estimate.fit(estimate, capacity) for estimate in estimated["memory_estimate_mb"]]
        titles[gpu["name"]] = f"{capacity:,.0f} MiB usable of {gpu['memory_gb']} GB"
    return pages.table(rows, list(rows.columns), table_id="fits-table", titles=titles)


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
                 gpu_table: str | Path | None = None, repeat_scoring: str = "median", eval_files=None) -> dict:
    """Write the figures and report.html; return what was drawn (figure name -> PNG path or left-out note).

    ``captions``: figure name -> its one-sentence caption (the rule passes rules/captions/figures/).
    ``gpu_table``: config/gpus.yaml, for the memory capacity of GPUs whose name does not give it.
    ``repeat_scoring``: how a configuration's repeats become one figure (analysis.REPEAT_SCORING).
    """
    # typed(): a table from an older ftbench gets the columns it lacks, as nulls
    steps = read_steps(step_files)
    peaks = gpu_tables.load_peaks(gpu_table) if gpu_table else None
    runs = analysis.prepare(typed(pd.read_parquet(metrics_path)), gpu_table=peaks)
    runs = analysis.add_step_figures(runs, steps)
    configs = analysis.configurations(runs, repeat_scoring)
    shared = analysis.common_parts(runs)
    evals = quality_target.read_evals(eval_files or [])
    drawn = {}
    for spec in figures.FIGURES:
        drawn[spec.name] = figures.draw(spec, runs, steps, configs, shared=shared)
        if spec.name == "accuracy_vs_cost":  # quality against cost from the evaluations (evals.parquet), beside it
            drawn[figures.QUALITY_VS_COST.name] = figures.draw(figures.QUALITY_VS_COST, runs, evals, shared=shared)
    # the scaling section and its figure only where the GPU runs used more than one GPU count
    scaling_points = scaling.scaling_table(runs, configs) if scaling.several_gpu_counts(runs) else None
    if scaling_points is not None:
        drawn[figures.SCALING_PER_GPU.name] = figures.draw(figures.SCALING_PER_GPU, scaling_points, shared=shared)
    written = figures.save(drawn, figures_dir)
    in_section = {name: written.pop(name) for name in [figures.SCALING_PER_GPU.name] if name in written}
    target_section = to_target(configs, runs)
    page_summary = summary(runs, configs, price_warnings(runs))
    page_summary["notes"] += target_notes(target_section)
    shown = with_display_columns(runs)
    config_rows = configuration_rows(configs, shown)
    # every configuration's predicted speed and cost on every GPU of the table (calibration.yaml and prices.yaml
    # read beside the GPU table)
    labels = dict(zip(runs["config_id"], runs["config_label"])) if "config_label" in runs else None
    predicted, predicted_figure = prediction_section.section(
        metrics_path, peaks or [], figures_dir, captions, labels, Path(gpu_table).parent if gpu_table else None)
    pages.render(
        "report.html.j2", html_path,
        title=title,
        headline=headline.section(configs, runs, peaks or [], recommend_settings or {}),
        summary=page_summary,
        recommendation=recommendation(configs, recommend_settings or {}),
        to_target=target_section,
        shared=shared,
        scoring=analysis.REPEAT_SCORING[repeat_scoring],
        configurations=pages.table(config_rows, shown_columns(config_rows, CONFIG_TABLE_COLUMNS, {"configuration", "method", "runs", "ok"}),
                                   table_id="configurations-table", titles=config_titles(repeat_scoring)),
        runs=runs_table(shown, shown_columns(shown, TABLE_COLUMNS, ALWAYS_SHOWN)),
        fits=what_fits(runs, peaks or []),
        prediction=predicted,
        error_band=memory_estimate.ERROR_BAND,
        scaling=scaling_section(scaling_points, runs, figure_blocks(in_section, captions or {})[0]) if scaling_points is not None else None,
        figures=figure_blocks(written, captions or {}, throughput_notes(runs)),
        environment=environment(runs),
        data=summary_text.dropped_rows(runs),
        conventions=CONVENTIONS,
    )
    return {**written, **in_section, **predicted_figure}
