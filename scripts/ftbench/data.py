"""Prepare tokenised datasets as Parquet shards with a manifest, and read them back verified.

One preparation serves every run with the same (dataset, tokenizer, sequence length). Sequences are
stored unpadded (``input_ids`` of their true length): padding is added per batch at training time, so the
real token count of every batch is known exactly and never includes padding.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from . import atomic, sources
from .errors import ConfigError, ManifestError, SourceError

MANIFEST_NAME = "manifest.json"
MANIFEST_VERSION = 1
SPLITS = ("train", "eval")


# ---------------------------------------------------------------------------------------------------
# Reading the raw dataset


def load_raw_splits(dataset_def: dict, dataset_name: str = "dataset") -> tuple[pd.DataFrame, pd.DataFrame]:
    """The train and eval examples as DataFrames with columns ``text`` and ``label`` (original values)."""
    tables = _load_source_tables(dataset_def)
    where = f"datasets.{dataset_name}"
    text_col, label_col = dataset_def["text_column"], dataset_def["label_column"]
    for split_name, frame in tables.items():
        for role, column in (("text_column", text_col), ("label_column", label_col)):
            if column not in frame.columns:
                raise ConfigError(
                    f"config key {where}.{role}: column {column!r} not in split {split_name!r}; "
                    f"columns are {', '.join(map(str, frame.columns))}"
                )
    tables = {
        name: frame[[text_col, label_col]].rename(columns={text_col: "text", label_col: "label"})
        for name, frame in tables.items()
    }
    labels = dataset_def.get("labels")
    tables = {name: _clean(frame, labels, dataset_def.get("deduplicate", True)) for name, frame in tables.items()}

    if "train_size" in dataset_def or "eval_split" not in dataset_def:
        frame = tables.get(dataset_def.get("train_split", "train"), next(iter(tables.values())))
        train_size = dataset_def.get("train_size", int(len(frame) * 0.8))
        eval_size = dataset_def.get("eval_size", len(frame) - train_size)
        if train_size + eval_size > len(frame):
            raise ConfigError(
                f"config key {where}.train_size: train_size + eval_size = {train_size + eval_size} "
                f"but only {len(frame)} usable rows remain after filtering and deduplication"
            )
        return stratified_split(frame, train_size, eval_size, dataset_def.get("split_seed", 0))

    for key in ("train_split", "eval_split"):
        split = dataset_def.get(key, "train")
        if split not in tables:
            raise ConfigError(f"config key {where}.{key}: split {split!r} not found; splits are {', '.join(tables)}")
    return tables[dataset_def.get("train_split", "train")], tables[dataset_def["eval_split"]]


def _load_source_tables(dataset_def: dict) -> dict[str, pd.DataFrame]:
    import datasets  # heavy import, only where data is really read

    source = dataset_def["source"]
    if source["kind"] == "hub":
        loaded = datasets.load_dataset(source["name"], source.get("subset"), revision=source.get("revision"))
    else:
        location = Path(sources.resolve_location(source))
        if not location.exists():
            raise SourceError(f"dataset source {location} does not exist")
        data_format = sources.dataset_format(location, dataset_def.get("format"))
        if data_format is not None:
            loaded = datasets.load_dataset(data_format, data_files=str(location))
        elif (location / "dataset_dict.json").is_file() or (location / "state.json").is_file():
            loaded = datasets.load_from_disk(str(location))  # a datasets.save_to_disk folder
        else:
            loaded = datasets.load_dataset(str(location))  # a folder of data files, hub layout
    if isinstance(loaded, datasets.Dataset):
        loaded = datasets.DatasetDict({"train": loaded})
    return {name: split.to_pandas() for name, split in loaded.items()}


def _clean(frame: pd.DataFrame, labels: list | None, deduplicate: bool) -> pd.DataFrame:
    frame = frame.dropna(subset=["text", "label"])
    frame = frame[frame["text"].astype(str).str.strip() != ""]
    if labels is not None:
        frame = frame[frame["label"].isin(labels)]
    if deduplicate:
        # Duplicated texts would leak between train and eval and inflate accuracy.
        frame = frame.drop_duplicates(subset="text", keep=False)
    return frame.reset_index(drop=True)


def stratified_split(frame: pd.DataFrame, train_size: int, eval_size: int, seed: int):
    """Seeded split that keeps each label's share in both parts (largest-remainder quotas)."""
    rng = np.random.default_rng(seed)
    shuffled = frame.iloc[rng.permutation(len(frame))].reset_index(drop=True)
    eval_part = _take_stratified(shuffled, eval_size)
    rest = shuffled.drop(eval_part.index)
    train_part = _take_stratified(rest, train_size)
    return train_part.reset_index(drop=True), eval_part.reset_index(drop=True)


def _take_stratified(frame: pd.DataFrame, count: int) -> pd.DataFrame:
    shares = frame["label"].value_counts(normalize=True, sort=False)
    exact = shares * count
    quotas = np.floor(exact).astype(int)
    remainder = count - int(quotas.sum())
    for label in (exact - quotas).sort_values(ascending=False).index[:remainder]:
        quotas[label] += 1
    return pd.concat([frame[frame["label"] == label].head(int(quota)) for label, quota in quotas.items()])


# ---------------------------------------------------------------------------------------------------
# Tokenising and sharding


