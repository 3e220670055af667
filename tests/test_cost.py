"""Cost (scripts/ftbench/report/cost.py): the formulas, the price table and its settings, collect's costed table.

Price tables are passed in, as the rules and the commands do: the repository's config/prices.yaml unless
a test writes its own.
"""

from __future__ import annotations

import copy
import json
import re
import subprocess
import sys

import pandas as pd
import pytest
import yaml

from ftbench.experiment import config as ftbench_config
from ftbench.report import cost
from ftbench.report.columns import COLUMNS
from ftbench.errors import ConfigError
from test_report import CPU_NAME, PRICES_TABLE, ROOT, UNPRICED, fixture_runs, make_run, prices

# ---------------------------------------------------------------------------------------------------
# Formulas


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
    cloud = prices({"provider": "gpu_cloud", "pricing": "on_demand"})
    row = make_run(1, "full", parallel="ddp", num_gpus=4, tokens_per_s=40000.0)
    values, warning = cost.run_costs(row, cloud)
    assert warning is None
    assert values["gpu_model"] == "H100 SXM" and values["billed_devices"] == 4
    assert values["price_per_hour"] == pytest.approx(4 * 2.99)
    # global tokens/s with all 4 GPUs' price; the per-device rate with 4 prices would be 4x too high
    assert values["cost_per_1m_tokens"] == pytest.approx(4 * 2.99 / (40000 * 3600) * 1e6)
    assert values["cost_per_1k_samples"] == pytest.approx(4 * 2.99 / (100 * 3600) * 1e3)


def billed(device, world_size, num_gpus, parallel, num_nodes=None) -> int:
    return cost.billed_devices(dict(device=device, world_size=world_size, num_gpus=num_gpus, parallel=parallel,
                                    num_nodes=num_nodes))


def test_billed_devices():
    assert billed("cpu", 1, 1, "single") == 1
    assert billed("cpu", 1, 4, "ddp") == 1  # a CPU run pays for the machine
    assert billed("cuda", 1, 1, "single") == 1
    assert billed("cuda", 2, 2, "dp") == 2
    assert billed("cuda", None, 4, "ddp") == 4
    assert billed("cuda", None, 4, "single") == 1  # trains on one of them
    assert billed("cuda", None, None, None) == 1  # nothing recorded: a single-GPU run


@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_a_multi_node_run_pays_for_every_gpu_of_every_node(parallel):
    # 2 nodes x 4 GPUs: 8 GPUs held, with or without the recorded world size
    assert billed("cuda", None, 4, parallel, num_nodes=2) == 8
    assert billed("cuda", 8, 4, parallel, num_nodes=2) == 8
    assert billed("cuda", None, 4, parallel, num_nodes=1) == 4
    assert billed("cuda", None, 1, parallel, num_nodes=4) == 4  # one GPU on each of 4 nodes
    assert billed("cuda", pd.NA, 4, parallel, num_nodes=pd.NA) == 4  # nulls of the parquet table: one node


def test_fsdp_without_a_recorded_world_size_pays_for_all_its_gpus():
    assert billed("cuda", None, 4, "fsdp") == 4
    assert billed("cuda", None, 2, "dp", num_nodes=1) == 2


def test_a_two_node_fsdp_run_is_priced_for_8_gpus():
    cloud = prices({"provider": "gpu_cloud", "pricing": "on_demand"})
    row = make_run(1, "full", parallel="fsdp", num_gpus=4, num_nodes=2, tokens_per_s=80000.0)
    row["world_size"] = None  # the settings alone say what it held
    values, warning = cost.run_costs(row, cloud)
    assert warning is None and values["billed_devices"] == 8
    assert values["price_per_hour"] == pytest.approx(8 * 2.99)  # H100 SXM on demand, $2.99 per GPU-hour
    # 8 x $2.99 = $23.92 an hour over 80,000 tokens/s (288M tokens an hour): $0.08306 per 1M tokens
    assert values["cost_per_1m_tokens"] == pytest.approx(23.92 / 288.0)


