"""Which runs share one evaluation before training (eval_before_training): those whose model, as built before the
first step, is the same model scoring the same examples the same way. The rule base_eval (rules/base_eval.smk)
computes it once per key, in a job of its own whose output the train jobs read (train/base_eval_job.py), so it
is reused by every run, experiment and re-run that starts from the same weights.

What makes two models as built the same: the model's definition, the random initialisation of what is new in it (a
classification head: the seed), and the weights' dtypes and how the forward pass computes (the recipe: frozen or
trained dtype, autocast, compute dtype; QLoRA's 4-bit quantisation). Full fine-tuning and LoRA share it: LoRA's B
matrices start at zero, so an adapted model computes exactly its base's outputs (an fp32 full run and an fp32 LoRA
run, any rank, share one; a LoRA run whose frozen base is 16-bit does not share with an fp32 one; QLoRA's quantised
base is a key of its own). What makes the scoring the same: the prepared data (its id), the rows scored
(max_eval_samples), the eval batch size (a retrieval loss contrasts within a batch) and the kind of device.

Runs that keep their evaluation before training in their own job: fsdp (the model is sharded over the run's ranks as
it is built) and runs this version records as unsupported from their settings alone (nothing is built for them).

Torch-free: Snakemake reads it when it builds the workflow.
"""

from __future__ import annotations

from collections.abc import Iterable

from ftbench.experiment import feasibility
from ftbench.experiment.matrix import short_hash
from ftbench.recipe import recipe_of
from ftbench.runspec import SPEC_VERSION, RunSpec

# Where the shared evaluations are written (one JSON per key), under the workflow's folder.
BASE_EVAL_DIR = "results/base_eval"


def shares_base_evaluation(run: RunSpec) -> bool:
    """Whether the run's evaluation before training is the shared step's (else its own job scores it, or none)."""
    return run.eval_before_training and run.parallel != "fsdp" and feasibility.unsupported_reason(run) is None


def base_eval_key(run: RunSpec) -> dict:
    """Everything that decides the model as built and how the evaluation before training scores it (the
    module's docstring); equal keys give equal figures."""
    recipe = recipe_of(run)
    return {
        "model_def": run.model_def,
        "data_id": run.data_id,
        "seed": run.seed,
        # The weights as built: the frozen base's dtype (LoRA, QLoRA's nf4 / fp4), else the trained weights' (full).
        "weights_dtype": recipe.frozen_dtype or recipe.trainable_dtype,
        "autocast_dtype": recipe.autocast_dtype,
        "compute_dtype": recipe.compute_dtype,
        "double_quant": run.qlora_double_quant if run.method == "qlora" else None,
        "kernels": run.kernels,
        "attn_implementation": run.attn_implementation,
        "image_size": run.image_size,
        "max_eval_samples": run.max_eval_samples,
        "eval_batch_size": run.eval_batch_size,
        "device": "gpu" if run.uses_gpu else "cpu",
        "spec_version": SPEC_VERSION,
        # Answers generated and how they are scored: only where the run generates, so other keys stay as they were.
        **({"generation": {"answer_metric": run.answer_metric, "answer_regex": run.answer_regex,
                           "max_new_tokens": run.max_new_tokens}} if run.answer_metric not in (None, "none") else {}),
    }


def base_eval_id(run: RunSpec) -> str:
    """The shared evaluation's name: model, dataset and the key's hash."""
    return f"{run.model}-{run.dataset}-{short_hash(base_eval_key(run))}"


def base_eval_path(run: RunSpec) -> str:
    return f"{BASE_EVAL_DIR}/{base_eval_id(run)}.json"


def evaluation_spec(run: RunSpec) -> RunSpec:
    """The run the shared job builds and scores: ``run`` on one device (a dp or ddp run's rank 0 scores on one too)."""
    return run.replace(parallel="single", num_gpus=min(run.num_gpus, 1), num_nodes=1)


def shared_evaluations(runs: Iterable[RunSpec]) -> dict[str, RunSpec]:
    """The shared evaluations the runs need, by id: the first run of each key, on one device, stands for it."""
    shared: dict[str, RunSpec] = {}
    for run in runs:
        if shares_base_evaluation(run):
            shared.setdefault(base_eval_id(run), evaluation_spec(run))
    return shared
