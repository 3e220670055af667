"""Matrix expansion and run ids (scripts/ftbench/experiment/matrix.py)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from conftest import ROOT
from ftbench.experiment import config as ftbench_config
from ftbench.experiment import matrix
from ftbench.runspec import RunSpec

RUN_ID = re.compile(r"^[a-z0-9_.]+(-[a-z0-9_.]+)+-[0-9a-f]{8}$")


def base_config(**sections) -> dict:
    """A config on hub sources (nothing is read from disk by expansion)."""
    config = {
        "models": {
            "bert": {"source": {"kind": "hub", "name": "org/bert"}},
            "bert_big": {"source": {"kind": "hub", "name": "org/bert-big"}},
        },
        "datasets": {
            "rt": {"source": {"kind": "hub", "name": "org/rt"}, "text_column": "text", "label_column": "label"},
            "imdb": {"source": {"kind": "hub", "name": "org/imdb"}, "text_column": "text", "label_column": "label"},
        },
        "defaults": {"batch_size": 32, "seq_len": 64, "lora_rank": 8},
        "matrix": {"model": ["bert"], "dataset": ["rt"]},
    }
    config.update(sections)
    ftbench_config.validate_config(config)  # every config used here is a valid one
    return config


def ids(runs: list[dict]) -> list[str]:
    return [run.run_id for run in runs]


def by_key(runs: list[dict], *keys: str) -> dict:
    return {tuple(getattr(run, key) for key in keys): run for run in runs}


# ---------------------------------------------------------------------------------------------------
# Product size, exclude, include, overrides


def test_product_size_is_the_cartesian_product():
    config = base_config(
        matrix={
            "model": ["bert", "bert_big"],
            "dataset": ["rt"],
            "method": ["lora", "qlora"],
            "lora_rank": [4, 8],
            "batch_size": [8, 16, 32],
        }
    )
    runs = matrix.expand_runs(config)
    assert len(runs) == 2 * 2 * 2 * 3
    assert len(set(ids(runs))) == len(runs)
    combos = {(r.model, r.method, r.lora_rank, r.batch_size) for r in runs}
    assert len(combos) == len(runs)


def test_full_runs_are_not_multiplied_by_lora_settings():
    config = base_config(
        matrix={"model": ["bert"], "dataset": ["rt"], "method": ["full", "lora", "qlora"], "lora_rank": [4, 8, 16]}
    )
    runs = matrix.expand_runs(config)
    methods = [run.method for run in runs]
    assert methods.count("full") == 1
    assert methods.count("lora") == 3
    assert methods.count("qlora") == 3
    full = next(run for run in runs if run.method == "full")
    assert all(getattr(full, key) is None for key in ("lora_rank", "lora_alpha", "lora_dropout", "lora_targets"))
    assert "-r" not in full.run_id.split("-full-")[1].rsplit("-", 1)[0]  # no rank in the readable part


def test_lora_alpha_default_is_twice_the_rank_and_equivalent_specs_share_an_id():
    implicit = matrix.expand_runs(base_config(defaults={"lora_rank": 8, "lora_alpha": None}))
    explicit = matrix.expand_runs(base_config(defaults={"lora_rank": 8, "lora_alpha": 16}))
    assert implicit[0].lora_alpha == 16
    assert ids(implicit) == ids(explicit)


def test_exclude_drops_matching_runs_only():
    axes = {"model": ["bert"], "dataset": ["rt"], "method": ["lora", "qlora"], "lora_rank": [4, 8]}
    runs = matrix.expand_runs(base_config(matrix=axes, exclude=[{"method": "qlora", "lora_rank": 8}]))
    assert {(r.method, r.lora_rank) for r in runs} == {("lora", 4), ("lora", 8), ("qlora", 4)}
    # an exclude entry matching nothing changes nothing
    untouched = matrix.expand_runs(base_config(matrix=axes, exclude=[{"method": "full"}]))
    assert len(untouched) == 4


def test_include_adds_runs_on_top_of_defaults_without_duplicates():
    axes = {"model": ["bert"], "dataset": ["rt"], "method": ["lora"]}
    plain = matrix.expand_runs(base_config(matrix=axes))
    extra = {"model": "bert_big", "dataset": "imdb", "method": "lora", "lora_rank": 64, "batch_size": 8}
    runs = matrix.expand_runs(base_config(matrix=axes, include=[extra]))
    assert len(runs) == len(plain) + 1
    added = runs[-1]
    assert (added.model, added.dataset, added.lora_rank, added.batch_size) == ("bert_big", "imdb", 64, 8)
    assert added.seq_len == 64  # the rest comes from defaults
    # an include identical to a matrix run is the same run: one id, one job
    same = {"model": "bert", "dataset": "rt", "method": "lora"}
    assert ids(matrix.expand_runs(base_config(matrix=axes, include=[same]))) == ids(plain)


def test_include_keeps_runs_that_exclude_would_drop():
    axes = {"model": ["bert"], "dataset": ["rt"], "method": ["lora", "qlora"]}
    runs = matrix.expand_runs(
        base_config(matrix=axes, exclude=[{"method": "qlora"}], include=[{"model": "bert", "dataset": "rt", "method": "qlora"}])
    )
    assert sorted(r.method for r in runs) == ["lora", "qlora"]


def test_overrides_apply_in_order_to_matching_runs():
    axes = {"model": ["bert"], "dataset": ["rt"], "method": ["full", "lora"]}
    runs = matrix.expand_runs(
        base_config(
            matrix=axes,
            defaults={"learning_rate": 0.001},
            overrides=[
                {"when": {"method": "full"}, "set": {"learning_rate": 0.0001, "batch_size": 16}},
                {"when": {"method": "full"}, "set": {"learning_rate": 0.00005}},  # later entries win
            ],
        )
    )
    runs = by_key(runs, "method")
    assert runs[("full",)].learning_rate == 0.00005
    assert runs[("full",)].batch_size == 16
    assert runs[("lora",)].learning_rate == 0.001
    assert runs[("lora",)].batch_size == 32


def test_override_that_makes_runs_equal_collapses_them():
    axes = {"model": ["bert"], "dataset": ["rt"], "method": ["lora", "qlora"], "lora_rank": [8, 16]}
    runs = matrix.expand_runs(base_config(matrix=axes, overrides=[{"when": {"method": "qlora"}, "set": {"lora_rank": 8}}]))
    assert sorted((r.method, r.lora_rank) for r in runs) == [("lora", 8), ("lora", 16), ("qlora", 8)]


def test_override_can_trigger_exclude():
    axes = {"model": ["bert"], "dataset": ["rt"], "method": ["lora"], "lora_rank": [8, 16]}
    runs = matrix.expand_runs(
        base_config(
            matrix=axes,
            overrides=[{"when": {"lora_rank": 16}, "set": {"batch_size": 4}}],
            exclude=[{"batch_size": 4}],
        )
    )
    assert [r.lora_rank for r in runs] == [8]


# ---------------------------------------------------------------------------------------------------
# Repeats


def test_repeats_give_distinct_seeds_and_ids():
    config = base_config(matrix={"model": ["bert"], "dataset": ["rt"], "method": ["full", "lora"]}, repeats=3)
    config["defaults"]["seed"] = 5
    runs = matrix.expand_runs(config)
    assert len(runs) == 2 * 3
    assert len(set(ids(runs))) == 6
    for method in ("full", "lora"):
        reps = sorted((r for r in runs if r.method == method), key=lambda r: r.repeat)
        assert [r.repeat for r in reps] == [0, 1, 2]
        assert [r.seed for r in reps] == [5, 6, 7]
        assert [r.run_id.rsplit("-", 2)[1] for r in reps] == ["rep0", "rep1", "rep2"]
        assert len({r.data_id for r in reps}) == 1  # repeats share the prepared data


def test_single_repeat_has_no_rep_suffix():
    runs = matrix.expand_runs(base_config())
    assert "rep" not in runs[0].run_id
    assert runs[0].repeat == 0


# ---------------------------------------------------------------------------------------------------
# Run ids


def test_run_ids_are_readable():
    config = base_config(
        defaults={"batch_size": 32, "seq_len": 64, "lora_rank": 8, "precision": "fp32"},
        matrix={"model": ["bert"], "dataset": ["rt"], "method": ["full", "lora"]},
    )
    runs = by_key(matrix.expand_runs(config), "method")
    assert re.fullmatch(r"bert-rt-lora-r8-fp32-b32-s64-[0-9a-f]{8}", runs[("lora",)].run_id)
    assert re.fullmatch(r"bert-rt-full-fp32-b32-s64-[0-9a-f]{8}", runs[("full",)].run_id)
    for run in runs.values():
        assert RUN_ID.match(run.run_id), run.run_id
        assert "/" not in run.run_id and " " not in run.run_id


def test_qlora_variants_show_in_the_id():
    """Figure labels are the readable part: each QLoRA variant must be told apart there, not only by hash."""
    config = base_config(defaults={"method": "qlora", "lora_rank": 8, "precision": "bf16", "batch_size": 32, "seq_len": 64},
                         matrix={"model": ["bert"], "dataset": ["rt"], "qlora_quant_type": ["nf4", "fp4"],
                                 "qlora_double_quant": [True, False]})
    names = sorted(run.run_id.rsplit("-", 1)[0] for run in matrix.expand_runs(config))
    assert names == ["bert-rt-qlora-r8-bf16-b32-s64", "bert-rt-qlora-r8-fp4-bf16-b32-s64",
                     "bert-rt-qlora-r8-fp4-nodq-bf16-b32-s64", "bert-rt-qlora-r8-nodq-bf16-b32-s64"]


def test_parallel_mode_shows_in_the_id():
    runs = matrix.expand_runs(base_config(defaults={"parallel": "dp", "num_gpus": 2}))
    assert "-dp2-" in runs[0].run_id


def test_run_ids_are_stable_across_calls():
    config = base_config(matrix={"model": ["bert", "bert_big"], "dataset": ["rt", "imdb"], "method": ["full", "lora"]})
    first = ids(matrix.expand_runs(config))
    second = ids(matrix.expand_runs(json.loads(json.dumps(config))))
    assert first == second
    assert len(set(first)) == 2 * 2 * 2


def test_run_ids_do_not_depend_on_key_order():
    config = base_config(defaults={"seq_len": 64, "batch_size": 32, "lora_rank": 8})
    reordered = base_config(defaults={"lora_rank": 8, "batch_size": 32, "seq_len": 64})
    reordered["models"] = dict(reversed(list(reordered["models"].items())))
    assert ids(matrix.expand_runs(config)) == ids(matrix.expand_runs(reordered))


def test_run_ids_are_stable_across_processes():
    """The hash must not depend on Python's per-process string hashing (it names result folders)."""
    config = base_config(matrix={"model": ["bert"], "dataset": ["rt", "imdb"], "method": ["full", "lora"]})
    code = (
        "import json, sys; from ftbench.experiment import matrix; "
        "print(json.dumps([r.run_id for r in matrix.expand_runs(json.loads(sys.argv[1]))]))"
    )
    outputs = []
    for seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        result = subprocess.run(
            [sys.executable, "-c", code, json.dumps(config)],
            capture_output=True, text=True, env=env, check=True,
        )
        outputs.append(json.loads(result.stdout))
    assert outputs[0] == outputs[1] == ids(matrix.expand_runs(config))


