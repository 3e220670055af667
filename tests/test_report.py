"""Cost, figures, the HTML report, Snakemake's report and compare, from fixture result tables.

The fixtures are metrics.parquet files built here with the documented columns (ftbench.columns.COLUMNS,
so they follow any column added there) and costs filled in by ftbench.cost exactly as collect does:
normal runs, repeats, an all-OOM experiment, a single run, several GPU types (one missing from the
price table), language-model runs and a GPU-scaling series.
"""

from __future__ import annotations

import copy
import hashlib
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

from ftbench import collect, compare, config as ftbench_config, cost, figures, report
from ftbench.columns import COLUMNS
from ftbench.errors import ConfigError, FtbenchError

ROOT = Path(__file__).resolve().parents[1]

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
    settings = json.dumps([config_name, device_name], sort_keys=True)
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
                       memory_estimate_mb=0.8 * memory_mb)
    if status == "ok" and accuracy is not None:
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
    raise ValueError(kind)


def fixture_runs(kind: str, prices: cost.Prices | None = None) -> tuple[pd.DataFrame, dict[str, pd.DataFrame]]:
    """(a run table as collect writes it, {run_id: steps}) for one fixture kind."""
    rows = fixture_rows(kind)
    frame = collect.typed(pd.DataFrame(rows, columns=list(COLUMNS)))
    frame, _ = cost.add_costs(frame, prices or cost.resolve(), warn=False)
    frame = collect.typed(frame)
    steps = {row["run_id"]: make_steps(row, seed=i) for i, row in enumerate(rows) if row["status"] in ("ok", "diverged") and row["tokens_per_s"]}
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
    html = tmp_path / kind / "report.html"
    written = report.build_report(metrics, files, tmp_path / kind / "figures", html, recommend_settings=settings or None)
    return runs, written, html.read_text(encoding="utf-8")


def images(page: str) -> list[str]:
    return re.findall(r'<img[^>]*src="data:image/png;base64,([A-Za-z0-9+/=]+)"', page)


def runs_table_rows(page: str) -> list[str]:
    table = re.search(r'<table class="sortable" id="runs">.*?</table>', page, flags=re.S).group(0)
    return re.findall(r"<tr class=\"status-[a-z]+\">(.*?)</tr>", table, flags=re.S)


# ---------------------------------------------------------------------------------------------------
# Cost formulas


def test_cost_columns_are_documented():
    assert set(cost.COST_COLUMNS) <= set(COLUMNS)
    order = [c for c in COLUMNS if c in cost.COST_COLUMNS]
    assert order == list(cost.COST_COLUMNS)


def test_cost_per_million_tokens_uses_price_per_hour_over_tokens_per_hour():
    # $2 per hour at 1,000 tokens/s: 3.6M tokens per hour -> $0.5556 per 1M tokens
    assert cost.cost_per_1m_tokens(2.0, 1000.0) == pytest.approx(2.0 / 3.6)
    assert cost.cost_per_1k_samples(2.0, 10.0) == pytest.approx(2.0 / 36.0)
    assert cost.cost_per_1m_tokens(2.0, 0.0) is None and cost.cost_per_1m_tokens(None, 1000.0) is None
    assert cost.cost_per_1m_tokens(0.0, 1000.0) == 0.0  # free hardware is a price, not a missing one


def test_multi_gpu_run_pays_for_every_gpu_with_global_throughput():
    prices = cost.resolve({"provider": "gpu_cloud", "pricing": "on_demand"})
    row = make_run(1, "full", parallel="ddp", num_gpus=4, tokens_per_s=40000.0)
    values, warning = cost.run_costs(row, prices)
    assert warning is None
    assert values["gpu_model"] == "H100 SXM" and values["billed_devices"] == 4
    assert values["price_per_hour"] == pytest.approx(4 * 2.99)
    # global tokens/s with all 4 GPUs' price; the per-device rate with 4 prices would be 4x too high
    assert values["cost_per_1m_tokens"] == pytest.approx(4 * 2.99 / (40000 * 3600) * 1e6)
    assert values["cost_per_1k_samples"] == pytest.approx(4 * 2.99 / (100 * 3600) * 1e3)


