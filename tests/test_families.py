"""Issue 3 on the CPU: every training configuration that can run without a GPU, on tiny models.

- DDP over 2 CPU processes (gloo, started by torchrun through `python -m ftbench train`), ranks merged;
- each optimizer, gradient checkpointing, torch.compile, gradient accumulation, attention kernels;
- the three model families (BERT classification, Llama causal LM, T5 seq2seq), their eval metrics
  recomputed independently from the trained model;
- QLoRA quantisation knobs, LoRA "all-linear";
- what the machine cannot run becomes a status=unsupported row (never a crash, also through snakemake);
- the shipped example experiments.

Merging DDP ranks is unit-tested in tests/test_metrics.py, the GPU slots in tests/test_gpu_slots.py.

Models built from a config (Llama hidden 64, 2 layers; T5 d_model 64) train on synthetic token data
prepared once per module: a run is well under a second.
"""

from __future__ import annotations

import json
import math
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
import yaml

from conftest import LM_DEFAULTS, MINILM_SOURCE, ROOT, snakemake_failure, tiny_config, tiny_dataset_def, write_config
from ftbench.tasks import registry
from ftbench.tasks.base import Batch, IGNORE_INDEX
from ftbench.data import tokenizers
from ftbench import cli
from ftbench.data import batch_order, prepared
from ftbench.train import ddp, modeling, trainer
from ftbench.experiment import matrix
from ftbench.runspec import RunSpec
from ftbench.experiment import config as ftconfig
from ftbench import errors
from ftbench.errors import ConfigError
from ftbench.measure.metrics import STEP_FIELDS

CUDA = torch.cuda.is_available()
GPUS = torch.cuda.device_count() if CUDA else 0

LLAMA_OVERRIDES = {
    "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "vocab_size": 1000, "max_position_embeddings": 128,
}
# decoder_start_token_id as a T5 checkpoint's config.json gives it; without it, see
# test_seq2seq_config_model_without_decoder_start_token.
T5_OVERRIDES = {
    "d_model": 64, "d_ff": 128, "d_kv": 16, "num_layers": 2, "num_decoder_layers": 2, "num_heads": 4,
    "vocab_size": 1000, "decoder_start_token_id": 0,
}
TARGET_LEN = 8
SEQ, LM_BATCH, LM_STEPS, LM_WARMUP = (LM_DEFAULTS[key] for key in ("seq_len", "batch_size", "max_steps", "warmup_steps"))
SYNTHETIC_TRAIN = 64
SYNTHETIC_EVAL = 16

BERT_DEFAULTS = {
    "method": "lora", "precision": "fp32", "batch_size": 8, "seq_len": SEQ, "lora_rank": 4,
    "lora_targets": ["query", "value"], "learning_rate": 0.001, "max_steps": 6, "warmup_steps": 2,
    "eval_batch_size": 64, "device": "cpu", "num_gpus": 0,
}


# ---------------------------------------------------------------------------------------------------
# Configs, specs, prepared data


def llama_def(**source_extra) -> dict:
    return {"task": "causal_lm",
            "source": {"kind": "config", "architecture": "LlamaConfig", "overrides": dict(LLAMA_OVERRIDES), **source_extra}}


def t5_def(overrides: dict | None = None) -> dict:
    return {"task": "seq2seq",
            "source": {"kind": "config", "architecture": "T5Config", "overrides": dict(overrides or T5_OVERRIDES)}}


def synthetic_def() -> dict:
    return {"source": {"kind": "synthetic", "target_len": TARGET_LEN}, "train_size": SYNTHETIC_TRAIN,
            "eval_size": SYNTHETIC_EVAL}


def lm_config(model_def: dict, name: str = "llama", **settings) -> dict:
    return {
        "models": {name: model_def},
        "datasets": {"tokens": synthetic_def()},
        "defaults": {**LM_DEFAULTS, **settings},
        "matrix": {"model": [name], "dataset": ["tokens"]},
    }


def only_spec(config: dict) -> RunSpec:
    """The config's single run, after the same validation snakemake does."""
    ftconfig.validate_config(config)
    runs = matrix.expand_runs(config)
    assert len(runs) == 1
    return runs[0]


def llama_spec(**settings) -> RunSpec:
    return only_spec(lm_config(llama_def(), **settings))


def t5_spec(**settings) -> RunSpec:
    return only_spec(lm_config(t5_def(), name="t5", **settings))


def prepare_for(spec: dict, folder: Path) -> Path:
    registry.prepare(spec.dataset, spec.dataset_def, spec.model_def, spec.seq_len, folder)
    return folder


@pytest.fixture(scope="module")
def llama_data(tmp_path_factory) -> Path:
    return prepare_for(llama_spec(), tmp_path_factory.mktemp("llama-tokens"))


@pytest.fixture(scope="module")
def t5_data(tmp_path_factory) -> Path:
    return prepare_for(t5_spec(), tmp_path_factory.mktemp("t5-tokens"))


@pytest.fixture(scope="module")
def bert_spec(tiny_config_factory):
    """``bert_spec(**settings)``: the single run of the tiny BERT config with these settings."""

    def make(**settings) -> dict:
        config = tiny_config_factory(defaults={**BERT_DEFAULTS, **settings}, matrix={"model": ["tiny"], "dataset": ["tiny"]})
        return only_spec(config)

    return make


@pytest.fixture(autouse=True)
def _two_threads():
    torch.set_num_threads(2)


