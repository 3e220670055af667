"""Prepare tokenised datasets as Parquet shards with a manifest, and read them back verified.

One preparation serves every run with the same (dataset, tokenizer, sequence length). Sequences are
stored unpadded (``input_ids`` of their true length): padding is added per batch at training time, so the
real token count of every batch is known exactly and never includes padding.
"""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from ftbench import atomic
from ftbench.tasks import batching, task_types
from ftbench.data import sources
from ftbench.errors import ConfigError, ManifestError, SourceError
from ftbench.experiment.matrix import DEFAULT_SHARD_SIZE_MB
from ftbench.train.modeling import SYNTHETIC_PAD_ID, config_vocab, config_vocab_size, load_failure, load_tokenizer, tokenizer_source
from ftbench.runspec import RunSpec

MANIFEST_NAME = "manifest.json"
MANIFEST_VERSION = 1
SPLITS = ("train", "eval")
ROW_GROUP_ROWS = 1024


# ---------------------------------------------------------------------------------------------------
# Reading the raw dataset


def load_raw_splits(dataset_def: dict, dataset_name: str = "dataset", task: str = "classification",
                    dropped: dict | None = None):
    """The train and eval examples as DataFrames with column ``text``, plus ``label`` (classification,
    original values) or ``target`` (seq2seq). ``dropped``, if given, receives the rows left out per
    source split and rule (see ``_clean``)."""
    where = f"datasets.{dataset_name}"
    columns = {"text": ("text_column", dataset_def["text_column"])}
    if task == "classification":
        columns["label"] = ("label_column", dataset_def.get("label_column"))
    if task == "seq2seq":
        columns["target"] = ("target_column", dataset_def.get("target_column"))
    for role, column in columns.values():
        if column is None:
            raise ConfigError(f"config key {where}.{role}: required for a {task} model")

    tables = _load_source_tables(dataset_def, where)
    for split_name, frame in tables.items():
        for role, column in columns.values():
            if column not in frame.columns:
                raise ConfigError(
                    f"config key {where}.{role}: column {column!r} not in split {split_name!r}; "
                    f"columns are {', '.join(map(str, frame.columns))}"
                )
    tables = {
        name: frame[[column for _, column in columns.values()]].set_axis(list(columns), axis=1)
        for name, frame in tables.items()
    }
    for name, (role, column) in columns.items():
        _check_scalar_column(tables, name, f"{where}.{role}", column)
    labels = dataset_def.get("labels") if task == "classification" else None
    if task == "classification":  # on the raw values first: a label given as "0" for a column of 0s shows as such
        check_labels(pd.concat(tables.values())["label"], labels, where, dataset_def["label_column"])
    deduplicate = dataset_def.get("deduplicate", True)
    cleaned = {name: _clean(frame, labels, deduplicate) for name, frame in tables.items()}
    tables = {name: frame for name, (frame, _) in cleaned.items()}
    counts = {name: split_counts for name, (_, split_counts) in cleaned.items()}
    if dropped is not None:
        dropped.update(counts)
    if task == "classification":
        # Again after cleaning: a class whose rows were all empty or conflicting is not one the model can learn.
        check_labels(pd.concat(tables.values())["label"], labels, where, dataset_def["label_column"])

    if "eval_split" not in dataset_def:
        name = dataset_def.get("train_split", "train")
        name = name if name in tables else next(iter(tables))
        frame = tables[name]
        train_size = dataset_def.get("train_size", int(len(frame) * 0.8))
        eval_size = dataset_def.get("eval_size", len(frame) - train_size)
        if train_size + eval_size > len(frame):
            raise ConfigError(
                f"config key {where}.train_size: train_size + eval_size = {train_size + eval_size} "
                f"but only {len(frame)} usable rows remain after filtering and deduplication"
            )
        train, evaluation = stratified_split(frame, train_size, eval_size, dataset_def.get("split_seed", 0))
        for split, part, key in (("train", train, "train_size"), ("eval", evaluation, "eval_size")):
            if part.empty:
                raise ConfigError(f"config key {where}.{key}: the {split} part would have no rows ({len(frame)} usable "
                                  f"rows of split {name!r}; rows dropped: {_dropped_text(counts[name])}); expected at least 1")
        return train, evaluation

    for key in ("train_split", "eval_split"):
        split = dataset_def.get(key, "train")
        if split not in tables:
            raise ConfigError(f"config key {where}.{key}: split {split!r} not found; splits are {', '.join(tables)}")
        if tables[split].empty:
            raise ConfigError(f"config key {where}.{key}: split {split!r} has no usable rows (rows dropped: "
                              f"{_dropped_text(counts[split])}); expected rows with text"
                              + (" and a label" if task == "classification" else ""))
    train_name, eval_name = dataset_def.get("train_split", "train"), dataset_def["eval_split"]
    train, evaluation = tables[train_name], tables[eval_name]
    if deduplicate and train_name != eval_name:
        # Official splits can share texts: a text seen in training scores as if it were new.
        seen = evaluation["text"].isin(set(train["text"]))
        evaluation = evaluation[~seen].reset_index(drop=True)
        counts[eval_name]["also_in_train"] = int(seen.sum())
        if evaluation.empty:
            raise ConfigError(f"config key {where}.eval_split: every text of split {eval_name!r} is also in {train_name!r}; "
                              "expected an eval split of unseen texts (or set deduplicate: false)")
    return train, evaluation


