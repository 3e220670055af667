"""RunSpec: the one list of run settings.

Every setting a run can have is a field of ``RunSpec`` with its default, its allowed values (a JSON
Schema fragment), a one-line doc, whether it is a column of ``results/metrics.parquet`` and how it shows
in the readable run name. Everything else is derived from this list:

- the experiment schema's ``run_settings`` and ``matrix`` blocks (``config.load_schema`` injects them);
- the spec columns of the Parquet table (``columns.COLUMNS``);
- the readable part of a run id (``readable_name``);
- which settings stop mattering under others (``normalise``: LoRA keys for full fine-tuning, ...).

Adding a knob is one field here plus the code that uses it. This module imports nothing heavy (no
torch), so validating a config at parse time stays fast.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from typing import Any, Callable

# The ways a generated answer is scored (tasks/generation.py, which imports this: the ground floor imports nothing).
ANSWER_METRICS = ("none", "exact_match", "contains", "regex")

# Bumping this changes every run id: do it when the meaning of a spec key changes.
SPEC_VERSION = 1


@dataclass(frozen=True)
class Setting:
    """What ftbench knows about one run setting (kept in the dataclass field's metadata)."""

    doc: str
    schema: dict  # JSON Schema of one value (matrix axes are lists of these)
    column: str | None = None  # pandas dtype of its metrics.parquet column; None: not a column
    # Part of the readable run name, or None when the setting adds nothing (e.g. at its usual value).
    name_part: Callable[["RunSpec"], str | None] | None = None
    # When this returns False for a run's settings, the setting has no effect and is normalised to None
    # (so runs that differ only in it share one id).
    applies: Callable[[dict], bool] | None = None
    # The same in words, for the warning when a setting is given but no run uses it ("method lora or qlora").
    applies_when: str | None = None
    # For a setting whose null stands for a value its run's settings decide (the run's precision, ...): that value.
    # normalise writes null and that value one way, so the two spellings of one recipe share one run id.
    null_means: Callable[[dict], Any] | None = None


def setting(default: Any, doc: str, schema: dict, column: str | None = None, name_part=None, applies=None,
            applies_when: str | None = None, null_means=None):
    meta = Setting(doc=doc, schema=schema, column=column, name_part=name_part, applies=applies,
                   applies_when=applies_when or APPLIES_WHEN.get(applies), null_means=null_means)
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: default, metadata={"setting": meta})
    return field(default=default, metadata={"setting": meta})


def _nullable(schema: dict) -> dict:
    return {"oneOf": [{"type": "null"}, schema]}


def _is_adapter(settings: dict) -> bool:
    return settings.get("method") != "full"


def _is_qlora(settings: dict) -> bool:
    return settings.get("method") == "qlora"


def _is_fsdp(settings: dict) -> bool:
    return settings.get("parallel") == "fsdp"




def _has_lora_base_choice(settings: dict) -> bool:
    return settings.get("method") == "lora" and settings.get("precision") in ("bf16", "fp16")


def _generates(settings: dict) -> bool:
    return settings.get("answer_metric", "none") != "none"


def _evaluates_during_training(settings: dict) -> bool:
    return settings.get("eval_every") is not None


APPLIES_WHEN = {_is_adapter: "method lora or qlora", _is_qlora: "method qlora", _is_fsdp: "parallel fsdp",
                _evaluates_during_training: "eval_every set", _has_lora_base_choice: "method lora with precision bf16 or fp16"}


LORA_TARGETS_SCHEMA = {
    "oneOf": [
        {"const": "all-linear"},
        {"type": "array", "minItems": 1, "items": {"type": "string", "minLength": 1}, "uniqueItems": True},
    ]
}