@pytest.fixture
def captured(monkeypatch):
    """What the trainer built: ``model`` (as modeling.build_model returned it), ``quant_states`` (each 4-bit
    layer's (quant_type, nested) as built), ``optimizer`` and ``before`` (trainable weights when the
    optimizer was made)."""
    seen: dict = {}
    build, make_optimizer = modeling.build_model, trainer.make_optimizer

    def spy_build(*args, **kwargs):
        built = build(*args, **kwargs)
        seen["model"] = built.model
        # As built: on the CPU, bitsandbytes' first 4-bit forward pass unpacks double-quantised constants.
        seen["quant_states"] = {name: (m.weight.quant_state.quant_type, m.weight.quant_state.nested)
                                for name, m in linear4bit_layers(built.model).items()}
        return built

    def spy_optimizer(spec, model, device):
        optimizer = make_optimizer(spec, model, device)
        seen["optimizer"] = optimizer
        seen["before"] = {name: p.detach().clone() for name, p in model.named_parameters() if p.requires_grad}
        return optimizer

    monkeypatch.setattr(modeling, "build_model", spy_build)
    monkeypatch.setattr(trainer, "make_optimizer", spy_optimizer)
    return seen


def linear4bit_layers(model) -> dict:
    if not modeling.package_available("bitsandbytes"):
        return {}
    import bitsandbytes as bnb

    return {name: module for name, module in model.named_modules() if isinstance(module, bnb.nn.Linear4bit)}


@pytest.fixture
def keep_sigterm():
    """cli.train installs a SIGTERM handler (the scheduler's stop request): restore pytest's afterwards."""
    previous = signal.getsignal(signal.SIGTERM)
    yield
    signal.signal(signal.SIGTERM, previous)


def assert_ok(metrics: dict, steps: list, total: int, warmup: int) -> None:
    assert metrics["status"] == "ok", metrics.get("status_reason")
    assert metrics["measured_steps"] == total - warmup
    assert len(steps) == total
    assert all(math.isfinite(record["loss"]) for record in steps)


def assert_unsupported(metrics: dict, steps: list, *reason_words: str) -> None:
    assert metrics["status"] == "unsupported", metrics
    reason = metrics["status_reason"]
    assert isinstance(reason, str) and reason and "\n" not in reason
    for word in reason_words:
        assert word.lower() in reason.lower(), reason
    assert len(steps) == 0
    assert metrics.get("tokens_per_s") is None


def train_cli(spec: dict, data_dir: Path, out: Path) -> tuple[dict, pd.DataFrame]:
    """The train rule's entry point, in this process: (metrics.json content, steps.parquet)."""
    cli.train(["--spec", spec.to_json(), "--data", str(data_dir), "--out", str(out)])
    return json.loads(out.read_text()), pd.read_parquet(out.with_name("steps.parquet"))


# ---------------------------------------------------------------------------------------------------
# DDP: two CPU processes with gloo, started by torchrun from the train rule's script


@pytest.fixture(scope="module")
def ddp_run(bert_spec, prepared_data, tmp_path_factory):
    """One real DDP run of the tiny BERT over 2 CPU processes: (spec, metrics, steps frame, rank results)."""
    spec = bert_spec(method="full", learning_rate=0.0001, parallel="ddp", num_gpus=2, device="cpu")
    out = tmp_path_factory.mktemp("ddp") / "run" / "metrics.json"
    out.parent.mkdir()
    process = subprocess.run(
        [sys.executable, "-m", "ftbench", "train", "--spec", spec.to_json(), "--data", str(prepared_data[0]),
         "--out", str(out), "--threads", "2"],
        capture_output=True, text=True, timeout=300,
    )
    assert process.returncode == 0, f"--- stdout\n{process.stdout[-4000:]}\n--- stderr\n{process.stderr[-4000:]}"
    result = json.loads(out.read_text())
    ranks = ddp.read_rank_results(out.parent / "ranks")
    return spec, result["metrics"], pd.read_parquet(out.with_name("steps.parquet")), ranks


@pytest.mark.slow
def test_ddp_runs_two_gloo_ranks_and_merges_them(ddp_run):
    spec, metrics, steps, ranks = ddp_run
    assert metrics["status"] == "ok", metrics.get("status_reason")
    assert metrics["world_size"] == 2
    assert metrics["device"] == "cpu"
    assert [r["rank"] for r in ranks] == [0, 1]
    for rank in ranks:
        assert rank["metrics"]["status"] == "ok"
        assert rank["metrics"]["world_size"] == 2  # each rank knew it was one of two
    assert len(metrics["per_rank"]) == 2
    assert [entry["status"] for entry in metrics["per_rank"]] == ["ok", "ok"]
    assert [entry["tokens_per_s"] for entry in metrics["per_rank"]] == pytest.approx(
        [r["metrics"]["tokens_per_s"] for r in ranks])
    # Evaluation happens once, on rank 0; the merged row carries it.
    assert 0 <= metrics["eval_accuracy"] <= 1
    assert ranks[1]["metrics"].get("eval_accuracy") is None


