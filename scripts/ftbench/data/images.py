"""Image data for the vision tasks (``task_types.IMAGE_TASKS``): decoding and resizing once at
preparation, and batching at training time (the images and image tokens each batch holds; their rates
are metrics.image_throughput).

Preparation decodes every image once, converts it to RGB and resizes it to the run's square
``image_size``, and stores the pixels as uint8 (height x width x 3, row-major bytes) in the Parquet
shards: a quarter of float32's size, and the same bytes whatever the normalisation. Normalisation
(the processor's mean and std, recorded in the manifest) happens per batch at collate.

Sources an image dataset can have (keys of ``datasets.NAME``):
- a csv/json/parquet file, a ``datasets.save_to_disk`` folder or a hub dataset whose ``image_column``
  holds file paths (relative to ``image_folder``, else to the file's folder), encoded image bytes, or a
  ``datasets`` Image feature (a dict with bytes and path);
- a headerless CSV of grey pixel rows followed by the class (``pixels: {height, width, max_value}``):
  the layout of the 8x8 handwritten digits scikit-learn ships (``sklearn/datasets/data/digits.csv.gz``);
- ``source: {kind: synthetic}``: random images of the run's size and random classes (throughput only).

Token convention: a ViT-style encoder turns an image into (image_size / patch_size)^2 patch tokens plus
one class token; those are the run's image tokens. ``tokens`` (tokens/s, FLOPs, cost per 1M tokens)
counts every token the model processes: text tokens plus image tokens. Image tokens, text tokens and
images are also reported apart (``image_tokens_per_s``, ``text_tokens_per_s``, ``images_per_s``).
"""

from __future__ import annotations

import dataclasses
import io
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa

from ftbench import atomic
from ftbench.data import sources
from ftbench.tasks.batching import Batch
from ftbench.errors import ConfigError, SourceError
from ftbench.tasks.task_types import DEFAULT_IMAGE_SIZE, image_tokens_per_image

# A config-built model has no processor: images are scaled to [-1, 1] (ViT's own processor default).
DEFAULT_MEAN = DEFAULT_STD = (0.5, 0.5, 0.5)
CHANNELS = 3


# ---------------------------------------------------------------------------------------------------
# Model facts the data depends on (read without torch: preparation and parse time use them)


def _model_config(model_def: dict) -> dict:
    """The model's config as a dict: the overrides of a config-built model, else its config.json."""
    source = model_def["source"]
    if source["kind"] == "config":
        return dict(source.get("overrides", {}))
    if source["kind"] == "hub":
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(source["name"], revision=source.get("revision")).to_dict()
    path = Path(sources.resolve_location(source)) / "config.json"
    if not path.is_file():
        raise SourceError(f"model source {path.parent}: no config.json")
    return json.loads(path.read_text(encoding="utf-8"))


def model_image_size(model_def: dict) -> int:
    return int(_model_config(model_def).get("image_size", DEFAULT_IMAGE_SIZE))


def resolve_image_size(image_size: int | None, model_def: dict) -> int:
    """The run's image side: its ``image_size`` setting, else the model config's."""
    return int(image_size) if image_size else model_image_size(model_def)


def processor_stats(model_def: dict) -> tuple[list[float], list[float], str | None]:
    """(mean, std, processor class) to normalise with: the checkpoint's image processor's
    (preprocessor_config.json: read as a file, so no processor class and its dependencies are needed), or
    [-1, 1] scaling for a config-built model or a checkpoint saved without a processor."""
    source = model_def["source"]
    if source["kind"] == "config":
        return list(DEFAULT_MEAN), list(DEFAULT_STD), None
    if source["kind"] == "hub":
        from huggingface_hub import hf_hub_download

        try:
            path = Path(hf_hub_download(source["name"], "preprocessor_config.json", revision=source.get("revision")))
        except Exception:  # noqa: BLE001 - no processor file (or no network): the model's config loads or fails next
            path = None
    else:
        path = Path(sources.resolve_location(source)) / "preprocessor_config.json"
    if path is None or not path.is_file():
        return list(DEFAULT_MEAN), list(DEFAULT_STD), None
    settings = json.loads(path.read_text(encoding="utf-8"))
    mean = settings.get("image_mean") or DEFAULT_MEAN
    std = settings.get("image_std") or DEFAULT_STD
    if not isinstance(mean, list):  # one value for every channel
        mean, std = [mean] * CHANNELS, [std] * CHANNELS
    return [float(v) for v in mean], [float(v) for v in std], settings.get("image_processor_type")


