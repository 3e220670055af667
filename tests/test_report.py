"""Figures, the HTML report, Snakemake's report and compare, from fixture result tables.

The fixtures are metrics.parquet files built here with the documented columns (ftbench.report.columns.COLUMNS,
so they follow any column added there) and costs filled in by ftbench.report.cost exactly as collect does:
normal runs, repeats, an all-OOM experiment, a single run, several GPU types (one missing from the
price table), language-model runs and a GPU-scaling series. test_cost.py, test_analysis.py and
test_browser.py build on them. The price table, GPU table and captions are the repository's, passed in
as the rules pass them.
"""

from __future__ import annotations

import copy
import hashlib
import html
import json
import math
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import yaml

from conftest import ROOT
from ftbench.report import analysis, collect, compare, cost, figures, quality_target, report_page, uncertainty
from ftbench.measure import gpu_table
from ftbench.report.columns import COLUMNS
from ftbench.errors import FtbenchError

PRICES_TABLE = ROOT / "config" / "prices.yaml"
GPU_TABLE = ROOT / "config" / "gpus.yaml"
CAPTIONS = {path.stem: " ".join(path.read_text(encoding="utf-8").split())
            for path in (ROOT / "rules" / "captions" / "figures").glob("*.rst")}

H100 = "NVIDIA H100 80GB HBM3"
A100 = "NVIDIA A100-SXM4-40GB"
UNPRICED = "NVIDIA B200"
CPU_NAME = "Intel(R) Xeon(R) Processor"


# ---------------------------------------------------------------------------------------------------
# Fixture tables


def make_run(index: int, method: str = "lora", status: str = "ok", device_name: str = H100, repeat: int = 0,
             tokens_per_s: float | None = 20000.0, accuracy: float | None = 0.85, memory_mb: float | None = 12000.0,
             task: str = "classification", parallel: str = "single", num_gpus: int = 1, reason: str | None = None,
             host: str = "node1", lora_rank: int | None = 8, **extra) -> dict:
    """One row with every documented column (null unless set), consistent with itself."""
    row = dict.fromkeys(COLUMNS)
    cpu = device_name == CPU_NAME
    rank = None if method == "full" else lora_rank
    batch, seq = extra.get("batch_size", 16), extra.get("seq_len", 512)
    name_parts = ["m", "d", method] + ([f"r{rank}"] if rank else []) + ["bf16", f"b{batch}", f"s{seq}"]
    if parallel != "single":
        name_parts.append(f"{parallel}{num_gpus}")
    config_name = "-".join(name_parts)
    if extra.pop("repeats", 1) > 1:
        name_parts.append(f"rep{repeat}")
    world = num_gpus if parallel in ("dp", "ddp") and not cpu else 1
    # as matrix.make_spec names it: the readable name and a hash of the settings (the device is no setting)
    settings = json.dumps(config_name)
    row.update(
        run_id="-".join(name_parts) + f"-{index:08x}",
        config_id=f"{config_name}-{hashlib.sha256(settings.encode()).hexdigest()[:8]}", status=status, status_reason=reason, model="m", task=task,
        dataset="d", method=method, precision="bf16", batch_size=batch, seq_len=seq, lora_rank=rank,
        lora_alpha=None if rank is None else 2.0 * rank, learning_rate=1e-4, optimizer="adamw", grad_accum_steps=1,
        gradient_checkpointing=False, compile=False, num_gpus=num_gpus, parallel=parallel, repeat=repeat, seed=repeat,
        device=("cpu" if cpu else "cuda") if status != "unsupported" else None,
        device_name=device_name if status != "unsupported" else None, world_size=world, host=host,
        gpu_names=None if cpu else device_name, torch_version="2.13.0", transformers_version="5.17.0",
        peft_version="0.21.2", git_commit="abc1234", trainable_params=1_000_000 if method != "full" else 100_000_000,
        total_params=100_000_000,
    )
    if status in ("ok", "timeout", "diverged") and tokens_per_s:
        row.update(
            tokens_per_s=tokens_per_s, tokens_per_s_per_device=tokens_per_s / world,
            samples_per_s=tokens_per_s / 400.0, measured_steps=20, measured_time_s=20 * 16 * 400 / tokens_per_s,
            measured_tokens=20 * 16 * 400, step_time_median_s=16 * 400 / tokens_per_s * world,
            step_time_p90_s=1.1 * 16 * 400 / tokens_per_s * world, total_steps=25, warmup_steps=5,
            wall_time_s=60.0, final_train_loss=0.4,
        )
    if memory_mb is not None and status != "unsupported":
        if cpu:
            row.update(peak_rss_mb=memory_mb, peak_memory_mb=memory_mb)
        else:
            row.update(peak_memory_reserved_mb=memory_mb, peak_memory_allocated_mb=0.9 * memory_mb, peak_memory_mb=memory_mb,
                       memory_estimate_mb=0.8 * memory_mb, memory_estimate_ratio=0.8 / 0.9 if status == "ok" else None)
    if status == "ok" and accuracy is not None:
        # 10,000 eval rows: +-0.7 points, so the fixtures' accuracies 2 points apart are told apart
        row.update(eval_samples=10000)
        if task == "classification":
            row.update(eval_accuracy=accuracy, eval_loss=0.4)
        else:
            row.update(eval_token_accuracy=accuracy, eval_loss=2.0, eval_perplexity=math.exp(2.0))
    if not cpu and status == "ok" and row["tokens_per_s"]:
        row.update(energy_j=300.0 * world * row["measured_time_s"], gpu_power_mean_w=300.0 * world)
        row["energy_j_per_token"] = row["energy_j"] / row["measured_tokens"]
    row.update({k: v for k, v in extra.items() if k in COLUMNS})
    return row


def make_steps(row: dict, count: int = 25, seed: int = 0) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    median = row["step_time_median_s"] or 0.5
    return pd.DataFrame({
        "step": np.arange(count),
        "measured": np.arange(count) >= 5,
        "step_time_s": median * (1 + 0.05 * rng.standard_normal(count)).clip(0.5),
        "samples": 16,
        "tokens": 6400,
        "padded_tokens": 8192,
        "loss": 0.7 * np.exp(-np.arange(count) / 10) + 0.3 + 0.01 * rng.standard_normal(count),
        "lr": 1e-4,
    })


def _normal(start=0, device=H100, host="node1", speed=1.0):
    return [
        make_run(start + 0, "full", tokens_per_s=15000 * speed, accuracy=0.90, memory_mb=60000, device_name=device, host=host),
        make_run(start + 1, "lora", tokens_per_s=22000 * speed, accuracy=0.86, memory_mb=20000, device_name=device, host=host),
        make_run(start + 2, "lora", lora_rank=16, tokens_per_s=21000 * speed, accuracy=0.88, memory_mb=21000, device_name=device, host=host),
        make_run(start + 3, "qlora", tokens_per_s=12000 * speed, accuracy=0.84, memory_mb=9000, device_name=device, host=host),
    ]