def test_editing_one_run_changes_only_its_id():
    axes = {"model": ["bert"], "dataset": ["rt"], "method": ["full", "lora"], "lora_rank": [4, 8]}
    before = {(r.method, r.lora_rank): r for r in matrix.expand_runs(base_config(matrix=axes))}
    after_runs = matrix.expand_runs(
        base_config(matrix=axes, overrides=[{"when": {"method": "lora", "lora_rank": 8}, "set": {"learning_rate": 0.002}}])
    )
    after = {(r.method, r.lora_rank): r for r in after_runs}
    assert after.keys() == before.keys()
    changed = {key for key in before if before[key].run_id != after[key].run_id}
    assert changed == {("lora", 8)}
    # the readable part stays; only the hash differs
    assert before[("lora", 8)].run_id.rsplit("-", 1)[0] == after[("lora", 8)].run_id.rsplit("-", 1)[0]
    assert after[("lora", 8)].data_id == before[("lora", 8)].data_id


def test_editing_an_include_entry_changes_only_that_run():
    axes = {"model": ["bert"], "dataset": ["rt"], "method": ["full", "lora"]}
    include = [{"model": "bert", "dataset": "rt", "method": "lora", "lora_rank": 32}]
    before = ids(matrix.expand_runs(base_config(matrix=axes, include=include)))
    include = [{**include[0], "batch_size": 4}]
    after = ids(matrix.expand_runs(base_config(matrix=axes, include=include)))
    assert before[:2] == after[:2]
    assert before[2] != after[2]


