"""What a SLURM cluster offers, asked once while Snakemake submits with the slurm executor.

Two facts decide whether `snakemake --profile slurm` works on a given cluster, and neither is in the
profile because they differ between clusters:
- Job accounting (slurmdbd). The executor plugin tracks jobs with `sacct` by default; on a cluster
  without accounting `sacct` fails on every query and Snakemake waits forever without a word.
  `choose_status_command` switches to `squeue` there, and says so.
- The nodes of the partition a job goes to. A request no node can meet (more CPUs per GPU than a
  GPU node has) is refused by sbatch ("Requested node configuration is not available") and a retry
  would send the same request again: resources.py fits a training job's CPUs to `node_shapes`.

Only the submitting Snakemake asks (the jobs themselves run under the jobstep executor); each answer
is read once per invocation.
"""

from __future__ import annotations

import functools
import re
import subprocess
import sys
from dataclasses import dataclass


@dataclass(frozen=True)
class NodeShape:
    cpus: int
    gpus: int


def submits_to_slurm(workflow) -> bool:
    """Whether this Snakemake submits its jobs with the slurm executor (not inside a job, not locally)."""
    plugin = getattr(workflow, "executor_plugin", None)
    return plugin is not None and plugin.name == "slurm"


def accounting_error() -> str | None:
    """Why `sacct` cannot answer here (its first error line), or None when it works."""
    try:
        result = subprocess.run(["sacct", "-n", "-X", "-j", "1", "--format=JobID"], capture_output=True,
                                text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as error:
        return str(error)
    if result.returncode == 0:
        return None
    lines = [line.strip() for line in result.stderr.splitlines() if line.strip()]
    return lines[0] if lines else f"exit status {result.returncode}"


def choose_status_command(workflow) -> None:
    """Track jobs with squeue where sacct cannot answer (no accounting database), and say so.

    The plugin reads the setting on every status check, so changing it before the first submission is
    enough. A working sacct is left alone: it also sees jobs that left the queue long ago."""
    if not submits_to_slurm(workflow):
        return
    settings = workflow.executor_settings
    if getattr(settings, "status_command", None) != "sacct":
        return
    reason = accounting_error()
    if reason is None:
        return
    settings.status_command = "squeue"
    sys.stderr.write(
        f"ftbench: sacct does not work on this cluster ({reason}): tracking jobs with squeue instead "
        "(set `slurm-status-command: squeue` in your profile to skip this check)\n"
    )


@functools.lru_cache(maxsize=None)
def node_shapes(partition: str) -> tuple[NodeShape, ...]:
    """CPUs and GPUs of each node of ``partition`` ("" for the cluster's default one), from sinfo.

    Empty when sinfo cannot say (then nothing is fitted and SLURM judges the request)."""
    try:
        result = subprocess.run(["sinfo", "-h", "-N", "-o", "%P|%c|%G"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return ()
    if result.returncode != 0:
        return ()
    shapes = []
    for line in result.stdout.splitlines():
        parts = line.strip().split("|")
        if len(parts) != 3 or not parts[1].isdigit():
            continue
        name, cpus, gres = parts
        default = name.endswith("*")
        if (partition and name.rstrip("*") == partition) or (not partition and default):
            shapes.append(NodeShape(cpus=int(cpus), gpus=gres_gpus(gres)))
    return tuple(shapes)


def gres_gpus(gres: str) -> int:
    """GPUs in an sinfo %G field: "gpu:2", "gpu:a100:4(S:0-1)", "gpu:a100:4,gpu:v100:2", "(null)"."""
    return sum(int(count) for count in re.findall(r"(?:^|,)gpu(?::[^:,(]+)?:(\d+)", gres))
