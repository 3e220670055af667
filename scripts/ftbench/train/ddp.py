"""DDP runs: the launcher side (torchrun, one process per device, and the merged result) and the worker
side (one rank).

DDP and FSDP runs are started by the training job itself (``torchrun --standalone``, one process per
device), so the same rule works locally and inside one SLURM allocation. A multi-node run (num_nodes > 1,
SLURM only) starts one torchrun per node of the job's allocation with ``srun``, all meeting at a c10d
rendezvous on the allocation's first host; the job's own process (on the first node) stays the launcher. Each rank writes its own result file; the
launcher merges them after torchrun returns. No collective runs after training, so a rank that failed
cannot leave the others waiting.
"""

from __future__ import annotations

import datetime
import json
import os
import re
import shutil
import shlex
import signal
import socket
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch

from ftbench import atomic
from ftbench.train import modeling, trainer
from ftbench.cluster import lifeline
from ftbench.train.devices import Distributed, choose_device
from ftbench.errors import ManifestError, UnsupportedConfiguration
from ftbench.cluster.lifeline import alive
from ftbench.measure.metrics import failed_metrics, merge_ranks
from ftbench.runspec import RunSpec
from ftbench.train.run_state import StopSignal


def launch(spec: RunSpec, data_dir: str, rank_dir: Path, threads: int | None, time_limit_s: float | None,
           stop: StopSignal) -> tuple[dict, list[dict]]:
    """Launcher side of a DDP run: check it can run, start torchrun, merge the ranks' results.

    A termination request that reached any rank counts as the run's (``stop.terminate_requested``).
    """
    try:
        device, _ = choose_device(spec, Distributed())
        modeling.check_supported(spec, device, importing=False)
    except UnsupportedConfiguration as exc:
        return {"run_id": spec.run_id, "status": "unsupported", "status_reason": str(exc)}, []
    shutil.rmtree(rank_dir, ignore_errors=True)
    rank_dir.mkdir(parents=True)
    code = run_ddp(spec, data_dir, rank_dir, threads, time_limit_s)
    results = read_rank_results(rank_dir)
    if any(r["terminated"] for r in results):
        stop.terminate_requested = True
    devices = spec.devices
    stopped_early = [r for r in results if r["metrics"]["status"] != "ok"]
    if len(results) < devices and stopped_early:
        # A rank stopped early (OOM, divergence) and the others were ended while waiting for it: the
        # run's status is that rank's, from what it measured.
        print(f"{devices - len(results)} rank(s) ended without results after rank {stopped_early[0]['rank']} stopped early")
    elif len(results) < devices:
        # A rank died without writing its result (killed, segfault): no honest row can be made.
        raise RuntimeError(f"torchrun exited with {code}; {len(results)} of {devices} ranks wrote results (see the log above)")
    metrics, steps = merge_ranks(results, devices)
    metrics.pop("host", None)
    metrics["hosts"] = ",".join(sorted({r["metrics"]["host"] for r in results if r["metrics"].get("host")})) or None
    if len(results) < devices:
        metrics["status_reason"] += f"; {devices - len(results)} other rank(s) ended while waiting for it, without results"
    return metrics, steps


