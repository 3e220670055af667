"""What each training job asks the scheduler for: GPUs, CPU threads, walltime and host memory.

The requests are pinned for a few representative runs (values computed with the estimate as it stood in
rules/common.smk before it moved into scripts/ftbench/cluster/resources.py): a CPU run, a 1-GPU bf16 run, DDP
over 4 GPUs, DataParallel, auto_batch_size, QLoRA with checkpointing, epochs against max_steps, a hub
model whose config cannot be read (1e9 parameters assumed), and config.json shapes with other key names.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest

from conftest import MINILM_SOURCE, snakemake_failure, write_config
from ftbench.experiment import matrix
from ftbench.cluster import resources

# Llama 3.2 1B's shape: 1.34e9 parameters by the estimate's formula.
LLAMA_1B = {"hidden_size": 2048, "num_hidden_layers": 16, "intermediate_size": 8192, "vocab_size": 128256,
            "num_attention_heads": 32, "num_key_value_heads": 8}
BERT_SMALL = {"hidden_size": 384, "num_hidden_layers": 6, "intermediate_size": 1536, "vocab_size": 30522,
              "num_attention_heads": 12, "max_position_embeddings": 512}
GPT2_STYLE = {"n_embd": 768, "n_layer": 12, "n_head": 12, "n_inner": None}  # no MLP width, no vocabulary

# name -> the run's settings (on top of RunSpec's defaults: lora, fp32, 1 GPU, 1 epoch)
RUNS = {
    "gpu_bf16": {"model": "llama", "dataset": "corpus", "precision": "bf16", "batch_size": 8, "seq_len": 512},
    "cpu": {"model": "bert", "dataset": "reviews", "num_gpus": 0, "batch_size": 32, "seq_len": 64},
    "device_cpu": {"model": "bert", "dataset": "reviews", "device": "cpu", "batch_size": 32, "seq_len": 64},
    "ddp4": {"model": "llama", "dataset": "corpus", "method": "full", "precision": "bf16", "parallel": "ddp",
             "num_gpus": 4, "batch_size": 8, "seq_len": 1024, "grad_accum_steps": 2},
    "dp2": {"model": "llama", "dataset": "corpus", "method": "full", "parallel": "dp", "num_gpus": 2,
            "batch_size": 4, "seq_len": 256},
    "auto_batch_size": {"model": "llama", "dataset": "corpus", "precision": "bf16", "auto_batch_size": True,
                        "auto_batch_size_max": 256, "batch_size": 8, "seq_len": 256},
    "qlora_checkpointing": {"model": "llama", "dataset": "corpus", "method": "qlora", "precision": "bf16",
                            "gradient_checkpointing": True, "batch_size": 16, "seq_len": 512, "max_eval_samples": 200},
    "epochs3": {"model": "llama", "dataset": "corpus", "precision": "fp16", "epochs": 3, "batch_size": 16, "seq_len": 256},
    "max_steps": {"model": "llama", "dataset": "corpus", "precision": "fp16", "max_steps": 500, "batch_size": 16, "seq_len": 256},
    "unknown_hub_model": {"model": "hub", "dataset": "hub_split", "batch_size": 16, "seq_len": 128},
    "text_config": {"model": "vlm", "dataset": "corpus", "precision": "bf16", "batch_size": 8, "seq_len": 512},
    "gpt2_keys": {"model": "gpt2", "dataset": "corpus", "batch_size": 8, "seq_len": 512},
}

# name -> (GPUs, threads on a cluster, runtime minutes at attempt 1 and 2, mem_mb at attempt 1 and 2)
EXPECTED = {
    "gpu_bf16": (1, 4, 98, 196, 18692, 37384),
    "cpu": (0, 8, 21, 42, 8208, 16416),
    "device_cpu": (0, 8, 21, 42, 8208, 16416),
    "ddp4": (4, 16, 54, 108, 50766, 101532),
    "dp2": (2, 8, 147, 294, 18692, 37384),
    "auto_batch_size": (1, 4, 52, 104, 18692, 37384),
    "qlora_checkpointing": (1, 4, 249, 498, 18692, 37384),
    "epochs3": (1, 4, 143, 286, 18692, 37384),
    "max_steps": (1, 4, 25, 50, 18692, 37384),
    "unknown_hub_model": (1, 4, 535, 1070, 16000, 32000),
    "text_config": (1, 4, 98, 196, 18692, 37384),
    "gpt2_keys": (1, 4, 63, 126, 9103, 18206),
}


def checkpoint(folder: Path, settings: dict) -> Path:
    """A model folder with its config.json (all the estimate reads) and an empty weights file: parsing
    refuses a checkpoint folder without weights, and no test here loads them."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(settings))
    (folder / "model.safetensors").touch()
    return folder


