"""scripts/compare_ecosystem.py, the check that ftbench measures what a plain PEFT loop and transformers.Trainer
measure, run on the CPU on a tiny Llama: each way trains and reports its speed, and ftbench's row says it ran the
recipe the other two run (a bf16 frozen base, fp32 adapters). Its GPU figures: scripts/README.md."""

import json
import os
import subprocess
import sys

import pytest

from conftest import ROOT


@pytest.mark.slow
def test_the_three_ways_train_the_same_lora_configuration(tmp_path):
    out = tmp_path / "compare.json"
    process = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "compare_ecosystem.py"), "--shape", "tiny", "--method", "lora",
         "--seq", "32", "--warmup", "1", "--steps", "2", "--out", str(out)],
        capture_output=True, text=True, timeout=600, env={**os.environ, "COMPARE_DEVICE": "cpu"})
    assert process.returncode == 0, process.stderr[-2000:]
    (row,) = json.loads(out.read_text())
    for way in ("ftbench", "peft", "trainer"):
        assert "error" not in row[way], row[way]
        assert row[way]["tokens_per_s"] > 0
    assert (row["ftbench"]["frozen_dtype"], row["ftbench"]["trainable_dtype"]) == ("bf16", "fp32")
    assert "ftbench/peft" in process.stdout  # the table of ratios
