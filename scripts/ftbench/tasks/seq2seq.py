"""Sequence to sequence (task ``seq2seq``): an encoder-decoder (T5-like); loss = cross-entropy over the
target tokens. Data: a text column and a target column; a batch's real tokens count the targets too (the
decoder processes them)."""

from __future__ import annotations

import numpy as np

from ftbench.tasks.base import IGNORE_INDEX, Batch, pad
from ftbench.tasks.text import TextFamily, padded_inputs


class Seq2Seq(TextFamily):
    name = "seq2seq"
    auto_model = "AutoModelForSeq2SeqLM"
    peft_task_type = "SEQ_2_SEQ_LM"
    needs = ("target_column",)
    column_keys = ("text_column", "target_column")
    roles = {"text": "text_column", "target": "target_column"}
    separate_targets = True
    not_packable = ("encoder-decoder rows pair each input with its target through cross-attention, which packing "
                    "would mix; use group_by_length")

    def target_ids(self, tokenizer, frame, seq_len: int) -> list:
        return tokenizer(text_target=frame["target"].astype(str).tolist(), truncation=True, max_length=seq_len)["input_ids"]

    def synthetic_extra(self, rng, rows: int, source: dict, seq_len: int, low: int, vocab_size: int):
        target_len = source.get("target_len", max(1, seq_len // 4))
        return None, rng.integers(low, vocab_size, size=(rows, target_len), dtype=np.int64).tolist()

    def collate(self, split, indices: np.ndarray, pad_token_id: int) -> Batch:
        """Inputs and targets each padded to their longest; real tokens are both, unpadded."""
        import torch  # deferred: the registry is read at parse time, torch-free

        rows = split.take(indices)
        inputs, _, _, real, squares, padded = padded_inputs(rows, pad_token_id)
        targets, target_mask = pad(rows.target_ids, pad_token_id)
        inputs["labels"] = torch.from_numpy(np.where(target_mask == 1, targets, IGNORE_INDEX))
        target_lengths = target_mask.sum(axis=1)
        target_tokens = int(target_lengths.sum())
        return Batch(inputs, len(rows), real + target_tokens, padded + int(target_mask.size), squares,
                     target_tokens, int((target_lengths * target_lengths).sum()))


FAMILY = Seq2Seq()
