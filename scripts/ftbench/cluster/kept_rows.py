"""A run's row kept where Snakemake does not delete it, so that a job the scheduler ends after writing it (or
while it stops) does not lose it.

Snakemake deletes the outputs of a job that failed, and SLURM's time limit, preemption or a node's end fail a
job whatever it had written: a `timeout` row on disk a second before the limit was deleted with the job, and
the run trained again, to the same limit. So a train job writes its row twice: first into ``kept/`` beside its
outputs (not an output: Snakemake leaves it), then the outputs. A job that finds its run's outputs missing but a
kept row of the same settings publishes that row as its outputs instead of training (``adopt``); it says so in
its log. A job stopped by the scheduler's limit before it could write its outputs keeps its `timeout` row there
the same way (train/job.py).

A kept row is only a safeguard for the job that wrote it: once the workflow sees the outputs it was published
as, it is dropped (``forget_published``, when the next invocation starts), so forcing a run to train again
(``--forcerun``, or deleting ``results/runs/<run_id>/``) trains it.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Iterable

from ftbench import atomic

KEPT = "kept"
# The files of a row, metrics.json last: its presence means the others are complete (train/job.py).
ROW_FILES = ("steps.parquet", "evals.parquet", "metrics.json")


# The line of the job that kept the row (why the scheduler ended it, the walltime to ask for): a retry that keeps the
# row says it again, since Snakemake's retry writes the run's log anew.
ENDING = "ending.txt"


def keep_ending(out: Path, line: str) -> None:
    atomic.write_text(kept_dir(out) / ENDING, line + "\n")


def kept_ending(out: Path) -> str | None:
    """The line the job that kept the row of ``out`` ended with, or None."""
    try:
        return (kept_dir(out) / ENDING).read_text(encoding="utf-8").strip() or None
    except OSError:
        return None


def kept_dir(out: Path) -> Path:
    """Where the row of the run whose metrics.json is ``out`` is kept."""
    return Path(out).parent / KEPT


def kept_row(out: Path, spec: dict) -> dict | None:
    """The kept result (metrics.json's content) of the run ``spec`` (its settings, RunSpec.to_dict()) whose outputs
    are ``out``'s folder, or None: none kept, incomplete, unreadable, or another run's settings."""
    folder = kept_dir(out)
    if not all((folder / name).is_file() for name in ROW_FILES):
        return None
    try:
        result = json.loads((folder / "metrics.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return result if isinstance(result, dict) and _same(result.get("spec"), spec) else None


def _same(one, other) -> bool:
    """Equal as written to JSON (a tuple is a list there)."""
    return json.dumps(one, sort_keys=True, default=str) == json.dumps(other, sort_keys=True, default=str)


def publish(out: Path) -> None:
    """Copy the kept row to the run's outputs (each file atomically, metrics.json last)."""
    folder = kept_dir(out)
    for name in ROW_FILES:
        with atomic.atomic_path(Path(out).with_name(name)) as temporary:
            shutil.copyfile(folder / name, temporary)


def adopt(out: Path, spec: dict, inputs: Iterable[Path] = ()) -> dict | None:
    """Publish the kept row of ``spec`` as its outputs when they are missing; its result (metrics.json's content),
    or None when there is nothing to adopt: a kept row of other settings, or older than one of ``inputs`` (its data
    prepared again since), is dropped."""
    if Path(out).exists():
        return None
    result = kept_row(out, spec)
    if result is not None and _older_than(kept_dir(out) / "metrics.json", inputs):
        result = None
    if result is None:
        forget(out)
        return None
    publish(out)
    return result


def _older_than(path: Path, inputs: Iterable[Path]) -> bool:
    written = path.stat().st_mtime
    return any(Path(item).is_file() and Path(item).stat().st_mtime > written for item in inputs)


def forget(out: Path) -> None:
    shutil.rmtree(kept_dir(out), ignore_errors=True)


def forget_published(outs: Iterable[Path]) -> int:
    """Drop the kept rows whose outputs exist (published: the job that wrote them ended well); how many."""
    dropped = 0
    for out in map(Path, outs):
        if out.is_file() and kept_dir(out).is_dir():
            forget(out)
            dropped += 1
    return dropped