def test_billed_devices():
    assert cost.billed_devices("cpu", 1, 1, "single") == 1
    assert cost.billed_devices("cpu", 1, 4, "ddp") == 1
    assert cost.billed_devices("cuda", 1, 1, "single") == 1
    assert cost.billed_devices("cuda", 2, 2, "dp") == 2
    assert cost.billed_devices("cuda", None, 4, "ddp") == 4
    assert cost.billed_devices("cuda", None, 4, "single") == 1


def test_cpu_runs_are_priced_per_machine_hour():
    prices = cost.resolve()
    values, warning = cost.run_costs(make_run(1, device_name=CPU_NAME, tokens_per_s=1000.0), prices)
    assert warning is None and values["gpu_model"] == "cpu"
    assert values["cost_per_1m_tokens"] == pytest.approx(prices.per_device_hour["cpu"] / 3.6)


def test_gpu_missing_from_the_price_table_warns_and_gets_no_cost():
    runs, _ = fixture_runs("normal")
    runs.loc[0, "device_name"] = UNPRICED
    priced, warnings = cost.add_costs(runs, cost.resolve(), warn=False)
    assert len(warnings) == 1 and UNPRICED in warnings[0] and "price table" in warnings[0]
    assert priced.loc[0, ["price_per_hour", "cost_per_1m_tokens", "projected_cost"]].isna().all()
    assert pd.isna(priced.loc[0, "gpu_model"]) and "no entry" in priced.loc[0, "price_source"]
    assert priced.loc[1:, "cost_per_1m_tokens"].notna().all()
    with pytest.warns(UserWarning, match="not in price table"):
        cost.add_costs(runs, cost.resolve())


def test_model_without_a_price_for_the_provider_gets_no_cost():
    prices = cost.resolve({"provider": "hyperscaler", "pricing": "spot"})
    values, warning = cost.run_costs(make_run(1, device_name="NVIDIA GeForce RTX 4090"), prices)
    assert values["gpu_model"] == "RTX 4090" and values["cost_per_1m_tokens"] is None
    assert "hyperscaler/spot" in warning


