"""Training memory estimated before the first step, stored beside the measured peak.

The model (bytes), so the ratio estimate / measured says where it is off:
- weights: 4 bytes per parameter (fp32 master weights); QLoRA: 4-bit base weights at 0.5 byte, plus
  their quantisation constants (one fp32 absmax per block of 64 = 0.0625 byte, or ~0.0159 byte with
  double quantisation), other parameters in fp32.
- weight copies: with bf16/fp16 autocast, the 16-bit copy of every unquantised weight, cast once per
  step and held for the backward pass (2 bytes per parameter). 4-bit weights are dequantised per use.
- gradients: 4 bytes per trainable parameter.
- optimizer state per trainable parameter: AdamW 8 (two fp32 moments), 8-bit AdamW 2, SGD with
  momentum 4.
- activations that autograd keeps for the backward pass, per layer and token: a x width + m x
  intermediate bytes, with (a, m) from ACTIVATION_BYTES below. The coefficients were traced here with
  torch.autograd saved-tensor hooks on transformers' Llama and BERT layers (tests/test_measurement.py
  traces them again and holds the estimate to within 10%): the same shape as Korthikanti et al.
  (2022)'s 34 x width, with the MLP term made to follow the MLP's real width and kind. Eager attention
  adds the stored score matrix, 5 x heads x S bytes in 16-bit (fused attention, the default of current
  models, keeps none). Gradient checkpointing keeps only each layer's input (the residual stream, fp32
  under autocast: 4 x width bytes), and one layer's full activations while it is recomputed (recompute).
- adapters (LoRA, QLoRA), traced the same way with all-linear targets on the CPU and on an H100: frozen
  weights change what the layers keep (ADAPTER_WIDTH_BYTES: an RMSNorm with a frozen weight no longer
  keeps its fp32 normalised input, one per norm); each adapted Linear keeps its rank-wide LoRA-A output;
  with lora_dropout on a GPU, a 1-byte mask per element of each adapted Linear's input (a CPU keeps the
  mask in the input's dtype: the estimate is for CUDA). QLoRA: bitsandbytes' 4-bit layers return their
  input's dtype, fp32 after peft's k-bit preparation, so the MLP's elementwise work keeps fp32 copies
  (QLORA_MLP_BYTES).
- logits of a language model: 12 bytes per batch x S x vocab element at the start of the backward
  pass: the loss's fp32 log-softmax output (kept for backward), its gradient and the gradient of its
  input. Large for decoders with big vocabularies.
- the peak (peak_bytes): weights + optimizer state + the larger of the start of the backward pass
  (weight copies, activations, logits; no gradient yet) and its end (gradients; with checkpointing also
  the layer inputs and one recomputed layer). Seen on an H100 by reading the allocated memory after each
  phase of a step (Llama-134M shape, bf16, 8 x 1024): the peak came at the start of the backward pass,
  without gradients, and with checkpointing also without autocast's weight copies.
- fsdp (FSDP2, per GPU): the fp32 weights, gradients and optimizer state are sharded, 1/world each (none
  on the GPU with fsdp_cpu_offload: they are host memory, memory_estimate_host_mb). In place of autocast's
  weight copies, the gathered (unsharded) parameters in the compute dtype: the root's (embeddings, head,
  kept gathered) plus two blocks (the one computing and the one prefetched), or every block with
  fsdp_reshard_after_forward off (all stay gathered from their forward to their backward). Gradients add
  two blocks' unsharded gradients in the reduce dtype, before their reduce-scatter.
It ignores allocator fragmentation, CUDA context and library workspaces: compare it with CUDA
max_memory_allocated (not reserved), and expect it to be low by a margin on small models.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from ftbench.measure import model_shape
from ftbench.runspec import RunSpec

if TYPE_CHECKING:  # torch is not imported here: cluster/resources.py reads OPTIMIZER_BYTES at parse time
    import torch

MIB = 2**20
# Optimizer state bytes per trainable parameter (see the module docstring); the resource estimate uses it too.
OPTIMIZER_BYTES = {"adamw": 8, "adamw_8bit": 2, "paged_adamw_8bit": 2, "sgd": 4}

# (bytes per layer-token per unit of width, per unit of MLP width), by (norm kind, MLP kind, 16-bit?).
# RMSNorm layers (Llama, Mistral, Qwen, T5) compute in fp32 and keep fp32 copies, hence their larger
# width term; a gated MLP (SwiGLU, GeGLU) keeps four intermediate-wide tensors, a plain one two.
# Traced: rms+gated (Llama) and layer+plain (BERT); the other two pair those norm and MLP terms.
ACTIVATION_BYTES = {
    ("rms", "gated", True): (34, 8),
    ("rms", "gated", False): (40, 16),
    ("rms", "plain", True): (34, 4),
    ("rms", "plain", False): (40, 8),
    ("layer", "gated", True): (24, 8),
    ("layer", "gated", False): (32, 16),
    ("layer", "plain", True): (24, 4),
    ("layer", "plain", False): (32, 8),
}
DROPOUT_MASK_BYTES = {True: 4, False: 8}  # per unit of width, when hidden dropout is on (training mode)
# CLIP's quick_gelu (x * sigmoid(1.702 x), unfused) keeps its sigmoid too: one more intermediate-wide tensor in
# the compute dtype than a fused GELU (traced on CLIP's towers: 20% more activations than BERT's MLP term).
QUICK_GELU_BYTES = {True: 2, False: 4}
# Adapters, per layer-token per unit of width, by (norm kind, 16-bit?), relative to the full fine-tuning
# row above. Llama: -8 for its two frozen RMSNorms, +2 for one more 16-bit copy under autocast; BERT
# (LayerNorm keeps what it keeps whether or not its weight trains): +2 and 0.
ADAPTER_WIDTH_BYTES = {("rms", True): -6, ("rms", False): -8, ("layer", True): 2, ("layer", False): 0}
# QLoRA under 16-bit autocast, per unit of MLP width: the MLP's intermediate-wide tensors kept in fp32 instead
# of 16 bits, 2 more bytes each: three in a gated MLP (gate and up outputs, activation), one in a plain one.
QLORA_MLP_BYTES = {"gated": 6, "plain": 2}
LORA_DROPOUT_MASK_BYTES = 1  # per element of an adapted Linear's input: CUDA's fused dropout keeps a bool mask
GATE_NAMES = ("gate_proj", "gate_up_proj", "wi_0", "w1")


def architecture_traits(model: torch.nn.Module) -> tuple[str, str]:
    """(norm kind, MLP kind) read from the module tree: "rms" | "layer", "gated" | "plain"."""
    names = [name for name, _ in model.named_modules()]
    gated = any(name.rsplit(".", 1)[-1] in GATE_NAMES for name in names)
    rms = any("RMSNorm" in type(module).__name__ or type(module).__name__ == "T5LayerNorm" for module in model.modules())
    return ("rms" if rms else "layer"), ("gated" if gated else "plain")


def hidden_dropout(config) -> float:
    for key in ("hidden_dropout_prob", "resid_pdrop", "dropout_rate", "dropout", "hidden_dropout"):
        value = getattr(config, key, None)
        if isinstance(value, (int, float)):
            return float(value)
    return 0.0


def adapted_linears(model: torch.nn.Module) -> list[int]:
    """Input widths of the Linear layers that carry a LoRA adapter (peft's LoRA layers have lora_A)."""
    return [module.in_features for module in model.modules() if len(getattr(module, "lora_A", None) or ()) > 0]


def adapter_bytes_per_layer_token(model: torch.nn.Module, spec: RunSpec, norm: str, mlp: str, inter: int, width: int,
                                  layers: int, sixteen_bit: bool) -> float:
    """What adapters change in the activations kept per layer and token (see the module's docstring)."""
    inputs = adapted_linears(model)
    per_element = 2 if sixteen_bit else 4
    added = len(inputs) * spec.lora_rank * per_element  # LoRA-A outputs, kept for LoRA-B's gradient
    if spec.lora_dropout:
        added += sum(inputs) * LORA_DROPOUT_MASK_BYTES
    per_layer = added / max(layers, 1) + ADAPTER_WIDTH_BYTES[(norm, sixteen_bit)] * width
    if spec.method == "qlora" and sixteen_bit:
        per_layer += QLORA_MLP_BYTES[mlp] * inter
    return per_layer


# Why a run gets no estimate (memory_estimate_mb null, this in memory_estimate_note), rather than a wrong one.
NOT_MODELLED_COMPILED = ("not modelled for compiled runs: torch.compile fuses elementwise work and keeps fewer "
                         "activations than eager autograd (seen: estimate 1.59x the measured peak)")


def parameter_counts(model: torch.nn.Module) -> tuple[int, int, int]:
    """(4-bit quantised, other, trainable) parameters; 4-bit weights counted as the parameters they stand for."""
    quantised = other = trainable = 0
    for param in model.parameters():
        quant_state = getattr(param, "quant_state", None)
        if quant_state is not None:
            quantised += int(math.prod(quant_state.shape))
        else:
            other += param.numel()
        if param.requires_grad:
            trainable += param.numel()
    return quantised, other, trainable


def estimate(model: torch.nn.Module, spec: RunSpec, logits_vocab: int | None) -> dict:
    """The estimate (MiB) and its parts; or, for a run the model does not describe, nulls and a note.
    ``logits_vocab``: the vocabulary a language model's logits run over (None: a head without such logits,
    a classifier's)."""
    if spec.compile:
        return {"memory_estimate_mb": None, "memory_estimate_parts_mb": None, "memory_estimate_note": NOT_MODELLED_COMPILED}
    quantised, other, trainable = parameter_counts(model)
    sixteen_bit = spec.precision in ("bf16", "fp16")
    constants = 0.0159 if spec.qlora_double_quant else 0.0625
    parts = {
        "weights": quantised * (0.5 + constants) + other * 4,
        "weight_copies": other * 2 if sixteen_bit else 0,
        "gradients": trainable * 4,
        "optimizer": trainable * OPTIMIZER_BYTES[spec.optimizer],
        **activation_parts(model, spec, sixteen_bit),
        "logits": 12 * spec.batch_size * spec.seq_len * (logits_vocab or 0),
    }
    if spec.gradient_checkpointing:
        # Autocast's weight copies are not saved for backward inside checkpointed layers: they go with
        # autocast's cache when the forward pass ends, and the recompute casts one layer's at a time.
        parts["weight_copies"] = 0
    host = 0.0
    if spec.parallel == "fsdp":
        parts, host = sharded(parts, model, spec, trainable)
    return {
        "memory_estimate_mb": peak_bytes(parts) / MIB,
        "memory_estimate_parts_mb": {name: value / MIB for name, value in parts.items()},
        "memory_estimate_note": None,
        "memory_estimate_host_mb": host / MIB if spec.parallel == "fsdp" and spec.fsdp_cpu_offload else None,
    }


def activation_parts(model: torch.nn.Module, spec: RunSpec, sixteen_bit: bool) -> dict:
    """The activations autograd keeps, and with checkpointing the one layer recomputed (bytes)."""
    config = getattr(model, "config", None)
    shape = model_shape.from_transformers_config(config)
    layers, width, inter = shape.attention_layers, shape.width, shape.intermediate
    batch, seq = spec.batch_size, spec.seq_len
    norm, mlp = architecture_traits(model)
    per_width, per_intermediate = ACTIVATION_BYTES[(norm, mlp, sixteen_bit)]
    if hidden_dropout(config) > 0:
        per_width += DROPOUT_MASK_BYTES[sixteen_bit]
    if getattr(config, "hidden_act", None) == "quick_gelu":
        per_intermediate += QUICK_GELU_BYTES[sixteen_bit]
    per_layer_token = per_width * width + per_intermediate * inter
    if spec.method in ("lora", "qlora"):
        per_layer_token += adapter_bytes_per_layer_token(model, spec, norm, mlp, inter, width, layers, sixteen_bit)
    if spec.attn_implementation == "eager":
        per_layer_token += 5 * shape.heads * seq * (1 if sixteen_bit else 2)
    if spec.gradient_checkpointing:
        # each layer's fp32 input; one layer's activations, while the backward pass recomputes it
        return {"activations": batch * seq * layers * 4 * width, "recompute": batch * seq * per_layer_token}
    return {"activations": batch * seq * layers * per_layer_token, "recompute": 0}


def repeated_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's repeated blocks (decoder/encoder layers): the entries of its ModuleLists whose class the
    model names in ``_no_split_modules`` (transformers' list of blocks that must stay whole), or, for a model
    that names none, every entry of a ModuleList of two or more modules of one class. Blocks inside
    ModuleLists only: embeddings (also named there) may share their weight with the output head, which
    must then stay in the same unit. (FSDP wraps these blocks: train/fsdp.py uses it.)"""
    import torch  # deferred: cluster/resources.py imports this module at parse time, torch-free

    names = set()
    for module in model.modules():
        names.update(getattr(module, "_no_split_modules", None) or ())
    blocks = []
    for module in model.modules():
        if isinstance(module, torch.nn.ModuleList) and len(module) > 1:
            for entry in module:
                kind = type(entry).__name__
                if kind in names or (not names and all(type(other) is type(entry) for other in module)):
                    blocks.append(entry)
    return blocks


def sharded(parts: dict, model: torch.nn.Module, spec: RunSpec, trainable: int) -> tuple[dict, float]:
    """One GPU's parts under FSDP2 (see the module's docstring), and the host bytes that offload holds."""
    world = spec.devices
    blocks = [sum(p.numel() for p in block.parameters()) for block in repeated_blocks(model)]
    total = sum(p.numel() for p in model.parameters())
    compute_bytes = 4 if spec.precision == "fp32" else 2
    reduce_bytes = 4 if (spec.fsdp_reduce_dtype or spec.precision) == "fp32" else 2
    largest = max(blocks, default=total)
    gathered_params = total if not spec.fsdp_reshard_after_forward else (total - sum(blocks)) + 2 * largest
    states = {name: parts[name] / world for name in ("weights", "gradients", "optimizer")}
    host = sum(states.values())
    if spec.fsdp_cpu_offload:
        states = dict.fromkeys(states, 0.0)
    in_flight = 2 * min(largest, trainable) * reduce_bytes  # unsharded gradients awaiting their reduce-scatter
    return {**parts, **states, "gradients": states["gradients"] + in_flight,
            "weight_copies": min(gathered_params, total) * compute_bytes}, host


def peak_bytes(parts: dict) -> float:
    """The parts do not all coexist. The backward pass starts with every kept activation and the logits'
    buffers and no gradient yet; gradients then grow as activations are freed (with checkpointing, beside
    the layer inputs and one recomputed layer). The peak is the larger of the two moments."""
    checkpointed = parts["recompute"] > 0  # only checkpointing recomputes; its layer inputs outlast the gradients
    backward_start = parts["weight_copies"] + parts["activations"] + parts["logits"]
    backward_end = parts["gradients"] + (parts["activations"] + parts["recompute"] if checkpointed else 0)
    return parts["weights"] + parts["optimizer"] + max(backward_start, backward_end)