def prepare(
    dataset_name: str,
    dataset_def: dict,
    model_def: dict,
    seq_len: int,
    out_dir: str | Path,
    shard_size_mb: float = 128,
) -> dict:
    """Load, tokenise and shard one dataset; write shards and ``manifest.json`` into ``out_dir``."""
    from .modeling import load_tokenizer

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    train, evaluation = load_raw_splits(dataset_def, dataset_name)
    label_names = dataset_def.get("labels") or sorted(pd.concat([train["label"], evaluation["label"]]).unique().tolist())
    label_ids = {name: index for index, name in enumerate(label_names)}
    unknown = set(evaluation["label"]) - set(label_ids)
    if unknown:
        raise ConfigError(
            f"config key datasets.{dataset_name}.labels: eval split has labels {sorted(map(str, unknown))} not in train"
        )

    tokenizer = load_tokenizer(model_def)
    manifest = {
        "manifest_version": MANIFEST_VERSION,
        "dataset": dataset_name,
        "source_fingerprint": sources.fingerprint(dataset_def["source"]),
        "tokenizer": model_def["source"].get("tokenizer", model_def["source"]),
        "tokenizer_class": type(tokenizer).__name__,
        "pad_token_id": tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id,
        "seq_len": seq_len,
        "label_names": [str(name) for name in label_names],
        "shard_size_mb": shard_size_mb,
        "splits": {},
    }
    for split_name, frame in zip(SPLITS, (train, evaluation)):
        encoded = tokenizer(frame["text"].astype(str).tolist(), truncation=True, max_length=seq_len)
        table = pa.table(
            {
                "input_ids": pa.array(encoded["input_ids"], type=pa.list_(pa.int32())),
                "length": pa.array([len(ids) for ids in encoded["input_ids"]], type=pa.int32()),
                "label": pa.array([label_ids[value] for value in frame["label"]], type=pa.int64()),
            }
        )
        manifest["splits"][split_name] = {
            "rows": table.num_rows,
            "tokens": int(pa.compute.sum(table["length"]).as_py() or 0),
            "shards": write_shards(table, out_dir, split_name, shard_size_mb),
        }
    atomic.write_json(out_dir / MANIFEST_NAME, manifest)
    return manifest


def write_shards(table: pa.Table, out_dir: Path, split_name: str, shard_size_mb: float) -> list[dict]:
    """Cut a table into Parquet files of about ``shard_size_mb`` each (in-memory size as the estimate)."""
    target_bytes = shard_size_mb * 1024 * 1024
    bytes_per_row = max(table.nbytes / max(table.num_rows, 1), 1)
    rows_per_shard = max(1, int(target_bytes // bytes_per_row))
    count = max(1, math.ceil(table.num_rows / rows_per_shard))
    shards = []
    for index in range(count):
        piece = table.slice(index * rows_per_shard, rows_per_shard)
        name = f"{split_name}-{index:05d}-of-{count:05d}.parquet"
        with atomic.atomic_path(out_dir / name) as tmp:
            pq.write_table(piece, tmp)
        shards.append({"file": name, "rows": piece.num_rows, "bytes": (out_dir / name).stat().st_size, "sha256": sha256_file(out_dir / name)})
    return shards


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


# ---------------------------------------------------------------------------------------------------
# Reading prepared data back


def read_manifest(data_dir: str | Path) -> dict:
    path = Path(data_dir) / MANIFEST_NAME
    if not path.is_file():
        raise ManifestError(f"{path}: manifest missing; run prepare_data for this dataset")
    manifest = json.loads(path.read_text(encoding="utf-8"))
    if manifest.get("manifest_version") != MANIFEST_VERSION:
        raise ManifestError(f"{path}: manifest version {manifest.get('manifest_version')} != {MANIFEST_VERSION}; prepare the data again")
    return manifest


def verify(data_dir: str | Path, manifest: dict | None = None) -> dict:
    """Check every shard against the manifest (size, sha256, rows). Raise ManifestError naming the shard."""
    data_dir = Path(data_dir)
    manifest = manifest or read_manifest(data_dir)
    for split in manifest["splits"].values():
        for shard in split["shards"]:
            path = data_dir / shard["file"]
            if not path.is_file():
                raise ManifestError(f"data shard {path}: missing; delete {data_dir} and prepare it again")
            size = path.stat().st_size
            if size != shard["bytes"]:
                raise ManifestError(f"data shard {path}: {size} bytes, manifest says {shard['bytes']} (truncated or replaced)")
            digest = sha256_file(path)
            if digest != shard["sha256"]:
                raise ManifestError(f"data shard {path}: sha256 {digest[:12]}… does not match the manifest ({shard['sha256'][:12]}…)")
    return manifest


@dataclass
class TokenisedSplit:
    """A split in memory: unpadded token id arrays and integer labels."""

    input_ids: list[np.ndarray]
    labels: np.ndarray

    def __len__(self) -> int:
        return len(self.labels)

    @property
    def lengths(self) -> np.ndarray:
        return np.fromiter((len(ids) for ids in self.input_ids), dtype=np.int64, count=len(self.input_ids))


def load_split(data_dir: str | Path, split_name: str, manifest: dict) -> TokenisedSplit:
    data_dir = Path(data_dir)
    tables = [pq.read_table(data_dir / shard["file"]) for shard in manifest["splits"][split_name]["shards"]]
    table = pa.concat_tables(tables)
    ids = [np.asarray(row, dtype=np.int64) for row in table["input_ids"].to_pylist()]
    return TokenisedSplit(input_ids=ids, labels=table["label"].to_numpy().astype(np.int64))
