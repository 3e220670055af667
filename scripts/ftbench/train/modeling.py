"""Build the model a run asks for: full fine-tuning, LoRA (peft) or QLoRA (bitsandbytes 4-bit + LoRA).

The dtype of every weight follows the run's recipe (ftbench/recipe.py): the weights are loaded, or built from a
config, directly in the dtype they train in (a LoRA run's frozen base in its 16-bit compute dtype, so no fp32 copy
of the base exists at any point), and every trainable parameter is then made the recipe's trainable dtype (fp32
adapters and heads, as peft's autocast_adapter_dtype makes adapters). Precision bf16/fp16 is autocast around the
forward pass; QLoRA's 4-bit base weights compute in the run's dtype.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import safetensors.torch
import torch

from ftbench.data.sources import load_failure, local_model_config, pretrained_args
from ftbench.data.tokenizers import SYNTHETIC_PAD_ID, load_tokenizer
from ftbench.errors import ConfigError, SourceError, UnsupportedConfiguration, describe
from ftbench.recipe import lora_base_in_compute_dtype, recipe_of
from ftbench.runspec import RunSpec, compute_dtype
from ftbench.tasks.base import TaskFamily
from ftbench.tasks.registry import model_family
from ftbench.train import fsdp

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}

# Output heads stay out of 4-bit quantisation: a new classification head has no quantisation state
# (its forward pass fails), and quantising the LM head hurts quality for little memory. Naming any
# skip list replaces transformers' default (which skips lm_head), so lm_head is listed too.
# transformers matches these against the start or end of a module's name, so BERT's pooler is named by
# its layer ("pooler.dense").
OUTPUT_HEADS = ["classifier", "pooler", "pooler.dense", "score", "lm_head"]


def package_available(name: str) -> bool:
    return importlib.util.find_spec(name) is not None


def import_problem(module: str) -> str | None:
    """Why ``module`` cannot be imported here (one line, its root cause), or None when it imports. Finding the
    package is not enough: an installed package whose own dependency is missing is found, then fails when the
    run first uses it, after the model was built (seen on a GPU host: transformers.Trainer, with datasets
    installed but not its dependency multiprocess)."""
    try:
        importlib.import_module(module)
    except Exception as exc:  # noqa: BLE001 - any failure to import is the answer
        return describe(exc)
    return None


def _require(module: str, package: str, needed_for: str, importing: bool, where_listed: str = "") -> None:
    """UnsupportedConfiguration unless ``module`` (of pip package ``package``) is installed and, when ``importing``,
    imports: not installed, or installed and broken, each said as such."""
    if not package_available(module.split(".")[0]):
        raise UnsupportedConfiguration(f"{needed_for} needs the {package} package, which is not installed{where_listed}")
    problem = import_problem(module) if importing else None
    if problem:
        raise UnsupportedConfiguration(f"{needed_for} needs {module}, which is installed but cannot be imported here: {problem}")


@dataclass
class BuiltModel:
    model: torch.nn.Module
    trainable_params: int
    total_params: int
    recipe_columns: dict  # the row's recipe columns, the dtypes read from the model as built (recipe_as_built)


DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}


def recipe_as_built(model: torch.nn.Module, spec: RunSpec) -> dict:
    """The row's recipe columns, with the frozen and trainable dtypes read from the built model's parameters rather
    than from what the recipe intends: a row says what was measured. A 4-bit base names its quantisation type."""
    columns = recipe_of(spec).columns()
    frozen = {DTYPE_NAMES.get(p.dtype, str(p.dtype)) for p in model.parameters()
              if not p.requires_grad and getattr(p, "quant_state", None) is None}
    if any(getattr(p, "quant_state", None) is not None for p in model.parameters()):
        frozen = {spec.qlora_quant_type}
    trainable = {DTYPE_NAMES.get(p.dtype, str(p.dtype)) for p in model.parameters() if p.requires_grad}
    columns["recipe_frozen_dtype"] = "+".join(sorted(frozen)) if frozen else None
    columns["recipe_trainable_dtype"] = "+".join(sorted(trainable)) if trainable else None
    return columns


def count_parameters(model: torch.nn.Module) -> tuple[int, int]:
    """(trainable, total); 4-bit weights are counted as the parameters they stand for, not packed bytes."""
    trainable = total = 0
    for param in model.parameters():
        quant_state = getattr(param, "quant_state", None)
        count = int(torch.Size(quant_state.shape).numel()) if quant_state is not None else param.numel()
        total += count
        if param.requires_grad:
            trainable += count
    return trainable, total


def check_supported(spec: RunSpec, device: torch.device, importing: bool = True) -> None:
    """Raise UnsupportedConfiguration, with the reason, for what this machine cannot run. These are the
    checks that need the job's device and installed packages, so they run in the job, not at parse time
    (experiment.config.check_run has every rule that a config alone decides). ``importing``: also import the
    packages the run needs; off in a DDP launcher, where importing bitsandbytes would initialise CUDA in a process
    that trains nothing (its ranks check again, importing, before they build the model)."""
    if spec.precision == "fp16" and device.type == "cpu":
        raise UnsupportedConfiguration("fp16 training needs a CUDA GPU (CPU autocast has no fp16 GradScaler path)")
    needs_bnb = spec.method == "qlora" or spec.optimizer in BNB_OPTIMIZERS
    if needs_bnb:
        _require("bitsandbytes", "bitsandbytes", f"{spec.method}/{spec.optimizer}", importing)
    if spec.engine == "hf_trainer":
        _require("transformers.trainer", "transformers", "engine hf_trainer", importing)
    if spec.optimizer == "paged_adamw_8bit" and device.type != "cuda":
        raise UnsupportedConfiguration("paged 8-bit AdamW pages optimizer state between GPU and host memory: needs a CUDA GPU")
    if compute_dtype(spec.precision) == "bf16" and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise UnsupportedConfiguration(f"{torch.cuda.get_device_name(device)} does not support bf16")
    if spec.fsdp_cpu_offload and spec.parallel == "fsdp" and device.type != "cuda":
        raise UnsupportedConfiguration("fsdp_cpu_offload moves shards between a GPU and host memory: needs a CUDA GPU")
    if spec.parallel == "fsdp" and lora_base_in_compute_dtype(spec) and not fsdp.mixes_frozen_dtypes():
        raise UnsupportedConfiguration(
            f"fsdp with a {spec.precision} LoRA base and fp32 adapters needs a torch whose FSDP2 shards frozen and "
            f"trainable parameters of different dtypes together (torch {torch.__version__} does not); set "
            "lora_base_dtype: fp32, or use ddp")
    if spec.parallel == "dp" and device.type != "cuda":
        raise UnsupportedConfiguration("DataParallel splits batches over CUDA GPUs; on a CPU use ddp (gloo processes)")
    if spec.compile and spec.parallel == "dp":
        raise UnsupportedConfiguration("torch.compile is not combined with DataParallel (it recompiles per replica); use ddp")
    if spec.kernels == "liger" and device.type != "cuda":
        raise UnsupportedConfiguration("kernels: liger runs Triton kernels, which need a CUDA GPU")
    if spec.kernels == "liger":
        _require("liger_kernel.transformers", "liger-kernel", "kernels: liger", importing, " (requirements-gpu.txt)")
    if spec.attn_implementation == "flash_attention_2" and device.type != "cuda":
        raise UnsupportedConfiguration("attn_implementation: flash_attention_2 needs a CUDA GPU")
    if spec.attn_implementation == "flash_attention_2":
        _require("flash_attn", "flash-attn", "attn_implementation: flash_attention_2", importing)
    if spec.attn_implementation == "flex_attention" and device.type != "cuda":
        # flex attention compiles its kernel with Inductor; on a CPU that compile costs more than the run measures.
        raise UnsupportedConfiguration("attn_implementation: flex_attention is measured on CUDA GPUs only")


BNB_OPTIMIZERS = ("adamw_8bit", "paged_adamw_8bit")


def build_model(spec: RunSpec, num_labels: int | None, device: torch.device, pad_token_id: int | None = None,
                vocab_size: int | None = None) -> BuiltModel:
    """The model for one run, on ``device``, with adapters and checkpointing applied.

    ``pad_token_id``: the prepared data's (its manifest has it); without it the tokenizer is loaded to find it.
    ``vocab_size``: the tokenizer's (the manifest has it); a config-built model takes it as its vocabulary.
    """
    family = model_family(spec.model_def)
    kwargs = family.model_kwargs(num_labels)
    if spec.attn_implementation:
        kwargs["attn_implementation"] = spec.attn_implementation
    quantised = {}
    if spec.method == "qlora":
        # bitsandbytes quantises while loading, onto the device it loads to.
        quantised = {
            "quantization_config": _bnb_config(spec),
            # a bare "cuda" is the current GPU (transformers takes a device map's None for no device at all)
            "device_map": {"": (torch.cuda.current_device() if device.index is None else device.index)
                           if device.type == "cuda" else "cpu"},
        }
    if spec.model_def["source"]["kind"] == "config":
        model = _model_from_config(spec, family, kwargs, quantised, device, vocab_size)
    else:
        model = _model_from_checkpoint(spec, family, kwargs, quantised)
    if family.modality == "text" and model.config.pad_token_id is None:
        if pad_token_id is None:
            tokenizer = load_tokenizer(spec.model_def)
            pad_token_id = tokenizer.pad_token_id if tokenizer is not None else SYNTHETIC_PAD_ID
        model.config.pad_token_id = pad_token_id
    model = _prepare_for_training(model, spec)
    if spec.method in ("lora", "qlora"):
        model = _add_lora(model, spec, family)
    trainables_in_recipe_dtype(model, spec)
    if spec.method != "qlora":
        model = model.to(device)
    trainable, total = count_parameters(model)
    return BuiltModel(model=model, trainable_params=trainable, total_params=total,
                      recipe_columns=recipe_as_built(model, spec))


def load_dtype(spec: RunSpec) -> torch.dtype:
    """The dtype a run's weights are loaded or built in (its recipe): the trained weights' for full fine-tuning, the
    frozen base's for LoRA; fp32 for QLoRA's layers that stay unquantised (peft's k-bit preparation keeps them fp32)."""
    recipe = recipe_of(spec)
    if spec.method == "qlora":
        return torch.float32
    return DTYPES[recipe.trainable_dtype if spec.method == "full" else recipe.frozen_dtype]


def trainables_in_recipe_dtype(model: torch.nn.Module, spec: RunSpec) -> None:
    """Every trainable parameter in the recipe's trainable dtype: peft makes 16-bit adapters fp32 itself, but a new
    head it keeps trainable (modules_to_save) stays in the base's dtype, and the optimizer must update fp32 masters.
    bf16_true: everything, adapters included, in bf16 (so gradients and optimizer state are bf16 too)."""
    wanted = DTYPES[recipe_of(spec).trainable_dtype]
    for param in model.parameters():
        if param.requires_grad and param.dtype != wanted:
            param.data = param.data.to(wanted)


def meta_model(spec: RunSpec) -> torch.nn.Module | None:
    """The run's model with no memory behind its tensors (torch's meta device): its modules, shapes and trainable
    parameters as build_model makes them (checkpointing, LoRA), for an estimate before anything loads: ``python
    -m ftbench plan`` and a train job's check that the run fits (experiment/memory_plan.py). None where it would
    not be the model the run trains: QLoRA (bitsandbytes quantises only while loading real weights) or a model
    whose config is not readable here (a hub name, offline)."""
    source = spec.model_def["source"]
    if spec.method == "qlora" or local_model_config(source) is None:
        return None
    family = model_family(spec.model_def)
    kwargs = family.model_kwargs(len(spec.dataset_def.get("labels") or ()) or None)
    if source["kind"] == "config":
        model = _model_from_config(spec, family, kwargs, {}, torch.device("meta"), None)
    else:
        import transformers

        location, extra = pretrained_args(source)
        config = transformers.AutoConfig.from_pretrained(location, revision=extra.get("revision"))
        with torch.device("meta"):
            model = family.model_class().from_config(config, **kwargs, dtype=load_dtype(spec))
    model = _prepare_for_training(model, spec)
    if spec.method == "lora":
        model = _add_lora(model, spec, family)
    trainables_in_recipe_dtype(model, spec)
    return model


def _model_from_config(spec: RunSpec, family: TaskFamily, kwargs: dict, quantised: dict, device: torch.device,
                       vocab_size: int | None):
    """A config-built model (random weights): the family's config for the run, built where it will live."""
    import transformers

    source = spec.model_def["source"]
    config_class = getattr(transformers, source["architecture"], None)
    if config_class is None:
        raise SourceError(f"model source architecture {source['architecture']!r} is not a transformers config class")
    overrides = dict(source.get("overrides", {}))
    check_overrides(config_class, overrides, f"models.{spec.model}.source.overrides")
    overrides = family.take_vocabulary(family.config_overrides(overrides, spec), vocab_size, spec)
    config = family.make_config(config_class, overrides, kwargs, spec)
    if getattr(config, "is_encoder_decoder", False) and getattr(config, "decoder_start_token_id", None) is None:
        # T5's convention: the decoder starts from the pad token. A bare config has no start token and
        # the first forward pass would fail while shifting the labels right.
        config.decoder_start_token_id = config.pad_token_id if config.pad_token_id is not None else SYNTHETIC_PAD_ID
    model_class = family.model_class()
    if quantised:
        return _quantised_random_model(model_class, config, kwargs, quantised, device, spec.run_id)
    # Random weights are made where they will live, in the dtype they train in: initialising a large model on
    # the CPU, or in fp32, and copying or casting it costs seconds and memory that the run does not measure.
    with torch.device(device):
        return model_class.from_config(config, dtype=load_dtype(spec))


def _quantised_random_model(model_class, config, kwargs: dict, quantised: dict, device: torch.device, run_id: str):
    """A config-built QLoRA model: bitsandbytes quantises while loading, so the random weights are saved and
    loaded back quantised. Made on the run's device in bf16 (what gets quantised: a random weight loses
    nothing), not in fp32 on the CPU: the 8B shape took minutes on the CPU, and 32 GB per process. Under
    torch.distributed one process per node writes them and every process loads that copy; the parameters
    that stay unquantised load as fp32 masters, as a checkpoint's do."""
    distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
    writer = not distributed or int(os.environ.get("LOCAL_RANK", "0")) == 0
    launch = os.environ.get("TORCHELASTIC_RUN_ID", str(os.getpid()))  # the same in every process of one launch
    folder = Path(tempfile.gettempdir()) / f"ftbench-model-{run_id}-{launch}"
    try:
        if writer:
            folder.mkdir(parents=True, exist_ok=True)
            with torch.device(device):
                model = model_class.from_config(config, dtype=torch.bfloat16)
            # Written by hand: under torch.distributed, save_pretrained writes on rank 0 only.
            model.config.save_pretrained(folder)
            safetensors.torch.save_model(model, str(folder / "model.safetensors"))
            del model
            if device.type == "cuda":
                torch.cuda.empty_cache()
        if distributed:
            torch.distributed.barrier()  # every node's copy is written
        model = model_class.from_pretrained(folder, **kwargs, **quantised, dtype=torch.float32)
        if distributed:
            torch.distributed.barrier()  # every process has loaded it: the copy may go
        return model
    finally:
        if writer:
            shutil.rmtree(folder, ignore_errors=True)


def _model_from_checkpoint(spec: RunSpec, family: TaskFamily, kwargs: dict, quantised: dict):
    source = spec.model_def["source"]
    location, extra = pretrained_args(source)
    extra.update(family.pretrained_kwargs())
    # Loaded in the recipe's dtype whatever dtype the checkpoint is stored in: transformers 5 loads a checkpoint in
    # its stored dtype by default, so a bf16-stored checkpoint (most hub LLMs) would otherwise train bf16 weights
    # under a run that says fp32 or mixed precision, and an fp32-stored one would keep an fp32 base under LoRA bf16.
    try:
        return family.model_class().from_pretrained(location, **extra, **kwargs, **quantised, dtype=load_dtype(spec))
    except OSError as exc:
        raise SourceError(load_failure("model", source, location, exc)) from None


def _prepare_for_training(model, spec: RunSpec):
    """k-bit preparation (QLoRA) or gradient checkpointing, no KV cache, Liger's kernels."""
    checkpointing = {"gradient_checkpointing_kwargs": {"use_reentrant": False}}
    if spec.method == "qlora":
        from peft import prepare_model_for_kbit_training

        # Casts norms and the head to fp32 and enables input gradients, which 4-bit training needs.
        model = prepare_model_for_kbit_training(
            model, use_gradient_checkpointing=spec.gradient_checkpointing, **checkpointing
        )
    elif spec.gradient_checkpointing:
        model.gradient_checkpointing_enable(**checkpointing)
    if hasattr(model.config, "use_cache"):
        model.config.use_cache = False  # the KV cache only serves generation and costs memory in training
    if spec.kernels == "liger":
        apply_liger(model)  # before LoRA wraps the layers it patches
    return model


def apply_liger(model: torch.nn.Module) -> None:
    """Patch Liger's fused kernels (RMSNorm, SwiGLU, RoPE, fused linear cross-entropy) into ``model`` through
    liger_kernel's per-architecture transformers patching functions."""
    from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN

    model_type = getattr(model.config, "model_type", None)
    if model_type not in MODEL_TYPE_TO_APPLY_LIGER_FN:
        raise UnsupportedConfiguration(f"kernels: liger has no kernels for model type {model_type!r} (Llama-family "
                                       "models such as llama, mistral, qwen2 are covered)")
    MODEL_TYPE_TO_APPLY_LIGER_FN[model_type](model=model)


def check_overrides(config_class, overrides: dict, where: str) -> None:
    """Every override must be a setting of the config class: transformers keeps an unknown keyword as a
    stray attribute, so a misspelt ``hidden_sze`` would silently build the default size."""
    import difflib
    import inspect

    from transformers import GenerationConfig, PretrainedConfig

    default = config_class()
    # A config takes its own settings, the common ones of every config, the names its attribute_map
    # translates, and generation settings (decoder_start_token_id and the like), which configs still accept.
    known = set(inspect.signature(config_class.__init__).parameters) | set(inspect.signature(PretrainedConfig.__init__).parameters)
    known |= set(default.to_dict()) | set(dir(default)) | set(getattr(config_class, "attribute_map", {}))
    known |= set(GenerationConfig().to_dict())
    unknown = [key for key in overrides if key not in known]
    if unknown:
        close = {key: difflib.get_close_matches(key, sorted(known), n=1) for key in unknown}
        hints = ", ".join(f"{key!r}" + (f" (did you mean {close[key][0]!r}?)" if close[key] else "") for key in unknown)
        raise ConfigError(f"config key {where}: {hints} is not a setting of {config_class.__name__}")


def _bnb_config(spec: RunSpec):
    from transformers import BitsAndBytesConfig

    compute = spec.qlora_compute_dtype or spec.precision
    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type=spec.qlora_quant_type,
        bnb_4bit_use_double_quant=spec.qlora_double_quant,
        bnb_4bit_compute_dtype=DTYPES[compute],
        # Under fsdp the packed weights are stored in the dtype FSDP2 gathers parameters in (the run's), so it
        # shards them as floating-point tensors and never casts (and so corrupts) the packed bytes: train/fsdp.py.
        bnb_4bit_quant_storage=DTYPES[spec.precision] if spec.parallel == "fsdp" else torch.uint8,
        llm_int8_skip_modules=OUTPUT_HEADS,
    )


