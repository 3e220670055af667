"""Build the model a run asks for: full fine-tuning, LoRA (peft) or QLoRA (bitsandbytes 4-bit + LoRA).

Precision is applied as autocast around the forward pass (weights stay fp32 masters, as mixed-precision
training does); QLoRA's 4-bit base weights compute in the run's dtype.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

import torch

from . import sources
from .errors import SourceError, UnsupportedConfiguration

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}

# Heads created fresh for the task: they must stay trainable and out of 4-bit quantisation
# (a quantised new head has no quantisation state and its forward pass fails).
CLASSIFIER_HEADS = ["classifier", "pooler", "score"]


def tokenizer_source(model_def: dict) -> dict:
    source = model_def["source"]
    return source["tokenizer"] if source["kind"] == "config" else source


def load_tokenizer(model_def: dict):
    from transformers import AutoTokenizer

    location = sources.resolve_location(tokenizer_source(model_def))
    try:
        tokenizer = AutoTokenizer.from_pretrained(location)
    except OSError as exc:
        raise SourceError(f"tokenizer {location}: cannot be loaded ({' '.join(str(exc).split())[:300]})") from None
    if tokenizer.pad_token_id is None and tokenizer.eos_token_id is not None:
        tokenizer.pad_token = tokenizer.eos_token  # decoder tokenizers ship without a pad token
    return tokenizer


def bitsandbytes_available() -> bool:
    return importlib.util.find_spec("bitsandbytes") is not None


@dataclass
class BuiltModel:
    model: torch.nn.Module
    trainable_params: int
    total_params: int


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


def check_supported(spec: dict, device: torch.device) -> None:
    """Raise UnsupportedConfiguration, with the reason, for what this machine cannot run."""
    if spec["precision"] == "fp16" and device.type == "cpu":
        raise UnsupportedConfiguration("fp16 training needs a CUDA GPU (CPU autocast has no fp16 GradScaler path)")
    if spec["method"] == "qlora" and not bitsandbytes_available():
        raise UnsupportedConfiguration("qlora needs the bitsandbytes package, which is not installed")
    if spec["parallel"] == "ddp":
        raise UnsupportedConfiguration("parallel mode ddp needs the torchrun launcher, which this version does not start yet")
    if spec["precision"] == "bf16" and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise UnsupportedConfiguration(f"{torch.cuda.get_device_name(device)} does not support bf16")


def build_model(spec: dict, num_labels: int, device: torch.device) -> BuiltModel:
    from transformers import AutoModelForSequenceClassification

    model_def = spec["model_def"]
    source = model_def["source"]
    kwargs = {"num_labels": num_labels}
    if spec["method"] == "qlora":
        kwargs["quantization_config"] = _bnb_config(spec)
        # bitsandbytes quantises while loading, on the device it loads to.
        kwargs["device_map"] = {"": device.index if device.type == "cuda" else "cpu"}

    if source["kind"] == "config":
        import transformers

        config_class = getattr(transformers, source["architecture"], None)
        if config_class is None:
            raise SourceError(f"model source architecture {source['architecture']!r} is not a transformers config class")
        config = config_class(**source.get("overrides", {}), num_labels=num_labels)
        if spec["method"] == "qlora":
            raise UnsupportedConfiguration("qlora on a randomly initialised config model is not supported; save it first")
        model = AutoModelForSequenceClassification.from_config(config)
    else:
        location = sources.resolve_location(source)
        if source["kind"] != "hub" and not Path(location).exists():
            raise SourceError(f"model source {location} does not exist")
        model = AutoModelForSequenceClassification.from_pretrained(location, **kwargs)
    if model.config.pad_token_id is None:
        model.config.pad_token_id = _pad_id(model_def)

    if spec["method"] == "qlora":
        from peft import prepare_model_for_kbit_training

        model = prepare_model_for_kbit_training(
            model, use_gradient_checkpointing=spec["gradient_checkpointing"],
            gradient_checkpointing_kwargs={"use_reentrant": False},
        )
    elif spec["gradient_checkpointing"]:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})

    if spec["method"] in ("lora", "qlora"):
        model = _add_lora(model, spec)
    if spec["method"] != "qlora":
        model = model.to(device)
    trainable, total = count_parameters(model)
    return BuiltModel(model=model, trainable_params=trainable, total_params=total)


def _pad_id(model_def: dict) -> int | None:
    return load_tokenizer(model_def).pad_token_id


def _bnb_config(spec: dict):
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=DTYPES[spec["precision"]],
        llm_int8_skip_modules=CLASSIFIER_HEADS,
    )


def _add_lora(model, spec: dict):
    from peft import LoraConfig, TaskType, get_peft_model

    config = LoraConfig(
        task_type=TaskType.SEQ_CLS,  # keeps the new classification head trainable (modules_to_save)
        r=spec["lora_rank"],
        lora_alpha=spec["lora_alpha"],
        lora_dropout=spec["lora_dropout"],
        target_modules=spec["lora_targets"],
    )
    return get_peft_model(model, config)