# ---------------------------------------------------------------------------------------------------
# Decoding


def decode(value, size: int, folder: Path | None) -> np.ndarray:
    """One image (path, encoded bytes, a datasets Image dict, a PIL image or an array) as uint8 size x size x 3."""
    from PIL import Image

    if isinstance(value, dict):  # datasets' Image feature in pandas: {"bytes": ..., "path": ...}
        value = value.get("bytes") or value.get("path")
    if isinstance(value, (bytes, bytearray)):
        image = Image.open(io.BytesIO(value))
    elif isinstance(value, str):
        path = Path(value)
        if not path.is_absolute() and folder is not None:
            path = folder / path
        if not path.is_file():
            raise SourceError(f"image file {path} does not exist")
        image = Image.open(path)
    elif isinstance(value, np.ndarray):
        image = Image.fromarray(value)
    elif isinstance(value, Image.Image):
        image = value
    else:
        raise SourceError(f"cannot read an image from a {type(value).__name__} value")
    image = image.convert("RGB")
    if image.size != (size, size):
        image = image.resize((size, size), Image.Resampling.BILINEAR)
    return np.asarray(image, dtype=np.uint8)


def _pixel_rows(dataset_def: dict, where: str) -> pd.DataFrame:
    """A headerless CSV of grey pixel values then the class, as frames of (image array, label)."""
    layout = dataset_def["pixels"]
    height, width = layout["height"], layout["width"]
    location = Path(sources.resolve_location(dataset_def["source"]))
    if not location.is_file():
        raise SourceError(f"dataset source {location} does not exist")
    values = pd.read_csv(location, header=None).to_numpy()
    if values.shape[1] != height * width + 1:
        raise ConfigError(f"config key {where}.pixels: rows of {location} have {values.shape[1]} values; expected "
                          f"height x width + 1 label = {height * width + 1}")
    scale = 255.0 / layout.get("max_value", 255)
    grey = np.clip(values[:, :-1] * scale, 0, 255).astype(np.uint8).reshape(-1, height, width)
    return pd.DataFrame({"image": list(grey), "label": values[:, -1]})


IMAGE_LABEL_ROLES = {"image": "image_column", "label": "label_column"}


def role_tables(dataset_def: dict, where: str, roles: dict[str, str]) -> tuple[dict[str, pd.DataFrame], Path | None]:
    """(split name -> frame with one column per role, folder that relative image paths start from): the
    dataset's source tables cut to the columns its ``roles`` (role -> config key naming the column) name, or
    the pixel rows of a ``pixels`` CSV (columns image and label)."""
    from ftbench.data import prepared

    folder = Path(dataset_def["image_folder"]).expanduser().resolve() if "image_folder" in dataset_def else None
    if "pixels" in dataset_def:
        return {"train": _pixel_rows(dataset_def, where)}, folder
    for key in roles.values():
        if key not in dataset_def:
            raise ConfigError(f"config key {where}.{key}: required for an image dataset of this task")
    tables = prepared._load_source_tables(dataset_def, where)
    for split_name, frame in tables.items():
        for key in roles.values():
            if dataset_def[key] not in frame.columns:
                raise ConfigError(f"config key {where}.{key}: column {dataset_def[key]!r} not in split {split_name!r}; "
                                  f"columns are {', '.join(map(str, frame.columns))}")
    tables = {name: frame[[dataset_def[key] for key in roles.values()]].set_axis(list(roles), axis=1)
              for name, frame in tables.items()}
    if folder is None and dataset_def["source"]["kind"] != "hub":
        location = Path(sources.resolve_location(dataset_def["source"]))
        folder = location.parent if location.is_file() else location
    return tables, folder


