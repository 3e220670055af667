"""Image classification (task ``image_classification``): a vision encoder (ViT-like) with a classification
head; loss = cross-entropy over classes; quality = accuracy. Data: images (data/images.py reads, decodes and
resizes them once at preparation), no text.

Preparation decodes every image once, converts it to RGB and resizes it to the run's square ``image_size``,
and stores the pixels as uint8 in the Parquet shards; normalisation (the processor's mean and std, recorded in
the manifest) happens per batch, on the device (``ImageBatch.to``).

Token convention: a ViT-style encoder turns an image into (image_size / patch_size)^2 patch tokens plus
one class token; those are the run's image tokens. ``tokens`` (tokens/s, FLOPs, cost per 1M tokens)
counts every token the model processes: text tokens plus image tokens. Image tokens, text tokens and
images are also reported apart (``image_tokens_per_s``, ``text_tokens_per_s``, ``images_per_s``).

The image-text families (retrieval, vision-language) build on this module's ImageFacts, ImageSplit,
ImageBatch and collate_images.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa

from ftbench.data import images, prepared, sources
from ftbench.data.images import pixels_of
from ftbench.errors import ConfigError
from ftbench.measure import memory_estimate
from ftbench.runspec import RunSpec
from ftbench.tasks.base import Batch, TaskFamily, to_device
from ftbench.tasks.text import ClassAccumulator


def image_tokens_per_image(model_config: dict | None, image_size: int | None) -> int:
    """Patch tokens plus the class token a ViT-style encoder makes of one image at ``image_size``
    (null: the config's own size). Reads a config dict only: the resource estimate uses it at parse time.
    A dual encoder's (CLIP's) vision settings are its ``vision_config``."""
    model_config = model_config or {}
    model_config = model_config.get("vision_config") or model_config
    size = int(image_size or model_config.get("image_size", images.DEFAULT_IMAGE_SIZE))
    return (size // int(model_config.get("patch_size", images.DEFAULT_PATCH_SIZE))) ** 2 + 1


# ---------------------------------------------------------------------------------------------------
# Training side (shared by the image families)


@dataclass(frozen=True)
class ImageFacts:
    """What collate needs from the manifest: the image side, normalisation and image tokens per image."""

    image_size: int
    mean: tuple[float, ...]
    std: tuple[float, ...]
    tokens_per_image: int
    interpolate: bool  # a checkpoint trained at another size: its position embeddings are interpolated

    @classmethod
    def of(cls, manifest: dict) -> "ImageFacts":
        return cls(manifest["image_size"], tuple(manifest["image_mean"]), tuple(manifest["image_std"]),
                   manifest["image_tokens_per_image"], manifest["interpolate_pos_encoding"])


def image_lengths(rows: int, facts: ImageFacts) -> np.ndarray:
    """Tokens of every row, as text splits give them (length-ordered batching and evaluation ask): every
    image of a split has the same number of patch tokens."""
    return np.full(rows, facts.tokens_per_image, dtype=np.int64)


@dataclass
class ImageSplit:
    """A split of decoded images: uint8 N x H x W x 3 and class ids."""

    pixels: np.ndarray
    labels: np.ndarray
    facts: ImageFacts

    def __len__(self) -> int:
        return len(self.labels)

    def take(self, indices: np.ndarray) -> "ImageSplit":
        return ImageSplit(self.pixels[indices], self.labels[indices], self.facts)

    def lengths(self) -> np.ndarray:
        return image_lengths(len(self), self.facts)


def from_table(table: pa.Table, facts: ImageFacts) -> ImageSplit:
    return ImageSplit(pixels_of(table, facts.image_size), table["label"].to_numpy().astype(np.int64), facts)


def collate_images(split, indices: np.ndarray) -> "ImageBatch":
    """A batch of images and labels; every token is real (no padding). The pixels stay uint8 until the
    batch is on its device (``ImageBatch.to``)."""
    import torch  # deferred: the registry is read at parse time, torch-free

    rows = split.take(np.asarray(indices))
    inputs = {"pixel_values": torch.from_numpy(np.ascontiguousarray(rows.pixels)), "labels": torch.from_numpy(rows.labels)}
    if rows.facts.interpolate:
        inputs["interpolate_pos_encoding"] = True
    count = len(rows)
    per_image = rows.facts.tokens_per_image
    return ImageBatch(inputs=inputs, samples=count, real_tokens=count * per_image, padded_tokens=count * per_image,
                      sum_squared_lengths=count * per_image**2, images=count, image_tokens=count * per_image,
                      facts=rows.facts)


@dataclass
class ImageBatch(Batch):
    """A Batch whose ``to`` moves uint8 pixels (a quarter of float32's bytes) and normalises them there:
    on a GPU the host side of the loader then only gathers bytes. After ``to``, ``pixel_values`` is
    float32, batch x 3 x side x side, normalised with the processor's mean and std."""

    facts: ImageFacts | None = None

    def to(self, device) -> "ImageBatch":
        import torch  # deferred: the registry is read at parse time, torch-free

        moved = {key: to_device(value, device) if isinstance(value, torch.Tensor) else value
                 for key, value in self.inputs.items()}
        pixels = moved["pixel_values"]
        if pixels.dtype == torch.uint8:  # N x H x W x 3 bytes -> normalised N x 3 x H x W floats
            mean = to_device(torch.tensor(self.facts.mean), device).view(1, -1, 1, 1)
            std = to_device(torch.tensor(self.facts.std), device).view(1, -1, 1, 1)
            pixels = pixels.permute(0, 3, 1, 2).float().div_(255.0)
            moved["pixel_values"] = ((pixels - mean) / std).contiguous()
        return dataclasses.replace(self, inputs=moved)



# ---------------------------------------------------------------------------------------------------
# The family


class ImageClassification(TaskFamily):
    name = "image_classification"
    auto_model = "AutoModelForImageClassification"
    # peft has no image task type: the new head is named instead (ViT's and most image models' "classifier").
    head_modules = ("classifier",)
    pooled_heads = ("classifier",)  # ViT's sees the class token only
    column_keys = ("image_column", "label_column")
    modality = "image"
    takes_num_labels = True
    not_packable = "every image is the same number of patch tokens: there is no padding to remove; use pad"

    def config_overrides(self, overrides: dict, spec: RunSpec) -> dict:
        if spec.image_size:
            overrides["image_size"] = spec.image_size  # a random-init encoder is built for the run's image size
        return overrides

    def pretrained_kwargs(self) -> dict:
        # An image checkpoint usually carries its pretraining head (ImageNet's 1,000 classes): a head of
        # another class count is made new, as for a text encoder without one.
        return {"ignore_mismatched_sizes": True}

    def check_run(self, run: RunSpec, setting_key) -> None:
        """Image data: an image and a label column, or pixel rows."""
        dataset_def = run.dataset_def
        if dataset_def["source"]["kind"] != "synthetic" and "pixels" not in dataset_def:
            for key in ("image_column", "label_column"):
                if key not in dataset_def:
                    raise ConfigError(f"config key datasets.{run.dataset}.{key}: required to train model {run.model!r} "
                                      f"({self.name}) (or `pixels` for a headerless CSV of pixel rows)")

    def tokens_per_example(self, run: RunSpec) -> int:
        """An image is its patch tokens, whatever seq_len says."""
        return image_tokens_per_image(sources.local_model_config(run.model_def["source"]), run.image_size)

    def prepare(self, dataset_name: str, dataset_def: dict, model_def: dict, seq_len: int, out_dir: Path,
                shard_size_mb: float, model_name: str, image_size: int | None = None) -> dict:
        """Decode and resize every image once (data/images.py), with its class id, into shards."""
        out_dir = Path(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        size = images.resolve_image_size(image_size, model_def)
        model_config = images.read_model_config(model_def)
        mean, std, processor_class = images.processor_stats(model_def)
        dropped: dict = {}
        if dataset_def["source"]["kind"] == "synthetic":
            rng = np.random.default_rng(dataset_def.get("split_seed", 0))
            num_labels = dataset_def["source"].get("num_labels", 2)
            label_names = [str(index) for index in range(num_labels)]
            tables = {}
            for split_name, default in sources.SYNTHETIC_SPLIT_ROWS.items():
                rows = dataset_def.get(f"{split_name}_size", default)
                tables[split_name] = images.to_table(rng.integers(0, 256, size=(rows, size, size, images.CHANNELS), dtype=np.uint8),
                                              rng.integers(0, num_labels, size=rows))
        else:
            train, evaluation, folder = images.load_image_splits(dataset_name, dataset_def, dropped)
            names = dataset_def.get("labels") or sorted(pd.concat([train["label"], evaluation["label"]]).unique().tolist())
            ids = {name: index for index, name in enumerate(names)}
            unknown = set(evaluation["label"]) - set(ids)
            if unknown:
                raise ConfigError(f"config key datasets.{dataset_name}.labels: eval split has labels {sorted(map(str, unknown))} not in train")
            label_names = [str(name) for name in names]
            tables = {}
            for split_name, frame in zip(prepared.SPLITS, (train, evaluation)):
                pixels = np.stack([images.decode(value, size, folder) for value in frame["image"]]) if len(frame) else \
                    np.zeros((0, size, size, images.CHANNELS), dtype=np.uint8)
                tables[split_name] = images.to_table(pixels, np.array([ids[value] for value in frame["label"]], dtype=np.int64))

        per_image = image_tokens_per_image(model_config, size)
        manifest = images.image_manifest(
            self.name, dataset_name, dataset_def, model_name, model_def, seq_len, image_size, size, (mean, std, processor_class),
            per_image, dropped, shard_size_mb, label_names=label_names,
            # A config-built model is built at the run's size; a checkpoint keeps its own and interpolates.
            interpolate_pos_encoding=model_def["source"]["kind"] != "config" and size != model_config.get("image_size", size))
        return images.write_image_shards(manifest, tables, out_dir, lambda table: {})

    def load_split(self, shards: list[Path], manifest: dict, data_source: str):
        facts = ImageFacts.of(manifest)
        return prepared.read_split(shards, lambda table: from_table(table, facts), data_source,
                                   lambda rows: image_lengths(rows, facts))

    def collate(self, split, indices: np.ndarray, pad_token_id: int) -> Batch:
        return collate_images(split, indices)

    def row_classes(self, split) -> np.ndarray:
        return np.asarray(split.labels)

    def eval_accumulator(self):
        return ClassAccumulator()

    def memory_estimate(self, model, spec: RunSpec, manifest: dict) -> dict:
        """The vision encoder's estimate: the text encoder model of memory_estimate.py (layer norm, plain MLP,
        a classifier head without logits over a vocabulary) over the image tokens of each image. The input
        pixels (batch x 3 x side x side floats) are small beside the activations and are not added."""
        return memory_estimate.estimate(model, spec.replace(seq_len=manifest["image_tokens_per_image"]), None)


FAMILY = ImageClassification()
