"""Vision-language decoders (task ``vision_language``): a LLaVA-style model (a vision tower, a projector and
a language model; transformers' LlavaForConditionalGeneration) trained on image + prompt -> answer.

The sequence the decoder sees, stored once at preparation (Parquet shards with the image pixels):

    [bos] <image> x N  prompt tokens  answer tokens [eos]

N is the number of image features the vision tower hands the decoder (``vision_language_image_tokens``:
its patches, plus its class token unless vision_feature_select_strategy 'default' drops it); LLaVA replaces
the N placeholder tokens with them. ``labels`` are -100 everywhere but the answer tokens (and the end
token), so the loss, eval loss, perplexity and token accuracy are over the answer alone. ``seq_len`` caps
the text tokens (bos, prompt, answer, end); the image tokens come on top of it.

Token counts (image_classification.py's convention): ``tokens`` is everything the decoder processes, text and image
tokens; ``image_tokens_per_s`` and ``text_tokens_per_s`` are the two apart (text: real, unpadded). The
vision tower's own tokens (N, plus the class token 'default' drops) are counted in the FLOPs only
(flops.py).

Sources of a dataset: those of image classification (data/images.py: image folder + CSV/JSON, save_to_disk
folder with an Image feature, csv/parquet with paths or bytes, headerless pixel rows) with a prompt
(``prompt_column``, or one ``prompt`` for every row) and an answer (``answer_column``; pixel rows: the
class, or ``answers[class]``), and ``source: {kind: synthetic}`` (random pixels and tokens; prompt of
seq_len - target_len tokens, answer of target_len, default seq_len / 4).
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc

from ftbench.data import images, prepared, sources
from ftbench.data.tokenizers import SYNTHETIC_PAD_ID, check_vocab, load_tokenizer, tokenizer_source
from ftbench.errors import ConfigError, SourceError
from ftbench.measure import memory_estimate as estimate_module
from ftbench.recipe import recipe_of
from ftbench.runspec import RunSpec
from ftbench.tasks.base import IGNORE_INDEX, Batch, TaskFamily, pad
from ftbench.tasks.image_classification import ImageBatch, ImageFacts
from ftbench.tasks.text import TokenAccumulator

IMAGE_TOKEN = "<image>"  # LLaVA's placeholder, added to a tokenizer that lacks one
SUPPORTED_MODEL_TYPES = ("llava",)
# A LLaVA model's vision towers and the class tokens each puts before its patch tokens.
VISION_CLASS_TOKENS = {"clip_vision_model": 1, "siglip_vision_model": 0}
# LlavaConfig's vision tower when a config names none (CLIP ViT-L/14 at 336), and CLIPVisionConfig's defaults.
LLAVA_DEFAULT_VISION = {"model_type": "clip_vision_model", "image_size": 336, "patch_size": 14}
CLIP_VISION_DEFAULTS = {"image_size": 224, "patch_size": 32}


# ---------------------------------------------------------------------------------------------------
# The model's facts the data depends on


def vision_language_image_tokens(model_config: dict | None, image_size: int | None) -> int:
    """Image tokens a LLaVA-style model puts in its text per image at ``image_size`` (null: the vision
    tower's own): the vision tower's patches plus its class token, less the first token when
    vision_feature_select_strategy is 'default' (LLaVA's get_image_features drops it). Reads a config dict
    only (parse time; preparation passes ``config.to_dict()``, where every default is filled in)."""
    model_config = model_config or {}
    tokens = vision_tower_tokens(model_config, image_size)
    return tokens - 1 if model_config.get("vision_feature_select_strategy", "default") == "default" else tokens


def vision_tower_tokens(model_config: dict | None, image_size: int | None) -> int:
    """Tokens the vision tower processes per image at ``image_size`` (null: its own): its patches and class token."""
    vision = {**CLIP_VISION_DEFAULTS, **((model_config or {}).get("vision_config") or LLAVA_DEFAULT_VISION)}
    size = int(image_size or vision["image_size"])
    return (size // int(vision["patch_size"])) ** 2 + VISION_CLASS_TOKENS.get(vision.get("model_type"), 1)


def load_config(model_def: dict, model_name: str, image_size: int | None = None, extra: dict | None = None):
    """The model's transformers config (a config-built model's as its overrides and ``extra`` make it, at
    ``image_size``), refused with one line unless it is a LLaVA model."""
    import transformers  # deferred: the registry is read at parse time, torch-free

    source = model_def["source"]
    if source["kind"] == "config":
        config_class = getattr(transformers, source["architecture"], None)
        if config_class is None:
            raise SourceError(f"model source architecture {source['architecture']!r} is not a transformers config class")
        config = config_class(**copy.deepcopy(source.get("overrides", {})), **(extra or {}))
        if image_size:
            config.vision_config.image_size = int(image_size)  # a random-init tower is built for the run's size
    else:
        location, kwargs = sources.pretrained_args(source)
        kwargs.pop("gguf_file", None)
        config = transformers.AutoConfig.from_pretrained(location, **kwargs)
    if config.model_type not in SUPPORTED_MODEL_TYPES or config.vision_config.model_type not in VISION_CLASS_TOKENS:
        raise ConfigError(f"config key models.{model_name}.source: task vision_language takes LLaVA models (model_type "
                          f"llava with a vision tower of type {', '.join(VISION_CLASS_TOKENS)}); this one is "
                          f"{config.model_type!r} with {getattr(getattr(config, 'vision_config', None), 'model_type', None)!r}")
    return config


@dataclass
class TextFacts:
    """The tokenizer side: the same at preparation and when the model is built (one function makes both)."""

    tokenizer: object | None  # None: a config-built model without one (synthetic data only)
    image_token_id: int
    vocab_size: int
    pad_token_id: int


def text_facts(model_def: dict, config, model_name: str, check_overrides: bool = True) -> TextFacts:
    """The tokenizer with the image placeholder (added if it lacks one) and the ids the model must use.
    A checkpoint's config must already name its tokenizer's placeholder id. ``check_overrides``: refuse a
    config-built model's overrides that contradict the tokenizer (in the model's own job, not at preparation:
    other models share the data)."""
    tokenizer = load_tokenizer(model_def)
    source = model_def["source"]
    text_vocab = config.text_config.vocab_size
    if tokenizer is None:
        # Random tokens only: keep the placeholder inside the vocabulary (LlavaConfig's default, 32000, is
        # just past a default Llama's 32,000 embeddings).
        image_id = config.image_token_id if config.image_token_id < text_vocab else text_vocab - 1
        return TextFacts(None, image_id, text_vocab, SYNTHETIC_PAD_ID)
    token = getattr(tokenizer, "image_token", None) or IMAGE_TOKEN
    if token not in tokenizer.get_vocab():
        tokenizer.add_tokens([token], special_tokens=True)
    image_id = tokenizer.convert_tokens_to_ids(token)
    overrides = source.get("overrides", {})
    if source["kind"] != "config" and config.image_token_id != image_id:
        raise SourceError(f"model source {sources.resolve_location(source)}: its config's image_token_index "
                          f"{config.image_token_id} is not its tokenizer's {token} id {image_id}")
    if source["kind"] == "config" and check_overrides:
        for key, value, wanted in (("image_token_index", overrides.get("image_token_index"), image_id),
                                   ("text_config.vocab_size", (overrides.get("text_config") or {}).get("vocab_size"), len(tokenizer))):
            if value is not None and value != wanted:
                raise ConfigError(f"config key models.{model_name}.source.overrides.{key}: {value}, but the tokenizer "
                                  f"(with {token} added) gives {wanted}; remove it (the model then takes the tokenizer's)")
    if source["kind"] == "config":
        text_vocab = len(tokenizer)
    return TextFacts(tokenizer, image_id, text_vocab, tokenizer.pad_token_id)


def config_for_run(spec, extra: dict):
    """A config-built model's config for a run: its image size, and its tokenizer's vocabulary, placeholder
    and pad ids (the family's make_config: modeling.build_model builds the model from it)."""
    config = load_config(spec.model_def, spec.model, spec.image_size, extra)
    facts = text_facts(spec.model_def, config, spec.model)
    config.text_config.vocab_size = facts.vocab_size
    config.image_token_id = facts.image_token_id
    config.text_config.pad_token_id = facts.pad_token_id
    return config


# ---------------------------------------------------------------------------------------------------
# Preparation


def _answer_text(value, answers: list | None, where: str) -> str:
    """A pixel-row dataset's class as its answer: ``answers[class]``, else the class itself."""
    if answers is None:
        return str(value)
    if not 0 <= int(value) < len(answers):
        raise ConfigError(f"config key {where}.answers: {len(answers)} answers (classes 0 to {len(answers) - 1}), but "
                          f"class {value} occurs; give one answer per class")
    return str(answers[int(value)])


def load_rows(dataset_name: str, dataset_def: dict, dropped: dict) -> tuple[pd.DataFrame, pd.DataFrame, Path | None]:
    """(train, eval, image folder): frames with columns image, prompt and answer."""
    roles = {"image": "image_column", "answer": "answer_column"}
    if "prompt" not in dataset_def:
        roles["prompt"] = "prompt_column"
    train, evaluation, folder = images.load_image_splits(dataset_name, dataset_def, dropped, roles)
    frames = []
    for frame in (train, evaluation):
        if "label" in frame.columns:  # pixel rows: the class is the answer
            answers = dataset_def.get("answers")
            frame = frame.assign(answer=[_answer_text(value, answers, f"datasets.{dataset_name}") for value in frame["label"]])
        if "prompt" in dataset_def:
            frame = frame.assign(prompt=dataset_def["prompt"])
        frames.append(frame[["image", "prompt", "answer"]].astype({"prompt": str, "answer": str}))
    return frames[0], frames[1], folder


def encode(facts: TextFacts, prompts: list[str], answers: list[str], seq_len: int, image_tokens: int):
    """(input ids, labels) per row: [bos] <image> x N prompt answer [end]; labels -100 but on the answer and
    end. The text (bos, prompt, answer, end) is cut to ``seq_len``: the prompt keeps room for one answer
    token, the answer is cut at its end. A row whose answer has no token is left out (None)."""
    tokenizer = facts.tokenizer
    prompt_ids = tokenizer(prompts, add_special_tokens=False)["input_ids"]
    answer_ids = tokenizer(answers, add_special_tokens=False)["input_ids"]
    bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    # The end token teaches the model to stop; a tokenizer without eos (BERT's) ends with its separator.
    end_id = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else tokenizer.sep_token_id
    end = [end_id] if end_id is not None else []
    rows = []
    for prompt, answer in zip(prompt_ids, answer_ids):
        if not answer:
            rows.append(None)
            continue
        budget = seq_len - len(bos)
        prompt = prompt[: budget - 1]
        answer = (answer + end)[: budget - len(prompt)]
        head = bos + [facts.image_token_id] * image_tokens + prompt
        rows.append((head + answer, [IGNORE_INDEX] * len(head) + answer))
    return rows


def to_table(pixels: np.ndarray, input_ids: list, labels: list, image_tokens: int) -> pa.Table:
    """Pixels (images.to_table's layout), the full token sequence, its labels, and its lengths."""
    table = images.to_table(pixels, np.zeros(len(pixels), dtype=np.int64)).drop_columns(["label"])
    lengths = [len(ids) for ids in input_ids]
    return (table.append_column("input_ids", pa.array(input_ids, type=pa.list_(pa.int32())))
            .append_column("labels", pa.array(labels, type=pa.list_(pa.int32())))
            .append_column("length", pa.array(lengths, type=pa.int32()))
            .append_column("text_length", pa.array([length - image_tokens for length in lengths], type=pa.int32())))


def _synthetic_tables(dataset_def: dict, facts: TextFacts, seq_len: int, size: int, image_tokens: int) -> dict:
    """Random pixels and tokens: a prompt of seq_len - target_len tokens, then an answer of target_len."""
    rng = np.random.default_rng(dataset_def.get("split_seed", 0))
    answer_len = min(dataset_def["source"].get("target_len", max(1, seq_len // 4)), seq_len)
    low = min(100, facts.vocab_size // 2)  # skip the special tokens at the start of most vocabularies
    tables = {}
    for split_name, default in sources.SYNTHETIC_SPLIT_ROWS.items():
        rows = dataset_def.get(f"{split_name}_size", default)
        text = rng.integers(low, facts.vocab_size, size=(rows, seq_len), dtype=np.int64)
        text[text == facts.image_token_id] = low  # the placeholder only where the image goes
        head = np.full((rows, image_tokens), facts.image_token_id, dtype=np.int64)
        ids = np.concatenate([head, text], axis=1)
        labels = ids.copy()
        labels[:, : image_tokens + seq_len - answer_len] = IGNORE_INDEX
        pixels = rng.integers(0, 256, size=(rows, size, size, images.CHANNELS), dtype=np.uint8)
        tables[split_name] = to_table(pixels, ids.tolist(), labels.tolist(), image_tokens)
    return tables


def prepare(dataset_name: str, dataset_def: dict, model_def: dict, seq_len: int, image_size: int | None,
            out_dir: Path, shard_size_mb: float, model_name: str) -> dict:
    config = load_config(model_def, model_name, image_size if model_def["source"]["kind"] == "config" else None)
    native = int(config.vision_config.image_size)
    size = int(image_size or native)
    if size != native:
        # LLaVA's vision tower has position embeddings for its own size and does not interpolate them.
        raise ConfigError(f"config key image_size: {size}, but model {model_name!r}'s vision tower is built for {native} "
                          "(a LLaVA checkpoint does not interpolate its position embeddings); use image_size "
                          f"{native} or null")
    facts = text_facts(model_def, config, model_name, check_overrides=False)
    config_dict = config.to_dict()
    per_image = vision_language_image_tokens(config_dict, size)
    vision_tokens = vision_tower_tokens(config_dict, size)
    mean, std, processor_class = images.processor_stats(model_def)
    dropped: dict = {}
    if dataset_def["source"]["kind"] == "synthetic":
        tables = _synthetic_tables(dataset_def, facts, seq_len, size, per_image)
    else:
        if facts.tokenizer is None:
            raise ConfigError(f"config key models.{model_name}.source.tokenizer: required to tokenise the prompts and "
                              f"answers of dataset {dataset_name!r}")
        train, evaluation, folder = load_rows(dataset_name, dataset_def, dropped)
        tables = {}
        for split_name, frame in zip(prepared.SPLITS, (train, evaluation)):
            encoded = encode(facts, frame["prompt"].tolist(), frame["answer"].tolist(), seq_len, per_image)
            keep = [index for index, row in enumerate(encoded) if row is not None]
            dropped.setdefault(split_name, {})["empty_answer"] = len(encoded) - len(keep)
            pixels = np.stack([images.decode(frame["image"].iloc[index], size, folder) for index in keep]) if keep else \
                np.zeros((0, size, size, images.CHANNELS), dtype=np.uint8)
            tables[split_name] = to_table(pixels, [encoded[i][0] for i in keep], [encoded[i][1] for i in keep], per_image)

    manifest = images.image_manifest(
        "vision_language", dataset_name, dataset_def, model_name, model_def, seq_len, image_size, size,
        (mean, std, processor_class), per_image, dropped, shard_size_mb,
        tokenizer=tokenizer_source(model_def),
        tokenizer_class=type(facts.tokenizer).__name__ if facts.tokenizer is not None else None,
        pad_token_id=facts.pad_token_id, vocab_size=facts.vocab_size, image_token_id=facts.image_token_id,
        # image_tokens_per_image: the placeholders in the text, what the decoder sees per image;
        vision_tokens_per_image=vision_tokens)  # what the vision tower processes per image
    return images.write_image_shards(manifest, tables, out_dir,
                                     lambda table: {"text_tokens": int(pc.sum(table["text_length"]).as_py() or 0)})


# ---------------------------------------------------------------------------------------------------
# Training side


@dataclass(frozen=True)
class Facts:
    image: ImageFacts
    vision_tokens_per_image: int

    @classmethod
    def of(cls, manifest: dict) -> "Facts":
        return cls(ImageFacts.of(manifest), manifest["vision_tokens_per_image"])


@dataclass
class Split:
    """Rows in memory: uint8 images (N x H x W x 3), token ids and labels of each row."""

    pixels: np.ndarray
    input_ids: list[np.ndarray]
    labels: list[np.ndarray]
    facts: Facts

    def __len__(self) -> int:
        return len(self.input_ids)

    def take(self, indices: np.ndarray) -> "Split":
        return Split(self.pixels[indices], [self.input_ids[i] for i in indices], [self.labels[i] for i in indices], self.facts)

    def lengths(self) -> np.ndarray:
        """Sequence length of every row, image tokens included (length-grouped batching sorts by it)."""
        return np.array([len(ids) for ids in self.input_ids], dtype=np.int64)


def from_table(table: pa.Table, facts: Facts) -> Split:
    def arrays(column: str) -> list[np.ndarray]:
        return [np.asarray(row, dtype=np.int64) for row in table[column].to_pylist()]

    return Split(images.pixels_of(table, facts.image.image_size), arrays("input_ids"), arrays("labels"), facts)


def load_split(shards: list[Path], manifest: dict, data_source: str):
    facts = Facts.of(manifest)
    return prepared.read_split(shards, lambda table: from_table(table, facts), data_source)


def collate(split, indices: np.ndarray, pad_token_id: int):
    """A padded batch: uint8 pixels (normalised on the device, ImageBatch.to), ids, mask, labels.
    Real tokens: each row's unpadded length, its image tokens included; image tokens counted apart."""
    import torch  # deferred: the registry is read at parse time, torch-free

    rows = split.take(np.asarray(indices))
    ids, mask = pad(rows.input_ids, pad_token_id)
    labels, _ = pad(rows.labels, IGNORE_INDEX)
    lengths = mask.sum(axis=1)
    count = len(rows)
    facts = rows.facts
    vision = facts.vision_tokens_per_image
    inputs = {"pixel_values": torch.from_numpy(np.ascontiguousarray(rows.pixels)), "input_ids": torch.from_numpy(ids),
              "attention_mask": torch.from_numpy(mask), "labels": torch.from_numpy(labels)}
    return ImageBatch(inputs=inputs, samples=count, real_tokens=int(lengths.sum()), padded_tokens=int(mask.size),
                             sum_squared_lengths=int((lengths * lengths).sum()), images=count,
                             image_tokens=count * facts.image.tokens_per_image, vision_tokens=count * vision,
                             vision_sum_squared_lengths=count * vision * vision, facts=facts.image)


def lora_target_modules(model, spec) -> list[str]:
    """The full names of the Linear layers LoRA adapts: the language model's that ``lora_targets`` names
    (all-linear: every one; its lm_head never), and the projector's (linear_1, linear_2) when named. The
    vision tower is never adapted: under LoRA it stays frozen."""
    import torch  # deferred: the registry is read at parse time, torch-free

    named = spec.lora_targets != "all-linear"
    chosen, projector = [], []
    for name, module in model.named_modules():
        if not isinstance(module, torch.nn.Linear):
            continue
        short = name.rsplit(".", 1)[-1]
        dotted = f".{name}."
        if ".language_model." in dotted and (not named or short in spec.lora_targets):
            chosen.append(name)
        elif ".multi_modal_projector." in dotted:
            projector.append(short)
            if named and short in spec.lora_targets:
                chosen.append(name)
    if not chosen:
        raise ConfigError(f"config key lora_targets: {spec.lora_targets} names no Linear layer of model {spec.model!r}'s "
                          f"language model or projector ({', '.join(sorted(set(projector)))}); its vision tower is not adapted")
    return chosen


def memory_estimate(model, spec: RunSpec, manifest: dict) -> dict:
    """memory_estimate.py's decoder model over the decoder's whole rows (the text tokens and the image features
    placed among them, with logits over all of them; ``longest_row`` beside the manifest's keys, when given, is
    the longest), with the whole model's weights, gradients and optimizer
    state, plus the vision tower's activations as its encoder model over the tower's own tokens, only where the
    tower trains (full fine-tuning): frozen, and fed pixels that need no gradient, it keeps nothing for the
    backward pass, and neither does autocast keep 16-bit copies of its weights. Left out: the projector's
    activations (two Linears over the image features, small beside either tower's)."""
    if spec.compile:
        return estimate_module.estimate(model, spec, None)  # not modelled, with the reason
    if spec.precision == "bf16_true":  # its vision tower's LayerNorm layers were not traced with bf16 weights
        return estimate_module.no_estimate(estimate_module.NOT_MODELLED_BF16_TRUE)
    tower, language_model = submodule(model, "vision_tower"), submodule(model, "language_model")
    if tower is None or language_model is None:
        return estimate_module.no_estimate("not modelled: the model has no module named vision_tower and language_model (LLaVA's)")
    whole = estimate_module.facts_of(model)
    decoder = dataclasses.replace(estimate_module.facts_of(language_model), quantised=whole.quantised, other=whole.other,
                                  trainable=whole.trainable, head=whole.head, head_trainable=whole.head_trainable)
    # The decoder's rows: the longest in the data where the caller read it (prompts and answers are often far
    # shorter than seq_len allows), else the most they can hold.
    row = manifest.get("longest_row") or manifest["seq_len"] + manifest["image_tokens_per_image"]
    parts = estimate_module.estimate_parts(decoder, spec.replace(seq_len=row), decoder.shape.vocab_size)
    vision = estimate_module.facts_of(tower)
    if vision.trainable:
        tokens = manifest["vision_tokens_per_image"]
        own = estimate_module.activation_parts(vision, spec.replace(seq_len=tokens), estimate_module.computes_in_16_bit(spec),
                                              spec.batch_size * tokens, tokens)
        parts["activations"] += own["activations"]
        parts["recompute"] = max(parts["recompute"], own["recompute"])  # one layer recomputed at a time
    elif parts["weight_copies"] and not spec.gradient_checkpointing and not recipe_of(spec).sixteen_bit_base:
        # a frozen fp32 tower is not cast by autocast (it runs without autocast's copies); a 16-bit base has none
        # counted to take away (only the fp32 adapters are copied)
        parts["weight_copies"] -= 2 * vision.other
    return estimate_module.figures(parts)


def submodule(model, name: str):
    """The outermost module called ``name`` in a LLaVA model, however wrapped (peft puts it under
    base_model.model); None if there is none."""
    return next((module for path, module in model.named_modules() if path == name or path.endswith(f".{name}")), None)


# ---------------------------------------------------------------------------------------------------
# Parse-time rules


def check_run(run: RunSpec, setting_key) -> None:
    """A vision-language run needs images, a prompt and an answer per row, a LLaVA model, and a tokenizer
    for real text; the hf_trainer engine does not count its images."""
    where = f"datasets.{run.dataset}"
    dataset_def, source = run.dataset_def, run.model_def["source"]
    if run.engine == "hf_trainer":
        raise ConfigError(f"config key {setting_key('engine', run.engine)}: run {run.run_id} (vision_language) "
                          "with engine 'hf_trainer' is not implemented (it counts no images or image tokens); use engine 'loop'")
    if run.parallel == "fsdp":  # fsdp.py shards decoder layers of text models; a LLaVA's towers are not planned for
        raise ConfigError(f"config key {setting_key('parallel', run.parallel)}: run {run.run_id} (vision_language) "
                          "with parallel 'fsdp' is not implemented by this ftbench version; use none or dp")
    if source["kind"] == "config" and source["architecture"] != "LlavaConfig":
        raise ConfigError(f"config key models.{run.model}.source.architecture: {source['architecture']!r}; task "
                          "vision_language builds LLaVA models: expected 'LlavaConfig'")
    check_vocab(run.model, run.model_def, "text_config.vocab_size",
                ((source.get("overrides") or {}).get("text_config") or {}).get("vocab_size"), (IMAGE_TOKEN,))
    if dataset_def["source"]["kind"] == "synthetic":
        return
    needed = [] if "pixels" in dataset_def else ["image_column", "answer_column"]
    if "prompt" not in dataset_def:
        needed.append("prompt_column")
    for key in needed:
        if key not in dataset_def:
            alternative = " (or `prompt`: one prompt for every row)" if key == "prompt_column" else \
                " (or `pixels` for a headerless CSV of pixel rows, whose class is the answer)"
            raise ConfigError(f"config key {where}.{key}: required to train model {run.model!r} (vision_language){alternative}")
    if source["kind"] == "config" and "tokenizer" not in source:
        raise ConfigError(f"config key models.{run.model}.source.tokenizer: required to tokenise the prompts and answers of "
                          f"dataset {run.dataset!r} (without a tokenizer a config model trains on synthetic data only)")


# ---------------------------------------------------------------------------------------------------
# The family


class VisionLanguage(TaskFamily):
    name = "vision_language"
    estimate_needs_model = True  # two stacks: the plan builds the model on the meta device
    auto_model = "AutoModelForImageTextToText"
    column_keys = ("image_column", "prompt_column", "answer_column")
    modality = "image"
    estimate_reads_longest_row = True
    not_packable = ("a packed row would hold several images whose features LLaVA places by counting image "
                    "tokens, which packing does not keep apart; use group_by_length")

    def make_config(self, config_class, overrides: dict, kwargs: dict, spec: RunSpec):
        """Nested vision and text configs, and the tokenizer's image token."""
        return config_for_run(spec, kwargs)

    def lora_targets(self, model, spec: RunSpec):
        """The language model's layers (the projector's when named), not the vision tower's."""
        return lora_target_modules(model, spec)

    def check_run(self, run: RunSpec, setting_key) -> None:
        check_run(run, setting_key)

    def tokens_per_example(self, run: RunSpec) -> int:
        """The text, then the image's tokens in the decoder."""
        model_config = sources.local_model_config(run.model_def["source"])
        return run.seq_len + vision_language_image_tokens(model_config, run.image_size)

    def planning_manifest(self, run: RunSpec) -> dict:
        """What preparation records of the images: the features placed in the text, the vision tower's own tokens."""
        model_config = sources.local_model_config(run.model_def["source"])
        return {"image_tokens_per_image": vision_language_image_tokens(model_config, run.image_size),
                "vision_tokens_per_image": vision_tower_tokens(model_config, run.image_size)}

    def prepare(self, dataset_name: str, dataset_def: dict, model_def: dict, seq_len: int, out_dir: Path,
                shard_size_mb: float, model_name: str, image_size: int | None = None) -> dict:
        out_dir = Path(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        return prepare(dataset_name, dataset_def, model_def, seq_len, image_size, out_dir, shard_size_mb, model_name)

    def load_split(self, shards: list[Path], manifest: dict, data_source: str):
        return load_split(shards, manifest, data_source)

    def collate(self, split, indices: np.ndarray, pad_token_id: int) -> Batch:
        return collate(split, indices, pad_token_id)

    def eval_accumulator(self):
        return TokenAccumulator(shift=True)

    def memory_estimate(self, model, spec: RunSpec, manifest: dict) -> dict:
        return memory_estimate(model, spec, manifest)


FAMILY = VisionLanguage()