def load_image_splits(dataset_name: str, dataset_def: dict, dropped: dict,
                      roles: dict[str, str] = IMAGE_LABEL_ROLES) -> tuple[pd.DataFrame, pd.DataFrame, Path | None]:
    """(train, eval, folder that relative image paths start from): frames with one column per role (the
    config key naming its source column): image and label for classification; pixel rows give image and label."""
    from ftbench.data import prepared

    where = f"datasets.{dataset_name}"
    tables, folder = role_tables(dataset_def, where, roles)
    labels = dataset_def.get("labels")
    if "label" in next(iter(tables.values())).columns:
        prepared.check_labels(pd.concat(tables.values())["label"], labels, where, dataset_def.get("label_column", "pixels label"))
    for name, frame in tables.items():
        before = len(frame)
        frame = frame.dropna()
        counts = {"missing_or_empty": before - len(frame)}
        before = len(frame)
        if labels is not None:
            frame = frame[frame["label"].isin(labels)]
        counts["other_labels"] = before - len(frame)
        tables[name] = frame.reset_index(drop=True)
        dropped[name] = counts
    return (*train_and_eval(tables, dataset_def, where), folder)


def train_and_eval(tables: dict[str, pd.DataFrame], dataset_def: dict, where: str) -> tuple[pd.DataFrame, pd.DataFrame]:
    """The (train, eval) frames of a dataset's cleaned ``tables`` (split name -> rows): its named
    ``train_split``/``eval_split``, or without an eval split a seeded split of train_size and eval_size rows,
    stratified by ``label`` where the rows have one (each class in both splits)."""
    from ftbench.data import prepared

    if "eval_split" not in dataset_def:
        frame = tables.get(dataset_def.get("train_split", "train"), next(iter(tables.values())))
        train_size = dataset_def.get("train_size", int(len(frame) * 0.8))
        eval_size = dataset_def.get("eval_size", len(frame) - train_size)
        if train_size + eval_size > len(frame):
            raise ConfigError(f"config key {where}.train_size: train_size + eval_size = {train_size + eval_size} but only "
                              f"{len(frame)} usable rows remain")
        return prepared.stratified_split(frame, train_size, eval_size, dataset_def.get("split_seed", 0))
    for key in ("train_split", "eval_split"):
        split = dataset_def.get(key, "train")
        if split not in tables:
            raise ConfigError(f"config key {where}.{key}: split {split!r} not found; splits are {', '.join(tables)}")
    return tables[dataset_def.get("train_split", "train")], tables[dataset_def["eval_split"]]


# ---------------------------------------------------------------------------------------------------
# Preparation (what prepared.prepare does for an image task)


def to_table(pixels: np.ndarray, labels: np.ndarray) -> pa.Table:
    """uint8 images (N x H x W x 3) and class ids as an Arrow table: one fixed-size binary per image."""
    flat = np.ascontiguousarray(pixels, dtype=np.uint8).reshape(len(pixels), -1)
    size = flat.shape[1]
    return pa.table({
        "pixels": pa.FixedSizeBinaryArray.from_buffers(pa.binary(size), len(flat), [None, pa.py_buffer(flat.tobytes())]),
        "label": pa.array(np.asarray(labels, dtype=np.int64)),
    })


