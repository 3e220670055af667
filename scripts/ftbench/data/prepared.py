"""Prepared data, task-neutral: raw tables (loading, cleaning, stratified splits), Parquet shards with a
manifest (writing, verifying, repairing) and reading them back (in memory, or one disk reader for every task).

One preparation serves every run with the same (dataset, tokenizer, sequence length). What a task family
stores in its tables (tokens, labels, pixels) and how it decodes them is the family's (``ftbench.tasks``):
this module never asks which task a dataset is for.
"""

from __future__ import annotations

import hashlib
import json
import math
import shutil
import tempfile
import zlib
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from ftbench import atomic
from ftbench.data import sources
from ftbench.errors import ConfigError, ManifestError, SourceError

MANIFEST_NAME = "manifest.json"
# 2: every split stored in a seeded, stratified order (fair_order), so that any prefix of it is a fair sample of it.
# Data of an earlier version (1: rows in label order) is prepared again.
MANIFEST_VERSION = 2
SPLITS = ("train", "eval")
ROW_GROUP_ROWS = 1024
# Columns of class ids a split's stored order is stratified by (the first of them a table has): a classifier's label,
# a retrieval pair's caption id. A split without one (token sequences, vision-language answers) is shuffled.
STRATA_COLUMNS = ("label", "caption_id")
# Shard size when none is given (the config's default is experiment.matrix.DEFAULT_SHARD_SIZE_MB, one layer up).
DEFAULT_SHARD_SIZE_MB = 128


# ---------------------------------------------------------------------------------------------------
# Reading the raw dataset


LABELLED_TEXT_ROLES = {"text": "text_column", "label": "label_column"}

# Why preparation leaves a source row out: the rules of the manifest's rows_dropped (source split -> rule ->
# rows), in the order a reader meets them. Each is a column of the runs that used the data (rows_dropped_<rule>).
DROP_REASONS = {
    "missing_or_empty": "a missing or empty text, label, image or target",
    "other_labels": "a label that is not among the dataset's labels",
    "conflicting_labels": "a text given two different labels (every copy dropped; deduplicate)",
    "duplicates": "a repeated text (one copy kept; deduplicate)",
    "also_in_train": "an eval row whose text is also in train (named eval splits; deduplicate)",
    "bad_image": "an image file that is missing, truncated or not an image (on_bad_image: skip)",
    "empty_answer": "vision_language: an answer with no tokens",
    # instruction data (tasks/instruction_rows.py tells them)
    "bad_message": "instruction: a message that is not a {role, content} mapping of strings, or a conversation that "
                   "starts with the assistant",
    "unknown_role": "instruction: a message whose role is not system, developer, user, assistant or tool",
    "no_assistant_turn": "instruction: a conversation without an assistant turn (nothing to train)",
    "empty_completion": "instruction: an empty completion, or assistant turns without text",
    "prompt_fills_seq_len": "instruction: a prompt that fills seq_len alone (no completion token would be trained)",
}


def dropped_by_reason(rows_dropped: dict) -> dict[str, int]:
    """Rows left out per rule over every source split (the manifest's rows_dropped), rules in DROP_REASONS order."""
    totals: dict[str, int] = {}
    for counts in (rows_dropped or {}).values():
        for rule, count in counts.items():
            totals[rule] = totals.get(rule, 0) + int(count)
    return dict(sorted(totals.items(), key=lambda item: list(DROP_REASONS).index(item[0]) if item[0] in DROP_REASONS else 99))


def data_columns(manifest: dict) -> dict:
    """What a run's figures are read against, from its data's manifest: rows_dropped_<rule> and
    rows_dropped_total (null for data that is not cleaned: synthetic). The majority-class rate is not among them:
    it is the rate of the rows the final evaluation scored (train/evaluation.py), which a run that never reached
    its final evaluation has none of (the whole split's would stand beside a score nobody computed)."""
    rows_dropped = manifest.get("rows_dropped") or {}
    totals = dropped_by_reason(rows_dropped)
    columns = {f"rows_dropped_{rule}": totals.get(rule, 0) if rows_dropped else None for rule in DROP_REASONS}
    columns["rows_dropped_total"] = sum(totals.values()) if rows_dropped else None
    return columns


def dropped_summary(rows_dropped: dict) -> str:
    """``duplicates 12, also_in_train 3`` (rules with no rows left out), or ``none``."""
    return _dropped_text(dropped_by_reason(rows_dropped))


