"""What the text families (classification, causal_lm, seq2seq) share: the parse-time rules of text data,
tokenising a dataset (or making synthetic tokens) into Arrow tables and shards, reading them back, padding a
batch, and token-level scoring.

Sequences are stored unpadded (``input_ids`` of their true length): padding is added per batch at training
time, so the real token count of every batch is known exactly and never includes padding.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from ftbench.data import prepared, sources
from ftbench.data.tokenizers import (SYNTHETIC_PAD_ID, check_vocab, config_vocab, config_vocab_size, load_tokenizer,
                                     tokenizer_source)
from ftbench.errors import ConfigError
from ftbench.measure import memory_estimate
from ftbench.runspec import RunSpec
from ftbench.tasks.base import IGNORE_INDEX, Batch, TaskFamily, TokenisedSplit, pad


# ---------------------------------------------------------------------------------------------------
# Arrow tables (what preparation stores)


def _id_lists(values: list[list[int]]) -> pa.Array:
    return pa.array(values, type=pa.list_(pa.int32()))


def to_table(input_ids: list[list[int]], labels: list[int] | None = None,
             target_ids: list[list[int]] | None = None) -> pa.Table:
    """Token ids and their lengths, plus class labels or decoder targets where the family has them."""
    columns: dict = {
        "input_ids": _id_lists(input_ids),
        "length": pa.array([len(ids) for ids in input_ids], type=pa.int32()),
    }
    if labels is not None:
        columns["label"] = pa.array(labels, type=pa.int64())
    if target_ids is not None:
        columns["target_ids"] = _id_lists(target_ids)
        columns["target_length"] = pa.array([len(ids) for ids in target_ids], type=pa.int32())
    return pa.table(columns)


def real_tokens_in(table: pa.Table) -> int:
    total = pc.sum(table["length"]).as_py() or 0
    if "target_length" in table.column_names:
        total += pc.sum(table["target_length"]).as_py() or 0
    return int(total)


def from_table(table: pa.Table) -> TokenisedSplit:
    def arrays(column: str) -> list[np.ndarray]:
        # One flat int64 copy split into per-row views: going through Python lists (to_pylist) took
        # 0.6 s for 4M tokens on 2 cores, in every train job.
        rows = table[column].combine_chunks()
        if rows.null_count:
            raise ValueError(f"column {column!r} has {rows.null_count} missing rows")
        offsets = rows.offsets.to_numpy()
        flat = rows.flatten().to_numpy(zero_copy_only=False).astype(np.int64)
        return np.split(flat, offsets[1:-1] - offsets[0]) if len(rows) else []

    return TokenisedSplit(
        input_ids=arrays("input_ids"),
        labels=table["label"].to_numpy().astype(np.int64) if "label" in table.column_names else None,
        target_ids=arrays("target_ids") if "target_ids" in table.column_names else None,
    )


def padded_inputs(rows: TokenisedSplit, pad_token_id: int) -> tuple[dict, np.ndarray, np.ndarray, int, int, int]:
    """(inputs without labels, ids, mask, real tokens, sum of squared lengths, padded positions) of a batch's
    rows padded to its longest."""
    import torch  # deferred: the registry is read at parse time, torch-free

    ids, mask = pad(rows.input_ids, pad_token_id)
    lengths = mask.sum(axis=1)
    inputs = {"input_ids": torch.from_numpy(ids), "attention_mask": torch.from_numpy(mask)}
    return inputs, ids, mask, int(lengths.sum()), int((lengths * lengths).sum()), int(mask.size)


# ---------------------------------------------------------------------------------------------------
# The family base


class TextFamily(TaskFamily):
    """A text family: its data is a ``text_column`` (plus the columns of ``roles``), tokenised once."""

    roles: dict[str, str] = {"text": "text_column"}  # raw-table role -> config key naming its column

    # -- parse-time rules

    def check_run(self, run: RunSpec, setting_key) -> None:
        dataset_def, model_source = run.dataset_def, run.model_def["source"]
        check_vocab(run.model, run.model_def, "vocab_size", model_source.get("overrides", {}).get("vocab_size"))
        if dataset_def["source"]["kind"] == "synthetic":
            return
        if model_source["kind"] == "config" and "tokenizer" not in model_source:
            raise ConfigError(
                f"config key models.{run.model}.source.tokenizer: required to tokenise dataset {run.dataset!r} "
                "(without a tokenizer a config model trains on synthetic data only)"
            )
        for key in ("text_column", *self.needs):
            if key not in dataset_def:
                raise ConfigError(f"config key datasets.{run.dataset}.{key}: required to train model {run.model!r} "
                                  f"({self.name})")

    def take_vocabulary(self, overrides: dict, vocab_size: int | None, spec: RunSpec) -> dict:
        """The tokenizer's vocabulary as the model's (config_vocab refuses an explicit one that differs)."""
        if vocab_size is None:
            return overrides
        return {**overrides, "vocab_size": config_vocab(spec.model, overrides, vocab_size)}

    # -- preparation

    def prepare(self, dataset_name: str, dataset_def: dict, model_def: dict, seq_len: int, out_dir: Path,
                shard_size_mb: float, model_name: str, image_size: int | None = None) -> dict:
        """Load, tokenise and shard one dataset; write shards and ``manifest.json`` into ``out_dir``."""
        out_dir = Path(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        # A config model's vocab_size that contradicts the tokenizer is that model's error, not the data's (other
        # models share this data): refused at parse time (check_run) or in its own job (take_vocabulary).
        tokenizer = load_tokenizer(model_def)
        if dataset_def["source"]["kind"] == "synthetic":
            vocab_size = len(tokenizer) if tokenizer is not None else config_vocab_size(model_def)
            if vocab_size is None:
                raise ConfigError(f"config key datasets.{dataset_name}: synthetic data needs the model's vocab_size or a tokenizer")
            split_tables, label_names = self.synthetic_tables(dataset_def, seq_len, vocab_size)
            dropped = {}
        else:
            split_tables, label_names, dropped = self.tokenised_tables(dataset_name, dataset_def, tokenizer, seq_len)
        extras = self.preparation_extras(out_dir, tokenizer, dataset_def, split_tables)
        manifest = prepared.manifest_head(
            self.name, dataset_name, dataset_def, model_name, model_def, seq_len, shard_size_mb, {
                "tokenizer": tokenizer_source(model_def),
                "tokenizer_class": type(tokenizer).__name__ if tokenizer is not None else None,
                "pad_token_id": tokenizer.pad_token_id if tokenizer is not None else SYNTHETIC_PAD_ID,
                # Token ids run below this: a config-built model takes it as its vocabulary size.
                "vocab_size": len(tokenizer) if tokenizer is not None else config_vocab_size(model_def),
                "seq_len": seq_len, "label_names": label_names,
                # Source rows left out, by rule and source split: rows with a missing or empty field, rows of
                # other labels than `labels` lists, repeated texts (one copy kept).
                "rows_dropped": dropped, **extras})
        return prepared.write_prepared(manifest, split_tables, out_dir, self.split_figures)

    def split_figures(self, table: pa.Table) -> dict:
        """What the manifest says of a prepared split: its rows and real tokens."""
        return {"rows": table.num_rows, "tokens": real_tokens_in(table)}

    def preparation_extras(self, out_dir: Path, tokenizer, dataset_def: dict, tables: dict) -> dict:
        """The family's own manifest fields (and files beside the shards): none by default."""
        return {}

    def tokenised_tables(self, dataset_name: str, dataset_def: dict, tokenizer, seq_len: int):
        """(split name -> table, label names, rows dropped) of a real dataset."""
        dropped: dict = {}
        train, evaluation = prepared.load_raw_splits(dataset_def, dataset_name, self.roles, dropped, self.name)
        label_ids, label_names = self.label_ids(dataset_name, dataset_def, train, evaluation)
        tables = {}
        for split_name, frame in zip(prepared.SPLITS, (train, evaluation)):
            input_ids = tokenizer(frame["text"].astype(str).tolist(), truncation=True, max_length=seq_len)["input_ids"]
            labels = [label_ids[value] for value in frame["label"]] if label_ids else None
            tables[split_name] = to_table(input_ids, labels, self.target_ids(tokenizer, frame, seq_len))
        return tables, label_names, dropped

    def label_ids(self, dataset_name: str, dataset_def: dict, train, evaluation) -> tuple[dict | None, list | None]:
        """(label value -> class id, label names): none for a family without classes."""
        return None, None

    def target_ids(self, tokenizer, frame, seq_len: int) -> list | None:
        """Decoder targets of a frame's rows: none for a family without them."""
        return None

    def synthetic_tables(self, dataset_def: dict, seq_len: int, vocab_size: int):
        """Random full-length token sequences, for throughput and memory runs where quality is irrelevant.

        Every sequence is exactly ``seq_len`` tokens, so there is no padding and the token count per step is
        fixed (batch x seq_len), which makes runs of different shapes directly comparable.
        """
        source = dataset_def["source"]
        rng = np.random.default_rng(dataset_def.get("split_seed", 0))
        sizes = {"train": dataset_def.get("train_size", sources.SYNTHETIC_SPLIT_ROWS["train"]),
                 "eval": dataset_def.get("eval_size", sources.SYNTHETIC_SPLIT_ROWS["eval"])}
        low = min(100, vocab_size // 2)  # skip the special tokens at the start of most vocabularies
        tables = {}
        for split_name, rows in sizes.items():
            ids = rng.integers(low, vocab_size, size=(rows, seq_len), dtype=np.int64).tolist()
            labels, targets = self.synthetic_extra(rng, rows, source, seq_len, low, vocab_size)
            tables[split_name] = to_table(ids, labels, targets)
        return tables, self.synthetic_label_names(source)

    def synthetic_extra(self, rng, rows: int, source: dict, seq_len: int, low: int, vocab_size: int):
        """(labels, targets) drawn after a synthetic split's ids: none for a plain language model."""
        return None, None

    def synthetic_label_names(self, source: dict) -> list | None:
        return None

    # -- training side

    def load_split(self, shards: list[Path], manifest: dict, data_source: str):
        return prepared.read_split(shards, from_table, data_source)

    def collate(self, split, indices: np.ndarray, pad_token_id: int) -> Batch:
        """Pad a batch to its longest sequence; count real tokens before padding is added. ``split`` is
        anything with ``take(indices) -> TokenisedSplit``: rows in memory, or read from disk."""
        rows = split.take(indices)
        inputs, ids, mask, real, squares, padded = padded_inputs(rows, pad_token_id)
        self.add_labels(inputs, rows, ids, mask)
        return Batch(inputs=inputs, samples=len(rows), real_tokens=real, padded_tokens=padded,
                     sum_squared_lengths=squares)

    def add_labels(self, inputs: dict, rows: TokenisedSplit, ids: np.ndarray, mask: np.ndarray) -> None:
        raise NotImplementedError

    def eval_accumulator(self):
        return TokenAccumulator(shift=False)

    def memory_estimate(self, model, spec: RunSpec, manifest: dict) -> dict:
        """memory_estimate.py's model, with the logits over the vocabulary a language model computes, over the
        tokens a batch holds (packed batches: the run's largest, ``largest_packed_batch`` beside the manifest's
        keys, where the caller read it from the data)."""
        return memory_estimate.estimate(model, spec, memory_estimate.vocab_of(model), manifest.get("largest_packed_batch"))


# ---------------------------------------------------------------------------------------------------
# Scoring


class ClassAccumulator:
    """Sums over eval batches of a classifier: mean loss per sample and accuracy."""

    METRICS = ("eval_loss", "eval_accuracy")  # what result() gives

    def __init__(self):
        self.loss_sum = 0.0
        self.count = 0
        self.correct = 0

    def add(self, output, batch: Batch) -> None:
        self.loss_sum += float(output.loss.mean()) * batch.samples
        self.count += batch.samples
        self.correct += int((output.logits.argmax(dim=-1) == batch.inputs["labels"]).sum())

    def result(self) -> dict:
        if self.count == 0:
            return {}
        return {"eval_loss": self.loss_sum / self.count, "eval_accuracy": self.correct / self.count}


class TokenAccumulator:
    """Sums over eval batches of a token predictor: loss per target token, perplexity, token accuracy.
    ``shift``: position t predicts token t+1 (decoders); else the labels line up with the logits (seq2seq)."""

    METRICS = ("eval_loss", "eval_perplexity", "eval_token_accuracy")  # what result() gives

    def __init__(self, shift: bool):
        self.shift = shift
        self.loss_sum = 0.0
        self.count = 0
        self.correct = 0

    def add(self, output, batch: Batch) -> None:
        import torch  # deferred: the registry is read at parse time, torch-free

        labels = batch.inputs["labels"]
        logits = output.logits
        if self.shift:
            logits, labels = logits[:, :-1], labels[:, 1:]  # position t predicts token t+1
        scored = labels != IGNORE_INDEX
        losses = torch.nn.functional.cross_entropy(
            logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=IGNORE_INDEX, reduction="sum"
        )
        self.loss_sum += float(losses)
        self.count += int(scored.sum())
        self.correct += int(((logits.argmax(dim=-1) == labels) & scored).sum())

    def result(self) -> dict:
        if self.count == 0:
            return {}
        loss = self.loss_sum / self.count
        return {
            "eval_loss": loss,
            "eval_perplexity": float(np.exp(min(loss, 50.0))),
            "eval_token_accuracy": self.correct / self.count,
        }