def fixture_rows(kind: str, **extra) -> list[dict]:
    if kind == "normal":
        return _normal()
    if kind == "repeats":
        rows = []
        for repeat, (stable, noisy) in enumerate([(20000, 15000), (20100, 18500), (19900, 13000)]):
            rows.append(make_run(10 + repeat, "lora", repeat=repeat, repeats=3, tokens_per_s=stable, accuracy=0.85 + 0.01 * repeat, **extra))
            rows.append(make_run(20 + repeat, "full", repeat=repeat, repeats=3, tokens_per_s=noisy, accuracy=0.9, memory_mb=60000, **extra))
        return rows
    if kind == "all_oom":
        return [make_run(30 + i, method, status="oom", tokens_per_s=None, accuracy=None, memory_mb=None,
                         reason="CUDA out of memory. Tried to allocate 2.00 GiB") for i, method in enumerate(["full", "lora", "qlora"])]
    if kind == "single":
        return [make_run(40, "lora")]
    if kind == "multi_gpu":
        return _normal(50, H100, "h100-node") + _normal(60, A100, "a100-node", speed=0.45) + [
            make_run(70, "lora", device_name=UNPRICED, host="b200-node", tokens_per_s=45000)]
    if kind == "lm":
        return [make_run(80 + i, method, task="causal_lm", accuracy=acc, tokens_per_s=speed)
                for i, (method, acc, speed) in enumerate([("full", 0.42, 9000), ("lora", 0.40, 14000), ("qlora", 0.39, 8000)])]
    if kind == "scaling":
        return [
            make_run(90, "full", tokens_per_s=15000, memory_mb=60000, **extra),
            make_run(91, "full", parallel="dp", num_gpus=2, tokens_per_s=21000, memory_mb=62000, **extra),
            make_run(92, "full", parallel="ddp", num_gpus=2, tokens_per_s=28500, memory_mb=60000, **extra),
            make_run(93, "full", parallel="ddp", num_gpus=4, tokens_per_s=55000, memory_mb=60000, **extra),
        ]
    if kind == "all_timeout":
        # stopped by the time limit after 21 of 50 measured steps: their throughput is real, no eval ran
        return [make_run(130 + i, method, status="timeout", tokens_per_s=speed, reason="time limit reached at step 31 of 60",
                         measured_steps=21, warmup_steps=10, total_steps=60, last_step=31)
                for i, (method, speed) in enumerate([("full", 15000), ("lora", 22000), ("qlora", 12000)])]
    if kind == "tie":
        # lora r8 and r16: three repeats each whose intervals overlap (a tie), on 1,000 eval rows 1 point
        # apart (another tie); full: slower and more accurate beyond noise; qlora: one run, unstable
        rows = []
        for repeat, (r8, r16, full) in enumerate([(20000, 20500, 15000), (21500, 19500, 15100), (19000, 21000, 14900)]):
            rows += [make_run(140 + repeat, "lora", repeat=repeat, repeats=3, tokens_per_s=r8, accuracy=0.85, eval_samples=1000),
                     make_run(150 + repeat, "lora", lora_rank=16, repeat=repeat, repeats=3, tokens_per_s=r16, accuracy=0.86,
                              eval_samples=1000),
                     make_run(160 + repeat, "full", repeat=repeat, repeats=3, tokens_per_s=full, accuracy=0.93, memory_mb=60000,
                              eval_samples=1000)]
        return rows + [make_run(170, "qlora", tokens_per_s=12000, accuracy=0.84, memory_mb=9000, eval_samples=1000)]
    if kind == "cpu":
        return [make_run(100 + i, method, device_name=CPU_NAME, tokens_per_s=speed, accuracy=acc, memory_mb=mem, host="laptop")
                for i, (method, speed, acc, mem) in enumerate([("full", 1350, 0.76, 1700), ("lora", 1150, 0.72, 2050), ("qlora", 1090, 0.70, 2190)])]
    if kind == "mixed":
        # distinct configurations: the repeats at batch 32, the scaling series at sequence length 1024
        rows = _normal() + fixture_rows("repeats", batch_size=32) + fixture_rows("scaling", seq_len=1024) + [
            make_run(110, "full", status="oom", tokens_per_s=None, accuracy=None, memory_mb=80500, lora_rank=None,
                     reason="CUDA out of memory. Tried to allocate 4.00 GiB", batch_size=64),
            make_run(111, "lora", status="diverged", accuracy=None, lora_rank=64, reason="loss became nan at step 7"),
            make_run(112, "qlora", status="unsupported", tokens_per_s=None, accuracy=None, lora_rank=32,
                     reason="QLoRA needs bitsandbytes with CUDA; not available"),
        ]
        rows += [make_run(120 + i, m, device_name=A100, host="a100-node", tokens_per_s=s, accuracy=a, memory_mb=mem)
                 for i, (m, s, a, mem) in enumerate([("lora", 9800, 0.86, 20000), ("qlora", 5400, 0.84, 9000)])]
        return rows
    if kind == "cpu_default":
        return _default_like()
    raise ValueError(kind)


# Shaped like the default experiment on a 2-core CPU: one model, full fine-tuning, LoRA r8 and r16, QLoRA r8; 62 steps of
# 32 reviews (about 25 tokens each); 1,000 eval rows, a base model at 0.523, the majority class at 0.575.
DEFAULT_LIKE = [("full", 8, 1350, 0.764, 1700), ("lora", 8, 1150, 0.728, 2050), ("lora", 16, 1120, 0.757, 2100),
                ("qlora", 8, 1090, 0.718, 2190)]
DEFAULT_TARGET = {"metric": "eval_accuracy", "value": 0.70}
DEFAULT_RECOMMEND = {"min_accuracy": 0.70, "max_memory_mb": 4000}


def _default_like() -> list[dict]:
    return [make_run(180 + i, method, lora_rank=rank, device_name=CPU_NAME, tokens_per_s=speed, accuracy=accuracy,
                     memory_mb=rss, host="laptop", eval_samples=1000, base_eval_accuracy=0.523, eval_majority_class_rate=0.575,
                     memory_estimate_mb=0.6 * rss, memory_estimate_ratio=0.6, measured_steps=59, warmup_steps=3, total_steps=62)
            for i, (method, rank, speed, accuracy, rss) in enumerate(DEFAULT_LIKE)]


def default_like_evals(runs: pd.DataFrame) -> dict[str, pd.DataFrame]:
    """Each default-like run's evaluations: before training and every 15 steps on 256 rows, the final on 1,000, rising
    from the base 0.523 to the run's final accuracy (the full run fastest)."""
    evals = {}
    for index, row in runs.reset_index(drop=True).iterrows():
        final, steps = float(row["eval_accuracy"]), [0, 15, 30, 45, 62]
        rate = 12.0 if row["method"] == "full" else 20.0 + 4 * index
        values = [final - (final - 0.523) * math.exp(-step / rate) for step in steps[:-1]] + [final]
        counts = [256] * 4 + [1000]
        bounds = [uncertainty.wilson(v, n) for v, n in zip(values, counts)]
        evals[row["run_id"]] = pd.DataFrame({
            "evaluation": range(5), "step": steps, "tokens": [step * 800 for step in steps], "samples": [step * 32 for step in steps],
            "train_s": [step * 800 / float(row["tokens_per_s"]) for step in steps], "eval_s": 2.0,
            "scope": ["subset"] * 4 + ["full"], "eval_samples": counts, "metric": "eval_accuracy", "value": values,
            "low": [b[0] for b in bounds], "high": [b[1] for b in bounds]})
    return evals


def prices(settings: dict | None = None) -> cost.Prices:
    """The repository's price table with an experiment's ``prices`` settings (which may name another table)."""
    return cost.resolve({"table": str(PRICES_TABLE), **(settings or {})})


def fixture_runs(kind: str) -> tuple[pd.DataFrame, dict[str, pd.DataFrame]]:
    """(a run table as collect writes it, {run_id: steps}) for one fixture kind."""
    rows = fixture_rows(kind)
    frame = collect.typed(pd.DataFrame(rows, columns=list(COLUMNS)))
    frame, _ = cost.add_costs(frame, prices(), warn=False)
    frame = collect.typed(frame)
    steps = {row["run_id"]: make_steps(row, seed=i) for i, row in enumerate(rows)
             if row["status"] in ("ok", "diverged", "timeout") and row["tokens_per_s"]}
    if kind == "tie":  # the qlora run had 9 consecutive slow steps in its window, as a compiled GPU run did
        qlora = next(run_id for run_id in steps if "-qlora-" in run_id)
        steps[qlora].loc[8:16, "step_time_s"] *= 1.6
    if kind == "cpu_default":  # a shared CPU: every run's steps slow down a third of the way through its window
        for run_steps in steps.values():
            run_steps.loc[15:, "step_time_s"] *= 1.3
        evals = default_like_evals(frame)
        targets = [quality_target.run_to_target(evals[row["run_id"]], DEFAULT_TARGET, row) for row in frame.to_dict("records")]
        for column in quality_target.TARGET_COLUMNS:
            frame[column] = [target[column] for target in targets]
        frame = collect.typed(frame)
    return frame, steps


def write_fixture(folder: Path, runs: pd.DataFrame, steps: dict[str, pd.DataFrame]) -> tuple[Path, list[Path]]:
    folder.mkdir(parents=True, exist_ok=True)
    metrics = folder / "metrics.parquet"
    runs.to_parquet(metrics, index=False)
    files = []
    for run_id, frame in steps.items():
        path = folder / "runs" / run_id / "steps.parquet"
        path.parent.mkdir(parents=True, exist_ok=True)
        frame.to_parquet(path, index=False)
        files.append(path)
    return metrics, files


