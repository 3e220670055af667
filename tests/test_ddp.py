"""ftbench.train.ddp, launcher side, with torchrun stood in for by hand-written rank results (real DDP runs over
gloo: tests/test_families.py and tests/test_faults.py)."""

from __future__ import annotations

import pytest

from ftbench import atomic
from ftbench.train import ddp, run_state
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


def fake_scontrol(job_nodes: str, node_addr: str):
    """scontrol as slurmctld answers it for job 1234 on ``job_nodes``, whose nodes have NodeAddr ``node_addr``."""
    def scontrol(*args):
        if args[:3] == ("-o", "show", "job") and args[3] == "1234":
            return f"JobId=1234 JobName=x ReqNodeList=(null) ExcNodeList=(null) NodeList={job_nodes} BatchHost=gpu07\n"
        if args[:3] == ("-o", "show", "node"):
            return f"NodeName={args[3]} Arch=x86_64 NodeAddr={node_addr} NodeHostName={args[3]} Port=6818\n"
        return None
    return scontrol


def test_srun_starts_one_torchrun_per_node_meeting_on_the_first_host(monkeypatch):
    monkeypatch.setattr(ddp, "first_host", lambda nodelist: {"gpu[07-08]": "gpu07"}[nodelist])
    monkeypatch.setattr(ddp, "_scontrol", fake_scontrol("gpu[07-08]", "gpu07"))
    # Inside the launcher's own step SLURM_JOB_NODELIST names that step's node only: the job's come from scontrol.
    command = ddp.slurm_command(NODES_SPEC, ["--spec", "{}"], {"SLURM_JOB_ID": "1234", "SLURM_JOB_NODELIST": "gpu07"})
    assert command[:7] == ["srun", "--overlap", "--nodes=2", "--ntasks=2", "--ntasks-per-node=1", "--gpus-per-node=4", "bash"]
    script = command[-1]
    assert script.startswith("exec ")
    # Each node's task expands its own node index; the first node's hosts the rendezvous store; the
    # rendezvous port follows the job id.
    assert '--node-rank="$SLURM_NODEID" --rdzv-conf=is_host=$(( SLURM_NODEID == 0 ))' in script
    assert f"--rdzv-endpoint=gpu07:{ddp.RDZV_PORT_BASE + 1234}" in script
    assert "--nnodes=2" in script and "--nproc-per-node=4" in script


def test_the_rendezvous_is_at_the_first_nodes_address(monkeypatch):
    """Node names need not be host names (several slurmd on one machine, or an address for another network):
    the rendezvous is where SLURM reaches the node, its NodeAddr."""
    monkeypatch.setattr(ddp, "first_host", lambda nodelist: "ftnode1")
    monkeypatch.setattr(ddp, "_scontrol", fake_scontrol("ftnode[1-2]", "127.0.0.1"))
    script = ddp.slurm_command(NODES_SPEC, [], {"SLURM_JOB_ID": "1234"})[-1]
    assert f"--rdzv-endpoint=127.0.0.1:{ddp.RDZV_PORT_BASE + 1234}" in script
    # scontrol silent: the node list of the environment and the node's name.
    monkeypatch.setattr(ddp, "_scontrol", lambda *args: None)
    script = ddp.slurm_command(NODES_SPEC, [], {"SLURM_JOB_ID": "1234", "SLURM_JOB_NODELIST": "ftnode[1-2]"})[-1]
    assert f"--rdzv-endpoint=ftnode1:{ddp.RDZV_PORT_BASE + 1234}" in script


def test_srun_runs_without_the_launcher_steps_slurm_variables():
    environ = {"SLURM_JOB_ID": "7", "SLURM_CONF": "/etc/x.conf", "SLURM_NNODES": "1", "SLURM_NTASKS": "1",
               "SLURM_STEP_ID": "0", "SRUN_CPUS_PER_TASK": "4", "PATH": "/bin", "OMP_NUM_THREADS": "2"}
    assert ddp.srun_environment(environ) == {"SLURM_JOB_ID": "7", "SLURM_CONF": "/etc/x.conf", "PATH": "/bin",
                                             "OMP_NUM_THREADS": "2"}


def test_a_rank_names_its_slurm_node(monkeypatch):
    monkeypatch.setenv("SLURMD_NODENAME", "gpu08")
    assert ddp.host_name() == "gpu08"
    monkeypatch.delenv("SLURMD_NODENAME")
    import socket
    assert ddp.host_name() == socket.gethostname()


def test_a_multi_node_run_outside_slurm_says_so():
    with pytest.raises(RuntimeError, match="inside a SLURM job"):
        ddp.slurm_command(NODES_SPEC, [], {})
