"""engine: hf_trainer (scripts/ftbench/train/hf_engine.py): the same run through transformers.Trainer, measured
by ftbench's own instrumentation. The promise tested: for one spec both engines train on the same batches
(same tokens, samples, step count, warmup and window), and the Trainer's own settings are recorded."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from ftbench.experiment import matrix
from ftbench.train import run_state, trainer
from ftbench.report.columns import COLUMNS

from test_measurement import llama_data, llama_spec  # noqa: F401 - the module-scoped tiny-Llama data fixture

COUNTS = ("step", "measured", "samples", "tokens", "padded_tokens", "flops")


@pytest.fixture(autouse=True)
def _two_threads():
    torch.set_num_threads(2)


def both_engines(spec, data_dir: Path) -> dict:
    """{engine: (metrics, steps)} of the same spec."""
    return {engine: trainer.train_run(spec.replace(engine=engine), data_dir) for engine in ("loop", "hf_trainer")}


def assert_same_run(results: dict) -> None:
    (loop, loop_steps), (hf, hf_steps) = results["loop"], results["hf_trainer"]
    assert loop["status"] == hf["status"] == "ok", (loop.get("status_reason"), hf.get("status_reason"))
    assert [{k: s[k] for k in COUNTS} for s in hf_steps] == [{k: s[k] for k in COUNTS} for s in loop_steps]
    for key in ("total_steps", "warmup_steps", "measured_steps", "measured_tokens", "grad_accum_steps", "padding_fraction"):
        assert hf[key] == loop[key], key
    # The window is the measured steps' time, by the same clock rule.
    measured = [s for s in hf_steps if s["measured"]]
    assert hf["window_s"] == pytest.approx(sum(s["step_time_s"] for s in measured))
    assert hf["tokens_per_s"] == pytest.approx(hf["measured_tokens"] / hf["window_s"])
    assert all(0 <= s["loader_s"] < s["step_time_s"] for s in hf_steps)
    assert math.isfinite(hf["final_train_loss"]) and "eval_loss" in hf


@pytest.mark.slow
def test_tiny_llama_sees_the_same_tokens_and_steps_in_both_engines(llama_data):  # noqa: F811
    results = both_engines(llama_spec(grad_accum_steps=2, max_steps=5), llama_data)
    assert_same_run(results)
    (loop, loop_steps), (hf, hf_steps) = results["loop"], results["hf_trainer"]
    # Same data, same initial weights, same optimizer and schedule: the same losses and learning rates (the
    # Trainer's clipping at 1.0 and its token-weighted loss do not move them here: equal-length sequences).
    assert [s["lr"] for s in hf_steps] == pytest.approx([s["lr"] for s in loop_steps])
    assert [s["loss"] for s in hf_steps] == pytest.approx([s["loss"] for s in loop_steps], rel=1e-3)
    assert (hf["hf_max_grad_norm"], hf["hf_optim"], hf["hf_lr_scheduler"], hf["hf_dataloader_workers"]) == (1.0, "adamw_torch", "linear", 0)
    assert loop.get("hf_optim") is None
    from test_measurement import NOT_COLUMNS

    assert sorted(set(hf) - set(COLUMNS) - set(NOT_COLUMNS)) == []  # collect keeps every figure


def recipe_seen_in_trainer_steps(monkeypatch) -> dict:
    """The dtypes inside transformers.Trainer's own steps, recorded by a callback every Trainer of the test gets:
    the frozen and trainable parameters' (and the gradients') before each optimizer step, and the autocast dtype
    the model's layers ran under (forward hooks on its submodules, on while the Trainer trains: accelerate wraps the
    model's own forward in autocast, so a hook on the model itself runs after autocast has ended)."""
    import transformers
    from ftbench.train.modeling import DTYPE_NAMES

    seen = {"frozen": set(), "trainable": set(), "autocast": set()}

    def name(dtype):
        return DTYPE_NAMES.get(dtype, str(dtype))

    class RecipeSeen(transformers.TrainerCallback):
        def on_train_begin(self, args, state, control, model=None, **kwargs):
            def forward_ran(*unused):
                seen["autocast"].add(name(torch.get_autocast_dtype("cpu")) if torch.is_autocast_enabled("cpu") else None)
            self.hooks = [module.register_forward_hook(forward_ran) for module in model.modules() if module is not model]

        def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
            for param in model.parameters():
                if param.requires_grad:
                    seen["trainable"].update({name(param.dtype), name(param.grad.dtype)})
                else:
                    seen["frozen"].add(name(param.dtype))

        def on_train_end(self, *unused, **kwargs):
            for hook in self.hooks:
                hook.remove()

    train = transformers.Trainer.train

    def train_with_recipe_seen(self, *args, **kwargs):
        self.add_callback(RecipeSeen())
        return train(self, *args, **kwargs)

    monkeypatch.setattr(transformers.Trainer, "train", train_with_recipe_seen)
    return seen


