"""The conda environments (envs/*.yaml) the rules use with --use-conda.

Creating them needs conda and conda-forge, which CI has not: Debian 12 packages no conda, PyPI's `conda`
stops at 4.3.16 (Python 2 era) and conda-forge itself is out of reach. So these tests check that they
pin what requirements.txt pins, that the post-deploy scripts install ftbench and the asset packages
the default experiment reads, that every rule names one, and that `snakemake -n --use-conda` plans the
workflow with them (against a stand-in `conda` that answers only the queries Snakemake makes before
creating anything). Untested here: the solve and install themselves, and running a rule in them.
"""

from __future__ import annotations

import json
import os
import re
import stat
import sys
from pathlib import Path

import pytest
import yaml

from conftest import ROOT, job_counts, run_snakemake, snakemake_failure, tiny_config, write_config

ENVS = sorted((ROOT / "envs").glob("*.yaml"))


def requirement_pins() -> dict[str, str]:
    pins = {}
    lines = (ROOT / "requirements.txt").read_text().splitlines() + (ROOT / "requirements-gpu.txt").read_text().splitlines()
    for line in lines:
        match = re.fullmatch(r"([A-Za-z0-9_.\-]+)==(\S+)", line.split("#")[0].strip())
        if match:
            pins[match.group(1).lower()] = match.group(2)
    return pins


def env_pins(path: Path) -> dict[str, str]:
    pins = {}
    for dependency in yaml.safe_load(path.read_text())["dependencies"]:
        for item in dependency["pip"] if isinstance(dependency, dict) else []:
            name, _, version = item.partition("==")
            assert version, f"{path.name}: {item} is not pinned with =="
            pins[name.lower()] = version
    return pins


def test_envs_pin_the_versions_requirements_pin():
    wanted = requirement_pins()
    assert [path.name for path in ENVS] == ["analysis.yaml", "train.yaml"]
    for path in ENVS:
        pins = env_pins(path)
        assert pins, path
        for name, version in pins.items():
            assert wanted.get(name) == version, f"{path.name}: {name}=={version}, requirements.txt has {wanted.get(name)}"
    assert {"torch", "transformers", "peft", "bitsandbytes", "datasets", "nvidia-ml-py", "pyarrow", "pandas"} <= set(
        env_pins(ROOT / "envs" / "train.yaml")
    )
    assert {"pandas", "pyarrow", "matplotlib", "seaborn"} <= set(env_pins(ROOT / "envs" / "analysis.yaml"))


def test_post_deploy_scripts_install_ftbench_and_the_assets():
    """Snakemake runs envs/NAME.post-deploy.sh inside the new environment, from a copy under
    .snakemake/conda/: the scripts find the repository through FTBENCH_ROOT, which the Snakefile sets."""
    for path in ENVS:
        script = path.with_name(f"{path.stem}.post-deploy.sh").read_text()
        assert 'pip install --no-deps -e "$FTBENCH_ROOT"' in script, path
        assert "set -euo pipefail" in script
    train = (ROOT / "envs" / "train.post-deploy.sh").read_text()
    assert 'pip install --no-deps -r "$FTBENCH_ROOT/requirements-assets.txt"' in train
    assert 'os.environ.update(FTBENCH_ROOT=str(workflow.basedir))' in (ROOT / "rules" / "common.smk").read_text()


def test_every_rule_with_a_command_names_an_env():
    for smk in sorted((ROOT / "rules").glob("*.smk")):
        for block in re.split(r"\n(?=rule \w+:)", smk.read_text()):
            if block.startswith("rule ") and "shell:" in block:
                match = re.search(r'conda:\s*\n\s*"\.\./(envs/\w+\.yaml)"', block)
                assert match, f"{smk.name}: {block.splitlines()[0]} has no conda: env"
                assert (ROOT / match.group(1)).is_file()


FAKE_CONDA = """#!/bin/sh
case "$1" in
  info) echo '{info}' ;;
  --version) echo "conda 24.11.0" ;;
  config) echo '{{"get": {{"channel_priority": "strict"}}}}' ;;
  *) echo "stand-in conda: $*: not available in this test" >&2; exit 1 ;;
esac
"""


@pytest.mark.slow
def test_dry_run_with_use_conda_plans_every_job(tmp_path, tiny_model_dir, tiny_csv, monkeypatch):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    info = {"conda_version": "24.11.0", "conda_prefix": str(tmp_path / "conda"), "root_prefix": str(tmp_path / "conda"),
            "envs_dirs": [str(tmp_path / "conda" / "envs")], "platform": "linux-64", "channels": []}
    conda = bin_dir / "conda"
    conda.write_text(FAKE_CONDA.format(info=json.dumps(info)))
    conda.chmod(conda.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    workdir = tmp_path / "workflow"
    write_config(workdir, tiny_config(tiny_model_dir, tiny_csv))
    process = run_snakemake(workdir, "-n", "--use-conda")
    assert process.returncode == 0, snakemake_failure(process)
    assert job_counts(process) == {"prepare_data": 1, "train": 2, "collect": 1, "report": 1, "all": 1}, process.stdout[-3000:]
