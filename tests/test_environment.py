"""ftbench.measure.environment: the git commit comes from the job's working directory, not from where ftbench is
installed."""

from __future__ import annotations

import subprocess

from ftbench.measure import environment


def test_git_commit_of_the_working_directory(tmp_path, monkeypatch):
    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(tmp_path), *args], capture_output=True, text=True, check=True).stdout

    git("init", "-q")
    git("-c", "user.name=t", "-c", "user.email=t@example.com", "commit", "-q", "--allow-empty", "-m", "start")
    monkeypatch.chdir(tmp_path)
    assert environment.git_commit() == git("rev-parse", "HEAD").strip()


def test_no_git_commit_outside_a_checkout(tmp_path, monkeypatch):
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path.parent))  # not the checkout tmp_path may lie in
    monkeypatch.chdir(tmp_path)
    assert environment.git_commit() is None
