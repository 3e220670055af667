"""What a run costs, from its measured throughput and a price table (config/prices.yaml, passed in by the caller).

Computed at ``collect`` time, so editing a price re-runs collect and report and never retrains. The
conventions, stated once:

- A run pays for the devices it holds: the GPUs that trained together (``world_size``; every GPU of a
  dp/ddp/fsdp run, on every node of a multi-node one), one GPU for a single-GPU run, and the whole machine
  (one "device", priced per hour in the table's ``cpu`` entry) for a CPU run. ``price_per_hour`` = $ per device-hour x billed devices.
- $ per 1M tokens = price_per_hour / (tokens_per_s x 3600) x 1e6, with the global (all devices)
  throughput of the measured window in real, unpadded tokens, prompts included. $ per 1M trained tokens likewise
  from trained_tokens_per_s (instruction data: the completion tokens the loss is computed on; null where trained
  tokens are not counted apart). $ per 1k samples likewise from samples_per_s.
- Training budget: projected wall hours (``projected_hours``, from the measurement issue's projection
  when the table has it, else budget tokens / tokens_per_s), GPU-hours = wall hours x billed devices,
  $ = GPU-hours x $ per device-hour.
- Energy cost (only where NVML measured ``energy_j``; null on CPUs): J per token x tokens / 3.6e6 J per
  kWh x electricity $ per kWh. It covers the GPU boards only (no host, cooling or PUE).
- A GPU that matches no entry of the price table, or whose entry has no price for the chosen provider
  and pricing, gets a warning and null costs: never a guessed price.
"""

from __future__ import annotations

import re
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import pandas as pd

from ftbench.report.analysis import is_missing
from ftbench.errors import ConfigError
from ftbench.runspec import RunSpec

# The price table when a caller names none: relative to the working directory, the repository root where
# Snakemake and `python -m ftbench` run.
DEFAULT_PRICES_TABLE = Path("config/prices.yaml")
PRICINGS = ("on_demand", "spot")
CPU_MODEL = "cpu"
J_PER_KWH = 3.6e6

# The cost block of the Parquet table (documented in columns.py), in the order written there.
COST_COLUMNS = (
    "gpu_model", "billed_devices", "price_per_device_hour", "price_per_hour", "price_source",
    "cost_per_1m_tokens", "cost_per_1m_trained_tokens", "cost_per_1k_samples", "cost_per_1k_images", "projected_gpu_hours", "projected_cost",
    "energy_cost_per_1m_tokens", "projected_energy_cost",
)


@dataclass
class Prices:
    """One price list: $ per device-hour by model name for the chosen provider and pricing."""

    table_path: str
    provider: str
    pricing: str
    models: list[dict]  # [{name, match}] in match order
    per_device_hour: dict[str, float]
    electricity_per_kwh: float | None
    overridden: set[str] = field(default_factory=set)

    @property
    def label(self) -> str:
        return f"{self.provider}/{self.pricing}"

    def model_for(self, device: str | None, device_name: str | None) -> str | None:
        """The table's model name for a run's device, or None when no entry matches."""
        if device == "cpu":
            return CPU_MODEL
        for entry in self.models:
            pattern = entry.get("match")
            if pattern and re.search(pattern, device_name or "", flags=re.IGNORECASE):
                return entry["name"]
        return None


def load_table(path: str | Path) -> dict:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config key prices.table: price table {path} not found")
    from ftbench.experiment.config import load_yaml  # syntax errors and duplicate keys as one line naming the file

    table = load_yaml(path)
    problems = _table_problems(table)
    if problems:
        raise ConfigError(f"price table {path}: {problems}")
    return table


def _table_problems(table: Any) -> str | None:
    if not isinstance(table, dict) or not isinstance(table.get("models"), list) or not isinstance(table.get("providers"), dict):
        return "expected the keys models (a list of {name, match}) and providers (provider -> on_demand/spot -> model -> $)"
    names = [entry.get("name") for entry in table["models"] if isinstance(entry, dict)]
    if len(names) != len(table["models"]) or not all(isinstance(name, str) for name in names):
        return "every models entry needs a name"
    for entry in table["models"]:
        if entry.get("match") is not None:
            if not isinstance(entry["match"], str):
                return f"models entry {entry['name']!r}: match {entry['match']!r} must be a regular expression (text)"
            try:
                re.compile(entry["match"])
            except re.error as exc:
                return f"models entry {entry['name']!r}: match {entry['match']!r} is not a regular expression ({exc})"
    for provider, pricings in table["providers"].items():
        if not isinstance(pricings, dict):
            return f"providers.{provider}: expected on_demand and/or spot price lists"
        for pricing, prices in pricings.items():
            if pricing not in PRICINGS:
                return f"providers.{provider}.{pricing}: unknown pricing; expected one of {', '.join(PRICINGS)}"
            for model, price in (prices or {}).items():
                if model not in names:
                    return f"providers.{provider}.{pricing}.{model}: not a model of the table; models: {', '.join(names)}"
                if price is not None and (not isinstance(price, (int, float)) or price < 0):
                    return f"providers.{provider}.{pricing}.{model}: expected a price >= 0 or null, got {price!r}"
    electricity = table.get("electricity_per_kwh")
    if electricity is not None and (isinstance(electricity, bool) or not isinstance(electricity, (int, float)) or electricity < 0):
        return f"electricity_per_kwh: expected a price per kWh >= 0 or null, got {electricity!r}"
    return None


