"""The optimizer, learning-rate schedule and fp16 gradient scaling of a run."""

from __future__ import annotations

import torch

from ftbench.train import modeling
from ftbench.runspec import RunSpec


def make_optimizer(spec: RunSpec, model: torch.nn.Module, device: torch.device):
    params = [p for p in model.parameters() if p.requires_grad]
    lr, decay = spec.learning_rate, spec.weight_decay
    name = spec.optimizer
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=0.9, weight_decay=decay)
    if name in modeling.BNB_OPTIMIZERS:
        import bitsandbytes as bnb

        optimizer_class = bnb.optim.PagedAdamW8bit if name == "paged_adamw_8bit" else bnb.optim.AdamW8bit
        return optimizer_class(params, lr=lr, weight_decay=decay)
    # The fused CUDA kernel updates all parameters in one launch; it needs every parameter on the GPU.
    fused = device.type == "cuda" and all(p.is_cuda and p.is_floating_point() for p in params)
    return torch.optim.AdamW(params, lr=lr, weight_decay=decay, fused=fused or None)


def skips_non_finite_on_device(optimizer, scaler: torch.amp.GradScaler, parallel: str) -> bool:
    """Whether a non-finite loss can stop the step's update on the device, with no wait for the loss first:
    fused Adam/AdamW take a ``found_inf`` tensor and leave the weights, their moments and step count as they
    were where it is 1 (``skip_update_if``). Not under a GradScaler (fp16), which sets found_inf itself; not
    across processes (ddp, fsdp), where a rank's own loss does not say whether the all-reduced gradients are."""
    return (parallel in ("single", "dp") and not scaler.is_enabled() and isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW))
            and bool(optimizer.defaults.get("fused")))


def skip_update_if(optimizer, loss: torch.Tensor) -> None:
    """Make the optimizer's next step leave everything as it was if ``loss`` is not finite (decided on the device)."""
    optimizer.found_inf = torch.logical_not(torch.isfinite(loss)).to(torch.float32)


def make_scheduler(optimizer, spec: RunSpec, total_steps: int):
    """Linear warmup over ``lr_warmup_steps``, then linear decay to zero."""
    warmup = spec.lr_warmup_steps

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return max(0.0, (total_steps - step) / max(1, total_steps - warmup))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def make_grad_scaler(spec: RunSpec, device: torch.device) -> torch.amp.GradScaler:
    # GradScaler keeps small fp16 gradients from flushing to zero; bf16 has fp32's range and needs none.
    return torch.amp.GradScaler(device.type, enabled=spec.precision == "fp16")


def scaler_step(scaler: torch.amp.GradScaler, optimizer) -> bool:
    """The optimizer step through the GradScaler; True when the scaler skipped it.

    With fp16 the scaler skips a step whose gradients hold inf/NaN (the loss scale was too high) and
    halves the scale: a lower scale after ``update`` is how a skipped step shows. A disabled scaler
    (fp32, bf16) steps the optimizer and never skips.
    """
    scale = scaler.get_scale() if scaler.is_enabled() else None
    scaler.step(optimizer)
    scaler.update()
    return scale is not None and scaler.get_scale() < scale
