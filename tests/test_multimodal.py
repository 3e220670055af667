"""Image tasks (data/images.py, tasks/image_classification.py): data preparation from every supported source, batching,
the run checks, throughput counts, and one tiny image experiment end to end through snakemake.

Models are ViTs built from a config (no pip package ships vision weights); the real images are the UCI
8x8 handwritten digits that scikit-learn ships (requirements-assets.txt).
"""

from __future__ import annotations

import importlib.util

import numpy as np
import pandas as pd
import pytest
import torch

from ftbench.tasks import registry
from ftbench.experiment import config as config_module, matrix
from ftbench.report import cost
from ftbench.data import prepared, images
from ftbench.measure import metrics
from ftbench.errors import ConfigError

from conftest import png_bytes, write_image_folder

TINY_VIT = {"kind": "config", "architecture": "ViTConfig",
            "overrides": {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 128,
                          "patch_size": 4, "image_size": 16}}
VIT_DEF = {"task": "image_classification", "source": TINY_VIT}
DIGITS_SOURCE = {"kind": "package", "package": "sklearn", "path": "datasets/data/digits.csv.gz"}
DIGITS_DEF = {"source": DIGITS_SOURCE, "pixels": {"height": 8, "width": 8, "max_value": 16}}
has_digits = pytest.mark.skipif(importlib.util.find_spec("sklearn") is None,
                                reason="scikit-learn (requirements-assets.txt) ships the digits")
IMAGE_DEFAULTS = {"method": "full", "precision": "fp32", "batch_size": 8, "seq_len": 32, "max_steps": 4,
                  "warmup_steps": 1, "learning_rate": 0.002, "device": "cpu", "num_gpus": 0, "eval_batch_size": 64,
                  "image_size": 16, "lora_rank": 4, "lora_targets": ["q_proj", "v_proj"]}


def image_rows(count: int = 24) -> pd.DataFrame:
    return pd.DataFrame({"file": [f"img{index}.png" for index in range(count)],
                         "label": ["cat" if index % 3 else "dog" for index in range(count)]})


@pytest.fixture(scope="module")
def image_folder(tmp_path_factory):
    """A folder of PNG files and a labels.csv naming them (paths relative to the folder)."""
    return write_image_folder(tmp_path_factory.mktemp("images"), image_rows(), "labels.csv")


def image_dataset(folder, **extra) -> dict:
    return {"source": {"kind": "path", "path": str(folder / "labels.csv")}, "image_column": "file",
            "label_column": "label", "train_size": 16, "eval_size": 8, **extra}


def prepare(dataset_def: dict, out, image_size: int | None = 16, **model) -> dict:
    return registry.prepare("imgs", dataset_def, {**VIT_DEF, **model}, 32, out, 128, "vit", image_size)


def experiment(dataset_def: dict, **defaults) -> dict:
    return {"models": {"vit": VIT_DEF}, "datasets": {"imgs": dataset_def},
            "defaults": {**IMAGE_DEFAULTS, **defaults}, "matrix": {"model": ["vit"], "dataset": ["imgs"]}}


# ---------------------------------------------------------------------------------------------------
# Preparation from each source


def test_decode_reads_paths_bytes_image_dicts_and_arrays(tmp_path):
    raw = png_bytes(0)
    (tmp_path / "a.png").write_bytes(raw)
    grey = np.arange(64, dtype=np.uint8).reshape(8, 8)
    for value, folder in ((raw, None), ("a.png", tmp_path), ({"bytes": raw, "path": None}, None), (grey, None)):
        pixels = images.decode(value, 16, folder)
        assert pixels.shape == (16, 16, 3) and pixels.dtype == np.uint8
    # a grey image becomes RGB with equal channels
    same = images.decode(grey, 8, None)
    assert (same[..., 0] == grey).all() and (same[..., 1] == same[..., 2]).all()


def test_folder_of_images_with_a_label_csv(tmp_path, image_folder):
    manifest = prepare(image_dataset(image_folder), tmp_path)
    assert manifest["task"] == "image_classification" and manifest["image_size"] == 16
    assert manifest["label_names"] == ["cat", "dog"]
    assert {name: split["rows"] for name, split in manifest["splits"].items()} == {"train": 16, "eval": 8}
    # ViT patch 4 at 16 pixels: 16 patches + the class token
    assert manifest["image_tokens_per_image"] == 17
    assert manifest["splits"]["train"]["tokens"] == 16 * 17
    split = registry.load_split(tmp_path, "train", prepared.verify(tmp_path))
    assert split.pixels.shape == (16, 16, 16, 3) and split.pixels.dtype == np.uint8