def adaptable_layer_names(model: torch.nn.Module) -> list[str]:
    """The short names of the layers LoRA can adapt (Linear, and GPT-2's Conv1D), as lora_targets takes them."""
    names = set()
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) or type(module).__name__ == "Conv1D":
            names.add(name.rsplit(".", 1)[-1])
    return sorted(names)


def check_lora_targets(model: torch.nn.Module, spec: RunSpec) -> None:
    """Every name in lora_targets must name layers of the model: peft fails only when none matches, and
    silently adapts fewer layers than asked when one of several is misspelt."""
    if spec.lora_targets == "all-linear":
        return
    layers = adaptable_layer_names(model)
    module_names = [name for name, _ in model.named_modules()]
    missing = [target for target in spec.lora_targets
               if not any(name == target or name.endswith(f".{target}") for name in module_names)]
    if missing:
        raise ConfigError(
            f"config key lora_targets: {', '.join(map(repr, missing))} name no layer of model {spec.model!r}; "
            f"its adaptable layers are: {', '.join(layers)} (or use all-linear)"
        )


def _add_lora(model, spec: RunSpec, family: TaskFamily):
    from peft import LoraConfig, TaskType, get_peft_model

    check_lora_targets(model, spec)
    # The task type makes peft keep a new classification head trainable (modules_to_save); a task peft has
    # no type for names its head instead.
    head = {"task_type": getattr(TaskType, family.peft_task_type)} if family.peft_task_type else \
        {"modules_to_save": list(family.head_modules)}
    config = LoraConfig(
        **head,
        r=spec.lora_rank,
        lora_alpha=spec.lora_alpha,
        lora_dropout=spec.lora_dropout,
        target_modules=family.lora_targets(model, spec),
    )
    return get_peft_model(model, config)
