"""Scaling over GPUs (scripts/ftbench/report/scaling.py), its figures and its report section, on hand-made run
tables whose expected efficiencies, intervals and costs are worked out here by hand.

The runs carry their within-run throughput interval (tokens_per_s_low/high, as collect stores it) and no steps,
so the intervals are exactly the ones written below. The price is set to $3.60 per H100-hour, so that
$ per 1M tokens = 3.6 x GPUs / (tokens/s x 3600) x 1e6 = 1000 x GPUs / tokens/s.
"""

from __future__ import annotations

import math
import re

import pandas as pd
import pytest

from ftbench.report import analysis, collect, cost, figures, report_page, scaling
from ftbench.report.columns import COLUMNS
from test_report import CAPTIONS, GPU_TABLE, H100, PRICES_TABLE, fixture_runs, images, make_run, write_fixture

SMALL, BIG = 124_000_000, 8_000_000_000
NO_STEPS = pd.DataFrame(columns=analysis.STEP_COLUMNS)


def run(index: int, tokens_per_s: float, low: float, high: float, parallel: str = "single", gpus: int = 1, model: str = "small",
        params: int = SMALL, offload: bool | None = None, memory_mb: float = 20000.0, **extra) -> dict:
    """A finished full fine-tuning run on H100s with its global tokens/s and that figure's 95% interval."""
    fsdp = parallel == "fsdp"
    row = make_run(index, "full", parallel=parallel, num_gpus=gpus, tokens_per_s=tokens_per_s, memory_mb=memory_mb,
                   tokens_per_s_low=low, tokens_per_s_high=high, world_size=gpus, total_params=params,
                   fsdp_cpu_offload=bool(offload) if fsdp else None, fsdp_reshard_after_forward=True if fsdp else None, **extra)
    # make_run names everything model "m": give each model its own name and configuration id
    for key in ("run_id", "config_id"):  # the name part of fsdp_cpu_offload goes before the hash, as runspec writes it
        row[key] = re.sub(r"-([0-9a-f]{8})$", r"-offload-\1" if offload else r"-\1", row[key].replace("m-d-", f"{model}-d-", 1))
    row["model"] = model
    return row


def table(rows: list[dict], price: float = 3.6) -> pd.DataFrame:
    """The runs as collect writes them (typed, priced), then as the report prepares them."""
    frame = collect.typed(pd.DataFrame(rows, columns=list(COLUMNS)))
    frame, _ = cost.add_costs(frame, cost.resolve({"table": str(PRICES_TABLE), "per_device_hour": {"H100 SXM": price}}), warn=False)
    return analysis.add_step_figures(analysis.prepare(collect.typed(frame)), NO_STEPS)


def scaling_rows() -> list[dict]:
    return [
        run(1, 20000, 16000, 25000),                                          # the baseline: single on one GPU
        run(2, 36000, 34000, 38000, "ddp", 2, memory_mb=30000),               # 18,000 (17,000-19,000) per GPU
        run(3, 64000, 60000, 68000, "ddp", 4, memory_mb=30500),               # 16,000 (15,000-17,000) per GPU
        run(4, 4000, 3800, 4200, "fsdp", 2, offload=True, memory_mb=9000),    # 2,000 (1,900-2,100) per GPU
        # the big model: too large for one GPU, so no baseline; fsdp beyond noise cheaper than with offload
        run(5, 12000, 11500, 12500, "fsdp", 2, model="big", params=BIG, memory_mb=70000),
        run(6, 3000, 2900, 3100, "fsdp", 2, model="big", params=BIG, offload=True, memory_mb=40000),
    ]


def points(rows: list[dict]) -> pd.DataFrame:
    runs = table(rows)
    return scaling.scaling_table(runs, analysis.configurations(runs))


def point(frame: pd.DataFrame, model: str, mode: str, gpus: int) -> pd.Series:
    chosen = frame[(frame["model"] == model) & (frame["mode"] == mode) & (frame["gpus"] == gpus)]
    assert len(chosen) == 1, (model, mode, gpus, frame[["model", "mode", "gpus"]])
    return chosen.iloc[0]


# ---------------------------------------------------------------------------------------------------
# The numbers


