"""Splits stored in a seeded stratified order, and partial evaluations scoring a seeded stratified sample.

A source sorted by label (or by length) must not leave any prefix of a prepared split biased, for every task family
(prepared.stored_order); and an evaluation that scores part of a split (max_eval_samples, eval_subset, a time limit)
must score a stratified sample of it and report the majority-class rate of the rows it scored (evaluation.score),
even on a split held in label order. The case this guards: a label-sorted eval split, max_eval_samples 128, its
first 128 rows all one class, eval_accuracy 0.0 reported beside a majority rate of 0.578.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from conftest import MINILM_SOURCE, make_rows
from ftbench.data import prepared
from ftbench.runspec import RunSpec
from ftbench.tasks import registry
from ftbench.tasks.base import TokenisedSplit
from ftbench.train import evaluation, trainer
from test_multimodal import VIT_DEF
from test_retrieval import CLIP_DEF
from test_vision_language import LLAVA_DEF

# ---------------------------------------------------------------------------------------------------
# fair_order: every prefix holds each class in its share


def class_counts_within(classes: np.ndarray, bound: float) -> float:
    """The largest gap, over every prefix and class, between a class's rows in the prefix and its share of it."""
    shares = {value: np.mean(classes == value) for value in np.unique(classes)}
    worst = 0.0
    for value, share in shares.items():
        counts = np.cumsum(classes == value)
        worst = max(worst, float(np.max(np.abs(counts - share * np.arange(1, len(classes) + 1)))))
    assert worst <= bound, f"a prefix is off its class shares by {worst} rows (allowed {bound})"
    return worst


def test_a_label_sorted_set_in_fair_order_has_the_class_mix_of_the_whole_in_every_prefix():
    labels = np.repeat([1, 0], [422, 578])  # the default experiment's eval split as it was stored: label 1 first
    order = prepared.fair_order(labels, len(labels), 0)
    assert sorted(order) == list(range(len(labels)))
    class_counts_within(labels[order], bound=2)
    three = np.repeat([0, 1, 2], [10, 300, 690])
    class_counts_within(three[prepared.fair_order(three, len(three), 1)], bound=3)
    with pytest.raises(AssertionError):  # the check can fail: the sorted order is far off
        class_counts_within(labels, bound=2)


def test_fair_order_is_seeded_and_a_shuffle_without_classes():
    labels = np.repeat([0, 1], [60, 40])
    assert np.array_equal(prepared.fair_order(labels, 100, 3), prepared.fair_order(labels, 100, 3))
    assert not np.array_equal(prepared.fair_order(labels, 100, 3), prepared.fair_order(labels, 100, 4))
    shuffled = prepared.fair_order(None, 100, 3)
    assert sorted(shuffled) == list(range(100)) and not np.array_equal(shuffled, np.arange(100))
    assert len(prepared.fair_order(np.zeros(0, dtype=np.int64), 0, 0)) == 0


# ---------------------------------------------------------------------------------------------------
# Every family's prepared splits, from a source sorted by label or by length


def stored_table(folder, manifest: dict, split: str) -> pa.Table:
    return pa.concat_tables([pq.read_table(path) for path in prepared.shard_paths(folder, manifest, split)])