def load_raw_splits(dataset_def: dict, dataset_name: str = "dataset", roles: dict[str, str] = LABELLED_TEXT_ROLES,
                    dropped: dict | None = None, purpose: str = "classification"):
    """The train and eval examples as DataFrames with one column per role (role -> the config key naming its
    source column): ``text``, plus ``label`` (original values) or ``target`` as a task family asks.
    ``dropped``, if given, receives the rows left out per source split and rule (see ``_clean``);
    ``purpose`` (the task) only words the errors."""
    where = f"datasets.{dataset_name}"
    columns = {role: (key, dataset_def.get(key)) for role, key in roles.items()}
    for key, column in columns.values():
        if column is None:
            raise ConfigError(f"config key {where}.{key}: required for a {purpose} model")
    tables = _role_frames(load_source_tables(dataset_def, where), columns, where)
    labels = dataset_def.get("labels") if "label" in columns else None
    if "label" in columns:  # on the raw values first: a label given as "0" for a column of 0s shows as such
        check_labels(pd.concat(tables.values())["label"], labels, where, dataset_def["label_column"])
    deduplicate = dataset_def.get("deduplicate", True)
    cleaned = {name: _clean(frame, labels, deduplicate) for name, frame in tables.items()}
    tables = {name: frame for name, (frame, _) in cleaned.items()}
    counts = {name: split_counts for name, (_, split_counts) in cleaned.items()}
    if dropped is not None:
        dropped.update(counts)
    if "label" in columns:
        # Again after cleaning: a class whose rows were all empty or conflicting is not one the model can learn.
        check_labels(pd.concat(tables.values())["label"], labels, where, dataset_def["label_column"])
    if "eval_split" not in dataset_def:
        return _seeded_split(tables, counts, dataset_def, where)
    return _named_splits(tables, counts, dataset_def, where, " and a label" if "label" in columns else "")


def _role_frames(tables: dict[str, pd.DataFrame], columns: dict, where: str) -> dict[str, pd.DataFrame]:
    """Each split cut to the roles' columns, renamed to the roles; a missing or non-scalar column refused."""
    for split_name, frame in tables.items():
        for key, column in columns.values():
            if column not in frame.columns:
                raise ConfigError(
                    f"config key {where}.{key}: column {column!r} not in split {split_name!r}; "
                    f"columns are {', '.join(map(str, frame.columns))}"
                )
    tables = {
        name: frame[[column for _, column in columns.values()]].set_axis(list(columns), axis=1)
        for name, frame in tables.items()
    }
    for name, (key, column) in columns.items():
        _check_scalar_column(tables, name, f"{where}.{key}", column)
    return tables


def _seeded_split(tables: dict, counts: dict, dataset_def: dict, where: str):
    """(train, eval) cut from one split: train_size and eval_size rows, seeded and stratified by label."""
    name = dataset_def.get("train_split", "train")
    name = name if name in tables else next(iter(tables))
    frame = tables[name]
    train, evaluation = seeded_split(frame, dataset_def, where, "usable rows remain after filtering and deduplication")
    for split, part, key in (("train", train, "train_size"), ("eval", evaluation, "eval_size")):
        if part.empty:
            raise ConfigError(f"config key {where}.{key}: the {split} part would have no rows ({len(frame)} usable "
                              f"rows of split {name!r}; rows dropped: {_dropped_text(counts[name])}); expected at least 1")
    return train, evaluation


def _named_splits(tables: dict, counts: dict, dataset_def: dict, where: str, row_needs: str):
    """(train, eval): the splits train_split and eval_split name, eval rows seen in train left out."""
    for key in ("train_split", "eval_split"):
        split = dataset_def.get(key, "train")
        if split not in tables:
            raise ConfigError(f"config key {where}.{key}: split {split!r} not found; splits are {', '.join(tables)}")
        if tables[split].empty:
            raise ConfigError(f"config key {where}.{key}: split {split!r} has no usable rows (rows dropped: "
                              f"{_dropped_text(counts[split])}); expected rows with text" + row_needs)
    train_name, eval_name = dataset_def.get("train_split", "train"), dataset_def["eval_split"]
    train, evaluation = tables[train_name], tables[eval_name]
    if dataset_def.get("deduplicate", True) and train_name != eval_name:
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


def load_source_tables(dataset_def: dict, where: str = "datasets.dataset") -> dict[str, pd.DataFrame]:
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
            raise SourceError(sources.load_failure("dataset", source, source["name"], exc)) from None
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


