"""parallel: fsdp (ftbench.train.fsdp): FSDP2 over two gloo processes on the CPU, against a one-process run on the
same data; what is refused; the per-GPU memory estimate under sharding and offload."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import torch

from ftbench.experiment import config as ftconfig, feasibility
from ftbench.train import ddp, fsdp, modeling, run_state
from ftbench.experiment import matrix
from ftbench.measure import memory_estimate
from ftbench.errors import ConfigError, UnsupportedConfiguration
from ftbench.runspec import RunSpec

from test_families import LLAMA_OVERRIDES, lm_config, llama_def, llama_spec, only_spec, prepare_for


@pytest.fixture(scope="module")
def llama_data(tmp_path_factory) -> Path:
    return prepare_for(llama_spec(), tmp_path_factory.mktemp("fsdp-tokens"))


@pytest.fixture(scope="module")
def llama_checkpoint(tmp_path_factory, minilm_dir) -> Path:
    """A tiny Llama saved as a checkpoint folder (with the MiniLM tokenizer): one process and two FSDP ranks
    then load the same weights, where config-built models are initialised differently under fsdp (on the
    meta device, each rank its own shards)."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    folder = tmp_path_factory.mktemp("fsdp-llama-checkpoint")
    tokenizer = AutoTokenizer.from_pretrained(minilm_dir)
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**{**LLAMA_OVERRIDES, "vocab_size": len(tokenizer)})).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def checkpoint_spec(folder: Path, **settings) -> RunSpec:
    return only_spec(lm_config({"task": "causal_lm", "source": {"kind": "path", "path": str(folder)}}, **settings))


@pytest.fixture(scope="module")
def checkpoint_data(llama_checkpoint, tmp_path_factory) -> Path:
    return prepare_for(checkpoint_spec(llama_checkpoint), tmp_path_factory.mktemp("fsdp-checkpoint-tokens"))


def tiny_llama(spec: RunSpec):
    return modeling.build_model(spec, num_labels=None, device=torch.device("cpu"), vocab_size=None).model


def train(spec: RunSpec, data: Path, folder: Path) -> tuple[dict, list[dict]]:
    """The train rule's command: (merged metrics, rank results; none for a one-process run)."""
    out = folder / spec.run_id / "metrics.json"
    out.parent.mkdir(parents=True)
    process = subprocess.run([sys.executable, "-m", "ftbench", "train", "--spec", spec.to_json(), "--data", str(data),
                              "--out", str(out), "--threads", "2"], capture_output=True, text=True, timeout=300)
    assert process.returncode == 0, f"--- stdout\n{process.stdout[-3000:]}\n--- stderr\n{process.stderr[-3000:]}"
    return json.loads(out.read_text())["metrics"], ddp.read_rank_results(out.parent / "ranks")


# ---------------------------------------------------------------------------------------------------
# Wrapping and policies


def test_repeated_blocks_are_the_decoder_layers():
    model = tiny_llama(llama_spec())
    blocks = fsdp.repeated_blocks(model)
    assert [type(b).__name__ for b in blocks] == ["LlamaDecoderLayer"] * model.config.num_hidden_layers
    # Under peft the same blocks are found through the adapter wrapper.
    lora = tiny_llama(llama_spec(method="lora"))
    assert len(fsdp.repeated_blocks(lora)) == model.config.num_hidden_layers


@pytest.mark.parametrize("precision, reduce, param_dtype, reduce_dtype", [
    ("bf16", None, torch.bfloat16, torch.bfloat16),
    ("bf16", "fp32", torch.bfloat16, torch.float32),
    ("fp32", None, None, torch.float32),
])
def test_mixed_precision_follows_the_run(precision, reduce, param_dtype, reduce_dtype):
    spec = RunSpec(parallel="fsdp", precision=precision, fsdp_reduce_dtype=reduce, fsdp_reshard_after_forward=False,
                   fsdp_cpu_offload=True)
    kwargs = fsdp.policies(spec)
    assert (kwargs["mp_policy"].param_dtype, kwargs["mp_policy"].reduce_dtype) == (param_dtype, reduce_dtype)
    assert kwargs["reshard_after_forward"] is False
    assert type(kwargs["offload_policy"]).__name__ == "CPUOffloadPolicy"


# ---------------------------------------------------------------------------------------------------
# Refused at parse time, or unsupported with the reason