def assert_fair_prefixes(values: np.ndarray, stratified: bool) -> None:
    """Stratified: every prefix holds each class's share to within a row per class. Otherwise (a seeded shuffle):
    the first quarter's and half's mean (of lengths, or each value's share) lie within four standard errors of the
    whole's, counting the finite population."""
    values = np.asarray(values)
    if stratified:
        class_counts_within(values, bound=len(np.unique(values)))
        return
    total = len(values)
    columns = [values.astype(float)] if len(np.unique(values)) > 12 else [(values == v).astype(float) for v in np.unique(values)]
    for column in columns:
        for k in (total // 4, total // 2):
            error = column.std() / np.sqrt(k) * np.sqrt((total - k) / (total - 1))
            assert abs(column[:k].mean() - column.mean()) <= 4 * error + 1e-9, (k, column[:k].mean(), column.mean())


def sorted_text_csv(path, target: bool = False):
    """Texts sorted by length, longest last (targets of the same length order for seq2seq)."""
    rows = pd.DataFrame(make_rows({"neg": 120, "pos": 80}, seed=3))
    rows = rows.assign(n=rows["text"].str.len()).sort_values("n").drop(columns="n")
    if target:
        rows = rows.assign(target=rows["text"].str.upper())
    rows.to_csv(path, index=False)
    return {"source": {"kind": "path", "path": str(path)}, "text_column": "text"}


def sorted_pixel_csv(path, classes: int = 3, per_class: int = 40):
    """A headerless CSV of 4 x 4 grey pixel rows, then the class: every class-0 row first, then class 1, ..."""
    rng = np.random.default_rng(0)
    labels = np.repeat(np.arange(classes), per_class)
    pixels = rng.integers(0, 17, size=(len(labels), 16))
    pd.DataFrame(np.column_stack([pixels, labels])).to_csv(path, header=False, index=False)
    return {"source": {"kind": "path", "path": str(path)}, "pixels": {"height": 4, "width": 4, "max_value": 16}}


def family_source(family: str, folder):
    """(dataset definition, model definition, image size, stored column read, stratified) of a source sorted by
    label (or by length where the family has no classes), named splits (kept in source order before) or a seeded
    split (stored in label order before)."""
    same_split = {"train_split": "train", "eval_split": "train"}
    seeded = {"train_size": 80, "eval_size": 40, "split_seed": 0}
    if family == "classification":
        rows = pd.DataFrame(make_rows({"neg": 180, "pos": 120})).sort_values("label")
        rows.to_csv(folder / "sorted.csv", index=False)
        dataset = {"source": {"kind": "path", "path": str(folder / "sorted.csv")}, "text_column": "text",
                   "label_column": "label", "train_size": 200, "eval_size": 100}
        return dataset, {"source": MINILM_SOURCE}, None, "label", True
    tokenizer_model = {"kind": "config", "tokenizer": MINILM_SOURCE}
    if family == "causal_lm":
        dataset = {**sorted_text_csv(folder / "sorted.csv"), **same_split}
        return dataset, {"task": "causal_lm", "source": {**tokenizer_model, "architecture": "LlamaConfig"}}, None, "length", False
    if family == "seq2seq":
        dataset = {**sorted_text_csv(folder / "sorted.csv", target=True), "target_column": "target", **same_split}
        return dataset, {"task": "seq2seq", "source": {**tokenizer_model, "architecture": "T5Config"}}, None, "length", False
    pixels = sorted_pixel_csv(folder / "pixels.csv")
    if family == "image_classification":
        return {**pixels, **seeded}, VIT_DEF, 16, "label", True
    if family == "image_text_retrieval":
        return {**pixels, **seeded, "caption_template": "a grey square of class {label}"}, CLIP_DEF, 16, "caption_id", True
    dataset = {**pixels, **seeded, "prompt": "Which class?", "answers": ["zero", "one", "two"]}
    return dataset, LLAVA_DEF, 16, "labels", False


@pytest.mark.parametrize("family", registry.NAMES)
def test_every_prefix_of_every_prepared_split_is_a_fair_sample_of_a_sorted_source(family, tmp_path):
    dataset, model, image_size, column, stratified = family_source(family, tmp_path)
    manifest = registry.prepare("sorted", dataset, model, 32, tmp_path / "prepared", 128, "m", image_size)
    assert manifest["manifest_version"] == prepared.MANIFEST_VERSION
    for split in prepared.SPLITS:
        table = stored_table(tmp_path / "prepared", manifest, split)
        values = table[column].to_pylist()
        if column == "labels":  # vision_language: a row's answer is its first scored token
            values = [next(token for token in row if token != -100) for row in values]
        assert_fair_prefixes(np.asarray(values), stratified)
        assert manifest["splits"][split]["row_order"] == {"stratified_by": column if stratified else None, "seed": 0}


def test_the_source_order_check_fails_on_the_sorted_order_itself(tmp_path):
    """The prefix check above can fail: a source kept in its order (lengths ascending) does not pass it."""
    dataset = sorted_text_csv(tmp_path / "sorted.csv")
    lengths = pd.read_csv(dataset["source"]["path"])["text"].str.len().to_numpy()
    with pytest.raises(AssertionError):
        assert_fair_prefixes(lengths, stratified=False)
    with pytest.raises(AssertionError):
        assert_fair_prefixes(np.repeat([0, 1], [60, 40]), stratified=True)


def test_data_of_the_earlier_version_is_refused_with_the_way_to_prepare_it_again(prepared_data, tmp_path):
    import shutil

    from ftbench.errors import ManifestError

    folder = tmp_path / "old"
    shutil.copytree(prepared_data[0], folder)
    manifest = prepared.read_manifest(folder)
    prepared.atomic.write_json(folder / prepared.MANIFEST_NAME, {**manifest, "manifest_version": 1})
    with pytest.raises(ManifestError, match=f"manifest version 1 != {prepared.MANIFEST_VERSION}.*delete .*old"):
        prepared.read_manifest(folder)


# ---------------------------------------------------------------------------------------------------
# Partial evaluations: a seeded stratified sample, and the majority rate of the rows scored


class AlwaysClass(torch.nn.Module):
    """A classifier that answers ``answer`` for every row: its accuracy on any rows is that class's share of them."""

    def __init__(self, answer: int, classes: int = 2):
        super().__init__()
        self.answer, self.classes = answer, classes

    def forward(self, input_ids, attention_mask, labels):
        logits = torch.zeros(len(input_ids), self.classes)
        logits[:, self.answer] = 1.0
        return SimpleNamespace(loss=torch.nn.functional.cross_entropy(logits, labels), logits=logits)


def label_sorted_split(ones: int = 422, zeros: int = 578) -> TokenisedSplit:
    """The default experiment's eval split as it was stored: its 422 label-1 rows first, then 578 label-0 rows,
    of varied lengths (longest-first scoring must not pick a class either)."""
    rng = np.random.default_rng(0)
    labels = np.repeat([1, 0], [ones, zeros])
    return TokenisedSplit([np.arange(int(rng.integers(4, 64))) + 1 for _ in labels], labels)


def spec(**settings) -> RunSpec:
    return RunSpec(model="m", dataset="d", precision="fp32", eval_batch_size=32, **settings)


def test_max_eval_samples_on_a_label_sorted_split_scores_a_stratified_sample_not_its_first_rows():
    split = label_sorted_split()
    figures = trainer.evaluate(AlwaysClass(0), split, spec(max_eval_samples=128), "classification", torch.device("cpu"), 0)
    assert figures["eval_samples"] == 128
    # The first 128 rows by position are all label 1: always answering 0 would score 0.0 there.
    assert figures["eval_accuracy"] == pytest.approx(0.578, abs=2 / 128)
    # The majority rate is that of the 128 rows scored, and here it is the accuracy of answering their majority.
    assert figures["eval_majority_class_rate"] == pytest.approx(figures["eval_accuracy"])
    other = trainer.evaluate(AlwaysClass(1), split, spec(max_eval_samples=128), "classification", torch.device("cpu"), 0)
    assert other["eval_accuracy"] == pytest.approx(1 - figures["eval_accuracy"])  # the same rows, the other class
    whole = trainer.evaluate(AlwaysClass(0), split, spec(), "classification", torch.device("cpu"), 0)
    assert whole["eval_samples"] == 1000 and whole["eval_accuracy"] == whole["eval_majority_class_rate"] == 0.578


def test_an_evaluation_a_time_limit_ends_keeps_whole_rounds_of_a_stratified_sample():
    split = label_sorted_split()
    # The probe (a quarter batch) fits, the rest at once does not, one round of ROUND_BATCHES batches does, no more.
    answers = iter([True, False, True, False, False])
    figures = trainer.evaluate(AlwaysClass(0), split, spec(), "classification", torch.device("cpu"), 0,
                               another_batch_fits=lambda rows: next(answers))
    rows = 8 + evaluation.ROUND_BATCHES * 32
    assert (figures["eval_samples"], figures["eval_samples_planned"]) == (rows, 1000)
    assert figures["eval_accuracy"] == pytest.approx(0.578, abs=2 / rows)
    assert figures["eval_majority_class_rate"] == pytest.approx(figures["eval_accuracy"])
    nothing = trainer.evaluate(AlwaysClass(0), split, spec(), "classification", torch.device("cpu"), 0,
                               another_batch_fits=lambda rows: False)
    assert nothing["eval_samples"] == 0 and nothing["eval_majority_class_rate"] is None


def test_the_eval_subset_is_a_stratified_sample_and_the_first_rows_max_eval_samples_takes():
    split = label_sorted_split()
    strata = registry.family("classification").row_strata(split)
    subset = evaluation.subset_indices(len(split), 256, strata)
    assert len(subset) == 256 and abs(split.labels[subset].mean() - 0.422) <= 2 / 256
    planned = evaluation.eval_order(split, "classification")[:512]
    assert set(subset) <= set(planned)  # nested: the subset is part of what a larger max_eval_samples scores


def test_the_row_reports_the_majority_rate_of_the_rows_it_scored_not_the_split_s(prepared_data):
    """evaluate_run overrides the data's figure (the whole split's, from the manifest) with the scored rows'."""
    folder, manifest = prepared_data
    split = registry.load_split(folder, "eval", manifest)
    run = SimpleNamespace(model=AlwaysClass(0), eval_split=split, task="classification", device=torch.device("cpu"),
                          pad_id=0, stop=SimpleNamespace(limit=None, margin=0.0),
                          spec=spec(max_eval_samples=20).replace(dataset_def={"source": {"kind": "path"}}))
    metrics = {"eval_majority_class_rate": 0.99}  # stands in for any rate set before the final evaluation
    evaluation.evaluate_run(run, trainer.evaluate, metrics, steps_done=None)
    scored = evaluation.eval_order(split, "classification")[:20]
    shares = np.bincount(split.labels[scored], minlength=2) / 20
    assert metrics["eval_samples"] == 20 and metrics["eval_majority_class_rate"] == pytest.approx(shares.max())
    assert metrics["eval_accuracy"] == pytest.approx(shares[0])