@pytest.mark.slow
def test_ddp_global_throughput_is_the_sum_over_ranks_per_window(ddp_run):
    spec, metrics, _, ranks = ddp_run
    rank_tokens = [r["metrics"]["measured_tokens"] for r in ranks]
    assert metrics["measured_tokens"] == sum(rank_tokens)
    window = max(r["metrics"]["window_s"] for r in ranks)
    assert metrics["measured_time_s"] == pytest.approx(window)
    assert metrics["tokens_per_s"] == pytest.approx(sum(rank_tokens) / window)
    assert metrics["tokens_per_s_per_device"] == pytest.approx(metrics["tokens_per_s"] / 2)
    measured_samples = spec.batch_size * 2 * metrics["measured_steps"]
    assert metrics["samples_per_s"] == pytest.approx(measured_samples / window)


@pytest.mark.slow
def test_ddp_ranks_take_distinct_slices_of_each_global_batch(ddp_run, prepared_data):
    spec, metrics, steps, ranks = ddp_run
    folder, manifest = prepared_data
    lengths = np.array([len(ids) for ids in registry.load_split(folder, "train", manifest).input_ids])
    batch = spec.batch_size
    order = list(batch_order.batch_order(len(lengths), batch * 2, metrics["total_steps"], spec.seed))
    for rank in ranks:
        r = rank["rank"]
        assert [s["tokens"] for s in rank["steps"]] == [int(lengths[idx[r * batch:(r + 1) * batch]].sum()) for idx in order]
    # The merged step records add both ranks up: the global batch of every step.
    assert steps["samples"].tolist() == [2 * batch] * metrics["total_steps"]
    assert steps["tokens"].tolist() == [int(lengths[idx].sum()) for idx in order]
    assert any(a["tokens"] != b["tokens"] for a, b in zip(ranks[0]["steps"], ranks[1]["steps"]))


# ---------------------------------------------------------------------------------------------------
# Optimizers


@pytest.mark.parametrize("method", ["full", "lora"])
def test_a_checkpoint_stored_in_bf16_trains_fp32_masters_like_one_stored_in_fp32(method, tiny_model_dir, tiny_csv, tmp_path):
    """transformers 5 loads a checkpoint in its stored dtype unless told otherwise: a bf16-stored checkpoint
    (most hub LLMs) would then train bf16 weights under a run that says fp32, and every number of the row
    would describe another run than the same model stored in fp32."""
    from transformers import AutoModelForSequenceClassification

    stored = tmp_path / "tiny-bf16"
    AutoModelForSequenceClassification.from_pretrained(tiny_model_dir, dtype=torch.bfloat16).save_pretrained(stored)
    shutil.copy(tiny_model_dir / "tokenizer.json", stored)
    shutil.copy(tiny_model_dir / "tokenizer_config.json", stored)
    spec = only_spec(tiny_config(stored, tiny_csv, defaults={**BERT_DEFAULTS, "method": method},
                                 matrix={"model": ["tiny"], "dataset": ["tiny"]}))
    model = modeling.build_model(spec, num_labels=2, device=torch.device("cpu")).model
    floating = {name: p.dtype for name, p in model.named_parameters() if p.is_floating_point()}
    assert set(floating.values()) == {torch.float32}, floating
    reference = AutoModelForSequenceClassification.from_pretrained(stored, dtype=torch.float32)
    embedding = dict(model.named_parameters())
    key = next(name for name in embedding if name.endswith("word_embeddings.weight"))
    assert torch.equal(embedding[key], reference.get_input_embeddings().weight)


def test_a_classifier_runs_flop_cross_check_agrees_once_its_heads_count_per_sequence(bert_spec, prepared_data):
    """The run's own cross-check (counted in its first step) on the tiny BERT: 0.9475 while the pooler and
    classifier counted per token; the analytic count of the counted batch now takes its sequences."""
    metrics, steps = trainer.train_run(bert_spec(method="full"), prepared_data[0])
    assert_ok(metrics, steps, 6, 2)
    assert metrics["flops_counted_ratio"] == pytest.approx(1.0, abs=0.002)
    assert steps[0]["flops"] > 0


@pytest.mark.slow
@pytest.mark.parametrize("name, class_name", [("adamw", "AdamW"), ("sgd", "SGD"), ("adamw_8bit", "AdamW8bit")])
def test_each_optimizer_trains(name, class_name, bert_spec, prepared_data, captured):
    metrics, steps = trainer.train_run(bert_spec(method="full", optimizer=name, learning_rate=0.0001), prepared_data[0])
    assert_ok(metrics, steps, 6, 2)
    optimizer = captured["optimizer"]
    assert type(optimizer).__name__ == class_name
    changed = [name for name, p in captured["model"].named_parameters() if p.requires_grad
               and not torch.equal(p.detach(), captured["before"][name])]
    assert len(changed) == len(captured["before"]) > 0, "every trainable weight should have been updated"
    if name == "adamw_8bit":
        # bitsandbytes keeps 8-bit moments for large tensors (the word embeddings here): uint8 state.
        embeddings = captured["model"].bert.embeddings.word_embeddings.weight
        assert optimizer.state[embeddings]["state1"].dtype == torch.uint8
    if name == "sgd":
        assert optimizer.param_groups[0]["momentum"] == 0.9


def test_paged_adamw_8bit_is_unsupported_on_cpu(bert_spec, prepared_data):
    metrics, steps = trainer.train_run(bert_spec(optimizer="paged_adamw_8bit"), prepared_data[0])
    assert_unsupported(metrics, steps, "paged", "CUDA")


# ---------------------------------------------------------------------------------------------------
# Gradient checkpointing, attention kernels, compile, gradient accumulation