def resolve(settings: dict | None = None, default_table: str | Path = DEFAULT_PRICES_TABLE) -> Prices:
    """The prices of an experiment: its ``prices`` config key (all optional) over the table's defaults."""
    settings = settings or {}
    table_path = settings.get("table") or default_table
    table = load_table(table_path)
    providers = table["providers"]
    provider = settings.get("provider") or table.get("default_provider")
    if provider is None and len(providers) == 1:
        provider = next(iter(providers))
    if provider is None:  # choosing one of several would be a guess
        raise ConfigError(f"config key prices.provider: price table {table_path} has providers "
                          f"{', '.join(repr(name) for name in providers)} and no default_provider; choose one")
    if provider not in providers:
        raise ConfigError(
            f"config key prices.provider: {provider!r} is not in price table {table_path}; "
            f"expected one of {', '.join(repr(name) for name in providers)}"
        )
    pricing = settings.get("pricing") or table.get("default_pricing") or "on_demand"
    if pricing not in PRICINGS:
        raise ConfigError(f"config key prices.pricing: {pricing!r} is not allowed; expected one of {', '.join(map(repr, PRICINGS))}")
    per_hour = {name: float(price) for name, price in (providers[provider].get(pricing) or {}).items() if price is not None}
    names = [entry["name"] for entry in table["models"]]
    overrides = settings.get("per_device_hour") or {}
    if not per_hour and not overrides:  # every cost would be empty
        has = [name for name in PRICINGS if (providers[provider] or {}).get(name)]
        raise ConfigError(f"config key prices.pricing: provider {provider!r} of price table {table_path} has no "
                          f"{pricing} prices, so every cost would be empty; expected "
                          f"{' or '.join(map(repr, has)) if has else 'a provider with prices'}")
    for name, price in overrides.items():
        if name not in names:
            raise ConfigError(
                f"config key prices.per_device_hour.{name}: not a model of price table {table_path}; "
                f"expected one of {', '.join(repr(n) for n in names)}"
            )
        per_hour[name] = float(price)
    electricity = settings.get("electricity_per_kwh")
    if electricity is None:
        electricity = table.get("electricity_per_kwh")
    return Prices(
        table_path=str(table_path),
        provider=provider,
        pricing=pricing,
        models=table["models"],
        per_device_hour=per_hour,
        electricity_per_kwh=float(electricity) if electricity is not None else None,
        overridden=set(overrides),
    )


# ---------------------------------------------------------------------------------------------------
# Formulas (one per quantity, each pinned by a unit test)


def billed_devices(row: Mapping[str, Any]) -> int:
    """Devices a run (one row of the run table) pays for: its GPUs that trained together, as RunSpec.devices
    counts them (every GPU of a dp/ddp/fsdp run, on every node of a multi-node one; one otherwise); 1 for a
    CPU machine. The run's recorded world_size where it has one, else the same count from its settings."""
    if row.get("device") == "cpu":
        return 1
    world_size = row.get("world_size")
    if not is_missing(world_size) and int(world_size) >= 1:
        return int(world_size)
    given = {name: row.get(name) for name in ("parallel", "num_gpus", "num_nodes")}
    return int(RunSpec().replace(**{name: value for name, value in given.items() if not is_missing(value)}).devices)


def cost_per_1m_tokens(price_per_hour: float | None, tokens_per_s: float | None) -> float | None:
    if not _positive(price_per_hour, allow_zero=True) or not _positive(tokens_per_s):
        return None
    return price_per_hour / (tokens_per_s * 3600.0) * 1e6


def cost_per_1k_samples(price_per_hour: float | None, samples_per_s: float | None) -> float | None:
    if not _positive(price_per_hour, allow_zero=True) or not _positive(samples_per_s):
        return None
    return price_per_hour / (samples_per_s * 3600.0) * 1e3