def test_cpu_runs_are_priced_per_machine_hour():
    price_list = prices()
    values, warning = cost.run_costs(make_run(1, device_name=CPU_NAME, tokens_per_s=1000.0), price_list)
    assert warning is None and values["gpu_model"] == "cpu"
    assert values["cost_per_1m_tokens"] == pytest.approx(price_list.per_device_hour["cpu"] / 3.6)


def test_gpu_missing_from_the_price_table_warns_and_gets_no_cost():
    runs, _ = fixture_runs("normal")
    runs.loc[0, "device_name"] = UNPRICED
    priced, warnings = cost.add_costs(runs, prices(), warn=False)
    assert len(warnings) == 1 and UNPRICED in warnings[0] and "price table" in warnings[0]
    assert priced.loc[0, ["price_per_hour", "cost_per_1m_tokens", "projected_cost"]].isna().all()
    assert pd.isna(priced.loc[0, "gpu_model"]) and "no entry" in priced.loc[0, "price_source"]
    assert priced.loc[1:, "cost_per_1m_tokens"].notna().all()
    with pytest.warns(UserWarning, match="not in price table"):
        cost.add_costs(runs, prices())


def test_model_without_a_price_for_the_provider_gets_no_cost():
    price_list = prices({"provider": "hyperscaler", "pricing": "spot"})
    values, warning = cost.run_costs(make_run(1, device_name="NVIDIA GeForce RTX 4090"), price_list)
    assert values["gpu_model"] == "RTX 4090" and values["cost_per_1m_tokens"] is None
    assert "hyperscaler/spot" in warning


def test_provider_pricing_and_overrides(tmp_path):
    row = make_run(1, tokens_per_s=10000.0)
    spot = cost.run_costs(row, prices({"pricing": "spot"}))[0]
    on_demand = cost.run_costs(row, prices({"pricing": "on_demand"}))[0]
    assert spot["price_per_device_hour"] < on_demand["price_per_device_hour"]
    hyper = cost.run_costs(row, prices({"provider": "hyperscaler"}))[0]
    table = yaml.safe_load(PRICES_TABLE.read_text())
    assert hyper["price_per_device_hour"] == table["providers"]["hyperscaler"]["on_demand"]["H100 SXM"]
    override = cost.run_costs(row, prices({"per_device_hour": {"H100 SXM": 1.0}}))[0]
    assert override["cost_per_1m_tokens"] == pytest.approx(1.0 / (10000 * 3600) * 1e6)
    assert "prices.per_device_hour" in override["price_source"]
    # a table of one's own
    own = tmp_path / "prices.yaml"
    own.write_text(yaml.safe_dump({"models": [{"name": "any", "match": "."}, {"name": "cpu", "match": None}],
                                   "providers": {"mine": {"on_demand": {"any": 7.0}}}}))
    mine = cost.run_costs(row, prices({"table": str(own)}))[0]
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
        prices(settings)


def test_the_default_price_table_is_read_from_the_working_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match=re.escape("price table config/prices.yaml not found")):
        cost.resolve()
    monkeypatch.chdir(ROOT)
    assert cost.resolve().per_device_hour == prices().per_device_hour


def test_broken_price_table_is_reported(tmp_path):
    bad = tmp_path / "prices.yaml"
    bad.write_text(yaml.safe_dump({"models": [{"name": "x", "match": "("}], "providers": {}}))
    with pytest.raises(ConfigError, match="not a regular expression"):
        prices({"table": str(bad)})
    bad.write_text(yaml.safe_dump({"models": [{"name": "x", "match": "x"}], "providers": {"p": {"on_demand": {"y": 1}}}}))
    with pytest.raises(ConfigError, match=r"providers.p.on_demand.y: not a model"):
        prices({"table": str(bad)})


