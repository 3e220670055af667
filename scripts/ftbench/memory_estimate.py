"""Training memory estimated before the first step, stored beside the measured peak.

The model (bytes), so the ratio estimate / measured says where it is off:
- weights: 4 bytes per parameter (fp32 master weights; autocast makes 16-bit copies on the fly);
  QLoRA: 4-bit base weights at 0.5 byte, plus their quantisation constants (one fp32 absmax per
  block of 64 = 0.0625 byte, or ~0.0159 byte with double quantisation), other parameters in fp32.
- gradients: 4 bytes per trainable parameter.
- optimizer state per trainable parameter: AdamW 8 (two fp32 moments), 8-bit AdamW 2, SGD with
  momentum 4.
- activations kept for backward (Korthikanti et al. 2022, "Reducing Activation Recomputation"):
  per layer and token, width x (34 + 5 x heads x S / width) bytes in 16-bit, the second term only for
  eager attention (fused attention keeps no score matrix); fp32 doubles it. With
  gradient checkpointing only each layer's input (2 x width bytes, 16-bit) is kept, plus one layer's
  full activations during its recomputation.
- logits: batch x S x vocab x 4 bytes for the fp32 logits plus the same again for their gradient
  (large for decoders with big vocabularies).
It ignores allocator fragmentation, CUDA context and library workspaces: compare it with CUDA
max_memory_allocated (not reserved), and expect it to be low by a margin on small models.
"""

from __future__ import annotations

import torch

OPTIMIZER_BYTES = {"adamw": 8, "adamw_8bit": 2, "paged_adamw_8bit": 2, "sgd": 4}
MIB = 2**20


def estimate(model: torch.nn.Module, spec: dict, task: str, vocab_size: int | None) -> dict:
    quantised = other = trainable = 0
    for param in model.parameters():
        quant_state = getattr(param, "quant_state", None)
        if quant_state is not None:
            quantised += int(torch.Size(quant_state.shape).numel())
        else:
            other += param.numel()
        if param.requires_grad:
            trainable += param.numel()
    constants = 0.0159 if spec.get("qlora_double_quant") else 0.0625
    weights = quantised * (0.5 + constants) + other * 4
    gradients = trainable * 4
    optimizer = trainable * OPTIMIZER_BYTES[spec["optimizer"]]

    config = getattr(model, "config", None)
    from .flops import attention_shape

    layers, width = attention_shape(config)
    heads = getattr(config, "num_attention_heads", None) or getattr(config, "num_heads", 0) or 0
    batch, seq = spec["batch_size"], spec["seq_len"]
    element = 2 if spec["precision"] in ("bf16", "fp16") else 4
    scale = element / 2  # the published formula is for 16-bit activations
    # The 5·heads·S/width term is the stored attention-score matrix; fused attention (sdpa, flash: the
    # default of current models) never materialises it, so it counts only for eager attention.
    scores = 5 * heads * seq / width if width and spec.get("attn_implementation") == "eager" else 0
    per_layer_token = width * (34 + scores) * scale
    if spec["gradient_checkpointing"]:
        activations = batch * seq * (layers * 2 * width * scale + per_layer_token)
    else:
        activations = batch * seq * layers * per_layer_token
    logits = 2 * batch * seq * (vocab_size or 0) * 4 if task != "classification" else 0
    parts = {
        "weights": weights,
        "gradients": gradients,
        "optimizer": optimizer,
        "activations": activations,
        "logits": logits,
    }
    return {
        "memory_estimate_mb": sum(parts.values()) / MIB,
        "memory_estimate_parts_mb": {name: value / MIB for name, value in parts.items()},
    }
