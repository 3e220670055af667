"""Task vision_language (vision_language.py): a LLaVA model built from a config (CLIP vision tower + Llama
language model, random weights) with the MiniLM tokenizer (a pip package ships it; the image placeholder is
added to it). Real images: scikit-learn's 8x8 digits, asked "What digit is this?" and answered with the
digit's word (no pip package ships a real image + caption or question set).
"""

from __future__ import annotations

import importlib.util

import numpy as np
import pandas as pd
import pytest
import torch

from conftest import MINILM_SOURCE, write_image_folder
from ftbench.tasks import registry
from ftbench.tasks.base import Batch, IGNORE_INDEX
from ftbench.data import tokenizers
from ftbench.tasks import vision_language as vision_language_family
from ftbench.experiment import config as config_module, matrix
from ftbench.data import prepared
from ftbench.measure import flops
from ftbench.train import modeling
from ftbench.errors import ConfigError

VISION = {"model_type": "clip_vision_model", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
          "num_attention_heads": 4, "image_size": 16, "patch_size": 4}
TEXT = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256}
TINY_LLAVA = {"kind": "config", "architecture": "LlavaConfig", "tokenizer": MINILM_SOURCE,
              "overrides": {"vision_config": VISION, "text_config": TEXT}}
LLAVA_DEF = {"task": "vision_language", "source": TINY_LLAVA}
DIGIT_WORDS = "zero one two three four five six seven eight nine".split()
DIGITS_QA = {"source": {"kind": "package", "package": "sklearn", "path": "datasets/data/digits.csv.gz"},
             "pixels": {"height": 8, "width": 8, "max_value": 16}, "prompt": "What digit is this?",
             "answers": DIGIT_WORDS, "train_size": 200, "eval_size": 50}
has_digits = pytest.mark.skipif(importlib.util.find_spec("sklearn") is None,
                                reason="scikit-learn (requirements-assets.txt) ships the digits")
VLM_DEFAULTS = {"method": "full", "precision": "fp32", "batch_size": 8, "seq_len": 16, "max_steps": 4,
                "warmup_steps": 1, "learning_rate": 0.002, "device": "cpu", "num_gpus": 0, "eval_batch_size": 32,
                "image_size": 16, "lora_rank": 4, "lora_targets": ["q_proj", "v_proj"]}
# 16 px / patch 4 = 16 patches; the CLIP class token is dropped by vision_feature_select_strategy 'default'
IMAGE_TOKENS = 16


@pytest.fixture(scope="module")
def qa_folder(tmp_path_factory):
    """PNG files and a qa.csv naming file, question and answer (paths relative to the folder)."""
    rows = pd.DataFrame([{"file": f"img{index}.png", "question": f"what colour is square {index}?",
                          "answer": "red" if index % 2 else "blue green"} for index in range(24)])
    return write_image_folder(tmp_path_factory.mktemp("vqa"), rows, "qa.csv")


def qa_dataset(folder, **extra) -> dict:
    return {"source": {"kind": "path", "path": str(folder / "qa.csv")}, "image_column": "file",
            "prompt_column": "question", "answer_column": "answer", "train_size": 16, "eval_size": 8, **extra}


def experiment(dataset_def: dict, **defaults) -> dict:
    return {"models": {"llava": LLAVA_DEF}, "datasets": {"vqa": dataset_def},
            "defaults": {**VLM_DEFAULTS, **defaults}, "matrix": {"model": ["llava"], "dataset": ["vqa"]}}


def first_run(config: dict):
    config_module.validate_config(config)
    return matrix.expand_runs(config)[0]


def prepare_run(spec, out):
    return registry.prepare(spec.dataset, spec.dataset_def, spec.model_def, spec.seq_len, out, 128, spec.model, spec.image_size)


def tokenizer():
    return tokenizers.load_tokenizer({"source": MINILM_SOURCE})


# ---------------------------------------------------------------------------------------------------
# Preparation and batches