@dataclass(frozen=True)
class RunSpec:
    """One run: its settings (fields with a ``setting`` in their metadata) and its identity.

    A run spec is what a training job receives, as JSON (``to_json`` / ``from_json``). Settings come from
    the experiment's defaults, matrix, overrides and includes (``matrix.expand_runs``); the identity
    fields (``run_id``, ``config_id``, ``data_id``, the model and dataset definitions) are filled there.
    """

    # --- what is trained on what
    model: str = setting(None, "model name from the config", {"type": "string", "minLength": 1}, "string",
                         name_part=lambda s: s.model)
    dataset: str = setting(None, "dataset name from the config", {"type": "string", "minLength": 1}, "string",
                           name_part=lambda s: s.dataset)
    method: str = setting("lora", "full | lora | qlora (4-bit base via bitsandbytes + LoRA)",
                          {"enum": ["full", "lora", "qlora"]}, "string", name_part=lambda s: s.method)
    lora_rank: int = setting(8, "LoRA rank r; null for full fine-tuning", {"type": "integer", "minimum": 1, "maximum": 4096},
                             "Int64", name_part=lambda s: f"r{s.lora_rank}" if s.method != "full" else None,
                             applies=_is_adapter)
    qlora_quant_type: str = setting("nf4", "nf4 | fp4 (QLoRA only)", {"enum": ["nf4", "fp4"]}, "string",
                                    name_part=lambda s: s.qlora_quant_type if s.method == "qlora" and s.qlora_quant_type != "nf4" else None,
                                    applies=_is_qlora)
    qlora_double_quant: bool = setting(True, "QLoRA double quantisation of the quantisation constants", {"type": "boolean"},
                                       "boolean", name_part=lambda s: "nodq" if s.method == "qlora" and not s.qlora_double_quant else None,
                                       applies=_is_qlora)
    precision: str = setting(
        "fp32", "fp32 | fp16 | bf16 (the forward pass under autocast in that dtype: full fine-tuning keeps fp32 master "
        "weights and optimizer state; LoRA keeps its frozen base in that dtype (lora_base_dtype) and fp32 adapters; QLoRA "
        "computes its 4-bit base in it) | bf16_true (weights, gradients and optimizer state themselves in bf16, "
        "no autocast: half the memory per parameter and no per-step casts, but updates smaller than bf16's resolution "
        "are lost; full and lora, not fsdp)",
        {"enum": ["fp32", "fp16", "bf16", "bf16_true"]}, "string", name_part=lambda s: s.precision)
    batch_size: int = setting(32, "samples per optimizer step on each device (with auto_batch_size: the batch found and measured)",
                              {"type": "integer", "minimum": 1, "maximum": 65536}, "Int64", name_part=lambda s: f"b{s.batch_size}")
    seq_len: int = setting(128, "maximum tokens per sample (longer texts are truncated)",
                           {"type": "integer", "minimum": 8, "maximum": 1048576}, "Int64", name_part=lambda s: f"s{s.seq_len}")
    grad_accum_steps: int = setting(1, "micro-batches per optimizer step", {"type": "integer", "minimum": 1, "maximum": 4096},
                                    "Int64", name_part=lambda s: f"ga{s.grad_accum_steps}" if s.grad_accum_steps > 1 else None)
    optimizer: str = setting("adamw", "adamw (fused on CUDA) | adamw_8bit | paged_adamw_8bit (bitsandbytes) | sgd",
                             {"enum": ["adamw", "adamw_8bit", "paged_adamw_8bit", "sgd"]}, "string",
                             name_part=lambda s: s.optimizer if s.optimizer != "adamw" else None)
    gradient_checkpointing: bool = setting(False, "activation recomputation on", {"type": "boolean"}, "boolean",
                                           name_part=lambda s: "gc" if s.gradient_checkpointing else None)
    auto_batch_size: bool = setting(
        False, "batch_size searched before measuring: the largest that fits, found by trying (batch_size is where the search starts)",
        {"type": "boolean"}, "boolean", name_part=lambda s: "autobs" if s.auto_batch_size else None)
    confirm_oom: bool = setting(
        False, "run it on a GPU where the memory estimate predicts it will not fit (to confirm the oom; otherwise the row is "
        "oom, predicted, and nothing is launched)", {"type": "boolean"}, "boolean",
        name_part=lambda s: "confirmoom" if s.confirm_oom else None)
    compile: bool = setting(False, "torch.compile on", {"type": "boolean"}, "boolean",
                            name_part=lambda s: "compiled" if s.compile else None)
    batching: str = setting(
        "pad", "how rows become batches: pad (to the batch's longest row) | group_by_length (similar lengths batched "
        "together within a seeded shuffle) | pack (several sequences per row up to seq_len, attention kept inside each) "
        "| padding_free (one row of all the batch's sequences, no padding; needs an attention that takes sequence bounds)",
        {"enum": ["pad", "group_by_length", "pack", "padding_free"]}, "string",
        name_part=lambda s: {"group_by_length": "grouped", "pack": "packed", "padding_free": "padfree"}.get(s.batching))
    loss_on: str | None = setting(
        "completion", "instruction data: the tokens the loss is computed on. completion (the completion of prompt-completion "
        "rows, the assistant turns of conversations: TRL's completion_only_loss, and its assistant_only_loss, which TRL "
        "leaves off by default) | all (every token but each row's first); evaluation scores the completion tokens "
        "either way. Null for other tasks",
        {"enum": [None, "completion", "all"]}, "string", name_part=lambda s: "lossall" if s.loss_on == "all" else None)
    kernels: str = setting("none", "fused-kernel library patched into the model: none | liger (Liger kernels: fused RMSNorm, "
                           "SwiGLU, RoPE, cross-entropy for Llama-family models; GPU only)",
                           {"enum": ["none", "liger"]}, "string",
                           name_part=lambda s: s.kernels if s.kernels != "none" else None)
    engine: str = setting("loop", "what runs the steps: loop (ftbench's own PyTorch loop) | hf_trainer (transformers.Trainer "
                          "with ftbench's measurements attached through callbacks)", {"enum": ["loop", "hf_trainer"]}, "string",
                          name_part=lambda s: "hftrainer" if s.engine == "hf_trainer" else None)
    data_source: str = setting("memory", "memory (shards decoded into RAM before training) | disk (rows read per batch)",
                               {"enum": ["memory", "disk"]}, "string",
                               name_part=lambda s: "disk" if s.data_source == "disk" else None)
    parallel: str = setting(
        "single", "single | dp (DataParallel) | ddp (DistributedDataParallel through torchrun) | fsdp (FSDP2 fully_shard: "
        "parameters, gradients and optimizer state sharded over the run's GPUs, launched like ddp)",
        {"enum": ["single", "dp", "ddp", "fsdp"]}, "string",
        name_part=lambda s: f"{s.parallel}{s.num_gpus}" if s.parallel != "single" else None)
    fsdp_reshard_after_forward: bool = setting(
        True, "fsdp: free each layer's gathered parameters after its forward pass (less memory, one more all-gather in "
        "backward); false keeps them until backward", {"type": "boolean"}, "boolean",
        name_part=lambda s: "noreshard" if s.parallel == "fsdp" and not s.fsdp_reshard_after_forward else None,
        applies=_is_fsdp)
    fsdp_cpu_offload: bool = setting(
        False, "fsdp: keep parameters, gradients and optimizer state in host memory between uses (fits larger models, "
        "slower)", {"type": "boolean"}, "boolean",
        name_part=lambda s: "offload" if s.parallel == "fsdp" and s.fsdp_cpu_offload else None,
        applies=_is_fsdp)
    fsdp_reduce_dtype: str | None = setting(
        None, "fsdp: dtype of the gradient reduce-scatter (null: the run's precision; fp32 for exact reductions of 16-bit "
        "gradients)", {"enum": [None, "fp32", "bf16", "fp16"]}, "string",
        applies=_is_fsdp, null_means=lambda settings: compute_dtype(settings["precision"]))
    num_gpus: int = setting(1, "GPUs per node the run asks for (0: CPU); with no GPU visible a 1-GPU run falls back to the CPU",
                            {"type": "integer", "minimum": 0, "maximum": 64}, "Int64")
    num_nodes: int = setting(1, "nodes of a ddp/fsdp run (SLURM only): one torchrun per node, num_gpus on each",
                             {"type": "integer", "minimum": 1, "maximum": 1024}, "Int64",
                             name_part=lambda s: f"n{s.num_nodes}" if s.num_nodes > 1 else None)

    # --- LoRA / QLoRA details
    lora_alpha: float | None = setting(None, "LoRA scaling alpha (null: 2 x rank); null for full fine-tuning",
                                       _nullable({"type": "number", "exclusiveMinimum": 0}), "Float64", applies=_is_adapter,
                                       null_means=lambda settings: 2 * settings["lora_rank"])
    lora_dropout: float = setting(0.05, "dropout on the LoRA branch", {"type": "number", "minimum": 0, "maximum": 0.9},
                                  applies=_is_adapter)
    lora_targets: Any = setting("all-linear", "module names to adapt, or all-linear", LORA_TARGETS_SCHEMA, applies=_is_adapter)
    lora_base_dtype: str | None = setting(
        "compute", "LoRA under bf16/fp16: dtype of the frozen base weights. compute (the run's 16-bit dtype, with fp32 "
        "adapters under autocast: PEFT's convention, as Axolotl, LLaMA-Factory, Unsloth and torchtune run it) | fp32 (an "
        "fp32 base under autocast, TRL's SFTTrainer default for a bare model id: twice the base's memory)",
        {"enum": [None, "compute", "fp32"]}, "string",
        name_part=lambda s: "fp32base" if s.lora_base_dtype == "fp32" else None, applies=_has_lora_base_choice,
        null_means=lambda settings: "compute")
    qlora_compute_dtype: str | None = setting(None, "QLoRA compute dtype; null: the run's precision",
                                              {"enum": [None, "fp32", "fp16", "bf16"]}, "string", applies=_is_qlora,
                                              null_means=lambda settings: compute_dtype(settings["precision"]))

    # --- optimisation
    learning_rate: float = setting(5e-4, "peak learning rate", {"type": "number", "exclusiveMinimum": 0, "maximum": 1}, "Float64")
    lr_warmup_steps: int = setting(0, "linear learning-rate warmup steps, then linear decay to 0", {"type": "integer", "minimum": 0})
    weight_decay: float = setting(0.0, "AdamW / SGD weight decay", {"type": "number", "minimum": 0, "maximum": 1})
    epochs: float | None = setting(1, "passes over the training split (ignored when max_steps is set)",
                                   {"type": "number", "exclusiveMinimum": 0, "maximum": 1000},
                                   applies=lambda settings: settings.get("max_steps") is None,
                                   applies_when="max_steps is null")
    max_steps: int | None = setting(None, "optimizer steps of the run, warmup included (null: epochs decide)",
                                    _nullable({"type": "integer", "minimum": 1}))
    seed: int = setting(0, "random seed of this repeat (the configured seed + repeat index)", {"type": "integer", "minimum": 0}, "Int64")

    # --- how it runs and is measured
    attn_implementation: str | None = setting(
        None, "attention kernel asked for (sdpa | eager | flex_attention | flash_attention_2); null: the model's default",
        {"enum": [None, "sdpa", "eager", "flex_attention", "flash_attention_2"]}, "string",
        name_part=lambda s: s.attn_implementation)
    auto_batch_size_max: int | None = setting(
        1024, "largest per-device batch auto_batch_size tries; null without auto_batch_size",
        {"type": "integer", "minimum": 1, "maximum": 65536}, "Int64",
        applies=lambda settings: bool(settings.get("auto_batch_size")), applies_when="auto_batch_size true")
    device: str = setting("auto", "auto: the GPUs asked for, or the CPU for a 1-GPU run on a machine without one | cpu | cuda",
                          {"enum": ["auto", "cpu", "cuda"]})
    warmup_steps: int = setting(3, "first steps run but excluded from timing (allocator growth, autotuning, compilation)",
                                {"type": "integer", "minimum": 0, "maximum": 100000})
    warmup_until_stable: bool = setting(
        False, "extend warmup past warmup_steps until step times settle (up to warmup_max_steps); the steps it took are "
        "recorded", {"type": "boolean"}, "boolean", name_part=lambda s: "stablewarmup" if s.warmup_until_stable else None)
    warmup_max_steps: int | None = setting(
        None, "with warmup_until_stable: the most warmup steps (null: half the run)", _nullable({"type": "integer", "minimum": 1}),
        applies=lambda settings: bool(settings.get("warmup_until_stable")), applies_when="warmup_until_stable true")
    image_size: int | None = setting(
        None, "image + text models: side of the square images the processor makes (null: the processor's own)",
        _nullable({"type": "integer", "minimum": 8, "maximum": 4096}), "Int64",
        name_part=lambda s: f"i{s.image_size}" if s.image_size else None)
    eval_batch_size: int = setting(64, "samples per evaluation batch", {"type": "integer", "minimum": 1})
    max_eval_samples: int | None = setting(None, "eval examples scored: a seeded stratified sample of the eval split, the same rows for every run (null: the whole eval split)",
                                           _nullable({"type": "integer", "minimum": 1}))
    eval_every: int | None = setting(
        None, "evaluate every N optimizer steps during training (and once before the first; on the whole split with "
        "eval_before_training), on eval_subset examples, with the clock paused: the measured window and its tokens/s "
        "exclude it; null: only the final evaluation",
        _nullable({"type": "integer", "minimum": 1}), "Int64")
    eval_subset: int | None = setting(
        256, "with eval_every: examples of the fixed seeded eval subset each evaluation during training scores (the same "
        "examples for every run; null: the whole eval split); the final evaluation scores the whole eval split",
        _nullable({"type": "integer", "minimum": 1}), "Int64", applies=_evaluates_during_training)
    stop_at_target: bool = setting(
        False, "with eval_every and the experiment's target: stop once an evaluation during the measured window reaches the "
        "target (status stays ok; stopped_at_target says so)", {"type": "boolean"}, "boolean",
        name_part=lambda s: "stopattarget" if s.stop_at_target else None)
    # No name part: the run trains exactly as without it (the evaluation is off the clock and changes no weights).
    eval_before_training: bool = setting(
        False, "evaluate the model as built before the first step, off the clock (its time: base_eval_time_s), on "
        "the final evaluation's examples (the whole eval split, or max_eval_samples of it), so base_eval_* and eval_* compare "
        "the same examples: whether fine-tuning helped. Scored once per starting model (results/base_eval/) and shared by "
        "every run, experiment and re-run that starts from the same weights: full fine-tuning and LoRA of one base and "
        "dtype share one, QLoRA's 4-bit base has its own; fsdp runs score their own. With eval_every it is the step-0 "
        "evaluation, in place of the subset one",
        {"type": "boolean"}, "boolean")
    # Scoring by generation (tasks/generation.py): settings of the run, as the other evaluation settings are, so they
    # sweep, show in the row and key the shared base evaluation; per dataset through `overrides: when: {dataset: ..}`.
    answer_metric: str = setting(
        "none", "instruction data: score what the model generates on the held-out prompts (greedy, KV cache, left-padded "
        "batches) against the reference completion, after normalisation (stripped, case-folded, whitespace runs as one "
        "space, trailing punctuation dropped): exact_match | contains (the reference inside the answer) | regex "
        "(answer_regex's answer in both) | none (no generation). Its figure: eval_generation_score, beside eval_loss and "
        "eval_token_accuracy on the completion tokens; its time apart (eval_generation_s), never training's",
        {"enum": list(ANSWER_METRICS)}, "string")
    answer_regex: str | None = setting(
        None, "answer_metric regex: the pattern whose first match is the answer (its group, or the whole match without "
        "one), e.g. '#### (\\d+)'; a generated text it does not match counts as wrong",
        _nullable({"type": "string", "minLength": 1}), "string",
        applies=lambda settings: settings.get("answer_metric") == "regex", applies_when="answer_metric regex")
    max_new_tokens: int | None = setting(
        32, "with answer_metric: the most tokens generated per answer (it ends sooner at the end-of-sequence or the "
        "template's end-of-turn token)", {"type": "integer", "minimum": 1, "maximum": 65536}, "Int64",
        applies=_generates, applies_when="answer_metric not none")
    # A measuring knob, but part of the spec so the run records how it was measured. 0.5 s: at 0.1 s an
    # H100 run lost 3.5% of its throughput to sampling (scripts/benchmark_overhead.py); the driver averages
    # utilisation over 1/6 to 1 s anyway, and energy comes from the driver's counter whatever the interval.
    gpu_sample_interval_s: float = setting(0.5, "seconds between NVML samples (utilisation, memory, power)",
                                           {"type": "number", "minimum": 0.01, "maximum": 10}, "Float64")

    # --- identity: filled by matrix.make_spec, not settable in a config
    repeat: int = 0
    spec_version: int = SPEC_VERSION
    model_def: dict = field(default_factory=dict)
    dataset_def: dict = field(default_factory=dict)
    data_id: str = ""
    # The experiment's quality target {metric, value}, for a run that stops at it (stop_at_target); None otherwise,
    # so changing the target re-trains only the runs it can stop.
    target: dict | None = None
    config_id: str = ""
    run_id: str = ""

    # --- conversions
    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_dict(cls, values: dict) -> "RunSpec":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"run spec: unknown keys {unknown}; this ftbench knows {sorted(known)}")
        return cls(**values)

    @classmethod
    def from_json(cls, text: str) -> "RunSpec":
        return cls.from_dict(json.loads(text))

    def replace(self, **changes) -> "RunSpec":
        return dataclasses.replace(self, **changes)

    # --- derived facts used by the trainer, the resource estimate and the cost model alike
    @property
    def uses_gpu(self) -> bool:
        """The run asks a scheduler for GPUs (a CPU run asks for none)."""
        return self.num_gpus > 0 and self.device != "cpu"

    @property
    def packed(self) -> bool:
        """Rows hold several sequences (batching pack or padding_free): a batch's size follows the lengths drawn."""
        return self.batching in ("pack", "padding_free")

    @property
    def devices(self) -> int:
        """Devices that train together: all GPUs of a dp/ddp/fsdp run (on every node), else one."""
        if self.parallel == "dp":
            return max(1, self.num_gpus)
        if self.parallel in ("ddp", "fsdp"):
            return max(1, self.num_gpus) * self.num_nodes
        return 1

    @property
    def processes(self) -> int:
        """Processes of the run: one per device for ddp/fsdp (on every node), else one."""
        return max(1, self.num_gpus) * self.num_nodes if self.parallel in ("ddp", "fsdp") else 1

    @property
    def distributed(self) -> bool:
        """One process per device, started by torchrun (ddp, fsdp)."""
        return self.parallel in ("ddp", "fsdp")

    @property
    def examples_per_step(self) -> int:
        """Training examples of one optimizer step (global batch)."""
        return self.batch_size * self.devices * self.grad_accum_steps

    @property
    def task(self) -> str:
        return self.model_def.get("task", "classification")

    def auto_batch_size_cap(self, train_examples: int) -> int:
        """The largest per-device batch auto_batch_size may try: auto_batch_size_max, and no more than one
        optimizer step's worth of the training split."""
        data_cap = train_examples // (self.devices * self.grad_accum_steps)
        return max(1, min(self.auto_batch_size_max or AUTO_BATCH_SIZE_MAX, data_cap))

    def planned_steps(self, train_examples: int) -> int:
        """Optimizer steps of the run, warmup included: max_steps, or epochs over the training split.

        An epoch is the whole global batches the split holds (the last incomplete one is dropped, so every
        step has the same shape). The trainer plans with the split's real size; the resource estimate
        with the dataset's train_size (or a default), so both count steps the same way.
        """
        steps_per_epoch = train_examples // self.examples_per_step
        if steps_per_epoch == 0:
            raise ValueError(
                f"one optimizer step needs {self.examples_per_step} examples (batch_size x devices x grad_accum_steps) "
                f"but the training split has {train_examples}"
            )
        if self.max_steps is not None:
            return self.max_steps
        return max(1, math.ceil(self.epochs * steps_per_epoch))


