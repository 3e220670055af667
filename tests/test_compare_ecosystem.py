"""scripts/compare_ecosystem.py, the check that ftbench measures what a plain PEFT loop and transformers.Trainer
measure, run on the CPU on a tiny Llama: each way trains the same recipe (a bf16 frozen base, fp32 adapters) on the
same tokens, read inside its own steps, and the ratios of ftbench's speed to theirs are printed as three-decimal
cells. Its GPU figures: scripts/README.md."""

import importlib.util
import json
import math
import os
import re
import subprocess
import sys
from types import SimpleNamespace

import pytest

from conftest import ROOT

SCRIPT = ROOT / "scripts" / "compare_ecosystem.py"


def load_script():
    spec = importlib.util.spec_from_file_location("compare_ecosystem", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_the_three_ways_train_the_same_lora_configuration(tmp_path):
    out = tmp_path / "compare.json"
    batch, seq, warmup, steps = 2, 32, 1, 2
    process = subprocess.run(
        [sys.executable, str(SCRIPT), "--shape", "tiny", "--method", "lora", "--batch", str(batch), "--seq", str(seq),
         "--warmup", str(warmup), "--steps", str(steps), "--out", str(out)],
        capture_output=True, text=True, timeout=600, env={**os.environ, "COMPARE_DEVICE": "cpu"})
    assert process.returncode == 0, process.stderr[-2000:]
    (row,) = json.loads(out.read_text())
    for way in ("ftbench", "peft", "trainer"):
        assert "error" not in row[way], row[way]
        # the recipe each way's steps ran (the PEFT loop's and the Trainer's read inside their steps), and the
        # measured steps' tokens: full-length rows, the warmup step's left out
        assert (row[way]["frozen_dtype"], row[way]["trainable_dtype"]) == ("bf16", "fp32"), way
        assert row[way]["trained_tokens"] == batch * seq * steps, way
        assert row[way]["tokens_per_s"] > 0
    # The table's last line ends with the two ratio cells: tokens/s to three decimals, memory "-" (no CUDA peak).
    table_row = next(line for line in process.stdout.splitlines() if line.startswith("tiny  lora"))
    cells = re.findall(r"(\d+\.\d{3}), -", table_row)
    assert len(cells) == 2, table_row
    for cell, other in zip(cells, ("peft", "trainer")):
        assert float(cell) == pytest.approx(row["ftbench"]["tokens_per_s"] / row[other]["tokens_per_s"], abs=5e-4)
    assert "trained other work" not in process.stdout


def test_a_way_that_trained_other_work_is_named_and_ratio_cells_have_three_decimals():
    script = load_script()
    mine = {"tokens_per_s": 1022.0, "peak_gib": 34.13, "frozen_dtype": "bf16", "trainable_dtype": "fp32", "trained_tokens": 20480}
    peft = {**mine, "tokens_per_s": 1000.0}
    trainer = {**mine, "tokens_per_s": 1000.0, "peak_gib": None, "frozen_dtype": "fp32", "trained_tokens": 18432}
    assert script.ratio_cell(mine, peft) == "1.022, 1.000"
    assert script.ratio_cell(mine, trainer) == "1.022, -"
    assert script.ratio_cell(mine, {"error": ["boom"]}) == "-"
    row = {"method": "lora", "ftbench": mine, "peft": peft, "trainer": trainer}
    assert script.differences([row]) == [
        "lora: trainer trained other work than ftbench: frozen_dtype fp32 (ftbench bf16), trained_tokens 18432 (ftbench 20480)"]


@pytest.mark.slow
def test_the_trainer_way_measures_without_a_warmup(monkeypatch):
    """--warmup 0: the window starts where training starts (it divided by a zero window)."""
    script = load_script()
    monkeypatch.setattr(script, "DEVICE", "cpu")
    args = SimpleNamespace(shape="tiny", batch=2, seq=16, warmup=0, steps=2)
    result = script.trainer_way("lora", args)
    assert result["trained_tokens"] == 2 * 16 * 2
    assert math.isfinite(result["tokens_per_s"]) and result["tokens_per_s"] > 0
    assert (result["frozen_dtype"], result["trainable_dtype"]) == ("bf16", "fp32")


def test_without_a_gpu_it_says_so_in_one_line_before_any_way_runs(monkeypatch, capsys):
    script = load_script()
    monkeypatch.setattr(script, "DEVICE", "cuda")
    monkeypatch.setattr(script, "cuda_visible", lambda: False)
    monkeypatch.setattr(script, "run_way", lambda *unused: pytest.fail("a way ran"))
    assert script.main(["--shape", "tiny"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "CUDA GPU" in err[0] and "COMPARE_DEVICE=cpu" in err[0]


def test_the_script_imports_the_installed_package_and_leaves_sys_path_alone():
    text = SCRIPT.read_text()
    assert "sys.path" not in text and "PYTHONPATH" not in text


def test_dtypes_are_named_as_ftbenchs_recipe_columns_name_them():
    """A 16-bit frozen base and fp32 adapters; a 4-bit base by its quantisation type alone (peft's k-bit preparation
    keeps its norms in fp32 beside it, which ftbench's recipe_frozen_dtype does not name either)."""
    import torch

    script = load_script()
    model = torch.nn.Sequential(torch.nn.Linear(2, 2).to(torch.bfloat16), torch.nn.LayerNorm(2), torch.nn.Linear(2, 2))
    model[0].requires_grad_(False)
    model[1].requires_grad_(False)
    assert script.parameter_dtypes(model) == {"frozen_dtype": "bf16+fp32", "trainable_dtype": "fp32"}
    model[0].weight.quant_state = object()  # what bitsandbytes' Params4bit carries
    assert script.parameter_dtypes(model) == {"frozen_dtype": "nf4", "trainable_dtype": "fp32"}
    assert script.parameter_dtypes(model[0]) == {"frozen_dtype": "nf4", "trainable_dtype": None}