def build(tmp_path: Path, kind: str, **settings):
    runs, steps = fixture_runs(kind)
    metrics, files = write_fixture(tmp_path / kind, runs, steps)
    eval_files = []
    if kind == "cpu_default":
        for run_id, frame in default_like_evals(runs).items():
            eval_files.append(tmp_path / kind / "runs" / run_id / "evals.parquet")
            eval_files[-1].parent.mkdir(parents=True, exist_ok=True)
            frame.to_parquet(eval_files[-1], index=False)
    page = tmp_path / kind / "report.html"
    written = report_page.build_report(metrics, files, tmp_path / kind / "figures", page, recommend_settings=settings or None,
                                  captions=CAPTIONS, gpu_table=GPU_TABLE, eval_files=eval_files)
    return runs, written, page.read_text(encoding="utf-8")


def test_what_fits_puts_each_configurations_estimate_against_every_gpu_of_the_table():
    """yes / borderline / no with the estimate's 10% band, on each GPU's usable memory (its GiB less the CUDA
    context): 20,000 MiB fits an H100 and an L4 (24,064 MiB usable) but not a T4 (15,872); 23,000 MiB is borderline
    on the L4. One row per configuration (repeats share it); a configuration without an estimate has no row."""
    runs = pd.DataFrame({"config_id": ["small", "small", "edge", "none"], "memory_estimate_mb": [20000.0, 20000.0, 23000.0, None],
                         "memory_estimate_ratio": [1.0, 1.0, 0.95, None]})
    peaks = gpu_table.load_peaks(GPU_TABLE)
    table = report_page.what_fits(runs, peaks)
    names = [name for name, _ in table.columns]
    assert names[:3] == ["configuration", "estimate MiB per GPU", "measured / estimate"]
    assert names[3:] == [gpu["name"] for gpu in peaks if gpu.get("memory_gb")]
    rows = {cells[0].text: {name: cell.text for (name, _), cell in zip(table.columns, cells)} for _, cells in table.rows}
    assert list(rows) == ["small", "edge"]
    assert (rows["small"]["H100 SXM"], rows["small"]["L4"], rows["small"]["T4"]) == ("yes", "yes", "no")
    assert rows["edge"]["L4"] == "borderline" and rows["edge"]["H200"] == "yes"
    assert report_page.what_fits(runs.assign(memory_estimate_mb=None), peaks) is None


def test_the_report_has_a_what_fits_section(tmp_path):
    _, _, page = build(tmp_path, "mixed")
    section = page[page.index('<h2 id="fits">'):page.index("</table>", page.index('<h2 id="fits">'))]
    assert "python -m ftbench plan" in section and 'id="fits-table"' in section and "H100 SXM" in section
    assert "lora-r8-b16-s512 @ H100 80GB HBM3" in section  # the configurations' own labels


def images(page: str) -> list[str]:
    return re.findall(r'<img[^>]*src="data:image/png;base64,([A-Za-z0-9+/=]+)"', page)


def runs_table_rows(page: str) -> list[str]:
    table = re.search(r'<table class="sortable" id="runs">.*?</table>', page, flags=re.S).group(0)
    return re.findall(r"<tr class=\"status-[a-z]+\">(.*?)</tr>", table, flags=re.S)


# ---------------------------------------------------------------------------------------------------
# Figures: what each shows


def bar_lengths(ax) -> dict[str, float]:
    """{configuration label: bar length} of a horizontal bar chart."""
    labels = {round(tick): text.get_text() for tick, text in zip(ax.get_yticks(), ax.get_yticklabels())}
    return {labels[round(bar.get_y() + bar.get_height() / 2)]: bar.get_width() for bar in ax.patches}


def drawn(name: str, runs: pd.DataFrame, steps: pd.DataFrame | None = None):
    spec = next(spec for spec in figures.FIGURES if spec.name == name)
    steps = pd.DataFrame(columns=report_page.STEP_COLUMNS) if steps is None else steps
    runs = analysis.add_step_figures(runs, steps)
    return figures.draw(spec, runs, steps, analysis.configurations(runs))


def test_throughput_figure_shows_the_median_and_every_repeat_of_finished_runs():
    runs = analysis.prepare(fixture_runs("mixed")[0])
    ax = drawn("throughput", runs).axes.flat[0]
    finished = runs[runs["status"] == "ok"]
    assert bar_lengths(ax) == pytest.approx(finished.groupby("config_label")["tokens_per_s"].median().astype(float).to_dict())
    assert sum(len(dots.get_offsets()) for dots in ax.collections) == len(finished)  # a dot per repeat
    assert not any("r64" in label for label in bar_lengths(ax))  # the diverged run measured a step, but is left out


def test_memory_figure_shows_unfinished_configurations_estimates_and_capacities():
    runs = analysis.prepare(fixture_runs("mixed")[0], gpu_table=gpu_table.load_peaks(GPU_TABLE))
    ax = drawn("peak_memory", runs).axes.flat[0]
    lengths = bar_lengths(ax)
    assert lengths["full-b64-s512 @ H100 80GB HBM3 (oom)"] == 80500
    assert lengths["lora-r64-b16-s512 @ H100 80GB HBM3 (diverged)"] == 12000
    assert len(lengths) == runs.loc[runs["peak_memory_mb"].notna(), "config_key"].nunique()
    capacities = {line.get_xdata()[0] for line in ax.lines if line.get_linestyle() == "--"}
    assert capacities == {80 * 1024, 40 * 1024}
    estimates = ax.collections[-1].get_offsets()[:, 0]  # a diamond per configuration, in the bars' order
    assert len(estimates) == len(lengths) and np.allclose(estimates, [0.8 * length for length in lengths.values()])


def test_accuracy_vs_cost_names_the_configurations_on_the_pareto_front():
    runs = analysis.prepare(fixture_runs("normal")[0])
    ax = drawn("accuracy_vs_cost", runs).axes.flat[0]
    assert sorted(text.get_text() for text in ax.texts) == ["full", "lora-r16", "lora-r8"]  # qlora is dominated


def test_figures_get_a_panel_per_model():
    normal = fixture_runs("normal")[0]
    other = normal.assign(model="other", run_id=normal["run_id"].str.replace("m-d", "other-d"),
                          config_id=normal["config_id"].str.replace("m-d", "other-d"))
    runs = analysis.prepare(pd.concat([normal, other], ignore_index=True))
    grid = drawn("throughput", runs)
    assert [ax.get_title() for ax in grid.axes.flat] == ["model = m", "model = other"]
    assert [len(bar_lengths(ax)) for ax in grid.axes.flat] == [4, 4]


def test_models_each_on_their_own_dataset_get_a_panel_per_pair_not_an_empty_grid():
    """A mixed experiment (a text model on text, an image model on images, ...): one panel per (model,
    dataset) pair with runs, titled with both, and a panel whose runs have no memory estimate draws none."""
    normal = fixture_runs("normal")[0]
    parts = [normal.assign(model=model, dataset=dataset, run_id=normal["run_id"].str.replace("m-d", f"{model}-{dataset}"),
                           config_id=normal["config_id"].str.replace("m-d", f"{model}-{dataset}"))
             for model, dataset in (("m", "d"), ("vit", "images"), ("llava", "vqa"))]
    parts[2] = parts[2].assign(memory_estimate_mb=float("nan"))  # not modelled for this task
    runs = analysis.prepare(pd.concat(parts, ignore_index=True))
    for figure in ("throughput", "peak_memory"):
        grid = drawn(figure, runs)
        titles = [ax.get_title() for ax in grid.axes.flat]
        assert titles == ["m on d", "vit on images", "llava on vqa"], figure
        assert [len(bar_lengths(ax)) for ax in grid.axes.flat] == [4, 4, 4]


# ---------------------------------------------------------------------------------------------------
# The HTML report from fixtures


