"""Issue 4: every figure in metrics.json, each pinned by a test written to fail on the common wrong way.

Throughput traps: padding counted as tokens; per-device and global tokens/s mixed; gradient accumulation
counting one micro-batch; warmup steps measured; the clock read before the device is synchronised;
tokens/s over anything but the measured window. Computations: analytic FLOPs (6N full, 4N + 2N_trainable
LoRA, attention), the model shape they use, counted vs analytic FLOPs, the peak table and MFU, the memory
estimate, NVML sampling and energy, and the columns collect keeps. The window summary, energy per token,
MFU of a collected row and merging DDP ranks are unit-tested in tests/test_metrics.py.
"""

from __future__ import annotations

import io
import json
import math
import os
import signal
import sys
import threading
import time
import types
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

from conftest import LM_DEFAULTS, ROOT
from ftbench.tasks import registry
from ftbench.tasks.base import IGNORE_INDEX, TokenisedSplit
from ftbench.runspec import RunSpec
from ftbench import cli
from ftbench.measure import gpu_table, flops, gpu_monitor, memory_estimate, metrics, model_shape, step_clock
from ftbench.report import collect
from ftbench.experiment import feasibility, matrix
from ftbench.train import modeling, trainer
from ftbench.experiment import config as ftconfig
from ftbench.report.columns import COLUMNS
from ftbench.measure.metrics import energy_per_token

LLAMA_OVERRIDES = {
    "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "vocab_size": 1000, "max_position_embeddings": 128,
}
# Matmul weights of that Llama, by hand: per layer q 64x64, k 64x32, v 64x32, o 64x64, gate/up 64x128, down 128x64.
LLAMA_LAYER_LINEAR = 64 * 64 + 64 * 32 + 64 * 32 + 64 * 64 + 3 * 64 * 128
LLAMA_LM_HEAD = 1000 * 64
LLAMA_EMBEDDINGS = 1000 * 64
SEQ, BATCH, STEPS, WARMUP = (LM_DEFAULTS[key] for key in ("seq_len", "batch_size", "max_steps", "warmup_steps"))


def llama_model_def() -> dict:
    return {"task": "causal_lm",
            "source": {"kind": "config", "architecture": "LlamaConfig", "overrides": dict(LLAMA_OVERRIDES)}}


def spec_for(model_def: dict, **settings) -> RunSpec:
    """The single run spec of this model on synthetic tokens, with LM_DEFAULTS and these settings."""
    config = {
        "models": {"m": model_def},
        "datasets": {"tokens": {"source": {"kind": "synthetic"}, "train_size": 64, "eval_size": 16}},
        "defaults": {**LM_DEFAULTS, **settings},
        "matrix": {"model": ["m"], "dataset": ["tokens"]},
    }
    ftconfig.validate_config(config)
    (spec,) = matrix.expand_runs(config)
    return spec


def llama_spec(**settings) -> RunSpec:
    return spec_for(llama_model_def(), **settings)


def tiny_llama(**overrides):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**{**LLAMA_OVERRIDES, **overrides}))


@pytest.fixture(scope="module")
def llama_data(tmp_path_factory) -> Path:
    spec = llama_spec()
    folder = tmp_path_factory.mktemp("llama-tokens")
    registry.prepare(spec.dataset, spec.dataset_def, spec.model_def, spec.seq_len, folder)
    return folder


@pytest.fixture(autouse=True)
def _two_threads():
    torch.set_num_threads(2)


# ---------------------------------------------------------------------------------------------------
# Trap: padding is not a token


def split_of(*lengths: int, targets: tuple[int, ...] | None = None) -> TokenisedSplit:
    return TokenisedSplit(
        input_ids=[np.arange(1, n + 1) for n in lengths],
        labels=np.zeros(len(lengths), dtype=np.int64),
        target_ids=[np.arange(1, n + 1) for n in targets] if targets else None,
    )


def test_collate_counts_real_tokens_not_padded_positions():
    batch = registry.family("classification").collate(split_of(3, 5, 1), np.array([0, 1, 2]), pad_token_id=0)
    assert batch.inputs["input_ids"].shape == (3, 5)
    assert batch.real_tokens == 3 + 5 + 1  # not 3 x 5
    assert batch.padded_tokens == 15
    assert batch.sum_squared_lengths == 9 + 25 + 1  # attention: each sequence's own length, squared
    assert batch.samples == 3
    assert batch.inputs["attention_mask"].sum().item() == batch.real_tokens


def test_causal_lm_labels_ignore_padding():
    batch = registry.family("causal_lm").collate(split_of(3, 5, 1), np.array([0, 1, 2]), pad_token_id=0)
    labels = batch.inputs["labels"]
    assert (labels != IGNORE_INDEX).sum().item() == batch.real_tokens
    assert (labels == IGNORE_INDEX).sum().item() == batch.padded_tokens - batch.real_tokens


def test_seq2seq_tokens_include_real_targets_only():
    batch = registry.family("seq2seq").collate(split_of(3, 5, 1, targets=(2, 4, 1)), np.array([0, 1, 2]), pad_token_id=0)
    assert batch.real_tokens == 9 + 7
    assert batch.target_tokens == 7
    assert batch.padded_tokens == 15 + 12
    assert batch.sum_squared_lengths == 35
    assert batch.target_sum_squared_lengths == 4 + 16 + 1
    assert (batch.inputs["labels"] != IGNORE_INDEX).sum().item() == 7


# ---------------------------------------------------------------------------------------------------
# Traps in a real run: the clock is read after a device sync; warmup and window; accumulation


class RecordingClock:
    """Stands in for trainer.time. A clock read right after trainer.synchronize returns 1000 x (syncs so
    far); any other read returns that plus a distinct fraction. A duration is a multiple of 1000 only if
    both of its clock reads followed a synchronize."""

    def __init__(self, synchronize):
        self._synchronize = synchronize
        self.syncs = 0
        self.fresh = False
        self.other_reads = 0
        self.events: list[str] = []

    def synchronize(self, device):
        self._synchronize(device)
        self.syncs += 1
        self.fresh = True
        self.events.append("sync")

    def perf_counter(self) -> float:
        if self.fresh:
            self.fresh = False
            self.events.append("synced read")
            return 1000.0 * self.syncs
        self.other_reads += 1
        self.events.append("read")
        return 1000.0 * self.syncs + 0.001 * self.other_reads

    monotonic = staticmethod(time.monotonic)
    sleep = staticmethod(time.sleep)


@pytest.fixture(scope="module")
def clocked_run(llama_data):
    """A real run under RecordingClock: (spec, metrics, steps, clock)."""
    spec = llama_spec(grad_accum_steps=2)
    patch = pytest.MonkeyPatch()
    clock = RecordingClock(trainer.synchronize)
    patch.setattr(trainer, "time", types.SimpleNamespace(perf_counter=clock.perf_counter, monotonic=clock.monotonic,
                                                         sleep=clock.sleep, time=time.time))
    patch.setattr(trainer, "synchronize", clock.synchronize)
    next_batch = trainer._next_batch

    def logged_next_batch(run, loop):
        clock.events.append("next batch")
        return next_batch(run, loop)

    patch.setattr(trainer, "_next_batch", logged_next_batch)
    # The window's step clock reads the same recording clock (on a CPU its markers are host times).
    patch.setattr(step_clock, "time", types.SimpleNamespace(perf_counter=clock.perf_counter))
    boundary = step_clock.StepClock.boundary

    def logged_boundary(self, step):
        clock.events.append("boundary")
        boundary(self, step)

    patch.setattr(step_clock.StepClock, "boundary", logged_boundary)
    try:
        metrics, steps = trainer.train_run(spec, llama_data)
    finally:
        patch.undo()
    assert metrics["status"] == "ok", metrics.get("status_reason")
    return spec, metrics, steps, clock


def is_synced_duration(seconds: float) -> bool:
    return seconds > 0 and abs(seconds / 1000.0 - round(seconds / 1000.0)) < 1e-9


@pytest.mark.slow
def test_warmup_steps_are_timed_after_a_sync_and_the_window_at_its_ends_only(clocked_run):
    """A warmup step's time is read after a device sync (those times decide when the window begins); the measured
    steps are timed by the step clock with none (a sync per step idles the GPU while the host launches the next
    step): the loop synchronises before its first step, after each warmup step and once at the window's end."""
    _, metrics, steps, clock = clocked_run
    assert clock.syncs == 1 + WARMUP + 1
    for record in steps:
        assert is_synced_duration(record["step_time_s"]) is not record["measured"], record
    assert metrics["measured_time_s"] == metrics["window_s"]


@pytest.mark.slow
def test_window_covers_the_measured_steps_only(clocked_run):
    _, metrics, steps, _ = clocked_run
    measured = [r for r in steps if r["measured"]]
    assert [r["measured"] for r in steps] == [False] * WARMUP + [True] * (STEPS - WARMUP)
    assert metrics["total_steps"] == STEPS and metrics["warmup_steps"] == WARMUP
    assert metrics["measured_steps"] == STEPS - WARMUP
    assert metrics["window_s"] == pytest.approx(sum(r["step_time_s"] for r in measured))
    assert metrics["window_s"] < sum(r["step_time_s"] for r in steps)  # the warmup steps are not in it
    assert metrics["measured_tokens"] == sum(r["tokens"] for r in measured)
    assert metrics["tokens_per_s"] == pytest.approx(metrics["measured_tokens"] / metrics["window_s"])
    assert metrics["tokens_per_s_per_device"] == metrics["tokens_per_s"]  # one device