def test_shards_round_trip_with_labels_on_the_answer_only(tmp_path, qa_folder):
    spec = first_run(experiment(qa_dataset(qa_folder)))
    manifest = prepare_run(spec, tmp_path)
    assert manifest["task"] == "vision_language" and manifest["image_tokens_per_image"] == IMAGE_TOKENS
    assert manifest["vision_tokens_per_image"] == IMAGE_TOKENS + 1  # the tower also processes its class token
    # the MiniLM tokenizer has no image placeholder: it was added after its 30,522 tokens
    assert manifest["image_token_id"] == 30522 and manifest["vocab_size"] == 30523
    assert {name: split["rows"] for name, split in manifest["splits"].items()} == {"train": 16, "eval": 8}
    memory = registry.load_split(tmp_path, "eval", prepared.verify(tmp_path))
    disk = registry.load_split(tmp_path, "eval", manifest, "disk")
    order = np.array([5, 0, 7, 2])
    batch = registry.family("vision_language").collate(memory, order, manifest["pad_token_id"])
    from_disk = registry.family("vision_language").collate(disk, order, manifest["pad_token_id"])
    for key in ("pixel_values", "input_ids", "labels", "attention_mask"):
        assert torch.equal(batch.inputs[key], from_disk.inputs[key]), key
    ids, labels, mask = batch.inputs["input_ids"], batch.inputs["labels"], batch.inputs["attention_mask"]
    words = tokenizer()
    source = pd.read_csv(qa_folder / "qa.csv").set_index("question")
    for row in range(len(order)):
        sequence = ids[row][mask[row] == 1]
        assert int((sequence == 30522).sum()) == IMAGE_TOKENS and bool((sequence[:IMAGE_TOKENS] == 30522).all())
        answer = labels[row][labels[row] != IGNORE_INDEX]
        # the scored tokens are the answer and the end token, the last ones of the sequence
        assert torch.equal(answer, sequence[-len(answer):])
        question = words.decode(sequence[IMAGE_TOKENS:-len(answer)])
        assert words.decode(answer, skip_special_tokens=True) == source.loc[question, "answer"]
        assert answer[-1] == words.sep_token_id
    # padding is neither a real token nor scored; image and text tokens counted apart
    assert batch.real_tokens == int(mask.sum()) < batch.padded_tokens
    assert (batch.images, batch.image_tokens, batch.vision_tokens) == (4, 4 * IMAGE_TOKENS, 4 * (IMAGE_TOKENS + 1))
    assert (labels[mask == 0] == IGNORE_INDEX).all()


@pytest.mark.parametrize("form", ["parquet_bytes", "save_to_disk"])
def test_parquet_image_bytes_and_saved_image_features_give_the_folders_rows(tmp_path, qa_folder, form):
    import datasets

    rows = pd.read_csv(qa_folder / "qa.csv")
    if form == "parquet_bytes":
        rows["file"] = [(qa_folder / name).read_bytes() for name in rows["file"]]
        rows.to_parquet(tmp_path / "qa.parquet")
        location = tmp_path / "qa.parquet"
    else:
        rows["file"] = [str(qa_folder / name) for name in rows["file"]]
        datasets.Dataset.from_pandas(rows).cast_column("file", datasets.Image()).save_to_disk(str(tmp_path / "saved"))
        location = tmp_path / "saved"
    other = prepare_run(first_run(experiment({**qa_dataset(qa_folder), "source": {"kind": "path", "path": str(location)}})),
                        tmp_path / "other")
    files = prepare_run(first_run(experiment(qa_dataset(qa_folder))), tmp_path / "files")
    a, b = (registry.load_split(tmp_path / name, "train", manifest) for name, manifest in (("other", other), ("files", files)))
    assert (a.pixels == b.pixels).all() and all((x == y).all() for x, y in zip(a.input_ids, b.input_ids))


@has_digits
def test_the_digits_become_questions_with_the_digit_word_as_answer(tmp_path):
    spec = first_run(experiment(DIGITS_QA))
    manifest = prepare_run(spec, tmp_path)
    split = registry.load_split(tmp_path, "train", manifest)
    words = tokenizer()
    answers = {words.decode(labels[labels != IGNORE_INDEX], skip_special_tokens=True) for labels in split.labels}
    assert answers == set(DIGIT_WORDS)
    assert words.decode(split.input_ids[0][IMAGE_TOKENS:IMAGE_TOKENS + 5]) == "what digit is this?"
    with pytest.raises(ConfigError, match=r"datasets\.vqa\.answers: 9 answers.*class 9 occurs"):
        prepare_run(first_run(experiment({**DIGITS_QA, "answers": DIGIT_WORDS[:9]})), tmp_path / "short")


def test_synthetic_rows_have_a_prompt_then_a_scored_answer(tmp_path):
    dataset_def = {"source": {"kind": "synthetic", "target_len": 4}, "train_size": 8, "eval_size": 4}
    spec = first_run(experiment(dataset_def))
    manifest = prepare_run(spec, tmp_path)
    assert manifest["splits"]["train"]["text_tokens"] == 8 * 16
    split = registry.load_split(tmp_path, "train", manifest)
    for ids, labels in zip(split.input_ids, split.labels):
        assert len(ids) == IMAGE_TOKENS + 16 and int((ids == manifest["image_token_id"]).sum()) == IMAGE_TOKENS
        assert (labels[:-4] == IGNORE_INDEX).all() and (labels[-4:] == ids[-4:]).all()


# ---------------------------------------------------------------------------------------------------
# The model: image tokens, LoRA placement, FLOPs


