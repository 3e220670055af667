"""Image-text retrieval (retrieval.py): image-caption data from each source, shards and batches, recall@1 on
hand-made similarity matrices, the towers' FLOPs, LoRA on both towers, the parse-time checks, and one tiny
experiment end to end through snakemake.

Models are CLIPs (and a SigLIP) built from a config; captions are tokenised with the MiniLM tokenizer a
pip package ships. No pip package ships image-caption pairs: the real pairs are scikit-learn's 8x8 digits
captioned from their class ("a handwritten digit 3").
"""

from __future__ import annotations

import importlib.util

import numpy as np
import pandas as pd
import pytest
import torch

from conftest import MINILM_SOURCE, write_image_folder
from ftbench.tasks import registry
from ftbench.tasks import image_text_retrieval as retrieval
from ftbench.experiment import config as config_module, matrix
from ftbench.measure import flops
from ftbench.train import modeling
from ftbench.errors import ConfigError
from test_multimodal import DIGITS_DEF, has_digits

TOWER = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2, "intermediate_size": 64}
TINY_CLIP = {"kind": "config", "architecture": "CLIPConfig",
             "overrides": {"text_config": {**TOWER, "max_position_embeddings": 32},
                           "vision_config": {**TOWER, "patch_size": 4, "image_size": 16}, "projection_dim": 16}}
CLIP_DEF = {"task": "image_text_retrieval", "source": {**TINY_CLIP, "tokenizer": MINILM_SOURCE}}
SYNTHETIC = {"source": {"kind": "synthetic"}, "train_size": 32, "eval_size": 8}
DEFAULTS = {"method": "full", "precision": "fp32", "batch_size": 8, "seq_len": 16, "max_steps": 4, "warmup_steps": 1,
            "learning_rate": 0.002, "device": "cpu", "num_gpus": 0, "eval_batch_size": 16, "image_size": 16,
            "lora_rank": 4, "lora_targets": ["q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2"]}
# 24 images, 6 captions: every caption is shared by 4 images (as class captions are)
CAPTIONS = ["a red square", "a blue circle on a long grey background", "two cats", "a dog", "snow", "a small green boat"]


def caption_rows(count: int = 24) -> pd.DataFrame:
    return pd.DataFrame({"file": [f"img{index}.png" for index in range(count)],
                         "caption": [CAPTIONS[index % len(CAPTIONS)] for index in range(count)]})


@pytest.fixture(scope="module")
def caption_folder(tmp_path_factory):
    """PNG files and a captions.csv naming them (paths relative to the folder)."""
    return write_image_folder(tmp_path_factory.mktemp("captioned"), caption_rows(), "captions.csv")


def caption_dataset(folder, **extra) -> dict:
    return {"source": {"kind": "path", "path": str(folder / "captions.csv")}, "image_column": "file",
            "text_column": "caption", "train_size": 16, "eval_size": 8, **extra}


def prepare(dataset_def: dict, out, model_def: dict = CLIP_DEF, seq_len: int = 16, image_size: int | None = 16) -> dict:
    return registry.prepare("pairs", dataset_def, model_def, seq_len, out, 128, "clip", image_size)


def experiment(dataset_def: dict, model_def: dict = CLIP_DEF, **defaults) -> dict:
    return {"models": {"clip": model_def}, "datasets": {"pairs": dataset_def},
            "defaults": {**DEFAULTS, **defaults}, "matrix": {"model": ["clip"], "dataset": ["pairs"]}}


# ---------------------------------------------------------------------------------------------------
# Preparation, shards and batches