def prepare(dataset_name: str, dataset_def: dict, model_def: dict, seq_len: int, image_size: int | None,
            out_dir: Path, shard_size_mb: float, model_name: str) -> dict:
    from ftbench.data import prepared

    task = model_def["task"]
    size = resolve_image_size(image_size, model_def)
    model_config = _model_config(model_def)
    mean, std, processor_class = processor_stats(model_def)
    dropped: dict = {}
    if dataset_def["source"]["kind"] == "synthetic":
        rng = np.random.default_rng(dataset_def.get("split_seed", 0))
        num_labels = dataset_def["source"].get("num_labels", 2)
        label_names = [str(index) for index in range(num_labels)]
        tables = {}
        for split_name, default in sources.SYNTHETIC_SPLIT_ROWS.items():
            rows = dataset_def.get(f"{split_name}_size", default)
            tables[split_name] = to_table(rng.integers(0, 256, size=(rows, size, size, CHANNELS), dtype=np.uint8),
                                          rng.integers(0, num_labels, size=rows))
    else:
        train, evaluation, folder = load_image_splits(dataset_name, dataset_def, dropped)
        names = dataset_def.get("labels") or sorted(pd.concat([train["label"], evaluation["label"]]).unique().tolist())
        ids = {name: index for index, name in enumerate(names)}
        unknown = set(evaluation["label"]) - set(ids)
        if unknown:
            raise ConfigError(f"config key datasets.{dataset_name}.labels: eval split has labels {sorted(map(str, unknown))} not in train")
        label_names = [str(name) for name in names]
        tables = {}
        for split_name, frame in zip(prepared.SPLITS, (train, evaluation)):
            pixels = np.stack([decode(value, size, folder) for value in frame["image"]]) if len(frame) else \
                np.zeros((0, size, size, CHANNELS), dtype=np.uint8)
            tables[split_name] = to_table(pixels, np.array([ids[value] for value in frame["label"]], dtype=np.int64))

    per_image = image_tokens_per_image(model_config, size)
    manifest = image_manifest(
        task, dataset_name, dataset_def, model_name, model_def, seq_len, image_size, size, (mean, std, processor_class),
        per_image, dropped, shard_size_mb, label_names=label_names,
        # A config-built model is built at the run's size; a checkpoint keeps its own and interpolates.
        interpolate_pos_encoding=model_def["source"]["kind"] != "config" and size != model_config.get("image_size", size))
    return write_image_shards(manifest, tables, out_dir, lambda table: {})


def image_manifest(task: str, dataset_name: str, dataset_def: dict, model_name: str, model_def: dict, seq_len: int,
                   image_size: int | None, size: int, processor: tuple, per_image: int, dropped: dict,
                   shard_size_mb: float, **task_fields) -> dict:
    """The manifest every image task's preparation writes (``processor``: processor_stats' mean, std and
    class; ``size``: the resolved side of ``image_size``), before its splits; ``task_fields`` add the
    task's own entries or replace these (a tokenizer, label names)."""
    from ftbench.data import prepared

    mean, std, processor_class = processor
    return {
        "manifest_version": prepared.MANIFEST_VERSION,
        "dataset": dataset_name,
        "task": task,
        "source_fingerprint": sources.fingerprint(dataset_def["source"]),
        "tokenizer": None,
        "tokenizer_class": None,
        "processor_class": processor_class,
        "pad_token_id": None,
        "vocab_size": None,
        "seq_len": seq_len,
        "image_size": size,
        "image_mean": mean,
        "image_std": std,
        "image_tokens_per_image": per_image,
        "interpolate_pos_encoding": False,
        "label_names": None,
        "rows_dropped": dropped,
        "shard_size_mb": shard_size_mb,
        "preparation": {"dataset": dataset_name, "dataset_def": dataset_def, "model": model_name, "model_def": model_def,
                        "seq_len": seq_len, "image_size": image_size},
        "splits": {},
        **task_fields,
    }


def write_image_shards(manifest: dict, tables: dict[str, pa.Table], out_dir: Path, split_figures) -> dict:
    """Each split's table as Parquet shards, its counts in the manifest (rows, images, image tokens, and
    ``split_figures(table)``'s: text tokens, say, which ``tokens`` then includes); the manifest written last."""
    from ftbench.data import prepared

    per_image = manifest["image_tokens_per_image"]
    for split_name, table in tables.items():
        figures = split_figures(table)
        manifest["splits"][split_name] = {
            "rows": table.num_rows,
            "tokens": table.num_rows * per_image + figures.get("text_tokens", 0),
            "images": table.num_rows,
            "image_tokens": table.num_rows * per_image,
            **figures,
            "shards": prepared.write_shards(table, out_dir, split_name, shard_size_mb=manifest["shard_size_mb"]),
        }
    atomic.write_json(out_dir / prepared.MANIFEST_NAME, manifest)
    return manifest


# ---------------------------------------------------------------------------------------------------
# Training side


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