def test_auto_batch_size_with_fsdp_is_refused_at_parse_time():
    config = lm_config(llama_def(), parallel="fsdp", num_gpus=2, auto_batch_size=True)
    with pytest.raises(ConfigError, match=r"auto_batch_size.*fsdp"):
        ftconfig.validate_config(config)


def test_fsdp_is_accepted_at_parse_time():
    assert only_spec(lm_config(llama_def(), parallel="fsdp", num_gpus=2, fsdp_cpu_offload=True)).parallel == "fsdp"


@pytest.mark.parametrize("settings, words", [
    ({"method": "qlora", "fsdp_cpu_offload": True}, "4-bit"),
    ({"optimizer": "adamw_8bit"}, "8-bit"),
])
def test_what_fsdp2_cannot_shard_is_unsupported(settings, words):
    assert words in feasibility.unsupported_reason(RunSpec(parallel="fsdp", **settings))
    assert feasibility.unsupported_reason(RunSpec(parallel="ddp", **settings)) is None  # only fsdp refuses them


def test_qlora_under_fsdp_is_supported_and_stores_its_packed_weights_in_the_run_dtype():
    """FSDP2 gathers parameters in the run's dtype: packed 4-bit bytes stored in another dtype would be cast."""
    spec = RunSpec(parallel="fsdp", method="qlora", precision="bf16")
    assert feasibility.unsupported_reason(spec) is None
    assert modeling._bnb_config(spec).bnb_4bit_quant_storage == torch.bfloat16
    assert modeling._bnb_config(spec.replace(parallel="ddp")).bnb_4bit_quant_storage == torch.uint8


def test_offload_needs_a_gpu():
    """CPU offload moves shards between a GPU and host memory: on a CPU run there is nothing to offload from."""
    with pytest.raises(UnsupportedConfiguration, match="offload"):
        modeling.check_supported(RunSpec(parallel="fsdp", fsdp_cpu_offload=True), torch.device("cpu"))


def test_where_an_fsdp_model_is_built():
    gpu = torch.device("cuda", 0)
    assert fsdp.build_device(llama_spec(parallel="fsdp", num_gpus=2), gpu).type == "meta"  # config-built: shapes only
    assert fsdp.build_device(llama_spec(parallel="fsdp", num_gpus=2, method="qlora"), gpu) == gpu  # 4-bit on the GPU
    assert fsdp.build_device(llama_spec(parallel="ddp", num_gpus=2), gpu) == gpu


# ---------------------------------------------------------------------------------------------------
# Memory estimate per GPU


def test_estimate_shards_states_and_moves_them_to_the_host_with_offload():
    model_def = llama_def()
    model_def["source"]["overrides"]["num_hidden_layers"] = 4  # more blocks than the two gathered at a time
    single = only_spec(lm_config(model_def, precision="bf16"))
    model = tiny_llama(single)
    base = memory_estimate.estimate(model, single, model.config.vocab_size)["memory_estimate_parts_mb"]
    four = only_spec(lm_config(model_def, precision="bf16", parallel="fsdp", num_gpus=4))
    sharded = memory_estimate.estimate(model, four, model.config.vocab_size)
    parts = sharded["memory_estimate_parts_mb"]
    assert parts["weights"] == pytest.approx(base["weights"] / 4)
    assert parts["optimizer"] == pytest.approx(base["optimizer"] / 4)
    assert parts["gradients"] > base["gradients"] / 4  # plus the gradients awaiting their reduce-scatter
    # A per-device batch either way, with the residual stream in bf16 (FSDP2 casts the parameters): 10 bytes less
    # per unit of width, layer and token.
    config = model.config
    fewer = 10 * config.hidden_size * config.num_hidden_layers * four.batch_size * four.seq_len / memory_estimate.MIB
    assert parts["activations"] == pytest.approx(base["activations"] - fewer)
    assert sharded["memory_estimate_host_mb"] is None
    kept = memory_estimate.estimate(model, four.replace(fsdp_reshard_after_forward=False), model.config.vocab_size)
    assert kept["memory_estimate_parts_mb"]["weight_copies"] > parts["weight_copies"]  # every block stays gathered
    offload = memory_estimate.estimate(model, four.replace(fsdp_cpu_offload=True), model.config.vocab_size)
    assert offload["memory_estimate_parts_mb"]["weights"] == offload["memory_estimate_parts_mb"]["optimizer"] == 0
    assert offload["memory_estimate_host_mb"] == pytest.approx((base["weights"] + base["gradients"] + base["optimizer"]) / 4)
    assert offload["memory_estimate_mb"] < sharded["memory_estimate_mb"] < memory_estimate.estimate(
        model, single, model.config.vocab_size)["memory_estimate_mb"]


