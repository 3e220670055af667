"""How each model task type (``task_types.py``) stores, batches and scores its examples.

Token counting convention (used for every throughput figure): the real, unpadded tokens the model
processes in a step, i.e. input tokens, plus target tokens for seq2seq (the decoder processes them too).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch

from ftbench.tasks.task_types import IMAGE_TASKS

IGNORE_INDEX = -100  # positions the loss skips (padding)


@dataclass
class TokenisedSplit:
    """A split in memory: unpadded token id arrays, plus class labels or target ids."""

    input_ids: list[np.ndarray]
    labels: np.ndarray | None = None  # class ids (classification)
    target_ids: list[np.ndarray] | None = None  # decoder targets (seq2seq)

    def __len__(self) -> int:
        return len(self.input_ids)

    def lengths(self) -> np.ndarray:
        """Input length of every row (length-grouped batching sorts by it)."""
        return np.array([len(ids) for ids in self.input_ids], dtype=np.int64)

    def take(self, indices: np.ndarray) -> "TokenisedSplit":
        """The rows at ``indices``, in that order."""
        return TokenisedSplit(
            input_ids=[self.input_ids[i] for i in indices],
            labels=self.labels[indices] if self.labels is not None else None,
            target_ids=[self.target_ids[i] for i in indices] if self.target_ids is not None else None,
        )


@dataclass
class Batch:
    inputs: dict[str, torch.Tensor]  # keyword arguments of the model's forward
    samples: int
    real_tokens: int  # tokens without padding (see the module docstring)
    padded_tokens: int  # positions processed including padding
    sum_squared_lengths: int  # sum over input sequences of real length squared (attention FLOPs)
    target_tokens: int = 0  # seq2seq: the part of real_tokens that is decoder targets
    target_sum_squared_lengths: int = 0
    images: int = 0  # image tasks (images.py): images in the batch
    image_tokens: int = 0  # the part of real_tokens that is image (patch) tokens
    capacity_tokens: int = 0  # packed batches (packing.py): rows x row capacity; 0 when not packed
    # vision-language (vision_language.py): tokens the vision tower processes (its class token included) and
    # their sum of squared lengths per image, for the FLOPs; not part of real_tokens (the decoder's)
    vision_tokens: int = 0
    vision_sum_squared_lengths: int = 0

    def to(self, device: torch.device) -> "Batch":
        moved = {key: value.to(device, non_blocking=True) for key, value in self.inputs.items()}
        return dataclasses.replace(self, inputs=moved)


# ---------------------------------------------------------------------------------------------------
# Tokenising into Arrow tables (what prepare_data stores)


def _id_lists(values: list[list[int]]) -> pa.Array:
    return pa.array(values, type=pa.list_(pa.int32()))


def to_table(task: str, input_ids: list[list[int]], labels: list[int] | None = None,
             target_ids: list[list[int]] | None = None) -> pa.Table:
    columns: dict[str, Any] = {
        "input_ids": _id_lists(input_ids),
        "length": pa.array([len(ids) for ids in input_ids], type=pa.int32()),
    }
    if task == "classification":
        columns["label"] = pa.array(labels, type=pa.int64())
    if task == "seq2seq":
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


# ---------------------------------------------------------------------------------------------------
# Batching


def _pad(sequences: list[np.ndarray], value: int) -> tuple[np.ndarray, np.ndarray]:
    """(padded ids, attention mask) padded on the right to the longest sequence."""
    longest = max(len(seq) for seq in sequences)
    ids = np.full((len(sequences), longest), value, dtype=np.int64)
    mask = np.zeros((len(sequences), longest), dtype=np.int64)
    for row, seq in enumerate(sequences):
        ids[row, : len(seq)] = seq
        mask[row, : len(seq)] = 1
    return ids, mask


def collate(task: str, split, indices: np.ndarray, pad_token_id: int) -> Batch:
    """Pad a batch to its longest sequence; count real tokens before padding is added.

    ``split`` is anything with ``take(indices) -> TokenisedSplit``: rows in memory, or read from disk.
    Image tasks are batched by images.py, image-caption pairs by retrieval.py, vision-language rows by
    vision_language.py."""
    if task == "vision_language":
        from ftbench.tasks import vision_language

        return vision_language.collate(split, indices, pad_token_id)
    if task == "image_text_retrieval":
        from ftbench.tasks import retrieval  # imports this module (its batches are Batches)

        return retrieval.collate(split, indices)
    if task in IMAGE_TASKS:
        from ftbench.data import images  # imports this module (its batches are Batches)

        return images.collate(split, indices)
    rows = split.take(indices)
    sequences = rows.input_ids
    ids, mask = _pad(sequences, pad_token_id)
    lengths = mask.sum(axis=1)
    real = int(lengths.sum())
    squares = int((lengths * lengths).sum())
    padded = int(mask.size)
    inputs = {"input_ids": torch.from_numpy(ids), "attention_mask": torch.from_numpy(mask)}
    if task == "classification":
        inputs["labels"] = torch.from_numpy(np.asarray(rows.labels))
    elif task == "causal_lm":
        # The model shifts labels by one inside; padded positions are ignored by the loss.
        inputs["labels"] = torch.from_numpy(np.where(mask == 1, ids, IGNORE_INDEX))
    elif task == "seq2seq":
        targets, target_mask = _pad(rows.target_ids, pad_token_id)
        inputs["labels"] = torch.from_numpy(np.where(target_mask == 1, targets, IGNORE_INDEX))
        target_lengths = target_mask.sum(axis=1)
        target_tokens = int(target_lengths.sum())
        return Batch(inputs, len(sequences), real + target_tokens, padded + int(target_mask.size), squares,
                     target_tokens, int((target_lengths * target_lengths).sum()))
    return Batch(inputs=inputs, samples=len(sequences), real_tokens=real, padded_tokens=padded, sum_squared_lengths=squares)


# ---------------------------------------------------------------------------------------------------
# Scoring


def eval_accumulator(task: str):
    """What scores a task's eval batches (``add(output, batch)``, then ``result()``): retrieval keeps every
    embedding for its recall over the whole split; the other tasks sum per batch."""
    if task == "image_text_retrieval":
        from ftbench.tasks import retrieval

        return retrieval.RecallAccumulator()
    return EvalAccumulator(task)


class EvalAccumulator:
    """Sums over eval batches; ``result`` gives the task's quality figures."""

    def __init__(self, task: str):
        self.task = task
        self.loss_sum = 0.0  # classification: per sample; LM tasks: per target token
        self.count = 0
        self.correct = 0

    def add(self, output, batch: Batch) -> None:
        labels = batch.inputs["labels"]
        logits = output.logits
        if self.task in ("classification", "image_classification"):
            self.loss_sum += float(output.loss.mean()) * batch.samples
            self.count += batch.samples
            self.correct += int((logits.argmax(dim=-1) == labels).sum())
            return
        if self.task in ("causal_lm", "vision_language"):
            logits, labels = logits[:, :-1], labels[:, 1:]  # position t predicts token t+1
        scored = labels != IGNORE_INDEX
        tokens = int(scored.sum())
        losses = torch.nn.functional.cross_entropy(
            logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=IGNORE_INDEX, reduction="sum"
        )
        self.loss_sum += float(losses)
        self.count += tokens
        self.correct += int(((logits.argmax(dim=-1) == labels) & scored).sum())

    def result(self) -> dict:
        if self.count == 0:
            return {}
        loss = self.loss_sum / self.count
        if self.task in ("classification", "image_classification"):
            return {"eval_loss": loss, "eval_accuracy": self.correct / self.count}
        return {
            "eval_loss": loss,
            "eval_perplexity": float(np.exp(min(loss, 50.0))),
            "eval_token_accuracy": self.correct / self.count,
        }
