"""A train job's progress line (train/progress.py) and its relay to a local invocation's terminal
(cluster/progress_relay.py). That the lines cost no throughput is measured, not asserted here:
scripts/benchmark_progress.py."""

from __future__ import annotations

import io
import os
import re

import torch

from conftest import ManualClock
from ftbench.cluster import progress_relay
from ftbench.measure.step_clock import LaggedLosses
from ftbench.train import progress


def test_a_line_after_the_first_step_then_one_per_cadence_whatever_the_step_rate():
    clock, out = ManualClock(100.0), io.StringIO()
    line = progress.Progress(total_steps=1000, every_s=30, out=out, clock=clock)
    losses = LaggedLosses(torch.device("cpu"), 1000)
    for step, at in enumerate([1, 2, 10, 29, 31, 32, 50, 60.9, 61.5, 200]):
        clock.now = 100 + at
        losses.put(step, torch.tensor(float(step)))
        line.step_done(step, tokens=50, losses=losses)
    lines = out.getvalue().splitlines()
    # After step 1 (t=1), then the first step at or past t=1+30 (step 5, t=31), t=61.5 (step 9), t=200 (step 10).
    assert [re.search(r"step (\d+) of 1000", text).group(1) for text in lines] == ["1", "5", "9", "10"]
    assert all(text.startswith(progress_relay.PREFIX) for text in lines)
    # The loss of the step just done (a CPU's losses are on the host at once); tokens/s over the elapsed time.
    assert lines[1].endswith("loss 4") and "5 of 1000 (0%)" in lines[1]
    assert "250 tokens/s" not in lines[1] and f"{5 * 50 / 31:,.0f} tokens/s" in lines[1]
    assert "31s elapsed, about 1h42m left" in lines[1]  # 995 more steps at 6.2 s a step


def test_the_time_limit_is_named_when_it_comes_before_the_end_and_ranks_count_in_the_rate():
    clock, out = ManualClock(100.0), io.StringIO()
    line = progress.Progress(total_steps=100, ranks=4, deadline=100 + 120, out=out, clock=clock)
    clock.now = 110
    line.step_done(0, tokens=1000)
    (text,) = out.getvalue().splitlines()
    assert "400 tokens/s" in text  # 4 ranks of 1000 tokens each in 10 s
    assert "about 16m30s left at this pace; its time limit stops it in 1m50s" in text
    assert text.endswith("loss pending")  # no losses given: none read


def test_other_ranks_stay_silent():
    out = io.StringIO()
    line = progress.Progress(total_steps=10, enabled=False, out=out)
    for step in range(10):
        line.step_done(step, tokens=5)
    assert out.getvalue() == "" and line.tokens == 50


def test_the_loss_shown_is_one_already_on_the_host():
    """A copy still in flight (its event not done) is skipped for an older one; nothing waits."""

    class Event:
        def __init__(self, done):
            self.done = done

        def query(self):
            return self.done

        def synchronize(self):
            raise AssertionError("a progress line must not wait for the device")

    losses = LaggedLosses(torch.device("cpu"), 10)
    for step in range(4):
        losses.host[step] = 10.0 + step
    losses.copied = {3: Event(False), 2: Event(False), 1: Event(True)}
    assert progress.ready_loss(losses, 3) == 11.0
    losses.copied = {step: Event(False) for step in range(4)}
    assert progress.ready_loss(losses, 3) is None


def test_duration_words():
    assert [progress.duration(s) for s in (0, 12.4, 250, 3600 * 2 + 300)] == ["0s", "12s", "4m10s", "2h05m"]


def test_the_relay_prints_each_running_jobs_latest_line_once(tmp_path):
    logs = tmp_path / "logs" / "train"
    logs.mkdir(parents=True)
    old = logs / "old-run.log"
    old.write_text("progress: step 9 of 9 (100%), ...\n")
    os.utime(old, (1000, 1000))  # an earlier invocation's log
    running = logs / "run-a.log"
    running.write_text("loading\nprogress: step 1 of 50 (2%), 10 tokens/s\nprogress: step 7 of 50 (14%), 12 tokens/s\n")
    quiet = logs / "run-b.log"
    quiet.write_text("loading the model\n")
    out = io.StringIO()
    relay = progress_relay.Relay(logs, since=2000, out=out)
    assert relay.tell() == ["ftbench: run-a: step 7 of 50 (14%), 12 tokens/s"]
    assert relay.tell() == []  # nothing new: no line
    with open(running, "a") as handle:
        handle.write("progress: step 12 of 50 (24%), 12 tokens/s\n")
    assert relay.tell() == ["ftbench: run-a: step 12 of 50 (24%), 12 tokens/s"]
    assert out.getvalue().count("ftbench: run-a:") == 2
