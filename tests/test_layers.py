"""The package's layers (tools/LAYERS.md), enforced: import-linter's contracts in pyproject.toml, and the
parse-time half of the package (experiment/, cluster/) run with the heavy libraries blocked.

Both run in subprocesses on this checkout's scripts/ (PYTHONPATH first, so an installed ftbench elsewhere
is not the one checked).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "scripts"
# The experiments a user may run as they are: the default one and every example.
EXPERIMENTS = sorted((ROOT / "config" / "examples").glob("*.yaml")) + [ROOT / "config" / "config.yaml"]
HEAVY = ("torch", "transformers", "peft", "datasets", "PIL")


def _env() -> dict:
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(SCRIPTS), os.environ.get("PYTHONPATH")]))}


def test_import_contracts_are_kept():
    """Layers (each imports only those below it; `|` siblings not each other), no cycle between the modules
    of any package, and no heavy library imported by experiment/ or cluster/ themselves. Imports inside
    functions count too."""
    lint_imports = shutil.which("lint-imports", path=str(Path(sys.executable).parent)) or shutil.which("lint-imports")
    assert lint_imports, "lint-imports not found: pip install -r requirements.txt (import-linter)"
    result = subprocess.run([lint_imports, str(ROOT / "pyproject.toml"), "--no-cache"],
                            cwd=ROOT, env=_env(), capture_output=True, text=True)
    report = result.stdout + result.stderr
    assert "Contracts:" in report and "0 broken" in report, report
    assert result.returncode == 0, report


# Installed before anything else is imported: a module of these names is found (so a library that only
# asks whether it is installed, as transformers does for torch, still works) but importing it fails.
BLOCKER = textwrap.dedent("""
    import importlib.abc, importlib.machinery, sys

    class _Refuse(importlib.abc.Loader):
        def create_module(self, spec):
            raise ImportError(f"{spec.name} is blocked: this code runs at parse time and must not import it")

        def exec_module(self, module):
            raise ImportError(f"{module.__name__} is blocked")

    class _Block(importlib.abc.MetaPathFinder):
        def __init__(self, names):
            self.names = set(names)

        def find_spec(self, name, path=None, target=None):
            if name.partition(".")[0] in self.names:
                return importlib.machinery.ModuleSpec(name, _Refuse())
            return None

    sys.meta_path.insert(0, _Block(sys.argv[1].split(",")))
""")


def _run_blocked(blocked: tuple[str, ...], body: str) -> subprocess.CompletedProcess:
    code = BLOCKER + textwrap.dedent(body)
    return subprocess.run([sys.executable, "-c", code, ",".join(blocked)], cwd=ROOT, env=_env(),
                          capture_output=True, text=True, timeout=300)


def test_experiment_and_cluster_import_without_heavy_libraries():
    """Snakemake imports these while it parses the workflow: none of torch, transformers, peft, datasets
    or PIL may be imported by any of their modules, directly or through a module below them."""
    result = _run_blocked(HEAVY, """
        import importlib, pkgutil
        import ftbench.experiment, ftbench.cluster

        for package in (ftbench.experiment, ftbench.cluster):
            for module in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
                importlib.import_module(module.name)
                print(module.name)
    """)
    assert result.returncode == 0, result.stderr
    assert "ftbench.experiment.config" in result.stdout and "ftbench.cluster.resources" in result.stdout


@pytest.fixture(scope="module")
def parsed_experiments() -> dict[str, str]:
    """Each shipped experiment parsed as the workflow parses it (Snakefile and rules/common.smk), in one
    subprocess with the heavy libraries blocked: {file name: "ok" or the traceback}.

    transformers alone may load: a config-built model's architecture is checked against transformers' list
    of config classes (data/sources.check_architecture), which it gives lazily, torch-free. Whatever it
    would import of the others is blocked all the same."""
    result = _run_blocked(tuple(name for name in HEAVY if name != "transformers"), f"""
        import json, sys, traceback
        from ftbench.experiment import config as ftbench_config, matrix
        from ftbench.cluster import resources

        def parse(path):
            config = ftbench_config.load_yaml(path)  # the Snakefile's strict reading of the file
            ftbench_config.validate_config(config)  # rules/common.smk from here on
            ftbench_config.check_gpu_limit(config, None)
            ftbench_config.experiment_warnings(config)
            runs = matrix.expand_runs(config)
            assert runs, "no runs"
            matrix.data_preparations(runs)
            matrix.shard_size_mb(config)
            for run in runs:  # the train rule's resources (on a cluster, so multi-node runs are accepted)
                ftbench_config.check_nodes(run, config, True)
                resources.train_gpus(run), resources.train_gres(run), resources.train_nodes(run)
                resources.train_threads(run, local=True, cores=2)
                resources.train_cpus_per_gpu(run)
                resources.train_partition({{}})
                resources.train_runtime_minutes(run, 1, local=True)
                resources.train_mem_mb(run, 1)

        outcome = {{}}
        for path in {[str(path) for path in EXPERIMENTS]!r}:
            try:
                parse(path)
                outcome[path] = "ok"
            except BaseException:
                outcome[path] = traceback.format_exc()
        print(json.dumps(outcome))
    """)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("path", EXPERIMENTS, ids=lambda path: path.name)
def test_shipped_experiment_parses_without_torch(parsed_experiments, path):
    assert parsed_experiments[str(path)] == "ok", parsed_experiments[str(path)]


def test_snakemakes_lint_finds_nothing():
    """Snakemake's own rules for a workflow (functions in rules/common.smk or the package, not beside the rules)."""
    beside = Path(sys.executable).with_name("snakemake")
    command = [str(beside)] if beside.is_file() else [sys.executable, "-m", "snakemake"]
    result = subprocess.run([*command, "--lint"], cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300)
    report = result.stdout + result.stderr
    assert result.returncode == 0 and "Lints for" not in report, report[-3000:]