# ---------------------------------------------------------------------------------------------------
# Two gloo ranks against one process on the same global batches


@pytest.mark.slow
@pytest.mark.parametrize("settings", [
    # eval_before_training: the sharded model as built, scored on both ranks, is the one process's model as built;
    # eval_every: so are the evaluations between steps (every rank takes part: the weights are sharded).
    {"eval_before_training": True, "eval_every": 2, "eval_subset": 8},
    # lora_dropout 0: dropout masks would differ between one process and two.
    {"method": "lora", "lora_dropout": 0.0, "gradient_checkpointing": True, "fsdp_reshard_after_forward": False},
], ids=["full", "lora-gc-noreshard"])
def test_fsdp_two_ranks_train_like_one_process(settings, llama_checkpoint, checkpoint_data, tmp_path):
    """Same weights (a checkpoint), same global batch (4 x 2 ranks against 8 x 1), same order: the same losses
    and the same final weights (the eval loss, computed sharded on both ranks, is a function of them)."""
    single, _ = train(checkpoint_spec(llama_checkpoint, batch_size=8, **settings), checkpoint_data, tmp_path)
    spec = checkpoint_spec(llama_checkpoint, batch_size=4, parallel="fsdp", num_gpus=2, **settings)
    metrics, ranks = train(spec, checkpoint_data, tmp_path)
    assert metrics["status"] == "ok", metrics.get("status_reason")
    assert metrics["world_size"] == 2 and len(ranks) == 2
    assert metrics["hosts"]  # where the ranks ran
    assert metrics["trainable_params"] == single["trainable_params"]
    # Each rank's loss is the mean over its half of the batch: their mean is the one process's loss.
    rank_losses = [[step["loss"] for step in r["steps"]] for r in ranks]
    mean_losses = [sum(pair) / 2 for pair in zip(*rank_losses)]
    single_out = tmp_path / checkpoint_spec(llama_checkpoint, batch_size=8, **settings).run_id / "steps.parquet"
    import pandas as pd
    assert mean_losses == pytest.approx(pd.read_parquet(single_out)["loss"].tolist(), abs=2e-4)
    assert metrics["eval_loss"] == pytest.approx(single["eval_loss"], abs=2e-4)
    assert ranks[1]["metrics"]["eval_loss"] == pytest.approx(metrics["eval_loss"])  # both ranks evaluated
    if settings.get("eval_before_training"):
        assert metrics["base_eval_loss"] == pytest.approx(single["base_eval_loss"], abs=2e-4)
        assert ranks[1]["metrics"]["base_eval_loss"] == pytest.approx(metrics["base_eval_loss"])
        assert metrics["base_eval_perplexity"] == pytest.approx(math.exp(metrics["base_eval_loss"]), rel=1e-6)
    if settings.get("eval_every"):
        def losses(run_spec):
            evals = pd.read_parquet(tmp_path / run_spec.run_id / "evals.parquet")
            return evals[evals["metric"] == "eval_loss"][["step", "scope", "value"]].values.tolist()

        one, sharded = losses(checkpoint_spec(llama_checkpoint, batch_size=8, **settings)), losses(spec)
        assert [row[:2] for row in sharded] == [row[:2] for row in one]
        assert len(sharded) > 2  # step 0, the ones between steps, the final one
        assert [row[2] for row in sharded] == pytest.approx([row[2] for row in one], abs=2e-4)
    # The FLOP cross-check, counted on the sharded model by both ranks, agrees with the one-process count.
    assert metrics["flops_counted_ratio"] == pytest.approx(single["flops_counted_ratio"], rel=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("method", ["full", "lora"])
def test_a_config_built_model_is_initialised_shard_by_shard(method, llama_data, tmp_path):
    """Under fsdp a config-built model is built on the meta device and each rank initialises only its shards:
    the run must start where a freshly initialised model starts, as the one-process run does (loss near
    ln(vocabulary) on uniform random tokens: unit norms, small normal weights, the rotary tables, LoRA's B at
    zero; memory left uninitialised would give a loss far off, or NaN) and train to the end."""
    single, _ = train(llama_spec(batch_size=8, method=method), llama_data, tmp_path)
    metrics, ranks = train(llama_spec(batch_size=4, parallel="fsdp", num_gpus=2, method=method), llama_data, tmp_path)
    assert metrics["status"] == "ok", metrics.get("status_reason")
    assert metrics["trainable_params"] == single["trainable_params"]
    vocabulary = LLAMA_OVERRIDES["vocab_size"]
    first = [r["steps"][0]["loss"] for r in ranks]
    assert all(abs(loss - math.log(vocabulary)) < 0.3 for loss in first), first  # random init: no better than chance
    single_first = pd.read_parquet(tmp_path / llama_spec(batch_size=8, method=method).run_id / "steps.parquet")["loss"][0]
    assert abs(sum(first) / 2 - single_first) < 0.1
    assert all(math.isfinite(step["loss"]) for r in ranks for step in r["steps"])
    assert metrics["total_steps"] == len(ranks[0]["steps"])


@pytest.mark.slow
@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_a_16_bit_lora_base_trains_over_two_ranks(parallel, llama_data, tmp_path):
    """LoRA's recipe under both multi-process modes: the frozen base in bf16 beside fp32 adapters (FSDP2 shards both
    kinds in one unit: its uniform-dtype check looks at trainable parameters only), every rank's row saying so, and
    a first loss where a freshly built model starts."""
    spec = llama_spec(method="lora", precision="bf16", batch_size=4, parallel=parallel, num_gpus=2)
    assert fsdp.mixes_frozen_dtypes()  # this torch's FSDP2 takes the mix; an older one is refused by name (next test)
    metrics, ranks = train(spec, llama_data, tmp_path)
    assert metrics["status"] == "ok", metrics.get("status_reason")
    assert len(ranks) == 2
    for result in [metrics] + [rank["metrics"] for rank in ranks]:
        assert (result["recipe_frozen_dtype"], result["recipe_trainable_dtype"], result["recipe_autocast_dtype"]) == \
            ("bf16", "fp32", "bf16")
    first = [rank["steps"][0]["loss"] for rank in ranks]
    assert all(abs(loss - math.log(LLAMA_OVERRIDES["vocab_size"])) < 0.3 for loss in first), first


def test_a_torch_whose_fsdp2_cannot_mix_frozen_dtypes_refuses_a_16_bit_lora_base(monkeypatch):
    monkeypatch.setattr(fsdp, "mixes_frozen_dtypes", lambda: False)
    spec = llama_spec(method="lora", precision="bf16", parallel="fsdp", num_gpus=2)
    with pytest.raises(UnsupportedConfiguration, match="lora_base_dtype: fp32"):
        modeling.check_supported(spec, torch.device("cpu"), importing=False)
    # an fp32 base (one dtype in every unit) and ddp are not refused
    modeling.check_supported(spec.replace(lora_base_dtype="fp32"), torch.device("cpu"), importing=False)
    modeling.check_supported(spec.replace(parallel="ddp"), torch.device("cpu"), importing=False)


# ---------------------------------------------------------------------------------------------------
# Multi-node: two local "nodes" (torchrun node ranks 0 and 1) meeting at a localhost rendezvous


@pytest.mark.slow
def test_two_node_ranks_meet_at_a_localhost_rendezvous(llama_data, tmp_path, monkeypatch):
    """What srun starts on each node (ddp.node_command), here as two local processes: one rank each, FSDP
    over both, merged by the launcher like any ddp/fsdp run."""
    import socket


    spec = llama_spec(parallel="fsdp", num_gpus=1, num_nodes=2)
    with socket.socket() as probe:  # a free port for the rendezvous
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]

    def two_local_nodes(spec, data_dir, rank_dir, threads, time_limit_s) -> int:
        args = ddp.worker_args(spec, data_dir, rank_dir, 1, time_limit_s)
        nodes = [subprocess.Popen(ddp.node_command(spec, args, str(rank), f"127.0.0.1:{port}", "test"))
                 for rank in (0, 1)]
        return max(node.wait(timeout=300) for node in nodes)

    monkeypatch.setattr(ddp, "run_ddp", two_local_nodes)
    metrics, steps = ddp.launch(spec, str(llama_data), tmp_path / "ranks", 2, None, run_state.StopSignal())
    assert metrics["status"] == "ok", metrics.get("status_reason")
    assert metrics["world_size"] == 2 and len(metrics["per_rank"]) == 2
    assert metrics["hosts"] == socket.gethostname()  # both "nodes" ran here
    assert steps[0]["samples"] == 2 * spec.batch_size  # one global batch over both nodes


