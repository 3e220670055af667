"""Image-text retrieval (task ``image_text_retrieval``): CLIP/SigLIP-style dual encoders fine-tuned
contrastively on image + caption pairs, scored by image->text and text->image recall@1.

- Model: transformers' ``CLIPModel`` / ``SiglipModel`` (any ``AutoModel`` with a ``vision_model`` and a
  ``text_model`` whose forward takes ``return_loss``), from a checkpoint folder, a hub name or a config
  alone (random init). The loss is the model's own (``return_loss=True``): CLIP's symmetric InfoNCE over
  the batch's image-caption similarities, SigLIP's pairwise sigmoid loss. The negatives of a caption are
  the other images of its batch (with ``parallel: dp``, of its GPU's slice of the batch). Rows of a batch
  that share a caption (class captions) are negatives of each other too, as in plain CLIP training: the
  loss cannot go below about ln(copies of a caption per batch), while recall still reaches 1.
- Data: an image and a caption per row. The caption is the dataset's ``text_column``, or for a dataset
  of class labels (``pixels`` rows, or ``label_column``) ``caption_template`` with ``{label}`` replaced
  (the 8x8 digits become "a handwritten digit 3"). Preparation decodes and resizes every image once
  (data/images.py) and tokenises every caption once with the model source's tokenizer (``seq_len``), into the
  Parquet shards: the image bytes, the caption's token ids, and a caption id (rows with the same caption
  text share it). ``source: {kind: synthetic}``: random images and random token captions (throughput only).
- Tokens: an image is its patch tokens plus the class token (CLIP; SigLIP pools with an attention head
  and has no class token); a caption is its real tokens, padding excluded. ``tokens`` counts both,
  ``image_tokens_per_s`` and ``text_tokens_per_s`` give them apart. SigLIP was trained on captions padded
  to its full length without an attention mask: its batches are padded so too (the padding still does
  not count as tokens).
- Run settings: methods full / lora / qlora (``lora_targets`` name both towers' layers alike: CLIP's
  q_proj, k_proj, v_proj, out_proj, fc1, fc2), every precision, batching pad and group_by_length (captions
  by length), data_source memory or disk, parallel none or dp. Refused at parse time (``check_run``):
  packed batching, parallel ddp / fsdp and engine hf_trainer.
- Memory estimate: each tower's, as memory_estimate.py models an encoder over its own tokens (see
  ``memory_estimate`` below).
- Quality: recall@1 both ways over the whole scored eval split (a similarity matrix computed in chunks
  of rows). A retrieved item counts as correct when its caption text equals the query's: several eval
  images may share one caption (every digit 3 is "a handwritten digit 3"), and retrieving any of them is
  right. A query counts as a hit only if its best-scoring correct item scores strictly above every
  wrong one, so a tie never counts as a hit and the row order cannot change the score.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc

from ftbench.data import images, prepared, sources
from ftbench.data.tokenizers import check_vocab, load_tokenizer, vocab_refusal
from ftbench.errors import ConfigError, SourceError
from ftbench.measure import memory_estimate as estimate_module
from ftbench.runspec import RunSpec
from ftbench.tasks import text
from ftbench.tasks.base import Batch, TaskFamily, TokenisedSplit, pad
from ftbench.tasks.image_classification import ImageBatch, ImageFacts, ImageSplit, collate_images, image_tokens_per_image
from ftbench.tasks.image_classification import from_table as image_rows

TASK = "image_text_retrieval"
# Query rows per block of the eval similarity matrix: 1,024 x (eval rows) floats at a time (200 MB, and two
# masked copies, for 50,000 eval rows).
SIMILARITY_CHUNK_ROWS = 1024
# Model types whose text tower was trained on captions padded to the full length with no attention mask
# (its pooled token is the last position).
PAD_TO_LENGTH_MODEL_TYPES = ("siglip", "siglip2")
# Model types whose vision tower has no class token (pooling is an attention head over the patches).
NO_CLASS_TOKEN_MODEL_TYPES = ("siglip", "siglip2")


# ---------------------------------------------------------------------------------------------------
# Model facts (read from the config, so that preparation needs no weights)


def full_config(model_def: dict) -> dict:
    """The model's whole config as a dict, the architecture's defaults included (a config-built CLIP that
    overrides only a few sizes still has a patch size and a vocabulary)."""
    source = model_def["source"]
    if source["kind"] == "config":
        import transformers  # deferred: the registry is read at parse time, torch-free

        config_class = getattr(transformers, source["architecture"], None)
        if config_class is None:
            raise SourceError(f"model source architecture {source['architecture']!r} is not a transformers config class")
        return config_class(**source.get("overrides", {})).to_dict()
    from transformers import AutoConfig  # deferred: the registry is read at parse time, torch-free

    location = sources.resolve_location(source)
    try:
        return AutoConfig.from_pretrained(location, revision=source.get("revision")).to_dict()
    except (OSError, ValueError) as exc:
        raise SourceError(sources.load_failure("model config", source, location, exc)) from None


def towers(config: dict, where: str) -> tuple[dict, dict]:
    """(vision settings, text settings) of a dual encoder's config; a config without both is refused."""
    if not isinstance(config.get("vision_config"), dict) or not isinstance(config.get("text_config"), dict):
        raise ConfigError(f"config key {where}: {config.get('model_type')!r} is not an image-text dual encoder (its "
                          "config has no vision_config and text_config); expected e.g. CLIPConfig or SiglipConfig")
    return config["vision_config"], config["text_config"]


