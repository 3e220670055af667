"""Fitting a training job's SLURM request to the partition's nodes (sinfo), and reading sinfo/sacct.

Fast: no cluster. The real cluster (tests/test_slurm.py) checks the same end to end, on a node with
fewer CPUs than a GPU job usually asks for.
"""

from __future__ import annotations

import subprocess

import pytest

from ftbench.cluster import resources, slurm
from ftbench.errors import FtbenchError
from ftbench.runspec import RunSpec

NODE = slurm.NodeShape


def gpu_run(num_gpus: int) -> RunSpec:
    return RunSpec(num_gpus=num_gpus, run_id=f"r{num_gpus}")


def cpu_run() -> RunSpec:
    return RunSpec(num_gpus=0, device="cpu", run_id="cpu")


def test_requests_are_unchanged_where_nodes_are_large_or_unknown():
    for nodes in ((), (NODE(64, 8),)):
        assert resources.train_cpus_per_gpu(gpu_run(2), nodes) == resources.TRAIN_CPUS_PER_GPU
        assert resources.train_threads(gpu_run(2), local=False, cores=2, nodes=nodes) == 2 * resources.TRAIN_CPUS_PER_GPU
        assert resources.train_threads(cpu_run(), local=False, cores=2, nodes=nodes) == resources.TRAIN_CPU_THREADS_CLUSTER


def test_requests_shrink_to_the_best_node_with_enough_gpus():
    nodes = (NODE(cpus=2, gpus=1), NODE(cpus=6, gpus=2), NODE(cpus=48, gpus=0))
    assert resources.train_cpus_per_gpu(gpu_run(1), nodes) == 4  # the 6-CPU node: 6 per GPU, capped at 4
    assert resources.train_cpus_per_gpu(gpu_run(2), nodes) == 3  # only the 6-CPU node has 2 GPUs
    assert resources.train_threads(gpu_run(2), local=False, cores=1, nodes=nodes) == 6
    assert resources.train_threads(cpu_run(), local=False, cores=1, nodes=(NODE(2, 2),)) == 2
    # Locally a run takes all cores, whatever sinfo would say.
    assert resources.train_threads(gpu_run(1), local=True, cores=3, nodes=nodes) == 3


def test_a_run_no_node_can_hold_is_refused_with_the_numbers():
    with pytest.raises(FtbenchError, match=r"run r4 asks for num_gpus 4 on one node, but the nodes .* have 2 GPUs/32 CPUs"):
        resources.train_cpus_per_gpu(gpu_run(4), (NODE(cpus=32, gpus=2),))


def test_training_partition_comes_from_the_environment():
    assert resources.train_partition({"FTBENCH_GPU_PARTITION": "gpu", "SBATCH_PARTITION": "cpu"}) == "gpu"
    assert resources.train_partition({"SBATCH_PARTITION": "cpu"}) == "cpu"
    assert resources.train_partition({}) == ""


@pytest.mark.parametrize("gres, gpus", [("gpu:2", 2), ("gpu:a100:4(S:0-1)", 4), ("gpu:a100:4,gpu:v100:2", 6),
                                        ("(null)", 0), ("gpu:h100:8(S:0-1),shard:8", 8)])
def test_gres_gpus(gres, gpus):
    assert slurm.gres_gpus(gres) == gpus


def test_node_shapes_of_a_named_or_the_default_partition(monkeypatch):
    sinfo = "debug*|32|(null)\ndebug*|16|(null)\ngpu|8|gpu:a100:2(S:0)\n"

    def fake_run(command, **kwargs):
        assert command[0] == "sinfo"
        return subprocess.CompletedProcess(command, 0, stdout=sinfo, stderr="")

    monkeypatch.setattr(slurm.subprocess, "run", fake_run)
    slurm.node_shapes.cache_clear()
    try:
        assert slurm.node_shapes("gpu") == (NODE(8, 2),)
        assert slurm.node_shapes("") == (NODE(32, 0), NODE(16, 0))
        assert slurm.node_shapes("missing") == ()
    finally:
        slurm.node_shapes.cache_clear()


def test_status_command_switches_to_squeue_only_where_sacct_fails(monkeypatch, capsys):
    class Plugin:
        name = "slurm"

    class Settings:
        status_command = "sacct"

    workflow = type("Workflow", (), {"executor_plugin": Plugin(), "executor_settings": Settings()})()
    monkeypatch.setattr(slurm, "accounting_error", lambda: None)
    slurm.choose_status_command(workflow)
    assert workflow.executor_settings.status_command == "sacct" and capsys.readouterr().err == ""
    monkeypatch.setattr(slurm, "accounting_error", lambda: "Slurm accounting storage is disabled")
    slurm.choose_status_command(workflow)
    assert workflow.executor_settings.status_command == "squeue"
    assert "sacct does not work on this cluster (Slurm accounting storage is disabled)" in capsys.readouterr().err