@pytest.mark.slow
def test_gradient_checkpointing_on_and_off_both_train(bert_spec, prepared_data, captured):
    results = {}
    for checkpointing in (False, True):
        metrics, steps = trainer.train_run(bert_spec(gradient_checkpointing=checkpointing), prepared_data[0])
        assert_ok(metrics, steps, 6, 2)
        base = captured["model"].get_base_model()
        assert base.is_gradient_checkpointing is checkpointing
        results[checkpointing] = (metrics, steps)
    # The same seeded run: checkpointing changes memory and time, not the numbers.
    assert [s["loss"] for s in results[True][1]] == pytest.approx([s["loss"] for s in results[False][1]], rel=1e-4)
    # The FLOP cross-check counts model FLOPs: checkpointing is off for its one-sample count (the batch might
    # fit only with it on), so the recomputed forward is not counted: 0.95 here, against about 1.4 with it.
    # (Not the plain run's 0.87: checkpointing makes the embeddings' output require a gradient, so the first
    # layer's input gradient, which the analytic 4N + 2N_trainable assumes, is computed too.)
    plain, checkpointed = results[False][0], results[True][0]
    assert checkpointed["flops_analytic_microbatch"] < plain["flops_analytic_microbatch"]  # one sample, not 8
    assert 0.85 < checkpointed["flops_counted_ratio"] < 1.05


@pytest.mark.slow
@pytest.mark.parametrize("implementation", ["eager", "sdpa"])
def test_attention_implementation_is_applied(implementation, llama_data, captured):
    metrics, steps = trainer.train_run(llama_spec(attn_implementation=implementation), llama_data)
    assert_ok(metrics, steps, LM_STEPS, LM_WARMUP)
    assert captured["model"].config._attn_implementation == implementation


@pytest.mark.slow
@pytest.mark.skipif(not (shutil.which("c++") or shutil.which("g++")),
                    reason="torch.compile (inductor) on a CPU needs a C++ compiler")
def test_compile_trains_and_reports_compile_time_apart(llama_data, monkeypatch):
    """About 40 s with a cold inductor cache on 2 cores, a few seconds warm."""
    compiled = []
    original = torch.compile

    def spy(model, *args, **kwargs):
        compiled.append(type(model).__name__)
        return original(model, *args, **kwargs)

    monkeypatch.setattr(torch, "compile", spy)
    metrics, steps = trainer.train_run(llama_spec(compile=True, max_steps=5), llama_data)
    assert_ok(metrics, steps, 5, LM_WARMUP)
    assert compiled == ["LlamaForCausalLM"]
    # Compilation happens in the first (warmup) step; the measured window does not contain it.
    assert metrics["first_step_s"] == steps[0]["step_time_s"]
    assert metrics["compile_time_s"] == pytest.approx(steps[0]["step_time_s"] - metrics["step_time_median_s"])
    assert metrics["compile_time_s"] > 0
    assert metrics["measured_time_s"] == pytest.approx(sum(s["step_time_s"] for s in steps if s["measured"]), rel=1e-6)
    assert metrics["measured_time_s"] < metrics["train_time_s"] - 0.9 * metrics["compile_time_s"]
    assert math.isfinite(metrics["eval_loss"])


@pytest.mark.slow
def test_gradient_accumulation_counts_every_micro_batch(llama_data):
    spec = llama_spec(grad_accum_steps=2, max_steps=3)
    metrics, steps = trainer.train_run(spec, llama_data)
    assert_ok(metrics, steps, 3, LM_WARMUP)
    assert metrics["grad_accum_steps"] == 2
    # Synthetic sequences are all seq_len long: a step of 2 micro-batches of 4 is 8 x 32 tokens.
    assert [s["samples"] for s in steps] == [2 * LM_BATCH] * 3
    assert [s["tokens"] for s in steps] == [2 * LM_BATCH * SEQ] * 3
    assert metrics["measured_tokens"] == 2 * 2 * LM_BATCH * SEQ
    assert metrics["tokens_per_s"] == pytest.approx(metrics["measured_tokens"] / metrics["measured_time_s"])
    assert len({s["lr"] for s in steps}) == 3  # the schedule advances per optimizer step, not per micro-batch


# ---------------------------------------------------------------------------------------------------
# Model families: each trains, and its eval metrics agree with an independent computation


def eval_batch(spec: dict, data_dir: Path) -> Batch:
    manifest = prepared.read_manifest(data_dir)
    split = registry.load_split(data_dir, "eval", manifest)
    return registry.family(manifest["task"]).collate(split, np.arange(len(split)), manifest["pad_token_id"])


@pytest.mark.slow
def test_classification_family_bert(bert_spec, prepared_data, captured):
    spec = bert_spec(method="full", learning_rate=0.0001)
    metrics, steps = trainer.train_run(spec, prepared_data[0])
    assert_ok(metrics, steps, 6, 2)
    assert metrics.get("eval_perplexity") is None and metrics.get("eval_token_accuracy") is None
    model = captured["model"].eval()
    batch = eval_batch(spec, prepared_data[0])
    with torch.no_grad():
        output = model(**batch.inputs)
    accuracy = (output.logits.argmax(-1) == batch.inputs["labels"]).float().mean().item()
    assert metrics["eval_samples"] == 50
    assert metrics["eval_accuracy"] == pytest.approx(accuracy)
    assert metrics["eval_loss"] == pytest.approx(output.loss.item(), rel=1e-5)