def budget_hours(budget: dict | None, tokens_per_s: float | None, samples_per_s: float | None) -> float | None:
    """Wall hours for a budget of ``tokens`` or ``samples`` (x ``epochs``, default 1) at the measured rate."""
    if not budget:
        return None
    epochs = float(budget.get("epochs") or 1)
    if budget.get("tokens") is not None and _positive(tokens_per_s):
        return float(budget["tokens"]) * epochs / tokens_per_s / 3600.0
    if budget.get("samples") is not None and _positive(samples_per_s):
        return float(budget["samples"]) * epochs / samples_per_s / 3600.0
    return None


def energy_cost(energy_j_per_token: float | None, tokens: float | None, per_kwh: float | None) -> float | None:
    """Electricity $ of ``tokens`` tokens at the measured J per token."""
    if not _positive(energy_j_per_token, allow_zero=True) or not _positive(tokens, allow_zero=True) or per_kwh is None:
        return None
    return energy_j_per_token * tokens / J_PER_KWH * per_kwh


def _positive(value: Any, allow_zero: bool = False) -> bool:
    if is_missing(value):
        return False
    return value >= 0 if allow_zero else value > 0


# ---------------------------------------------------------------------------------------------------
# The table


def run_costs(row: dict, prices: Prices, budget: dict | None = None) -> tuple[dict, str | None]:
    """(cost columns of one run, a warning or None). ``row`` is one row of the run table."""
    out = dict.fromkeys(COST_COLUMNS)
    device = row.get("device")
    if is_missing(device):
        return out, None  # never started (unsupported before choosing a device): nothing to price
    devices = billed_devices(row)
    out["billed_devices"] = devices
    model = prices.model_for(device, row.get("device_name"))
    out["gpu_model"] = model
    warning = None
    if model is None:
        out["price_source"] = f"no entry of the price table matches {row.get('device_name')!r}: cost left empty"
        warning = (f"run {row.get('run_id')}: GPU {row.get('device_name')!r} is not in price table "
                   f"{prices.table_path}; its cost is left empty (add it to the table's models and prices)")
    elif model not in prices.per_device_hour:
        out["price_source"] = f"no {prices.label} price for {model}: cost left empty"
        warning = (f"run {row.get('run_id')}: price table {prices.table_path} has no {prices.label} price for "
                   f"{model}; its cost is left empty")
    else:
        unit = prices.per_device_hour[model]
        out["price_per_device_hour"] = unit
        out["price_per_hour"] = unit * devices
        where = "experiment config prices.per_device_hour" if model in prices.overridden else f"{Path(prices.table_path).name} {prices.label}"
        out["price_source"] = f"{model} at ${unit:g}/device-hour ({where})"
        out["cost_per_1m_tokens"] = cost_per_1m_tokens(out["price_per_hour"], row.get("tokens_per_s"))
        out["cost_per_1m_trained_tokens"] = cost_per_1m_tokens(out["price_per_hour"], row.get("trained_tokens_per_s"))
        out["cost_per_1k_samples"] = cost_per_1k_samples(out["price_per_hour"], row.get("samples_per_s"))
        out["cost_per_1k_images"] = cost_per_1k_samples(out["price_per_hour"], row.get("images_per_s"))  # same arithmetic

    hours = row.get("projected_hours")
    if is_missing(hours):
        hours = budget_hours(budget, row.get("tokens_per_s"), row.get("samples_per_s"))
    if not is_missing(hours):
        out["projected_gpu_hours"] = hours * devices
        if not is_missing(out["price_per_device_hour"]):
            out["projected_cost"] = out["projected_gpu_hours"] * out["price_per_device_hour"]

    per_token = row.get("energy_j_per_token")
    if not is_missing(per_token):
        out["energy_cost_per_1m_tokens"] = energy_cost(per_token, 1e6, prices.electricity_per_kwh)
        if not is_missing(hours) and _positive(row.get("tokens_per_s")):
            out["projected_energy_cost"] = energy_cost(per_token, row["tokens_per_s"] * hours * 3600.0, prices.electricity_per_kwh)
    return out, warning


def add_costs(frame: pd.DataFrame, prices: Prices, budget: dict | list | None = None,
              warn: bool = True) -> tuple[pd.DataFrame, list[str]]:
    """The run table with its cost columns filled in; plus the warnings (one per unpriced run).
    ``budget``: one training budget for every run, or a list with one per row."""
    frame = frame.copy()
    budgets = budget if isinstance(budget, list) else [budget] * len(frame)
    rows, warnings_list = [], []
    for record, run_budget in zip(frame.to_dict("records"), budgets):
        values, warning = run_costs({k: (None if is_missing(v) else v) for k, v in record.items()}, prices, run_budget)
        rows.append(values)
        if warning:
            warnings_list.append(warning)
            if warn:
                warnings.warn(warning, stacklevel=2)
    costs = pd.DataFrame(rows, columns=list(COST_COLUMNS), index=frame.index)
    for name in COST_COLUMNS:
        frame[name] = costs[name]
    return frame, warnings_list