def test_captioned_folder_round_trips_through_shards_memory_and_disk(tmp_path, caption_folder):
    manifest = prepare(caption_dataset(caption_folder), tmp_path)
    assert manifest["task"] == "image_text_retrieval" and manifest["tokenizer_class"]
    # CLIP: (16 / 4)^2 patches + the class token
    assert manifest["image_tokens_per_image"] == 17 and manifest["pad_to_length"] is False
    train = manifest["splits"]["train"]
    assert (train["rows"], train["images"], train["image_tokens"]) == (16, 16, 16 * 17)
    assert train["tokens"] == train["image_tokens"] + train["text_tokens"]
    indices = np.array([5, 0, 15, 3])
    memory = registry.family("image_text_retrieval").collate(registry.load_split(tmp_path, "train", manifest), indices, 0)
    disk = registry.family("image_text_retrieval").collate(registry.load_split(tmp_path, "train", manifest, "disk"), indices, 0)
    assert set(memory.inputs) == {"pixel_values", "input_ids", "attention_mask", "return_loss"}
    memory, disk = memory.to(torch.device("cpu")), disk.to(torch.device("cpu"))
    for key in ("pixel_values", "input_ids", "attention_mask"):
        assert torch.equal(memory.inputs[key], disk.inputs[key]), key
    assert (memory.caption_ids == disk.caption_ids).all()
    assert memory.inputs["pixel_values"].shape == (4, 3, 16, 16) and memory.inputs["pixel_values"].dtype == torch.float32
    # real tokens: the images' and the captions' without padding; padded positions counted apart
    text = int(memory.inputs["attention_mask"].sum())
    assert text < memory.inputs["attention_mask"].numel()  # captions of different lengths: some padding
    assert (memory.images, memory.image_tokens, memory.real_tokens) == (4, 68, 68 + text)
    assert memory.padded_tokens == 68 + memory.inputs["attention_mask"].numel()
    lengths = memory.inputs["attention_mask"].sum(dim=1)
    assert memory.sum_squared_lengths == 4 * 17**2 + int((lengths**2).sum())


def test_rows_with_the_same_caption_share_a_caption_id(tmp_path, caption_folder):
    manifest = prepare(caption_dataset(caption_folder), tmp_path)
    split = registry.load_split(tmp_path, "eval", manifest)
    ids = split.take(np.arange(len(split)))
    texts = [tuple(row) for row in ids.captions.input_ids]
    for a in range(len(texts)):
        for b in range(len(texts)):
            assert (texts[a] == texts[b]) == (ids.caption_ids[a] == ids.caption_ids[b])
    assert manifest["splits"]["eval"]["distinct_captions"] < 8  # 8 eval rows of 6 captions: some shared


def test_parquet_of_image_bytes_and_a_save_to_disk_image_feature(tmp_path, caption_folder):
    import datasets

    rows = caption_rows()
    rows["file"] = [(caption_folder / name).read_bytes() for name in rows["file"]]
    rows.to_parquet(tmp_path / "pairs.parquet")
    from_bytes = prepare({**caption_dataset(caption_folder), "source": {"kind": "path", "path": str(tmp_path / "pairs.parquet")}},
                         tmp_path / "bytes")
    from_files = prepare(caption_dataset(caption_folder), tmp_path / "files")
    a, b = registry.load_split(tmp_path / "bytes", "eval", from_bytes), registry.load_split(tmp_path / "files", "eval", from_files)
    assert (a.pictures.pixels == b.pictures.pixels).all() and (a.caption_ids == b.caption_ids).all()

    table = datasets.Dataset.from_dict({"img": [str(caption_folder / name) for name in caption_rows()["file"]],
                                        "text": caption_rows()["caption"].tolist()}).cast_column("img", datasets.Image())
    table.save_to_disk(str(tmp_path / "saved"))
    saved = prepare({"source": {"kind": "path", "path": str(tmp_path / "saved")}, "image_column": "img", "text_column": "text",
                     "train_size": 16, "eval_size": 8}, tmp_path / "saved-out")
    assert saved["splits"]["train"]["rows"] == 16


def test_synthetic_pairs_are_full_length_and_end_where_clip_pools(tmp_path):
    manifest = prepare(SYNTHETIC, tmp_path, model_def={"task": "image_text_retrieval", "source": TINY_CLIP})
    assert manifest["tokenizer"] is None and manifest["vocab_size"] == 49408  # CLIP's own vocabulary
    split = registry.load_split(tmp_path, "train", manifest)
    assert len(split) == 32 and split.pictures.pixels.shape == (32, 16, 16, 3)
    assert all(len(ids) == 16 and ids[-1] == 49407 for ids in split.captions.input_ids)  # CLIP's end-of-text token
    assert len(set(split.caption_ids)) == 32  # every random caption is its own
    assert manifest["splits"]["train"]["text_tokens"] == 32 * 16