@pytest.mark.slow
def test_gradient_accumulation_counts_every_micro_batch(clocked_run):
    spec, metrics, steps, _ = clocked_run
    assert spec.grad_accum_steps == 2
    # Synthetic sequences are exactly seq_len long: 2 micro-batches of 4 per optimizer step.
    assert [r["tokens"] for r in steps] == [2 * BATCH * SEQ] * STEPS
    assert [r["samples"] for r in steps] == [2 * BATCH] * STEPS
    assert metrics["measured_tokens"] == (STEPS - WARMUP) * 2 * BATCH * SEQ
    # FLOPs too: the analytic count of a step is that of both micro-batches.
    model = modeling.build_model(spec, None, torch.device("cpu")).model
    shape = flops.ModelShape.of(model)
    assert metrics["flops_per_step_analytic"] == flops.step_flops(shape, True, 2 * BATCH * SEQ, 2 * BATCH * SEQ**2)


@pytest.mark.slow
def test_loader_time_is_part_of_step_time(clocked_run):
    _, metrics, steps, _ = clocked_run
    for record in steps:
        assert 0 < record["loader_s"] < record["step_time_s"]
    measured = [r for r in steps if r["measured"]]
    assert metrics["loader_wait_fraction"] == pytest.approx(
        sum(r["loader_s"] for r in measured) / sum(r["step_time_s"] for r in measured))


@pytest.mark.slow
def test_each_step_collates_the_next_steps_first_batch_before_its_closing_sync(clocked_run):
    """The host's data work overlaps the GPU's: a step's first micro-batch is collated before the sync (warmup) or
    the step clock's marker (window) that ends the step before it (a bare loop never waits for it either); the
    second micro-batch during the step's own first one. Every micro-batch is collated exactly once."""
    spec, _, steps, clock = clocked_run
    events = clock.events[clock.events.index("next batch"):]
    closing = [index for index, event in enumerate(events) if event in ("sync", "boundary")][: len(steps)]
    segments = [events[start:end] for start, end in zip([0] + [i + 1 for i in closing], closing)]
    per_step = [segment.count("next batch") for segment in segments]
    accum = spec.grad_accum_steps
    # Step 0: its own two and step 1's first; steps in between: their second and the next one's first; the last: its second.
    assert per_step == [accum + 1] + [accum] * (len(steps) - 2) + [accum - 1]
    assert events.count("next batch") == accum * len(steps)


# ---------------------------------------------------------------------------------------------------
# Steady-state warmup (warmup_until_stable)


@pytest.mark.parametrize("times, expected", [
    ([1.0, 1.0, 1.0, 1.0], False),  # fewer than SETTLE_STEPS times: not yet
    ([9.0, 3.0, 1.0, 1.02, 0.99, 1.0, 1.01], True),  # slow start, then five within 5%
    ([1.0, 1.0, 1.0, 1.0, 1.2], False),  # the last step is 20% off
    ([1.0, 1.0, 1.0, 1.06, 1.0], False),  # 6% off: outside the tolerance
    ([1.0, 1.0, 1.0, 1.04, 1.0], True),
    ([2.0, 1.0, 1.0, 1.0, 1.0, 1.0], True),  # only the last five count
])
def test_settling_rule_on_hand_made_step_times(times, expected):
    assert metrics.settled(times) is expected


def run_warmup(warmup: metrics.Warmup, times: list[float]) -> list[bool]:
    """The measured flags a loop would give these step times."""
    flags, begun = [], False
    for step in range(len(times)):
        begun = warmup.window_begins(step, times[:step]) or begun
        flags.append(begun)
    return flags


def test_warmup_until_stable_begins_the_window_once_times_settle():
    times = [5.0, 2.0, 1.5, 1.0, 1.01, 0.99, 1.0, 1.0, 1.0, 1.0, 1.0]
    warmup = metrics.Warmup(warmup_steps=2, until_stable=True, max_steps=None, total_steps=20)  # cap: step 10
    flags = run_warmup(warmup, times)
    # Steps 3..7 are the first five settled times: measurement begins at step 8.
    assert flags == [False] * 8 + [True] * 3
    assert warmup.figures(len(times)) == {"warmup_steps": 8, "warmup_settled": True}


def test_warmup_until_stable_stops_at_the_cap_and_says_so():
    times = [1.0, 2.0] * 10  # never settles
    warmup = metrics.Warmup(warmup_steps=1, until_stable=True, max_steps=None, total_steps=len(times))
    assert run_warmup(warmup, times) == [False] * 10 + [True] * 10  # default cap: half the run
    assert warmup.figures(len(times)) == {"warmup_steps": 10, "warmup_settled": False}
    capped = metrics.Warmup(warmup_steps=1, until_stable=True, max_steps=4, total_steps=len(times))
    assert run_warmup(capped, times).index(True) == 4


def test_fixed_warmup_is_unchanged():
    warmup = metrics.Warmup(warmup_steps=3, until_stable=False, max_steps=None, total_steps=6)
    assert run_warmup(warmup, [9.0, 1.0, 1.0, 1.0, 1.0, 1.0]) == [False] * 3 + [True] * 3
    assert warmup.figures(6) == {"warmup_steps": 3, "warmup_settled": None}
    assert metrics.Warmup(3, False, None, 6).figures(2)["warmup_steps"] == 2  # stopped before the window


def test_warmup_max_steps_is_checked_at_parse_time():
    with pytest.raises(ftconfig.ConfigError, match="warmup_max_steps.*expected warmup_max_steps < max_steps"):
        llama_spec(warmup_until_stable=True, warmup_max_steps=4)
    with pytest.raises(ftconfig.ConfigError, match="warmup_max_steps.*expected warmup_max_steps >= warmup_steps"):
        llama_spec(warmup_until_stable=True, warmup_steps=2, max_steps=8, warmup_max_steps=1)


@pytest.mark.slow
def test_run_with_warmup_until_stable_measures_after_the_warmup_it_used(monkeypatch, llama_data):
    """A CPU run's step times are not predictable: the rule is made to settle after 3 steps."""
    monkeypatch.setattr(metrics, "settled", lambda times: len(times) >= 3)
    result, steps = trainer.train_run(llama_spec(warmup_until_stable=True, max_steps=6), llama_data)
    assert result["status"] == "ok"
    assert [r["measured"] for r in steps] == [False] * 3 + [True] * 3
    assert (result["warmup_steps"], result["warmup_settled"], result["measured_steps"], result["total_steps"]) == (3, True, 3, 6)
    assert result["window_s"] == pytest.approx(sum(r["step_time_s"] for r in steps[3:]))


# ---------------------------------------------------------------------------------------------------
# Analytic FLOPs and the model shape


def test_step_flops_full_and_lora_on_a_hand_computed_example():
    shape = flops.ModelShape(linear_params=1000, trainable_linear_params=100, layers=2, width=8)
    tokens, squares = 10, 50  # e.g. sequences of 5 + 5 tokens: 25 + 25
    attention = 12 * 2 * 8 * 50  # 9600: 12 x layers x width x sum of S^2
    assert flops.step_flops(shape, True, tokens, squares) == 6 * 1000 * 10 + attention == 69_600
    assert flops.step_flops(shape, False, tokens, squares) == (4 * 1000 + 2 * 100) * 10 + attention == 51_600
    assert flops.step_flops(shape, True, tokens, 0) == 60_000  # attention grows with S^2, not with tokens


def test_step_flops_encoder_decoder_on_a_hand_computed_example():
    shape = flops.ModelShape(linear_params=300, trainable_linear_params=300, layers=2, width=8,
                             encoder_linear_params=100, encoder_trainable_linear_params=100, encoder_layers=3)
    # 6 input tokens through the encoder's 100 weights, 4 target tokens through the decoder's 200.
    expected = 6 * 100 * 6 + 6 * 200 * 4 + 12 * 8 * (3 * 20 + 2 * 10)
    assert flops.step_flops(shape, True, 10, 20, target_tokens=4, target_sum_squared_lengths=10) == expected == 16_080


def test_model_shape_excludes_embeddings_and_includes_the_lm_head():
    shape = flops.ModelShape.of(tiny_llama())
    assert shape.linear_params == 2 * LLAMA_LAYER_LINEAR + LLAMA_LM_HEAD
    assert shape.trainable_linear_params == shape.linear_params
    assert (shape.layers, shape.width) == (2, 64)
    assert shape.encoder_linear_params == 0
    # Tied: the LM head shares the embedding matrix, and is still a matmul of every token.
    tied = flops.ModelShape.of(tiny_llama(tie_word_embeddings=True))
    assert tied.linear_params == 2 * LLAMA_LAYER_LINEAR + LLAMA_LM_HEAD
    total = sum(p.numel() for p in tiny_llama().parameters())
    assert total - shape.linear_params == LLAMA_EMBEDDINGS + sum(  # what is left is embeddings and norms
        p.numel() for n, p in tiny_llama().named_parameters() if "norm" in n)