def representative_config(folder: Path) -> dict:
    """An experiment whose runs are RUNS, in that order (the first is the matrix, the others includes)."""
    synthetic = {"kind": "synthetic"}
    first, *others = RUNS.values()
    return {
        "models": {
            "llama": {"task": "causal_lm", "source": {"kind": "config", "architecture": "LlamaConfig", "overrides": LLAMA_1B}},
            "bert": {"source": {"kind": "path", "path": str(checkpoint(folder / "bert", BERT_SMALL))}},
            "vlm": {"task": "causal_lm", "source": {"kind": "path", "path": str(checkpoint(folder / "vlm", {"text_config": LLAMA_1B}))}},
            "gpt2": {"task": "causal_lm", "source": {"kind": "path", "path": str(checkpoint(folder / "gpt2", GPT2_STYLE))}},
            "hub": {"source": {"kind": "hub", "name": "example-org/not-in-the-cache"}},
        },
        "datasets": {
            "corpus": {"source": synthetic, "train_size": 20000, "eval_size": 1000},
            "reviews": {"source": synthetic, "train_size": 2000, "eval_size": 1000},
            # Splits the source has: their sizes are unknown before the data is prepared.
            "hub_split": {"source": {"kind": "hub", "name": "example-org/reviews"}, "train_split": "train",
                          "eval_split": "test", "text_column": "text", "label_column": "label"},
        },
        "matrix": {key: [value] for key, value in first.items()},
        "include": others,
    }


@pytest.fixture(scope="module")
def representative_runs(tmp_path_factory):
    """(experiment folder, config, {name: RunSpec})."""
    folder = tmp_path_factory.mktemp("resources")
    config = representative_config(folder)
    runs = matrix.expand_runs(config)
    assert len(runs) == len(RUNS)
    return folder, config, dict(zip(RUNS, runs))


@pytest.mark.parametrize("name", RUNS)
def test_requests_of_representative_runs(representative_runs, name):
    run = representative_runs[2][name]
    gpus, cluster_threads, runtime, runtime_retried, mem_mb, mem_mb_retried = EXPECTED[name]
    assert resources.train_gpus(run) == gpus
    assert resources.train_threads(run, local=True, cores=6) == 6
    assert resources.train_threads(run, local=False, cores=6) == cluster_threads
    assert [resources.train_runtime_minutes(run, attempt) for attempt in (1, 2)] == [runtime, runtime_retried]
    assert [resources.train_mem_mb(run, attempt) for attempt in (1, 2)] == [mem_mb, mem_mb_retried]


def test_model_params_from_the_config_a_model_is_read_from(representative_runs):
    _, config, _ = representative_runs
    models = config["models"]
    llama = 16 * (4 * 2048**2 + 3 * 2048 * 8192) + 128256 * 2048
    assert resources.model_params(models["llama"]) == resources.model_params(models["vlm"]) == llama
    # GPT-2 names: n_embd, n_layer; no MLP width (4 x 768) and no vocabulary (32000 assumed).
    assert resources.model_params(models["gpt2"]) == 12 * (4 * 768**2 + 3 * 768 * 4 * 768) + 32000 * 768
    assert resources.model_params({"source": MINILM_SOURCE}) == 6 * (4 * 384**2 + 3 * 384 * 1536) + 30522 * 384
    assert resources.model_params(models["hub"]) == resources.DEFAULT_MODEL_PARAMS
    assert resources.model_params({"source": {"kind": "path", "path": "/nonexistent/checkpoint"}}) == resources.DEFAULT_MODEL_PARAMS


def test_steps_are_the_trainers_steps(representative_runs):
    runs = representative_runs[2]
    assert resources.train_steps(runs["ddp4"], 20000) == runs["ddp4"].planned_steps(20000) == 20000 // (8 * 4 * 2)
    assert resources.train_steps(runs["max_steps"], 20000) == 500


def test_auto_batch_size_plans_the_largest_batch_the_data_allows(representative_runs):
    auto = representative_runs[2]["auto_batch_size"].replace(auto_batch_size_max=1024, max_steps=100)
    small = {**auto.dataset_def, "train_size": 500}
    at_cap = auto.replace(auto_batch_size=False, batch_size=500, dataset_def=small)
    assert resources.train_compute_seconds(auto.replace(dataset_def=small)) == resources.train_compute_seconds(at_cap)
    # Plenty of data: the search may reach auto_batch_size_max.
    at_max = auto.replace(auto_batch_size=False, batch_size=1024)
    assert resources.train_compute_seconds(auto) == resources.train_compute_seconds(at_max)