def run_rank(spec: RunSpec, data_dir: str, rank_dir: Path, threads: int | None, stop: StopSignal) -> None:
    """One DDP rank (started by torchrun): train, then write ``rank_dir/rank<R>.json``."""
    if threads:
        torch.set_num_threads(threads)
    dist = Distributed.from_env()
    use_cuda = spec.device != "cpu" and torch.cuda.is_available()
    if use_cuda:
        torch.cuda.set_device(dist.local_rank)
    # A bounded timeout: a rank stuck in a collective (a peer died) fails instead of hanging the job.
    timeout = datetime.timedelta(seconds=float(os.environ.get("FTBENCH_DDP_TIMEOUT_S", 600)))
    torch.distributed.init_process_group("nccl" if use_cuda else "gloo", timeout=timeout)
    try:
        metrics, steps = trainer.train_run(spec, data_dir, stop, dist)
    except BaseException as exc:
        # Peers may be waiting in a collective this rank will never join: destroying the process group
        # would wait for them too. Exit at once; torchrun and the launcher stop the others. An error
        # (not a signal or an exit) is first written as this rank's failed result: the run's row.
        traceback.print_exc()
        sys.stderr.flush()
        # Not when a peer already stopped with a result (OOM, divergence, an error): this rank's error is
        # then the consequence (gloo: connection closed by peer), and the run's row is the peer's.
        peer_stopped = any(r["metrics"]["status"] != "ok" for r in read_rank_results(rank_dir))
        if isinstance(exc, Exception) and not isinstance(exc, ManifestError) and not peer_stopped:
            atomic.write_json(rank_dir / f"rank{dist.rank}.json", {
                "rank": dist.rank, "metrics": {**failed_metrics(spec.run_id, exc), "rank": dist.rank}, "steps": [],
                "terminated": stop.terminate_requested})
        os._exit(1)
    metrics["rank"] = dist.rank
    metrics["host"] = host_name()  # a multi-node run's ranks run on several hosts
    atomic.write_json(rank_dir / f"rank{dist.rank}.json", {"rank": dist.rank, "metrics": metrics, "steps": steps,
                                                          "terminated": stop.terminate_requested})
    if metrics["status"] != "ok":
        sys.stdout.flush()
        os._exit(0)  # same reason: no collective after a rank stopped early (OOM, divergence)
    torch.distributed.destroy_process_group()


def ddp_command(processes: int, worker_args: list[str]) -> list[str]:
    return [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={processes}",
        "-m", "ftbench", "train", *worker_args,
    ]


def node_command(spec: RunSpec, worker_args: list[str], node_rank: str, endpoint: str, rdzv_id: str) -> list[str]:
    """One node's torchrun of a multi-node run: num_gpus processes here, num_nodes x num_gpus in all, meeting
    at the c10d rendezvous ``endpoint`` (host:port). ``node_rank``: a number, or "$SLURM_NODEID" for srun."""
    return [
        sys.executable, "-m", "torch.distributed.run", f"--nnodes={spec.num_nodes}",
        f"--nproc-per-node={max(1, spec.num_gpus)}", f"--node-rank={node_rank}", "--rdzv-backend=c10d",
        f"--rdzv-endpoint={endpoint}", f"--rdzv-id={rdzv_id}", "-m", "ftbench", "train", *worker_args,
    ]


def slurm_command(spec: RunSpec, worker_args: list[str], environ: dict | None = None) -> list[str]:
    """``srun`` of a multi-node run inside its SLURM job: one task per node, each a torchrun (node_command).
    Run it with srun_environment.

    --overlap: the job's own step (this launcher) already holds the first node's CPUs and GPUs, which its
    torchrun must use too. The job's nodes are slurmctld's (job_nodelist): inside the launcher's step the
    SLURM_* variables describe that step (Snakemake's jobstep plugin starts it with `srun -n1` after
    clearing them, and SLURM_JOB_NODELIST then names the step's one node). The rendezvous is on the first
    node, at the address SLURM reaches it by (rendezvous_host); its port follows the job id, so two
    multi-node jobs sharing a first node do not meet each other. The first node's torchrun hosts the
    rendezvous store (is_host): torch's own guess, "the endpoint is one of my addresses", is true of every
    node when several share a machine.
    """
    environ = os.environ if environ is None else environ
    job_id = environ.get("SLURM_JOB_ID")
    nodelist = job_id and (job_nodelist(job_id) or environ.get("SLURM_JOB_NODELIST") or environ.get("SLURM_NODELIST"))
    if not nodelist:
        raise RuntimeError(f"num_nodes {spec.num_nodes}: a multi-node run starts inside a SLURM job "
                           "(SLURM_JOB_ID and SLURM_JOB_NODELIST unset)")
    endpoint = f"{rendezvous_host(nodelist)}:{RDZV_PORT_BASE + int(job_id) % RDZV_PORT_SPAN}"
    torchrun = " ".join(shlex.quote(part) for part in node_command(spec, worker_args, "NODE_RANK", endpoint, job_id))
    # $SLURM_NODEID is each task's own node index: expanded by the task's shell, not here.
    script = "exec " + torchrun.replace("--node-rank=NODE_RANK", '--node-rank="$SLURM_NODEID" '
                                        '--rdzv-conf=is_host=$(( SLURM_NODEID == 0 ))')
    gpus = [f"--gpus-per-node={spec.num_gpus}"] if spec.uses_gpu else []
    return ["srun", "--overlap", f"--nodes={spec.num_nodes}", f"--ntasks={spec.num_nodes}", "--ntasks-per-node=1",
            *gpus, "bash", "-c", script]


