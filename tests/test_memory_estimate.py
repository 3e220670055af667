"""The memory estimate's terms (scripts/ftbench/measure/memory_estimate.py), each against hand-checked numbers,
the estimate from a config alone (facts_from_config) against the built model, and the plan before training
(experiment/memory_plan.py, ``python -m ftbench plan``). Most tests build no model: ModelFacts by hand."""

from __future__ import annotations

import json
import math

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from conftest import ROOT
from ftbench.data import batch_order, prepared
from ftbench.experiment import config as ftconfig
from ftbench.experiment import matrix, memory_plan
from ftbench.measure import memory_estimate as me
from ftbench.measure import model_shape
from ftbench.runspec import RunSpec

MIB = me.MIB
# A Llama-shaped decoder, by hand: width 64, MLP 128, 2 layers, 4 heads, vocabulary 1000.
SHAPE = model_shape.ConfigShape(width=64, layers=2, decoder_layers=0, intermediate=128, heads=4, vocab_size=1000)
PARAMS = 200_000
FACTS = me.ModelFacts(quantised=0, other=PARAMS, trainable=PARAMS, shape=SHAPE, norm="rms", mlp="gated",
                      blocks=((40_000, 0, 40_000),) * 2, head_trainable=64_000)


def spec(**settings) -> RunSpec:
    return RunSpec(**{"model": "m", "dataset": "d", "method": "full", "optimizer": "adamw", "batch_size": 8,
                      "seq_len": 64, "precision": "bf16", "attn_implementation": None, "qlora_double_quant": None,
                      **settings})


def estimate(facts=FACTS, packed_batch=None, vocab=1000, **settings) -> dict:
    return me.estimate(facts, spec(**settings), vocab, packed_batch)


def part(result: dict, name: str) -> float:
    """One part in bytes."""
    return result["memory_estimate_parts_mb"].get(name, 0.0) * MIB


# --- DDP gradient buckets ---------------------------------------------------------------------------------------

def test_ddp_adds_its_bucket_copy_and_the_rebuild_copy_at_the_start_of_the_backward_pass():
    """Seen on two H100s (Llama 1B, bf16, 2 x 1024): single 23.09 GiB, DDP 27.70 in the steady state and 32.30 in
    the bucket-rebuilding second step: the run's peak is the single one plus two fp32 copies of the gradients."""
    single, ddp = estimate(), estimate(parallel="ddp", num_gpus=2)
    assert part(ddp, "ddp_buckets") == part(ddp, "ddp_rebuild") == 4 * PARAMS
    assert (ddp["memory_estimate_mb"] - single["memory_estimate_mb"]) * MIB == pytest.approx(2 * 4 * PARAMS)
    # every other part is the single run's (per GPU: batch_size is per device)
    for name in ("weights", "weight_copies", "gradients", "optimizer", "activations", "logits"):
        assert part(ddp, name) == part(single, name)


def test_ddp_with_accumulation_holds_the_no_sync_gradients_beside_the_buckets_and_no_rebuild_copy():
    """Seen: with 2 micro-batches, single + two copies on every step (no third in the rebuild step)."""
    single1, single2 = estimate(), estimate(grad_accum_steps=2)
    ddp2 = estimate(parallel="ddp", num_gpus=2, grad_accum_steps=2)
    # single: the second micro-batch starts its backward pass beside the first one's gradients
    assert part(single2, "accumulated") == 4 * PARAMS
    assert (single2["memory_estimate_mb"] - single1["memory_estimate_mb"]) * MIB == pytest.approx(4 * PARAMS)
    assert part(ddp2, "ddp_rebuild") == 0
    assert (ddp2["memory_estimate_mb"] - single1["memory_estimate_mb"]) * MIB == pytest.approx(2 * 4 * PARAMS)