def compute_dtype(precision: str) -> str:
    """The dtype a precision computes in ("fp32", "fp16", "bf16"): its autocast dtype, or its weights' (bf16_true)."""
    return "bf16" if precision == "bf16_true" else precision


def settings_fields() -> list[dataclasses.Field]:
    """The fields of RunSpec that are run settings (in declaration order)."""
    return [f for f in dataclasses.fields(RunSpec) if "setting" in f.metadata]


# Settings a run has when neither `defaults` nor the matrix gives them (model and dataset have none).
RUN_DEFAULTS: dict[str, Any] = {
    f.name: (f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default)
    for f in settings_fields()
    if f.name not in ("model", "dataset")
}

# The largest per-device batch auto_batch_size tries unless the run sets auto_batch_size_max.
AUTO_BATCH_SIZE_MAX = RUN_DEFAULTS["auto_batch_size_max"]


def run_settings_schema() -> dict:
    """JSON Schema of one run's settings (``defaults``, ``include`` entries, ``overrides``)."""
    properties = {}
    for f in settings_fields():
        meta = f.metadata["setting"]
        properties[f.name] = {**meta.schema, "description": meta.doc}
    return {
        "description": "Settings of one run. In `defaults` each is a single value; in `matrix` a non-empty list of values.",
        "type": "object",
        "additionalProperties": False,
        "properties": properties,
    }