def _dropped_text(counts: dict) -> str:
    return ", ".join(f"{rule} {count}" for rule, count in counts.items() if count) or "none"


def _check_scalar_column(tables: dict, name: str, key: str, column: str) -> None:
    """A text, label or target column holds one value a row: a column of lists (pre-tokenised words,
    multi-label sets) cannot be tokenised or counted as one class, and would fail deep inside pandas."""
    for split, frame in tables.items():
        values = frame[name].dropna()
        if len(values) and isinstance(values.iloc[0], (list, tuple, dict, set, np.ndarray)):
            raise ConfigError(f"config key {key}: column {column!r} of split {split!r} holds "
                              f"{type(values.iloc[0]).__name__} values; expected one string (or one label) per row "
                              "(pre-tokenised text and multi-label rows are not supported)")


def check_labels(values: pd.Series, labels: list | None, where: str, column: str) -> None:
    """Refuse classification data that would train a head with a class that has no rows, or with one
    class only (every prediction right: an eval accuracy of 1.0 that means nothing)."""
    counts = values.dropna().value_counts()
    found = ", ".join(f"{value!r}: {count}" for value, count in counts.head(20).items())
    found += ", ..." if len(counts) > 20 else ""
    if labels is not None:
        missing = [label for label in labels if counts.get(label, 0) == 0]
        if missing:
            raise ConfigError(
                f"config key {where}.labels: {', '.join(map(repr, missing))} never occur in column {column!r}; "
                f"label counts found: {found or 'none'}"
            )
    classes = len(labels) if labels is not None else len(counts)
    if classes < 2:
        raise ConfigError(
            f"config key {where}.label_column: column {column!r} holds one class only ({found or 'no labels'}); "
            "a classifier needs at least 2 (accuracy would be 1.0 by construction)"
        )


def _load_source_tables(dataset_def: dict, where: str = "datasets.dataset") -> dict[str, pd.DataFrame]:
    source = dataset_def["source"]
    if source["kind"] != "hub":
        location = Path(sources.resolve_location(source))
        if not location.exists():
            raise SourceError(f"dataset source {location} does not exist")
        data_format = sources.dataset_format(location, dataset_def.get("format"), where)
        if data_format is not None:
            # Plain files are read with pandas (compression inferred from the suffix): no extra
            # dependency on training nodes, and the same frames `datasets` would give.
            return {"train": sources.read_table_file(location, data_format, dataset_def.get("encoding", "utf-8"), where)}

    import datasets  # hub names, save_to_disk folders and hub-layout folders

    if source["kind"] == "hub":
        try:
            loaded = datasets.load_dataset(source["name"], source.get("subset"), revision=source.get("revision"))
        except (OSError, ConnectionError, ValueError) as exc:
            raise SourceError(load_failure("dataset", source, source["name"], exc)) from None
    elif (location / "dataset_dict.json").is_file() or (location / "state.json").is_file():
        loaded = datasets.load_from_disk(str(location))
    else:
        loaded = datasets.load_dataset(str(location))
    if isinstance(loaded, datasets.Dataset):
        loaded = datasets.DatasetDict({"train": loaded})
    return {name: split.to_pandas() for name, split in loaded.items()}


