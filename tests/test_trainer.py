"""The training loop on a tiny BERT for a few steps on the CPU (scripts/ftbench/train/trainer.py train_run).

Each run is 6 optimizer steps of 8 examples (2 warmup + 4 measured), then evaluation on 50 examples:
about a second each. Results are shared per module so every assertion does not retrain.
"""

from __future__ import annotations

import math
import shutil

import numpy as np
import pandas as pd
import pytest
import torch

from ftbench.tasks import registry
from ftbench.report import collect
from ftbench.data import batch_order, prepared
from ftbench.measure import environment
from ftbench.experiment import matrix
from ftbench.train import trainer
from ftbench.report.columns import COLUMNS
from ftbench.errors import ManifestError

TOTAL_STEPS = 6
WARMUP = 2
BATCH = 8
LR = 0.001
LR_WARMUP = 2

CUDA = torch.cuda.is_available()
GPUS = torch.cuda.device_count() if CUDA else 0


@pytest.fixture(scope="module")
def make_spec(tiny_config_factory):
    """``make_spec(**settings)``: the single run spec of a tiny config with these settings."""

    def make(**settings) -> dict:
        defaults = {
            "method": "lora",
            "precision": "fp32",
            "batch_size": BATCH,
            "seq_len": 32,
            "lora_rank": 4,
            "lora_targets": ["query", "value"],
            "learning_rate": LR,
            "lr_warmup_steps": LR_WARMUP,
            "max_steps": TOTAL_STEPS,
            "warmup_steps": WARMUP,
            "eval_batch_size": 64,
            **settings,
        }
        config = tiny_config_factory(defaults=defaults, matrix={"model": ["tiny"], "dataset": ["tiny"]})
        runs = matrix.expand_runs(config)
        assert len(runs) == 1
        return runs[0]

    return make


@pytest.fixture(scope="module")
def trained(make_spec, prepared_data):
    """{method: (spec, metrics, steps)} for full, lora and qlora, trained once for this module."""
    torch.set_num_threads(2)
    folder, _ = prepared_data
    results = {}
    for method in ("full", "lora", "qlora"):
        spec = make_spec(method=method)
        metrics, steps = trainer.train_run(spec, folder)
        results[method] = (spec, metrics, steps)
    return results


METHODS = ["full", "lora", "qlora"]


@pytest.mark.slow
@pytest.mark.parametrize("method", METHODS)
def test_run_completes_with_the_planned_steps(trained, method):
    spec, metrics, steps = trained[method]
    assert metrics["status"] == "ok", metrics.get("status_reason")
    assert metrics["run_id"] == spec.run_id
    assert metrics["total_steps"] == TOTAL_STEPS
    assert metrics["warmup_steps"] == WARMUP
    assert metrics["measured_steps"] == TOTAL_STEPS - WARMUP
    assert [record["step"] for record in steps] == list(range(TOTAL_STEPS))
    assert [record["measured"] for record in steps] == [False] * WARMUP + [True] * (TOTAL_STEPS - WARMUP)
    if not CUDA:
        assert metrics["device"] == "cpu"
        assert "CPU" in metrics["status_reason"]  # a 1-GPU run that fell back says so
        assert metrics["world_size"] == 1


@pytest.mark.slow
@pytest.mark.parametrize("method", METHODS)
def test_tokens_are_counted_without_padding(trained, method, prepared_data):
    spec, metrics, steps = trained[method]
    folder, manifest = prepared_data
    train_split = registry.load_split(folder, "train", manifest)
    lengths = np.array([len(ids) for ids in train_split.input_ids])
    # The same seeded batch order the loop used: each step's real tokens are the stored lengths.
    order = list(batch_order.batch_order(len(train_split), BATCH, TOTAL_STEPS, spec.seed))
    for record, indices in zip(steps, order):
        assert record["samples"] == BATCH
        assert record["tokens"] == int(lengths[indices].sum())
        assert record["padded_tokens"] == int(lengths[indices].max()) * BATCH
    assert any(record["tokens"] < record["padded_tokens"] for record in steps)  # padding existed...
    measured = [record for record in steps if record["measured"]]
    assert metrics["measured_tokens"] == sum(record["tokens"] for record in measured)  # ...and was not counted
    padded = sum(record["padded_tokens"] for record in measured)
    assert metrics["padding_fraction"] == pytest.approx(1 - metrics["measured_tokens"] / padded)
    assert 0 < metrics["padding_fraction"] < 1


