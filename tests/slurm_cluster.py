"""A real SLURM cluster (Debian's slurmctld + slurmd + munge) for tests: one node, or several on one machine.

It installs nothing: `.ci/install-system.sh` installs the Debian packages. `SlurmCluster.start()` writes
the configuration, starts munged (unless one runs already), slurmctld and slurmd, and waits until the
nodes are IDLE; `stop()` stops exactly the daemons it started, by the PIDs they wrote, and puts back any
configuration files it replaced. `unavailable_reason()` says why a machine cannot run one (for a skip).
A second test run on the same machine waits for the first one's cluster to stop (a lock file).

The facts this rests on (why /etc/slurm/slurm.conf, fake GPUs, MinJobAge, ...) are in
shared/notes/slurm-on-one-machine.md. The node advertises more CPUs and memory than a CI machine
has (`SlurmdParameters=config_overrides`), so jobs shaped like real ones schedule side by side, and 2
fake GPUs (character devices like /dev/null) so GPU-requesting jobs schedule too;
`CUDA_VISIBLE_DEVICES` is set in those jobs, and torch still finds no CUDA device and uses the CPU.

Several nodes (``nodes=2``: ftnode1, ftnode2), for multi-node jobs: one slurmd per node on this machine,
the way SLURM's own "multiple slurmd" test setups run. Each node's line says `NodeHostname=<this host>
NodeAddr=127.0.0.1 Port=<its own>`; each slurmd is started with `-N <node>` (Debian's 22.05 slurmd takes
it, though not built with --enable-multiple-slurmd: checked, two nodes register and `srun -N2` runs one
task on each) and keeps its spool folder, pid file and log apart through `%n` (the node name) in
SlurmdSpoolDir, SlurmdPidFile and SlurmdLogFile. No network namespaces or /etc/hosts entries: the node
names resolve nowhere, so a job reaches another node by its NodeAddr (ftbench/train/ddp.py's rendezvous
does, as on a cluster whose node names are not host names), and a job step knows its node by
SLURMD_NODENAME (hostname is this machine's on every node). The two nodes share the fake GPU devices
(nothing opens them). One node is named after this host and started without -N, as on a real machine.
"""

from __future__ import annotations

import fcntl
import os
import re
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

SLURM_CONF = Path("/etc/slurm/slurm.conf")
GRES_CONF = Path("/etc/slurm/gres.conf")
MUNGE_KEY = Path("/etc/munge/munge.key")
MUNGE_RUN = Path("/run/munge")
# One SLURM test at a time on a machine: two would fight over /etc/slurm and the daemons' ports.
LOCK_FILE = Path("/tmp/ftbench-slurm-test.lock")

# What the node advertises (SlurmdParameters=config_overrides: slurmd believes slurm.conf, not the
# hardware): room for a few jobs shaped like real ones at once (4 CPUs per GPU, 8 for a CPU run, 8 GB
# each) on a 2-core CI machine. Nothing enforces them (no cgroups), and the test's jobs are tiny.
NODE_CPUS = 32
NODE_MIN_MEMORY_MB = 32768
NODE_GPUS = 2
PARTITION = "debug"  # the default partition
GPU_PARTITION = "gpu"  # the same node again, for tests that route GPU jobs to their own partition
NODE_PREFIX = "ftnode"  # names of the nodes of a cluster of several (ftnode1, ftnode2, ...)
SLURMD_PORT_BASE = 6821  # their slurmd ports: one each, from here up


class ClusterUnavailable(RuntimeError):
    """This machine cannot run a test cluster now (the message says why)."""


def _acquire_lock(wait_s: float):
    handle = open(LOCK_FILE, "w")
    deadline = time.monotonic() + wait_s
    while True:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return handle
        except BlockingIOError:
            if time.monotonic() > deadline:
                handle.close()
                raise ClusterUnavailable(f"another SLURM test kept {LOCK_FILE} for over {wait_s:.0f} s")
            time.sleep(1)


def unavailable_reason() -> str | None:
    """Why no cluster can be started here (a skip reason), or None."""
    missing = [name for name in ("slurmctld", "slurmd", "munged", "sbatch", "squeue", "scontrol") if not _which(name)]
    if missing:
        return f"SLURM is not installed (missing {', '.join(missing)}); run `bash .ci/install-system.sh` as root"
    if os.geteuid() != 0:
        return "starting SLURM daemons needs root"
    return None


def _foreign_daemons() -> str | None:
    for name in ("slurmctld", "slurmd"):
        if _running(name):
            return f"a {name} that this test did not start is running; not touching it"
    return None


def _which(name: str) -> str | None:
    return shutil.which(name) or next(
        (str(Path(d) / name) for d in ("/usr/sbin", "/sbin") if (Path(d) / name).exists()), None
    )


def _running(name: str) -> bool:
    return bool(_pids_named(name))