def image_tokens(config: dict, image_size: int) -> int:
    """Patch tokens (plus the class token, where the vision tower has one) of one image."""
    vision = config["vision_config"]
    patches = (image_size // int(vision["patch_size"])) ** 2
    return patches + (0 if config.get("model_type") in NO_CLASS_TOKEN_MODEL_TYPES else 1)


def text_max_positions(model_def: dict) -> int | None:
    """The text tower's positions as far as the config file or overrides say (parse time, no transformers)."""
    config = sources.local_model_config(model_def["source"]) or {}
    return (config.get("text_config") or {}).get("max_position_embeddings")


def end_token_id(tokenizer) -> int | None:
    """The token a caption ends with, where CLIP's text tower pools: the tokenizer's end of sequence
    (BERT-style tokenizers call it [SEP])."""
    for token_id in (tokenizer.eos_token_id, tokenizer.sep_token_id):
        if token_id is not None:
            return int(token_id)
    return None


def config_overrides(overrides: dict, spec, tokenizer) -> dict:
    """A config-built dual encoder's overrides for this run: the vision tower at the run's image size, and
    the text tower's vocabulary and special tokens those of the tokenizer the data was prepared with (CLIP
    pools at the first end-of-sequence token: with another tokenizer's id there, every caption would be
    pooled at its first token and carry nothing)."""
    overrides = dict(overrides)
    if spec.image_size:
        overrides["vision_config"] = {**overrides.get("vision_config", {}), "image_size": spec.image_size}
    if tokenizer is not None:
        text = dict(overrides.get("text_config", {}))
        vocab = text.get("vocab_size")
        if vocab is not None and vocab != len(tokenizer):
            raise ConfigError(vocab_refusal(spec.model, "text_config.vocab_size", vocab, len(tokenizer)))
        text.setdefault("vocab_size", len(tokenizer))
        start = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.cls_token_id
        for key, value in (("pad_token_id", tokenizer.pad_token_id), ("eos_token_id", end_token_id(tokenizer)),
                           ("bos_token_id", start)):
            if value is not None:
                text.setdefault(key, int(value))
        overrides["text_config"] = text
    return overrides


# ---------------------------------------------------------------------------------------------------
# Parse-time checks (the family's check_run)


def check_run(run, setting_key) -> None:
    """What a retrieval run needs before any job starts: images and captions, a tokenizer for real
    captions, captions no longer than the text tower's positions, and one process (no ddp)."""
    where = f"datasets.{run.dataset}"
    dataset_def = run.dataset_def
    source = run.model_def["source"]
    check_vocab(run.model, run.model_def, "text_config.vocab_size",
                ((source.get("overrides") or {}).get("text_config") or {}).get("vocab_size"))
    if dataset_def["source"]["kind"] != "synthetic":
        labelled = "pixels" in dataset_def or "label_column" in dataset_def
        if "text_column" not in dataset_def and not (labelled and "caption_template" in dataset_def):
            raise ConfigError(f"config key {where}.text_column: required to train model {run.model!r} ({TASK}): the "
                              "column of captions (or caption_template, for a dataset of class labels)")
        if "pixels" not in dataset_def and "image_column" not in dataset_def:
            raise ConfigError(f"config key {where}.image_column: required to train model {run.model!r} ({TASK}) "
                              "(or `pixels` for a headerless CSV of pixel rows)")
        if source["kind"] == "config" and "tokenizer" not in source:
            raise ConfigError(f"config key models.{run.model}.source.tokenizer: required to tokenise the captions of "
                              f"dataset {run.dataset!r} (without a tokenizer a config model trains on synthetic data only)")
    limit = text_max_positions(run.model_def)
    if limit is not None and run.seq_len > limit:
        raise ConfigError(f"config key {setting_key('seq_len', run.seq_len)}: {run.seq_len} exceeds the text tower of "
                          f"model {run.model!r} ({limit} positions); expected a value <= {limit}")
    if run.engine == "hf_trainer":
        # hf_engine's collator normalises image batches, but the Trainer path is not built or tested for a dual
        # encoder's contrastive loss and recall evaluation.
        raise ConfigError(f"config key {setting_key('engine', run.engine)}: run {run.run_id} ({TASK}) with engine "
                          "'hf_trainer' is not implemented by this ftbench version (its contrastive loss and recall@1 run in the "
                          "loop only); use engine loop")
    if run.parallel in ("ddp", "fsdp"):
        # One contrastive batch per process would change the loss: each rank would contrast its own slice
        # only (fewer negatives than the global batch), unless embeddings were gathered across ranks.
        raise ConfigError(f"config key {setting_key('parallel', run.parallel)}: run {run.run_id} ({TASK}) with "
                          f"parallel {run.parallel!r} is not implemented by this ftbench version; use none or dp")


# ---------------------------------------------------------------------------------------------------
# Preparation


def _caption_frames(dataset_name: str, dataset_def: dict, dropped: dict):
    """(train, eval, folder of relative image paths): frames with columns image and caption."""
    where = f"datasets.{dataset_name}"
    template = dataset_def.get("caption_template")
    roles = {"image": "image_column", "caption": "text_column"} if "text_column" in dataset_def else \
        {"image": "image_column", "label": "label_column"}
    tables, folder = images.role_tables(dataset_def, where, roles)
    for name, frame in tables.items():
        before = len(frame)
        frame = frame.dropna()
        if "caption" not in frame.columns:
            frame = frame.assign(caption=[template.replace("{label}", str(label)) for label in frame["label"]])
        frame = frame[frame["caption"].astype(str).str.strip() != ""]
        dropped[name] = {"missing_or_empty": before - len(frame)}
        tables[name] = frame.reset_index(drop=True)
    tables = images.check_images(tables, dataset_def, where, folder, dropped)
    # Stratified by class where the captions come from classes (each class in both splits).
    return (*images.train_and_eval(tables, dataset_def, where), folder)


def to_table(pixels: np.ndarray, input_ids: list, caption_ids: np.ndarray) -> pa.Table:
    """The image bytes (images.to_table; its class column holds the caption ids) and the caption tokens."""
    table = images.to_table(pixels, caption_ids).rename_columns(["pixels", "caption_id"])
    table = table.append_column("input_ids", pa.array(input_ids, type=pa.list_(pa.int32())))
    return table.append_column("length", pa.array([len(ids) for ids in input_ids], type=pa.int32()))


def prepare(dataset_name: str, dataset_def: dict, model_def: dict, seq_len: int, image_size: int | None,
            out_dir: Path, shard_size_mb: float, model_name: str) -> dict:
    where = f"models.{model_name}.source"
    config = full_config(model_def)
    vision, text = towers(config, where)
    if seq_len > text["max_position_embeddings"]:
        raise ConfigError(f"config key seq_len: {seq_len} exceeds the text tower of model {model_name!r} "
                          f"({text['max_position_embeddings']} positions); expected a value <= {text['max_position_embeddings']}")
    size = int(image_size or vision["image_size"])
    mean, std, processor_class = images.processor_stats(model_def)
    tokenizer = load_tokenizer(model_def)
    dropped: dict = {}
    channels = images.CHANNELS
    if dataset_def["source"]["kind"] == "synthetic":
        rng = np.random.default_rng(dataset_def.get("split_seed", 0))
        vocab = len(tokenizer) if tokenizer is not None else int(text["vocab_size"])
        end = end_token_id(tokenizer) if tokenizer is not None else text.get("eos_token_id")
        low = min(100, vocab // 2)  # skip the special tokens at the start of most vocabularies
        tables = {}
        for split_name, default in sources.SYNTHETIC_SPLIT_ROWS.items():
            rows = dataset_def.get(f"{split_name}_size", default)
            ids = rng.integers(low, vocab, size=(rows, seq_len), dtype=np.int64)
            if end is not None and end < vocab:
                ids[:, -1] = end  # where CLIP's text tower pools
            tables[split_name] = to_table(rng.integers(0, 256, size=(rows, size, size, channels), dtype=np.uint8),
                                          ids.tolist(), np.arange(rows))
    else:
        if tokenizer is None:
            raise ConfigError(f"config key {where}.tokenizer: required to tokenise the captions of dataset {dataset_name!r}")
        train, evaluation, folder = _caption_frames(dataset_name, dataset_def, dropped)
        tables = {}
        for split_name, frame in zip(prepared.SPLITS, (train, evaluation)):
            captions = frame["caption"].astype(str).tolist()
            # The caption id says which rows share a caption text (recall counts any of them as right).
            caption_ids, distinct = pd.factorize(pd.Series(captions, dtype=object))
            if split_name == "eval" and len(distinct) < 2:
                raise ConfigError(f"config key datasets.{dataset_name}: the eval split has {len(distinct)} distinct "
                                  "caption(s); retrieval needs at least 2 (recall would be 1.0 by construction)")
            pixels = np.stack([images.decode(value, size, folder) for value in frame["image"]]) if len(frame) else \
                np.zeros((0, size, size, channels), dtype=np.uint8)
            input_ids = tokenizer(captions, truncation=True, max_length=seq_len)["input_ids"] if captions else []
            tables[split_name] = to_table(pixels, input_ids, caption_ids)

    per_image = image_tokens(config, size)
    manifest = images.image_manifest(
        TASK, dataset_name, dataset_def, model_name, model_def, seq_len, image_size, size, (mean, std, processor_class),
        per_image, dropped, shard_size_mb,
        tokenizer=model_def["source"].get("tokenizer") if model_def["source"]["kind"] == "config" else model_def["source"],
        tokenizer_class=type(tokenizer).__name__ if tokenizer is not None else None,
        pad_token_id=tokenizer.pad_token_id if tokenizer is not None else int(text.get("pad_token_id") or 0),
        vocab_size=len(tokenizer) if tokenizer is not None else int(text["vocab_size"]),
        # SigLIP's captions are padded to seq_len with no attention mask (see the module docstring).
        pad_to_length=config.get("model_type") in PAD_TO_LENGTH_MODEL_TYPES,
        interpolate_pos_encoding=model_def["source"]["kind"] != "config" and size != vision["image_size"])
    return images.write_image_shards(manifest, tables, out_dir, lambda table: {
        "text_tokens": int(pc.sum(table["length"]).as_py() or 0),
        "distinct_captions": len(np.unique(table["caption_id"].to_numpy()))})


# ---------------------------------------------------------------------------------------------------
# Reading back and batching


@dataclass(frozen=True)
class CaptionFacts:
    pad_token_id: int
    pad_to_length: int | None  # pad every caption to this many positions (SigLIP), else to the batch's longest


@dataclass
class RetrievalSplit:
    """Image-caption pairs: the images (their ``labels`` are the caption ids) and the captions' tokens."""

    pictures: ImageSplit
    captions: TokenisedSplit
    caption_facts: CaptionFacts

    def __len__(self) -> int:
        return len(self.pictures)

    @property
    def caption_ids(self) -> np.ndarray:
        return self.pictures.labels

    def take(self, indices: np.ndarray) -> "RetrievalSplit":
        return RetrievalSplit(self.pictures.take(indices), self.captions.take(indices), self.caption_facts)

    def lengths(self) -> np.ndarray:
        """Caption lengths (every image has the same tokens): what length-grouped batching sorts by."""
        return self.captions.lengths()


def caption_facts(manifest: dict) -> CaptionFacts:
    return CaptionFacts(manifest["pad_token_id"], manifest["seq_len"] if manifest["pad_to_length"] else None)


def from_table(table: pa.Table, facts: ImageFacts, captions: CaptionFacts) -> RetrievalSplit:
    pictures = image_rows(table.select(["pixels", "caption_id"]).rename_columns(["pixels", "label"]), facts)
    return RetrievalSplit(pictures, text.from_table(table.select(["input_ids", "length"])), captions)


def load_split(shards: list[Path], manifest: dict, data_source: str):
    facts, captions = ImageFacts.of(manifest), caption_facts(manifest)
    return prepared.read_split(shards, lambda table: from_table(table, facts, captions), data_source)


@dataclass
class RetrievalBatch(ImageBatch):
    """An ImageBatch with captions: ``inputs`` are the model's (pixels, caption tokens, return_loss);
    ``caption_ids`` say which rows share a caption text (for scoring, not for the model)."""

    caption_ids: np.ndarray | None = None


def collate(split, indices: np.ndarray) -> RetrievalBatch:
    """A batch of pairs: images as image_classification.collate_images makes them, captions padded (to the batch's longest, or
    to seq_len for SigLIP). Real tokens are the image tokens plus the unpadded caption tokens."""
    import torch  # deferred: the registry is read at parse time, torch-free

    rows = split.take(np.asarray(indices))
    pictures = collate_images(rows.pictures, np.arange(len(rows)))
    facts = rows.caption_facts
    sequences = rows.captions.input_ids
    if facts.pad_to_length:
        sequences = sequences + [np.zeros(facts.pad_to_length, dtype=np.int64)]  # a row that sets the padded width
    ids, mask = pad(sequences, facts.pad_token_id)
    if facts.pad_to_length:
        ids, mask = ids[:-1], mask[:-1]
    inputs = {key: value for key, value in pictures.inputs.items() if key != "labels"}
    inputs.update(input_ids=torch.from_numpy(ids), return_loss=True)
    if not facts.pad_to_length:
        inputs["attention_mask"] = torch.from_numpy(mask)
    lengths = mask.sum(axis=1)
    text = int(lengths.sum())
    return RetrievalBatch(
        inputs=inputs, samples=pictures.samples, real_tokens=pictures.image_tokens + text,
        padded_tokens=pictures.image_tokens + int(mask.size),
        sum_squared_lengths=pictures.sum_squared_lengths + int((lengths * lengths).sum()),
        images=pictures.images, image_tokens=pictures.image_tokens, facts=pictures.facts, caption_ids=rows.caption_ids)


# ---------------------------------------------------------------------------------------------------
# Scoring


def hits(similarity, query_ids, key_ids):
    """For each query row of ``similarity`` (queries x keys): whether its best-scoring correct key (same
    caption id) scores strictly above every wrong key. A tie between a right and a wrong key is a miss."""
    import torch  # deferred: the registry is read at parse time, torch-free

    same = query_ids[:, None] == key_ids[None, :]
    best_right = torch.where(same, similarity, torch.full_like(similarity, -torch.inf)).amax(dim=1)
    best_wrong = torch.where(same, torch.full_like(similarity, -torch.inf), similarity).amax(dim=1)
    return best_right > best_wrong


def recall_at_1(image_embeds, text_embeds, caption_ids, chunk_rows: int = SIMILARITY_CHUNK_ROWS) -> tuple[float, float]:
    """(image->text, text->image) recall@1 over all rows: each image's query against every caption and
    each caption's against every image, cosine similarity (the embeddings are L2-normalised here), the
    matrix taken ``chunk_rows`` query rows at a time."""
    import torch  # deferred: the registry is read at parse time, torch-free

    images_n = torch.nn.functional.normalize(image_embeds.float(), dim=-1)
    texts_n = torch.nn.functional.normalize(text_embeds.float(), dim=-1)
    ids = torch.as_tensor(caption_ids, device=images_n.device)
    found = []
    for queries, keys in ((images_n, texts_n), (texts_n, images_n)):
        count = 0
        for start in range(0, len(queries), chunk_rows):
            block = queries[start:start + chunk_rows] @ keys.T
            count += int(hits(block, ids[start:start + chunk_rows], ids).sum())
        found.append(count / len(queries))
    return found[0], found[1]


class RecallAccumulator:
    """The eval accumulator of retrieval (text.ClassAccumulator's interface): keeps every scored pair's
    embeddings, then recall@1 over all of them, and the mean contrastive loss of the eval batches (which
    depends on eval_batch_size: the negatives are the batch's)."""

    METRICS = ("eval_loss", "eval_recall_at_1_i2t", "eval_recall_at_1_t2i", "eval_recall_at_1")  # what result() gives

    def __init__(self):
        self.image_embeds, self.text_embeds, self.caption_ids = [], [], []
        self.loss_sum = 0.0
        self.count = 0

    def add(self, output, batch: RetrievalBatch) -> None:
        self.image_embeds.append(output.image_embeds.detach().float())
        self.text_embeds.append(output.text_embeds.detach().float())
        self.caption_ids.append(np.asarray(batch.caption_ids))
        self.loss_sum += float(output.loss.mean()) * batch.samples
        self.count += batch.samples

    def result(self) -> dict:
        if self.count == 0:
            return {}
        import torch  # deferred: the registry is read at parse time, torch-free

        image_to_text, text_to_image = recall_at_1(torch.cat(self.image_embeds), torch.cat(self.text_embeds),
                                                   np.concatenate(self.caption_ids))
        return {"eval_loss": self.loss_sum / self.count, "eval_recall_at_1_i2t": image_to_text,
                "eval_recall_at_1_t2i": text_to_image, "eval_recall_at_1": (image_to_text + text_to_image) / 2}


def memory_estimate(model, spec, manifest: dict) -> dict:
    """Each tower as memory_estimate.py models an encoder stack (layer norm, plain MLP, no logits over a
    vocabulary), over its own tokens: the vision tower over the image tokens, the text tower over seq_len
    caption tokens (the longest a batch pads to: an upper bound for captions of several lengths). The parts
    are added up and the peak taken of the sum. Left out: the projections (under 1% of CLIP's parameters)
    and the batch x batch similarities of the loss."""
    parts: dict = {}
    for tower, tokens in ((model.vision_model, manifest["image_tokens_per_image"]), (model.text_model, manifest["seq_len"])):
        figures = estimate_module.estimate(tower, spec.replace(seq_len=tokens), None)
        if figures["memory_estimate_mb"] is None:
            return figures  # not modelled (a compiled run), with the reason
        for name, value in figures["memory_estimate_parts_mb"].items():
            value *= estimate_module.MIB
            # one process, one set of cuBLAS workspaces: the towers share them
            parts[name] = max(parts.get(name, 0.0), value) if name == "workspace" else parts.get(name, 0.0) + value
    return estimate_module.figures(parts)


# ---------------------------------------------------------------------------------------------------
# The family


class ImageTextRetrieval(TaskFamily):
    name = TASK
    estimate_needs_model = True  # two stacks: the plan builds the model on the meta device
    auto_model = "AutoModel"
    # No new head: the towers' projections are the model's own.
    column_keys = ("image_column", "text_column", "label_column")
    modality = "image"
    images_beside_text = True  # the captions are input_ids, the images' tokens come beside them
    not_packable = "a dual encoder pairs each caption with its image and pools one token per caption; use group_by_length"

    def config_overrides(self, overrides: dict, spec: RunSpec) -> dict:
        """The towers' nested configs: image size, the tokenizer's vocabulary."""
        return config_overrides(overrides, spec, load_tokenizer(spec.model_def))

    def check_run(self, run: RunSpec, setting_key) -> None:
        check_run(run, setting_key)

    def tokens_per_example(self, run: RunSpec) -> int:
        """An image is its patch tokens (the parse-time estimate counts the vision tower's), whatever seq_len says."""
        return image_tokens_per_image(sources.local_model_config(run.model_def["source"]), run.image_size)

    def prepare(self, dataset_name: str, dataset_def: dict, model_def: dict, seq_len: int, out_dir: Path,
                shard_size_mb: float, model_name: str, image_size: int | None = None) -> dict:
        out_dir = Path(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        return prepare(dataset_name, dataset_def, model_def, seq_len, image_size, out_dir, shard_size_mb, model_name)

    def load_split(self, shards: list[Path], manifest: dict, data_source: str):
        return load_split(shards, manifest, data_source)

    def collate(self, split, indices: np.ndarray, pad_token_id: int) -> Batch:
        return collate(split, indices)

    def row_strata(self, split) -> np.ndarray:
        """Caption ids: a partial evaluation keeps each caption's share (class captions: each class's)."""
        return np.asarray(split.caption_ids)

    def eval_accumulator(self):
        return RecallAccumulator()

    def memory_estimate(self, model, spec: RunSpec, manifest: dict) -> dict:
        return memory_estimate(model, spec, manifest)


FAMILY = ImageTextRetrieval()