@pytest.mark.slow
def test_causal_lm_family_llama(llama_data, captured):
    spec = llama_spec()
    metrics, steps = trainer.train_run(spec, llama_data)
    assert_ok(metrics, steps, LM_STEPS, LM_WARMUP)
    assert metrics.get("eval_accuracy") is None
    assert [s["tokens"] for s in steps] == [LM_BATCH * SEQ] * LM_STEPS
    assert metrics["padding_fraction"] == 0.0
    model = captured["model"].eval()
    batch = eval_batch(spec, llama_data)
    with torch.no_grad():
        output = model(**batch.inputs)  # transformers shifts the labels itself: next-token loss
    labels = batch.inputs["labels"][:, 1:]
    accuracy = (output.logits[:, :-1].argmax(-1) == labels).float().mean().item()
    assert metrics["eval_samples"] == SYNTHETIC_EVAL
    assert metrics["eval_loss"] == pytest.approx(output.loss.item(), rel=1e-5)
    assert metrics["eval_perplexity"] == pytest.approx(math.exp(metrics["eval_loss"]), rel=1e-9)
    assert metrics["eval_token_accuracy"] == pytest.approx(accuracy)
    assert 0 < metrics["eval_loss"] < 2 * math.log(LLAMA_OVERRIDES["vocab_size"])


@pytest.mark.slow
def test_seq2seq_family_t5(t5_data, captured):
    spec = t5_spec()
    metrics, steps = trainer.train_run(spec, t5_data)
    assert_ok(metrics, steps, LM_STEPS, LM_WARMUP)
    assert metrics.get("eval_accuracy") is None
    # Tokens are encoder inputs plus decoder targets.
    assert [s["tokens"] for s in steps] == [LM_BATCH * (SEQ + TARGET_LEN)] * LM_STEPS
    model = captured["model"].eval()
    batch = eval_batch(spec, t5_data)
    with torch.no_grad():
        output = model(**batch.inputs)
    labels = batch.inputs["labels"]
    assert labels.shape == (SYNTHETIC_EVAL, TARGET_LEN)
    accuracy = (output.logits.argmax(-1) == labels).float().mean().item()
    assert metrics["eval_loss"] == pytest.approx(output.loss.item(), rel=1e-5)
    assert metrics["eval_perplexity"] == pytest.approx(math.exp(metrics["eval_loss"]), rel=1e-9)
    assert metrics["eval_token_accuracy"] == pytest.approx(accuracy)


@pytest.mark.slow
def test_seq2seq_config_model_without_decoder_start_token(tmp_path):
    """A bare T5Config has no decoder_start_token_id (a checkpoint's config.json does): the decoder starts from pad."""
    overrides = {key: value for key, value in T5_OVERRIDES.items() if key != "decoder_start_token_id"}
    spec = only_spec(lm_config(t5_def(overrides), name="t5"))
    metrics, steps = trainer.train_run(spec, prepare_for(spec, tmp_path / "data"))
    assert_ok(metrics, steps, LM_STEPS, LM_WARMUP)


@pytest.mark.slow
def test_causal_lm_on_real_text_ignores_padding(tmp_path, tiny_csv, captured):
    """A config-built Llama with a tokenizer, on real (padded) text: eval loss and token accuracy skip padding."""
    config = {
        "models": {"llama": llama_def(tokenizer=MINILM_SOURCE)},
        "datasets": {"text": {k: v for k, v in tiny_dataset_def(tiny_csv).items() if k != "label_column"}},
        "defaults": {**LM_DEFAULTS, "eval_batch_size": 64},
        "matrix": {"model": ["llama"], "dataset": ["text"]},
    }
    config["models"]["llama"]["source"]["overrides"]["vocab_size"] = 30522
    spec = only_spec(config)
    folder = prepare_for(spec, tmp_path / "data")
    metrics, steps = trainer.train_run(spec, folder)
    assert_ok(metrics, steps, LM_STEPS, LM_WARMUP)
    assert 0 < metrics["padding_fraction"] < 1
    model = captured["model"].eval()
    batch = eval_batch(spec, folder)
    with torch.no_grad():
        output = model(**batch.inputs)
    labels = batch.inputs["labels"][:, 1:]
    scored = labels != IGNORE_INDEX
    correct = ((output.logits[:, :-1].argmax(-1) == labels) & scored).sum().item()
    assert metrics["eval_loss"] == pytest.approx(output.loss.item(), rel=1e-5)
    assert metrics["eval_token_accuracy"] == pytest.approx(correct / scored.sum().item())
    assert metrics["eval_perplexity"] == pytest.approx(math.exp(metrics["eval_loss"]))


def test_eval_accumulator_shifts_causal_labels_and_skips_padding():
    """Position t predicts token t+1: logits that predict the next token exactly score 100%, padding excluded."""
    ids = torch.tensor([[5, 6, 7, 8], [9, 3, 0, 0]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])
    labels = torch.where(mask == 1, ids, IGNORE_INDEX)
    logits = torch.full((2, 4, 10), -10.0)
    for row in range(2):
        for t in range(3):
            target = int(ids[row, t + 1])
            logits[row, t, target] = 10.0 if mask[row, t + 1] else -10.0
    batch = Batch({"input_ids": ids, "attention_mask": mask, "labels": labels}, 2, 6, 8, 20)
    scores = registry.family("causal_lm").eval_accumulator()
    scores.add(type("Output", (), {"logits": logits})(), batch)
    result = scores.result()
    assert scores.count == 4  # 3 predictions in row 0, 1 in row 1 (its padding is not scored)
    assert result["eval_token_accuracy"] == 1.0
    assert result["eval_perplexity"] == pytest.approx(math.exp(result["eval_loss"]))
    assert result["eval_loss"] < 1e-6