class SlurmCluster:
    def __init__(self, root: Path, cpus: int = NODE_CPUS, nodes: int = 1):
        """``cpus``: CPUs each node advertises (a small number makes a node too small for the jobs' requests).
        ``nodes``: 1 gives one node named after this host; more gives that many nodes (NODE_PREFIX1, ...), each
        its own slurmd on this machine (the module's docstring says how)."""
        self.root = Path(root)
        self.cpus = cpus
        self.host = socket.gethostname().split(".")[0]
        self.nodes = [self.host] if nodes == 1 else [f"{NODE_PREFIX}{index}" for index in range(1, nodes + 1)]
        self.log_dir = self.root / "log"
        self.ctld_log = self.log_dir / "slurmctld.log"
        self.slurmd_logs = [self.log_dir / f"slurmd-{node}.log" for node in self.nodes]
        self.started: list[tuple[str, Path]] = []  # (name, pid file) of daemons this object started
        self._backups: dict[Path, Path | None] = {}
        self._lock = None
        self._stepds_before: set[int] = set()

    # -- configuration -------------------------------------------------------------------------------
    def _write_config(self) -> None:
        state, spool, run, dev = (self.root / name for name in ("state", "spool", "run", "dev"))
        for folder in (state, run, dev, self.log_dir, *(spool / node for node in self.nodes)):
            folder.mkdir(parents=True, exist_ok=True)
        for index in range(NODE_GPUS):
            device = dev / f"nvidia{index}"
            if not device.exists():
                subprocess.run(["mknod", str(device), "c", "1", "3"], check=True)
        mem_mib = max(_memory_mib() - 1024, NODE_MIN_MEMORY_MB)
        node_lines = "\n".join(self._node_line(node, index, mem_mib) for index, node in enumerate(self.nodes))
        slurm_conf = f"""\
# Written by tests/slurm_cluster.py for a single-node test cluster; put back when the test ends.
ClusterName=ftbench-test
SlurmctldHost={self.host}(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
MpiDefault=none
MailProg=/bin/true
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/filetxt
JobCompLoc={self.log_dir}/jobcomp.txt
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
SlurmdParameters=config_overrides
DefMemPerCPU=500
MinJobAge=600
ReturnToService=2
GresTypes=gpu
StateSaveLocation={state}
SlurmdSpoolDir={spool}/%n
SlurmctldPidFile={run}/slurmctld.pid
SlurmdPidFile={run}/slurmd-%n.pid
SlurmctldLogFile={self.ctld_log}
SlurmdLogFile={self.log_dir}/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
{node_lines}
PartitionName={PARTITION} Nodes=ALL Default=YES MaxTime=INFINITE State=UP
PartitionName={GPU_PARTITION} Nodes=ALL Default=NO MaxTime=INFINITE State=UP
"""
        gres_conf = "".join(f"NodeName={node} Name=gpu File={dev}/nvidia[0-{NODE_GPUS - 1}]\n" for node in self.nodes)
        for path, text in ((SLURM_CONF, slurm_conf), (GRES_CONF, gres_conf)):
            self._replace(path, text)

    def _node_line(self, node: str, index: int, mem_mib: int) -> str:
        line = f"NodeName={node} NodeAddr=127.0.0.1 CPUs={self.cpus} RealMemory={mem_mib} Gres=gpu:{NODE_GPUS} State=UNKNOWN"
        if len(self.nodes) == 1:
            return line  # slurmd finds its node by this host's name, on the default port
        # Several slurmd on this host: each is started with -N <node>, listens on its own port, and is
        # known to slurmctld by its node name; NodeHostname says they all run here.
        return f"{line} NodeHostname={self.host} Port={SLURMD_PORT_BASE + index}"

    def _replace(self, path: Path, text: str) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        backup = None
        if path.exists():
            backup = self.root / f"{path.name}.orig"
            shutil.copy2(path, backup)
        self._backups[path] = backup
        path.write_text(text)

    def _restore_config(self) -> None:
        for path, backup in self._backups.items():
            if backup is not None:
                shutil.copy2(backup, path)
            else:
                path.unlink(missing_ok=True)
        self._backups.clear()

    # -- daemons -------------------------------------------------------------------------------------
    def start(self, timeout_s: float = 60, lock_wait_s: float = 600) -> "SlurmCluster":
        """Start the cluster; waits up to ``lock_wait_s`` for another test's cluster on this machine to end.

        Raises ClusterUnavailable (a reason to skip) if daemons that are not ours already run.
        """
        self._lock = _acquire_lock(lock_wait_s)
        try:
            reason = unavailable_reason() or _foreign_daemons()
            if reason:
                raise ClusterUnavailable(reason)
            self._stepds_before = set(_pids_named("slurmstepd"))
            self._write_config()
            self._start_munge()
            self._daemon("slurmctld", ["-c"], self.root / "run" / "slurmctld.pid")  # -c: no old jobs
            for node in self.nodes:
                # -N only with several nodes: a lone node is this host, as on a real machine.
                self._daemon("slurmd", ["-N", node] if len(self.nodes) > 1 else [],
                             self.root / "run" / f"slurmd-{node}.pid")
            self._wait_idle(timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    def _start_munge(self) -> None:
        if not MUNGE_KEY.exists():
            subprocess.run(["mungekey", "--create"], check=True)
        shutil.chown(MUNGE_KEY, "munge", "munge")
        MUNGE_KEY.chmod(0o400)
        subprocess.run(["install", "-d", "-o", "munge", "-g", "munge", "-m", "0755", str(MUNGE_RUN)], check=True)
        if not _munge_works():
            subprocess.run(["runuser", "-u", "munge", "--", _which("munged")], check=True)
            self.started.append(("munged", MUNGE_RUN / "munged.pid"))
            deadline = time.monotonic() + 10
            while not _munge_works():
                if time.monotonic() > deadline:
                    raise RuntimeError("munged started but `munge -n | unmunge` fails")
                time.sleep(0.2)

    def _daemon(self, name: str, args: list[str], pid_file: Path) -> None:
        pid_file.unlink(missing_ok=True)
        subprocess.run([_which(name), *args], check=True, capture_output=True, text=True)
        self.started.append((name, pid_file))
        deadline = time.monotonic() + 15
        while not pid_file.exists() or not pid_file.read_text().strip():
            if time.monotonic() > deadline:
                raise RuntimeError(f"{name} wrote no pid file {pid_file}; its log:\n{self.tail_logs()}")
            time.sleep(0.1)

    def _wait_idle(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        states: dict[str, str] = {}
        while time.monotonic() < deadline:
            for node in self.nodes:
                result = subprocess.run(["scontrol", "show", "node", node], capture_output=True, text=True)
                match = re.search(r"State=(\S+)", result.stdout)
                states[node] = match.group(1) if match else result.stderr.strip()
            if all(state.startswith("IDLE") for state in states.values()):
                return
            time.sleep(0.5)
        raise RuntimeError(f"nodes not IDLE after {timeout_s:.0f} s (states {states}):\n{self.tail_logs()}")

    def stop(self) -> None:
        """Cancel the jobs still queued, stop every daemon this object started (last started first) and
        the job step daemons of its jobs, then put the config back."""
        if any(name == "slurmctld" for name, _ in self.started):
            self._cancel_all_jobs()
        for name, pid_file in reversed(self.started):
            _stop_pid_file(name, pid_file)
        self.started.clear()
        # A slurmstepd outlives slurmd while it retries to report its job's end: stop those of our jobs.
        for pid in set(_pids_named("slurmstepd")) - self._stepds_before:
            _stop_pid(pid, timeout_s=5)
        self._restore_config()
        if self._lock is not None:
            self._lock.close()
            self._lock = None

    def _cancel_all_jobs(self, timeout_s: float = 30) -> None:
        def live_jobs() -> list[str]:
            out = subprocess.run(["squeue", "-h", "-o", "%i"], capture_output=True, text=True, timeout=10)
            return out.stdout.split() if out.returncode == 0 else []

        jobs = live_jobs()
        if jobs:
            subprocess.run(["scancel", *jobs], capture_output=True, timeout=10)
        deadline = time.monotonic() + timeout_s
        while jobs and time.monotonic() < deadline:
            time.sleep(0.5)
            jobs = live_jobs()

    # -- queries -------------------------------------------------------------------------------------
    def submitted_job_ids(self) -> list[int]:
        """Ids of every batch job slurmctld accepted since it started (its log is the record)."""
        text = self.ctld_log.read_text(errors="replace") if self.ctld_log.exists() else ""
        return [int(n) for n in re.findall(r"_slurm_rpc_submit_batch_job: JobId=(\d+)", text)]

    def job_info(self, job_id: int) -> dict[str, str]:
        """`scontrol show job` as a dict (jobs stay known for MinJobAge = 600 s after they end)."""
        out = subprocess.run(["scontrol", "-o", "show", "job", str(job_id)], capture_output=True, text=True).stdout
        return dict(re.findall(r"(\S+?)=(\S*)", out))

    def tail_logs(self, lines: int = 30) -> str:
        parts = []
        for log in (self.ctld_log, *self.slurmd_logs):
            if log.exists():
                parts.append(f"--- {log}\n" + "\n".join(log.read_text(errors="replace").splitlines()[-lines:]))
        return "\n".join(parts)


def _munge_works() -> bool:
    try:
        credential = subprocess.run(["munge", "-n"], capture_output=True, timeout=5)
        if credential.returncode != 0:
            return False
        return subprocess.run(["unmunge"], input=credential.stdout, capture_output=True, timeout=5).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def _memory_mib() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) // 1024
    raise RuntimeError("no MemTotal in /proc/meminfo")


def _pids_named(name: str) -> list[int]:
    result = subprocess.run(["pgrep", "-x", name], capture_output=True, text=True)
    return [int(pid) for pid in result.stdout.split() if _alive(int(pid))]


def _stop_pid_file(name: str, pid_file: Path, timeout_s: float = 15) -> None:
    try:
        pid = int(pid_file.read_text().strip())
    except (OSError, ValueError):
        return
    _stop_pid(pid, timeout_s)


def _stop_pid(pid: int, timeout_s: float = 15) -> None:
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not _alive(pid):
            return
        time.sleep(0.1)
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie (exited, not yet reaped by its parent) counts as gone.
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"
    except (OSError, IndexError):
        return False