def test_report_normal_runs(tmp_path):
    runs, written, page = build(tmp_path, "normal", min_accuracy=0.87, max_memory_mb=30000)
    drawn = {name for name, result in written.items() if not isinstance(result, str)}
    assert drawn == {"peak_memory", "throughput", "accuracy_vs_memory", "cost", "accuracy_vs_cost", "step_time", "loss_curves"}
    assert "Scaling</b>: left out, every GPU run used the same number of GPUs" in page
    assert len(images(page)) == len(drawn)
    assert len(runs_table_rows(page)) == len(runs)
    assert "Cheapest meeting accuracy &ge; 0.87 and peak memory &le; 30000 MiB" in page
    assert 'id="recommend-per-method"' in page
    for name in drawn:
        assert f"{CAPTIONS[name]}</figcaption>" in html.unescape(page)
    assert not re.search(r'(src|href)="(https?:)?//', page)
    assert "<h2 id=\"environment\">" in page and "abc1234" in page


def test_report_with_repeats(tmp_path):
    runs, written, page = build(tmp_path, "repeats")
    assert len(runs_table_rows(page)) == 6
    assert "Unstable:" in page and "CV of tokens/s over 3 repeats" in page
    assert not isinstance(written["throughput"], str)


def test_report_all_oom(tmp_path):
    runs, written, page = build(tmp_path, "all_oom", min_accuracy=0.5)
    assert all(isinstance(result, str) for result in written.values()), written
    assert images(page) == []
    assert page.count("left out,") == len(figures.FIGURES) + 1  # and quality vs cost, drawn from the evaluations
    rows = runs_table_rows(page)
    assert len(rows) == 3 and all("oom" in row and "CUDA out of memory" in row for row in rows)
    assert "No run finished" in page and "No finished configuration to recommend" in page
    assert not list((tmp_path / "all_oom" / "figures").glob("*.png"))


def test_report_single_run(tmp_path):
    runs, written, page = build(tmp_path, "single")
    assert len(runs_table_rows(page)) == 1
    assert not isinstance(written["throughput"], str)
    assert isinstance(written["scaling"], str)
    assert "Set <code>recommend:" in page


def test_report_multiple_gpu_types(tmp_path):
    runs, written, page = build(tmp_path, "multi_gpu")
    assert len(runs_table_rows(page)) == len(runs)
    assert "No cost for some runs" in page and UNPRICED in page
    assert "H100 SXM at $2.99/device-hour" in page and "A100 40GB at $1.29/device-hour" in page
    assert not isinstance(written["cost"], str)


def test_report_language_model_runs(tmp_path):
    runs, written, page = build(tmp_path, "lm")
    assert not isinstance(written["accuracy_vs_cost"], str)
    assert "eval_token_accuracy" in page and "eval_perplexity" in page
    assert "eval_accuracy</th>" not in page  # a column with no data is not shown


def test_report_scaling(tmp_path):
    runs, written, page = build(tmp_path, "scaling")
    assert not isinstance(written["scaling"], str)


def test_report_cpu_runs_have_costs(tmp_path):
    runs, written, page = build(tmp_path, "cpu")
    assert runs["cost_per_1m_tokens"].notna().all()
    assert not isinstance(written["cost"], str)
    assert "per 1M tokens" in page


def test_report_mixed_statuses_are_shown_with_reasons(tmp_path):
    runs, written, page = build(tmp_path, "mixed")
    rows = runs_table_rows(page)
    assert len(rows) == len(runs)
    for status, reason in [("oom", "Tried to allocate 4.00 GiB"), ("diverged", "loss became nan"), ("unsupported", "bitsandbytes")]:
        assert any(f">{status}<" in row and reason in row for row in rows), status
    # every figure, and the scaling section's (the mixed runs hold a series on 1, 2 and 4 GPUs)
    assert sum(not isinstance(r, str) for r in written.values()) == len(figures.FIGURES) + 1


def test_report_mixed_statuses_say_which_runs_the_throughput_figures_leave_out(tmp_path):
    runs, written, page = build(tmp_path, "mixed")
    caption = re.search(r'id="figure-throughput".*?</figcaption>', page, flags=re.S).group(0)
    assert "Not shown: 1 diverged, 1 oom, 1 unsupported run(s)" in caption


def test_report_only_timed_out_runs(tmp_path):
    """Issue 20 item 5: runs stopped by their time limit after measuring steps. Their throughput and cost
    are drawn (marked timeout), the left-out figures give the true reason (no finished run), never missing
    prices or missing measured steps."""
    runs, written, page = build(tmp_path, "all_timeout")
    assert {name for name, result in written.items() if not isinstance(result, str)} == {
        "peak_memory", "throughput", "cost", "step_time", "loss_curves"}
    for name in ("accuracy_vs_memory", "accuracy_vs_cost"):
        assert written[name] == "no run finished, and only a finished run's quality is compared (3 timeout)"
    for note in (result for result in written.values() if isinstance(result, str)):
        assert "price" not in note and "measured steps" not in note, note
    assert "No run finished; 3 configuration(s) timed out after measuring steps" in page
    assert "Fastest: <b>lora-r8 (timed out)</b> at 22,000 tokens/s" in page
    assert "No cost for some runs" not in page  # the prices were there
    rows = runs_table_rows(page)
    assert all(">timeout<" in row and ">21 measured + 10 warmup of 60 planned<" in row for row in rows)
    timed_out = analysis.add_step_figures(analysis.prepare(runs), pd.DataFrame(columns=report_page.STEP_COLUMNS))
    ax = drawn("throughput", timed_out).axes.flat[0]
    assert bar_lengths(ax) == {"full (timeout)": 15000, "lora-r8 (timeout)": 22000, "qlora-r8 (timeout)": 12000}
    assert [text.get_text() for text in ax.figure.legends[0].texts][-1] == "timed out (its measured steps)"


def test_report_calls_overlapping_configurations_a_tie_and_ranks_separated_ones(tmp_path):
    """lora r8 and r16 overlap on throughput, cost and accuracy: a tie, with the repeats that would
    separate them; full is more accurate beyond noise: ranked; the qlora run is unstable."""
    runs, written, page = build(tmp_path, "tie", min_accuracy=0.8)
    facts = {re.match(r"<li>([^:]+):", item).group(1): item for item in re.findall(r"<li>.*?</li>", page, flags=re.S)
             if re.match(r"<li>(Fastest|Cheapest|Most accurate)", item)}
    for lead in ("Fastest", "Cheapest"):
        assert "<b>tie, within noise</b>" in facts[lead] and "<b>lora-r16</b>" in facts[lead] and "<b>lora-r8</b>" in facts[lead]
        assert "full" not in facts[lead]  # beyond noise: not part of the tie
        assert re.search(r"about \d+ repeats each would separate lora-r16 and lora-r8", facts[lead])
    assert facts["Most accurate"].startswith("<li>Most accurate: <b>full</b> at 0.930 accuracy (95% interval 0.912")
    assert "Cheapest meeting accuracy &ge; 0.8: <b>lora-r16</b>" in page
    assert "Within noise of it (their 95% intervals of $ per 1M tokens overlap): lora-r8. That is a tie" in page
    qlora = next(row for row in runs_table_rows(page) if "-qlora-" in row)
    assert ">yes<" in qlora and "below the median-based figure (a stretch of slow steps)" in qlora
    assert "Unstable run m-d-qlora" in page


def test_report_on_synthetic_data_shows_no_quality(tmp_path):
    """Random tokens score nothing: no accuracy column, no 'most accurate', no accuracy figure."""
    runs, steps = fixture_runs("normal")
    runs = runs.assign(data_kind="synthetic", eval_accuracy=0.0)
    metrics, files = write_fixture(tmp_path, runs, steps)
    written = report_page.build_report(metrics, files, tmp_path / "figures", tmp_path / "report.html", captions=CAPTIONS)
    page = (tmp_path / "report.html").read_text(encoding="utf-8")
    assert "Most accurate" not in page and "at 0.000" not in page and "eval_accuracy</th>" not in page
    assert written["accuracy_vs_cost"] == written["accuracy_vs_memory"] == (
        "every finished run trained on synthetic (random-token) data, whose accuracy measures nothing")
    assert "4 run(s) trained on synthetic (random-token) data: no quality figure is shown" in page