def test_ddp_buckets_are_the_gradients_at_the_end_of_the_backward_pass():
    """gradient_as_bucket_view: where the gradients make the single run's peak (fp32, a token per batch), DDP's
    peak is its buckets (the gradients, as views) plus the rebuild copy, not the gradients beside both."""
    tiny = dict(vocab=None, precision="fp32", batch_size=1, seq_len=1)
    single, ddp = estimate(**tiny), estimate(parallel="ddp", num_gpus=2, **tiny)
    parts = single["memory_estimate_parts_mb"]
    assert single["memory_estimate_mb"] == \
        pytest.approx(parts["weights"] + parts["optimizer"] + parts["gradients"] + parts["workspace"])
    held = 4 * PARAMS + 4 * PARAMS  # buckets + the rebuild copy, from the start of the backward pass
    assert (ddp["memory_estimate_mb"] - single["memory_estimate_mb"]) * MIB == \
        pytest.approx(held + part(single, "activations") - 4 * PARAMS)


# --- token positions of packed batches ------------------------------------------------------------------------

def test_padding_free_activations_are_the_padded_ones_times_real_over_padded():
    flash = {"attn_implementation": "flash_attention_2"}  # no mask bias (the next tests count it)
    pad = estimate(batching="pad", **flash)
    free = estimate(batching="padding_free", packed_batch=(128, 128), **flash)  # the largest batch: 128 real tokens, one row
    real, padded = 128, 8 * 64
    assert part(free, "activations") == pytest.approx(part(pad, "activations") * real / padded)
    assert part(free, "logits") == pytest.approx(part(pad, "logits") * real / padded)
    # a padded batch is counted at its longest (seq_len): the peak's batch
    assert part(pad, "activations") == part(estimate(batching="pad", packed_batch=(128, 128), **flash), "activations")


def test_pack_holds_the_largest_batch_rows_and_full_rows_before_the_data_is_known():
    packed = estimate(batching="pack", packed_batch=(3 * 64, 64))  # the largest batch packs into 3 rows of 64
    unknown = estimate(batching="pack")  # data not prepared: full rows, an upper bound
    assert part(packed, "activations") == pytest.approx(part(unknown, "activations") * 3 / 8)
    flash = {"attn_implementation": "flash_attention_2"}
    assert part(estimate(batching="pack", **flash), "activations") == part(estimate(batching="pad", **flash), "activations")


def test_a_packed_batch_is_counted_as_first_fit_decreasing_packs_it():
    """50, 30, 20 and 14 tokens in rows of 64: 50 | 30, 20 | 14 joins the 50 -> 2 rows, the fuller of 64
    tokens, 128 positions; padding_free: one row of 114."""
    run = spec(batch_size=4, seq_len=64, max_steps=1, warmup_steps=0, batching="pack")
    lengths = [50, 30, 20, 14]
    assert batch_order.pack_rows(lengths, 64) == [[0, 3], [1, 2]]
    assert batch_order.largest_packed_batch(run, lengths) == (128, 64)
    assert batch_order.largest_packed_batch(run.replace(batching="padding_free"), lengths) == (114, 114)


@pytest.mark.parametrize("batching", ["pack", "padding_free"])
def test_the_largest_packed_batch_is_the_largest_the_trainer_collates(batching):
    """Over every micro-batch the run's order draws (two devices, two micro-steps per step, three epochs),
    collated as the trainer collates them: the largest tensor is the one the estimate counts, and it holds
    more than the mean batch (what the estimate used to count: 0.74-0.83 of the H100's measured peak)."""
    from ftbench.tasks.base import TokenisedSplit
    from ftbench.train import batching as batching_module  # torch: imported here, the rest of this file is torch-free

    rng = np.random.default_rng(5)
    lengths = np.minimum(rng.geometric(1 / 40, size=240), 256)  # short reviews with a long tail, as real data
    split = TokenisedSplit(input_ids=[np.arange(1, n + 1) for n in lengths])
    run = spec(batch_size=8, seq_len=256, num_gpus=2, parallel="ddp", grad_accum_steps=2, epochs=3,
               warmup_steps=1, batching=batching)
    positions = []
    for batch in batch_order.run_order(run, len(lengths), run.planned_steps(len(lengths))):
        for rank_rows in np.split(batch, 2):
            collated = batching_module.collate("causal_lm", split, rank_rows, 0, batching, 256)
            positions.append(collated.inputs["input_ids"].numel())
    largest = batch_order.largest_packed_batch(run, lengths)
    assert largest[0] == max(positions)
    assert largest[0] > 1.15 * np.mean(positions)


