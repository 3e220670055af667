"""The recipe: which dtype each kind of tensor of a run is kept in, as the tools users train with keep them.

A LoRA run under bf16/fp16 keeps its frozen base in that dtype (PEFT's convention: 16-bit base, fp32 adapters,
autocast); full fine-tuning keeps fp32 masters; bf16_true is all bf16. Pinned here on the model as built (from a
config and from a checkpoint; a GGUF decoder in tests/test_gguf.py), on the host memory a build takes, on the
memory estimate's terms, and on the row's recipe columns.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from conftest import ROOT
from ftbench.measure import memory_estimate as me
from ftbench.recipe import RECIPE_COLUMNS, Recipe, recipe_of
from ftbench.report.columns import COLUMNS
from ftbench.runspec import RunSpec
from ftbench.train import modeling
from test_measurement import llama_spec, spec_for

# (method, precision, lora_base_dtype) -> (frozen, trainable, autocast, master weights, optimizer state, compute)
EXPECTED = {
    ("full", "fp32", None): (None, "fp32", None, False, "fp32", "fp32"),
    ("full", "bf16", None): (None, "fp32", "bf16", True, "fp32", "bf16"),
    ("full", "fp16", None): (None, "fp32", "fp16", True, "fp32", "fp16"),
    ("full", "bf16_true", None): (None, "bf16", None, False, "bf16", "bf16"),
    ("lora", "fp32", None): ("fp32", "fp32", None, False, "fp32", "fp32"),
    ("lora", "bf16", "compute"): ("bf16", "fp32", "bf16", True, "fp32", "bf16"),
    ("lora", "fp16", "compute"): ("fp16", "fp32", "fp16", True, "fp32", "fp16"),
    ("lora", "bf16", "fp32"): ("fp32", "fp32", "bf16", True, "fp32", "bf16"),
    ("lora", "bf16_true", None): ("bf16", "bf16", None, False, "bf16", "bf16"),
    ("qlora", "bf16", None): ("nf4", "fp32", "bf16", True, "fp32", "bf16"),
    ("qlora", "fp32", None): ("nf4", "fp32", None, False, "fp32", "fp32"),
}


@pytest.mark.parametrize("key", list(EXPECTED), ids=["-".join(str(part) for part in key) for key in EXPECTED])
def test_each_method_and_precision_has_the_ecosystems_recipe(key):
    method, precision, base = key
    spec = RunSpec(model="m", dataset="d", method=method, precision=precision, lora_base_dtype=base or "compute")
    assert recipe_of(spec) == Recipe(*EXPECTED[key])


def test_the_lora_base_setting_shows_in_the_run_id_only_when_not_the_default():
    default = llama_spec(method="lora", precision="bf16")
    fp32_base = llama_spec(method="lora", precision="bf16", lora_base_dtype="fp32")
    assert default.lora_base_dtype == "compute" and "fp32base" not in default.run_id
    assert "fp32base" in fp32_base.run_id and fp32_base.run_id != default.run_id
    # Where it cannot change anything it is normalised away: no second id for the same run.
    for settings in ({"method": "full", "precision": "bf16"}, {"method": "lora", "precision": "fp32"},
                     {"method": "qlora", "precision": "bf16"}):
        assert llama_spec(**settings).lora_base_dtype is None
        assert llama_spec(**settings, lora_base_dtype="fp32").run_id == llama_spec(**settings).run_id


DTYPE = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def dtypes_of(model: torch.nn.Module) -> tuple[set, set]:
    """(frozen dtypes, trainable dtypes) of a built model's parameters."""
    frozen = {param.dtype for param in model.parameters() if not param.requires_grad}
    trainable = {param.dtype for param in model.parameters() if param.requires_grad}
    return frozen, trainable