def seeded_split(frame: pd.DataFrame, dataset_def: dict, where: str, rows_left: str = "usable rows remain"):
    """(train, eval): the dataset's train_size and eval_size rows of one table (80/20 by default), seeded by its
    split_seed and stratified by label; too few rows are refused naming train_size (``rows_left`` says which rows
    were counted)."""
    train_size = dataset_def.get("train_size", int(len(frame) * 0.8))
    eval_size = dataset_def.get("eval_size", len(frame) - train_size)
    if train_size + eval_size > len(frame):
        raise ConfigError(f"config key {where}.train_size: train_size + eval_size = {train_size + eval_size} but only "
                          f"{len(frame)} {rows_left}")
    return stratified_split(frame, train_size, eval_size, dataset_def.get("split_seed", 0))


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
# Shards and manifest


def manifest_head(task: str, dataset_name: str, dataset_def: dict, model_name: str, model_def: dict, seq_len: int,
                  shard_size_mb: float, fields: dict) -> dict:
    """The manifest fields every preparation writes, in their order; ``fields`` are the family's own (the
    tokenizer, label names, rows dropped, ...), put between ``source_fingerprint`` and ``shard_size_mb``."""
    return {
        "manifest_version": MANIFEST_VERSION,
        "dataset": dataset_name,
        "task": task,
        "source_fingerprint": sources.fingerprint(dataset_def["source"]),
        **fields,
        "shard_size_mb": shard_size_mb,
        # What produced these shards, so `python -m ftbench repair-data` can produce them again.
        "preparation": {"dataset": dataset_name, "dataset_def": dataset_def, "model": model_name, "model_def": model_def,
                        "seq_len": seq_len},
        "splits": {},
    }


def write_prepared(manifest: dict, tables: dict[str, pa.Table], out_dir: Path, split_figures) -> dict:
    """Each split's table as Parquet shards, in a seeded stratified order (``stored_order``), ``split_figures(table)``
    (rows, tokens, ...) and its shards in the manifest's ``splits``; the manifest written last, so a folder with a
    manifest is complete."""
    for split_name, table in tables.items():
        table, row_order = stored_order(table, split_name, manifest)
        manifest["splits"][split_name] = {
            **split_figures(table),
            **majority_class(table, manifest),
            "row_order": row_order,
            "shards": write_shards(table, out_dir, split_name, manifest["shard_size_mb"]),
        }
    atomic.write_json(out_dir / MANIFEST_NAME, manifest)
    return manifest


def stored_order(table: pa.Table, split_name: str, manifest: dict) -> tuple[pa.Table, dict]:
    """(the split's rows in the order they are stored, how that order was made). Sources and splits often come
    sorted (by label, by length, by date): stored so, the first rows of a split would be one class, and anything
    that takes part of a split by position (an evaluation cut short) would score a biased sample. Stored in
    fair_order, stratified by the table's class column (STRATA_COLUMNS) where it has one and seeded by the
    dataset's split_seed, any prefix of a split is a fair sample of it: each class in its share, lengths alike."""
    column = next((name for name in STRATA_COLUMNS if name in table.column_names
                   and pa.types.is_integer(table.schema.field(name).type)), None)
    seed = int(((manifest.get("preparation") or {}).get("dataset_def") or {}).get("split_seed", 0))
    strata = table[column].to_numpy() if column is not None else None
    order = fair_order(strata, table.num_rows, (seed, zlib.crc32(split_name.encode())))
    return table.take(pa.array(order)), {"stratified_by": column, "seed": seed}


def fair_order(strata: np.ndarray | None, rows: int, seed) -> np.ndarray:
    """A seeded order of ``rows`` rows any prefix of which is a fair sample of them. With ``strata`` (a class per
    row) the classes are interleaved: the i-th of a class's n rows (in a seeded shuffle of them) sits at
    (i + u) / n, u uniform in [0, 1), and the rows are taken by that key, so the first k rows hold each class's
    share of k to within about one row per class. Without, a seeded shuffle (its prefixes are fair in
    expectation: lengths, targets)."""
    rng = np.random.default_rng(seed)
    shuffled = rng.permutation(rows)
    if strata is None:
        return shuffled
    classes = np.asarray(strata)[shuffled]
    grouped = np.argsort(classes, kind="stable")  # each class's rows together, in shuffled order within it
    ordered = classes[grouped]
    starts = np.flatnonzero(np.r_[True, ordered[1:] != ordered[:-1]]) if rows else np.zeros(0, dtype=np.int64)
    sizes = np.diff(np.r_[starts, rows])
    rank = np.arange(rows) - np.repeat(starts, sizes)
    keys = np.empty(rows)
    keys[grouped] = (rank + rng.random(rows)) / np.repeat(sizes, sizes)
    return shuffled[np.argsort(keys, kind="stable")]