def test_provider_pricing_and_overrides(tmp_path):
    row = make_run(1, tokens_per_s=10000.0)
    spot = cost.run_costs(row, cost.resolve({"pricing": "spot"}))[0]
    on_demand = cost.run_costs(row, cost.resolve({"pricing": "on_demand"}))[0]
    assert spot["price_per_device_hour"] < on_demand["price_per_device_hour"]
    hyper = cost.run_costs(row, cost.resolve({"provider": "hyperscaler"}))[0]
    table = yaml.safe_load((ROOT / "config" / "prices.yaml").read_text())
    assert hyper["price_per_device_hour"] == table["providers"]["hyperscaler"]["on_demand"]["H100 SXM"]
    override = cost.run_costs(row, cost.resolve({"per_device_hour": {"H100 SXM": 1.0}}))[0]
    assert override["cost_per_1m_tokens"] == pytest.approx(1.0 / (10000 * 3600) * 1e6)
    assert "prices.per_device_hour" in override["price_source"]
    # a table of one's own
    own = tmp_path / "prices.yaml"
    own.write_text(yaml.safe_dump({"models": [{"name": "any", "match": "."}, {"name": "cpu", "match": None}],
                                   "providers": {"mine": {"on_demand": {"any": 7.0}}}}))
    mine = cost.run_costs(row, cost.resolve({"table": str(own)}))[0]
    assert mine["price_per_device_hour"] == 7.0 and mine["gpu_model"] == "any"


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"provider": "nope"}, "config key prices.provider: 'nope' is not in price table"),
        ({"per_device_hour": {"H1000": 1.0}}, "config key prices.per_device_hour.H1000: not a model"),
        ({"table": "/nonexistent/prices.yaml"}, "config key prices.table: price table /nonexistent/prices.yaml not found"),
    ],
)
def test_price_settings_errors_name_the_key(settings, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        cost.resolve(settings)


def test_broken_price_table_is_reported(tmp_path):
    bad = tmp_path / "prices.yaml"
    bad.write_text(yaml.safe_dump({"models": [{"name": "x", "match": "("}], "providers": {}}))
    with pytest.raises(ConfigError, match="not a regular expression"):
        cost.resolve({"table": str(bad)})
    bad.write_text(yaml.safe_dump({"models": [{"name": "x", "match": "x"}], "providers": {"p": {"on_demand": {"y": 1}}}}))
    with pytest.raises(ConfigError, match=r"providers.p.on_demand.y: not a model"):
        cost.resolve({"table": str(bad)})


def test_budget_projection_gpu_hours_and_cost():
    # 1e9 tokens x 2 epochs at 10,000 tokens/s = 55.6 wall hours; on 4 GPUs 222 GPU-hours
    assert cost.budget_hours({"tokens": 1e9, "epochs": 2}, 10000.0, 25.0) == pytest.approx(2e9 / 1e4 / 3600)
    assert cost.budget_hours({"samples": 1e6}, 10000.0, 25.0) == pytest.approx(1e6 / 25 / 3600)
    assert cost.budget_hours(None, 10000.0, 25.0) is None
    prices = cost.resolve({"per_device_hour": {"H100 SXM": 2.0}})
    row = make_run(1, parallel="ddp", num_gpus=4, tokens_per_s=10000.0)
    values, _ = cost.run_costs(row, prices, budget={"tokens": 1e9, "epochs": 2})
    hours = 2e9 / 1e4 / 3600
    assert values["projected_gpu_hours"] == pytest.approx(4 * hours)
    assert values["projected_cost"] == pytest.approx(4 * hours * 2.0)
    # the measurement's own projection (column projected_hours) wins over the budget given here
    row["projected_hours"] = 10.0
    values, _ = cost.run_costs(row, prices, budget={"tokens": 1e9})
    assert values["projected_gpu_hours"] == pytest.approx(40.0) and values["projected_cost"] == pytest.approx(80.0)


def test_energy_cost_from_joules_per_token():
    # 0.5 J/token x 1M tokens = 500 kJ = 0.1389 kWh; at $0.15/kWh = $0.0208
    assert cost.energy_cost(0.5, 1e6, 0.15) == pytest.approx(0.5e6 / 3.6e6 * 0.15)
    prices = cost.resolve({"electricity_per_kwh": 0.30})
    row = make_run(1, tokens_per_s=10000.0)
    values, _ = cost.run_costs(row, prices, budget={"tokens": 3.6e7})  # one hour at 10,000 tokens/s
    assert values["energy_cost_per_1m_tokens"] == pytest.approx(row["energy_j_per_token"] * 1e6 / 3.6e6 * 0.30)
    assert values["projected_energy_cost"] == pytest.approx(row["energy_j_per_token"] * 3.6e7 / 3.6e6 * 0.30)
    cpu_values, _ = cost.run_costs(make_run(2, device_name=CPU_NAME), prices)
    assert cpu_values["energy_cost_per_1m_tokens"] is None  # no NVML on a CPU: null, not 0


def test_runs_without_a_device_or_throughput_get_no_cost():
    prices = cost.resolve()
    unsupported, warning = cost.run_costs(make_run(1, status="unsupported", tokens_per_s=None), prices)
    assert warning is None and all(v is None for v in unsupported.values())
    oom, _ = cost.run_costs(make_run(2, status="oom", tokens_per_s=None), prices)
    assert oom["price_per_hour"] == pytest.approx(2.99) and oom["cost_per_1m_tokens"] is None


def test_collect_computes_costs_from_metrics_json(tmp_path):
    """collect's own path: metrics.json files in, costed table out (a CPU run and an unpriced GPU run)."""
    files = []
    for index, (device, name) in enumerate([("cpu", CPU_NAME), ("cuda", UNPRICED)]):
        spec = {key: None for key in ("model", "dataset", "lora_rank", "lora_alpha", "attn_implementation")}
        spec.update(model="m", dataset="d", method="lora", precision="fp32", batch_size=8, seq_len=64, learning_rate=1e-3,
                    optimizer="adamw", grad_accum_steps=1, gradient_checkpointing=False, compile=False, num_gpus=1,
                    parallel="single", repeat=0, seed=0, model_def={"task": "classification"})
        spec["run_id"] = f"run{index}"
        if index == 0:
            spec["budget"] = {"tokens": 7.2e6}  # a budget in the run's own spec wins over --budget
        metrics = {"run_id": f"run{index}", "status": "ok", "device": device, "device_name": name, "world_size": 1,
                   "tokens_per_s": 1000.0, "samples_per_s": 20.0, "peak_rss_mb": 100.0}
        path = tmp_path / f"run{index}" / "metrics.json"
        path.parent.mkdir()
        path.write_text(json.dumps({"spec": spec, "metrics": metrics, "environment": {"host": "h"}}))
        files.append(path)
    process = subprocess.run(
        [sys.executable, "-m", "ftbench", "collect", "--parquet", str(tmp_path / "m.parquet"), "--csv",
         str(tmp_path / "m.csv"), "--price-settings", json.dumps({"pricing": "spot"}),
         "--budget", json.dumps({"samples": 72000}), *map(str, files)],
        capture_output=True, text=True, check=False,
    )
    assert process.returncode == 0, process.stderr
    assert f"warning: run run1: GPU '{UNPRICED}' is not in price table" in process.stderr
    table = pd.read_parquet(tmp_path / "m.parquet")
    assert list(table.columns) == list(COLUMNS)
    spot_cpu = cost.resolve({"pricing": "spot"}).per_device_hour["cpu"]
    assert table.loc[0, "cost_per_1m_tokens"] == pytest.approx(spot_cpu / 3.6)
    assert pd.isna(table.loc[1, "cost_per_1m_tokens"])
    assert table.loc[0, "projected_gpu_hours"] == pytest.approx(2.0)  # 7.2M tokens at 1,000 tokens/s
    assert table.loc[0, "projected_cost"] == pytest.approx(2.0 * spot_cpu)
    assert table.loc[1, "projected_gpu_hours"] == pytest.approx(1.0)  # 72,000 samples at 20 samples/s
    assert pd.isna(table.loc[1, "projected_cost"])  # hours are known, the price is not


# ---------------------------------------------------------------------------------------------------
# Configurations, Pareto front, recommendation


def test_repeats_share_a_configuration_and_unstable_ones_are_flagged():
    runs = figures.prepare(fixture_runs("repeats")[0])
    assert runs["config_key"].nunique() == 2
    configs = report.configurations(runs).set_index("method")
    assert configs.loc["lora", "runs"] == 3 and configs.loc["lora", "tokens_per_s"] == pytest.approx(20000)
    speeds = np.array([15000, 18500, 13000])
    assert configs.loc["full", "tokens_per_s_cv"] == pytest.approx(speeds.std(ddof=1) / speeds.mean())
    assert bool(configs.loc["full", "unstable"]) is True and bool(configs.loc["lora", "unstable"]) is False
    assert "rep" not in configs.loc["full", "configuration"]


def test_configurations_on_different_gpus_are_kept_apart():
    runs = figures.prepare(fixture_runs("multi_gpu")[0])
    assert runs["config_key"].nunique() == len(runs)
    assert runs["config_label"].is_unique
    assert runs["config_label"].str.contains(" @ H100").sum() == 4


def test_pareto_front():
    points = pd.DataFrame({"cost": [1.0, 2.0, 3.0, 1.5, 4.0, 2.0], "quality": [0.70, 0.80, 0.90, 0.65, 0.85, 0.80]},
                          index=list("abcdef"))
    front = figures.pareto_front(points)
    assert list(front.index) == ["a", "b", "c"]  # d and e are dominated; f ties b and adds nothing


def test_recommendation_cheapest_per_method_and_under_constraints():
    configs = report.configurations(figures.prepare(fixture_runs("normal")[0]))
    result = report.recommend(configs)
    assert result["basis"] == "cost"
    per_method = result["per_method"].set_index("method")
    assert list(per_method.index) == ["full", "lora", "qlora"]
    assert "r8" in per_method.loc["lora", "configuration"]  # r8 is faster than r16, so cheaper
    assert result["best"]["configuration"] == per_method["cost_per_1m_tokens"].idxmin() or result["best"]["method"] == "lora"
    best = report.recommend(configs, min_accuracy=0.87)["best"]
    assert best["method"] in ("full", "lora") and best["accuracy"] >= 0.87
    assert "r16" in best["configuration"]  # lora r16 (0.88) is cheaper than full (0.90)
    best = report.recommend(configs, min_accuracy=0.87, max_memory_mb=15000)["best"]
    assert best is None
    best = report.recommend(configs, max_memory_mb=15000)["best"]
    assert best["method"] == "qlora"


def test_recommendation_without_prices_ranks_by_throughput():
    runs, _ = fixture_runs("normal")
    runs["cost_per_1m_tokens"] = pd.NA
    result = report.recommend(report.configurations(figures.prepare(runs)))
    assert result["basis"] == "throughput"
    assert result["per_method"].set_index("method").loc["lora", "tokens_per_s"] == 22000


def test_language_model_runs_use_token_accuracy():
    runs = figures.prepare(fixture_runs("lm")[0])
    quality, name = figures.quality_column(runs)
    assert name == "eval token accuracy"
    assert quality.tolist() == pytest.approx([0.42, 0.40, 0.39])
    mixed = figures.prepare(pd.concat([fixture_runs("lm")[0], fixture_runs("single")[0]], ignore_index=True))
    assert figures.quality_column(mixed)[1] == "eval accuracy (token accuracy for LM runs)"


def test_gpu_capacity_from_the_gpu_table():
    assert figures.gpu_capacity_mb(H100) == pytest.approx(80 * 1024)
    assert figures.gpu_capacity_mb("Some Future GPU") is None
    assert figures.gpu_capacity_mb(None) is None


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
    for spec in figures.FIGURES:
        if spec.name in drawn:
            assert html_escape(spec.caption) in page
    assert not re.search(r'(src|href)="(https?:)?//', page)
    assert "<h2 id=\"environment\">" in page and "abc1234" in page


def html_escape(text: str) -> str:
    import html

    return html.escape(text, quote=True)


def test_report_with_repeats(tmp_path):
    runs, written, page = build(tmp_path, "repeats")
    assert len(runs_table_rows(page)) == 6
    assert "Unstable:" in page and "CV of tokens/s over 3 repeats" in page
    assert not isinstance(written["throughput"], str)


def test_report_all_oom(tmp_path):
    runs, written, page = build(tmp_path, "all_oom", min_accuracy=0.5)
    assert all(isinstance(result, str) for result in written.values()), written
    assert images(page) == []
    assert page.count("left out,") == len(figures.FIGURES)
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
    assert sum(not isinstance(r, str) for r in written.values()) == len(figures.FIGURES)


def test_report_cli(tmp_path):
    runs, steps = fixture_runs("normal")
    metrics, files = write_fixture(tmp_path, runs, steps)
    process = subprocess.run(
        [sys.executable, "-m", "ftbench", "report", "--metrics", str(metrics), "--steps", *map(str, files),
         "--figures", str(tmp_path / "figures"), "--html", str(tmp_path / "report.html"),
         "--recommend", json.dumps({"min_accuracy": 0.85})],
        capture_output=True, text=True, check=False,
    )
    assert process.returncode == 0, process.stderr
    assert "figure scaling: every GPU run used the same number of GPUs" in process.stdout
    assert "Cheapest meeting accuracy &ge; 0.85" in (tmp_path / "report.html").read_text()


# ---------------------------------------------------------------------------------------------------
# compare


def test_compare_across_gpus_and_nodes(tmp_path):
    a_rows = _normal(0, H100, "h100-a") + [make_run(9, "lora", lora_rank=32, tokens_per_s=20000, host="h100-a")]
    b_rows = _normal(0, H100, "h100-b", speed=1.08)   # the same H100 configurations on another node, 8% faster
    c_rows = _normal(0, A100, "a100-a", speed=0.5)    # and on an A100
    paths = []
    for name, rows in (("siteA", a_rows), ("siteB", b_rows), ("siteC", c_rows)):
        frame = collect.typed(pd.DataFrame(rows, columns=list(COLUMNS)))
        frame, _ = cost.add_costs(frame, cost.resolve({"pricing": "spot"}), warn=False)  # each set priced its own way
        path = tmp_path / name / "results" / "metrics.parquet"
        path.parent.mkdir(parents=True)
        collect.typed(frame).to_parquet(path)
        paths.append(path)
    result = compare.compare([(None, p) for p in paths], tmp_path / "out", prices=cost.resolve())
    assert result["sets"] == 3 and result["runs"] == 13
    merged = pd.read_parquet(tmp_path / "out" / "compare.parquet")
    assert list(merged.columns) == [compare.SET_COLUMN, *COLUMNS]
    assert set(merged[compare.SET_COLUMN]) == {"siteA", "siteB", "siteC"}
    # re-priced with one table (on-demand), not each set's spot prices
    assert (merged.loc[merged["gpu_model"] == "H100 SXM", "price_per_device_hour"] == 2.99).all()

    devices = result["across_devices"]
    lora = devices[devices["configuration"] == "m-d-lora-r8-bf16-b16-s512"].set_index("device")
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
        capture_output=True, text=True, check=False,
    )
    assert process.returncode == 0, process.stderr
    assert "lacks 12 column(s)" in process.stderr
    merged = pd.read_parquet(tmp_path / "out" / "compare.parquet")
    assert set(merged[compare.SET_COLUMN]) == {"first", "second"}
    assert merged["cost_per_1m_tokens"].notna().all()  # re-priced, so the old set has costs too
    page = (tmp_path / "out" / "compare.html").read_text()
    assert "Node-to-node variation above" not in page
    assert "every configuration ran on one device model only" in page