@pytest.mark.slow
def test_tiny_bert_classification_sees_the_same_tokens_and_steps(tiny_config_factory, prepared_data, capsys, monkeypatch):
    """Padded text (real lengths differ): the counted tokens are the unpadded ones, in both engines. Under bf16 both
    train LoRA's recipe: the frozen base in bf16 (not TrainingArguments' fp32 default), fp32 adapters and head; the
    Trainer's as its own steps saw it (a callback), which is what its row says."""
    seen = recipe_seen_in_trainer_steps(monkeypatch)
    config = tiny_config_factory(defaults={"method": "lora", "lora_targets": ["query", "value"], "batch_size": 4,
                                           "seq_len": 32, "max_steps": 4, "warmup_steps": 1, "lora_rank": 4,
                                           "precision": "bf16"},
                                 matrix={"model": ["tiny"], "dataset": ["tiny"]})
    (spec,) = matrix.expand_runs(config)
    results = both_engines(spec, prepared_data[0])
    assert_same_run(results)
    assert results["hf_trainer"][0]["padding_fraction"] > 0  # the batches were padded, and padding not counted
    # each engine's job logs its progress: the first line after its first step
    assert capsys.readouterr().out.count("progress: step 1 of 4") == 2
    for engine in ("loop", "hf_trainer"):
        metrics = results[engine][0]
        assert (metrics["recipe_frozen_dtype"], metrics["recipe_trainable_dtype"], metrics["recipe_autocast_dtype"]) == \
            ("bf16", "fp32", "bf16"), engine
    assert (seen["frozen"], seen["trainable"], seen["autocast"]) == ({"bf16"}, {"fp32"}, {"bf16"})


@pytest.mark.slow
@pytest.mark.parametrize("batching", ["group_by_length", "pack"])
def test_both_engines_batch_as_the_run_asks(batching, tiny_config_factory, prepared_data, llama_data):  # noqa: F811
    """The Trainer takes the run's batching too: the same grouped order, the same packed rows (and their
    capacity), not padded batches under a packed run's name."""
    if batching == "pack":
        spec, data_dir = llama_spec(batching="pack", max_steps=4), llama_data
    else:
        config = tiny_config_factory(defaults={"method": "full", "batch_size": 4, "seq_len": 32, "max_steps": 4,
                                               "warmup_steps": 1, "batching": batching},
                                     matrix={"model": ["tiny"], "dataset": ["tiny"]})
        (spec,) = matrix.expand_runs(config)
        data_dir = prepared_data[0]
    results = both_engines(spec, data_dir)
    assert_same_run(results)
    hf_steps = results["hf_trainer"][1]
    assert [s["capacity_tokens"] for s in hf_steps] == [s["capacity_tokens"] for s in results["loop"][1]]
    if batching == "pack":
        assert all(s["capacity_tokens"] > 0 for s in hf_steps)


@pytest.mark.slow
def test_timeout_through_the_callback(llama_data):  # noqa: F811
    """A deadline already past: the callback stops the Trainer after its first step, status timeout."""
    stop = run_state.StopSignal(deadline=0.0)
    metrics, steps = trainer.train_run(llama_spec(engine="hf_trainer", max_steps=5), llama_data, stop)
    assert metrics["status"] == "timeout" and len(steps) == 1
    assert "at step 1 of 5" in metrics["status_reason"]


@pytest.mark.slow
def test_diverged_loss_stops_before_the_update(monkeypatch, llama_data):  # noqa: F811
    """The Trainer computes the loss itself: a NaN is made where transformers' LM loss calls cross_entropy."""
    monkeypatch.setattr(torch.nn.functional, "cross_entropy", lambda *a, **k: torch.tensor(float("nan"), requires_grad=True))
    metrics, steps = trainer.train_run(llama_spec(engine="hf_trainer", max_steps=5), llama_data)
    assert metrics["status"] == "diverged" and metrics["diverged_step"] == 0 and steps == []


def test_data_parallel_is_refused_as_unsupported(llama_data):  # noqa: F811
    from ftbench.experiment import feasibility

    spec = llama_spec().replace(engine="hf_trainer", parallel="ddp", num_gpus=2)
    assert "parallel 'single' only" in feasibility.unsupported_reason(spec)
    metrics, steps = trainer.train_run(spec, llama_data)  # refused before anything is built
    assert metrics["status"] == "unsupported" and "parallel 'single' only" in metrics["status_reason"] and steps == []


@pytest.mark.parametrize("optimizer, device, expected", [
    ("adamw", "cpu", "adamw_torch"), ("sgd", "cpu", "sgd (momentum=0.9)"), ("adamw_8bit", "cpu", "adamw_bnb_8bit"),
])
def test_optimizer_mapping_is_recorded(tmp_path, optimizer, device, expected):
    """The loop's optimizers by the Trainer's names (CUDA: adamw -> adamw_torch_fused, as the loop fuses there)."""
    from ftbench.train import hf_engine

    args = hf_engine._arguments(llama_spec(optimizer=optimizer, lr_warmup_steps=2), 4, torch.device(device), str(tmp_path))
    settings = hf_engine.trainer_settings(args)
    assert settings["hf_optim"] == expected
    assert (settings["hf_max_grad_norm"], settings["hf_lr_scheduler"], args.warmup_steps, args.max_steps) == (1.0, "linear", 2, 4)
    assert args.report_to == [] and args.save_strategy == "no"  # no external services, no checkpoints