def matrix_schema() -> dict:
    """JSON Schema of the ``matrix`` block: each setting as a non-empty list of allowed values."""
    properties = {}
    for f in settings_fields():
        meta = f.metadata["setting"]
        axis = {"type": "array", "minItems": 1, "items": meta.schema, "description": meta.doc}
        if f.name != "lora_targets":  # lists of lists: uniqueness of unhashable items is not worth it
            axis["uniqueItems"] = True
        properties[f.name] = axis
    return {
        "description": "Axes. Each key takes a non-empty list; one run per combination of all axes.",
        "type": "object",
        "additionalProperties": False,
        "required": ["model", "dataset"],
        "properties": properties,
    }


def spec_columns() -> dict[str, tuple[str, str]]:
    """Parquet columns copied from the run spec: name -> (pandas dtype, meaning)."""
    columns = {f.name: (f.metadata["setting"].column, f.metadata["setting"].doc)
               for f in settings_fields() if f.metadata["setting"].column}
    columns["repeat"] = ("Int64", "repeat index of this configuration (0-based)")
    return columns


def normalise(settings: dict) -> dict:
    """Drop what does not affect a run, and write each setting's null and what it stands for one way, so that
    equivalent runs share one id."""
    settings = dict(settings)
    for f in settings_fields():
        meta = f.metadata["setting"]
        if meta.applies is not None and not meta.applies(settings):
            settings[f.name] = None
        elif meta.null_means is not None and settings[f.name] in (None, meta.null_means(settings)):
            # The default's spelling, which earlier ids were hashed with: null where the default is null.
            settings[f.name] = None if f.default is None else meta.null_means(settings)
    if settings["method"] != "full" and settings["lora_alpha"] is None:
        settings["lora_alpha"] = 2 * settings["lora_rank"]  # the common choice that keeps the update scale stable
    if settings["parallel"] == "single":
        settings["num_gpus"] = min(settings["num_gpus"], 1)
    return settings


def readable_name(spec: RunSpec, repeats: int = 1) -> str:
    """``minilm-rt-lora-r8-fp32-b32-s64``: the settings that tell runs apart, in field order."""
    parts = []
    for f in settings_fields():
        part = f.metadata["setting"].name_part
        value = part(spec) if part else None
        if value is not None:
            parts.append(str(value))
    if repeats > 1:
        parts.append(f"rep{spec.repeat}")
    return "-".join(parts)