def srun_environment(environ: dict) -> dict:
    """The environment of a multi-node run's srun: the launcher's, less the SLURM_* and SRUN_* variables of
    its own step (its SLURM_NNODES=1, SLURM_NTASKS=1, ... make srun see a one-node allocation: "Only
    allocated 1 nodes asked for 2"), so srun asks slurmctld for the job's; SLURM_JOB_ID (which job) and
    SLURM_CONF (which cluster) stay. srun gives each task its own SLURM_* (SLURM_NODEID, SLURMD_NODENAME)."""
    return {name: value for name, value in environ.items()
            if not name.startswith(("SLURM_", "SRUN_")) or name in ("SLURM_JOB_ID", "SLURM_CONF")}


def first_host(nodelist: str) -> str:
    """The first host of a SLURM node list ("gpu[01-04]" -> "gpu01"), as scontrol expands it."""
    return subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True,
                          check=True).stdout.split()[0]


def job_nodelist(job_id: str) -> str | None:
    """The nodes of a SLURM job (`scontrol show job`: "gpu[07-08]"), or None if scontrol does not say."""
    match = re.search(r"\bNodeList=(\S+)", _scontrol("-o", "show", "job", str(job_id)) or "")
    return match.group(1) if match and match.group(1) != "(null)" else None


def rendezvous_host(nodelist: str) -> str:
    """Where the other nodes reach the allocation's first node: its NodeAddr (`scontrol show node`), the
    address SLURM itself uses for it. That is the node name unless slurm.conf says otherwise (a node name
    that is no host name, or several nodes on one machine); the name if scontrol does not say."""
    node = first_host(nodelist)
    match = re.search(r"\bNodeAddr=(\S+)", _scontrol("-o", "show", "node", node) or "")
    return match.group(1) if match and match.group(1) != "(null)" else node