def test_the_evaluation_before_training_is_a_second_eval_pass_in_the_time_asked_for(representative_runs):
    run = representative_runs[2]["cpu"]
    once, twice = (resources.train_compute_seconds(run.replace(eval_before_training=flag), on_gpu=False) for flag in (False, True))
    without_eval = resources.train_compute_seconds(run.replace(max_eval_samples=1), on_gpu=False)  # one example: ~nothing
    assert twice - once == pytest.approx(once - without_eval, rel=0.01)
    # scored by the shared step (rules/base_eval.smk), it is not the train job's work
    shared = resources.train_compute_seconds(run.replace(eval_before_training=True), on_gpu=False, base_eval_in_job=False)
    assert shared == once


# BERT_SMALL's parameters by the estimate's formula (test_model_params_from_the_config_a_model_is_read_from).
BERT_SMALL_PARAMS = 6 * (4 * 384**2 + 3 * 384 * 1536) + 30522 * 384


@pytest.mark.parametrize("steps, before_training, evaluations", [
    # The trainer evaluates before steps 0, 10, 20, 30 of 40 (the final evaluation follows step 39, so none at 40).
    (40, False, 4),
    (40, True, 3),  # step 0's is the evaluation before training, on the whole split: counted apart
    # 45 steps: before 0, 10, 20, 30 and 40, five steps before the final evaluation.
    (45, False, 5),
    (45, True, 4),
])
def test_evaluations_during_training_are_in_the_time_asked_for(representative_runs, steps, before_training, evaluations):
    """eval_every 10 scores eval_subset examples before each step the trainer evaluates at (hand-counted above;
    the trainer's own schedule: test_base_evaluation's test of evaluations_between_steps), and the walltime asks
    for those examples' forward passes: 2 FLOPs per parameter per token at the CPU rate, twice over (the margin)."""
    run = representative_runs[2]["cpu"].replace(max_steps=steps, eval_before_training=before_training, max_eval_samples=1000)
    every = run.replace(eval_every=10, eval_subset=800)  # one evaluation: about 2 minutes of the limit
    final = 1000 * (2 if before_training else 1)
    assert resources.evaluations_between_steps(every, 2000) == evaluations
    assert resources.eval_examples_scored(run, 2000) == final
    assert resources.eval_examples_scored(every, 2000) == final + evaluations * 800
    if before_training:  # the shared step scored the base: the job scores the final evaluation and the subsets
        assert resources.eval_examples_scored(every, 2000, base_eval_in_job=False) == 1000 + evaluations * 800
    flops = 6 * BERT_SMALL_PARAMS * steps * 32 * 64 + 2 * BERT_SMALL_PARAMS * 64 * (final + evaluations * 800)
    minutes = math.ceil((resources.TRAIN_STARTUP_S + 2 * flops / 5e10) / 60)
    assert resources.train_runtime_minutes(every, local=True, environ={}) == minutes


def test_a_split_smaller_than_one_batch_asks_for_the_floor_not_a_crash(representative_runs):
    run = representative_runs[2]["cpu"].replace(dataset_def={"source": {"kind": "synthetic"}, "train_size": 10, "eval_size": 10})
    assert resources.train_steps(run, 10) == 1
    assert resources.train_runtime_minutes(run) == resources.TRAIN_RUNTIME_FLOOR_MIN


def test_locally_a_gpu_run_on_a_machine_without_a_gpu_is_estimated_at_the_cpu_rate(representative_runs, monkeypatch):
    """Such a run falls back to the CPU (device auto): a GPU-speed limit would stop it as a timeout."""
    run = representative_runs[2]["gpu_bf16"]
    at_cpu_rate = math.ceil((resources.TRAIN_STARTUP_S + resources.TRAIN_RUNTIME_MARGIN
                             * resources.train_compute_seconds(run, on_gpu=False)) / 60)
    monkeypatch.setattr(resources, "local_gpu_visible", lambda: False)
    assert resources.train_runtime_minutes(run, local=True) == at_cpu_rate > 10 * resources.train_runtime_minutes(run)
    assert resources.train_runtime_minutes(run, local=False) == EXPECTED["gpu_bf16"][2]  # a cluster's GPU node
    monkeypatch.setattr(resources, "local_gpu_visible", lambda: True)
    assert resources.train_runtime_minutes(run, local=True) == EXPECTED["gpu_bf16"][2]


