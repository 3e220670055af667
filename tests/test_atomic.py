"""Atomic result writes (scripts/ftbench/atomic.py): whole files only, readable as the umask allows."""

from __future__ import annotations

import os
import stat

import pandas as pd
import pytest

from ftbench import atomic


@pytest.fixture
def umask():
    """Set a umask for one test and restore the previous one afterwards."""
    previous = os.umask(0o022)
    yield lambda mask: os.umask(mask)
    os.umask(previous)


@pytest.mark.parametrize("mask, mode", [(0o022, 0o644), (0o002, 0o664), (0o077, 0o600)])
def test_results_get_the_mode_the_umask_allows(tmp_path, umask, mask, mode):
    """A teammate on a shared file system can read report.html and metrics.parquet (not 0600 as mkstemp
    makes them), unless the user's umask says otherwise."""
    umask(mask)
    writers = {
        "metrics.json": lambda path: atomic.write_json(path, {"status": "ok"}),
        "report.html": lambda path: atomic.write_text(path, "<html></html>"),
        "metrics.parquet": lambda path: atomic.write_parquet(path, pd.DataFrame({"x": [1]})),
        "metrics.csv": lambda path: atomic.write_csv(path, pd.DataFrame({"x": [1]})),
    }
    for name, write in writers.items():
        write(tmp_path / name)
        assert stat.S_IMODE((tmp_path / name).stat().st_mode) == mode, name


def test_a_failed_write_leaves_the_previous_file_and_no_temporary(tmp_path):
    target = tmp_path / "metrics.json"
    target.write_text("previous\n")
    with pytest.raises(TypeError):
        atomic.write_json(target, {"value": object()})
    assert target.read_text() == "previous\n"
    assert [path.name for path in tmp_path.iterdir()] == ["metrics.json"]