def test_packed_rows_under_sdpa_keep_one_mask_bias_per_layer():
    """sdpa turns the packed rows' block-diagonal mask into a 16-bit bias per layer, kept for backward: 2 bytes x
    rows x row^2 per layer (one row of 128: 2 layers x 2 x 128 x 128); flash attention takes no mask."""
    sdpa = estimate(batching="padding_free", packed_batch=(128, 128))
    flash = estimate(batching="padding_free", packed_batch=(128, 128), attn_implementation="flash_attention_2")
    assert part(sdpa, "activations") - part(flash, "activations") == pytest.approx(2 * 2 * 128 * 128)
    packed = estimate(batching="pack", packed_batch=(3 * 64, 64))  # 3 rows of 64: 3 x 64^2 per layer
    packed_flash = estimate(batching="pack", packed_batch=(3 * 64, 64), attn_implementation="flash_attention_2")
    assert part(packed, "activations") - part(packed_flash, "activations") == pytest.approx(2 * 2 * 3 * 64 * 64)
    # padded batches: no packed mask
    assert part(estimate(batching="pad"), "activations") == part(estimate(batching="pad", attn_implementation="flash_attention_2"), "activations")


@pytest.mark.parametrize("method, per_width, per_inter", [("full", -10, 0), ("lora", -8, 0), ("qlora", -8, -6)])
def test_fsdp_mixed_precision_keeps_sixteen_bit_residuals(method, per_width, per_inter):
    """FSDP2 casts the parameters to bf16: the residual stream and RMSNorm outputs are 16-bit, and QLoRA's MLP
    is no longer fp32. Per layer-token, against the same run on one GPU: width 64, MLP 128, 2 layers, 8 x 64."""
    adapted = FACTS if method == "full" else me.ModelFacts(**{**FACTS.__dict__, "adapted_inputs": (64,) * 7})
    one_gpu = estimate(adapted, method=method)
    sharded = estimate(adapted, method=method, parallel="fsdp", num_gpus=2)
    positions = 8 * 64
    expected = (per_width * 64 + per_inter * 128) * 2 * positions
    assert part(sharded, "activations") - part(one_gpu, "activations") == pytest.approx(expected)
    # fp32 runs keep fp32 parameters either way
    assert part(estimate(adapted, method=method, precision="fp32", parallel="fsdp", num_gpus=2), "activations") == \
        part(estimate(adapted, method=method, precision="fp32"), "activations")


def test_the_plan_reads_the_packed_batches_from_the_prepared_data(tmp_path):
    """With the data prepared, a packed run's plan counts its largest batch from the rows' lengths (64 rows of 16
    tokens: 4 rows of 256, a 16th of full rows); before, it takes full rows and says so."""
    runs = matrix.expand_runs(ftconfig.load_config(ROOT / "config" / "examples" / "batching-kernels.yaml"))
    packed = next(r for r in runs if r.batching == "pack" and r.kernels == "none")
    assert (packed.batch_size, packed.seq_len) == (64, 256)
    before = memory_plan.run_estimate(packed, tmp_path / "not-prepared")
    assert "packed rows taken as full" in before["plan_note"]
    data_dir = tmp_path / "prepared"
    data_dir.mkdir()
    pq.write_table(pa.table({"length": pa.array([16] * 4096, type=pa.int32())}), data_dir / "train-0.parquet")
    (data_dir / prepared.MANIFEST_NAME).write_text(json.dumps({"splits": {"train": {"shards": [{"file": "train-0.parquet"}]}}}))
    after = memory_plan.run_estimate(packed, data_dir)
    assert after["plan_note"] is None
    assert after["memory_estimate_parts_mb"]["activations"] == pytest.approx(before["memory_estimate_parts_mb"]["activations"] / 16)


# --- Liger kernels -------------------------------------------------------------------------------------------------