def test_lora_settings_do_not_change_full_run_ids():
    axes = {"model": ["bert"], "dataset": ["rt"], "method": ["full"]}
    first = ids(matrix.expand_runs(base_config(matrix=axes, defaults={"lora_rank": 8, "lora_dropout": 0.1})))
    second = ids(matrix.expand_runs(base_config(matrix=axes, defaults={"lora_rank": 64, "lora_dropout": 0.0})))
    assert first == second


@pytest.mark.parametrize(
    "setting",
    [
        {"learning_rate": 0.01},
        {"batch_size": 16},
        {"precision": "bf16"},
        {"warmup_steps": 7},
        {"max_steps": 50},
        {"optimizer": "sgd"},
        {"gradient_checkpointing": True},
        {"seed": 3},
    ],
    ids=lambda s: next(iter(s)),
)
def test_every_setting_is_part_of_the_id(setting):
    plain = ids(matrix.expand_runs(base_config()))
    edited = ids(matrix.expand_runs(base_config(defaults={"batch_size": 32, "seq_len": 64, "lora_rank": 8, **setting})))
    assert plain != edited


def test_editing_a_model_or_dataset_definition_changes_its_runs_only():
    axes = {"model": ["bert", "bert_big"], "dataset": ["rt"]}
    before = by_key(matrix.expand_runs(base_config(matrix=axes)), "model")
    config = base_config(matrix=axes)
    config["models"]["bert_big"]["source"]["revision"] = "v2"
    after = by_key(matrix.expand_runs(config), "model")
    assert after[("bert",)].run_id == before[("bert",)].run_id
    assert after[("bert_big",)].run_id != before[("bert_big",)].run_id