@pytest.mark.parametrize(("mode", "gpus", "per_gpu", "efficiency", "low", "high"), [
    # per-GPU / single; the interval: per-GPU low / single high, per-GPU high / single low
    ("ddp", 2, (18000, 17000, 19000), 18000 / 20000, 17000 / 25000, 19000 / 16000),       # 0.9 (0.68-1.1875)
    ("ddp", 4, (16000, 15000, 17000), 16000 / 20000, 15000 / 25000, 17000 / 16000),       # 0.8 (0.6-1.0625)
    ("fsdp+offload", 2, (2000, 1900, 2100), 2000 / 20000, 1900 / 25000, 2100 / 16000),    # 0.1 (0.076-0.13125)
])
def test_efficiency_and_its_interval_by_hand(mode, gpus, per_gpu, efficiency, low, high):
    row = point(points(scaling_rows()), "small", mode, gpus)
    assert (row["tokens_per_s_per_gpu"], row["tokens_per_s_per_gpu_low"], row["tokens_per_s_per_gpu_high"]) == pytest.approx(per_gpu)
    # the global figure stays what the run measured, in its own column
    assert (row["tokens_per_s"], row["tokens_per_s_low"], row["tokens_per_s_high"]) == pytest.approx(tuple(v * gpus for v in per_gpu))
    assert (row["efficiency"], row["efficiency_low"], row["efficiency_high"]) == pytest.approx((efficiency, low, high))
    assert row["has_baseline"] and not row["baseline"]


def test_the_baseline_is_one_without_an_interval_and_memory_is_per_gpu():
    frame = points(scaling_rows())
    baseline = point(frame, "small", "single", 1)
    assert baseline["baseline"] and baseline["efficiency"] == 1 and math.isnan(baseline["efficiency_low"])
    assert point(frame, "small", "ddp", 2)["peak_memory_reserved_mb"] == 30000  # the run's own peak: one GPU's
    assert point(frame, "small", "fsdp+offload", 2)["peak_memory_reserved_mb"] == 9000
    # sorted by model size, then mode (single, dp, ddp, fsdp and its variants) and GPU count
    assert list(zip(frame["model"], frame["mode"], frame["gpus"])) == [
        ("small", "single", 1), ("small", "ddp", 2), ("small", "ddp", 4), ("small", "fsdp+offload", 2),
        ("big", "fsdp", 2), ("big", "fsdp+offload", 2)]


def test_repeats_give_the_baseline_their_t_interval():
    # three single-GPU repeats 19,000 / 20,000 / 21,000: mean 20,000, sd 1,000, t(2) = 4.303
    half = 4.303 * 1000 / math.sqrt(3)
    rows = [run(10 + i, speed, speed - 100, speed + 100, repeat=i, repeats=3) for i, speed in enumerate([19000, 20000, 21000])]
    row = point(points(rows + [run(2, 36000, 34000, 38000, "ddp", 2)]), "small", "ddp", 2)
    assert row["efficiency"] == pytest.approx(18000 / 20000)
    assert (row["efficiency_low"], row["efficiency_high"]) == pytest.approx((17000 / (20000 + half), 19000 / (20000 - half)), rel=1e-3)


def test_no_baseline_is_said_not_invented():
    frame = points(scaling_rows())
    for mode in ("fsdp", "fsdp+offload"):
        big = point(frame, "big", mode, 2)
        assert not big["has_baseline"] and math.isnan(big["efficiency"]) and math.isnan(big["efficiency_low"])
    assert scaling.without_baseline(frame) == ["big-d-full-bf16-b16-s512"]


def test_the_cheapest_mode_per_model_size_with_a_tie_within_noise():
    cheapest = scaling.cheapest_modes(points(scaling_rows())).set_index("model")
    assert list(cheapest.index) == ["small", "big"]  # smallest model first
    # small: single $0.05 (1000/25000 = 0.04 to 1000/16000 = 0.0625); ddp x2 $0.0556 (2000/38000 = 0.0526 to
    # 2000/34000 = 0.0588) and ddp x4 $0.0625 (0.0588 to 0.0667) reach into it: a tie; fsdp+offload x2 $0.5 does not
    small = cheapest.loc["small"]
    assert small["cheapest"] == "single \u00d71" and small["basis"] == "cost"
    assert (small["cost_per_1m_tokens"], small["cost_low"], small["cost_high"]) == pytest.approx((0.05, 0.04, 0.0625))
    assert small["within_noise"] == "ddp \u00d72 ($0.0556), ddp \u00d74 ($0.0625)"
    assert small["beyond_noise"] == "fsdp+offload \u00d72 ($0.5)"
    # big: fsdp x2 $0.167 (2000/12500 = 0.16 to 2000/11500 = 0.174) against $0.667 with offload: no tie
    big = cheapest.loc["big"]
    assert big["cheapest"] == "fsdp \u00d72" and big["cost_per_1m_tokens"] == pytest.approx(2000 / 12000)
    assert pd.isna(big["within_noise"]) and big["beyond_noise"] == "fsdp+offload \u00d72 ($0.667)"