def test_multi_node_runs_need_ddp_or_fsdp():
    with pytest.raises(ConfigError, match=r"num_nodes.*expected parallel 'ddp' or 'fsdp'"):
        ftconfig.validate_config(lm_config(llama_def(), num_nodes=2))


def test_multi_node_runs_are_refused_without_a_cluster():
    config = lm_config(llama_def(), parallel="fsdp", num_gpus=1, num_nodes=2)
    ftconfig.validate_config(config)  # valid as such: where it can run is the executor's question
    (run,) = matrix.expand_runs(config)
    with pytest.raises(ConfigError, match=r"num_nodes: run .* spans 2 nodes, which needs a SLURM cluster"):
        ftconfig.check_nodes(run, config, cluster=False)
    ftconfig.check_nodes(run, config, cluster=True)


# ---------------------------------------------------------------------------------------------------
# What a job asks SLURM for


def test_multi_node_jobs_ask_per_node():
    from ftbench.cluster import resources

    one = llama_spec(parallel="fsdp", num_gpus=4, device="auto")
    two = one.replace(num_nodes=2)
    assert (resources.train_gpus(one), resources.train_gres(one), resources.train_nodes(one)) == (4, None, 1)
    # --gpus counts the job's total, which SLURM may spread unevenly: gres gpu:4 is 4 on each node.
    assert (resources.train_gpus(two), resources.train_gres(two), resources.train_nodes(two)) == (0, "gpu:4", 2)
    assert resources.train_mem_mb(two) == resources.train_mem_mb(one)  # --mem is per node: same processes per node