def built(tmp_path, **defaults):
    spec = first_run(experiment({"source": {"kind": "synthetic"}, "train_size": 8, "eval_size": 4}, **defaults))
    manifest = prepare_run(spec, tmp_path)
    torch.manual_seed(0)
    return spec, manifest, modeling.build_model(spec, None, torch.device("cpu"), manifest["pad_token_id"]).model


@pytest.mark.parametrize("vision, strategy", [("clip_vision_model", "default"), ("clip_vision_model", "full"),
                                              ("siglip_vision_model", "full")])
def test_image_tokens_are_the_features_the_model_inserts(tmp_path, vision, strategy):
    overrides = {"vision_config": {**VISION, "model_type": vision}, "text_config": TEXT,
                 "vision_feature_select_strategy": strategy}
    config = experiment({"source": {"kind": "synthetic"}, "train_size": 8, "eval_size": 4}, image_size=24)
    config["models"]["llava"] = {**LLAVA_DEF, "source": {**TINY_LLAVA, "overrides": overrides}}
    spec = first_run(config)
    manifest = prepare_run(spec, tmp_path)
    model = modeling.build_model(spec, None, torch.device("cpu"), manifest["pad_token_id"]).model
    features = model.get_image_features(pixel_values=torch.zeros(2, 3, 24, 24), return_dict=True).pooler_output
    per_image = features[0].shape[0] if isinstance(features, (list, tuple)) else features.shape[1]
    assert manifest["image_tokens_per_image"] == per_image
    # the parse-time reading of the config (resource estimates) agrees
    assert vision_language_family.vision_language_image_tokens(overrides, 24) == per_image
    # and a batch of the prepared rows goes through the model (LLaVA checks the placeholder count)
    batch = registry.family("vision_language").collate(registry.load_split(tmp_path, "train", manifest), np.arange(2),
                             manifest["pad_token_id"]).to("cpu")
    assert torch.isfinite(model(**batch.inputs).loss)


def test_lora_adapts_the_language_model_and_the_projector_only_when_named(tmp_path):
    _, _, model = built(tmp_path / "a", method="lora")
    adapted = {name.rsplit(".lora_A", 1)[0] for name, _ in model.named_modules() if name.endswith(".lora_A")}
    assert adapted and all(".language_model." in name and name.endswith(("q_proj", "v_proj")) for name in adapted)
    # the vision tower has q_proj and v_proj too, and stays frozen
    assert not any(param.requires_grad for name, param in model.named_parameters() if ".vision_tower." in name)
    _, _, model = built(tmp_path / "b", method="lora", lora_targets=["q_proj", "linear_1"])
    adapted = {name for name, _ in model.named_modules() if name.endswith(".lora_A")}
    assert any(".multi_modal_projector.linear_1" in name for name in adapted)
    assert not any(".multi_modal_projector.linear_2" in name or ".vision_tower." in name for name in adapted)
    _, _, model = built(tmp_path / "c", method="lora", lora_targets="all-linear")
    adapted = {name for name, _ in model.named_modules() if name.endswith(".lora_A")}
    assert len(adapted) == 2 * 7 and all(".language_model." in name for name in adapted)  # 4 attention + 3 MLP per layer
    with pytest.raises(ConfigError, match="lora_targets.*language model or projector"):
        built(tmp_path / "d", method="lora", lora_targets=["out_proj"])  # a layer of the vision tower only


def test_flops_count_the_vision_tower_on_its_own_tokens(tmp_path):
    _, _, model = built(tmp_path / "full")
    shape = flops.ModelShape.of(model)
    assert (shape.vision_layers, shape.vision_width) == (2, 64) and shape.vision_linear_params > 0
    assert shape.projector_linear_params == 2 * 64 * 64
    # a frozen tower (LoRA) runs forward only: 2 FLOPs per weight and token, forward attention only
    _, _, lora = built(tmp_path / "lora", method="lora")
    frozen = flops.ModelShape.of(lora)
    with_vision = flops.step_flops(frozen, False, 100, 0, image_tokens=16, vision_tokens=17, vision_sum_squared_lengths=17**2)
    without = flops.step_flops(frozen, False, 100, 0)
    assert with_vision - without == (2 * frozen.vision_linear_params * 17 + 4 * 2 * 64 * 17**2
                                     + 4 * frozen.projector_linear_params * 16)


