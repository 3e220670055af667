"""ftbench.train.devices: autocast settings, the device a run gets, a process's place in a DDP group."""

from __future__ import annotations

import pytest
import torch

from ftbench.train.devices import Distributed, autocast_args, choose_device
from ftbench.errors import UnsupportedConfiguration
from ftbench.runspec import RunSpec

CPU = torch.device("cpu")


def test_autocast_only_for_16_bit_precisions():
    assert autocast_args(CPU, "fp32") == {"device_type": "cpu", "dtype": torch.float32, "enabled": False}
    assert autocast_args(CPU, "bf16") == {"device_type": "cpu", "dtype": torch.bfloat16, "enabled": True}
    assert autocast_args(torch.device("cuda", 1), "fp16") == {"device_type": "cuda", "dtype": torch.float16, "enabled": True}


def test_distributed_from_torchrun_environment(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert not Distributed.from_env().active
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert Distributed.from_env() == Distributed(1, 2, 1) and Distributed(1, 2, 1).active


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a CUDA GPU")
def test_choose_device_without_a_gpu():
    assert choose_device(RunSpec(num_gpus=0), Distributed()) == (CPU, None)
    device, note = choose_device(RunSpec(num_gpus=1, device="auto"), Distributed())
    assert device == CPU and "CPU" in note  # a 1-GPU run falls back, and says so
    with pytest.raises(UnsupportedConfiguration, match="2 GPUs"):
        choose_device(RunSpec(parallel="ddp", num_gpus=2, device="auto"), Distributed())