def test_model_shape_of_a_lora_model_counts_adapters_as_trainable():
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(tiny_llama(), LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    shape = flops.ModelShape.of(model)
    adapters = 2 * 4 * ((64 + 64) + (64 + 32))
    assert shape.trainable_linear_params == adapters
    assert shape.linear_params == 2 * LLAMA_LAYER_LINEAR + LLAMA_LM_HEAD + adapters


def test_model_shape_splits_encoder_and_decoder():
    from transformers import T5Config, T5ForConditionalGeneration

    model = T5ForConditionalGeneration(T5Config(d_model=64, d_ff=128, d_kv=16, num_layers=2, num_decoder_layers=3,
                                                num_heads=4, vocab_size=1000))
    shape = flops.ModelShape.of(model)
    attention, feed_forward = 4 * 64 * 64, 2 * 64 * 128
    assert shape.encoder_linear_params == 2 * (attention + feed_forward)
    assert shape.linear_params == shape.encoder_linear_params + 3 * (2 * attention + feed_forward) + 1000 * 64
    assert (shape.encoder_layers, shape.layers, shape.width) == (2, 3, 64)


def test_config_shape_reads_each_architectures_key_names():
    gpt2 = model_shape.from_config({"n_embd": 768, "n_layer": 12, "n_head": 12, "n_inner": None, "vocab_size": 50257})
    assert gpt2 == model_shape.ConfigShape(width=768, layers=12, decoder_layers=0, intermediate=4 * 768, heads=12,
                                           vocab_size=50257)  # no MLP width given: four times the width
    t5 = model_shape.from_config({"d_model": 64, "d_ff": 128, "num_layers": 2, "num_decoder_layers": 3, "num_heads": 4,
                                  "is_encoder_decoder": True})
    assert (t5.width, t5.intermediate, t5.heads, t5.encoder_layers, t5.decoder_layers, t5.attention_layers) == (64, 128, 4, 2, 3, 5)
    # A multimodal config: its language model's fields; per-layer lists are no count.
    vlm = model_shape.from_config({"num_attention_heads": [2, 4], "text_config": {"hidden_size": 64, "num_hidden_layers": 2}})
    assert (vlm.width, vlm.layers, vlm.heads, vlm.vocab_size) == (64, 2, 0, None)
    assert model_shape.from_config(None) == model_shape.from_transformers_config(None) == model_shape.ConfigShape(0, 0, 0, 0, 0, None)


def test_config_shape_of_a_config_object_reads_what_its_attributes_say():
    """config.to_dict() keeps an architecture's own names; the object's attribute_map gives the usual ones
    (BART: num_hidden_layers is encoder_layers, num_attention_heads is encoder_attention_heads)."""
    from transformers import BartConfig, GPT2Config

    bart = BartConfig(d_model=64, encoder_layers=3, decoder_layers=2, encoder_attention_heads=4, encoder_ffn_dim=96)
    shape = model_shape.from_transformers_config(bart)
    assert (shape.width, shape.encoder_layers, shape.decoder_layers, shape.heads, shape.intermediate) == (64, 3, 2, 4, 96)
    gpt2 = GPT2Config(n_embd=64, n_layer=2, n_head=4)
    shape = model_shape.from_transformers_config(gpt2)
    assert (shape.width, shape.layers, shape.heads) == (gpt2.hidden_size, gpt2.num_hidden_layers, gpt2.num_attention_heads)


@pytest.mark.slow
def test_counted_flops_agree_with_analytic_for_a_tiny_llama(llama_data):
    """flop_counter on the run's own micro-batch vs 6N + attention (eager attention here; fused attention
    with grouped-query heads: test_fused_attention_is_counted_with_grouped_query_heads)."""
    metrics, _ = trainer.train_run(llama_spec(attn_implementation="eager"), llama_data)
    assert metrics["status"] == "ok"
    linear = 2 * LLAMA_LAYER_LINEAR + LLAMA_LM_HEAD
    analytic = flops.step_flops(flops.ModelShape(linear, linear, 2, 64), True, BATCH * SEQ, BATCH * SEQ**2)
    assert metrics["flops_analytic_microbatch"] == analytic
    assert metrics["flops_counted_ratio"] == pytest.approx(1.0, abs=0.02)  # 1.00000 here; 0.944 without attention
    assert metrics["flops_counted_ratio"] == pytest.approx(metrics["flops_counted_microbatch"] / analytic)


@pytest.mark.slow
def test_the_first_step_counts_what_a_pass_of_its_own_counts(llama_data, monkeypatch):
    """A plain one-device run counts its first step's first micro-batch as it trains (no pass of its own, which
    was 0.8-1.5 s of a short job's overhead on an H100): the same count as the pass before training, taken at
    no cost of its own, and the run's losses untouched by it."""
    spec = llama_spec(attn_implementation="eager")
    in_step, in_step_steps = trainer.train_run(spec, llama_data)
    monkeypatch.setattr(trainer, "_counts_flops_in_first_step", lambda run: False)
    own_pass, own_pass_steps = trainer.train_run(spec, llama_data)
    assert in_step["flops_counted_microbatch"] == own_pass["flops_counted_microbatch"] > 0
    assert in_step["flops_analytic_microbatch"] == own_pass["flops_analytic_microbatch"]
    assert in_step["flops_count_time_s"] is None  # no pass of its own to time
    assert 0 < own_pass["flops_count_time_s"] < own_pass["overhead_s"]  # part of what the job spends before its first step
    assert [s["loss"] for s in in_step_steps] == [s["loss"] for s in own_pass_steps]


def test_where_the_first_step_is_counted():
    """Counted as it trains only where what trains is what the counter should see, and the step is not timed."""
    def counted_in_first_step(checkpointed=False, **settings):
        model = torch.nn.Linear(2, 2)
        model.gradient_checkpointing = checkpointed
        run = types.SimpleNamespace(spec=llama_spec(**settings), dist=types.SimpleNamespace(active=False), model=model)
        return trainer._counts_flops_in_first_step(run)

    assert counted_in_first_step()
    assert not counted_in_first_step(checkpointed=True)  # recomputation: counted in a pass of its own, switched off
    assert not counted_in_first_step(compile=True)
    assert not counted_in_first_step(batching="pack")
    assert not counted_in_first_step(engine="hf_trainer")
    assert not counted_in_first_step(parallel="dp", num_gpus=2)
    assert not counted_in_first_step(warmup_steps=0)  # a measured first step must not carry the counter


@pytest.mark.slow
def test_counted_flops_of_lora_agree_with_4n_plus_2n_trainable(llama_data):
    metrics, _ = trainer.train_run(llama_spec(method="lora", attn_implementation="eager",
                                              lora_targets=["q_proj", "v_proj", "gate_proj"]), llama_data)
    assert metrics["status"] == "ok"
    # Not 6N: frozen weights get no weight gradient. (The first layer's frozen inputs need no input
    # gradient either, which the analytic count ignores: 0.965 on this 2-layer model; 6N would give ~0.67.)
    assert metrics["flops_counted_ratio"] == pytest.approx(1.0, abs=0.05)


def test_the_flop_count_of_a_checkpointed_model_is_its_model_flops_and_leaves_checkpointing_on():
    """Recomputation is hardware FLOPs, not model FLOPs: counted with checkpointing on, the cross-check read
    1.23 (full) and 1.37 (LoRA) on an H100 for the 134M example's checkpointed runs."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                         num_key_value_heads=2, vocab_size=100, attn_implementation="eager")).train()
    ids = torch.randint(0, 100, (2, 16))
    inputs = {"input_ids": ids, "labels": ids}
    autocast = {"device_type": "cpu", "enabled": False}
    plain = flops.counted_flops(model, inputs, autocast)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    checkpointed = flops.checkpointed_modules(model)
    assert len(checkpointed) >= 2  # each decoder layer (and the model's own flag)
    with flops.FlopTally() as recomputing:  # what the count was before: the forward of each layer twice
        model(**inputs).loss.backward()
    model.zero_grad(set_to_none=True)
    assert recomputing.total > plain
    assert flops.counted_flops(model, inputs, autocast) == plain
    assert flops.checkpointed_modules(model) == checkpointed  # still on for training


def test_a_4bit_base_is_counted_like_the_matmuls_it_replaces(tmp_path):
    """bitsandbytes' forward through a 4-bit weight is one custom op (bitsandbytes::gemm_4bit) that torch's
    formulas do not know: uncounted, QLoRA's cross-check read 0.73 on an H100. Counted, the same LoRA on a
    4-bit base counts what it counts on the unquantised one."""
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
    from transformers import BitsAndBytesConfig, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    # hidden 128: bitsandbytes' CPU kernels quantise blocks of 64 input features
    LlamaForCausalLM(LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                                 num_key_value_heads=2, vocab_size=256)).save_pretrained(tmp_path)
    ids = torch.randint(0, 256, (2, 16))
    counts = {}
    for method in ("lora", "qlora"):
        quantised = {"quantization_config": BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                                               bnb_4bit_compute_dtype=torch.float32),
                     "device_map": {"": "cpu"}} if method == "qlora" else {}
        model = LlamaForCausalLM.from_pretrained(tmp_path, dtype=torch.float32, attn_implementation="eager", **quantised)
        if quantised:
            model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
        model = get_peft_model(model, LoraConfig(r=8, target_modules="all-linear")).train()
        counts[method] = flops.counted_flops(model, {"input_ids": ids, "labels": ids}, {"device_type": "cpu", "enabled": False})
    assert counts["qlora"] == counts["lora"]


def test_fused_attention_is_counted_with_grouped_query_heads():
    """SDPA on a model with fewer KV heads than heads (the tiny Llama: 4 heads, 2 KV heads): counted as the
    eager math path counts it, and the count matches the analytic one (torch 2.11 raised here; the CPU
    kernel had no formula, the attention term was missing)."""
    model = tiny_llama(attn_implementation="sdpa")
    assert model.config.num_key_value_heads < model.config.num_attention_heads
    ids = torch.randint(0, 1000, (2, 16), generator=torch.Generator().manual_seed(0))
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}
    no_autocast = {"device_type": "cpu", "enabled": False}
    fused = flops.counted_flops(model, inputs, no_autocast)
    model.set_attn_implementation("eager")
    assert fused == flops.counted_flops(model, inputs, no_autocast)
    linear = 2 * LLAMA_LAYER_LINEAR + LLAMA_LM_HEAD
    analytic = flops.step_flops(flops.ModelShape(linear, linear, 2, 64), True, 2 * 16, 2 * 16**2)
    assert fused / analytic == pytest.approx(1.0, abs=0.01)


@pytest.mark.parametrize("method", ["full", "lora"])
def test_the_flop_tally_gives_flop_counter_modes_total(method):
    """FlopTally is FlopCounterMode's arithmetic without its bookkeeping: the same total, here with
    autocast, fused attention and LoRA adapters (on a checkpointed model, whose recomputation both leave out:
    counted_flops switches it off)."""
    from torch.utils.flop_counter import FlopCounterMode

    model = tiny_llama(attn_implementation="sdpa")
    if method == "lora":
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj", "down_proj"]))
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    ids = torch.randint(0, 1000, (2, 16), generator=torch.Generator().manual_seed(0))
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}
    autocast = {"device_type": "cpu", "dtype": torch.bfloat16}
    reference = FlopCounterMode(display=False, custom_mapping=flops.attention_flop_formulas())
    with flops.recomputation_off(model), reference:
        with torch.autocast(**autocast):
            output = model(**inputs)
        output.loss.backward()
    model.zero_grad(set_to_none=True)
    tallied = flops.counted_flops(model, inputs, autocast)
    assert tallied == reference.get_total_flops() > 0
    assert all(p.grad is None for p in model.parameters())


def test_attention_formula_on_a_hand_computed_example():
    # b=2, 4 query heads, 2 KV heads, S=8, head dim 16: QK^T and PV are 2 x (2*4*8*8*16) multiply-adds.
    forward = flops._attention_forward_flops((2, 4, 8, 16), (2, 2, 8, 16), (2, 2, 8, 16))
    assert forward == 2 * 2 * (2 * 4 * 8 * 8 * 16)
    assert flops._attention_backward_flops((2, 4, 8, 16), (2, 4, 8, 16), (2, 2, 8, 16), (2, 2, 8, 16)) == 2 * forward


# ---------------------------------------------------------------------------------------------------
# Peak table and MFU

SHIPPED_PEAKS = gpu_table.load_peaks(ROOT / "config" / "gpus.yaml")


@pytest.mark.parametrize("device_name, dtype, peak, entry", [
    ("NVIDIA H100 80GB HBM3", "bf16", 989.4, "H100 SXM bf16"),
    ("NVIDIA H100 PCIe", "bf16", 756.5, "H100 PCIe bf16"),
    ("NVIDIA H100 NVL", "fp16", 835.5, "H100 NVL fp16"),
    ("NVIDIA H200", "bf16", 989.4, "H200 bf16"),
    ("NVIDIA A100-SXM4-80GB", "bf16", 312.0, "A100 bf16"),
    ("NVIDIA A100-SXM4-40GB", "fp32", 19.5, "A100 fp32"),  # fp32 is the non-tensor-core peak, not TF32
])
def test_peak_tflops_resolves_known_gpus(device_name, dtype, peak, entry):
    assert gpu_table.peak_tflops(device_name, dtype, SHIPPED_PEAKS) == (peak, entry)


def test_mfu_divides_by_the_peak_of_every_device():
    result = gpu_table.mfu(0.5 * 989.4e12 * 2, "NVIDIA H100 80GB HBM3", "bf16", devices=2, peaks=SHIPPED_PEAKS)
    assert result == {"mfu": pytest.approx(0.5), "mfu_peak_tflops": 989.4, "mfu_peak_source": "H100 SXM bf16"}


def test_a_bf16_true_run_is_measured_against_the_bf16_peak():
    row = {"device": "cuda", "tflops_per_s": 494.7, "device_name": "NVIDIA H100 80GB HBM3", "world_size": 1}
    assert metrics.mfu({**row, "precision": "bf16_true"}, SHIPPED_PEAKS) == metrics.mfu({**row, "precision": "bf16"}, SHIPPED_PEAKS)
    assert metrics.mfu({**row, "precision": "bf16_true"}, SHIPPED_PEAKS)["mfu"] == pytest.approx(0.5)


@pytest.mark.slow
def test_bf16_true_trains_bf16_weights_without_autocast(llama_data):
    """precision bf16_true: every weight (LoRA's adapters too) is bf16 and no autocast runs; the run trains and its
    estimate counts half the bytes per parameter of the mixed-precision run's."""
    from ftbench.train.devices import autocast_args

    cpu = torch.device("cpu")
    for method in ("full", "lora"):
        built = modeling.build_model(llama_spec(precision="bf16_true", method=method), None, cpu, pad_token_id=0)
        assert {p.dtype for p in built.model.parameters()} == {torch.bfloat16}
    assert not autocast_args(cpu, "bf16_true")["enabled"] and autocast_args(cpu, "bf16")["enabled"]
    true, steps = trainer.train_run(llama_spec(precision="bf16_true"), llama_data)
    assert true["status"] == "ok" and all(math.isfinite(s["loss"]) for s in steps)
    mixed, _ = trainer.train_run(llama_spec(precision="bf16"), llama_data)
    assert true["memory_estimate_parts_mb"]["weights"] == pytest.approx(mixed["memory_estimate_parts_mb"]["weights"] / 2)
    assert true["memory_estimate_parts_mb"]["weight_copies"] == 0 < mixed["memory_estimate_parts_mb"]["weight_copies"]


@pytest.mark.parametrize("settings, words", [({"method": "qlora"}, "QLoRA"), ({"parallel": "fsdp", "num_gpus": 2}, "fsdp")])
def test_bf16_true_beyond_full_and_lora_on_one_process_kind_is_unsupported(settings, words):
    assert words in feasibility.unsupported_reason(RunSpec(precision="bf16_true", **settings))
    assert feasibility.unsupported_reason(RunSpec(precision="bf16", **settings)) is None
    assert feasibility.unsupported_reason(RunSpec(precision="bf16_true", method="lora", parallel="ddp", num_gpus=2)) is None


@pytest.mark.parametrize("device_name, dtype", [("Mystery Accelerator 9000", "bf16"), ("Tesla T4", "bf16")])
def test_unknown_gpu_or_dtype_gives_no_mfu_and_a_warning(device_name, dtype):
    with pytest.warns(UserWarning, match=device_name):
        result = gpu_table.mfu(1e14, device_name, dtype, devices=1, peaks=SHIPPED_PEAKS)
    assert result == {"mfu": None, "mfu_peak_tflops": None, "mfu_peak_source": None}


# ---------------------------------------------------------------------------------------------------
# Memory estimate


def estimate_spec(**settings) -> RunSpec:
    return RunSpec(**{"method": "full", "optimizer": "adamw", "batch_size": 2, "seq_len": 16, "precision": "fp32",
                      "gradient_checkpointing": False, "qlora_double_quant": None, "attn_implementation": None, **settings})


def parts(model, **settings) -> dict:
    """The estimate's parts in bytes."""
    result = memory_estimate.estimate(model, estimate_spec(**settings), LLAMA_OVERRIDES["vocab_size"])
    return {name: value * memory_estimate.MIB for name, value in result["memory_estimate_parts_mb"].items()}


@pytest.mark.parametrize("optimizer, bytes_per_param",
                         [("adamw", 8), ("adamw_8bit", 2), ("paged_adamw_8bit", 2), ("sgd", 4)])
def test_optimizer_state_bytes_per_trainable_parameter(optimizer, bytes_per_param):
    model = tiny_llama()
    params = sum(p.numel() for p in model.parameters())
    assert parts(model, optimizer=optimizer)["optimizer"] == pytest.approx(bytes_per_param * params)
    for p in model.parameters():  # only trainable parameters have optimizer state and gradients
        p.requires_grad_(False)
    model.lm_head.weight.requires_grad_(True)
    assert parts(model, optimizer=optimizer)["optimizer"] == pytest.approx(bytes_per_param * LLAMA_LM_HEAD)
    assert parts(model, optimizer=optimizer)["gradients"] == pytest.approx(4 * LLAMA_LM_HEAD)


def test_weights_are_fp32_masters_and_estimate_sums_its_parts():
    model = tiny_llama()
    params = sum(p.numel() for p in model.parameters())
    result = memory_estimate.estimate(model, estimate_spec(batch_size=8, seq_len=64), 1000)
    assert result["memory_estimate_parts_mb"]["weights"] * memory_estimate.MIB == pytest.approx(4 * params)
    # 512 tokens of a decoder: its peak is the start of the backward pass, everything but the gradients.
    expected = sum(value for name, value in result["memory_estimate_parts_mb"].items() if name != "gradients")
    assert result["memory_estimate_mb"] == pytest.approx(expected)
    # Logits of a decoder, batch x seq x vocab: the fp32 log-softmax output, its gradient and its input's.
    assert parts(model)["logits"] == pytest.approx(12 * 2 * 16 * 1000)
    # Autocast's 16-bit weight copies exist only with a 16-bit precision.
    assert parts(model)["weight_copies"] == 0
    assert parts(model, precision="bf16")["weight_copies"] == pytest.approx(2 * params)


def test_activation_model_and_checkpointing():
    model = tiny_llama()  # RMSNorm, gated MLP, width 64, MLP width 128, 4 heads, 2 layers
    assert memory_estimate.architecture_traits(model) == ("rms", "gated")
    plain = parts(model)["activations"]
    # batch 2 x seq 16 x 2 layers x (40 x width + 16 x MLP width) bytes in fp32
    assert plain == pytest.approx(2 * 16 * 2 * (40 * 64 + 16 * 128))
    assert parts(model, precision="bf16")["activations"] == pytest.approx(2 * 16 * 2 * (34 * 64 + 8 * 128))
    # The stored score matrix only where eager attention keeps it (fused kernels do not): 5 x heads x S.
    eager = parts(model, attn_implementation="eager", precision="bf16")["activations"]
    assert eager - parts(model, precision="bf16")["activations"] == pytest.approx(2 * 16 * 2 * 5 * 4 * 16)
    longer = parts(model, attn_implementation="eager", precision="bf16", seq_len=64)["activations"]
    assert longer > 4 * eager  # the score matrix grows with S^2
    # Checkpointing: each layer's fp32 input, plus one layer's activations during its recomputation; of the
    # weight copies only the output head's (vocabulary 1000 x width 64 in bf16): the layers' go with autocast's
    # cache before the backward pass.
    checkpointed = parts(model, gradient_checkpointing=True, precision="bf16")
    assert checkpointed["activations"] == pytest.approx(2 * 16 * 2 * 4 * 64)
    assert checkpointed["recompute"] == pytest.approx(2 * 16 * (34 * 64 + 8 * 128))
    assert checkpointed["weight_copies"] == 2 * 1000 * 64 and parts(model)["recompute"] == 0


def test_peak_is_the_larger_moment_of_the_backward_pass():
    """Start (activations, logits, weight copies; no gradients) or end (gradients, and with checkpointing the
    layer inputs and one recomputed layer), on top of weights and optimizer state."""
    base = {"weights": 100, "optimizer": 200, "weight_copies": 10, "activations": 50, "recompute": 0, "logits": 40}
    assert memory_estimate.peak_bytes({**base, "gradients": 30}) == 100 + 200 + 10 + 50 + 40
    assert memory_estimate.peak_bytes({**base, "gradients": 150}) == 100 + 200 + 150
    checkpointed = {**base, "weight_copies": 0, "recompute": 20}
    assert memory_estimate.peak_bytes({**checkpointed, "gradients": 10}) == 100 + 200 + 50 + 40
    assert memory_estimate.peak_bytes({**checkpointed, "gradients": 60}) == 100 + 200 + 60 + 50 + 20
    # A full fine-tune of a classifier with short sequences: the gradients are the peak.
    model = tiny_llama()
    small = memory_estimate.estimate(model, estimate_spec(batch_size=1, seq_len=2), None)
    parts_mb = small["memory_estimate_parts_mb"]
    assert small["memory_estimate_mb"] == pytest.approx(parts_mb["weights"] + parts_mb["optimizer"] + parts_mb["gradients"]
                                                        + parts_mb["workspace"])


def traced_activation_bytes_per_layer(make_model, precision: str, batch: int = 3, seq: int = 40) -> float:
    """Bytes autograd saves for backward per layer, traced with saved-tensor hooks: the difference between a
    4-layer and a 2-layer model, so embeddings, head and loss cancel. Tensors without the batch dimension
    (autocast's weight copies) are left out; each storage is counted once."""
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[precision]
    totals = {}
    for layers in (2, 4):
        torch.manual_seed(0)
        model = make_model(layers).train()
        ids = torch.randint(0, 1000, (batch, seq))
        labels = ids if "CausalLM" in type(model).__name__ else torch.zeros(batch, dtype=torch.long)
        storages = {}

        def keep(tensor):
            if tensor.dim() >= 2 and batch in (tensor.shape[0], tensor.shape[0] // seq):
                storage = tensor.untyped_storage()
                storages[storage.data_ptr()] = storage.nbytes()
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(keep, lambda tensor: tensor):
            with torch.autocast("cpu", dtype=dtype, enabled=precision != "fp32"):
                model(input_ids=ids, labels=labels)
        totals[layers] = sum(storages.values())
    return (totals[4] - totals[2]) / 2


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("family", ["llama", "bert"])
def test_activation_model_matches_what_autograd_keeps(family, precision):
    """The per-layer activation model against the bytes transformers' layers really save, within 10%."""
    from transformers import BertConfig, BertForSequenceClassification, LlamaConfig, LlamaForCausalLM

    def make_model(layers):
        if family == "llama":
            return LlamaForCausalLM(LlamaConfig(hidden_size=96, intermediate_size=256, num_hidden_layers=layers,
                                                num_attention_heads=4, num_key_value_heads=4, vocab_size=1000))
        return BertForSequenceClassification(BertConfig(hidden_size=96, intermediate_size=384, num_hidden_layers=layers,
                                                        num_attention_heads=4, vocab_size=1000, attention_probs_dropout_prob=0.0))

    batch, seq = 3, 40
    traced = traced_activation_bytes_per_layer(make_model, precision, batch, seq)
    model = make_model(1)
    spec = estimate_spec(precision=precision, batch_size=batch, seq_len=seq)
    estimated = memory_estimate.estimate(model, spec, None)["memory_estimate_parts_mb"]["activations"]
    assert estimated * memory_estimate.MIB == pytest.approx(traced, rel=0.10)


@pytest.mark.parametrize("method", ["full", "qlora"])
def test_fsdp_activation_model_matches_what_autograd_keeps_with_sixteen_bit_parameters(method):
    """Under FSDP2's mixed precision the layers compute with bf16 parameters (its MixedPrecisionPolicy casts
    them): traced here by casting a Llama's unquantised parameters to bf16 under bf16 autocast, against the
    estimate of the same run under fsdp, within 10%."""
    batch, seq = 3, 40

    def make_model(layers):
        spec = adapter_spec("llama", layers, method=method, precision="bf16", lora_dropout=0.0)
        model = modeling.build_model(spec, None, torch.device("cpu")).model
        for param in model.parameters():
            if param.dtype == torch.float32:
                param.data = param.data.to(torch.bfloat16)
        return model

    traced = traced_activation_bytes_per_layer(make_model, "bf16", batch, seq)
    spec = adapter_spec("llama", 1, method=method, precision="bf16", lora_dropout=0.0)
    spec = spec.replace(batch_size=batch, seq_len=seq, parallel="fsdp", num_gpus=2)
    estimated = memory_estimate.estimate(make_model(1), spec, None)["memory_estimate_parts_mb"]["activations"]
    assert estimated * memory_estimate.MIB == pytest.approx(traced, rel=0.10)
    one_gpu = memory_estimate.estimate(make_model(1), spec.replace(parallel="single", num_gpus=1), None)
    assert one_gpu["memory_estimate_parts_mb"]["activations"] * memory_estimate.MIB > 1.2 * traced  # what fsdp was counted as


def adapter_spec(family: str, layers: int, **settings) -> RunSpec:
    """A run spec for a small Llama (RMSNorm, gated MLP) or BERT (LayerNorm, plain MLP) with adapters."""
    if family == "llama":
        model_def = {"task": "causal_lm", "source": {"kind": "config", "architecture": "LlamaConfig", "overrides": {
            "hidden_size": 96, "intermediate_size": 256, "num_hidden_layers": layers, "num_attention_heads": 4,
            "num_key_value_heads": 4, "vocab_size": 1000}}}
    else:
        model_def = {"task": "classification", "source": {"kind": "config", "architecture": "BertConfig", "overrides": {
            "hidden_size": 96, "intermediate_size": 384, "num_hidden_layers": layers, "num_attention_heads": 4,
            "vocab_size": 1000, "attention_probs_dropout_prob": 0.0, "hidden_dropout_prob": 0.0}}}
    return spec_for(model_def, lora_targets="all-linear", **settings)


@pytest.mark.parametrize("method", ["lora", "qlora"])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("family", ["llama", "bert"])
def test_adapter_activation_model_matches_what_autograd_keeps(family, precision, method):
    """Frozen weights, LoRA-A outputs and QLoRA's fp32 MLP, against the bytes peft and bitsandbytes layers
    really save, within 10%. Without LoRA dropout: a CPU keeps dropout masks in the input's dtype, a GPU
    in one byte (the next test)."""
    batch, seq = 3, 40
    num_labels = None if family == "llama" else 2

    def make_model(layers):
        spec = adapter_spec(family, layers, method=method, precision=precision, lora_dropout=0.0)
        return modeling.build_model(spec, num_labels, torch.device("cpu")).model

    traced = traced_activation_bytes_per_layer(make_model, precision, batch, seq)
    model = make_model(1)
    spec = adapter_spec(family, 1, method=method, precision=precision, lora_dropout=0.0).replace(batch_size=batch, seq_len=seq)

    def estimated_activations(method_as: str) -> float:
        parts_mb = memory_estimate.estimate(model, spec.replace(method=method_as), None)["memory_estimate_parts_mb"]
        return parts_mb["activations"] * memory_estimate.MIB

    assert estimated_activations(method) == pytest.approx(traced, rel=0.10)
    # The adapter terms bring it closer than the full fine-tuning model would (for 16-bit QLoRA on Llama,
    # that one is 20% low: the fp32 MLP tensors).
    assert abs(estimated_activations(method) - traced) < abs(estimated_activations("full") - traced)


def test_compiled_run_gets_no_estimate_and_a_reason():
    """torch.compile keeps fewer activations than eager autograd: no estimate rather than a wrong one."""
    result = memory_estimate.estimate(tiny_llama(), estimate_spec(compile=True), 1000)
    assert result["memory_estimate_mb"] is None and result["memory_estimate_parts_mb"] is None
    assert result["memory_estimate_note"].startswith("not modelled for compiled runs")
    eager = memory_estimate.estimate(tiny_llama(), estimate_spec(), 1000)
    assert eager["memory_estimate_mb"] > 0 and eager["memory_estimate_note"] is None
    from ftbench.report.columns import row_from_result

    row = row_from_result({"spec": {**estimate_spec(compile=True).to_dict(), "model_def": {"task": "causal_lm"}},
                           "metrics": {"status": "ok", "peak_rss_mb": 100.0, **result}})
    assert row["memory_estimate_ratio"] is None and row["memory_estimate_note"] == result["memory_estimate_note"]


def test_lora_dropout_adds_a_one_byte_mask_per_adapted_input():
    """CUDA's fused dropout keeps a bool mask: traced on an H100 with all-linear LoRA on Llama, dropout 0.05 added
    exactly 6 x width + 1 x intermediate bytes per layer-token (q, k, v, o, gate, up read width-wide inputs, down
    an intermediate-wide one)."""
    spec = adapter_spec("llama", 2, method="lora", precision="bf16", lora_dropout=0.0)
    model = modeling.build_model(spec, None, torch.device("cpu")).model
    without = memory_estimate.estimate(model, spec, 1000)["memory_estimate_parts_mb"]["activations"]
    with_dropout = memory_estimate.estimate(model, spec.replace(lora_dropout=0.05), 1000)["memory_estimate_parts_mb"]["activations"]
    tokens = spec.batch_size * spec.seq_len
    assert (with_dropout - without) * memory_estimate.MIB == pytest.approx(tokens * 2 * (6 * 96 + 256))


def test_qlora_weights_are_estimated_below_full_weights(llama_data):
    full = modeling.build_model(llama_spec(), None, torch.device("cpu")).model
    full_weights = parts(full)["weights"]
    estimates = {}
    for double_quant in (False, True):
        spec = llama_spec(method="qlora", qlora_double_quant=double_quant, lora_targets="all-linear")
        model = modeling.build_model(spec, None, torch.device("cpu")).model
        estimates[double_quant] = parts(model, qlora_double_quant=double_quant)["weights"]
    quantised = 2 * LLAMA_LAYER_LINEAR  # the LM head and embeddings stay unquantised
    adapters = 4 * 1024 * 2  # all-linear LoRA at rank 4 (fp32, like every unquantised parameter)
    assert estimates[False] < full_weights
    # 0.5 byte per 4-bit weight plus one fp32 absmax per 64 weights, instead of 4 bytes
    assert full_weights - estimates[False] == pytest.approx(quantised * (4 - 0.5 - 0.0625) - 4 * adapters)
    assert estimates[True] < estimates[False]


# ---------------------------------------------------------------------------------------------------
# NVML sampling


NULL_FIELDS = ("gpu_util_mean", "gpu_mem_used_peak_mb", "gpu_power_mean_w", "energy_j")


def test_sampler_without_gpus_gives_null_not_zero():
    sampler = gpu_monitor.GpuSampler([])
    sampler.start()
    result = sampler.stop()
    assert all(result[key] is None for key in NULL_FIELDS)
    assert result["nvml_samples"] == 0


def test_sampler_without_nvml_gives_null_not_zero(monkeypatch):
    monkeypatch.setattr(gpu_monitor, "_nvml", lambda module=None: None)
    sampler = gpu_monitor.GpuSampler([0])
    assert not sampler.available
    sampler.start()
    result = sampler.stop()
    assert all(result[key] is None for key in NULL_FIELDS)


class FakeNvml:
    """Two GPUs at 200 W each, 60% / 80% busy; an energy counter unless ``counter`` is False."""

    def __init__(self, counter: bool = True):
        self.counter = counter
        self.energy_reads = {0: iter([1_000, 51_000]), 1: iter([5_000, 35_000])}  # mJ: +50 J and +30 J

    def nvmlDeviceGetTotalEnergyConsumption(self, handle):
        if not self.counter:
            raise RuntimeError("not supported")
        return next(self.energy_reads[handle])

    def nvmlDeviceGetUtilizationRates(self, handle):
        return types.SimpleNamespace(gpu=60 if handle == 0 else 80)

    def nvmlDeviceGetPowerUsage(self, handle):
        return 200_000  # mW

    def nvmlDeviceGetMemoryInfo(self, handle):
        return types.SimpleNamespace(used=(1 + handle) * 2**30)


@pytest.mark.slow
def test_run_samples_at_the_interval_its_spec_gives(monkeypatch, llama_data):
    built = []

    class RecordingSampler(gpu_monitor.GpuSampler):
        def __init__(self, cuda_indices, interval_s=0.5):
            super().__init__(cuda_indices, interval_s)
            built.append(interval_s)

    monkeypatch.setattr(gpu_monitor, "GpuSampler", RecordingSampler)
    metrics, _ = trainer.train_run(llama_spec(gpu_sample_interval_s=0.25, max_steps=2, warmup_steps=1), llama_data)
    assert metrics["status"] == "ok" and built == [0.25]


def sample_with(monkeypatch, fake: FakeNvml) -> tuple[dict, gpu_monitor.Sampling]:
    """What the sampler process does between "start" and "stop", here in this process on a stand-in NVML."""
    sampling = gpu_monitor.Sampling(fake, [0, 1])
    sampling.begin()
    for _ in range(4):
        time.sleep(0.01)
        sampling.sample()
    return sampling.end(), sampling


FAKE_NVML_MODULE = """
import types
def nvmlInit(): pass
def nvmlDeviceGetHandleByUUID(uuid): return int(uuid.rsplit("-", 1)[1])
_energy = {0: iter([1_000, 51_000]), 1: iter([5_000, 35_000])}
def nvmlDeviceGetTotalEnergyConsumption(handle): return next(_energy[handle])
def nvmlDeviceGetUtilizationRates(handle): return types.SimpleNamespace(gpu=60 if handle == 0 else 80)
def nvmlDeviceGetPowerUsage(handle): return 200_000
def nvmlDeviceGetMemoryInfo(handle): return types.SimpleNamespace(used=(1 + handle) * 2**30)
"""


def stand_in_sampler(monkeypatch, tmp_path, gpus: list[int], module: str = FAKE_NVML_MODULE) -> gpu_monitor.GpuSampler:
    """A GpuSampler whose process opens ``module`` (Python source, a stand-in for pynvml) in place of NVML."""
    (tmp_path / "fake_nvml.py").write_text(module)
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}:{os.environ.get('PYTHONPATH', '')}")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(gpu_monitor, "gpu_uuids", lambda indices: [f"GPU-{index}" for index in indices])
    return gpu_monitor.GpuSampler(gpus, interval_s=0.01, nvml_module="fake_nvml")


def test_the_sampler_process_samples_between_start_and_stop(monkeypatch, tmp_path):
    """The run's process only writes start and stop: the sampling happens in a process of its own (no
    interpreter lock shared with the loop), which answers with the window's summary."""
    sampler = stand_in_sampler(monkeypatch, tmp_path, [0, 1])
    assert sampler.available
    sampler.start()
    time.sleep(0.3)
    result = sampler.stop()
    assert result["energy_j"] == pytest.approx(80.0)  # the driver counters' difference, summed over the GPUs
    assert result["gpu_util_mean"] == pytest.approx(70.0)
    assert result["gpu_mem_used_peak_mb"] == 2048.0
    assert result["nvml_samples"] >= 4
    assert not sampler.available  # the process has ended


def test_a_sampler_never_started_ends_its_process(monkeypatch, tmp_path):
    sampler = stand_in_sampler(monkeypatch, tmp_path, [0])
    process = sampler._process
    assert sampler.stop() == gpu_monitor.NULL_RESULT  # an OOM before the window: no figures, no stray process
    assert process.poll() is not None


# Energy counters read at both ends of two spans with a pause between: GPU 0 gains 10 J in the first span,
# 29 J while paused and 5 J in the second; GPU 1 gains 4, 12 and 2 J. The window's energy: 10 + 5 + 4 + 2 J.
SPANNED_ENERGY_MJ = {0: [1_000, 11_000, 40_000, 45_000], 1: [3_000, 7_000, 19_000, 21_000]}
SPANNED_ENERGY_J = 21.0
SPANNED_NVML_MODULE = FAKE_NVML_MODULE.replace(
    "_energy = {0: iter([1_000, 51_000]), 1: iter([5_000, 35_000])}",
    f"_energy = {{handle: iter(reads) for handle, reads in {SPANNED_ENERGY_MJ}.items()}}")


class ServedNvml(FakeNvml):
    """FakeNvml as the sampler process opens it (by UUID), with SPANNED_ENERGY_MJ's counters; it counts the
    counter's readings, and the samples taken while the test says an evaluation runs."""

    def __init__(self, counter: bool = True):
        super().__init__(counter)
        self.energy_reads = {handle: iter(reads) for handle, reads in SPANNED_ENERGY_MJ.items()}
        self.counter_reads = 0
        self.evaluating = False
        self.samples_while_evaluating = 0

    def nvmlInit(self):
        pass

    def nvmlDeviceGetHandleByUUID(self, uuid):
        return int(uuid.rsplit("-", 1)[1])

    def nvmlDeviceGetTotalEnergyConsumption(self, handle):
        self.counter_reads += 1
        return super().nvmlDeviceGetTotalEnergyConsumption(handle)

    def nvmlDeviceGetUtilizationRates(self, handle):
        self.samples_while_evaluating += self.evaluating
        return super().nvmlDeviceGetUtilizationRates(handle)


def serve_request(monkeypatch, nvml: ServedNvml, interval_s: float) -> dict:
    """The sampler process's request for two GPUs, ``nvml`` importable by the name it gives (``serve`` runs
    in this process in these tests)."""
    module = types.ModuleType("served_nvml")
    for name in dir(nvml):
        if name.startswith("nvml"):
            setattr(module, name, getattr(nvml, name))
    monkeypatch.setitem(sys.modules, module.__name__, module)
    return {"uuids": ["GPU-0", "GPU-1"], "interval_s": interval_s, "nvml_module": module.__name__}


def serve_all_at_once(monkeypatch, nvml: ServedNvml, commands: list[str], clock_readings: list[float]) -> dict:
    """``serve``'s summary given ``commands`` all at once through a pipe, on a clock that reads
    ``clock_readings`` in turn (one reading where each span opens and one where it closes)."""
    read_fd, write_fd = os.pipe()
    os.write(write_fd, "".join(f"{command}\n" for command in commands).encode())
    os.close(write_fd)
    readings, out = iter(clock_readings), io.StringIO()
    with os.fdopen(read_fd) as pipe:
        gpu_monitor.serve(serve_request(monkeypatch, nvml, 60.0), pipe, out, clock=lambda: next(readings))
    return json.loads(out.getvalue())


@pytest.mark.parametrize("counter", [True, False])
def test_the_window_s_energy_and_time_leave_a_paused_evaluation_out(monkeypatch, counter):
    """Steps from 0 s to 10 s, an evaluation to 25 s, steps to 30 s: 15 s of window. With a counter, its
    readings' increase over the two spans (SPANNED_ENERGY_J, not the 62 J of 0-30 s); without one, the two
    GPUs' 200 W each over the 15 s (not the 30 s)."""
    result = serve_all_at_once(monkeypatch, ServedNvml(counter), ["start", "pause", "resume", "stop"],
                               [0.0, 10.0, 25.0, 30.0])
    assert result["nvml_window_s"] == pytest.approx(15.0)
    energy_j = SPANNED_ENERGY_J if counter else 400.0 * 15.0
    assert result["energy_j"] == pytest.approx(energy_j)
    assert result["gpu_power_mean_w"] == pytest.approx(energy_j / 15.0)


def test_a_window_that_ends_paused_counts_up_to_the_pause(monkeypatch):
    """A pipe closed during an evaluation (the run stopped there): the span before it is the window."""
    nvml = ServedNvml()
    result = serve_all_at_once(monkeypatch, nvml, ["start", "pause"], [0.0, 10.0])
    assert result["nvml_window_s"] == pytest.approx(10.0)
    assert result["energy_j"] == pytest.approx(10.0 + 4.0)  # the first span's readings only
    assert nvml.counter_reads == 4  # nothing read again at the end


def wait_for(condition, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "the sampler did not act on the command"
        time.sleep(0.001)


def test_no_samples_are_taken_while_paused(monkeypatch):
    """Sampling every 5 ms, paused for 100 ms: none of the evaluation's utilisation or power reaches the figures."""
    nvml = ServedNvml()
    read_fd, write_fd = os.pipe()
    out = io.StringIO()
    with os.fdopen(read_fd) as pipe:
        served = threading.Thread(target=gpu_monitor.serve, args=(serve_request(monkeypatch, nvml, 0.005), pipe, out),
                                  daemon=True)
        served.start()
        os.write(write_fd, b"start\n")
        time.sleep(0.05)
        os.write(write_fd, b"pause\n")
        wait_for(lambda: nvml.counter_reads == 4)  # the span closed: both GPUs read at start and at pause
        nvml.evaluating = True
        time.sleep(0.1)
        nvml.evaluating = False
        os.write(write_fd, b"resume\n")
        time.sleep(0.05)
        os.write(write_fd, b"stop\n")
        served.join(timeout=5)
    os.close(write_fd)
    assert not served.is_alive()
    assert nvml.samples_while_evaluating == 0
    assert json.loads(out.getvalue())["nvml_samples"] >= 4  # the spans were sampled


def test_the_sampler_process_leaves_out_what_lies_between_pause_and_resume(monkeypatch, tmp_path):
    """Through the pipe: pause, resume and stop written back to back (read together, none may wait unseen)."""
    sampler = stand_in_sampler(monkeypatch, tmp_path, [0, 1], SPANNED_NVML_MODULE)
    sampler.start()
    time.sleep(0.05)
    sampler.pause()
    sampler.resume()
    assert sampler.stop()["energy_j"] == pytest.approx(SPANNED_ENERGY_J)


def test_a_pause_before_the_window_or_after_it_sends_nothing(monkeypatch, tmp_path):
    """The evaluation before training pauses a sampler not yet started: the process must not take that for
    the run ending before its window (its first line not "start")."""
    sampler = stand_in_sampler(monkeypatch, tmp_path, [0, 1])
    sampler.pause()
    sampler.resume()
    sampler.start()
    time.sleep(0.05)
    assert sampler.stop()["energy_j"] == pytest.approx(80.0)  # FAKE_NVML_MODULE's counters, start to stop
    sampler.pause()  # after the window: the process has ended, nothing to tell it
    sampler.resume()


def test_sampler_energy_from_the_driver_counter(monkeypatch):
    result, sampler = sample_with(monkeypatch, FakeNvml())
    assert result["energy_j"] == pytest.approx(80.0)  # (51000 - 1000 + 35000 - 5000) mJ, all GPUs of the run
    assert result["gpu_power_mean_w"] == pytest.approx(80.0 / sampler.duration_s)
    assert result["gpu_util_mean"] == pytest.approx(70.0)
    assert result["gpu_mem_used_peak_mb"] == 2048.0  # the fullest GPU, MiB
    assert result["nvml_samples"] >= 4


def test_sampler_energy_integrated_from_power_without_a_counter(monkeypatch):
    result, sampler = sample_with(monkeypatch, FakeNvml(counter=False))
    assert result["gpu_power_mean_w"] == pytest.approx(400.0)  # two GPUs at 200 W: summed, not averaged
    assert result["energy_j"] == pytest.approx(400.0 * sampler.duration_s)
    tokens = 1234
    assert energy_per_token({"energy_j": result["energy_j"], "measured_tokens": tokens}) == pytest.approx(
        result["energy_j"] / tokens)


# ---------------------------------------------------------------------------------------------------
# Columns: what a real run produces reaches the table


# Keys of metrics.json that are not table columns, each for a stated reason.
NOT_COLUMNS = {
    "window_s": "same value as measured_time_s (asserted below)",
    "memory_estimate_parts_mb": "nested breakdown of memory_estimate_mb",
    "evals": "the run's evaluations: rows of evals.parquet, taken out before metrics.json is written",
}


@pytest.fixture(scope="module")
def real_result(llama_data, tmp_path_factory):
    """A run through the train rule's entry point: (metrics.json content, collected table). With its base evaluation:
    its base_* figures are columns too."""
    spec = llama_spec(method="lora", lora_targets="all-linear", eval_before_training=True)
    out = tmp_path_factory.mktemp("run") / "metrics.json"
    previous = signal.getsignal(signal.SIGTERM)
    try:
        cli.train(["--spec", spec.to_json(), "--data", str(llama_data), "--out", str(out)])
    finally:
        signal.signal(signal.SIGTERM, previous)
    result = json.loads(out.read_text())
    table = collect.collect([out], out.with_name("metrics.parquet"), out.with_name("metrics.csv"))
    return result, table


@pytest.mark.slow
def test_every_metric_of_a_real_run_is_a_column(real_result):
    result, _ = real_result
    metrics = result["metrics"]
    assert metrics["status"] == "ok"
    missing = sorted(set(metrics) - set(COLUMNS) - set(NOT_COLUMNS))
    assert missing == [], f"metrics.json keys collect would drop: {missing}"
    assert metrics["window_s"] == metrics["measured_time_s"]
    assert {"base_eval_loss", "base_eval_perplexity", "base_eval_token_accuracy", "base_eval_time_s"} <= set(metrics)


@pytest.mark.slow
def test_collected_values_are_the_run_values(real_result):
    result, table = real_result
    row = table.iloc[0]
    for key, value in result["metrics"].items():
        if key not in COLUMNS:
            continue
        if value is None:
            assert pd.isna(row[key]), key
        elif isinstance(value, float):
            assert float(row[key]) == pytest.approx(value, rel=1e-12), key
        else:
            assert row[key] == value, key


@pytest.mark.slow
def test_memory_estimate_ratio_only_for_a_finished_run(real_result):
    """An OOM run's measured peak is where it failed, not the run's peak: no ratio for it."""
    from ftbench.report.columns import row_from_result

    result, _ = real_result
    assert row_from_result(result)["memory_estimate_ratio"] is None  # a CPU run: RSS is not what the estimate models
    on_gpu = {**result, "metrics": {**result["metrics"], "peak_memory_allocated_mb": 100.0}}
    assert row_from_result(on_gpu)["memory_estimate_ratio"] == pytest.approx(result["metrics"]["memory_estimate_mb"] / 100.0)
    failed = {**result, "metrics": {**on_gpu["metrics"], "status": "oom"}}
    assert row_from_result(failed)["memory_estimate_ratio"] is None


@pytest.mark.slow
def test_cpu_run_fills_its_measurements_and_leaves_gpu_ones_null(real_result):
    _, table = real_result
    row = table.iloc[0]
    for column in ("tokens_per_s", "tokens_per_s_per_device", "measured_tokens", "tflops_per_s",
                   "flops_per_step_analytic", "flops_counted_ratio", "loader_wait_fraction", "memory_estimate_mb",
                   "peak_rss_mb", "eval_peak_memory_mb", "eval_loss", "eval_perplexity"):
        assert pd.notna(row[column]) and row[column] > 0, column
    assert 0 <= row["eval_token_accuracy"] <= 1
    for column in ("gpu_util_mean", "gpu_mem_used_peak_mb", "gpu_power_mean_w", "energy_j", "energy_j_per_token",
                   "mfu", "peak_memory_allocated_mb", "peak_memory_reserved_mb"):
        assert pd.isna(row[column]), column  # null on a CPU, never 0
    assert row["nvml_samples"] == 0 and row["gpu_sample_interval_s"] == 0.5  # how it was (not) sampled
    assert pd.isna(row["memory_estimate_ratio"])  # the estimate models CUDA tensors, not a process's RSS
    assert row["eval_perplexity"] == pytest.approx(math.exp(row["eval_loss"]))


def test_flop_formulas_get_the_tensors_they_name_by_position():
    """aten.addmm.dtype_out, as Liger's fused linear cross-entropy calls it (out_dtype fourth, by position): the
    formula still counts the matmul, where it used to raise (out_shape given twice) and leave every Liger run
    without a cross-check."""
    from torch.utils.flop_counter import flop_registry

    bias, a, b = torch.zeros(3), torch.zeros(2, 4), torch.zeros(4, 3)
    op = torch.ops.aten.addmm.dtype_out
    formula = flop_registry[op._overloadpacket]
    positional, named = flops.formula_arguments(formula, op, (bias, a, b, torch.float32), {"out": bias})
    assert len(positional) == 3 and named == {"out": bias, "out_dtype": torch.float32}
    assert formula(*positional, **named, out_val=torch.zeros(2, 3)) == 2 * 2 * 4 * 3
    plain = torch.ops.aten.addmm.default
    assert flops.formula_arguments(formula, plain, (bias, a, b), {"beta": 1}) == ((bias, a, b), {"beta": 1})


def _tiny_classifier_batch(sequences: int, length: int, vocab: int) -> dict:
    generator = torch.Generator().manual_seed(0)
    return {"input_ids": torch.randint(0, vocab, (sequences, length), generator=generator),
            "attention_mask": torch.ones(sequences, length, dtype=torch.long),
            "labels": torch.randint(0, 2, (sequences,), generator=generator)}


def test_an_encoder_classifiers_pooled_heads_are_counted_once_per_sequence():
    """BERT's pooler and classifier see the first token only: counted per token, the analytic FLOPs of a 2-layer
    BERT (hidden 64) were 5% too many (flops_counted_ratio 0.9475; MiniLM's 1.3%, 0.987). Under LoRA peft keeps the
    untouched original classifier beside the trained copy and runs only the copy: it is not counted either."""
    from peft import LoraConfig, TaskType, get_peft_model
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    config = BertConfig(vocab_size=1000, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=128, max_position_embeddings=64, num_labels=2, hidden_dropout_prob=0.0,
                        attention_probs_dropout_prob=0.0)
    model = BertForSequenceClassification(config)
    shape = flops.ModelShape.of(model, registry.family("classification").pooled_heads)
    heads = model.bert.pooler.dense.weight.numel() + model.classifier.weight.numel()
    assert shape.pooled_linear_params == shape.pooled_trainable_linear_params == heads
    sequences, length = 4, 32
    inputs = _tiny_classifier_batch(sequences, length, config.vocab_size)
    no_autocast = {"device_type": "cpu", "enabled": False}
    counted = flops.counted_flops(model, inputs, no_autocast)
    analytic = flops.step_flops(shape, True, sequences * length, sequences * length**2, sequences=sequences)
    assert counted / analytic == pytest.approx(1.0, abs=0.002)
    per_token = flops.step_flops(flops.ModelShape(shape.linear_params, shape.linear_params, shape.layers, shape.width),
                                 True, sequences * length, sequences * length**2)
    assert counted / per_token < 0.96  # what counting the heads per token read

    lora = get_peft_model(model, LoraConfig(task_type=TaskType.SEQ_CLS, r=4, target_modules=["query", "value"]))
    assert any(".original_module" in name for name, _ in lora.named_modules())  # the copy peft keeps
    lora_shape = flops.ModelShape.of(lora, registry.family("classification").pooled_heads)
    adapters = sum(p.numel() for name, p in lora.named_parameters() if "lora_" in name)
    assert lora_shape.linear_params == shape.linear_params + adapters  # the classifier once, not twice
    assert lora_shape.pooled_linear_params == heads
    assert lora_shape.pooled_trainable_linear_params == model.classifier.weight.numel()  # the pooler stays frozen
    lora_counted = flops.counted_flops(lora, inputs, no_autocast)
    lora_analytic = flops.step_flops(lora_shape, False, sequences * length, sequences * length**2, sequences=sequences)
    # Lower than 1 by what autograd skips before the first adapted layer (flops.py: not modelled).
    assert 0.90 < lora_counted / lora_analytic < 1.0  # 0.921: half of this model's layers are the first


def test_a_vit_under_lora_counts_its_classifier_once_per_image():
    """Image classification has no peft task type: LoRA wraps a ViT in a plain PeftModel, whose name says nothing
    of classification (a first version read the class name and missed it). Its classifier, trained as a copy,
    still sees only the class token: once per image."""
    from peft import LoraConfig, get_peft_model
    from transformers import ViTConfig, ViTForImageClassification

    torch.manual_seed(0)
    config = ViTConfig(image_size=32, patch_size=8, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                       intermediate_size=128, num_labels=1000, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    vit = ViTForImageClassification(config)
    lora = get_peft_model(vit, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], modules_to_save=["classifier"]))
    shape = flops.ModelShape.of(lora, registry.family("image_classification").pooled_heads)
    assert shape.pooled_linear_params == shape.pooled_trainable_linear_params == vit.classifier.weight.numel()
    images, tokens = 2, (32 // 8) ** 2 + 1  # patches and the class token
    inputs = {"pixel_values": torch.randn(images, 3, 32, 32), "labels": torch.tensor([1, 2])}
    counted = flops.counted_flops(lora, inputs, {"device_type": "cpu", "enabled": False})
    analytic = flops.step_flops(shape, False, images * tokens, images * tokens**2, sequences=images)
    # Per token the 1000-class head made the analytic count twice the counted (0.47); once per image they agree
    # but for what autograd skips before the first adapted layer and the patch convolution (not counted).
    assert 0.9 < counted / analytic < 1.05
    with pytest.raises(ValueError, match="pass sequences"):  # a caller that forgets them would count 0 FLOPs for the heads
        flops.step_flops(shape, False, images * tokens, images * tokens**2)