def majority_class(table: pa.Table, manifest: dict) -> dict:
    """A classification split's majority-class rate (the accuracy of always answering its most common class:
    what a fine-tuned classifier's accuracy is read against); nothing for data without classes."""
    if not manifest.get("label_names") or "label" not in table.column_names or table.num_rows == 0:
        return {}
    counts = np.bincount(table["label"].to_numpy().astype(np.int64))
    return {"majority_class_rate": float(counts.max() / table.num_rows)}


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
        raise ManifestError(f"{path}: manifest version {manifest.get('manifest_version')} != {MANIFEST_VERSION} (prepared by "
                            f"another ftbench version); delete {Path(data_dir)} and run snakemake again to prepare it anew "
                            "(the runs on it train again)")
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


def repair(data_dir: str | Path, prepare) -> list[Path]:
    """Prepare a data folder's dataset again and put back the shards that were damaged, if the source
    still gives exactly the data of the manifest (same sha256 for every shard); return the shards put back.
    ``prepare(job, scratch_dir, shard_size_mb)``: the preparation the manifest's task family does (data/ knows
    no task: ``tasks.registry.repair`` passes it).

    The manifest and the folder's other files are left as they are, so the runs trained on this data
    keep their results (Snakemake sees the same prepared data); only if the source now gives other data
    is the repair refused, because those results would then describe data that no longer exists.
    """
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
        fresh = prepare(job, scratch, manifest["shard_size_mb"])
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


def shard_paths(data_dir: str | Path, manifest: dict, split_name: str) -> list[Path]:
    return [Path(data_dir) / shard["file"] for shard in manifest["splits"][split_name]["shards"]]


def read_split(shards: list[Path], decode, data_source: str = "memory", lengths=None):
    """A split to draw batches from: ``decode(table)`` (the task family's rows: anything with ``take`` and
    ``lengths``) of every shard, in memory up front; or, for ``data_source: disk``, a DiskSplit reading the
    shards per batch (``lengths(rows)``: every row's length, for a family whose tables have no length column)."""
    if data_source == "disk":
        return DiskSplit(shards, decode, lengths)
    return decode(pa.concat_tables([pq.read_table(path) for path in shards]))


class DiskSplit:
    """Rows read from the Parquet shards when a batch asks for them (``data_source: disk``), for every task
    family: ``decode`` turns the batch's rows (an Arrow table, in batch order) into the family's rows.

    Each batch reads the row groups holding its rows; a few recently read groups are kept. This is the cost
    of training straight from storage (the OS page cache still helps), so the loader-wait figure of a disk
    run shows whether storage and decoding keep up with the GPU.
    """

    CACHED_GROUPS = 8

    def __init__(self, shards: list[Path], decode, lengths=None):
        self.files = [pq.ParquetFile(path) for path in shards]
        self.decode = decode
        self._lengths = lengths
        # (file, row group, first global row) for each row group, in order
        self.groups = []
        first = 0
        for file_index, parquet in enumerate(self.files):
            for group in range(parquet.num_row_groups):
                self.groups.append((file_index, group, first))
                first += parquet.metadata.row_group(group).num_rows
        self.rows = first
        self.group_starts = np.array([start for _, _, start in self.groups])
        self._cache: dict[int, pa.Table] = {}

    def __len__(self) -> int:
        return self.rows

    def _group(self, index: int) -> pa.Table:
        if index not in self._cache:
            if len(self._cache) >= self.CACHED_GROUPS:
                self._cache.pop(next(iter(self._cache)))  # oldest first
            file_index, group, _ = self.groups[index]
            self._cache[index] = self.files[file_index].read_row_group(group)
        return self._cache[index]

    def lengths(self) -> np.ndarray:
        """Length of every row: the shards' length column (no token ids decoded), or ``lengths(rows)``."""
        if self._lengths is not None:
            return self._lengths(self.rows)
        return np.concatenate([parquet.read(columns=["length"])["length"].to_numpy() for parquet in self.files])

    def take(self, indices: np.ndarray):
        """The rows at ``indices``, in that order: one take per row group touched, then each row back to its
        place in the batch, decoded together."""
        indices = np.asarray(indices)
        group_of = np.searchsorted(self.group_starts, indices, side="right") - 1
        pieces, positions = [], []
        for group in np.unique(group_of):
            where = np.flatnonzero(group_of == group)
            pieces.append(self._group(int(group)).take(pa.array(indices[where] - self.group_starts[group])))
            positions.append(where)
        table = pa.concat_tables(pieces).take(pa.array(np.argsort(np.concatenate(positions), kind="stable")))
        return self.decode(table)