def pixels_of(table: pa.Table, side: int) -> np.ndarray:
    """A table's ``pixels`` column (to_table's layout) as uint8 N x side x side x 3, without a copy."""
    column = table["pixels"].combine_chunks()
    raw = np.frombuffer(column.buffers()[1], dtype=np.uint8, count=len(column) * side * side * CHANNELS,
                        offset=column.offset * side * side * CHANNELS)
    return raw.reshape(len(column), side, side, CHANNELS)


def from_table(table: pa.Table, facts: ImageFacts) -> ImageSplit:
    return ImageSplit(pixels_of(table, facts.image_size), table["label"].to_numpy().astype(np.int64), facts)


class DiskImageSplit:
    """Images read from the shards per batch (``data_source: disk``): one row-group read per group touched."""

    def __init__(self, shards: list[Path], facts: ImageFacts):
        from ftbench.data import prepared

        self.rows = prepared.DiskSplit(shards)  # its row-group index; the decoding is this module's
        self.facts = facts
        self._cache: dict[int, ImageSplit] = {}  # recently read row groups, as DiskSplit keeps them

    def _group(self, index: int) -> ImageSplit:
        if index not in self._cache:
            if len(self._cache) >= self.rows.CACHED_GROUPS:
                self._cache.pop(next(iter(self._cache)))  # oldest first
            file_index, row_group, _ = self.rows.groups[index]
            self._cache[index] = from_table(self.rows.files[file_index].read_row_group(row_group), self.facts)
        return self._cache[index]

    def __len__(self) -> int:
        return len(self.rows)

    def lengths(self) -> np.ndarray:
        return image_lengths(len(self), self.facts)

    def take(self, indices: np.ndarray) -> ImageSplit:
        indices = np.asarray(indices)
        rows = self.rows
        group_of = np.searchsorted(rows.group_starts, indices, side="right") - 1
        side = self.facts.image_size
        pixels = np.empty((len(indices), side, side, CHANNELS), dtype=np.uint8)
        labels = np.empty(len(indices), dtype=np.int64)
        for group in np.unique(group_of):
            positions = np.flatnonzero(group_of == group)
            picked = self._group(int(group)).take(indices[positions] - rows.group_starts[group])
            pixels[positions], labels[positions] = picked.pixels, picked.labels
        return ImageSplit(pixels, labels, self.facts)


def load_split(shards: list[Path], manifest: dict, data_source: str):
    import pyarrow.parquet as pq

    facts = ImageFacts.of(manifest)
    if data_source == "disk":
        return DiskImageSplit(shards, facts)
    return from_table(pa.concat_tables([pq.read_table(path) for path in shards]), facts)


def collate(split, indices: np.ndarray) -> "ImageBatch":
    """A batch of images and labels; every token is real (no padding). The pixels stay uint8 until the
    batch is on its device (``ImageBatch.to``)."""
    import torch

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
        import torch

        moved = {key: value.to(device, non_blocking=True) if isinstance(value, torch.Tensor) else value
                 for key, value in self.inputs.items()}
        pixels = moved["pixel_values"]
        if pixels.dtype == torch.uint8:  # N x H x W x 3 bytes -> normalised N x 3 x H x W floats
            mean = torch.tensor(self.facts.mean, device=device).view(1, -1, 1, 1)
            std = torch.tensor(self.facts.std, device=device).view(1, -1, 1, 1)
            pixels = pixels.permute(0, 3, 1, 2).float().div_(255.0)
            moved["pixel_values"] = ((pixels - mean) / std).contiguous()
        return dataclasses.replace(self, inputs=moved)


def memory_estimate(model, spec, manifest: dict) -> dict:
    """The vision encoder's estimate: the text encoder model of memory_estimate.py (layer norm, plain MLP,
    a classifier head without logits over a vocabulary) over the image tokens of each image. The input
    pixels (batch x 3 x side x side floats) are small beside the activations and are not added."""
    from ftbench.measure import memory_estimate as estimate_module

    return estimate_module.estimate(model, spec.replace(seq_len=manifest["image_tokens_per_image"]), "classification", None)