def _clean(frame: pd.DataFrame, labels: list | None, deduplicate: bool) -> tuple[pd.DataFrame, dict]:
    """Usable rows, and how many rows each rule dropped (recorded in the manifest)."""
    dropped = {}
    before = len(frame)
    frame = frame.dropna()
    frame = frame[frame["text"].astype(str).str.strip() != ""]
    dropped["missing_or_empty"] = before - len(frame)
    before = len(frame)
    if labels is not None:
        frame = frame[frame["label"].isin(labels)]
    dropped["other_labels"] = before - len(frame)
    if deduplicate:
        # A text that occurs twice could land in train and in eval and inflate accuracy. Keeping one copy
        # of it prevents that as well as dropping every copy does, and loses less data. A text given two
        # different labels has no right answer: every copy of it goes.
        if "label" in frame.columns:
            before = len(frame)
            conflicting = frame.groupby("text")["label"].transform("nunique") > 1
            frame = frame[~conflicting]
            dropped["conflicting_labels"] = before - len(frame)
        before = len(frame)
        frame = frame.drop_duplicates(subset="text", keep="first")
        dropped["duplicates"] = before - len(frame)
    return frame.reset_index(drop=True), dropped


def stratified_split(frame: pd.DataFrame, train_size: int, eval_size: int, seed: int):
    """Seeded split that keeps each label's share in both parts (largest-remainder quotas)."""
    rng = np.random.default_rng(seed)
    shuffled = frame.iloc[rng.permutation(len(frame))].reset_index(drop=True)
    eval_part = _take_stratified(shuffled, eval_size)
    rest = shuffled.drop(eval_part.index)
    train_part = _take_stratified(rest, train_size)
    return train_part.reset_index(drop=True), eval_part.reset_index(drop=True)


