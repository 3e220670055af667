"""measure/step_clock.py: the measured window's steps timed without waiting for the device (on a CPU, where the
host clock is the device's timeline), and the window's loop in trainer.py that uses it."""

from __future__ import annotations

import math

import pytest
import torch

from ftbench.experiment import matrix
from ftbench.measure import step_clock
from ftbench.measure.step_clock import LaggedLosses, StepClock
from ftbench.train import trainer

CPU = torch.device("cpu")


@pytest.fixture
def make_cpu_spec(tiny_config_factory):
    """``make_cpu_spec(**settings)``: the one run of the tiny config's LoRA on the CPU, with these settings."""

    def make(**settings):
        config = tiny_config_factory()
        config["defaults"].update(device="cpu", num_gpus=0, **settings)
        config["matrix"] = {"model": ["tiny"], "dataset": ["tiny"]}
        (spec,) = matrix.expand_runs(config)
        return spec

    return make


def test_a_chain_of_boundaries_times_each_step_and_an_evaluation_between_chains_belongs_to_none(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(step_clock.time, "perf_counter", lambda: now[0])
    clock = StepClock(CPU)
    clock.start(100.0)
    for step, seconds in ((2, 0.5), (3, 0.25)):
        now[0] += seconds
        clock.boundary(step)
    assert clock.host_time_of() == 100.75  # the last step's end: where an evaluation's pause begins
    now[0] = 110.0  # a 9.25-s evaluation, then a new chain from the clock's resumption
    clock.start(110.0)
    now[0] += 0.125
    clock.boundary(4)
    assert clock.step_seconds() == {2: 0.5, 3: 0.25, 4: 0.125}
    assert clock.host_time_of(3) == 100.75 and clock.host_time_of(4) == 110.125


def test_lagged_losses_give_back_each_steps_value_when_asked():
    losses = LaggedLosses(CPU, steps=3)
    losses.put(0, torch.tensor(2.5))
    losses.put(1, torch.tensor(float("nan"), dtype=torch.bfloat16))
    assert losses.get(0) == 2.5 and math.isnan(losses.get(1))


@pytest.mark.slow
def test_the_window_waits_for_the_device_only_at_its_ends(make_cpu_spec, prepared_data, monkeypatch):
    """A sync per measured step would idle the GPU while the host launches the next step: the loop synchronises
    before the first step, after each warmup step (their times decide when the window begins) and once at the
    window's end; the measured steps' times, read off the step clock, still add up to the window exactly."""
    synchronised = []
    real = trainer.synchronize
    monkeypatch.setattr(trainer, "synchronize", lambda device: (synchronised.append(1), real(device)))
    metrics, steps = trainer.train_run(make_cpu_spec(max_steps=8, warmup_steps=2), prepared_data[0])
    assert metrics["status"] == "ok" and metrics["measured_steps"] == 6
    assert len(synchronised) == 1 + 2 + 1
    measured = [record for record in steps if record["measured"]]
    assert metrics["window_s"] == pytest.approx(sum(record["step_time_s"] for record in measured), rel=1e-9)
    assert all(record["step_time_s"] > 0 and math.isfinite(record["loss"]) for record in measured)