def test_offload_asks_for_host_memory_and_time():
    from ftbench.cluster import resources

    sharded = llama_spec(parallel="fsdp", num_gpus=4, device="auto", precision="bf16")
    offload = only_spec(lm_config(llama_def(), parallel="fsdp", num_gpus=4, device="auto", fsdp_cpu_offload=True))
    params = resources.model_params(sharded.model_def)
    # Each of the node's 4 processes holds a quarter of the fp32 weights, gradients and AdamW state.
    extra_mb = 4 * params * 16 / 4 / 1e6
    assert resources.train_mem_mb(offload) == pytest.approx(resources.train_mem_mb(sharded) + extra_mb, abs=1)
    assert resources.train_compute_seconds(offload) > 10 * resources.train_compute_seconds(sharded)


# ---------------------------------------------------------------------------------------------------
# A config-built QLoRA model under torch.distributed: one copy of the random weights per node


def _build_qlora_rank(rank: int, port: int, out: str) -> None:
    """One process of a two-process gloo group on this "node": build the config-built QLoRA model, and note
    which ranks wrote the random weights and what each loaded."""
    import os

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), LOCAL_RANK=str(rank),
                      TORCHELASTIC_RUN_ID="test-launch", TMPDIR=str(Path(out) / "tmp"))
    import tempfile

    tempfile.tempdir = None  # read TMPDIR again in this process
    torch.distributed.init_process_group("gloo", rank=rank, world_size=2)
    save = modeling.safetensors.torch.save_model

    def noted_save(model, filename, *args, **kwargs):
        with open(Path(out) / "writers", "a") as notes:
            notes.write(f"{rank}\n")
        return save(model, filename, *args, **kwargs)

    modeling.safetensors.torch.save_model = noted_save
    torch.manual_seed(rank)  # different seeds: equal weights can only come from the one copy
    spec = llama_spec(parallel="fsdp", num_gpus=2, method="qlora", precision="bf16")
    model = modeling.build_model(spec, None, torch.device("cpu")).model
    weights = {name: tensor.float().sum().item() for name, tensor in model.state_dict().items()
               if "lora" not in name and tensor.is_floating_point()}
    (Path(out) / f"rank{rank}.json").write_text(json.dumps(weights))
    torch.distributed.destroy_process_group()


@pytest.mark.slow
def test_config_built_qlora_writes_one_copy_per_node_that_every_rank_loads(tmp_path):
    """QLoRA quantises while loading, so a config-built model's random weights are written and loaded back: under
    torch.distributed the node's first process writes them once, every process loads that copy (the same
    weights whatever its own seed), and the copy is gone afterwards."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    (tmp_path / "tmp").mkdir()
    mp.spawn(_build_qlora_rank, args=(port, str(tmp_path)), nprocs=2, join=True)
    assert (tmp_path / "writers").read_text().split() == ["0"]
    first, second = (json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1))
    assert first == second and len(first) > 5
    assert not list((tmp_path / "tmp").glob("ftbench-model-*"))  # (torch.compile caches may be there)