@pytest.fixture(scope="module")
def llava_checkpoint(tmp_path_factory):
    """The tiny LLaVA saved as a checkpoint folder: weights, the MiniLM tokenizer with <image> added (the id its
    config names) and an image processor of its own statistics."""
    from transformers import CLIPImageProcessor, LlavaConfig, LlavaForConditionalGeneration

    folder = tmp_path_factory.mktemp("llava-checkpoint")
    words = tokenizer()
    words.add_tokens(["<image>"], special_tokens=True)
    config = LlavaConfig(vision_config=VISION, text_config={**TEXT, "vocab_size": len(words), "pad_token_id": 0},
                         image_token_index=words.convert_tokens_to_ids("<image>"))
    torch.manual_seed(0)
    LlavaForConditionalGeneration(config).save_pretrained(folder)
    words.save_pretrained(folder)
    CLIPImageProcessor(image_mean=[0.4, 0.5, 0.6], image_std=[0.2, 0.25, 0.3]).save_pretrained(folder)
    return folder


def test_a_checkpoint_folder_brings_its_tokenizer_and_processor(tmp_path, qa_folder, llava_checkpoint):
    config = experiment(qa_dataset(qa_folder), method="lora", image_size=None)
    config["models"]["llava"] = {"task": "vision_language", "source": {"kind": "path", "path": str(llava_checkpoint)}}
    spec = first_run(config)
    manifest = prepare_run(spec, tmp_path / "ok")
    assert manifest["image_mean"] == [0.4, 0.5, 0.6] and manifest["processor_class"] == "CLIPImageProcessor"
    assert (manifest["image_size"], manifest["image_tokens_per_image"], manifest["image_token_id"]) == (16, 16, 30522)
    model = modeling.build_model(spec, None, torch.device("cpu"), manifest["pad_token_id"]).model
    batch = registry.family("vision_language").collate(registry.load_split(tmp_path / "ok", "train", manifest), np.arange(2),
                             manifest["pad_token_id"]).to("cpu")
    assert torch.isfinite(model(**batch.inputs).loss)
    # its vision tower has position embeddings for 16 x 16 only
    with pytest.raises(ConfigError, match=r"image_size: 24, but model 'llava'.*built for 16"):
        prepare_run(spec.replace(image_size=24), tmp_path / "larger")
    # The plan of a checkpoint folder: its config built on the meta device, the train job's estimate.
    from ftbench.experiment import memory_plan

    plan = memory_plan.run_estimate(spec, tmp_path / "not-prepared", model=modeling.meta_model(spec))
    made = registry.family("vision_language").memory_estimate(model, spec, manifest)
    assert plan["memory_estimate_mb"] == pytest.approx(made["memory_estimate_mb"], rel=1e-9)


def test_a_checkpoint_whose_image_token_is_not_its_tokenizers_is_refused(tmp_path, qa_folder, llava_checkpoint):
    import json
    import shutil

    from ftbench.errors import SourceError

    folder = shutil.copytree(llava_checkpoint, tmp_path / "other")
    settings = json.loads((folder / "config.json").read_text())
    settings["image_token_index"] = 100
    (folder / "config.json").write_text(json.dumps(settings))
    config = experiment(qa_dataset(qa_folder), image_size=None)
    config["models"]["llava"] = {"task": "vision_language", "source": {"kind": "path", "path": str(folder)}}
    with pytest.raises(SourceError, match="image_token_index 100 is not its tokenizer's <image> id 30522"):
        prepare_run(first_run(config), tmp_path / "out")


# ---------------------------------------------------------------------------------------------------
# Loss and evaluation


def test_eval_scores_answer_tokens_only_on_hand_made_logits():
    """Two sequences of 4 positions; the labels of position t are predicted at t-1 (shift by one)."""
    vocab = 5
    labels = torch.tensor([[-100, -100, 3, 1], [-100, 2, 4, -100]])
    logits = torch.full((2, 4, vocab), -10.0)
    logits[0, 1, 3] = 10.0  # right: predicts label 3
    logits[0, 2, 0] = 10.0  # wrong: label 1
    logits[1, 0, 2] = 10.0  # right
    logits[1, 1, :] = 0.0  # uniform over 5: loss log 5, argmax 0 (wrong: label 4)
    logits[1, 3, 1] = 10.0  # after the last position: never scored
    output = type("Output", (), {"logits": logits})()
    batch = Batch({"labels": labels}, 2, 8, 8, 0)
    scores = registry.family("vision_language").eval_accumulator()
    scores.add(output, batch)
    result = scores.result()
    assert result["eval_token_accuracy"] == pytest.approx(2 / 4)
    confident = torch.nn.functional.cross_entropy(torch.tensor([[10.0] + [-10.0] * 4]), torch.tensor([0])).item()
    wrong = torch.nn.functional.cross_entropy(torch.tensor([[10.0] + [-10.0] * 4]), torch.tensor([1])).item()
    expected = (2 * confident + wrong + np.log(5)) / 4
    assert result["eval_loss"] == pytest.approx(expected, rel=1e-4)
    assert result["eval_perplexity"] == pytest.approx(np.exp(expected), rel=1e-4)