def test_report_names_quality_per_task_and_tabulates_both_memory_peaks(tmp_path):
    classifier = fixture_runs("single")[0].assign(model="clf", config_id=lambda t: t["config_id"].str.replace("m-d", "clf-d"),
                                                  run_id=lambda t: t["run_id"].str.replace("m-d", "clf-d"))
    runs = pd.concat([fixture_runs("lm")[0], classifier], ignore_index=True)
    metrics, files = write_fixture(tmp_path, runs, {})
    report_page.build_report(metrics, files, tmp_path / "figures", tmp_path / "report.html")
    page = (tmp_path / "report.html").read_text(encoding="utf-8")
    configurations = re.search(r'id="configurations-table">.*?</thead>', page, flags=re.S).group(0)
    assert ">accuracy</th>" in configurations and ">token_accuracy</th>" in configurations
    assert "Most accurate (accuracy): <b>" in page and "Most accurate (token accuracy): <b>" in page
    headers = re.findall(r"<th[^>]*>([^<]+)</th>", re.search(r'id="runs">.*?</thead>', page, flags=re.S).group(0))
    assert {"peak_memory_allocated_mb", "peak_memory_reserved_mb", "estimate_over_allocated"} <= set(headers)
    assert "peak_memory_mb" not in headers and "estimate_over_rss" not in headers  # GPU runs only


def test_report_shows_each_score_beside_the_base_model_s_and_the_majority_class_rate(tmp_path):
    """Whether fine-tuning helped: eval_before_training's base figure and the majority-class rate beside each score."""
    runs, steps = fixture_runs("normal")
    runs = runs.assign(base_eval_accuracy=0.51, eval_majority_class_rate=0.58)
    metrics, files = write_fixture(tmp_path, runs, steps)
    report_page.build_report(metrics, files, tmp_path / "figures", tmp_path / "report.html")
    page = (tmp_path / "report.html").read_text(encoding="utf-8")
    cells = table_cells(page, "runs")
    for _, run in runs.iterrows():
        assert cells[run["run_id"]]["quality_vs_base"] == f"{run['eval_accuracy']:.3f} (base 0.510, majority 0.580)"
    configurations = table_cells(page, "configurations-table")
    assert sorted(row["quality_vs_base"] for row in configurations.values()) == [
        f"{accuracy:.3f} (base 0.510, majority 0.580)" for accuracy in sorted(runs["eval_accuracy"])]
    assert re.search(r"Most accurate: <b>full</b> at 0\.900 accuracy \(95% interval [^)]+\) on 10,000 eval rows; "
                     r"base 0\.510, majority 0\.580\.", page)
    # Without a base evaluation the majority-class rate is still there to read the score against.
    runs = runs.assign(base_eval_accuracy=None)
    metrics, files = write_fixture(tmp_path / "no-base", runs, steps)
    report_page.build_report(metrics, files, tmp_path / "no-base" / "figures", tmp_path / "no-base" / "report.html")
    cells = table_cells((tmp_path / "no-base" / "report.html").read_text(encoding="utf-8"), "runs")
    assert {row["quality_vs_base"] for row in cells.values()} == {f"{a:.3f} (majority 0.580)" for a in runs["eval_accuracy"]}


def test_report_shows_a_language_model_s_loss_and_perplexity_beside_its_base(tmp_path):
    runs, steps = fixture_runs("lm")
    runs = runs.assign(base_eval_token_accuracy=0.30, base_eval_loss=3.0, base_eval_perplexity=math.exp(3.0))
    metrics, files = write_fixture(tmp_path, runs, steps)
    report_page.build_report(metrics, files, tmp_path / "figures", tmp_path / "report.html")
    page = (tmp_path / "report.html").read_text(encoding="utf-8")
    cells = table_cells(page, "runs")
    for _, run in runs.iterrows():
        shown = cells[run["run_id"]]
        assert shown["quality_vs_base"] == f"{run['eval_token_accuracy']:.3f} (base 0.300)"
        assert (shown["eval_loss"], shown["base_eval_loss"]) == ("2", "3")
        assert (shown["eval_perplexity"], shown["base_eval_perplexity"]) == ("7.389", "20.09")
    configuration = next(iter(table_cells(page, "configurations-table").values()))
    assert (configuration["eval_perplexity"], configuration["base_eval_perplexity"]) == ("7.389", "20.09")


def test_report_cli(tmp_path):
    runs, steps = fixture_runs("normal")
    metrics, files = write_fixture(tmp_path, runs, steps)
    process = subprocess.run(
        [sys.executable, "-m", "ftbench", "report", "--metrics", str(metrics), "--steps", *map(str, files),
         "--figures", str(tmp_path / "figures"), "--html", str(tmp_path / "report.html"),
         "--recommend", json.dumps({"min_accuracy": 0.85}), "--repeat-scoring", "trimmed_mean"],
        capture_output=True, text=True, check=False,
    )
    assert process.returncode == 0, process.stderr
    assert "figure scaling: every GPU run used the same number of GPUs" in process.stdout
    page = (tmp_path / "report.html").read_text()
    assert "Cheapest meeting accuracy &ge; 0.85" in page
    assert "the mean of repeats without the fastest and the slowest" in page


# ---------------------------------------------------------------------------------------------------
# compare


def test_compare_across_gpus_and_nodes(tmp_path):
    a_rows = _normal(0, H100, "h100-a") + [make_run(9, "lora", lora_rank=32, tokens_per_s=20000, host="h100-a")]
    b_rows = _normal(0, H100, "h100-b", speed=1.08)   # the same H100 configurations on another node, 8% faster
    c_rows = _normal(0, A100, "a100-a", speed=0.5)    # and on an A100
    paths = []
    for name, rows in (("siteA", a_rows), ("siteB", b_rows), ("siteC", c_rows)):
        frame = collect.typed(pd.DataFrame(rows, columns=list(COLUMNS)))
        frame, _ = cost.add_costs(frame, prices({"pricing": "spot"}), warn=False)  # each set priced its own way
        path = tmp_path / name / "results" / "metrics.parquet"
        path.parent.mkdir(parents=True)
        collect.typed(frame).to_parquet(path)
        paths.append(path)
    result = compare.compare([(None, p) for p in paths], tmp_path / "out", prices=prices(), captions=CAPTIONS, gpu_table=GPU_TABLE)
    assert result["sets"] == 3 and result["runs"] == 13
    merged = pd.read_parquet(tmp_path / "out" / "compare.parquet")
    assert list(merged.columns) == [compare.SET_COLUMN, *COLUMNS]
    assert set(merged[compare.SET_COLUMN]) == {"siteA", "siteB", "siteC"}
    # re-priced with one table (on-demand), not each set's spot prices
    assert (merged.loc[merged["gpu_model"] == "H100 SXM", "price_per_device_hour"] == 2.99).all()

    devices = result["across_devices"]
    lora = devices[devices["configuration"] == "lora-r8"].set_index("device")  # named by what tells it apart
    assert lora.loc["A100-SXM4-40GB", "throughput_ratio"] == pytest.approx(11000 / np.median([22000, 22000 * 1.08]))
    assert lora.loc["H100 80GB HBM3", "throughput_ratio"] == pytest.approx(1.0)
    assert lora.loc["A100-SXM4-40GB", "cost_ratio"] == pytest.approx(
        (1.29 / 11000) / (2.99 / np.median([22000, 22000 * 1.08])))

    variance = result["node_variance"]
    assert len(variance) == 4  # the four H100 configurations ran on two hosts; lora r32 only on one
    assert variance["flagged"].all()  # 8% apart -> CV 5.4% > 5%
    assert variance["cv"].iloc[0] == pytest.approx(np.std([1.0, 1.08], ddof=1) / np.mean([1.0, 1.08]))
    page = (tmp_path / "out" / "compare.html").read_text()
    assert "Node-to-node variation above 5%" in page
    assert len(runs_table_rows(page)) == 13
    assert not isinstance(result["figures"]["throughput_ratio"], str)