def test_spec_carries_everything_the_job_needs():
    run = matrix.expand_runs(base_config())[0]
    for key in matrix.RUN_DEFAULTS:
        assert hasattr(run, key)
    assert run.model_def == {"source": {"kind": "hub", "name": "org/bert"}}
    assert run.dataset_def["text_column"] == "text"
    assert RunSpec.from_json(run.to_json()) == run  # the job receives it as JSON


# ---------------------------------------------------------------------------------------------------
# Data ids: one preparation per (dataset, tokenizer, seq_len)


def test_data_id_is_shared_by_runs_with_the_same_dataset_tokenizer_and_seq_len():
    config = base_config(
        matrix={"model": ["bert"], "dataset": ["rt"], "method": ["full", "lora", "qlora"], "lora_rank": [4, 8], "batch_size": [8, 16]}
    )
    runs = matrix.expand_runs(config)
    assert len(runs) > 1
    assert len({run.data_id for run in runs}) == 1
    assert len(matrix.data_preparations(runs)) == 1


def test_data_id_differs_by_seq_len_dataset_and_tokenizer():
    config = base_config(matrix={"model": ["bert", "bert_big"], "dataset": ["rt", "imdb"], "seq_len": [32, 64]})
    runs = matrix.expand_runs(config)
    assert len(runs) == 8
    tasks = matrix.data_preparations(runs)
    assert len(tasks) == 8  # the two models have different tokenizer sources
    for run in runs:
        task = tasks[run.data_id]
        assert (task["dataset"], task["seq_len"]) == (run.dataset, run.seq_len)
        assert run.data_id.startswith(f"{run.dataset}-s{run.seq_len}-")


def test_models_sharing_a_tokenizer_share_prepared_data():
    tokenizer = {"kind": "hub", "name": "org/bert"}
    models = {
        "bert": {"source": tokenizer},
        "bert_wide": {"source": {"kind": "config", "architecture": "BertConfig", "overrides": {"hidden_size": 1024}, "tokenizer": tokenizer}},
    }
    config = base_config(models=models, matrix={"model": ["bert", "bert_wide"], "dataset": ["rt"]})
    runs = matrix.expand_runs(config)
    assert len(runs) == 2 and runs[0].run_id != runs[1].run_id
    assert runs[0].data_id == runs[1].data_id