# ---------------------------------------------------------------------------------------------------
# QLoRA knobs and LoRA targets


@pytest.mark.slow
@pytest.mark.parametrize("quant_type, double_quant", [("nf4", True), ("nf4", False), ("fp4", True), ("fp4", False)])
def test_qlora_quant_type_and_double_quant(quant_type, double_quant, llama_data, captured):
    spec = llama_spec(method="qlora", qlora_quant_type=quant_type, qlora_double_quant=double_quant,
                      lora_targets="all-linear")
    metrics, steps = trainer.train_run(spec, llama_data)
    assert_ok(metrics, steps, LM_STEPS, LM_WARMUP)
    quantised = linear4bit_layers(captured["model"])
    assert len(quantised) == 7 * LLAMA_OVERRIDES["num_hidden_layers"]  # q k v o gate up down
    assert set(captured["quant_states"].values()) == {(quant_type, double_quant)}
    for module in quantised.values():
        assert module.compute_dtype == torch.float32  # the run's precision
        assert not module.weight.requires_grad
    assert not any("lm_head" in name for name in quantised)  # the LM head stays out of 4-bit
    assert metrics["trainable_params"] == 4 * 1024 * LLAMA_OVERRIDES["num_hidden_layers"]


@pytest.mark.slow
def test_qlora_double_quant_lowers_the_weight_estimate(llama_data):
    weights = {}
    for double_quant in (False, True):
        metrics, _ = trainer.train_run(llama_spec(method="qlora", qlora_double_quant=double_quant), llama_data)
        weights[double_quant] = metrics["memory_estimate_parts_mb"]["weights"]
    assert weights[True] < weights[False]


@pytest.mark.slow
def test_qlora_compute_dtype(llama_data, captured):
    metrics, steps = trainer.train_run(llama_spec(method="qlora", qlora_compute_dtype="bf16"), llama_data)
    assert_ok(metrics, steps, LM_STEPS, LM_WARMUP)
    assert {m.compute_dtype for m in linear4bit_layers(captured["model"]).values()} == {torch.bfloat16}


@pytest.mark.slow
def test_qlora_classification_head_stays_out_of_quantisation(bert_spec, prepared_data, captured):
    metrics, steps = trainer.train_run(bert_spec(method="qlora"), prepared_data[0])
    assert_ok(metrics, steps, 6, 2)
    quantised = linear4bit_layers(captured["model"])
    assert quantised and not any("classifier" in name for name in quantised)
    head = [p for name, p in captured["model"].named_parameters() if "classifier" in name and p.requires_grad]
    assert head, "the new classification head must be trained"
    assert 0 <= metrics["eval_accuracy"] <= 1


def test_qlora_bert_pooler_stays_out_of_quantisation(bert_spec):
    # transformers matches skip names against the start or end of a module name: "bert.pooler.dense"
    built = modeling.build_model(bert_spec(method="qlora"), num_labels=2, device=torch.device("cpu"))
    assert linear4bit_layers(built.model)  # the encoder is quantised...
    assert not [name for name in linear4bit_layers(built.model) if "pooler" in name]  # ...the pooler is not


@pytest.mark.slow
def test_lora_all_linear_targets_every_projection_but_the_head(llama_data, captured):
    metrics, steps = trainer.train_run(llama_spec(method="lora", lora_targets="all-linear"), llama_data)
    assert_ok(metrics, steps, LM_STEPS, LM_WARMUP)
    adapted = {name.split(".")[-1] for name, module in captured["model"].named_modules() if hasattr(module, "lora_A")}
    assert adapted == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    # rank x (in + out) per adapted layer: q 64+64, k 64+32, v 64+32, o 64+64, gate/up 64+128, down 128+64
    assert metrics["trainable_params"] == 4 * (128 + 96 + 96 + 128 + 192 + 192 + 192) * 2

    listed, _ = trainer.train_run(llama_spec(method="lora", lora_targets=["q_proj", "v_proj"]), llama_data)
    assert listed["trainable_params"] == 4 * (128 + 96) * 2


# ---------------------------------------------------------------------------------------------------
# What the machine cannot run: a status=unsupported row with the reason, never a crash


@pytest.mark.skipif(CUDA, reason="fp16 is supported where a CUDA GPU is visible")
def test_fp16_on_cpu_writes_an_unsupported_row(bert_spec, prepared_data, tmp_path, keep_sigterm):
    result, steps = train_cli(bert_spec(precision="fp16"), prepared_data[0], tmp_path / "run" / "metrics.json")
    assert_unsupported(result["metrics"], [], "fp16")
    assert steps.empty and list(steps.columns) == STEP_FIELDS


def test_qlora_without_bitsandbytes_is_unsupported(llama_data, monkeypatch):
    monkeypatch.setattr(modeling, "package_available", lambda name: name != "bitsandbytes")
    metrics, steps = trainer.train_run(llama_spec(method="qlora"), llama_data)
    assert_unsupported(metrics, steps, "bitsandbytes")
    metrics, steps = trainer.train_run(llama_spec(optimizer="adamw_8bit"), llama_data)
    assert_unsupported(metrics, steps, "bitsandbytes")