def test_compare_within_threshold_is_not_flagged_and_old_sets_are_read(tmp_path):
    a = collect.typed(pd.DataFrame(_normal(0, H100, "n1"), columns=list(COLUMNS)))
    b = collect.typed(pd.DataFrame(_normal(0, H100, "n2", speed=1.02), columns=list(COLUMNS)))
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    a.to_parquet(tmp_path / "a" / "metrics.parquet")
    b.drop(columns=list(cost.COST_COLUMNS) + ["memory_estimate_mb"]).to_parquet(tmp_path / "b" / "metrics.parquet")
    process = subprocess.run(
        [sys.executable, "-m", "ftbench", "compare", "--out", str(tmp_path / "out"),
         f"first={tmp_path / 'a' / 'metrics.parquet'}", f"second={tmp_path / 'b' / 'metrics.parquet'}", "--pricing", "spot"],
        capture_output=True, text=True, check=False, cwd=ROOT,  # the default tables are the repository's
    )
    assert process.returncode == 0, process.stderr
    assert f"lacks {len(cost.COST_COLUMNS) + 1} column(s)" in process.stderr
    merged = pd.read_parquet(tmp_path / "out" / "compare.parquet")
    assert set(merged[compare.SET_COLUMN]) == {"first", "second"}
    assert merged["cost_per_1m_tokens"].notna().all()  # re-priced, so the old set has costs too
    page = (tmp_path / "out" / "compare.html").read_text()
    assert "Node-to-node variation above" not in page
    assert "every configuration ran on one device model only" in page


def test_compare_outside_the_repository_names_the_option_to_pass(tmp_path):
    runs, _ = fixture_runs("single")
    runs.to_parquet(tmp_path / "metrics.parquet")
    command = [sys.executable, "-m", "ftbench", "compare", "--out", str(tmp_path / "out"), str(tmp_path / "metrics.parquet")]
    process = subprocess.run(command, capture_output=True, text=True, check=False, cwd=tmp_path)
    assert process.returncode == 1
    assert process.stderr == ("ftbench: compare: --prices-table config/prices.yaml not found "
                              "(run from the repository root or pass --prices-table PATH)\n")
    process = subprocess.run([*command, "--prices-table", str(PRICES_TABLE), "--captions-dir", str(ROOT / "rules" / "captions" / "figures"),
                              "--gpu-peaks", str(GPU_TABLE)], capture_output=True, text=True, check=False, cwd=tmp_path)
    assert process.returncode == 0, process.stderr


def test_compare_rejects_what_is_not_a_result_set(tmp_path):
    with pytest.raises(FtbenchError, match="not found"):
        compare.merge([(None, tmp_path / "missing.parquet")])
    pd.DataFrame({"x": [1]}).to_parquet(tmp_path / "other.parquet")
    with pytest.raises(FtbenchError, match="not an ftbench metrics table"):
        compare.merge([(None, tmp_path / "other.parquet")])


# ---------------------------------------------------------------------------------------------------
# The workflow: a price change re-runs collect and report only; Snakemake's own report


@pytest.fixture(scope="module")
def priced_workflow(snakemake_run, tmp_path_factory):
    """A copy of the real tiny run whose experiment uses a price table of its own (copied from
    config/prices.yaml), brought up to date (collect and report only)."""
    from conftest import copy_workflow, job_counts, snakemake_failure, train_run_ids, write_config

    source, config, _ = snakemake_run
    workdir = copy_workflow(source, tmp_path_factory.mktemp("priced") / "workflow")
    table = workdir / "prices.yaml"
    table.write_text(PRICES_TABLE.read_text(encoding="utf-8"), encoding="utf-8")
    config = copy.deepcopy(config)
    config["prices"] = {"table": "prices.yaml"}
    config["recommend"] = {"min_accuracy": 0.3}
    write_config(workdir, config)
    from conftest import run_snakemake

    dry = run_snakemake(workdir, "-n")
    assert dry.returncode == 0, snakemake_failure(dry)
    assert job_counts(dry) == {"collect": 1, "report": 1, "all": 1} and not train_run_ids(dry)
    process = run_snakemake(workdir)
    assert process.returncode == 0, snakemake_failure(process)
    return workdir, config


@pytest.mark.slow
def test_price_change_reruns_collect_and_report_never_training(priced_workflow):
    from conftest import job_counts, run_snakemake, snakemake_failure, train_run_ids, write_config

    workdir, config = priced_workflow
    assert job_counts(run_snakemake(workdir, "-n")) == {}
    before = pd.read_parquet(workdir / "results" / "metrics.parquet")
    assert (before["gpu_model"] == "cpu").all() and before["cost_per_1m_tokens"].notna().all()
    runs_before = {p: p.stat().st_mtime_ns for p in (workdir / "results" / "runs").glob("*/metrics.json")}

    # 1. edit a price in the table
    table = workdir / "prices.yaml"
    text = table.read_text(encoding="utf-8")
    old = yaml.safe_load(text)["providers"]["gpu_cloud"]["on_demand"]["cpu"]
    table.write_text(text.replace(f"      cpu: {old:.2f}", "      cpu: 1.00", 1), encoding="utf-8")
    dry = run_snakemake(workdir, "-n")
    assert dry.returncode == 0, snakemake_failure(dry)
    assert job_counts(dry) == {"collect": 1, "report": 1, "all": 1}
    assert not train_run_ids(dry)
    process = run_snakemake(workdir)
    assert process.returncode == 0, snakemake_failure(process)
    after = pd.read_parquet(workdir / "results" / "metrics.parquet")
    ratio = (after["cost_per_1m_tokens"] / before["cost_per_1m_tokens"]).astype(float)
    assert np.allclose(ratio, 1.00 / old)
    assert {p: p.stat().st_mtime_ns for p in runs_before} == runs_before  # no run was trained again

    # 2. choose spot pricing in the experiment config
    config = copy.deepcopy(config)
    config["prices"]["pricing"] = "spot"
    write_config(workdir, config)
    dry = run_snakemake(workdir, "-n")
    assert job_counts(dry) == {"collect": 1, "report": 1, "all": 1} and not train_run_ids(dry)


@pytest.mark.slow
def test_bad_provider_stops_the_dry_run_with_the_key(priced_workflow, tmp_path):
    from conftest import run_snakemake, write_config

    workdir, config = priced_workflow
    config = copy.deepcopy(config)
    config["prices"]["provider"] = "acme"
    write_config(tmp_path, config)
    process = run_snakemake(workdir, "-n", configfile=tmp_path / "config.yaml")
    assert process.returncode != 0
    assert "ftbench: config key prices.provider: 'acme' is not in price table" in process.stderr


@pytest.mark.slow
def test_snakemake_report_has_the_figures(priced_workflow):
    from conftest import run_snakemake, snakemake_failure

    workdir, _ = priced_workflow
    process = run_snakemake(workdir, "--report", "snakemake-report.html")
    assert process.returncode == 0, snakemake_failure(process)
    out = workdir / "snakemake-report.html"
    assert out.is_file() and out.stat().st_size > 100_000
    drawn = sorted(p.stem for p in (workdir / "results" / "figures").glob("*.png"))
    assert len(drawn) >= 6
    log = process.stdout + process.stderr
    for name in drawn:
        assert f"Adding {name}.png" in log, name
    assert "Adding report.html" in log
    text = out.read_text(encoding="utf-8")
    for name in drawn:  # each figure's own caption file, rendered through rules/captions/figure.rst
        assert " ".join(CAPTIONS[name].split()[:6]) in text, name


# ---------------------------------------------------------------------------------------------------
# One run from its result files (metrics.json and steps.parquet, as a training job writes them) through
# collect to the report


def write_result(folder: Path, run_id: str, step_times: list[float], tokens: int = 1000, warmup: list[float] = (2.0, 2.0, 2.0),
                 data_kind: str = "path", **metrics) -> Path:
    """results/runs/<run_id>/{metrics.json, steps.parquet} of a finished GPU run whose measured window is
    ``step_times`` (``tokens`` real tokens each) after ``warmup`` steps; its figures as summarise makes them."""
    from ftbench.measure.metrics import STEP_FIELDS, summarise
    from ftbench.runspec import RunSpec

    spec = RunSpec(model="m", dataset="d", precision="bf16", run_id=run_id, config_id=f"{run_id}-cfg",
                   model_def={"task": "classification"}, dataset_def={"source": {"kind": data_kind}})
    records = [{"step": i, "measured": i >= len(warmup), "step_time_s": t, "loader_s": 0.0, "samples": 10, "tokens": tokens,
                "padded_tokens": tokens, "flops": 0, "loss": 0.5, "lr": 1e-4} for i, t in enumerate([*warmup, *step_times])]
    result = {"run_id": run_id, "status": "ok", "status_reason": None, "device": "cuda", "device_name": H100, "world_size": 1,
              "warmup_steps": len(warmup), "total_steps": len(records), "eval_accuracy": 0.8, "eval_samples": 500,
              "peak_memory_reserved_mb": 1000.0, "peak_memory_allocated_mb": 900.0, "wall_time_s": 100.0,
              **summarise(records, sum(step_times), 1), **metrics}
    folder = folder / "runs" / run_id
    folder.mkdir(parents=True)
    pd.DataFrame(records, columns=STEP_FIELDS).to_parquet(folder / "steps.parquet", index=False)
    (folder / "metrics.json").write_text(json.dumps({"spec": spec.to_dict(), "metrics": result, "environment": {}}))
    return folder / "metrics.json"