def test_liger_replaces_the_logits_with_its_fused_loss_buffers():
    """No logits: the hidden states' fp32 gradient, the head's weight gradient, one chunk of fp32 logits."""
    plain, liger = estimate(), estimate(kernels="liger")
    positions = 8 * 64
    assert part(plain, "logits") == 12 * positions * 1000
    chunk = 2 ** math.ceil(math.log2(math.ceil(positions / math.ceil(1000 / 64))))  # 512 / 16 = 32 tokens
    assert chunk == 32
    assert part(liger, "logits") == pytest.approx(4 * positions * 64 + 4 * 64_000 + 4 * chunk * 1000)


def test_liger_keeps_fewer_activations_by_the_traced_amount():
    """Traced on an H100 (Llama layers, width 576, MLP 1,536, bf16): 30,380 -> 22,692 bytes per layer-token, 7,688
    fewer; the terms give 8 x width + 2 x MLP width = 7,680."""
    plain, liger = estimate(), estimate(kernels="liger")
    tokens_layers = 8 * 64 * 2
    assert part(plain, "activations") - part(liger, "activations") == pytest.approx(tokens_layers * (8 * 64 + 2 * 128))
    assert 8 * 576 + 2 * 1536 == 7680
    # with adapters the frozen norms keep only their input already: only the SwiGLU term remains
    lora = dict(method="lora", lora_rank=8, lora_dropout=0.0)
    assert part(estimate(**lora), "activations") - part(estimate(kernels="liger", **lora), "activations") == \
        pytest.approx(tokens_layers * 2 * 128)
    # everything else is unchanged: liger drops exactly these two terms
    for name in ("weights", "weight_copies", "gradients", "optimizer"):
        assert part(liger, name) == part(plain, name)


# --- FSDP ----------------------------------------------------------------------------------------------------------

def test_fsdp_accumulation_keeps_this_gpus_gradient_shard():
    one, two = estimate(parallel="fsdp", num_gpus=2), estimate(parallel="fsdp", num_gpus=2, grad_accum_steps=2)
    assert part(one, "accumulated") == 0
    assert part(two, "accumulated") == pytest.approx(4 * PARAMS / 2)


def test_qlora_under_fsdp_shards_the_packed_base_and_gathers_it_packed():
    """4-bit base in the compute dtype's storage, sharded 1/world; constants whole on every GPU; a unit gathered
    with its 4-bit weights still packed and its other parameters in bf16."""
    quantised, adapters, rest = 160_000, 4_000, 40_000
    blocks = ((2_000 + 1_000, 80_000, 1_000),) * 2  # per block: (norms + adapters, 4-bit weights, trainable adapters)
    facts = me.ModelFacts(quantised=quantised, other=rest + adapters, trainable=adapters, shape=SHAPE, norm="rms",
                          mlp="gated", blocks=blocks)
    result = me.estimate(facts, spec(method="qlora", lora_rank=8, qlora_double_quant=True, parallel="fsdp", num_gpus=4), 1000)
    assert part(result, "weights") == pytest.approx((quantised * 0.5 + (rest + adapters) * 4) / 4 + quantised * 0.0159)
    assert part(result, "optimizer") == pytest.approx(8 * adapters / 4)
    root = (rest + adapters - 2 * 3_000) * 2  # outside the blocks, cast to bf16
    assert part(result, "weight_copies") == pytest.approx(root + 2 * (3_000 * 2 + 80_000 * 0.5))
    assert part(result, "gradients") == pytest.approx(4 * adapters / 4 + 2 * 1_000 * 2)


def test_the_cublas_workspaces_are_a_constant_part():
    """32 MiB each for the forward pass's thread and autograd's backward thread (two blocks in a CUDA memory
    snapshot on an H100): what a tiny model's estimate missed most."""
    result = estimate()
    assert part(result, "workspace") == 2 * 32 * MIB
    assert estimate(batch_size=16)["memory_estimate_parts_mb"]["workspace"] == 64