def test_image_paths_are_read_from_image_folder_when_given(tmp_path, image_folder):
    moved = tmp_path / "labels"
    moved.mkdir()
    image_rows().to_csv(moved / "labels.csv", index=False)
    dataset_def = image_dataset(moved, image_folder=str(image_folder))
    assert prepare(dataset_def, tmp_path / "out")["splits"]["eval"]["rows"] == 8
    with pytest.raises(Exception, match="does not exist"):
        prepare(image_dataset(moved), tmp_path / "missing")


def test_parquet_with_image_bytes_gives_the_pixels_of_the_files(tmp_path, image_folder):
    rows = image_rows()
    rows["file"] = [(image_folder / name).read_bytes() for name in rows["file"]]
    rows.to_parquet(tmp_path / "imgs.parquet")
    from_bytes = prepare({**image_dataset(image_folder), "source": {"kind": "path", "path": str(tmp_path / "imgs.parquet")}},
                         tmp_path / "bytes")
    from_files = prepare(image_dataset(image_folder), tmp_path / "files")
    a = registry.load_split(tmp_path / "bytes", "eval", from_bytes)
    b = registry.load_split(tmp_path / "files", "eval", from_files)
    assert (a.pixels == b.pixels).all() and (a.labels == b.labels).all()


def test_save_to_disk_folder_with_an_image_feature(tmp_path, image_folder):
    import datasets

    rows = image_rows()
    table = datasets.Dataset.from_dict(
        {"img": [str(image_folder / name) for name in rows["file"]], "label": rows["label"].tolist()}
    ).cast_column("img", datasets.Image())
    table.save_to_disk(str(tmp_path / "saved"))
    dataset_def = {"source": {"kind": "path", "path": str(tmp_path / "saved")}, "image_column": "img",
                   "label_column": "label", "train_size": 16, "eval_size": 8}
    manifest = prepare(dataset_def, tmp_path / "out")
    assert manifest["splits"]["train"]["rows"] == 16