@pytest.mark.slow
@pytest.mark.parametrize("method", METHODS)
def test_throughput_comes_from_the_measured_window(trained, method):
    _, metrics, steps = trained[method]
    measured = [record for record in steps if record["measured"]]
    times = [record["step_time_s"] for record in measured]
    assert all(t > 0 for t in times)
    assert metrics["measured_time_s"] == pytest.approx(sum(times), rel=1e-6)  # warmup steps are not in it
    assert metrics["tokens_per_s"] == pytest.approx(metrics["measured_tokens"] / metrics["measured_time_s"])
    assert metrics["samples_per_s"] == pytest.approx(BATCH * len(measured) / metrics["measured_time_s"])
    assert metrics["tokens_per_s_per_device"] == pytest.approx(metrics["tokens_per_s"] / metrics["world_size"])
    assert metrics["step_time_median_s"] == pytest.approx(float(np.median(times)))
    assert metrics["step_time_p90_s"] >= metrics["step_time_median_s"]
    assert metrics["train_time_s"] >= metrics["measured_time_s"]
    assert metrics["wall_time_s"] >= metrics["train_time_s"]
    assert metrics["peak_rss_mb"] > 50  # torch alone is more than that
    if not CUDA:
        assert metrics.get("peak_memory_allocated_mb") is None  # no CUDA figure is invented on a CPU


@pytest.mark.slow
@pytest.mark.parametrize("method", METHODS)
def test_evaluation_and_losses(trained, method):
    _, metrics, steps = trained[method]
    assert metrics["eval_samples"] == 50
    assert 0.0 <= metrics["eval_accuracy"] <= 1.0
    assert math.isfinite(metrics["eval_loss"]) and metrics["eval_loss"] > 0
    assert metrics["final_train_loss"] == steps[-1]["loss"]
    assert all(math.isfinite(record["loss"]) for record in steps)


@pytest.mark.slow
@pytest.mark.parametrize("method", METHODS)
def test_learning_rate_warms_up_then_decays(trained, method):
    _, _, steps = trained[method]
    factors = [0.5, 1.0, 1.0, 0.75, 0.5, 0.25]  # 2 warmup steps, then linear decay to 0 at step 6
    assert [record["lr"] for record in steps] == pytest.approx([LR * f for f in factors])


@pytest.mark.slow
def test_parameter_counts(trained):
    full, lora, qlora = (trained[m][1] for m in METHODS)
    assert full["trainable_params"] == full["total_params"] > 1_000_000
    assert 0 < lora["trainable_params"] < 0.05 * lora["total_params"]
    # LoRA adds its adapters to the full model's count
    assert lora["total_params"] > full["total_params"]
    # QLoRA: the same adapters; 4-bit weights counted as the values they stand for, not packed bytes
    assert qlora["trainable_params"] == lora["trainable_params"]
    assert qlora["total_params"] == lora["total_params"]


@pytest.mark.slow
def test_full_fine_tuning_changes_the_loss(trained):
    _, _, steps = trained["full"]
    assert len({round(record["loss"], 6) for record in steps}) > 1


@pytest.mark.slow
def test_same_seed_same_losses_other_seed_other_batches(make_spec, prepared_data, trained):
    folder, _ = prepared_data
    _, _, reference = trained["lora"]
    _, again = trainer.train_run(make_spec(method="lora"), folder)
    assert [r["loss"] for r in again] == pytest.approx([r["loss"] for r in reference], rel=1e-5)
    _, other = trainer.train_run(make_spec(method="lora", seed=1), folder)
    assert [r["tokens"] for r in other] != [r["tokens"] for r in reference]


@pytest.mark.slow
def test_bf16_autocast_runs_on_cpu(make_spec, prepared_data):
    metrics, steps = trainer.train_run(make_spec(method="lora", precision="bf16"), prepared_data[0])
    assert metrics["status"] == "ok", metrics.get("status_reason")
    assert metrics["measured_steps"] == TOTAL_STEPS - WARMUP
    assert all(math.isfinite(record["loss"]) for record in steps)


# ---------------------------------------------------------------------------------------------------
# What this machine cannot run becomes status "unsupported" with a reason, not a crash