def test_without_a_price_the_per_gpu_throughput_ranks_the_modes():
    rows = [run(1, 20000, 16000, 25000), run(2, 36000, 34000, 38000, "ddp", 2), run(4, 4000, 3800, 4200, "fsdp", 2, offload=True)]
    runs = table([{**row, "device_name": "NVIDIA B200"} for row in rows])  # B200: not in the price table
    cheapest = scaling.cheapest_modes(scaling.scaling_table(runs, analysis.configurations(runs))).iloc[0]
    assert cheapest["basis"] == "per-GPU throughput" and cheapest["cheapest"] == "single \u00d71"
    assert cheapest["within_noise"] == "ddp \u00d72 (18,000 tokens/s per GPU)"  # 17,000-19,000 reaches into 16,000-25,000


def test_one_gpu_count_has_nothing_to_scale():
    runs = table([run(1, 20000, 16000, 25000), run(7, 30000, 28000, 32000, model="other")])
    assert not scaling.several_gpu_counts(runs)
    assert scaling.scaling_table(runs, analysis.configurations(runs)).empty  # single on one GPU only: no series to follow
    # a 2-GPU run that measured nothing does not make a scaling answer, but it is named
    failed = {**run(8, 0, 0, 0, "ddp", 2), "status": "failed", "tokens_per_s": None, "tokens_per_s_low": None, "tokens_per_s_high": None}
    runs = table([run(1, 20000, 16000, 25000), failed])
    assert not scaling.several_gpu_counts(runs)
    assert scaling.unmeasured_multi_gpu(runs) == [f"{failed['run_id']} (failed)"]


def test_modes_name_the_fsdp_options_and_the_nodes():
    base = dict.fromkeys(scaling.PARALLEL_SETTINGS)
    assert scaling.mode_of({**base, "parallel": "single"}) == "single"
    assert scaling.mode_of({**base, "parallel": "fsdp", "fsdp_cpu_offload": True, "fsdp_reshard_after_forward": True}) == "fsdp+offload"
    assert scaling.mode_of({**base, "parallel": "fsdp", "fsdp_cpu_offload": False, "fsdp_reshard_after_forward": False,
                            "fsdp_reduce_dtype": "fp32"}) == "fsdp+noreshard+reduce-fp32"
    assert scaling.mode_of({**base, "parallel": "ddp", "num_nodes": 2}) == "ddp over 2 nodes"
    assert sorted(["fsdp+offload", "ddp", "single", "fsdp", "dp"], key=scaling.mode_rank) == ["single", "dp", "ddp", "fsdp", "fsdp+offload"]


# ---------------------------------------------------------------------------------------------------
# The figures


def legend(grid) -> list[str]:
    return [text.get_text() for text in grid._legend.texts]


def test_global_scaling_figure_follows_every_mode_with_the_ideal_line():
    runs = table(scaling_rows())
    grid = figures.draw(figures.FIGURES[[spec.name for spec in figures.FIGURES].index("scaling")], runs, NO_STEPS,
                        analysis.configurations(runs))
    assert legend(grid) == ["single", "ddp", "fsdp+offload", figures.IDEAL]  # fsdp lines are drawn too
    ax = grid.axes.flat[0]  # the one series measured at several GPU counts: the small model
    ideal = next(line for line in ax.lines if line.get_linestyle() == "--")
    assert list(ideal.get_xdata()) == [1, 2, 4] and list(ideal.get_ydata()) == pytest.approx([20000, 40000, 80000])
    assert "all GPUs together (global)" in ax.get_ylabel()