@has_digits
def test_digits_captioned_from_their_class(tmp_path):
    dataset_def = {**DIGITS_DEF, "caption_template": "a handwritten digit {label}", "train_size": 1400, "eval_size": 397}
    manifest = prepare(dataset_def, tmp_path)
    assert manifest["splits"]["eval"]["distinct_captions"] == 10
    assert manifest["splits"]["train"]["rows"] + manifest["splits"]["eval"]["rows"] == 1797


def test_siglip_captions_are_padded_to_seq_len_without_a_mask(tmp_path, caption_folder):
    siglip = {"task": "image_text_retrieval", "source": {
        "kind": "config", "architecture": "SiglipConfig", "tokenizer": MINILM_SOURCE,
        "overrides": {"text_config": {**TOWER, "max_position_embeddings": 32}, "vision_config": {**TOWER, "patch_size": 4, "image_size": 16}}}}
    manifest = prepare(caption_dataset(caption_folder), tmp_path, model_def=siglip)
    assert manifest["pad_to_length"] is True
    assert manifest["image_tokens_per_image"] == 16  # no class token
    batch = registry.family("image_text_retrieval").collate(registry.load_split(tmp_path, "train", manifest), np.arange(4), 0)
    assert "attention_mask" not in batch.inputs and batch.inputs["input_ids"].shape == (4, 16)
    assert batch.padded_tokens == 4 * 16 + 4 * 16 and batch.real_tokens < batch.padded_tokens


# ---------------------------------------------------------------------------------------------------
# recall@1


def test_hits_on_a_hand_made_similarity_matrix():
    similarity = torch.tensor([[0.9, 0.1, 0.0],   # its own caption best: hit
                               [0.8, 0.2, 0.1],   # caption 0 best, its own is 1: miss
                               [0.3, 0.3, 0.3]])  # a three-way tie: a miss, whatever the order
    ids = torch.tensor([0, 1, 2])
    assert retrieval.hits(similarity, ids, ids).tolist() == [True, False, False]


def test_a_shared_caption_counts_any_of_its_items_and_a_tie_with_a_wrong_one_misses():
    similarity = torch.tensor([[0.1, 0.9, 0.2, 0.0],   # row 0 (caption 7) retrieves item 1, also caption 7: hit
                               [0.5, 0.5, 0.5, 0.1],   # tie between right items 0/1 and wrong item 2: miss
                               [0.0, 0.0, 0.4, 0.3],   # its own best: hit
                               [0.2, 0.2, 0.6, 0.6]])  # caption 5: a tie of its own item (3) and a wrong one (2): miss
    ids = torch.tensor([7, 7, 3, 5])
    keys = torch.tensor([7, 7, 3, 5])
    assert retrieval.hits(similarity, ids, keys).tolist() == [True, False, True, False]


def test_recall_both_ways_in_chunks_equals_the_whole_matrix():
    generator = torch.Generator().manual_seed(0)
    images = torch.randn(50, 8, generator=generator)
    ids = np.arange(50) % 7  # shared captions: texts of one caption have one embedding
    distinct = torch.randn(7, 8, generator=generator)
    texts = distinct[ids]
    whole = retrieval.recall_at_1(images, texts, ids, chunk_rows=1000)
    assert retrieval.recall_at_1(images, texts, ids, chunk_rows=7) == whole
    # texts equal to their images (one per caption) retrieve perfectly both ways
    assert retrieval.recall_at_1(texts, texts, ids) == (1.0, 1.0)
    # by hand: image->text is the share of images whose nearest distinct caption (cosine) is theirs
    cosine = torch.nn.functional.normalize(images, dim=1) @ torch.nn.functional.normalize(distinct, dim=1).T
    assert whole[0] == pytest.approx(float((cosine.argmax(dim=1).numpy() == ids).mean()))