def test_loss_falls_on_a_tiny_llava(tmp_path, qa_folder):
    spec = first_run(experiment(qa_dataset(qa_folder)))
    manifest = prepare_run(spec, tmp_path)
    torch.manual_seed(0)
    model = modeling.build_model(spec, None, torch.device("cpu"), manifest["pad_token_id"]).model
    batch = registry.family("vision_language").collate(registry.load_split(tmp_path, "train", manifest), np.arange(4),
                             manifest["pad_token_id"]).to("cpu")
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.003)
    losses = []
    for _ in range(6):
        loss = model(**batch.inputs).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    # from about ln(30,523) = 10.3 (random weights): more than one nat less on the answers in 6 steps
    assert losses[-1] < losses[0] - 1.0 and losses == sorted(losses, reverse=True), losses


# ---------------------------------------------------------------------------------------------------
# Parse-time refusals


@pytest.mark.parametrize("missing", ["answer_column", "prompt_column", "image_column"])
def test_a_missing_prompt_answer_or_image_column_is_refused(qa_folder, missing):
    dataset_def = qa_dataset(qa_folder)
    del dataset_def[missing]
    with pytest.raises(ConfigError, match=rf"^config key datasets\.vqa\.{missing}: required"):
        config_module.validate_config(experiment(dataset_def))


def test_a_column_the_file_lacks_is_refused(qa_folder):
    with pytest.raises(ConfigError, match=r"datasets\.vqa\.answer_column: column 'reply' is not in"):
        config_module.validate_config(experiment(qa_dataset(qa_folder, answer_column="reply")))


def test_one_prompt_for_every_row_replaces_the_prompt_column(qa_folder):
    dataset_def = qa_dataset(qa_folder, prompt="Describe the image.")
    del dataset_def["prompt_column"]
    config_module.validate_config(experiment(dataset_def))


@pytest.mark.parametrize("settings, match", [
    ({"batching": "pack"}, r"batching 'pack' is not supported .*vision_language"),
    ({"batching": "padding_free"}, r"batching 'padding_free' is not supported"),
    ({"engine": "hf_trainer"}, r"engine.*hf_trainer.*not implemented"),
    ({"parallel": "fsdp", "num_gpus": 2, "device": "auto"}, r"fsdp.*not implemented"),
])
def test_settings_this_task_does_not_support_are_refused(qa_folder, settings, match):
    with pytest.raises(ConfigError, match=match):
        config_module.validate_config(experiment(qa_dataset(qa_folder), **settings))


def test_models_other_than_llava_and_config_models_without_tokenizer_are_refused(qa_folder):
    config = experiment(qa_dataset(qa_folder))
    config["models"]["llava"] = {**LLAVA_DEF, "source": {**TINY_LLAVA, "architecture": "LlamaConfig"}}
    with pytest.raises(ConfigError, match=r"models\.llava\.source\.architecture: 'LlamaConfig'.*LlavaConfig"):
        config_module.validate_config(config)
    source = {key: value for key, value in TINY_LLAVA.items() if key != "tokenizer"}
    config["models"]["llava"] = {**LLAVA_DEF, "source": source}
    with pytest.raises(ConfigError, match=r"models\.llava\.source\.tokenizer: required"):
        config_module.validate_config(config)


# ---------------------------------------------------------------------------------------------------
# Training (slow)