def test_checkpointing_keeps_only_the_output_heads_autocast_copy():
    """With checkpointing the layers' 16-bit weight copies are not saved, but the head's matmul (outside the
    checkpointed layers) keeps its bf16 weight: 2 bytes x 1000 x 64 here, trainable or not (the frozen head of LoRA
    over an fp32 base too). Without checkpointing every weight's copy; fp32 none; Liger's fused loss keeps no copy
    of the head. LoRA's default 16-bit base is 16-bit already: no copy of it, the head included."""
    facts = me.ModelFacts(**{**FACTS.__dict__, "head": 1000 * 64})
    assert part(me.estimate(facts, spec(gradient_checkpointing=True), 1000), "weight_copies") == 2 * 64_000
    fp32_base = spec(gradient_checkpointing=True, method="lora", lora_base_dtype="fp32")
    assert part(me.estimate(facts, fp32_base, 1000), "weight_copies") == 2 * 64_000
    assert part(me.estimate(facts, spec(gradient_checkpointing=True, method="lora"), 1000), "weight_copies") == 0
    assert part(me.estimate(facts, spec(), 1000), "weight_copies") == 2 * PARAMS
    assert part(me.estimate(facts, spec(gradient_checkpointing=True, precision="fp32"), 1000), "weight_copies") == 0
    assert part(me.estimate(facts, spec(gradient_checkpointing=True, kernels="liger"), 1000), "weight_copies") == 0
    assert part(me.estimate(facts, spec(kernels="liger"), 1000), "weight_copies") == 2 * (PARAMS - 64_000)


def test_the_head_is_counted_from_the_built_model_and_from_the_config():
    """facts_of reads the output embeddings' weight; facts_from_config counts vocabulary x width, tied or not."""
    transformers = pytest.importorskip("transformers")
    settings = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, vocab_size=500, tie_word_embeddings=True)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**settings))
    assert me.facts_of(model).head == 500 * 32
    assert me.facts_from_config({"model_type": "llama", **settings}, spec(), classifier=False).head == 500 * 32


# --- what fits ------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("estimate_mb, verdict", [(70_000, "yes"), (74_000, "yes"), (76_000, "borderline"),
                                                  (88_000, "borderline"), (91_000, "no")])
def test_fit_allows_for_the_error_band(estimate_mb, verdict):
    assert me.fit(estimate_mb, 81_408) == verdict


def test_largest_fitting_batch_is_the_largest_within_the_band():
    assert me.largest_fitting_batch(lambda batch: 1000 + 100 * batch, 5000) == 35  # 1.1 x 4500 = 4950 <= 5000
    assert me.largest_fitting_batch(lambda batch: 1000 + 100 * batch, 1000) == 0
    assert me.largest_fitting_batch(lambda batch: 1.0, 5000, cap=64) == 64


# --- from the config alone -------------------------------------------------------------------------------------------

LLAMA = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "vocab_size": 1000}
VIT = {"hidden_size": 192, "num_hidden_layers": 2, "num_attention_heads": 3, "intermediate_size": 768,
       "patch_size": 4, "image_size": 32}