def assert_unsupported(metrics: dict, steps: list, *reason_words: str) -> None:
    assert metrics["status"] == "unsupported"
    reason = metrics["status_reason"]
    assert isinstance(reason, str) and reason and "\n" not in reason
    for word in reason_words:
        assert word in reason, reason
    assert steps == []
    assert metrics.get("eval_accuracy") is None
    assert metrics.get("tokens_per_s") is None
    assert metrics["wall_time_s"] >= 0


@pytest.mark.skipif(CUDA, reason="fp16 is supported where a CUDA GPU is visible")
def test_fp16_on_cpu_is_unsupported(make_spec, prepared_data):
    metrics, steps = trainer.train_run(make_spec(method="lora", precision="fp16"), prepared_data[0])
    assert_unsupported(metrics, steps, "fp16")


@pytest.mark.skipif(GPUS >= 2, reason="needs a machine with fewer than 2 GPUs")
def test_ddp_without_gpus_is_unsupported(make_spec, prepared_data):
    metrics, steps = trainer.train_run(make_spec(method="lora", parallel="ddp", num_gpus=2), prepared_data[0])
    assert_unsupported(metrics, steps)


@pytest.mark.skipif(GPUS >= 2, reason="needs a machine with fewer than 2 GPUs")
def test_two_gpu_run_on_a_cpu_machine_is_unsupported(make_spec, prepared_data):
    metrics, steps = trainer.train_run(make_spec(method="full", parallel="dp", num_gpus=2), prepared_data[0])
    assert_unsupported(metrics, steps, "2 GPUs")


# ---------------------------------------------------------------------------------------------------
# Prepared data is verified before training starts


def test_tampered_data_is_refused_before_training(make_spec, prepared_data, tmp_path):
    folder = tmp_path / "tampered"
    shutil.copytree(prepared_data[0], folder)
    shard = folder / prepared.read_manifest(folder)["splits"]["train"]["shards"][0]["file"]
    raw = bytearray(shard.read_bytes())
    raw[len(raw) // 3] ^= 0x80
    shard.write_bytes(bytes(raw))
    with pytest.raises(ManifestError, match=shard.name):
        trainer.train_run(make_spec(method="lora"), folder)


# ---------------------------------------------------------------------------------------------------
# collect: real run results into the documented table


@pytest.mark.slow
def test_collect_builds_the_documented_table(trained, make_spec, prepared_data, tmp_path):
    import json

    files = []
    results = [trained[m] for m in METHODS]
    unsupported_spec = make_spec(method="lora", parallel="dp", num_gpus=2)
    results.append((unsupported_spec, *trainer.train_run(unsupported_spec, prepared_data[0])))
    env = environment.capture()
    for index, (spec, metrics, _) in enumerate(results):
        path = tmp_path / f"run{index}" / "metrics.json"
        path.parent.mkdir()
        path.write_text(json.dumps({"spec": spec.to_dict(), "metrics": metrics, "environment": env}, default=str))
        files.append(path)
    frame = collect.collect(files, tmp_path / "metrics.parquet", tmp_path / "metrics.csv")

    assert list(frame.columns) == list(COLUMNS)
    assert len(frame) == 4
    read = pd.read_parquet(tmp_path / "metrics.parquet")
    assert list(read.columns) == list(COLUMNS)
    assert read["run_id"].tolist() == [spec.run_id for spec, _, _ in results]
    assert pd.read_csv(tmp_path / "metrics.csv")["run_id"].tolist() == read["run_id"].tolist()

    ok = read[read["status"] == "ok"]
    assert len(ok) == 3 and set(ok["method"]) == set(METHODS)
    assert ok["tokens_per_s"].gt(0).all() and ok["eval_accuracy"].between(0, 1).all()
    assert ok.loc[ok["method"] == "full", "lora_rank"].isna().all()  # null, not 0, for full fine-tuning
    if not CUDA:
        assert (ok["peak_memory_mb"] == ok["peak_rss_mb"]).all()  # the CPU memory figure is the RSS
        assert ok["peak_memory_reserved_mb"].isna().all()
    failed = read[read["status"] == "unsupported"].iloc[0]
    assert pd.isna(failed["tokens_per_s"]) and pd.isna(failed["eval_accuracy"])  # null, never 0
    assert failed["status_reason"]