def train(tmp_path, dataset_def: dict, **defaults):
    from ftbench.train import trainer

    spec = first_run(experiment(dataset_def, **defaults))
    prepare_run(spec, tmp_path)
    return trainer.train_run(spec, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("method", ["full", "lora"])
def test_training_reports_answer_metrics_and_image_tokens_apart(tmp_path, qa_folder, method):
    metrics, steps = train(tmp_path, qa_dataset(qa_folder), method=method)
    assert metrics["status"] == "ok", metrics["status_reason"]
    assert metrics["images_per_s"] == pytest.approx(metrics["samples_per_s"])
    assert metrics["image_tokens_per_s"] + metrics["text_tokens_per_s"] == pytest.approx(metrics["tokens_per_s"])
    assert metrics["image_tokens_per_s"] == pytest.approx(IMAGE_TOKENS * metrics["images_per_s"])
    assert all(step["image_tokens"] == 8 * IMAGE_TOKENS for step in steps)
    assert 0 <= metrics["eval_token_accuracy"] <= 1 and metrics["eval_perplexity"] > 1 and metrics["eval_samples"] == 8
    assert metrics["memory_estimate_mb"] > 0 and metrics["memory_estimate_note"] is None
    # the analytic count (vision tower, projector, decoder) against torch's counter; the patch convolution is the gap
    assert 0.9 < metrics["flops_counted_ratio"] < 1.1


@pytest.mark.slow
def test_ddp_vision_language_run_counts_every_ranks_images(tmp_path, qa_folder):
    """Two gloo ranks on the CPU through the train command: images and image tokens of both ranks count."""
    import json
    import subprocess
    import sys

    spec = first_run(experiment(qa_dataset(qa_folder), method="lora", parallel="ddp", num_gpus=2, device="cpu"))
    prepare_run(spec, tmp_path / "data")
    out = tmp_path / "run" / "metrics.json"
    out.parent.mkdir()
    process = subprocess.run([sys.executable, "-m", "ftbench", "train", "--spec", spec.to_json(), "--data",
                              str(tmp_path / "data"), "--out", str(out), "--threads", "2"],
                             capture_output=True, text=True, timeout=300)
    assert process.returncode == 0, process.stderr[-3000:]
    row = json.loads(out.read_text())["metrics"]
    assert row["status"] == "ok", row["status_reason"]
    assert row["world_size"] == 2
    assert row["measured_images"] == row["measured_steps"] * 2 * spec.batch_size
    assert row["image_tokens_per_s"] == pytest.approx(IMAGE_TOKENS * row["images_per_s"])
    assert row["image_tokens_per_s"] + row["text_tokens_per_s"] == pytest.approx(row["tokens_per_s"])
    assert 0 <= row["eval_token_accuracy"] <= 1


@pytest.mark.slow
@has_digits
def test_vision_language_experiment_through_snakemake(tmp_path, snakemake_runner, config_writer, qa_folder):
    """Full fine-tuning on the question folder and LoRA on the digits questions: both runs ok, the answer-token
    metrics and image columns filled, and the report names the quality figure after the task."""
    config = experiment(qa_dataset(qa_folder))
    config["datasets"]["digits"] = DIGITS_QA
    config["matrix"] = {"model": ["llava"], "dataset": ["vqa", "digits"]}
    config["overrides"] = [{"when": {"dataset": "digits"}, "set": {"method": "lora"}}]
    config_writer(tmp_path, config)
    process = snakemake_runner(tmp_path, timeout=300)
    assert process.returncode == 0, process.stderr[-4000:]
    table = pd.read_parquet(tmp_path / "results" / "metrics.parquet")
    assert len(table) == 2 and (table["status"] == "ok").all(), table[["run_id", "status_reason"]]
    assert (table["task"] == "vision_language").all() and sorted(table["method"]) == ["full", "lora"]
    for column in ("eval_token_accuracy", "eval_perplexity", "eval_loss", "images_per_s", "image_tokens_per_s",
                   "text_tokens_per_s", "flops_per_step_analytic"):
        assert table[column].notna().all() and (table[column] >= 0).all(), column
    assert table["eval_accuracy"].isna().all() and (table["memory_estimate_mb"] > 0).all()
    report = (tmp_path / "results" / "report.html").read_text(encoding="utf-8")
    assert "answer token accuracy" in report


def test_mixed_reports_name_the_answer_token_accuracy_apart(tmp_path):
    """A language model's and a vision-language model's runs side by side: each quality figure under its own name."""
    import re

    from ftbench.report import analysis, report_page
    from test_report import fixture_runs, write_fixture

    vlm = fixture_runs("single")[0].assign(task="vision_language", eval_accuracy=pd.NA, eval_token_accuracy=0.7,
                                           images_per_s=12.5, image_tokens_per_s=12.5 * IMAGE_TOKENS,
                                           model="vlm", config_id=lambda t: t["config_id"].str.replace("m-d", "vlm-d"),
                                           run_id=lambda t: t["run_id"].str.replace("m-d", "vlm-d"))
    runs = pd.concat([fixture_runs("lm")[0], vlm], ignore_index=True)
    assert analysis.quality_column(analysis.prepare(runs))[1] == \
        "eval token accuracy (causal_lm) / answer token accuracy (vision_language)"
    metrics, files = write_fixture(tmp_path, runs, {})
    report_page.build_report(metrics, files, tmp_path / "figures", tmp_path / "report.html")
    page = (tmp_path / "report.html").read_text(encoding="utf-8")
    configurations = re.search(r'id="configurations-table">.*?</thead>', page, flags=re.S).group(0)
    assert ">answer_token_accuracy</th>" in configurations and ">token_accuracy</th>" in configurations
    assert "Most accurate (answer token accuracy): <b>" in page
    runs_table = re.search(r'id="runs">.*?</thead>', page, flags=re.S).group(0)
    assert ">images_per_s</th>" in runs_table and ">image_tokens_per_s</th>" in runs_table


# ---------------------------------------------------------------------------------------------------
# Memory estimate


@pytest.mark.parametrize("method", ["full", "lora"])
def test_memory_estimate_counts_the_vision_tower_only_where_it_trains(tmp_path, qa_folder, method):
    """The bytes autograd saves while the vision tower runs (saved-tensor hooks, bf16 autocast on the CPU):
    nothing at all under LoRA (frozen, fed pixels that need no gradient); under full fine-tuning its activations,
    per layer (a tower of 4 layers less one of 2, so its embeddings cancel), against the estimate's vision part (its encoder model over the
    tower's own tokens, class token included) within 5%. The rest is the decoder's estimate over the longest
    row, image features included, with the whole model's weights."""
    from ftbench.measure import memory_estimate as me

    traced, estimated = {}, {}
    for layers in (2, 4):
        model_def = {"task": "vision_language", "source": {**TINY_LLAVA, "overrides": {
            "vision_config": {**VISION, "num_hidden_layers": layers}, "text_config": TEXT}}}
        config = experiment(qa_dataset(qa_folder), method=method, precision="bf16", lora_dropout=0.0)
        config["models"]["llava"] = model_def
        spec = first_run(config)
        data = tmp_path / str(layers)
        prepare_run(spec, data)
        manifest = prepared.verify(data)
        split = registry.load_split(data, "train", manifest)
        longest = int(split.lengths().max())
        model = modeling.build_model(spec, None, torch.device("cpu"), manifest["pad_token_id"], manifest["vocab_size"]).model
        tower = vision_language_family.submodule(model, "vision_tower")
        inside, saved = [False], {}

        def keep(tensor, inside=inside, saved=saved, rows=(spec.batch_size, spec.batch_size * (IMAGE_TOKENS + 1))):
            # activations (a batch dimension first); autocast's weight copies are another part of the estimate
            if inside[0] and (method == "lora" or (tensor.dim() >= 2 and tensor.shape[0] in rows)):
                saved[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
            return tensor

        tower.register_forward_pre_hook(lambda *_, inside=inside: inside.__setitem__(0, True))
        tower.register_forward_hook(lambda *_, inside=inside: inside.__setitem__(0, False))
        batch = registry.family("vision_language").collate(split, np.arange(spec.batch_size), manifest["pad_token_id"])
        with torch.autograd.graph.saved_tensors_hooks(keep, lambda tensor: tensor), torch.autocast("cpu", dtype=torch.bfloat16):
            model(**batch.to(torch.device("cpu")).inputs).loss.backward()
        estimate = registry.family("vision_language").memory_estimate(model, spec, {**manifest, "longest_row": longest})
        parts = {name: value * me.MIB for name, value in estimate["memory_estimate_parts_mb"].items()}
        whole, decoder_facts = me.facts_of(model), me.facts_of(vision_language_family.submodule(model, "language_model"))
        decoder = me.estimate_parts(decoder_facts, spec.replace(seq_len=longest), decoder_facts.shape.vocab_size)
        traced[layers], estimated[layers] = sum(saved.values()), parts["activations"] - decoder["activations"]
        assert parts["logits"] == pytest.approx(12 * spec.batch_size * longest * decoder_facts.shape.vocab_size)
        # LoRA's recipe: the frozen base (tower included) in bf16, the adapters fp32; full: fp32 masters
        frozen_bytes = 2 if method == "lora" else 4
        assert parts["weights"] == pytest.approx(4 * whole.trainable + frozen_bytes * (whole.total - whole.trainable))
        if method == "lora":  # autocast copies only the fp32 adapters: the 16-bit base, tower included, needs none
            assert parts["weight_copies"] == pytest.approx(2 * whole.trainable)
    if method == "lora":
        assert traced == {2: 0, 4: 0} and estimated == {2: 0, 4: 0}
    else:
        assert estimated[4] - estimated[2] == pytest.approx(traced[4] - traced[2], rel=0.05)


@pytest.mark.parametrize("method", ["full", "lora"])
def test_the_plan_of_a_llava_is_the_estimate_its_train_job_makes(tmp_path, method):
    """Before any data is prepared, the plan builds the model on the meta device and gets the estimate the train
    job makes from the built model and the prepared manifest (the decoder over its full rows; the tower where it
    trains); a run that cannot fit is refused before its model is built."""
    from ftbench.experiment import memory_plan

    spec = first_run(experiment({"source": {"kind": "synthetic"}, "train_size": 8, "eval_size": 4}, method=method,
                                precision="bf16"))
    plan = memory_plan.plan_run(spec, [{"name": "H100 SXM", "memory_gb": 80}], tmp_path / "not-prepared",
                                build=modeling.meta_model)
    manifest = prepare_run(spec, tmp_path / "data")
    model = modeling.build_model(spec, None, torch.device("cpu"), manifest["pad_token_id"], manifest["vocab_size"]).model
    made = registry.family("vision_language").memory_estimate(model, spec, manifest)
    assert plan["memory_estimate_mb"] == pytest.approx(made["memory_estimate_mb"], rel=1e-9)
    assert plan["memory_estimate_parts_mb"] == pytest.approx(made["memory_estimate_parts_mb"], rel=1e-9)
    assert plan["gpus"][0]["fits"] == "yes" and plan["gpus"][0]["largest_batch"] > spec.batch_size
    assert memory_plan.predicted_not_to_fit(spec, 2**30, "a 1 GiB GPU", None, build=modeling.meta_model) is None  # 512 MiB context
    tight = int((plan["memory_estimate_mb"] / 2 + memory_plan.CUDA_CONTEXT_MIB) * 2**20)
    assert "predicted not to fit" in memory_plan.predicted_not_to_fit(spec, tight, "a small GPU", None, build=modeling.meta_model)


def test_with_the_data_prepared_the_llava_plan_reads_its_longest_row_as_the_train_job_does(tmp_path, qa_folder):
    """Questions and answers far shorter than seq_len allows: before the data is prepared the plan takes full rows
    (an upper bound, said in its note); once prepared, the data's longest row, the very estimate the train job
    makes, so a run that fits is never refused for rows it does not have."""
    from ftbench.experiment import memory_plan

    spec = first_run(experiment(qa_dataset(qa_folder), seq_len=96, precision="bf16"))
    before = memory_plan.run_estimate(spec, tmp_path / "data", model=modeling.meta_model(spec))
    assert "upper bound" in before["plan_note"]
    manifest = prepare_run(spec, tmp_path / "data")
    after = memory_plan.run_estimate(spec, tmp_path / "data", model=modeling.meta_model(spec))
    longest = int(registry.load_split(tmp_path / "data", "train", manifest).lengths().max())
    assert longest < spec.seq_len + IMAGE_TOKENS and after["plan_note"] is None
    model = modeling.build_model(spec, None, torch.device("cpu"), manifest["pad_token_id"], manifest["vocab_size"]).model
    made = registry.family("vision_language").memory_estimate(model, spec, {**manifest, "longest_row": longest})
    assert after["memory_estimate_mb"] == pytest.approx(made["memory_estimate_mb"], rel=1e-9)
    assert after["memory_estimate_mb"] < before["memory_estimate_mb"]


@pytest.mark.parametrize("overrides", [{}, {"image_token_index": 5}])
def test_a_llava_plan_without_its_model_or_under_qlora_says_why_it_has_no_estimate(qa_folder, overrides):
    """No builder given (or QLoRA, whose 4-bit layers exist only once loaded): a note, not a crash, and the train
    job is not refused."""
    from ftbench.experiment import memory_plan

    config = experiment(qa_dataset(qa_folder))
    config["models"]["llava"] = {"task": "vision_language", "source": {**TINY_LLAVA, "overrides": overrides}}
    plan = memory_plan.plan_run(first_run(config), [{"name": "H100 SXM", "memory_gb": 80}])
    assert plan["memory_estimate_mb"] is None and "meta device" in plan["memory_estimate_note"]
    qlora = first_run(experiment(qa_dataset(qa_folder), method="qlora", precision="bf16"))
    assert modeling.meta_model(qlora) is None
    plan = memory_plan.plan_run(qlora, [{"name": "H100 SXM", "memory_gb": 80}], build=modeling.meta_model)
    assert plan["memory_estimate_mb"] is None and "QLoRA" in plan["memory_estimate_note"]
    assert memory_plan.predicted_not_to_fit(first_run(config), 80 * 2**30, "NVIDIA H100", None) is None

    def broken(run):
        raise RuntimeError("no meta support")

    # A model that cannot be built on the meta device, or estimated: the plan says why; the train job is launched.
    plan = memory_plan.plan_run(first_run(config), [{"name": "H100 SXM", "memory_gb": 80}], build=broken)
    assert plan["memory_estimate_mb"] is None and "RuntimeError: no meta support" in plan["memory_estimate_note"]
    assert memory_plan.predicted_not_to_fit(first_run(config), 2**30, "a 1 GiB GPU", None, build=broken) is None
    spec = first_run(config)
    unmodelled = memory_plan.run_estimate(spec, None, model=torch.nn.Linear(2, 2))  # no vision tower / language model
    assert unmodelled["memory_estimate_mb"] is None and "vision_tower" in unmodelled["memory_estimate_note"]
    failing = memory_plan.run_estimate(spec, None, model=object())  # the estimate itself raises
    assert failing["memory_estimate_mb"] is None and failing["memory_estimate_note"].startswith("no estimate: ")
