"""Runs this version cannot train, known from their settings alone: recorded as `unsupported` rows with
the reason, without building a model or holding a GPU.

A combination the schema accepts key by key can still be one that fails for a known reason of the
installed stack (a library that cannot shard a parameter type, a kernel that breaks under compilation).
Such a run is not a config error (the rest of the experiment is still worth running) but it must not be
launched to discover the failure after minutes of model building: ``unsupported_reason`` names it here,
once, and the job writes the row before anything else (``train.job``; ``train.trainer`` asks too, for
runs trained without a job). ``snakemake -n`` and ``python -m ftbench check`` list these runs as warnings.

What depends on the machine (no GPU, a package not installed, bf16 on an old GPU) can only be known in
the job: ``train.modeling.check_supported``.
"""

from __future__ import annotations

from collections.abc import Callable

from ftbench.runspec import RunSpec

BNB_8BIT_OPTIMIZERS = ("adamw_8bit", "paged_adamw_8bit")


def _fsdp_8bit_optimizer(spec: RunSpec) -> str | None:
    if spec.parallel == "fsdp" and spec.optimizer in BNB_8BIT_OPTIMIZERS:
        return (f"optimizer {spec.optimizer} under fsdp: bitsandbytes' 8-bit optimizers do not take FSDP2's sharded "
                "(DTensor) parameters; use adamw or sgd")
    return None


def _qlora_fsdp_offload(spec: RunSpec) -> str | None:
    if spec.parallel == "fsdp" and spec.method == "qlora" and spec.fsdp_cpu_offload:
        # Offloading copies the packed 4-bit shards between host and GPU as plain tensors each step; bitsandbytes
        # ties their quantisation state to the module on the GPU. Not measured here, so not offered.
        return ("QLoRA under fsdp with fsdp_cpu_offload: the 4-bit base weights are already a quarter of bf16 and "
                "their quantisation state lives on the GPU; offloading them is not supported (set fsdp_cpu_offload false)")
    return None


def _hf_trainer_parallel(spec: RunSpec) -> str | None:
    if spec.engine == "hf_trainer" and spec.parallel != "single":
        return f"engine hf_trainer runs parallel 'single' only in this version (not {spec.parallel!r})"
    return None


def _compile_with_liger(spec: RunSpec) -> str | None:
    if spec.compile and spec.kernels == "liger":
        # Seen on an H100 (torch 2.11, liger-kernel 0.8): TorchRuntimeError while tracing Liger's fused linear
        # cross-entropy, after the model was built. Liger's kernels are already fused, which is most of what
        # compiling would add.
        return ("compile with kernels: liger: torch.compile fails tracing Liger's fused linear cross-entropy on this "
                "torch; measure them as separate runs (compile: true, or kernels: liger)")
    return None


def _bf16_true_beyond_full_and_lora(spec: RunSpec) -> str | None:
    if spec.precision != "bf16_true":
        return None
    if spec.method == "qlora":
        # The 4-bit base computes in qlora_compute_dtype already; the adapters are what bf16_true would change.
        return ("precision bf16_true with QLoRA: its 4-bit base computes in qlora_compute_dtype and only its adapters "
                "train; use precision bf16 (or method lora with bf16_true)")
    if spec.parallel == "fsdp":
        # FSDP2's mixed precision keeps fp32 sharded masters and casts what it gathers: a different recipe, not
        # measured here with bf16 masters.
        return "precision bf16_true under fsdp: FSDP2 keeps fp32 sharded weights and gathers them in bf16; use precision bf16"
    return None


RULES: tuple[Callable[[RunSpec], str | None], ...] = (
    _fsdp_8bit_optimizer, _qlora_fsdp_offload, _hf_trainer_parallel, _compile_with_liger, _bf16_true_beyond_full_and_lora,
)


def unsupported_reason(spec: RunSpec) -> str | None:
    """Why this version cannot train ``spec`` (one sentence), or None when it can."""
    for rule in RULES:
        reason = rule(spec)
        if reason:
            return reason
    return None