@pytest.mark.parametrize("method, precision, base", [
    ("full", "fp32", None), ("full", "bf16", None), ("full", "bf16_true", None), ("lora", "fp32", None),
    ("lora", "bf16", None), ("lora", "fp16", None), ("lora", "bf16", "fp32"), ("lora", "bf16_true", None),
])
def test_a_config_built_model_has_the_recipes_dtypes(method, precision, base):
    settings = {"lora_base_dtype": base} if base else {}
    spec = llama_spec(method=method, precision=precision, **settings)
    built = modeling.build_model(spec, None, torch.device("cpu"))
    frozen, trainable = dtypes_of(built.model)
    recipe = recipe_of(spec)
    assert trainable == {DTYPE[recipe.trainable_dtype]}
    assert frozen == (set() if method == "full" else {DTYPE[recipe.frozen_dtype]})
    assert built.recipe_columns == recipe.columns()  # the row reads the model as built, and agrees


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_the_meta_model_of_the_plan_has_the_dtypes_of_the_built_one(precision):
    spec = llama_spec(method="lora", precision=precision)
    built = modeling.build_model(spec, None, torch.device("cpu")).model
    meta = modeling.meta_model(spec)
    assert dtypes_of(meta) == dtypes_of(built)
    assert all(param.is_meta for param in meta.parameters())


@pytest.fixture(scope="module")
def bf16_classifier_checkpoint(tmp_path_factory, minilm_dir):
    """MiniLM saved in bf16: a checkpoint stored in 16 bits, like most hub models."""
    from transformers import AutoModel

    folder = tmp_path_factory.mktemp("bf16-minilm")
    AutoModel.from_pretrained(minilm_dir, dtype=torch.bfloat16).save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json"):
        if (minilm_dir / name).exists():
            (folder / name).write_bytes((minilm_dir / name).read_bytes())
    return folder


@pytest.mark.parametrize("method, precision, frozen, trainable", [
    ("lora", "bf16", {torch.bfloat16}, {torch.float32}),  # the base as stored, the adapters and the new head fp32
    ("lora", "fp32", {torch.float32}, {torch.float32}),  # a bf16-stored checkpoint is not trained in bf16 under fp32
    ("full", "bf16", set(), {torch.float32}),  # mixed precision: fp32 masters whatever the checkpoint's dtype
])
def test_a_checkpoint_loads_in_the_recipes_dtype_whatever_it_is_stored_in(bf16_classifier_checkpoint, method,
                                                                          precision, frozen, trainable):
    model_def = {"task": "classification", "source": {"kind": "path", "path": str(bf16_classifier_checkpoint)}}
    spec = spec_for(model_def, method=method, precision=precision, seq_len=16)
    built = modeling.build_model(spec, 2, torch.device("cpu"), pad_token_id=0)
    assert dtypes_of(built.model) == (frozen, trainable)
    head = [name for name, param in built.model.named_parameters() if param.requires_grad and "classifier" in name]
    assert head  # the new head trains, in fp32 (peft leaves a kept head in the base's dtype: ftbench casts it)


# A child process builds one config-built Llama of ~25M parameters and prints the peak resident memory (MiB) of the
# build above where it started (the high-water mark reset after the imports): an fp32 copy of the base anywhere
# would show as 100 MB more.
BUILD_PEAK = """
import json, sys
sys.path.insert(0, {scripts!r}); sys.path.insert(0, {tests!r})
import torch, transformers, peft
from ftbench.train import evaluation, modeling
from test_measurement import spec_for
spec = spec_for({model_def!r}, method="lora", precision={precision!r})
if not evaluation.reset_peak_rss():
    print(json.dumps(None)); sys.exit()
before = evaluation.peak_rss_mb()
model = modeling.build_model(spec, None, torch.device("cpu")).model
print(json.dumps(evaluation.peak_rss_mb() - before))
"""


def build_peak_mib(precision: str) -> float:
    model_def = {"task": "causal_lm", "source": {"kind": "config", "architecture": "LlamaConfig", "overrides": {
        "hidden_size": 512, "intermediate_size": 1536, "num_hidden_layers": 8, "num_attention_heads": 8,
        "num_key_value_heads": 8, "vocab_size": 1000}}}
    code = BUILD_PEAK.format(scripts=str(ROOT / "scripts"), tests=str(ROOT / "tests"), model_def=model_def,
                             precision=precision)
    process = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert process.returncode == 0, process.stderr[-2000:]
    return json.loads(process.stdout.strip().splitlines()[-1])