def test_the_speed_decided_for_the_invocation_wins_over_where_the_estimate_is_made(representative_runs, monkeypatch):
    """The Snakemake inside a cluster job sees no GPU (or another node's) and is not a cluster executor: it
    must still get the number that was submitted, which the planning Snakemake handed down in the environment."""
    run = representative_runs[2]["gpu_bf16"]
    at_gpu, at_cpu = EXPECTED["gpu_bf16"][2], resources.train_runtime_minutes(run, environ={resources.TRAIN_SPEED_ENV: "cpu"})
    assert at_cpu > 10 * at_gpu
    monkeypatch.setattr(resources, "local_gpu_visible", lambda: False)
    submitted = resources.train_runtime_minutes(run, environ={})  # where jobs are submitted: a GPU node's speed
    handed_down = {resources.TRAIN_SPEED_ENV: resources.train_speed(local=False, environ={})}
    for local in (False, True):  # inside the job, whichever executor it counts as, with no GPU visible
        assert resources.train_runtime_minutes(run, 1, local=local, environ=handed_down) == submitted == at_gpu
        assert resources.train_runtime_minutes(run, 2, local=local, environ=handed_down) == 2 * at_gpu
    # Locally with no GPU, decided once for the invocation: the CPU's speed, in the dry run and the job alike.
    local_decision = {resources.TRAIN_SPEED_ENV: resources.train_speed(local=True, environ={})}
    assert local_decision == {resources.TRAIN_SPEED_ENV: "cpu"}
    assert resources.train_runtime_minutes(run, environ=local_decision) == at_cpu
    # A CPU run is at the CPU's speed whatever was decided.
    cpu_run = representative_runs[2]["cpu"]
    assert resources.train_runtime_minutes(cpu_run, environ={resources.TRAIN_SPEED_ENV: "gpu"}) == EXPECTED["cpu"][2]


def test_a_wrong_speed_in_the_environment_is_refused():
    with pytest.raises(resources.FtbenchError, match=f"{resources.TRAIN_SPEED_ENV}='fast': expected gpu or cpu"):
        resources.train_speed(local=True, environ={resources.TRAIN_SPEED_ENV: "fast"})


def test_no_gpu_is_visible_where_cuda_visible_devices_hides_them(monkeypatch):
    resources.local_gpu_visible.cache_clear()
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    try:
        assert resources.local_gpu_visible() is False
    finally:
        resources.local_gpu_visible.cache_clear()


def train_job_requests(output: str) -> dict[str, dict]:
    """run_id -> {threads, gpu, runtime, mem_mb} of the train jobs a dry run lists."""
    requests = {}
    for block in output.split("rule train:")[1:]:
        run_id = re.search(r"wildcards: run_id=(\S+)", block).group(1)
        resources = dict(re.findall(r"(\w+)=([^,\s]+)", re.search(r"resources: (.*)", block).group(1)))
        requests[run_id] = {"threads": int(re.search(r"threads: (\d+)", block).group(1)),
                            **{key: int(resources[key]) for key in ("gpu", "runtime", "mem_mb")}}
    return requests


@pytest.mark.slow
def test_the_train_rule_asks_for_the_estimate(representative_runs, snakemake_runner):
    """Through Snakemake: the rule passes the estimate on (locally a job takes all of --cores, here 2)."""
    folder, config, runs = representative_runs
    write_config(folder, config)
    process = snakemake_runner(folder, "-n")
    assert process.returncode == 0, snakemake_failure(process)
    requests = train_job_requests(process.stdout + process.stderr)
    for name, run in runs.items():
        gpus, _, _, _, mem_mb, _ = EXPECTED[name]
        # Locally, for the device this machine has (tests/test_resources.py above: no GPU -> the CPU's rate).
        runtime = resources.train_runtime_minutes(run, local=True)
        assert requests[run.run_id] == {"threads": 2, "gpu": gpus, "runtime": runtime, "mem_mb": mem_mb}, name
    # --set-resources replaces the estimate of the first attempt (a retry scales it: below); locally a walltime under
    # the scheduled minimum is the job's own affair (it stops itself), so it is not refused here.
    given = snakemake_runner(folder, "-n", "--set-resources", "train:runtime=1", "train:mem_mb=9000")
    assert given.returncode == 0, snakemake_failure(given)
    assert {(r["runtime"], r["mem_mb"]) for r in train_job_requests(given.stdout + given.stderr).values()} == {(1, 9000)}


def test_a_retry_scales_a_given_walltime_and_memory_as_it_scales_the_estimate(representative_runs):
    """The README promises twice the walltime on a retry: a value given with --set-resources gets it too (Snakemake
    alone would give every attempt the same number, and a job its walltime ended would end again)."""
    _, _, runs = representative_runs
    run = next(iter(runs.values()))
    estimate = [resources.train_runtime_minutes(run, attempt) for attempt in (1, 2, 3)]
    assert estimate[1] == 2 * estimate[0] and estimate[2] == 4 * estimate[0]
    assert [resources.given_per_attempt("runtime", 5, attempt) for attempt in (1, 2, 3)] == [5, 10, 20]
    memory = [resources.train_mem_mb(run, attempt) for attempt in (1, 2)]
    assert memory[1] == 2 * memory[0]
    assert [resources.given_per_attempt("mem_mb", 9000, attempt) for attempt in (1, 2, 3)] == [9000, 18000, 27000]