def test_an_installed_package_that_cannot_be_imported_is_an_unsupported_row_before_the_model_is_built(llama_data, monkeypatch):
    """Seen on a GPU host: datasets installed without its dependency multiprocess, so transformers.Trainer could not
    be imported; the hf_trainer rows failed after their models were built, with transformers' "Could not import
    module 'Trainer'". The row must say so up front, with the cause."""
    monkeypatch.setitem(sys.modules, "transformers.trainer", None)  # importing it now fails, as a broken install does
    built = []
    monkeypatch.setattr(modeling, "build_model", lambda *args, **kwargs: built.append(args))
    metrics, steps = trainer.train_run(llama_spec(engine="hf_trainer"), llama_data)
    assert_unsupported(metrics, steps, "engine hf_trainer needs transformers.trainer, which is installed but cannot be "
                       "imported here: ModuleNotFoundError: import of transformers.trainer halted")
    assert not built


def test_a_broken_kernel_package_names_its_missing_dependency(tmp_path, monkeypatch):
    package = tmp_path / "liger_kernel" / "transformers"
    package.mkdir(parents=True)
    (package.parent / "__init__.py").write_text("")
    (package / "__init__.py").write_text("import a_dependency_that_is_not_installed\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in ("liger_kernel", "liger_kernel.transformers"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda: True)
    with pytest.raises(errors.UnsupportedConfiguration, match="kernels: liger needs liger_kernel.transformers, which is "
                       "installed but cannot be imported here: ModuleNotFoundError: No module named 'a_dependency_that_is_not_installed'"):
        modeling.check_supported(llama_spec(kernels="liger"), torch.device("cuda", 0))


def test_a_ddp_launcher_checks_packages_are_installed_without_importing_them(llama_data, tmp_path, monkeypatch):
    """Importing bitsandbytes initialises CUDA: the launcher, which trains nothing, must not hold a CUDA context
    beside its ranks. It only looks the packages up; each rank imports them before building its model."""
    def no_import(module):
        raise AssertionError(f"the launcher imported {module}")

    class Launched(Exception):
        pass

    def torchrun(*args, **kwargs):
        raise Launched

    monkeypatch.setattr(modeling, "import_problem", no_import)
    monkeypatch.setattr(ddp, "run_ddp", torchrun)
    with pytest.raises(Launched):  # it got as far as starting the ranks
        ddp.launch(llama_spec(method="qlora", parallel="ddp", num_gpus=2, device="cpu"), llama_data, tmp_path / "ranks",
                   None, None, trainer.StopSignal())
    monkeypatch.setattr(modeling, "package_available", lambda name: name != "bitsandbytes")
    metrics, _ = ddp.launch(llama_spec(method="qlora", parallel="ddp", num_gpus=2, device="cpu"), llama_data,
                            tmp_path / "ranks", None, None, trainer.StopSignal())
    assert metrics["status"] == "unsupported" and "bitsandbytes package, which is not installed" in metrics["status_reason"]


@pytest.mark.skipif(GPUS >= 2, reason="needs a machine with fewer than 2 GPUs")
def test_ddp_asking_for_more_gpus_than_visible_writes_an_unsupported_row(llama_data, tmp_path, monkeypatch, keep_sigterm):
    def no_torchrun(*args, **kwargs):
        raise AssertionError("torchrun must not be started for a run that cannot get its GPUs")

    monkeypatch.setattr(ddp, "run_ddp", no_torchrun)
    spec = llama_spec(parallel="ddp", num_gpus=2, device="auto")
    result, steps = train_cli(spec, llama_data, tmp_path / "run" / "metrics.json")
    assert_unsupported(result["metrics"], [], "2 GPUs")
    assert steps.empty


def test_dataparallel_on_cpu_is_unsupported(llama_data):
    """DataParallel needs CUDA GPUs. Run on one CPU process, it would train the 2-device batch while
    dividing tokens_per_s_per_device by 2 with world_size 1: per-device and global figures mixed."""
    metrics, steps = trainer.train_run(llama_spec(parallel="dp", num_gpus=2, device="cpu"), llama_data)
    assert_unsupported(metrics, steps, "DataParallel")


@pytest.mark.slow
@pytest.mark.skipif(CUDA, reason="fp16 and multi-GPU rows are supported where GPUs are visible")
def test_unsupported_rows_do_not_crash_the_dag(tmp_path, tiny_config_factory, snakemake_runner):
    config = tiny_config_factory(
        defaults=BERT_DEFAULTS | {"device": "auto", "num_gpus": 1},
        matrix={"model": ["tiny"], "dataset": ["tiny"], "precision": ["fp16"]},
        include=[{"model": "tiny", "dataset": "tiny", "parallel": "ddp", "num_gpus": 4}],
    )
    write_config(tmp_path, config)
    process = snakemake_runner(tmp_path, timeout=600)
    assert process.returncode == 0, snakemake_failure(process)
    table = pd.read_parquet(tmp_path / "results" / "metrics.parquet")
    assert len(table) == 2
    assert (table["status"] == "unsupported").all()
    reasons = dict(zip(table["precision"] + "/" + table["parallel"], table["status_reason"]))
    assert "fp16" in reasons["fp16/single"]
    assert "4 GPUs" in reasons["fp32/ddp"]
    assert table["tokens_per_s"].isna().all()  # null, never 0


# ---------------------------------------------------------------------------------------------------
# Config-built models without a tokenizer; the shipped example experiments


@pytest.mark.slow
def test_config_model_without_tokenizer_trains_on_synthetic_data(tmp_path):
    spec = llama_spec()
    assert "tokenizer" not in spec.model_def["source"]
    folder = prepare_for(spec, tmp_path / "data")
    manifest = prepared.read_manifest(folder)
    assert manifest["tokenizer"] is None and manifest["pad_token_id"] == tokenizers.SYNTHETIC_PAD_ID
    split = registry.load_split(folder, "train", manifest)
    ids = np.stack(split.input_ids)
    assert ids.shape == (SYNTHETIC_TRAIN, SEQ) and ids.max() < LLAMA_OVERRIDES["vocab_size"]
    metrics, steps = trainer.train_run(spec, folder)
    assert_ok(metrics, steps, LM_STEPS, LM_WARMUP)


def test_config_model_without_tokenizer_is_refused_for_real_text(tiny_csv):
    config = {
        "models": {"llama": llama_def()},
        "datasets": {"text": tiny_dataset_def(tiny_csv)},
        "defaults": LM_DEFAULTS,
        "matrix": {"model": ["llama"], "dataset": ["text"]},
    }
    with pytest.raises(ConfigError, match=r"models\.llama\.source\.tokenizer"):
        ftconfig.validate_config(config)


EXAMPLES = ROOT / "config" / "examples"


def load_example(name: str) -> dict:
    config = yaml.safe_load((EXAMPLES / name).read_text())
    ftconfig.validate_config(config)
    return config


@pytest.mark.parametrize("name", sorted(path.name for path in EXAMPLES.glob("*.yaml")))
def test_every_example_is_a_valid_experiment_with_runs(name):
    """Each ready experiment a user may run as it is passes validation and expands to runs (those with a
    particular design have their own test below)."""
    assert matrix.expand_runs(load_example(name))


def test_example_engines():
    runs = matrix.expand_runs(load_example("engines.yaml"))
    assert {r.engine for r in runs} == {"loop", "hf_trainer"}
    # Every configuration measured through the Trainer is also measured through the loop, side by side.
    loop = {(r.method, r.precision, r.compile) for r in runs if r.engine == "loop"}
    trainer_engine = {(r.method, r.precision, r.compile) for r in runs if r.engine == "hf_trainer"}
    assert trainer_engine and trainer_engine <= loop


def test_example_batching_kernels():
    config = load_example("batching-kernels.yaml")
    runs = matrix.expand_runs(config)
    assert sorted((r.batching, r.kernels) for r in runs) == sorted(
        (b, k) for b in ("pad", "group_by_length", "pack", "padding_free") for k in ("none", "liger"))
    # One workload: the same model, data, steps and sequences per step in every mode.
    assert len({(r.model, r.dataset, r.batch_size, r.seq_len, r.max_steps, r.method, r.precision) for r in runs}) == 1
    assert all(r.model_def["task"] == "causal_lm" and r.dataset_def["source"]["kind"] == "package" for r in runs)
    assert config["models"]["llama134m"]["source"]["architecture"] == "LlamaConfig"  # a model type Liger patches


def test_example_llama_methods():
    runs = matrix.expand_runs(load_example("llama-methods.yaml"))
    assert len(runs) == 3 * 2 * 2 + 6
    grid = {(r.method, r.precision, r.gradient_checkpointing) for r in runs if r.optimizer == "adamw"
            and not r.compile and r.qlora_quant_type in (None, "nf4") and r.qlora_double_quant in (None, True)}
    assert len(grid) == 12
    assert {r.method for r in runs if r.optimizer == "paged_adamw_8bit"} == {"full", "lora"}
    assert {r.method for r in runs if r.compile} == {"full", "lora"}
    assert any(r.qlora_quant_type == "fp4" for r in runs)
    assert any(r.method == "qlora" and r.qlora_double_quant is False for r in runs)
    assert all(r.model_def["task"] == "causal_lm" and r.dataset_def["source"]["kind"] == "synthetic" for r in runs)


def test_example_measurement_check():
    config = load_example("measurement-check.yaml")
    runs = matrix.expand_runs(config)
    assert len(runs) == 4 * 3 and len({r.config_id for r in runs}) == 4
    assert sorted({r.seed for r in runs}) == [0, 1, 2]
    # Full multi-head attention: the FLOP counter can count it, so counted/analytic is compared.
    overrides = config["models"]["llama134m_mha"]["source"]["overrides"]
    assert overrides["num_key_value_heads"] == overrides["num_attention_heads"]


def test_example_dp_vs_ddp():
    runs = matrix.expand_runs(load_example("dp-vs-ddp.yaml"))
    assert sorted((r.parallel, r.num_gpus) for r in runs) == [("ddp", 2), ("dp", 2), ("single", 1)]
    assert len({r.batch_size for r in runs}) == 1  # the same per-GPU batch


def test_example_seq_batch_diagnostic():
    runs = matrix.expand_runs(load_example("seq-batch-diagnostic.yaml"))
    assert len(runs) == 9
    assert {(r.seq_len, r.batch_size) for r in runs} == {(s, b) for s in (256, 1024, 4096) for b in (1, 4, 16)}
