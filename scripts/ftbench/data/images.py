"""Image data, task-neutral (the image task families in ``ftbench.tasks`` use it): reading image sources,
decoding and resizing once at preparation, and the pixel layout of the shards.

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

import io
import json
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa

from ftbench.data import prepared, sources
from ftbench.errors import ConfigError, SourceError

# A config-built model has no processor: images are scaled to [-1, 1] (ViT's own processor default).
DEFAULT_MEAN = DEFAULT_STD = (0.5, 0.5, 0.5)
CHANNELS = 3
# ViT's defaults, for a model config that names no image or patch size.
DEFAULT_IMAGE_SIZE = 224
DEFAULT_PATCH_SIZE = 16


# ---------------------------------------------------------------------------------------------------
# Model facts the data depends on (read without torch: preparation and parse time use them)


def read_model_config(model_def: dict) -> dict:
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
    return int(read_model_config(model_def).get("image_size", DEFAULT_IMAGE_SIZE))


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


def _open(value, folder: Path | None):
    """A PIL image of a table cell (path, encoded bytes, a datasets Image dict, a PIL image or an array), its
    pixels not yet decoded."""
    from PIL import Image  # deferred: data/ is imported at parse time; PIL only where images are read

    if isinstance(value, dict):  # datasets' Image feature in pandas: {"bytes": ..., "path": ...}
        value = value.get("bytes") or value.get("path")
    if isinstance(value, (bytes, bytearray)):
        return Image.open(io.BytesIO(value))
    if isinstance(value, str):
        path = image_path(value, folder)
        if not path.is_file():
            raise SourceError(f"image file {path} does not exist")
        return Image.open(path)
    if isinstance(value, np.ndarray):
        return Image.fromarray(value)
    if isinstance(value, Image.Image):
        return value
    raise SourceError(f"cannot read an image from a {type(value).__name__} value")


def image_path(value: str, folder: Path | None) -> Path:
    path = Path(value)
    return folder / path if not path.is_absolute() and folder is not None else path


# Modes whose pixels are not 8-bit: 16-bit grey is scaled to 8 bits (convert("RGB") would clip it to white);
# float pixels have no one scale, and are refused.
SIXTEEN_BIT_MODES = ("I;16", "I;16B", "I;16L", "I;16N", "I")


def _rgb(image):
    from PIL import Image  # deferred: data/ is imported at parse time; PIL only where images are read

    if image.mode in SIXTEEN_BIT_MODES:
        values = np.asarray(image, dtype=np.int64)
        scale = 257.0 if values.max(initial=0) > 255 else 1.0
        image = Image.fromarray(np.clip(values / scale, 0, 255).astype(np.uint8), mode="L")
    if image.mode == "F":
        raise ValueError("float pixels (mode F) have no 8-bit scale; save the image as 8- or 16-bit")
    if image.width == 0 or image.height == 0:
        raise ValueError(f"image of size {image.width}x{image.height}")
    return image.convert("RGB")


def decode(value, size: int, folder: Path | None) -> np.ndarray:
    """One image (path, encoded bytes, a datasets Image dict, a PIL image or an array) as uint8 size x size x 3."""
    from PIL import Image  # deferred: data/ is imported at parse time; PIL only where images are read

    image = _rgb(_open(value, folder))
    if image.size != (size, size):
        image = image.resize((size, size), Image.Resampling.BILINEAR)
    return np.asarray(image, dtype=np.uint8)


def image_problem(value, folder: Path | None) -> str | None:
    """Why a table cell is not a usable image (missing file, not an image, truncated, float pixels), or None.
    The image is decoded in full: a truncated file opens fine and fails only when its pixels are read."""
    from PIL import Image  # deferred: data/ is imported at parse time; PIL only where images are read

    what = f"image file {image_path(value, folder)}" if isinstance(value, str) else "image"
    try:
        image = _open(value, folder)
        image.load()
        _rgb(image)
    except SourceError as exc:
        return str(exc)
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as exc:
        # PIL's UnidentifiedImageError (not an image) and "image file is truncated" are OSErrors.
        return f"{what}: cannot be decoded ({type(exc).__name__}: {' '.join(str(exc).split())[:120]})"
    return None


def check_images(tables: dict[str, pd.DataFrame], dataset_def: dict, where: str, folder: Path | None,
                 dropped: dict) -> dict[str, pd.DataFrame]:
    """Every image of every source split decoded once, before the splits are drawn: a missing, truncated or
    undecodable file is one line naming the file and its table row, or with ``on_bad_image: skip`` a dropped
    row (reason bad_image) that train_size and eval_size never count."""
    skip = dataset_def.get("on_bad_image", "fail") == "skip"
    problems = []
    for name, frame in tables.items():
        rows = frame["source_row"] if "source_row" in frame.columns else pd.Series(frame.index)
        bad = [(row, problem) for row, value in zip(rows, frame["image"]) if (problem := image_problem(value, folder))]
        dropped.setdefault(name, {})["bad_image"] = len(bad) if skip else 0
        if skip and bad:
            tables[name] = frame[~rows.isin([row for row, _ in bad]).to_numpy()].reset_index(drop=True)
        problems += [f"{problem} (split {name!r}, data row {int(row) + 1})" for row, problem in bad]
    if problems and not skip:
        more = f"; and {len(problems) - 3} more" if len(problems) > 3 else ""
        raise SourceError(f"config key {where}: {len(problems)} bad image(s): {'; '.join(problems[:3])}{more}; fix or remove "
                          f"them, or set {where}.on_bad_image: skip to drop their rows (counted as dropped, bad_image)")
    return tables


def missing_image_files(dataset_def: dict, where: str) -> list[str]:
    """Parse time (cheap: the table is read and each path stat-ed; measured 25 ms for 1,000 rows): image paths of a
    local table that name no file, as "path (split, data row)". Decoding is preparation's (check_images)."""
    if "pixels" in dataset_def or "image_column" not in dataset_def or dataset_def.get("on_bad_image") == "skip" \
            or dataset_def["source"]["kind"] in ("hub", "synthetic", "config"):
        return []
    tables, folder = role_tables(dataset_def, where, {"image": "image_column"})
    missing = []
    for name, frame in tables.items():
        for row, value in zip(frame["source_row"], frame["image"]):
            if isinstance(value, str) and not image_path(value, folder).is_file():
                missing.append(f"{image_path(value, folder)} (split {name!r}, data row {int(row) + 1})")
    return missing


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
    folder = Path(dataset_def["image_folder"]).expanduser().resolve() if "image_folder" in dataset_def else None
    if "pixels" in dataset_def:
        return {"train": _pixel_rows(dataset_def, where)}, folder
    for key in roles.values():
        if key not in dataset_def:
            raise ConfigError(f"config key {where}.{key}: required for an image dataset of this task")
    tables = prepared.load_source_tables(dataset_def, where)
    for split_name, frame in tables.items():
        for key in roles.values():
            if dataset_def[key] not in frame.columns:
                raise ConfigError(f"config key {where}.{key}: column {dataset_def[key]!r} not in split {split_name!r}; "
                                  f"columns are {', '.join(map(str, frame.columns))}")
    # source_row: each row's place in its source split, kept through cleaning, so a bad image names its row.
    tables = {name: frame[[dataset_def[key] for key in roles.values()]].set_axis(list(roles), axis=1)
              .assign(source_row=np.arange(len(frame))) for name, frame in tables.items()}
    if folder is None and dataset_def["source"]["kind"] != "hub":
        location = Path(sources.resolve_location(dataset_def["source"]))
        folder = location.parent if location.is_file() else location
    return tables, folder