def test_compare_rejects_what_is_not_a_result_set(tmp_path):
    with pytest.raises(FtbenchError, match="not found"):
        compare.merge([(None, tmp_path / "missing.parquet")])
    pd.DataFrame({"x": [1]}).to_parquet(tmp_path / "other.parquet")
    with pytest.raises(FtbenchError, match="not an ftbench metrics table"):
        compare.merge([(None, tmp_path / "other.parquet")])


# ---------------------------------------------------------------------------------------------------
# Config keys: prices and recommend


def _base_config() -> dict:
    return yaml.safe_load((ROOT / "config" / "config.yaml").read_text())


def test_default_config_has_valid_prices_and_recommend_keys():
    config = _base_config()
    ftbench_config.validate_config(config)
    assert cost.resolve(config.get("prices")).provider


@pytest.mark.parametrize(
    ("section", "message"),
    [
        ({"prices": {"provder": "x"}}, "config key prices.provder: unknown key"),
        ({"prices": {"pricing": "reserved"}}, "config key prices.pricing: 'reserved' is not allowed"),
        ({"prices": {"per_device_hour": {"H100 SXM": -1}}}, "config key prices.per_device_hour.H100 SXM: -1 is out of range"),
        ({"recommend": {"min_accuracy": 1.5}}, "config key recommend.min_accuracy: 1.5 is out of range"),
        ({"recommend": {"max_memory": 1}}, "config key recommend.max_memory: unknown key"),
    ],
)
def test_prices_and_recommend_keys_are_strict(section, message):
    config = copy.deepcopy(_base_config())
    config.update(section)
    with pytest.raises(ConfigError, match=re.escape(message)):
        ftbench_config.validate_config(config)


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
    table.write_text((ROOT / "config" / "prices.yaml").read_text(encoding="utf-8"), encoding="utf-8")
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
        assert " ".join(figures.caption(name).split()[:6]) in text, name