def test_budget_projection_gpu_hours_and_cost():
    # 1e9 tokens x 2 epochs at 10,000 tokens/s = 55.6 wall hours; on 4 GPUs 222 GPU-hours
    assert cost.budget_hours({"tokens": 1e9, "epochs": 2}, 10000.0, 25.0) == pytest.approx(2e9 / 1e4 / 3600)
    assert cost.budget_hours({"samples": 1e6}, 10000.0, 25.0) == pytest.approx(1e6 / 25 / 3600)
    assert cost.budget_hours(None, 10000.0, 25.0) is None
    price_list = prices({"per_device_hour": {"H100 SXM": 2.0}})
    row = make_run(1, parallel="ddp", num_gpus=4, tokens_per_s=10000.0)
    values, _ = cost.run_costs(row, price_list, budget={"tokens": 1e9, "epochs": 2})
    hours = 2e9 / 1e4 / 3600
    assert values["projected_gpu_hours"] == pytest.approx(4 * hours)
    assert values["projected_cost"] == pytest.approx(4 * hours * 2.0)
    # the measurement's own projection (column projected_hours) wins over the budget given here
    row["projected_hours"] = 10.0
    values, _ = cost.run_costs(row, price_list, budget={"tokens": 1e9})
    assert values["projected_gpu_hours"] == pytest.approx(40.0) and values["projected_cost"] == pytest.approx(80.0)


def test_energy_cost_from_joules_per_token():
    # 0.5 J/token x 1M tokens = 500 kJ = 0.1389 kWh; at $0.15/kWh = $0.0208
    assert cost.energy_cost(0.5, 1e6, 0.15) == pytest.approx(0.5e6 / 3.6e6 * 0.15)
    price_list = prices({"electricity_per_kwh": 0.30})
    row = make_run(1, tokens_per_s=10000.0)
    values, _ = cost.run_costs(row, price_list, budget={"tokens": 3.6e7})  # one hour at 10,000 tokens/s
    assert values["energy_cost_per_1m_tokens"] == pytest.approx(row["energy_j_per_token"] * 1e6 / 3.6e6 * 0.30)
    assert values["projected_energy_cost"] == pytest.approx(row["energy_j_per_token"] * 3.6e7 / 3.6e6 * 0.30)
    cpu_values, _ = cost.run_costs(make_run(2, device_name=CPU_NAME), price_list)
    assert cpu_values["energy_cost_per_1m_tokens"] is None  # no NVML on a CPU: null, not 0


def test_runs_without_a_device_or_throughput_get_no_cost():
    price_list = prices()
    unsupported, warning = cost.run_costs(make_run(1, status="unsupported", tokens_per_s=None), price_list)
    assert warning is None and all(v is None for v in unsupported.values())
    oom, _ = cost.run_costs(make_run(2, status="oom", tokens_per_s=None), price_list)
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
         str(tmp_path / "m.csv"), "--prices-table", str(PRICES_TABLE), "--price-settings", json.dumps({"pricing": "spot"}),
         "--budget", json.dumps({"samples": 72000}), *map(str, files)],
        capture_output=True, text=True, check=False,
    )
    assert process.returncode == 0, process.stderr
    assert f"warning: run run1: GPU '{UNPRICED}' is not in price table" in process.stderr
    table = pd.read_parquet(tmp_path / "m.parquet")
    assert list(table.columns) == list(COLUMNS)
    spot_cpu = prices({"pricing": "spot"}).per_device_hour["cpu"]
    assert table.loc[0, "cost_per_1m_tokens"] == pytest.approx(spot_cpu / 3.6)
    assert pd.isna(table.loc[1, "cost_per_1m_tokens"])
    assert table.loc[0, "projected_gpu_hours"] == pytest.approx(2.0)  # 7.2M tokens at 1,000 tokens/s
    assert table.loc[0, "projected_cost"] == pytest.approx(2.0 * spot_cpu)
    assert table.loc[1, "projected_gpu_hours"] == pytest.approx(1.0)  # 72,000 samples at 20 samples/s
    assert pd.isna(table.loc[1, "projected_cost"])  # hours are known, the price is not


# ---------------------------------------------------------------------------------------------------
# Config keys: prices and recommend


def _base_config() -> dict:
    return yaml.safe_load((ROOT / "config" / "config.yaml").read_text())


def test_default_config_has_valid_prices_and_recommend_keys():
    config = _base_config()
    ftbench_config.validate_config(config)
    assert prices(config.get("prices")).provider


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


