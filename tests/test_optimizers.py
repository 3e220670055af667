"""ftbench.train.optimizers: the learning-rate schedule and fp16 gradient scaling, on tiny tensors (the optimizers
themselves train in tests/test_families.py)."""

from __future__ import annotations

import math

import pytest
import torch

from ftbench.train.optimizers import make_grad_scaler, make_scheduler, scaler_step
from ftbench.runspec import RunSpec


def test_learning_rate_warms_up_then_decays_to_zero():
    optimizer = torch.optim.SGD(torch.nn.Linear(2, 1).parameters(), lr=0.001)
    scheduler = make_scheduler(optimizer, RunSpec(lr_warmup_steps=2), total_steps=6)
    rates = []
    for _ in range(6):
        rates.append(scheduler.get_last_lr()[0])
        optimizer.step()
        scheduler.step()
    assert rates == pytest.approx([0.001 * f for f in (0.5, 1.0, 1.0, 0.75, 0.5, 0.25)])


def test_only_fp16_gets_a_grad_scaler():
    cpu = torch.device("cpu")
    assert make_grad_scaler(RunSpec(precision="fp16"), cpu).is_enabled()
    assert not make_grad_scaler(RunSpec(precision="bf16"), cpu).is_enabled()
    assert not make_grad_scaler(RunSpec(precision="fp32"), cpu).is_enabled()


def test_grad_scaler_skipped_steps_are_counted():
    """fp16 needs a CUDA GPU here, so the counting is tested on a CPU GradScaler: a step whose gradients
    hold inf is skipped (weights unchanged) and counted; a finite one is not."""
    layer = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(layer.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", enabled=True, init_scale=2.0**16)
    before = layer.weight.detach().clone()
    scaler.scale(layer(torch.tensor([[math.inf, 1.0]])).sum()).backward()
    assert scaler_step(scaler, optimizer) is True
    assert torch.equal(layer.weight, before)
    optimizer.zero_grad()
    scaler.scale(layer(torch.tensor([[1.0, 1.0]])).sum()).backward()
    assert scaler_step(scaler, optimizer) is False
    assert not torch.equal(layer.weight, before)
    optimizer.zero_grad()
    layer(torch.tensor([[1.0, 1.0]])).sum().backward()
    assert scaler_step(torch.amp.GradScaler("cpu", enabled=False), optimizer) is False