def test_per_gpu_figure_has_throughput_and_memory_per_series():
    runs = table(scaling_rows())
    grid = figures.draw(figures.SCALING_PER_GPU, scaling.scaling_table(runs, analysis.configurations(runs)))
    assert grid.axes.shape == (2, 2)  # a row per series, throughput and memory per GPU side by side
    throughput, memory = grid.axes[0]
    assert "per GPU" in throughput.get_ylabel() and "global" in throughput.get_ylabel() and "per GPU" in memory.get_ylabel()
    ideal = next(line for line in throughput.lines if line.get_linestyle() == "--")
    assert list(ideal.get_ydata()) == pytest.approx([20000, 20000, 20000])  # per GPU, linear scaling keeps the single GPU's
    assert "no baseline" in " ".join(text.get_text() for text in grid.axes[1][0].texts)


# ---------------------------------------------------------------------------------------------------
# The report section


def render(tmp_path, rows: list[dict]) -> tuple[dict, str]:
    frame = collect.typed(pd.DataFrame(rows, columns=list(COLUMNS)))
    frame, _ = cost.add_costs(frame, cost.resolve({"table": str(PRICES_TABLE), "per_device_hour": {"H100 SXM": 3.6}}), warn=False)
    metrics, files = write_fixture(tmp_path, collect.typed(frame), {})
    written = report_page.build_report(metrics, files, tmp_path / "figures", tmp_path / "report.html", captions=CAPTIONS,
                                       gpu_table=GPU_TABLE)
    return written, (tmp_path / "report.html").read_text(encoding="utf-8")


def section(page: str) -> str:
    return re.search(r'<h2 id="scaling">.*?(?=<h2 id="runs-section">)', page, flags=re.S).group(0)


def test_report_has_the_scaling_section(tmp_path):
    written, page = render(tmp_path, scaling_rows())
    assert '<a href="#scaling">Scaling</a>' in page
    text = section(page)
    cheapest = re.search(r'id="scaling-cheapest">.*?</table>', text, flags=re.S).group(0)
    assert "single \u00d71" in cheapest and "ddp \u00d72 ($0.0556), ddp \u00d74 ($0.0625)" in cheapest and "124M" in cheapest
    assert "a tie, not a ranking" in text
    rows = re.findall(r"<tr>(.*?)</tr>", re.search(r'id="scaling-points">.*?</table>', text, flags=re.S).group(0), flags=re.S)
    ddp2 = next(row for row in rows if ">ddp<" in row and ">2<" in row)
    # global and per-GPU throughput apart; efficiency 0.9 with 0.68-1.1875
    assert ">36,000<" in ddp2 and ">18,000<" in ddp2 and ">0.9<" in ddp2 and "0.68\u20131.188" in ddp2
    assert "tokens_per_s_all_gpus</th>" in text and "tokens_per_s_per_gpu</th>" in text
    assert "No baseline for big-d-full-bf16-b16-s512" in text and "no baseline (no single run on 1 GPU)" in text
    assert 'id="figure-scaling_per_gpu"' in text and not isinstance(written["scaling_per_gpu"], str)
    assert len(images(text)) == 1


def test_no_scaling_section_when_every_run_used_one_gpu(tmp_path):
    written, page = render(tmp_path, [run(1, 20000, 16000, 25000), run(7, 30000, 28000, 32000, model="other")])
    assert 'id="scaling"' not in page and "#scaling" not in page
    assert "scaling_per_gpu" not in written
    assert written["scaling"] == "every GPU run used the same number of GPUs"


def test_the_fixture_scaling_series_gets_the_section(tmp_path):
    runs, steps = fixture_runs("scaling")  # dp and ddp on 2 and 4 GPUs beside one GPU, as test_report draws them
    prepared = analysis.prepare(runs)
    frame = scaling.scaling_table(prepared, analysis.configurations(prepared))
    assert {(mode, gpus): speed for mode, gpus, speed in zip(frame["mode"], frame["gpus"], frame["tokens_per_s"])} == {
        ("single", 1): 15000, ("dp", 2): 21000, ("ddp", 2): 28500, ("ddp", 4): 55000}
    assert list(frame["efficiency"]) == pytest.approx([1, 21000 / 2 / 15000, 28500 / 2 / 15000, 55000 / 4 / 15000])
    metrics, files = write_fixture(tmp_path, runs, steps)
    written = report_page.build_report(metrics, files, tmp_path / "figures", tmp_path / "report.html", captions=CAPTIONS)
    page = (tmp_path / "report.html").read_text(encoding="utf-8")
    assert 'id="scaling-points"' in page and not isinstance(written["scaling_per_gpu"], str)
    assert H100.removeprefix("NVIDIA ") in section(page)