BERT = {"hidden_size": 96, "intermediate_size": 384, "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 1000}


@pytest.mark.parametrize("architecture, overrides, model_class, classifier", [
    ("LlamaConfig", LLAMA, "LlamaForCausalLM", False),
    ("LlamaConfig", {**LLAMA, "tie_word_embeddings": True}, "LlamaForCausalLM", False),
    ("ViTConfig", VIT, "ViTForImageClassification", True),
    ("BertConfig", BERT, "BertForSequenceClassification", True),
])
def test_facts_from_the_config_are_the_built_models(architecture, overrides, model_class, classifier):
    import transformers

    model = getattr(transformers, model_class)(getattr(transformers, architecture)(**overrides, num_labels=2))
    built = me.facts_of(model)
    planned = me.facts_from_config(model_shape.with_defaults(architecture, overrides), spec(), classifier, 2)
    assert (planned.total, planned.trainable, planned.norm, planned.mlp, planned.dropout, planned.blocks[0]) == \
        (built.total, built.trainable, built.norm, built.mlp, built.dropout, built.blocks[0])
    assert planned.head_trainable == built.head_trainable
    assert me.estimate(planned, spec(), None)["memory_estimate_mb"] == \
        pytest.approx(me.estimate(model, spec(), None)["memory_estimate_mb"])


def test_lora_facts_from_the_config_are_peft_models():
    import torch

    from ftbench.train import modeling

    model_def = {"task": "causal_lm", "source": {"kind": "config", "architecture": "LlamaConfig", "overrides": LLAMA}}
    run = matrix.expand_runs({
        "models": {"m": model_def}, "datasets": {"t": {"source": {"kind": "synthetic"}, "train_size": 64, "eval_size": 8}},
        "defaults": {"method": "lora", "lora_rank": 4, "lora_targets": "all-linear", "device": "cpu", "num_gpus": 0,
                     "seq_len": 16, "batch_size": 2},
        "matrix": {"model": ["m"], "dataset": ["t"]}})[0]
    built = me.facts_of(modeling.build_model(run, None, torch.device("cpu")).model)
    planned = me.facts_from_config(model_shape.with_defaults("LlamaConfig", LLAMA), run, False)
    assert (planned.total, planned.trainable, sorted(planned.adapted_inputs)) == \
        (built.total, built.trainable, sorted(built.adapted_inputs))


# --- the plan ---------------------------------------------------------------------------------------------------------

def _runs(path: str) -> list[RunSpec]:
    return matrix.expand_runs(ftconfig.load_config(ROOT / path))


def test_plan_of_dp_vs_ddp_puts_ddp_above_single_by_its_buckets():
    gpus = [{"name": "H100 SXM", "memory_gb": 80}, {"name": "T4", "memory_gb": 16}]
    plans = {run.parallel: memory_plan.plan_run(run, gpus) for run in _runs("config/examples/dp-vs-ddp.yaml")}
    trainable = plans["single"]["memory_estimate_parts_mb"]["gradients"]
    assert plans["ddp"]["memory_estimate_mb"] - plans["single"]["memory_estimate_mb"] == pytest.approx(2 * trainable)
    h100 = plans["single"]["gpus"][0]
    assert h100["fits"] == "yes" and h100["largest_batch"] > 16
    assert plans["single"]["gpus"][1]["fits"] == "no" and 0 < plans["single"]["gpus"][1]["largest_batch"] < 16
    # DataParallel's GPU 0 peaks at a replica's (two H100s: the single run's plus 21 MB): the same estimate, no caveat
    assert plans["dp"]["memory_estimate_mb"] == pytest.approx(plans["single"]["memory_estimate_mb"])
    assert plans["dp"]["plan_note"] is None


def test_plan_says_the_8b_shape_does_not_fit_ddp_but_fits_fsdp_on_two_h100s():
    gpus = [{"name": "H100 SXM", "memory_gb": 80}]
    verdicts = {(run.model, run.parallel, run.num_gpus, run.fsdp_reshard_after_forward, run.fsdp_cpu_offload):
                memory_plan.plan_run(run, gpus)["gpus"][0]["fits"] for run in _runs("config/examples/sharding.yaml")
                if run.method == "full"}
    assert verdicts[("llama8b", "ddp", 2, None, None)] == "no"
    assert verdicts[("llama8b", "single", 1, None, None)] == "no"
    assert verdicts[("llama8b", "fsdp", 2, True, False)] == "yes"
    assert verdicts[("llama8b", "fsdp", 1, True, True)] == "yes"  # offload: the states live in host memory
    assert verdicts[("llama1b", "ddp", 2, None, None)] == "yes"


def test_a_job_predicted_not_to_fit_its_gpu_is_an_oom_row_with_the_numbers():
    run = next(run for run in _runs("config/examples/sharding.yaml") if run.model == "llama8b" and run.parallel == "single")
    reason = memory_plan.predicted_not_to_fit(run, 80 * 2**30, "NVIDIA H100 80GB HBM3")
    assert reason.startswith("predicted not to fit: estimate 123.2 GiB > 79.5 GiB on NVIDIA H100 80GB HBM3")
    assert memory_plan.predicted_not_to_fit(run, 141 * 2**30, "NVIDIA H200") is None  # fits there
    assert memory_plan.predicted_not_to_fit(run.replace(auto_batch_size=True), 80 * 2**30, "H100") is None


def test_plan_command_runs_without_torch():
    """Parse-time rule: the plan builds nothing and never imports torch (transformers' lazy config names only,
    as the config check reads them)."""
    from test_layers import _run_blocked

    result = _run_blocked(("torch", "peft", "datasets", "PIL"),
                          "from ftbench import cli\ncli.main(['plan', 'config/examples/dp-vs-ddp.yaml', '--detail'])")
    assert result.returncode == 0, result.stderr
    assert "ddp_buckets" in result.stdout and "largest batch" in result.stdout


def test_quick_gelu_keeps_its_sigmoid_in_fp32_under_qlora():
    """QLoRA's 4-bit layers return fp32 (their input's dtype after k-bit preparation), so a plain MLP's fc1
    output (QLORA_MLP_BYTES) and CLIP's quick_gelu sigmoid are fp32: 2 + 2 more bytes per MLP element than LoRA
    keeps over an fp32 base, as QLoRA's unquantised layers are (batch 8 x 64 positions x 2 layers x MLP width
    128). Seen on an H100: CLIP ViT-B/32's QLoRA estimate was 0.896 of the peak without the sigmoid's."""
    facts = me.ModelFacts(quantised=0, other=PARAMS, trainable=1_000, shape=SHAPE, norm="layer", mlp="plain",
                          quick_gelu=True, adapted_inputs=(64,) * 4)
    fp32_base_lora = spec(method="lora", lora_base_dtype="fp32")
    lora = part(me.estimate(facts, fp32_base_lora, None), "activations")
    qlora = part(me.estimate(facts, spec(method="qlora"), None), "activations")
    assert qlora - lora == 8 * 64 * 2 * (2 + 2) * 128
    plain = me.ModelFacts(**{**facts.__dict__, "quick_gelu": False})
    assert part(me.estimate(plain, spec(method="qlora"), None), "activations") - \
        part(me.estimate(plain, fp32_base_lora, None), "activations") == 8 * 64 * 2 * 2 * 128


# --- precision bf16_true ----------------------------------------------------------------------------------------

def test_bf16_true_halves_weights_gradients_and_adamw_state_and_has_no_weight_copies():
    """The weights themselves in bf16: 2 bytes per weight and gradient, AdamW's moments in bf16, nothing cast by
    autocast; the activations are those of 16-bit parameters (the residual stream and RMSNorm outputs in bf16)."""
    mixed, true = estimate(), estimate(precision="bf16_true")
    assert part(true, "weights") == 2 * PARAMS == part(mixed, "weights") / 2
    assert part(true, "gradients") == 2 * PARAMS == part(mixed, "gradients") / 2
    assert part(true, "optimizer") == 4 * PARAMS == part(mixed, "optimizer") / 2
    assert part(mixed, "weight_copies") > 0 and part(true, "weight_copies") == 0
    positions = 8 * 64
    assert part(mixed, "activations") - part(true, "activations") == pytest.approx(10 * 64 * 2 * positions)
    assert part(true, "logits") == part(mixed, "logits")
    # an 8-bit optimizer keeps 8-bit state whatever the weights' dtype; SGD's momentum follows the weights
    assert part(estimate(precision="bf16_true", optimizer="adamw_8bit"), "optimizer") == 2 * PARAMS
    assert part(estimate(precision="bf16_true", optimizer="sgd"), "optimizer") == 2 * PARAMS
    # checkpointing keeps each layer's bf16 input; DDP's buckets are bf16 too
    assert part(estimate(precision="bf16_true", gradient_checkpointing=True), "activations") == positions * 2 * 2 * 64
    assert part(estimate(precision="bf16_true", parallel="ddp", num_gpus=2), "ddp_buckets") == 2 * PARAMS


def test_bf16_true_is_not_modelled_for_layernorm_models():
    """Only RMSNorm stacks were traced with bf16 weights: an encoder gets a note, never a guess."""
    encoder = me.ModelFacts(**{**FACTS.__dict__, "norm": "layer", "mlp": "plain"})
    result = estimate(encoder, precision="bf16_true")
    assert result["memory_estimate_mb"] is None and "bf16_true" in result["memory_estimate_note"]
    assert estimate(encoder)["memory_estimate_mb"] > 0  # mixed precision is modelled
