"""Text classification (task ``classification``): an encoder (BERT-like) with a new classification head;
loss = cross-entropy over classes; quality = accuracy. Data: a text column and a label column."""

from __future__ import annotations

import numpy as np

from ftbench.errors import ConfigError
from ftbench.runspec import RunSpec
from ftbench.tasks.base import TokenisedSplit
from ftbench.tasks.text import ClassAccumulator, TextFamily
from ftbench.measure import memory_estimate


class TextClassification(TextFamily):
    name = "classification"
    auto_model = "AutoModelForSequenceClassification"
    peft_task_type = "SEQ_CLS"
    # An encoder's pooler and classifier see its first token only (BERT's pooler and classifier, RoBERTa's
    # classifier head, DistilBERT's pre_classifier); a decoder's `score` projects every token and is not one.
    pooled_heads = ("pooler", "classifier", "pre_classifier")
    needs = ("label_column",)
    column_keys = ("text_column", "label_column")
    takes_num_labels = True
    roles = {"text": "text_column", "label": "label_column"}
    not_packable = ("classification pools one token per sequence and transformers' encoder masks do not read "
                    "packed position ids, so packed rows would mix sequences; use group_by_length")

    def label_ids(self, dataset_name: str, dataset_def: dict, train, evaluation):
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
        return label_ids, [str(name) for name in label_names]

    def synthetic_extra(self, rng, rows: int, source: dict, seq_len: int, low: int, vocab_size: int):
        return rng.integers(0, source.get("num_labels", 2), size=rows).tolist(), None

    def synthetic_label_names(self, source: dict) -> list:
        return [str(index) for index in range(source.get("num_labels", 2))]

    def add_labels(self, inputs: dict, rows: TokenisedSplit, ids: np.ndarray, mask: np.ndarray) -> None:
        import torch  # deferred: the registry is read at parse time, torch-free

        inputs["labels"] = torch.from_numpy(np.asarray(rows.labels))

    def row_classes(self, split) -> np.ndarray:
        return np.asarray(split.labels)

    def eval_accumulator(self):
        return ClassAccumulator()

    def memory_estimate(self, model, spec: RunSpec, manifest: dict) -> dict:
        """memory_estimate.py's model; a classifier's head has no logits over a vocabulary."""
        return memory_estimate.estimate(model, spec, None)


FAMILY = TextClassification()