def test_recall_accumulator_scores_the_whole_split_and_keeps_the_loss_per_sample():
    class Output:
        def __init__(self, images, texts, loss):
            self.image_embeds, self.text_embeds, self.loss = images, texts, torch.tensor(loss)

    class Pairs:
        def __init__(self, ids):
            self.caption_ids, self.samples = np.array(ids), len(ids)

    scores = retrieval.RecallAccumulator()
    eye = torch.eye(4)
    # image 3 looks like caption 0 (in the other batch): images 0-2 find their captions, image 3 finds caption 0;
    # caption 0 ties image 0 with image 3 (a miss), caption 3 is orthogonal to every image (a tie: a miss)
    scores.add(Output(eye[[0, 1]], eye[[0, 1]], 1.0), Pairs([0, 1]))
    scores.add(Output(eye[[2, 0]], eye[[2, 3]], 3.0), Pairs([2, 3]))
    result = scores.result()
    assert result["eval_recall_at_1_i2t"] == 0.75 and result["eval_recall_at_1_t2i"] == 0.5
    assert result["eval_recall_at_1"] == 0.625 and result["eval_loss"] == 2.0
    assert retrieval.RecallAccumulator().result() == {}


# ---------------------------------------------------------------------------------------------------
# Model: loss, LoRA, FLOPs


def built(method: str = "full", model_def: dict = CLIP_DEF, **settings):
    spec = matrix.expand_runs(experiment(SYNTHETIC, model_def, method=method, **settings))[0]
    return spec, modeling.build_model(spec, None, torch.device("cpu"))


@pytest.mark.parametrize("method", ["full", "lora"])
def test_the_plan_of_a_clip_is_the_estimate_its_train_job_makes(tmp_path, method):
    """The plan builds the dual encoder on the meta device: both towers' estimate, equal to the train job's from
    the built model, before any data is prepared."""
    from ftbench.experiment import memory_plan

    spec, made = built(method, precision="bf16")
    plan = memory_plan.plan_run(spec, [{"name": "H100 SXM", "memory_gb": 80}], tmp_path, build=modeling.meta_model)
    manifest = {"seq_len": spec.seq_len, "image_tokens_per_image": registry.family("image_text_retrieval").tokens_per_example(spec)}
    expected = retrieval.memory_estimate(made.model, spec, manifest)
    assert expected["memory_estimate_mb"] > 0
    assert plan["memory_estimate_mb"] == pytest.approx(expected["memory_estimate_mb"], rel=1e-9)
    assert plan["gpus"][0]["fits"] == "yes"


def test_the_contrastive_loss_of_a_config_built_clip_decreases(tmp_path):
    """16 synthetic pairs (every caption its own, ending in the MiniLM tokenizer's [SEP]) learnt as one batch."""
    manifest = prepare(SYNTHETIC, tmp_path)
    torch.manual_seed(0)
    spec, model = built()
    assert model.model.text_model.config.eos_token_id == 102  # the MiniLM tokenizer's [SEP]: where captions pool
    batch = registry.family("image_text_retrieval").collate(registry.load_split(tmp_path, "train", manifest), np.arange(16), 0)
    optimizer = torch.optim.AdamW(model.model.parameters(), lr=0.002)
    losses = []
    for _ in range(15):
        loss = model.model(**batch.to(torch.device("cpu")).inputs).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < 0.3 * losses[0], losses


def test_lora_adapts_both_towers_and_trains_only_adapters():
    spec, model = built("lora")
    adapted = [name for name, _ in model.model.named_modules() if name.endswith("lora_A")]
    assert any(".vision_model." in name for name in adapted) and any(".text_model." in name for name in adapted)
    for target in ("q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2"):
        assert any(f".{target}.lora_A" in name for name in adapted), target
    trainable = [name for name, p in model.model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in name for name in trainable)
    assert 0 < model.trainable_params < model.total_params


