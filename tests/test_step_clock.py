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
        config["defaults"].update({"device": "cpu", "num_gpus": 0, **settings})  # settings may name another device
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


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_a_gpu_event_timed_steps_add_up_to_the_window_and_a_nan_stops_before_the_next_update(make_cpu_spec,
                                                                                                prepared_data, monkeypatch):
    """The CUDA half of the clock (events, pinned loss copies), where CI cannot reach it: the steps' event times add up
    to the host-timed window, and a NaN in the window (fused AdamW: read a step late) still ends the run at its step.
    The clock reads finished steps every 4 here (HARVEST_EVERY), so that reading runs on the GPU too."""
    monkeypatch.setattr(step_clock, "HARVEST_EVERY", 4)
    metrics, steps = trainer.train_run(make_cpu_spec(device="auto", num_gpus=1, max_steps=12, warmup_steps=2),
                                       prepared_data[0])
    measured = [record for record in steps if record["measured"]]
    assert metrics["status"] == "ok" and metrics["device"] == "cuda" and len(measured) == 10
    assert sum(record["step_time_s"] for record in measured) == pytest.approx(metrics["window_s"], rel=0.02)
    assert all(math.isfinite(record["loss"]) for record in measured)
    monkeypatch.setenv("FTBENCH_INJECT_FAULT", "nan@6")
    metrics, steps = trainer.train_run(make_cpu_spec(device="auto", num_gpus=1, max_steps=12, warmup_steps=2),
                                       prepared_data[0])
    assert metrics["status"] == "diverged" and metrics["diverged_step"] == 6 and metrics["last_step"] == 6
    assert [record["step"] for record in steps] == [0, 1, 2, 3, 4, 5]


def test_a_long_window_reads_finished_steps_as_it_goes_and_keeps_every_steps_time(monkeypatch):
    """One marker per step held to the end would keep a CUDA event per step alive for the whole run: past
    HARVEST_EVERY the finished steps are read and let go, the newest two kept for the window's end."""
    now = [0.0]
    monkeypatch.setattr(step_clock.time, "perf_counter", lambda: now[0])
    clock = StepClock(CPU)
    clock.start(0.0)
    steps = 3 * step_clock.HARVEST_EVERY + 7
    for step in range(steps):
        now[0] += 0.001 * (1 + step % 5)
        clock.boundary(step)
        assert len(clock.ends) <= step_clock.HARVEST_EVERY
    seconds = clock.step_seconds()
    assert list(seconds) == list(range(steps))
    assert seconds == {step: pytest.approx(0.001 * (1 + step % 5)) for step in range(steps)}
    assert clock.host_time_of(steps - 2) == pytest.approx(now[0] - 0.001 * (1 + (steps - 1) % 5))
