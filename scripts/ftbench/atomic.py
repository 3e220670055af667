"""Atomic file writes: a reader sees either the old file, the whole new file, or no file.

A job killed mid-write (walltime, OOM killer, Ctrl-C) must never leave half a JSON or Parquet file that a
later stage would read as a result. Each writer writes a temporary file in the same folder (so the
rename stays on one file system), flushes it to disk, then renames it over the target.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any, Iterator


@contextlib.contextmanager
def atomic_path(target: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path next to ``target``; rename it onto ``target`` if the block succeeds."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    # mkstemp creates the file readable by its owner only (0600); a result must be readable as any file
    # the user writes (teammates on a shared cluster file system), so give it the mode the umask allows.
    os.fchmod(fd, 0o666 & ~_current_umask())
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        yield tmp
        with open(tmp, "rb+") as handle:
            os.fsync(handle.fileno())
        os.replace(tmp, target)
    except OSError as exc:
        if exc.errno is None:
            raise
        # A full disk or a file-size limit: say which result could not be written (the errno stays).
        raise OSError(exc.errno, f"{exc.strerror}: could not write {target} (left as it was; the partial "
                                 "temporary file is removed)") from exc
    finally:
        tmp.unlink(missing_ok=True)


def _current_umask() -> int:
    # The umask can only be read by setting it; set it straight back (one thread writes results).
    mask = os.umask(0)
    os.umask(mask)
    return mask


def write_text(target: str | os.PathLike, text: str) -> None:
    with atomic_path(target) as tmp:
        tmp.write_text(text, encoding="utf-8")


def write_json(target: str | os.PathLike, data: Any) -> None:
    write_text(target, json.dumps(data, indent=2, sort_keys=True, default=_json_default) + "\n")


def write_parquet(target: str | os.PathLike, frame) -> None:
    """Write a pandas DataFrame as Parquet (pyarrow), atomically."""
    with atomic_path(target) as tmp:
        frame.to_parquet(tmp, engine="pyarrow", index=False)


def write_csv(target: str | os.PathLike, frame) -> None:
    with atomic_path(target) as tmp:
        frame.to_csv(tmp, index=False)


def _json_default(value: Any) -> Any:
    # numpy scalars and paths appear in metrics; JSON has no type for them.
    if hasattr(value, "item"):
        return value.item()
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    raise TypeError(f"cannot write {type(value).__name__} to JSON")