def _take_stratified(frame: pd.DataFrame, count: int) -> pd.DataFrame:
    if "label" not in frame.columns:
        return frame.head(count)  # no classes to balance: the shuffled order is the split
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
    shard_size_mb: float = DEFAULT_SHARD_SIZE_MB,
    model_name: str = "model",
    image_size: int | None = None,
) -> dict:
    """Load, tokenise and shard one dataset; write shards and ``manifest.json`` into ``out_dir``.
    Image tasks decode and resize their images instead (images.py; ``image_size``: the runs' setting)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    task = task_types.model_task(model_def)
    if task == "vision_language":
        from ftbench.tasks import vision_language

        return vision_language.prepare(dataset_name, dataset_def, model_def, seq_len, image_size, out_dir, shard_size_mb,
                                       model_name)
    if task == "image_text_retrieval":
        from ftbench.tasks import retrieval

        return retrieval.prepare(dataset_name, dataset_def, model_def, seq_len, image_size, out_dir, shard_size_mb, model_name)
    if task in task_types.IMAGE_TASKS:
        from ftbench.data import images

        return images.prepare(dataset_name, dataset_def, model_def, seq_len, image_size, out_dir, shard_size_mb, model_name)
    tokenizer = load_tokenizer(model_def)
    if tokenizer is not None and model_def["source"]["kind"] == "config":
        # Refuse a config model whose vocab_size contradicts its tokenizer now, not in every training job.
        config_vocab(RunSpec(model=model_name), model_def["source"].get("overrides", {}), len(tokenizer))
    if dataset_def["source"]["kind"] == "synthetic":
        vocab_size = len(tokenizer) if tokenizer is not None else config_vocab_size(model_def)
        if vocab_size is None:
            raise ConfigError(f"config key datasets.{dataset_name}: synthetic data needs the model's vocab_size or a tokenizer")
        split_tables, label_names = synthetic_tables(dataset_def, task, seq_len, vocab_size)
        dropped = {}
    else:
        split_tables, label_names, dropped = _tokenised_tables(dataset_name, dataset_def, task, tokenizer, seq_len)

    manifest = {
        "manifest_version": MANIFEST_VERSION,
        "dataset": dataset_name,
        "task": task,
        "source_fingerprint": sources.fingerprint(dataset_def["source"]),
        "tokenizer": tokenizer_source(model_def),
        "tokenizer_class": type(tokenizer).__name__ if tokenizer is not None else None,
        "pad_token_id": tokenizer.pad_token_id if tokenizer is not None else SYNTHETIC_PAD_ID,
        # Token ids run below this: a config-built model takes it as its vocabulary size.
        "vocab_size": len(tokenizer) if tokenizer is not None else config_vocab_size(model_def),
        "seq_len": seq_len,
        "label_names": label_names,
        # Source rows left out, by rule and source split: rows with a missing or empty field, rows of other
        # labels than `labels` lists, repeated texts (one copy kept).
        "rows_dropped": dropped,
        "shard_size_mb": shard_size_mb,
        # What produced these shards, so `python -m ftbench repair-data` can produce them again.
        "preparation": {"dataset": dataset_name, "dataset_def": dataset_def, "model": model_name, "model_def": model_def,
                        "seq_len": seq_len},
        "splits": {},
    }
    for split_name, table in split_tables.items():
        manifest["splits"][split_name] = {
            "rows": table.num_rows,
            "tokens": batching.real_tokens_in(table),
            "shards": write_shards(table, out_dir, split_name, shard_size_mb),
        }
    atomic.write_json(out_dir / MANIFEST_NAME, manifest)
    return manifest


def _tokenised_tables(dataset_name, dataset_def, task, tokenizer, seq_len):
    dropped: dict = {}
    train, evaluation = load_raw_splits(dataset_def, dataset_name, task, dropped)
    label_ids = None
    label_names = None
    if task == "classification":
        # The classes are the ones training sees: an eval-only label would be a class the head never learns.
        label_names = dataset_def.get("labels") or sorted(train["label"].unique().tolist())
        label_ids = {name: index for index, name in enumerate(label_names)}
        unknown = evaluation["label"][~evaluation["label"].isin(set(train["label"]))].value_counts()
        if len(unknown):
            found = ", ".join(f"{value!r}: {count}" for value, count in unknown.head(10).items())
            raise ConfigError(
                f"config key datasets.{dataset_name}.labels: the eval split has labels the train split lacks ({found} rows); "
                "expected eval labels that training sees: list the classes to keep in labels, or use a labelled eval split"
            )
        label_names = [str(name) for name in label_names]
    tables = {}
    for split_name, frame in zip(SPLITS, (train, evaluation)):
        input_ids = tokenizer(frame["text"].astype(str).tolist(), truncation=True, max_length=seq_len)["input_ids"]
        labels = [label_ids[value] for value in frame["label"]] if label_ids else None
        targets = None
        if task == "seq2seq":
            targets = tokenizer(text_target=frame["target"].astype(str).tolist(), truncation=True, max_length=seq_len)["input_ids"]
        tables[split_name] = batching.to_table(task, input_ids, labels, targets)
    return tables, label_names, dropped


def synthetic_tables(dataset_def: dict, task: str, seq_len: int, vocab_size: int):
    """Random full-length token sequences, for throughput and memory runs where quality is irrelevant.

    Every sequence is exactly ``seq_len`` tokens, so there is no padding and the token count per step is
    fixed (batch x seq_len), which makes runs of different shapes directly comparable.
    """
    source = dataset_def["source"]
    rng = np.random.default_rng(dataset_def.get("split_seed", 0))
    sizes = {"train": dataset_def.get("train_size", sources.SYNTHETIC_SPLIT_ROWS["train"]),
             "eval": dataset_def.get("eval_size", sources.SYNTHETIC_SPLIT_ROWS["eval"])}
    num_labels = source.get("num_labels", 2)
    low = min(100, vocab_size // 2)  # skip the special tokens at the start of most vocabularies
    tables = {}
    for split_name, rows in sizes.items():
        ids = rng.integers(low, vocab_size, size=(rows, seq_len), dtype=np.int64).tolist()
        labels = rng.integers(0, num_labels, size=rows).tolist() if task == "classification" else None
        targets = None
        if task == "seq2seq":
            target_len = source.get("target_len", max(1, seq_len // 4))
            targets = rng.integers(low, vocab_size, size=(rows, target_len), dtype=np.int64).tolist()
        tables[split_name] = batching.to_table(task, ids, labels, targets)
    label_names = [str(index) for index in range(num_labels)] if task == "classification" else None
    return tables, label_names


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
            # Small row groups let the disk data source read a batch's rows without decoding a shard.
            pq.write_table(piece, tmp, row_group_size=ROW_GROUP_ROWS)
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
    """Check every shard against the manifest (size, sha256, rows). Raise ManifestError naming the shard
    and the way back."""
    data_dir = Path(data_dir)
    manifest = manifest or read_manifest(data_dir)
    problems = damaged_shards(data_dir, manifest)
    if problems:
        path, problem = problems[0]
        more = f" (and {len(problems) - 1} more shard(s))" if len(problems) > 1 else ""
        raise ManifestError(
            f"data shard {path}: {problem}{more}. To prepare it again and keep the results of runs trained on it, "
            f"run: python -m ftbench repair-data {data_dir}"
        )
    return manifest


def damaged_shards(data_dir: Path, manifest: dict) -> list[tuple[Path, str]]:
    """(shard, what is wrong) for each shard that is missing or differs from the manifest."""
    problems = []
    for split in manifest["splits"].values():
        for shard in split["shards"]:
            path = data_dir / shard["file"]
            if not path.is_file():
                problems.append((path, "missing"))
                continue
            size = path.stat().st_size
            if size != shard["bytes"]:
                problems.append((path, f"{size} bytes, manifest says {shard['bytes']} (truncated or replaced)"))
                continue
            digest = sha256_file(path)
            if digest != shard["sha256"]:
                problems.append((path, f"sha256 {digest[:12]}… does not match the manifest ({shard['sha256'][:12]}…)"))
    return problems


def repair(data_dir: str | Path) -> list[Path]:
    """Prepare a data folder's dataset again and put back the shards that were damaged, if the source
    still gives exactly the data of the manifest (same sha256 for every shard); return the shards put back.

    The manifest and the folder's other files are left as they are, so the runs trained on this data
    keep their results (Snakemake sees the same prepared data); only if the source now gives other data
    is the repair refused, because those results would then describe data that no longer exists.
    """
    import shutil
    import tempfile

    data_dir = Path(data_dir)
    manifest = read_manifest(data_dir)
    damaged = damaged_shards(data_dir, manifest)
    if not damaged:
        return []
    job = manifest.get("preparation")
    if job is None:
        raise ManifestError(f"{data_dir}: the manifest predates repair-data (no preparation recorded); delete "
                            f"{data_dir} and run snakemake again (runs on this data train again)")
    with tempfile.TemporaryDirectory(prefix=".repair-", dir=data_dir.parent) as scratch:
        fresh = prepare(job["dataset"], job["dataset_def"], job["model_def"], job["seq_len"], scratch, manifest["shard_size_mb"],
                        job["model"], job.get("image_size"))
        expected = {shard["file"]: shard["sha256"] for split in manifest["splits"].values() for shard in split["shards"]}
        produced = {shard["file"]: shard["sha256"] for split in fresh["splits"].values() for shard in split["shards"]}
        if produced != expected:
            raise ManifestError(
                f"{data_dir}: preparing {job['dataset']} again gives other data than the manifest records (the source "
                f"or the tokenizer changed), so results trained on the old data cannot be kept; delete {data_dir} and "
                "run snakemake again to prepare it and retrain the runs that use it"
            )
        for path, _ in damaged:
            with atomic.atomic_path(path) as tmp:
                shutil.copyfile(Path(scratch) / path.name, tmp)
    verify(data_dir, manifest)
    return [path for path, _ in damaged]


def load_split(data_dir: str | Path, split_name: str, manifest: dict, data_source: str = "memory"):
    """A split to draw batches from: decoded into memory up front, or read from the shards per batch."""
    data_dir = Path(data_dir)
    shards = [data_dir / shard["file"] for shard in manifest["splits"][split_name]["shards"]]
    if manifest["task"] == "vision_language":
        from ftbench.tasks import vision_language

        return vision_language.load_split(shards, manifest, data_source)
    if manifest["task"] == "image_text_retrieval":
        from ftbench.tasks import retrieval

        return retrieval.load_split(shards, manifest, data_source)
    if manifest["task"] in task_types.IMAGE_TASKS:
        from ftbench.data import images

        return images.load_split(shards, manifest, data_source)
    if data_source == "disk":
        return DiskSplit(shards)
    return batching.from_table(pa.concat_tables([pq.read_table(path) for path in shards]))


class DiskSplit:
    """Rows read from the Parquet shards when a batch asks for them (``data_source: disk``).

    Each batch reads and decodes the row groups holding its rows; a few recently decoded groups are
    kept. This is the cost of training straight from storage (the OS page cache still helps), so the
    loader-wait figure of a disk run shows whether storage and decoding keep up with the GPU.
    """

    CACHED_GROUPS = 8

    def __init__(self, shards: list[Path]):
        self.files = [pq.ParquetFile(path) for path in shards]
        # (file, row group, first global row) for each row group, in order
        self.groups = []
        first = 0
        for file_index, parquet in enumerate(self.files):
            for group in range(parquet.num_row_groups):
                self.groups.append((file_index, group, first))
                first += parquet.metadata.row_group(group).num_rows
        self.rows = first
        self.group_starts = np.array([start for _, _, start in self.groups])
        self._cache: dict[int, batching.TokenisedSplit] = {}

    def __len__(self) -> int:
        return self.rows

    def _group(self, index: int) -> batching.TokenisedSplit:
        if index not in self._cache:
            if len(self._cache) >= self.CACHED_GROUPS:
                self._cache.pop(next(iter(self._cache)))  # oldest first
            file_index, group, _ = self.groups[index]
            self._cache[index] = batching.from_table(self.files[file_index].read_row_group(group))
        return self._cache[index]

    def lengths(self) -> np.ndarray:
        """Input length of every row, from the shards' length column (no token ids decoded)."""
        return np.concatenate([parquet.read(columns=["length"])["length"].to_numpy() for parquet in self.files])

    def take(self, indices: np.ndarray) -> batching.TokenisedSplit:
        indices = np.asarray(indices)
        group_of = np.searchsorted(self.group_starts, indices, side="right") - 1
        input_ids: list = [None] * len(indices)
        targets: list = [None] * len(indices)
        labels = None
        # One take per row group touched, then each row back to its place in the batch.
        for group in np.unique(group_of):
            positions = np.flatnonzero(group_of == group)
            rows = self._group(int(group)).take(indices[positions] - self.group_starts[group])
            for slot, position in enumerate(positions):
                input_ids[position] = rows.input_ids[slot]
                if rows.target_ids is not None:
                    targets[position] = rows.target_ids[slot]
            if rows.labels is not None:
                labels = np.empty(len(indices), dtype=np.int64) if labels is None else labels
                labels[positions] = rows.labels
        has_targets = targets and targets[0] is not None
        return batching.TokenisedSplit(input_ids=input_ids, labels=labels, target_ids=targets if has_targets else None)
