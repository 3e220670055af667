"""ftbench.cluster.gpu_slots: distinct GPUs for local jobs running at the same time."""

from __future__ import annotations

import os
import threading

from ftbench.cluster.gpu_slots import GpuSlots, assign_gpus
from ftbench.cluster import gpu_slots


class Acquiring:
    """``slots.acquire(count, total)`` in a background thread, so a test can see it wait (and never hangs)."""

    def __init__(self, slots: GpuSlots, count: int, total: int = 2):
        self.result: list = []
        self.messages: list = []
        self.thread = threading.Thread(target=lambda: self.result.append(
            slots.acquire(count, total, poll_s=0.02, log=self.messages.append)), daemon=True)
        self.thread.start()

    def get(self, timeout: float):
        """The GPUs it got, or None if it is still waiting after ``timeout`` seconds."""
        self.thread.join(timeout)
        return self.result[0] if self.result else None


def test_gpu_slots_give_distinct_gpus_and_a_third_holder_waits(tmp_path):
    first, second, third = (GpuSlots(tmp_path / "locks") for _ in range(3))
    assert Acquiring(first, 1).get(5) == [0]
    assert Acquiring(second, 1).get(5) == [1]
    waiting = Acquiring(third, 1)
    assert waiting.get(0.3) is None  # both GPUs held: it waits instead of sharing one
    assert len(waiting.messages) == 1 and "waiting" in waiting.messages[0]
    second.release()
    assert waiting.get(5) == [1]  # it gets the GPU that was freed, not the one still held
    first.release()
    third.release()


def test_gpu_slots_two_gpu_job_waits_for_both_without_holding_one(tmp_path):
    holder, job, other = (GpuSlots(tmp_path) for _ in range(3))
    assert Acquiring(holder, 1).get(5) == [0]
    waiting = Acquiring(job, 2)
    assert waiting.get(0.2) is None  # one free GPU is not enough...
    assert Acquiring(other, 1).get(2) == [1]  # ...and the waiting job does not sit on the free one
    other.release()
    holder.release()
    assert waiting.get(5) == [0, 1]
    job.release()


def test_gpu_slots_more_than_the_machine_has_gives_none(tmp_path):
    assert GpuSlots(tmp_path).acquire(3, total=2) == []


def test_assign_gpus_sets_distinct_visible_devices(tmp_path, monkeypatch):
    monkeypatch.setattr(gpu_slots, "visible_gpu_count", lambda: 2)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "placeholder")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    first, second = GpuSlots(tmp_path), GpuSlots(tmp_path)
    assert assign_gpus(1, first) == "0"
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")  # the second job is another process with its own environment
    assert assign_gpus(1, second) == "1"
    first.release()
    second.release()


def test_assign_gpus_leaves_a_scheduler_choice_alone(tmp_path, monkeypatch):
    monkeypatch.setattr(gpu_slots, "visible_gpu_count", lambda: 2)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    assert assign_gpus(1, GpuSlots(tmp_path)) is None
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    monkeypatch.setenv("SLURM_JOB_ID", "42")
    assert assign_gpus(1, GpuSlots(tmp_path)) is None
    assert "CUDA_VISIBLE_DEVICES" not in os.environ