def collect_and_report(tmp_path: Path, results: list[Path]) -> tuple[pd.DataFrame, str]:
    """(the table collect wrote, the report.html built from it and the runs' steps)."""
    parquet = tmp_path / "metrics.parquet"
    collect.collect(results, parquet, tmp_path / "metrics.csv", prices=prices(), budget={"tokens": 1e9})
    report_page.build_report(parquet, [path.with_name("steps.parquet") for path in results], tmp_path / "figures",
                             tmp_path / "report.html", captions=CAPTIONS, gpu_table=GPU_TABLE)
    return pd.read_parquet(parquet).set_index("run_id"), (tmp_path / "report.html").read_text(encoding="utf-8")


UNSTABLE_NOTE = re.compile(r"Unstable run (?P<run>\S+): window-mean tokens/s (?P<percent>[\d.]+)% (?P<direction>below|above) "
                           r"the median-based figure \(a stretch of (?P<steps>slow|fast) steps\); its window-mean tokens/s "
                           r"\((?P<mean>[\d,.]+), median-based (?P<median>[\d,.]+)\)")


def test_the_unstable_note_gives_the_two_figures_its_steps_give(tmp_path):
    """Issue 28 item 1: the note printed the window mean times (1 + its gap to the median-based figure)
    as the median-based figure ('2,894, median-based 1,505' for '48.0% below'; the steps gave 5,564).
    Each figure of the note is what the run's steps give, and its percentage and direction agree with them."""
    # 20 measured steps of 1,000 tokens: 14 at 0.5 s and, mid-window, 6 slow ones at 1.5 s -> window mean
    # 20,000 / 16 s = 1,250 tokens/s, median-based 1,000 / 0.5 s = 2,000: the mean is 37.5% below.
    slow = write_result(tmp_path, "slow-run", [0.5] * 7 + [1.5] * 6 + [0.5] * 7)
    # ...and 6 fast ones at 0.4 s among 1.0 s steps: 20,000 / 16.4 s = 1,219.5 against 1,000 / 1.0 s: 22.0% above.
    fast = write_result(tmp_path, "fast-run", [1.0] * 7 + [0.4] * 6 + [1.0] * 7)
    # a steady run: not every run is unstable, so each unstable one gets its own note with its figures
    steady = write_result(tmp_path, "steady-run", [0.50, 0.52, 0.49, 0.51] * 5)
    table, page = collect_and_report(tmp_path, [slow, fast, steady])
    notes = {match["run"]: match for match in UNSTABLE_NOTE.finditer(html.unescape(page))}
    assert set(notes) == {"slow-run", "fast-run"}
    for run_id, (direction, steps) in {"slow-run": ("below", "slow"), "fast-run": ("above", "fast")}.items():
        note = notes[run_id]
        frame = pd.read_parquet(tmp_path / "runs" / run_id / "steps.parquet")
        window = frame[frame["measured"]]
        window_mean = window["tokens"].sum() / window["step_time_s"].sum()
        median_based = window["tokens"].mean() / window["step_time_s"].median()
        shown_mean, shown_median = (float(note[key].replace(",", "")) for key in ("mean", "median"))
        assert shown_mean == pytest.approx(window_mean, abs=0.5) and shown_median == pytest.approx(median_based, abs=0.5)
        assert (note["direction"], note["steps"]) == (direction, steps)
        assert float(note["percent"]) == pytest.approx(abs(window_mean / median_based - 1) * 100, abs=0.05)
        assert (shown_mean < shown_median) == (direction == "below")
    assert (notes["slow-run"]["mean"], notes["slow-run"]["median"], notes["slow-run"]["percent"]) == ("1,250", "2,000", "37.5")


def table_cells(page: str, table_id: str) -> dict[str, dict[str, str]]:
    """{first cell: {column: shown text}} of one table of the page."""
    table = re.search(rf'<table class="sortable" id="{table_id}">.*?</table>', page, flags=re.S).group(0)
    header = re.findall(r"<th(?: [^>]*)?>(.*?)</th>", table)
    body = table.split("</thead>", 1)[1]
    rows = [re.findall(r"<td[^>]*>(.*?)</td>", row) for row in re.findall(r"<tr[^>]*>(.*?)</tr>", body, flags=re.S)]
    return {html.unescape(cells[0]): dict(zip(header, map(html.unescape, cells))) for cells in rows}


def test_the_table_holds_the_intervals_and_stability_the_report_shows(tmp_path):
    """Issue 28 item 2: the 95% intervals (throughput, cost, quality) and unstable / unstable_reason are
    columns of metrics.parquet, equal to the report's own figures and to what its runs table shows."""
    results = [
        write_result(tmp_path, "slow-run", [0.5] * 7 + [1.5] * 6 + [0.5] * 7),
        write_result(tmp_path, "steady-run", [0.50, 0.52, 0.49, 0.51] * 5),
        write_result(tmp_path, "random-tokens", [0.50, 0.52, 0.49, 0.51] * 5, data_kind="synthetic"),
        write_result(tmp_path, "oom-run", [], status="oom", status_reason="CUDA out of memory"),
    ]
    table, page = collect_and_report(tmp_path, results)
    runs = analysis.add_step_figures(analysis.prepare(collect.typed(table.reset_index())),
                                     analysis.read_steps([path.with_name("steps.parquet") for path in results]))
    shown = report_page.with_display_columns(runs).set_index("run_id")
    for column in analysis.RUN_FIGURES:
        assert column in COLUMNS
        pd.testing.assert_series_equal(table[column], shown[column].astype(COLUMNS[column][0]), check_names=False,
                                       check_index_type=False, obj=column)
    # what the runs table shows, from the table's columns with the report's formatting
    cells = table_cells(page, "runs")
    for run_id, row in table.iterrows():
        for text, (low, high, column) in {"tokens_per_s_ci95": ("tokens_per_s_low", "tokens_per_s_high", "tokens_per_s"),
                                          "cost_ci95": ("cost_per_1m_tokens_low", "cost_per_1m_tokens_high", "cost_per_1m_tokens"),
                                          "projected_cost_ci95": ("projected_cost_low", "projected_cost_high", "projected_cost"),
                                          "quality_ci95": ("quality_low", "quality_high", "quality")}.items():
            assert cells[run_id][text] == (report_page.span(row[low], row[high], column) or ""), (run_id, text)
        assert cells[run_id]["unstable"] == report_page.fmt(row["unstable"], "unstable")
        assert cells[run_id]["unstable_reason"] == ("" if pd.isna(row["unstable_reason"]) else row["unstable_reason"])
    # the figures themselves: the slow run is unstable, the steady one has an interval around its speed
    assert bool(table.loc["slow-run", "unstable"]) and not bool(table.loc["steady-run", "unstable"])
    assert table.loc["slow-run", "tokens_per_s_median_based"] == pytest.approx(2000)
    steady = table.loc["steady-run"]
    assert steady["tokens_per_s_low"] < steady["tokens_per_s"] < steady["tokens_per_s_high"]
    assert steady["cost_per_1m_tokens_low"] == pytest.approx(steady["cost_per_1m_tokens"] * steady["tokens_per_s"] / steady["tokens_per_s_high"])
    assert steady["quality_metric"] == "accuracy" and (steady["quality_low"], steady["quality_high"]) == pytest.approx(
        uncertainty.wilson(0.8, 500))
    assert table.loc["random-tokens", ["quality", "quality_low", "quality_metric"]].isna().all()  # synthetic: none
    assert table.loc["oom-run", ["tokens_per_s_low", "cost_per_1m_tokens_low", "unstable"]].isna().all()