def test_flops_count_each_tower_on_its_own_tokens():
    _, model = built()
    shape = flops.ModelShape.of(model.model)
    linears = {name: module.weight.numel() for name, module in model.model.named_modules() if isinstance(module, torch.nn.Linear)}
    assert shape.vision.linear_params == sum(v for n, v in linears.items() if n.startswith("vision_model."))
    assert shape.linear_params == sum(v for n, v in linears.items() if n.startswith("text_model."))
    assert shape.pooled_linear_params == linears["visual_projection"] + linears["text_projection"] == 2 * 32 * 16
    assert (shape.vision.layers, shape.vision.width, shape.layers, shape.width) == (2, 32, 2, 32)
    # by hand: 2 images of 17 tokens, 2 captions of 5 and 7 tokens
    v, t, p = shape.vision.linear_params, shape.linear_params, shape.pooled_linear_params
    expected = (6 * v * 34 + 12 * 2 * 32 * 2 * 17**2) + (6 * t * 12 + 12 * 2 * 32 * (25 + 49)) + 6 * p * 2
    assert flops.step_flops(shape, True, 34 + 12, 2 * 17**2 + 25 + 49, images=2, image_tokens=34) == expected


def test_lora_flops_count_frozen_towers_at_4n():
    _, model = built("lora")
    shape = flops.ModelShape.of(model.model)
    assert 0 < shape.vision.trainable_linear_params < shape.vision.linear_params
    assert shape.pooled_trainable_linear_params == 0  # the projections are not adapted
    full = flops.step_flops(shape, True, 34, 2 * 17**2, images=2, image_tokens=34)
    assert flops.step_flops(shape, False, 34, 2 * 17**2, images=2, image_tokens=34) < full


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("method", ["full", "lora"])
def test_memory_estimate_of_both_towers_matches_what_autograd_keeps(precision, method):
    """The activations of each tower over its own tokens (CLIP's quick_gelu keeping its sigmoid too) against
    the bytes a CLIPModel's layers really save, traced with saved-tensor hooks: a model with 4 layers per
    tower less one with 2, so embeddings, projections and loss cancel."""
    batch, text_len, image_tokens = 3, 16, 17

    def make(layers: int):
        towers = {"text_config": {**TINY_CLIP["overrides"]["text_config"], "num_hidden_layers": layers},
                  "vision_config": {**TINY_CLIP["overrides"]["vision_config"], "num_hidden_layers": layers}}
        model_def = {"task": "image_text_retrieval", "source": {**TINY_CLIP, "overrides": {**TINY_CLIP["overrides"], **towers}}}
        spec = matrix.expand_runs(experiment(SYNTHETIC, model_def, method=method, precision=precision, seq_len=text_len,
                                             lora_dropout=0.0))[0]
        torch.manual_seed(0)
        return spec, modeling.build_model(spec, None, torch.device("cpu")).model

    saved = {}
    for layers in (2, 4):
        _, model = make(layers)
        storages = {}

        def keep(tensor):
            if tensor.dim() >= 2 and tensor.shape[0] in (batch, batch * text_len, batch * image_tokens):
                storages[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
            return tensor

        inputs = {"pixel_values": torch.randn(batch, 3, 16, 16), "input_ids": torch.randint(200, 1000, (batch, text_len)),
                  "return_loss": True}
        with torch.autograd.graph.saved_tensors_hooks(keep, lambda tensor: tensor):
            with torch.autocast("cpu", dtype=modeling.DTYPES[precision], enabled=precision != "fp32"):
                model.train()(**inputs)
        saved[layers] = sum(storages.values())
    spec, one_layer = make(1)
    manifest = {"image_tokens_per_image": image_tokens, "seq_len": text_len}
    estimate = retrieval.memory_estimate(one_layer, spec.replace(batch_size=batch), manifest)
    per_layer_pair = (saved[4] - saved[2]) / 2  # one vision layer and one text layer
    assert estimate["memory_estimate_parts_mb"]["activations"] * 2**20 == pytest.approx(per_layer_pair, rel=0.10)
    assert estimate["memory_estimate_mb"] > 0 and estimate["memory_estimate_note"] is None


# ---------------------------------------------------------------------------------------------------
# Parse-time checks


def check(config: dict) -> None:
    config_module.validate_config(config)


def test_a_dataset_without_captions_is_refused_naming_text_column(caption_folder):
    dataset_def = caption_dataset(caption_folder)
    del dataset_def["text_column"]
    with pytest.raises(ConfigError, match=r"^config key datasets\.pairs\.text_column: required"):
        check(experiment(dataset_def))
    # a caption column the file does not have: named with the file's columns
    with pytest.raises(ConfigError, match=r"datasets\.pairs\.text_column: column 'captions' is not in .*file, caption"):
        check(experiment(caption_dataset(caption_folder, text_column="captions")))


def test_other_retrieval_refusals_name_their_key(caption_folder):
    checks = [
        (experiment(caption_dataset(caption_folder), {"task": "image_text_retrieval", "source": TINY_CLIP}),
         r"models\.clip\.source\.tokenizer: required"),
        (experiment(caption_dataset(caption_folder), seq_len=64), r"defaults\.seq_len: 64 exceeds the text tower.*32 positions"),
        (experiment(SYNTHETIC, parallel="ddp", num_gpus=2, device="auto"), r"defaults\.parallel.*'ddp' is not implemented"),
        (experiment(SYNTHETIC, engine="hf_trainer"), r"defaults\.engine.*hf_trainer"),
        (experiment(SYNTHETIC, batching="pack"), r"defaults\.batching.*dual encoder"),
        (experiment({**DIGITS_DEF, "caption_template": "a digit"}), r"datasets\.pairs\.caption_template: 'a digit' is not allowed; expected text containing \{label\}"),
    ]
    for config, message in checks:
        with pytest.raises(ConfigError, match=message):
            check(config)
    check(experiment(caption_dataset(caption_folder)))
    check(experiment({**DIGITS_DEF, "caption_template": "a handwritten digit {label}"}))


def test_quality_is_recall_beside_accuracy_in_a_mixed_table():
    from ftbench.report import analysis

    runs = pd.DataFrame({"task": ["classification", "image_text_retrieval"], "eval_accuracy": [0.8, None],
                         "eval_recall_at_1": [None, 0.6]}, dtype=object).astype({"eval_accuracy": "Float64", "eval_recall_at_1": "Float64"})
    values, name = analysis.quality_column(runs)
    assert values.tolist() == [0.8, 0.6]
    assert name == "eval accuracy (classification) / recall@1 (image_text_retrieval)"


# ---------------------------------------------------------------------------------------------------
# Training (slow)


@pytest.fixture(scope="module")
def clip_checkpoint(tmp_path_factory, minilm_dir):
    """The tiny CLIP saved as a checkpoint folder (16 px) with the MiniLM tokenizer and an image processor of
    its own statistics: what a fine-tuned CLIP folder holds."""
    from transformers import AutoTokenizer, CLIPConfig, CLIPImageProcessor, CLIPModel

    folder = tmp_path_factory.mktemp("clip-checkpoint")
    tokenizer = AutoTokenizer.from_pretrained(minilm_dir)
    text = {**TINY_CLIP["overrides"]["text_config"], "vocab_size": len(tokenizer), "eos_token_id": tokenizer.sep_token_id,
            "pad_token_id": tokenizer.pad_token_id, "bos_token_id": tokenizer.cls_token_id}
    torch.manual_seed(0)
    CLIPModel(CLIPConfig(text_config=text, vision_config=TINY_CLIP["overrides"]["vision_config"], projection_dim=16)).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    CLIPImageProcessor(image_mean=[0.4, 0.5, 0.6], image_std=[0.2, 0.25, 0.3]).save_pretrained(folder)
    return folder


@pytest.mark.slow
def test_lora_on_a_clip_checkpoint_at_another_image_size(tmp_path, caption_folder, clip_checkpoint):
    from ftbench.train import trainer

    model_def = {"task": "image_text_retrieval", "source": {"kind": "path", "path": str(clip_checkpoint)}}
    config = experiment(caption_dataset(caption_folder), model_def, method="lora", image_size=24)
    spec = matrix.expand_runs(config)[0]
    config_module.check_run(spec, config)
    manifest = prepare(spec.dataset_def, tmp_path, model_def, image_size=24)
    assert manifest["image_mean"] == [0.4, 0.5, 0.6] and manifest["tokenizer_class"]
    assert manifest["interpolate_pos_encoding"] is True and manifest["image_tokens_per_image"] == (24 // 4) ** 2 + 1
    metrics, steps = trainer.train_run(spec, tmp_path)
    assert metrics["status"] == "ok", metrics["status_reason"]
    assert steps[0]["image_tokens"] == 8 * 37 and 0 <= metrics["eval_recall_at_1"] <= 1


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("bitsandbytes") is None, reason="bitsandbytes not installed")
def test_qlora_trains_a_dual_encoder(tmp_path):
    from ftbench.train import trainer

    # bitsandbytes' CPU inference kernel needs rows of at least its 64-value quantisation block
    wide = {**TOWER, "hidden_size": 64}
    model_def = {"task": "image_text_retrieval", "source": {**TINY_CLIP, "overrides": {
        "text_config": {**wide, "max_position_embeddings": 32}, "vision_config": {**wide, "patch_size": 4, "image_size": 16},
        "projection_dim": 64}}}
    config = experiment(SYNTHETIC, model_def, method="qlora", max_steps=3)
    spec = matrix.expand_runs(config)[0]
    prepare(SYNTHETIC, tmp_path, model_def)
    metrics, _ = trainer.train_run(spec, tmp_path)
    assert metrics["status"] == "ok", metrics["status_reason"]
    assert metrics["trainable_params"] < metrics["total_params"] and metrics["eval_samples"] == 8


@pytest.mark.slow
def test_a_siglip_and_a_lora_clip_train_through_the_loop(tmp_path, caption_folder):
    from ftbench.train import trainer

    siglip = {"task": "image_text_retrieval", "source": {
        "kind": "config", "architecture": "SiglipConfig", "tokenizer": MINILM_SOURCE,
        "overrides": {"text_config": {**TOWER, "max_position_embeddings": 32}, "vision_config": {**TOWER, "patch_size": 4, "image_size": 16}}}}
    for name, model_def, method, checkpointing in (("siglip", siglip, "full", True), ("clip", CLIP_DEF, "lora", False)):
        config = experiment(caption_dataset(caption_folder), model_def, method=method, data_source="disk",
                            batching="group_by_length", gradient_checkpointing=checkpointing)
        spec = matrix.expand_runs(config)[0]
        config_module.check_run(spec, config)
        prepare(spec.dataset_def, tmp_path / name, model_def)
        metrics, steps = trainer.train_run(spec, tmp_path / name)
        assert metrics["status"] == "ok", metrics["status_reason"]
        assert metrics["eval_samples"] == 8 and 0 <= metrics["eval_recall_at_1"] <= 1
        assert metrics["memory_estimate_mb"] > 0 and metrics["memory_estimate_note"] is None
        assert metrics["text_tokens_per_s"] > 0 and metrics["image_tokens_per_s"] > 0
        # analytic FLOPs of both towers against torch's counter (the patch convolution is the known gap); a
        # checkpointed run is counted with checkpointing off (model FLOPs: 1.09 here, about 1.4 with the
        # recomputed forward)
        assert 0.8 < metrics["flops_counted_ratio"] < 1.2, metrics["flops_counted_ratio"]


@pytest.mark.slow
def test_retrieval_experiment_through_snakemake(tmp_path, snakemake_runner, config_writer, caption_folder):
    """A config-built CLIP fully fine-tuned on captioned images and LoRA-tuned on synthetic pairs: both rows
    ok with their recall and image/text token columns, and a report that names recall@1 as the quality."""
    config = experiment(caption_dataset(caption_folder))
    config["datasets"]["synth"] = SYNTHETIC
    config["matrix"] = {"model": ["clip"], "dataset": ["pairs", "synth"]}
    config["overrides"] = [{"when": {"dataset": "synth"}, "set": {"method": "lora"}}]
    config_writer(tmp_path, config)
    process = snakemake_runner(tmp_path, timeout=300)
    assert process.returncode == 0, process.stderr[-4000:]
    table = pd.read_parquet(tmp_path / "results" / "metrics.parquet")
    assert len(table) == 2 and (table["status"] == "ok").all(), table[["run_id", "status_reason"]]
    assert (table["task"] == "image_text_retrieval").all()
    for column in ("eval_recall_at_1_i2t", "eval_recall_at_1_t2i", "eval_recall_at_1", "images_per_s",
                   "image_tokens_per_s", "text_tokens_per_s"):
        assert table[column].notna().all() and (table[column] >= 0).all(), column
    assert (table["memory_estimate_mb"] > 0).all()
    report = (tmp_path / "results" / "report.html").read_text(encoding="utf-8")
    assert "recall@1" in report


def test_a_report_of_classifier_and_dual_encoder_runs_names_each_quality_and_draws_every_figure(tmp_path):
    """Mixed tasks: accuracy for the classifier, recall@1 for the dual encoder (compiled: no memory estimate,
    so the peak-memory figure draws a diamond for the classifier only)."""
    import re

    from ftbench.report import analysis, collect, report_page
    from ftbench.measure import memory_estimate
    from ftbench.report.columns import COLUMNS
    from test_report import drawn, make_run, write_fixture

    classifier = make_run(0, accuracy=0.8)
    clip = make_run(1, accuracy=None, task="image_text_retrieval", model="clip", run_id="clip-d-lora-r8-bf16-b16-s512-00000001",
                    config_id="clip-d-lora-r8-bf16-b16-s512-1234abcd", memory_estimate_mb=None, memory_estimate_ratio=None,
                    memory_estimate_note=memory_estimate.NOT_MODELLED_COMPILED, eval_samples=500, eval_recall_at_1=0.6,
                    eval_recall_at_1_i2t=0.5, eval_recall_at_1_t2i=0.7, images_per_s=50.0)
    runs = collect.typed(pd.DataFrame([classifier, clip], columns=list(COLUMNS)))
    grid = drawn("peak_memory", analysis.prepare(runs))
    # the estimate diamonds (white markers): the classifier's, at its estimate; none for the dual encoder
    estimates = [offset[0] for ax in grid.axes.flat for c in ax.collections if c.get_facecolor().size
                 and tuple(c.get_facecolor()[0][:3]) == (1.0, 1.0, 1.0) for offset in c.get_offsets()]
    assert estimates == [0.8 * 12000.0]
    metrics, files = write_fixture(tmp_path, runs, {})
    report_page.build_report(metrics, files, tmp_path / "figures", tmp_path / "report.html")
    page = (tmp_path / "report.html").read_text(encoding="utf-8")
    configurations = re.search(r'id="configurations-table">.*?</thead>', page, flags=re.S).group(0)
    assert ">accuracy</th>" in configurations and ">recall@1</th>" in configurations
    assert "Most accurate (accuracy): <b>" in page and "Most accurate (recall@1): <b>" in page


@pytest.mark.slow
@has_digits
def test_a_clip_learns_to_match_the_digits_to_their_captions(tmp_path):
    """Quality path on real images: a small CLIP from scratch on the digits captioned from their class finds
    the right caption far above chance (0.1) in 150 steps."""
    from ftbench.train import trainer

    wide = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2, "intermediate_size": 256}
    model_def = {"task": "image_text_retrieval", "source": {**CLIP_DEF["source"], "overrides": {
        "text_config": {**wide, "num_hidden_layers": 2, "max_position_embeddings": 32},
        "vision_config": {**wide, "patch_size": 4, "image_size": 16}, "projection_dim": 64}}}
    dataset_def = {**DIGITS_DEF, "caption_template": "a handwritten digit {label}", "train_size": 1400, "eval_size": 397}
    config = experiment(dataset_def, model_def, batch_size=64, max_steps=150, warmup_steps=5, learning_rate=0.001,
                        eval_batch_size=128)
    spec = matrix.expand_runs(config)[0]
    prepare(dataset_def, tmp_path, model_def)
    metrics, _ = trainer.train_run(spec, tmp_path)
    assert metrics["status"] == "ok" and metrics["eval_samples"] == 397
    assert metrics["eval_recall_at_1_i2t"] > 0.5 and metrics["eval_recall_at_1_t2i"] > 0.5, metrics
