"""ftbench.train.ddp, launcher side, with torchrun stood in for by hand-written rank results (real DDP runs over
gloo: tests/test_families.py and tests/test_faults.py)."""

from __future__ import annotations

import pytest

from ftbench import atomic
from ftbench.train import ddp, run_state, trainer
from ftbench.runspec import RunSpec

SPEC = RunSpec(run_id="r", parallel="ddp", num_gpus=2, device="cpu")


def torchrun_leaving(*ranks: tuple[str, bool]):
    """A stand-in for ddp.run_ddp whose ranks end with these (status_reason, terminated)."""

    def run(spec, data_dir, rank_dir, threads, time_limit_s) -> int:
        for rank, (reason, terminated) in enumerate(ranks):
            metrics = {"run_id": spec.run_id, "status": "timeout", "status_reason": reason, "device": "cpu",
                       "world_size": 2, "window_s": None}
            atomic.write_json(rank_dir / f"rank{rank}.json",
                              {"rank": rank, "metrics": metrics, "steps": [], "terminated": terminated})
        return 0

    return run


@pytest.mark.parametrize("terminated_rank", [0, 1])
def test_a_rank_asked_to_terminate_makes_the_run_terminated(tmp_path, monkeypatch, terminated_rank):
    """Whichever rank got SIGTERM, the run counts as terminated, also when the merged status_reason names
    another rank (the one that stopped because its peer did)."""
    reasons = ["another rank stopped at step 2 of 9"] * 2
    reasons[terminated_rank] = "terminated by the scheduler (SIGTERM) at step 2 of 9"
    monkeypatch.setattr(ddp, "run_ddp", torchrun_leaving(*((r, i == terminated_rank) for i, r in enumerate(reasons))))
    stop = run_state.StopSignal()
    metrics, _ = ddp.launch(SPEC, "data", tmp_path / "ranks", None, None, stop)
    assert stop.terminate_requested
    assert metrics["status"] == "timeout" and metrics["status_reason"].startswith("rank 0: ")


def test_a_deadline_stop_is_not_a_termination(tmp_path, monkeypatch):
    monkeypatch.setattr(ddp, "run_ddp", torchrun_leaving(("stopped before the job's time limit at step 2 of 9", False),
                                                         ("another rank stopped at step 2 of 9", False)))
    stop = run_state.StopSignal()
    metrics, _ = ddp.launch(SPEC, "data", tmp_path / "ranks", None, None, stop)
    assert not stop.terminate_requested
    assert metrics["status"] == "timeout"


# ---------------------------------------------------------------------------------------------------
# Multi-node launch (num_nodes > 1): one torchrun per node through srun


NODES_SPEC = RunSpec(run_id="r", parallel="fsdp", num_gpus=4, num_nodes=2, device="auto")


def test_a_node_torchrun_joins_a_c10d_rendezvous():
    command = ddp.node_command(NODES_SPEC, ["--spec", "{}"], "1", "gpu01:29600", "77")
    assert command[1:3] == ["-m", "torch.distributed.run"]
    for flag in ("--nnodes=2", "--nproc-per-node=4", "--node-rank=1", "--rdzv-backend=c10d",
                 "--rdzv-endpoint=gpu01:29600", "--rdzv-id=77"):
        assert flag in command
    assert "--standalone" not in command
    assert command[-4:] == ["ftbench", "train", "--spec", "{}"]


def test_srun_starts_one_torchrun_per_node_meeting_on_the_first_host(monkeypatch):
    monkeypatch.setattr(ddp, "first_host", lambda nodelist: {"gpu[07-08]": "gpu07"}[nodelist])
    command = ddp.slurm_command(NODES_SPEC, ["--spec", "{}"], {"SLURM_JOB_ID": "1234", "SLURM_JOB_NODELIST": "gpu[07-08]"})
    assert command[:6] == ["srun", "--overlap", "--nodes=2", "--ntasks-per-node=1", "--gpus-per-node=4", "bash"]
    script = command[-1]
    assert script.startswith("exec ")
    # Each node's task expands its own node index; the rendezvous port follows the job id.
    assert '--node-rank="$SLURM_NODEID"' in script
    assert f"--rdzv-endpoint=gpu07:{ddp.RDZV_PORT_BASE + 1234}" in script
    assert "--nnodes=2" in script and "--nproc-per-node=4" in script


def test_a_multi_node_run_outside_slurm_says_so():
    with pytest.raises(RuntimeError, match="inside a SLURM job"):
        ddp.slurm_command(NODES_SPEC, [], {})