def test_a_preparation_is_what_shapes_the_data_whichever_model_or_experiment_asks():
    """Two experiments naming different models on one tokenizer (a checkpoint, a config-built model with a bad
    vocab_size) get one data id and one identical preparation: no model name, no architecture in it, so the
    prepare_data rule's params do not change between them and neither fails nor re-prepares the other's data."""
    tokenizer = {"kind": "hub", "name": "org/bert"}
    first = base_config(models={"bert": {"source": tokenizer}}, matrix={"model": ["bert"], "dataset": ["rt"]})
    wide = {"kind": "config", "architecture": "BertConfig", "overrides": {"hidden_size": 1024, "vocab_size": 7}, "tokenizer": tokenizer}
    second = base_config(models={"wide": {"source": wide, "max_seq_len": 512}}, matrix={"model": ["wide"], "dataset": ["rt"]})
    (one,), (other,) = matrix.expand_runs(first), matrix.expand_runs(second)
    assert one.data_id == other.data_id
    preparations = matrix.data_preparations([one]), matrix.data_preparations([other])
    assert preparations[0] == preparations[1]
    job = preparations[0][one.data_id]
    assert "model" not in job
    assert job["model_def"] == {"task": "classification", "source": {"kind": "config", "tokenizer": tokenizer}}


def test_config_models_without_a_tokenizer_share_data_by_vocab_size_alone():
    def model(**overrides):
        return {"source": {"kind": "config", "architecture": "LlamaConfig", "overrides": overrides}, "task": "causal_lm"}

    models = {"small": model(hidden_size=64, vocab_size=1000), "large": model(hidden_size=256, vocab_size=1000),
              "other_vocab": model(hidden_size=64, vocab_size=2000)}
    synthetic = {"synthetic": {"source": {"kind": "synthetic"}}}
    config = base_config(models=models, datasets=synthetic, matrix={"model": list(models), "dataset": ["synthetic"]})
    runs = {run.model: run for run in matrix.expand_runs(config)}
    assert runs["small"].data_id == runs["large"].data_id != runs["other_vocab"].data_id
    job = matrix.data_preparations(list(runs.values()))[runs["small"].data_id]
    assert job["model_def"] == {"task": "causal_lm", "source": {"kind": "config", "overrides": {"vocab_size": 1000}}}


def test_image_models_keep_their_whole_source_in_the_data():
    """An image model's config and processor shape its pixels and image tokens: its source is the data's."""
    source = {"kind": "config", "architecture": "ViTConfig", "overrides": {"patch_size": 4}, "tokenizer": {"kind": "hub", "name": "t"}}
    other = {**source, "overrides": {"patch_size": 8}}
    models = {"a": {"source": source, "task": "image_classification"}, "b": {"source": other, "task": "image_classification"}}
    images = {"img": {"source": {"kind": "hub", "name": "org/img"}, "image_column": "image", "label_column": "label"}}
    runs = matrix.expand_runs(base_config(models=models, datasets=images, matrix={"model": ["a", "b"], "dataset": ["img"]}))
    assert runs[0].data_id != runs[1].data_id
    assert matrix.data_preparations(runs)[runs[0].data_id]["model_def"] == {"task": "image_classification", "source": source}


def test_shard_size_is_part_of_the_data_id():
    small = matrix.expand_runs(base_config(data={"shard_size_mb": 1}))
    large = matrix.expand_runs(base_config(data={"shard_size_mb": 256}))
    assert small[0].data_id != large[0].data_id


# ---------------------------------------------------------------------------------------------------
# The shipped default experiment


def test_default_config_has_the_runs_the_issue_asks_for():
    config = ftbench_config.load_config(ROOT / "config" / "config.yaml")
    runs = matrix.expand_runs(config)
    methods = [run.method for run in runs]
    assert {"full", "lora", "qlora"} <= set(methods)
    assert len({run.lora_rank for run in runs if run.method == "lora"}) >= 2
    assert all(run.precision == "fp32" for run in runs)
    assert len(set(ids(runs))) == len(runs)
    assert len(matrix.data_preparations(runs)) == 1  # one shared preparation