# ---------------------------------------------------------------------------------------------------
# The answer first: the headline table and the recommendation in one sentence


HEADLINE_HEADERS = ["configuration", "status", "quality (95% interval)", "tokens/s", "$ per 1M tokens", "cost to target", "fits on"]


def verdict(page: str) -> str:
    """The recommendation sentence's text."""
    return html.unescape(re.sub(r"<[^>]+>", "", re.search(r'<p class="pick" id="verdict">(.*?)</p>', page, flags=re.S).group(1)))


def test_the_report_opens_with_the_headline_table_and_the_recommendation(tmp_path):
    """Shaped like the default experiment: the first table of the page is one row per configuration with its status,
    quality and interval, tokens/s, $ per 1M tokens, cost to the target and the GPUs it fits; the recommendation is
    one sentence under it, naming what the to-target section ranks first; the details come after both."""
    runs, _, page = build(tmp_path, "cpu_default", **DEFAULT_RECOMMEND)
    first_table = re.search(r"<table[^>]*>", page).group(0)
    assert 'id="headline"' in first_table
    assert page.index('id="headline"') < page.index('id="verdict"') < page.index('<h2 id="summary">') < page.index("<li>Fastest")
    header = re.findall(r"<th(?: [^>]*)?>(.*?)</th>", re.search(r'<table class="sortable" id="headline">.*?</thead>', page, flags=re.S).group(0))
    assert header == HEADLINE_HEADERS
    cells = table_cells(page, "headline")
    assert list(cells) == ["full", "lora-r16", "lora-r8", "qlora-r8"]  # cheapest to the target first
    configs = analysis.configurations(analysis.add_step_figures(analysis.prepare(runs), pd.DataFrame()))
    to_target = quality_target.configurations_to_target(configs, analysis.prepare(runs)).set_index("configuration")
    for name, row in cells.items():
        config = to_target.loc[name]
        assert row["status"] == "ok"
        assert row["quality (95% interval)"] == f"{config['accuracy']:.3f} ({config['accuracy_low']:.3f}\u2013{config['accuracy_high']:.3f})"
        assert row["tokens/s"] == report_page.fmt(config["tokens_per_s"]) and row["$ per 1M tokens"] == report_page.money(config["cost_per_1m_tokens"])
        assert row["cost to target"].startswith(report_page.money(config["cost_to_target"]) + " (")
        assert row["fits on"] == "all 11"  # 1-1.3 GiB estimates fit every GPU of the table
    to_target_cells = table_cells(page, "to-target")
    assert all(to_target_cells[name]["cost_to_target"] == cells[name]["cost to target"].split(" (")[0] for name in cells)
    sentence = verdict(page)
    leaders = [name for name, row in to_target_cells.items() if row["within_noise"] == "yes"]
    assert sentence.startswith("Recommended: any of ") and all(f"{name} (" in sentence for name in leaders)
    assert "the cheapest to reach eval_accuracy 0.7, among those with accuracy \u2265 0.7 and peak memory \u2264 4,000 MiB" in sentence
    assert re.sub(r"\d\.\d", "", sentence).count(".") == 1 and sentence.endswith(".")  # one sentence: one full stop, at its end


def test_a_note_every_run_shares_is_said_once(tmp_path):
    """Every run of the default-like experiment is unstable on a shared CPU: one note says so, no note per run."""
    runs, _, page = build(tmp_path, "cpu_default", **DEFAULT_RECOMMEND)
    text = html.unescape(page)
    assert text.count("Every run's measured window is unstable (4 runs:") == 1
    assert "Unstable run " not in text
    assert text.count(report_page.WITHIN_RUN_NOTE) == 1  # the within-run interval remark: once, not per figure
    assert "fewer than 3 repeats: the intervals bound" not in text
    # in the runs table each run still says it, with its own reason
    assert all(">yes<" in row for row in runs_table_rows(page))


def test_unstable_notes_name_each_run_unless_every_run_of_a_kind_is(tmp_path):
    frame = pd.DataFrame({"run_id": ["g1", "g2", "c1", "c2"], "device": ["cuda", "cuda", "cpu", "cpu"],
                          "unstable": pd.array([True, False, True, True], dtype="boolean"),
                          "unstable_reason": ["step time rose 9.0%", None, "a", "b"],
                          "tokens_per_s": [1.0, 1.0, 1.0, 1.0], "tokens_per_s_median_based": [1.1, 1.0, 1.1, 1.1]})
    notes = report_page.unstable_notes(frame)
    assert len(notes) == 2 and notes[0].startswith("Every CPU run's measured window is unstable (2 runs")
    assert notes[1].startswith("Unstable run g1: step time rose 9.0%")
    assert report_page.unstable_notes(frame.assign(unstable=True))[0].startswith("Every run's measured window is unstable (4 runs")
    assert [n.split(":")[0] for n in report_page.unstable_notes(frame.iloc[[0, 1]])] == ["Unstable run g1"]


@pytest.mark.parametrize("kind, settings, expected", [
    ("cpu", {}, r"^Recommended: full, the cheapest per 1M training tokens \(\$0\.0412, 95% interval \$0\.0402\u2013\$0\.0421\)\.$"),
    ("normal", {"min_accuracy": 0.87, "max_memory_mb": 30000},
     r"^Recommended: lora-r16, the cheapest per 1M training tokens \(\$[\d.]+, 95% interval [^)]+\), among those with "
     r"accuracy \u2265 0\.87 and peak memory \u2264 30,000 MiB\.$"),
    ("normal", {"min_accuracy": 0.99}, r"^No finished configuration has accuracy \u2265 0\.99, so none is recommended \(the best "
                                       r"accuracy was 0\.900, the smallest peak memory 9,000 MiB\)\.$"),
    ("all_oom", {}, r"^No configuration finished, so there is nothing to recommend"),
    ("tie", {"min_accuracy": 0.8}, r"^Recommended: any of lora-r16 \(\$[\d.]+\), lora-r8 \(\$[\d.]+\) \u2014 the cheapest per 1M "
                                   r"training tokens, among those with accuracy \u2265 0\.8, within noise of each other"),
])
def test_the_recommendation_is_one_sentence_for_every_case(tmp_path, kind, settings, expected):
    _, _, page = build(tmp_path, kind, **settings)
    assert re.search(expected, verdict(page)), verdict(page)


def test_the_headline_marks_unfinished_configurations_and_puts_them_last(tmp_path):
    _, _, page = build(tmp_path, "mixed", min_accuracy=0.8, max_memory_mb=30000)
    cells = table_cells(page, "headline")
    statuses = [row["status"] for row in cells.values()]
    assert statuses[-3:] == ["oom", "diverged", "unsupported"] and statuses.count("ok (3 runs)") == 2
    assert "cost to target" not in next(iter(cells.values()))  # no target: no column, and a line says how to get it
    assert "Set <code>target: {metric, value}</code>" in page
    assert re.search(r'<tr class="status-oom"><td[^>]*>full-b64-s512', page)
    costs = [float(row["$ per 1M tokens"].lstrip("$")) for row in cells.values() if row["$ per 1M tokens"]]
    assert costs == sorted(costs)


def test_where_no_configuration_reached_the_target_the_sentence_says_so_and_ranks_by_cost(tmp_path):
    from ftbench.report import headline

    runs, steps = fixture_runs("cpu_default")
    runs = runs.assign(target_reached=False, tokens_to_target=None, cost_to_target=None, cost_to_target_low=None,
                       cost_to_target_high=None, gpu_hours_to_target=None, hours_to_target=None, train_s_to_target=None)
    runs = analysis.add_step_figures(analysis.prepare(collect.typed(runs)), analysis.read_steps([]))
    configs = analysis.configurations(runs)
    text = "".join(part for part, _ in headline.sentence(configs, runs, {}, DEFAULT_TARGET))
    assert text == "Recommended: full, the cheapest per 1M training tokens ($0.0412); no configuration reached the target eval_accuracy 0.7."
    section = headline.section(configs, runs, gpu_table.load_peaks(GPU_TABLE), {})
    assert [cells[5].text for _, cells in section["table"].rows] == ["not reached"] * 4