def load_image_splits(dataset_name: str, dataset_def: dict, dropped: dict,
                      roles: dict[str, str] = IMAGE_LABEL_ROLES) -> tuple[pd.DataFrame, pd.DataFrame, Path | None]:
    """(train, eval, folder that relative image paths start from): frames with one column per role (the
    config key naming its source column): image and label for classification; pixel rows give image and label."""
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
    tables = check_images(tables, dataset_def, where, folder, dropped)
    return (*train_and_eval(tables, dataset_def, where), folder)


def train_and_eval(tables: dict[str, pd.DataFrame], dataset_def: dict, where: str) -> tuple[pd.DataFrame, pd.DataFrame]:
    """The (train, eval) frames of a dataset's cleaned ``tables`` (split name -> rows): its named
    ``train_split``/``eval_split``, or without an eval split a seeded split of train_size and eval_size rows,
    stratified by ``label`` where the rows have one (each class in both splits)."""
    if "eval_split" not in dataset_def:
        frame = tables.get(dataset_def.get("train_split", "train"), next(iter(tables.values())))
        return prepared.seeded_split(frame, dataset_def, where)
    for key in ("train_split", "eval_split"):
        split = dataset_def.get(key, "train")
        if split not in tables:
            raise ConfigError(f"config key {where}.{key}: split {split!r} not found; splits are {', '.join(tables)}")
    return tables[dataset_def.get("train_split", "train")], tables[dataset_def["eval_split"]]


# ---------------------------------------------------------------------------------------------------
# Shards (what every image family's preparation writes)


def to_table(pixels: np.ndarray, labels: np.ndarray) -> pa.Table:
    """uint8 images (N x H x W x 3) and class ids as an Arrow table: one fixed-size binary per image."""
    flat = np.ascontiguousarray(pixels, dtype=np.uint8).reshape(len(pixels), -1)
    size = flat.shape[1]
    return pa.table({
        "pixels": pa.FixedSizeBinaryArray.from_buffers(pa.binary(size), len(flat), [None, pa.py_buffer(flat.tobytes())]),
        "label": pa.array(np.asarray(labels, dtype=np.int64)),
    })


def image_manifest(task: str, dataset_name: str, dataset_def: dict, model_name: str, model_def: dict, seq_len: int,
                   image_size: int | None, size: int, processor: tuple, per_image: int, dropped: dict,
                   shard_size_mb: float, **task_fields) -> dict:
    """The manifest every image task's preparation writes (``processor``: processor_stats' mean, std and
    class; ``size``: the resolved side of ``image_size``), before its splits; ``task_fields`` add the
    task's own entries or replace these (a tokenizer, label names)."""
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
    per_image = manifest["image_tokens_per_image"]

    def figures(table: pa.Table) -> dict:
        extra = split_figures(table)
        return {"rows": table.num_rows, "tokens": table.num_rows * per_image + extra.get("text_tokens", 0),
                "images": table.num_rows, "image_tokens": table.num_rows * per_image, **extra}

    return prepared.write_prepared(manifest, tables, out_dir, figures)


def pixels_of(table: pa.Table, side: int) -> np.ndarray:
    """A table's ``pixels`` column (to_table's layout) as uint8 N x side x side x 3, without a copy."""
    column = table["pixels"].combine_chunks()
    raw = np.frombuffer(column.buffers()[1], dtype=np.uint8, count=len(column) * side * side * CHANNELS,
                        offset=column.offset * side * side * CHANNELS)
    return raw.reshape(len(column), side, side, CHANNELS)