def test_building_a_16_bit_lora_base_never_holds_an_fp32_copy():
    """~25M parameters: 100 MB in fp32, 50 MB in bf16. Building the bf16 LoRA run peaks well under the fp32 one's
    weights alone, so no fp32 copy of the base was made on the way."""
    bf16, fp32 = build_peak_mib("bf16"), build_peak_mib("fp32")
    if bf16 is None:
        pytest.skip("this kernel cannot reset a process's peak resident memory (/proc/self/clear_refs)")
    params_mib = (8 * (4 * 512 * 512 + 3 * 512 * 1536) + 2 * 1000 * 512) / 2**20
    assert fp32 > 3.5 * params_mib  # the fp32 build holds its fp32 weights
    assert bf16 < fp32 - 1.5 * params_mib, (bf16, fp32)  # at least 2 bytes a parameter less at its peak


def test_the_estimate_counts_a_16_bit_base_at_two_bytes_and_makes_no_copies_of_it():
    """Hand-checked parts: 1,000,000 frozen parameters and 10,000 adapter ones, Llama-like, batch 8 x 64."""
    shape = me.model_shape.ConfigShape(width=64, layers=2, decoder_layers=0, intermediate=128, heads=4, vocab_size=1000)
    facts = me.ModelFacts(quantised=0, other=1_010_000, trainable=10_000, shape=shape, norm="rms", mlp="gated")
    def parts(**settings):
        spec = RunSpec(model="m", dataset="d", method="lora", precision="bf16", batch_size=8, seq_len=64,
                       qlora_double_quant=None, **settings)
        return {name: value * me.MIB for name, value in me.estimate(facts, spec, 1000)["memory_estimate_parts_mb"].items()}

    compute, fp32 = parts(), parts(lora_base_dtype="fp32")
    assert compute["weights"] == pytest.approx(1_000_000 * 2 + 10_000 * 4)
    assert fp32["weights"] == pytest.approx(1_010_000 * 4)
    assert compute["weight_copies"] == pytest.approx(10_000 * 2)  # only the fp32 adapters are cast by autocast
    assert fp32["weight_copies"] == pytest.approx(1_010_000 * 2)
    assert compute["gradients"] == fp32["gradients"] == pytest.approx(10_000 * 4)
    assert compute["optimizer"] == fp32["optimizer"] == pytest.approx(10_000 * 8)
    # Checkpointing keeps each layer's input: 16-bit where the embeddings are (RMSNorm models).
    checkpointed = parts(gradient_checkpointing=True)
    assert checkpointed["activations"] == pytest.approx(8 * 64 * 2 * 2 * 64)
    assert parts(gradient_checkpointing=True, lora_base_dtype="fp32")["activations"] == pytest.approx(8 * 64 * 2 * 4 * 64)


def test_the_recipe_columns_are_documented_columns_of_every_row():
    for name, meaning in RECIPE_COLUMNS.items():
        assert name in COLUMNS and COLUMNS[name][1] == meaning
    assert set(recipe_of(RunSpec(model="m", dataset="d")).columns()) == set(RECIPE_COLUMNS)


def test_plan_and_the_report_name_each_runs_recipe():
    from ftbench import cli
    from ftbench.report import report_page
    import pandas as pd

    spec = llama_spec(method="lora", precision="bf16")
    text = cli.plan_table(spec, {"unsupported": "for this test"})
    assert "  recipe: base bf16, trains fp32 (masters), autocast bf16, optimizer state fp32" in text.splitlines()
    rows = pd.DataFrame([recipe_of(spec).columns(), recipe_of(llama_spec(method="full", precision="bf16_true")).columns(),
                         dict.fromkeys(RECIPE_COLUMNS)])
    assert report_page.recipes_of(rows).fillna("-").tolist() == [
        "base bf16, trains fp32 (masters), autocast bf16, optimizer state fp32",
        "trains bf16, no autocast, optimizer state bf16", "-"]