def _scontrol(*args: str) -> str | None:
    """scontrol's output, or None if it fails."""
    try:
        result = subprocess.run(["scontrol", *args], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return result.stdout if result.returncode == 0 else None


def host_name() -> str:
    """The node this rank runs on: SLURM's node name inside a SLURM job step (SLURMD_NODENAME, what the
    scheduler and its users call the node, and the one name that tells apart nodes sharing a machine),
    else the machine's host name."""
    return os.environ.get("SLURMD_NODENAME") or socket.gethostname()


# c10d rendezvous ports of multi-node runs: RDZV_PORT_BASE + job id modulo RDZV_PORT_SPAN.
RDZV_PORT_BASE = 29500
RDZV_PORT_SPAN = 20000


def worker_args(spec: RunSpec, data_dir: str, rank_dir: Path, threads: int | None, time_limit_s: float | None) -> list[str]:
    """``python -m ftbench train`` arguments of one rank (threads: this node's, shared by its processes)."""
    args = ["--spec", spec.to_json(), "--data", str(data_dir), "--rank-dir", str(rank_dir)]
    if threads:
        args += ["--threads", str(max(1, threads // max(1, spec.num_gpus)))]
    if time_limit_s:
        args += ["--time-limit-s", str(time_limit_s)]
    return args


def run_ddp(spec: RunSpec, data_dir: str, rank_dir: Path, threads: int | None, time_limit_s: float | None) -> int:
    """Start one process per device with torchrun (one torchrun per node); each writes ``rank_dir/rank<R>.json``
    (a multi-node run's rank_dir must be on a file system every node sees, as results/ is on a cluster)."""
    processes = max(1, spec.num_gpus)
    args = worker_args(spec, data_dir, rank_dir, threads, time_limit_s)
    env = dict(os.environ, OMP_NUM_THREADS=str(max(1, (threads or processes) // processes)))
    if spec.num_nodes > 1:
        command, env = slurm_command(spec, args), srun_environment(env)
    else:
        command = ddp_command(processes, args)
    process = subprocess.Popen(command, env=env)
    # If Snakemake dies (lifeline.py), the job ends its torchrun and ranks before it exits.
    end_all = lambda: end_torchrun(process, rank_dir, grace_s=1.0)  # noqa: E731
    lifeline.on_parent_death(end_all)
    try:
        return _wait_for_ranks(process, rank_dir)
    finally:
        lifeline.forget(end_all)


def _wait_for_ranks(process: subprocess.Popen, rank_dir: Path) -> int:
    stopped_at = None
    while process.poll() is None:
        time.sleep(1.0)
        if stopped_at is None and any(r["metrics"]["status"] in PEER_STUCK_STATUSES for r in read_rank_results(rank_dir)):
            stopped_at = time.monotonic()
        # A rank stopped early (OOM, divergence) and wrote its result; the others would wait for it in
        # their next collective until the process-group timeout. Give them a moment, then end them.
        if stopped_at is not None and time.monotonic() - stopped_at > RANK_GRACE_S:
            print(f"a rank stopped early and its peers still run {RANK_GRACE_S:g} s later (waiting for it in a "
                  "collective): ending them", flush=True)
            end_torchrun(process, rank_dir)
    return process.wait()


RANK_GRACE_S = 20.0
# A rank that ended with one of these stopped alone, so its peers may wait for it in a collective. A
# timeout is not one: every rank stops at the same step (trainer._stop_reason), and rank 0 then evaluates.
PEER_STUCK_STATUSES = ("failed", "oom", "diverged")
# Seconds a rank gets between SIGTERM and SIGKILL when its run is ended. A rank blocked in a collective
# (NCCL, gloo) does not run Python signal handlers, so only SIGKILL ends it.
RANK_KILL_GRACE_S = 5.0


def end_torchrun(process: subprocess.Popen, rank_dir: Path, grace_s: float | None = None) -> None:
    """End a torchrun launch and every rank it started.

    torchrun starts each rank in a session of its own, so signalling torchrun alone can leave a rank
    behind that holds its GPU's memory until the collective timeout; and torchrun's own shutdown waits
    30 s before it kills. So: SIGTERM each rank, SIGKILL those still there ``grace_s`` later, then the same
    for torchrun. Only torchrun's children running this run's worker command are signalled.
    """
    grace_s = RANK_KILL_GRACE_S if grace_s is None else grace_s
    ranks = [pid for pid in _children(process.pid) if str(rank_dir) in _cmdline(pid)]
    for pids, are_ranks in ((ranks, True), ([process.pid], False)):
        for pid in pids:
            _signal(pid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and any(alive(pid) for pid in pids) and process.poll() is None:
            time.sleep(0.2)
        for pid in pids:
            # A rank is checked again: once torchrun is gone its pid could be another process's.
            if alive(pid) and (not are_ranks or str(rank_dir) in _cmdline(pid)):
                _signal(pid, signal.SIGKILL)
    try:
        process.wait(timeout=grace_s + 30)
    except subprocess.TimeoutExpired:
        process.kill()


def _children(pid: int) -> list[int]:
    """Process ids whose parent is ``pid`` (Linux /proc)."""
    children = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                # /proc/<pid>/stat: "pid (comm) state ppid ...": split after the command, which may hold spaces.
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue
            if int(fields[1]) == pid:
                children.append(int(entry.name))
    return children


def _cmdline(pid: int) -> str:
    try:
        return (Path("/proc") / str(pid) / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def read_rank_results(rank_dir: Path) -> list[dict]:
    return [json.loads(path.read_text()) for path in sorted(rank_dir.glob("rank*.json"))]