def test_synthetic_images_have_the_run_size_and_random_classes(tmp_path):
    manifest = prepare({"source": {"kind": "synthetic", "num_labels": 3}, "train_size": 20, "eval_size": 4}, tmp_path,
                       image_size=32)
    assert manifest["image_size"] == 32 and manifest["label_names"] == ["0", "1", "2"]
    assert manifest["image_tokens_per_image"] == (32 // 4) ** 2 + 1
    split = registry.load_split(tmp_path, "train", manifest)
    assert split.pixels.shape == (20, 32, 32, 3)


@pytest.fixture(scope="module")
def vit_checkpoint(tmp_path_factory):
    """The tiny ViT saved as a checkpoint folder (16 px) with an image processor of its own statistics."""
    from transformers import ViTConfig, ViTForImageClassification, ViTImageProcessor

    folder = tmp_path_factory.mktemp("vit-checkpoint")
    torch.manual_seed(0)
    # a pretraining head of 5 classes: fine-tuning on 2 makes a new head
    ViTForImageClassification(ViTConfig(**TINY_VIT["overrides"], num_labels=5)).save_pretrained(folder)
    ViTImageProcessor(image_mean=[0.4, 0.5, 0.6], image_std=[0.2, 0.25, 0.3], size={"height": 16, "width": 16}).save_pretrained(folder)
    return folder


def test_a_checkpoint_folder_brings_its_processor_statistics(tmp_path, vit_checkpoint):
    source = {"source": {"kind": "path", "path": str(vit_checkpoint)}}
    dataset_def = {"source": {"kind": "synthetic"}, "train_size": 4, "eval_size": 2}
    manifest = prepare(dataset_def, tmp_path / "same", image_size=None, **source)
    assert manifest["image_mean"] == [0.4, 0.5, 0.6] and manifest["image_std"] == [0.2, 0.25, 0.3]
    assert manifest["processor_class"] == "ViTImageProcessor"
    assert (manifest["image_size"], manifest["interpolate_pos_encoding"]) == (16, False)
    # another size than the checkpoint's: its position embeddings are interpolated
    larger = prepare(dataset_def, tmp_path / "larger", image_size=32, **source)
    assert larger["interpolate_pos_encoding"] is True and larger["image_tokens_per_image"] == 65


def test_image_size_defaults_to_the_model_config(tmp_path):
    manifest = prepare({"source": {"kind": "synthetic"}, "train_size": 4, "eval_size": 2}, tmp_path, image_size=None)
    assert manifest["image_size"] == 16


def test_pixel_rows_csv(tmp_path):
    values = np.random.default_rng(0).integers(0, 17, size=(30, 16))
    labels = np.arange(30) % 3
    pd.DataFrame(np.column_stack([values, labels])).to_csv(tmp_path / "rows.csv", header=False, index=False)
    dataset_def = {"source": {"kind": "path", "path": str(tmp_path / "rows.csv")},
                   "pixels": {"height": 4, "width": 4, "max_value": 16}, "train_size": 21, "eval_size": 9}
    manifest = prepare(dataset_def, tmp_path / "out", image_size=4)
    assert manifest["label_names"] == ["0", "1", "2"]
    split = registry.load_split(tmp_path / "out", "train", manifest)
    # 16 is the brightest: scaled to 255; every channel equal (grey)
    assert split.pixels.max() <= 255 and (split.pixels[..., 0] == split.pixels[..., 2]).all()
    wrong = {**dataset_def, "pixels": {"height": 5, "width": 4}}
    with pytest.raises(ConfigError, match="pixels"):
        prepare(wrong, tmp_path / "wrong", image_size=4)


@has_digits
def test_the_digits_scikit_learn_ships(tmp_path):
    manifest = prepare({**DIGITS_DEF, "train_size": 1400, "eval_size": 397}, tmp_path)
    assert manifest["label_names"] == [str(digit) for digit in range(10)]
    assert manifest["splits"]["train"]["rows"] + manifest["splits"]["eval"]["rows"] == 1797
    # uint8 storage: 1,797 images of 16 x 16 x 3 bytes stay well under a megabyte of shards
    assert sum(shard["bytes"] for split in manifest["splits"].values() for shard in split["shards"]) < 1_500_000


# ---------------------------------------------------------------------------------------------------
# Batching and counting


def test_disk_and_memory_splits_give_the_same_batches(tmp_path, image_folder):
    manifest = prepare(image_dataset(image_folder), tmp_path)
    indices = np.array([5, 0, 15, 3])
    memory = registry.family("image_classification").collate(registry.load_split(tmp_path, "train", manifest), indices, None)
    disk = registry.family("image_classification").collate(registry.load_split(tmp_path, "train", manifest, "disk"), indices, None)
    assert memory.inputs["pixel_values"].dtype == torch.uint8  # bytes until the batch reaches its device
    memory, disk = memory.to(torch.device("cpu")), disk.to(torch.device("cpu"))
    assert (memory.inputs["pixel_values"] == disk.inputs["pixel_values"]).all()
    assert (memory.inputs["labels"] == disk.inputs["labels"]).all()
    assert memory.inputs["pixel_values"].shape == (4, 3, 16, 16)
    # mean 0.5, std 0.5: pixels land in [-1, 1]
    assert memory.inputs["pixel_values"].min() >= -1 and memory.inputs["pixel_values"].max() <= 1
    assert (memory.images, memory.image_tokens, memory.real_tokens, memory.padded_tokens) == (4, 68, 68, 68)


def test_throughput_separates_images_image_tokens_and_text_tokens():
    steps = [{"measured": False, "images": 8, "image_tokens": 136, "tokens": 136},
             {"measured": True, "images": 8, "image_tokens": 136, "tokens": 136},
             {"measured": True, "images": 8, "image_tokens": 136, "tokens": 136}]
    figures = metrics.image_throughput(steps, 2.0, devices=2)
    assert figures == {"measured_images": 16, "images_per_s": 8.0, "images_per_s_per_device": 4.0,
                       "image_tokens_per_s": 136.0, "text_tokens_per_s": 0.0}
    assert metrics.image_throughput(steps, None, 1) == {}
    text_steps = [{"measured": True, "tokens": 136}]
    assert metrics.image_throughput(text_steps, 2.0, 1) == {}  # a text run has no image columns


def test_ranks_images_add_up_like_their_tokens():
    def rank(index: int, images: int) -> dict:
        steps = [{"step": step, "measured": step > 0, "step_time_s": 1.0 + index, "loader_s": 0.0, "samples": images,
                  "tokens": images * 17, "padded_tokens": images * 17, "flops": 1, "loss": 1.0, "lr": 0.1,
                  "images": images, "image_tokens": images * 17} for step in range(3)]
        return {"rank": index, "steps": steps, "metrics": {"status": "ok", "window_s": 2.0 + index}}

    merged, steps = metrics.merge_ranks([rank(0, 4), rank(1, 4)], devices=2)
    assert merged["measured_images"] == 2 * 2 * 4  # two measured steps, two ranks
    assert merged["images_per_s"] == pytest.approx(16 / 3.0)  # over the slowest rank's window
    assert merged["images_per_s_per_device"] == pytest.approx(16 / 3.0 / 2)
    assert merged["image_tokens_per_s"] == pytest.approx(merged["tokens_per_s"]) and merged["text_tokens_per_s"] == 0


def test_cost_per_1k_images_next_to_samples_and_tokens():
    prices = cost.Prices("prices.yaml", "cloud", "on-demand", [{"name": "h100", "match": "H100"}], {"h100": 3.6}, None)
    out, _ = cost.run_costs({"run_id": "r", "device": "cuda", "device_name": "H100", "world_size": 1,
                             "samples_per_s": 100.0, "images_per_s": 100.0, "tokens_per_s": 1700.0}, prices)
    assert out["cost_per_1k_images"] == pytest.approx(3.6 / 360) == out["cost_per_1k_samples"]
    text, _ = cost.run_costs({"run_id": "t", "device": "cuda", "device_name": "H100", "world_size": 1,
                              "samples_per_s": 100.0, "tokens_per_s": 1700.0}, prices)
    assert text["cost_per_1k_images"] is None


# ---------------------------------------------------------------------------------------------------
# Config checks and data ids


def test_image_size_is_part_of_the_data_id_and_the_run_name(image_folder):
    config = experiment(image_dataset(image_folder))
    config["matrix"]["image_size"] = [16, 32]
    runs = matrix.expand_runs(config)
    assert len({run.data_id for run in runs}) == 2
    assert [run.data_id.split("-")[2] for run in runs] == ["i16", "i32"]
    assert all(f"i{run.image_size}" in run.run_id for run in runs)
    preparations = matrix.data_preparations(runs)
    assert sorted(job["image_size"] for job in preparations.values()) == [16, 32]
    for run in runs:
        config_module.check_run(run, config)


def test_the_time_estimate_counts_image_tokens_not_seq_len(image_folder):
    from ftbench.cluster import resources

    config = experiment(image_dataset(image_folder))
    config["matrix"]["image_size"] = [16, 32]
    small, large = matrix.expand_runs(config)
    # 17 and 65 tokens per image (patch 4), whatever seq_len is
    assert resources.train_compute_seconds(large) / resources.train_compute_seconds(small) == pytest.approx(65 / 17)


def test_text_runs_refuse_image_size():
    config = experiment({"source": {"kind": "synthetic"}}, image_size=64)
    config["models"]["vit"] = {"task": "causal_lm", "source": {"kind": "config", "architecture": "LlamaConfig",
                                                               "overrides": {"vocab_size": 128}}}
    run = matrix.expand_runs(config)[0]
    with pytest.raises(ConfigError, match="image_size.*reads no images"):
        config_module.check_run(run, config)


def test_image_runs_need_an_image_column(image_folder):
    dataset_def = image_dataset(image_folder)
    del dataset_def["image_column"]
    config = experiment(dataset_def)
    with pytest.raises(ConfigError, match=r"datasets\.imgs\.image_column"):
        config_module.check_run(matrix.expand_runs(config)[0], config)


def test_image_runs_refuse_packing_with_the_reason(image_folder):
    with pytest.raises(ConfigError, match=r"batching 'pack' is not supported .*no padding to remove"):
        config_module.validate_config(experiment(image_dataset(image_folder), batching="pack"))


def test_example_multimodal():
    import yaml

    from conftest import ROOT

    config = yaml.safe_load((ROOT / "config" / "examples" / "multimodal.yaml").read_text())
    config_module.validate_config(config)
    runs = matrix.expand_runs(config)
    assert len(runs) == 3 + 4 + 4 + 4  # ViT matrix + ViT includes + CLIP + LLaVA
    assert {run.method for run in runs if run.model == "vit_base"} == {"full", "lora", "qlora"}
    assert {run.method for run in runs if run.model == "clip_b32"} == {"full", "lora", "qlora"}
    assert {run.method for run in runs if run.model == "llava_small"} == {"full", "lora", "qlora"}
    assert {run.image_size for run in runs} == {224, 384, 32, 16}
    # 224 and 384 prepared apart, the digits once per task (labels, captions, questions), the synthetic
    # pairs once, the VLM's synthetic rows once
    assert len({run.data_id for run in runs}) == 7
    assert {run.model_def["task"] for run in runs} == {"image_classification", "image_text_retrieval", "vision_language"}


# ---------------------------------------------------------------------------------------------------
# Training (slow)


def train(tmp_path, dataset_def: dict, **defaults):
    from ftbench.train import trainer

    config = experiment(dataset_def, **defaults)
    spec = matrix.expand_runs(config)[0]
    config_module.check_run(spec, config)
    registry.prepare(spec.dataset, spec.dataset_def, spec.model_def, spec.seq_len, tmp_path, 128, spec.model, spec.image_size)
    return trainer.train_run(spec, tmp_path)


@pytest.mark.slow
def test_the_hf_trainer_engine_sees_the_loops_normalised_images(tmp_path, image_folder):
    """engine hf_trainer on an image run: the same normalised pixels (the same first loss from the same
    weights and batch), and its images counted as the loop counts them."""
    loop, loop_steps = train(tmp_path / "loop", image_dataset(image_folder))
    hf, hf_steps = train(tmp_path / "hf", image_dataset(image_folder), engine="hf_trainer")
    assert hf["status"] == "ok", hf["status_reason"]
    assert hf_steps[0]["loss"] == pytest.approx(loop_steps[0]["loss"], rel=1e-4)
    assert hf["measured_images"] == loop["measured_images"] == 3 * 8
    assert hf["images_per_s"] == pytest.approx(hf["samples_per_s"])
    assert 0 <= hf["eval_accuracy"] <= 1


@pytest.mark.slow
@pytest.mark.parametrize("method", ["full", "lora"])
def test_training_reports_images_and_image_tokens(tmp_path, image_folder, method):
    metrics, steps = train(tmp_path, image_dataset(image_folder), method=method)
    assert metrics["status"] == "ok", metrics["status_reason"]
    assert metrics["images_per_s"] == pytest.approx(metrics["samples_per_s"])
    assert metrics["image_tokens_per_s"] == pytest.approx(metrics["tokens_per_s"]) and metrics["text_tokens_per_s"] == 0
    assert metrics["measured_images"] == 3 * 8 and all(step["image_tokens"] == 8 * 17 for step in steps)
    assert 0 <= metrics["eval_accuracy"] <= 1 and metrics["eval_samples"] == 8
    assert metrics["memory_estimate_mb"] > 0
    # the analytic FLOPs (vision tower's Linear layers + attention) against torch's counter: the patch
    # embedding convolution is the known gap
    assert 0.7 < metrics["flops_counted_ratio"] < 1.2
    if method == "lora":
        assert metrics["trainable_params"] < metrics["total_params"]


@pytest.mark.slow
def test_lora_on_a_checkpoint_at_another_image_size(tmp_path, image_folder, vit_checkpoint):
    from ftbench.train import trainer

    config = experiment(image_dataset(image_folder), method="lora", image_size=24)
    config["models"]["vit"] = {"task": "image_classification", "source": {"kind": "path", "path": str(vit_checkpoint)}}
    spec = matrix.expand_runs(config)[0]
    registry.prepare(spec.dataset, spec.dataset_def, spec.model_def, spec.seq_len, tmp_path, 128, spec.model, spec.image_size)
    metrics, steps = trainer.train_run(spec, tmp_path)
    assert metrics["status"] == "ok", metrics["status_reason"]
    assert steps[0]["image_tokens"] == 8 * ((24 // 4) ** 2 + 1)


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("bitsandbytes") is None, reason="bitsandbytes not installed")
def test_qlora_trains_a_vision_encoder(tmp_path):
    overrides = {**TINY_VIT["overrides"], "hidden_size": 64}
    dataset_def = {"source": {"kind": "synthetic", "num_labels": 2}, "train_size": 32, "eval_size": 8}
    from ftbench.train import trainer

    config = experiment(dataset_def, method="qlora", max_steps=3)
    config["models"]["vit"] = {**VIT_DEF, "source": {**TINY_VIT, "overrides": overrides}}
    spec = matrix.expand_runs(config)[0]
    registry.prepare(spec.dataset, spec.dataset_def, spec.model_def, spec.seq_len, tmp_path, 128, spec.model, spec.image_size)
    metrics, _ = trainer.train_run(spec, tmp_path)
    assert metrics["status"] == "ok", metrics["status_reason"]


@pytest.mark.slow
@has_digits
def test_a_vision_encoder_learns_the_digits(tmp_path):
    """Quality path on real images: a ViT trained from scratch beats chance (0.1) by far in 150 steps."""
    metrics, _ = train(tmp_path, {**DIGITS_DEF, "train_size": 1400, "eval_size": 397}, batch_size=32, max_steps=150,
                       warmup_steps=2, learning_rate=0.002)
    assert metrics["status"] == "ok"
    assert metrics["eval_accuracy"] > 0.4, metrics["eval_accuracy"]


@pytest.mark.slow
def test_image_experiment_through_snakemake(tmp_path, snakemake_runner, config_writer, image_folder):
    """A config-built ViT fully fine-tuned on the image folder and LoRA-tuned on synthetic images: both runs
    ok, the image columns filled, and the report written."""
    config = experiment(image_dataset(image_folder))
    config["datasets"]["synth"] = {"source": {"kind": "synthetic", "num_labels": 4}, "train_size": 32, "eval_size": 8}
    config["matrix"] = {"model": ["vit"], "dataset": ["imgs", "synth"]}
    config["overrides"] = [{"when": {"dataset": "synth"}, "set": {"method": "lora"}}]
    config_writer(tmp_path, config)
    process = snakemake_runner(tmp_path, timeout=300)
    assert process.returncode == 0, process.stderr[-4000:]
    table = pd.read_parquet(tmp_path / "results" / "metrics.parquet")
    assert len(table) == 2 and (table["status"] == "ok").all(), table[["run_id", "status_reason"]]
    assert sorted(table["method"]) == ["full", "lora"]
    assert (table["task"] == "image_classification").all()
    for column in ("images_per_s", "image_tokens_per_s", "memory_estimate_mb", "eval_accuracy"):
        assert table[column].notna().all() and (table[column] >= 0).all(), column
    assert (tmp_path / "results" / "report.html").is_file()


@pytest.mark.slow
def test_ddp_image_run_sums_the_ranks_images(tmp_path, image_folder):
    """Two gloo ranks on the CPU, through the train command as the rule runs it: each rank's images count once."""
    import json
    import subprocess
    import sys

    config = experiment(image_dataset(image_folder), parallel="ddp", num_gpus=2, device="cpu", batch_size=4)
    spec = matrix.expand_runs(config)[0]
    config_module.check_run(spec, config)
    data_dir = tmp_path / "data"
    registry.prepare(spec.dataset, spec.dataset_def, spec.model_def, spec.seq_len, data_dir, 128, spec.model, spec.image_size)
    out = tmp_path / "run" / "metrics.json"
    out.parent.mkdir()
    process = subprocess.run([sys.executable, "-m", "ftbench", "train", "--spec", spec.to_json(), "--data", str(data_dir),
                              "--out", str(out), "--threads", "2"], capture_output=True, text=True, timeout=300)
    assert process.returncode == 0, process.stderr[-3000:]
    row = json.loads(out.read_text())["metrics"]
    assert row["status"] == "ok", row["status_reason"]
    assert row["world_size"] == 2
    # 3 measured steps (4 steps, 1 warmup) x 2 ranks x 4 images, 17 image tokens each (16 patches + class token)
    assert row["measured_images"] == 3 * 2 * 4
    assert row["images_per_s"] == pytest.approx(row["samples_per_s"])
    assert row["image_tokens_per_s"] == pytest.approx(row["tokens_per_s"])
    assert row["images_per_s_per_device"] == pytest.approx(row["images_per_s"] / 2)
    assert 0 <= row["eval_accuracy"] <= 1
