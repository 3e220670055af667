"""The evaluation before training as a job of its own (rule base_eval): the model as built, scored as a train job's
evaluation before training scores it, once for every run that starts from the same weights (which runs those are:
experiment/base_evaluation.py). The train jobs read the result (evaluation.read_shared_base) instead of scoring.

The model is built as the train job builds it (seeded, on the run's device), and scored on the same rows (the
final evaluation's: evaluation.score) with the same batches, under the same training layout of a 4-bit base
(evaluation.training_layout_kept), so the figures are the ones each run would have computed itself.

A model this job cannot build or score (a package missing, out of memory, an error) is not the workflow's end: the
result says why (status not ok), and each train job of that key then evaluates before training itself, meeting the
problem as its own run and recording it in its row. Damaged data (ManifestError) fails the job, as it fails a
train job, until it is repaired.
"""

from __future__ import annotations

import time
import traceback
from pathlib import Path

import torch

from ftbench import atomic
from ftbench.cluster.gpu_slots import GpuSlots, assign_gpus
from ftbench.data import prepared
from ftbench.errors import ManifestError
from ftbench.experiment import base_evaluation
from ftbench.measure import environment
from ftbench.runspec import RunSpec
from ftbench.tasks import registry
from ftbench.train import evaluation, fsdp, modeling, trainer
from ftbench.train.devices import Distributed, choose_device
from ftbench.train.run_state import set_seed


def run_job(spec: RunSpec, data_dir: str | Path, out: Path, threads: int | None = None,
            time_limit_s: float | None = None) -> dict:
    """Score ``spec``'s model as built on its eval split; write ``out`` (JSON: the key, status, figures, time, whether
    the job ran forked from the warm process)."""
    result = {"base_eval_id": base_evaluation.base_eval_id(spec), "key": base_evaluation.base_eval_key(spec),
              "run_id": spec.run_id, "status": "ok", "reason": None,
              "warm_start": environment.job_started_at is not None}  # forked from the warm process, as a train row says
    slots = GpuSlots()
    assign_gpus(spec.num_gpus if spec.device != "cpu" else 0, slots)
    if threads:
        torch.set_num_threads(threads)
    try:
        result.update(score_as_built(spec, data_dir, time_limit_s))
    except ManifestError:
        raise
    except Exception as exc:  # noqa: BLE001 - each train job then evaluates itself and records what happens
        traceback.print_exc()
        result.update(status="not_evaluated", reason=f"{type(exc).__name__}: {' '.join(str(exc).split())}"[:300])
    finally:
        slots.release()
    atomic.write_json(out, result)
    return result


def score_as_built(spec: RunSpec, data_dir: str | Path, time_limit_s: float | None) -> dict:
    """{figures: the evaluation's scores, eval_time_s, device, device_name}: the model built as trainer._prepare
    builds it, scored as evaluation.DuringTraining scores it before the first step."""
    started = time.monotonic()
    device, _ = choose_device(spec, Distributed())
    modeling.check_supported(spec, device)
    manifest = prepared.verify(data_dir)
    set_seed(spec.seed)
    eval_split = registry.load_split(data_dir, "eval", manifest)
    built = modeling.build_model(spec, num_labels=len(manifest["label_names"] or []) or None,
                                 device=fsdp.build_device(spec, device), pad_token_id=manifest["pad_token_id"],
                                 vocab_size=manifest.get("vocab_size"))
    # A time limit ends the evaluation between rounds, keeping a tenth of it for writing the result.
    budget = evaluation.EvalBudget(started + 0.9 * time_limit_s if time_limit_s else None, 0.0)
    scoring = time.perf_counter()
    with evaluation.training_layout_kept(built.model):
        figures = trainer.evaluate(built.model, eval_split, spec, manifest["task"], device, manifest["pad_token_id"],
                                   another_batch_fits=budget.another_batch_fits if time_limit_s else None)
    return {"figures": figures, "eval_time_s": time.perf_counter() - scoring, "device": device.type,
            "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else environment.cpu_model()}
