"""The columns of ``results/metrics.parquet``: one row per run. This is the one place they are defined.

Each entry: name -> (pandas dtype, meaning). ``collect`` writes exactly these columns in this order; a
value a run did not produce (an OOM run has no accuracy; a CPU run has no CUDA memory) is null, never 0.
"""

from __future__ import annotations

from ftbench.data import prepared
from ftbench.measure.metrics import HOST_BOUND_BUSY_SHARE, describe_statuses, gpu_busy
from ftbench.recipe import RECIPE_COLUMNS
from ftbench.runspec import spec_columns

# The eval figures an evaluation before training (eval_before_training) also gives as base_<figure>: every task's.
BASE_FIGURES = ("eval_loss", "eval_accuracy", "eval_token_accuracy", "eval_perplexity", "eval_recall_at_1",
                "eval_recall_at_1_i2t", "eval_recall_at_1_t2i", "eval_generation_score")
# What generating answers cost (tasks/generation.py), for the final evaluation and, as base_<name>, the one before
# training: (dtype, meaning).
GENERATION_COST = {
    "eval_generation_s": ("Float64", "answer_metric: seconds of generating and scoring the answers (device synchronised "
                                     "before and after), part of eval_time_s, never of train_time_s or tokens_per_s"),
    "eval_generation_rows": ("Int64", "answer_metric: prompts answered (the n of eval_generation_score's interval: the "
                                      "eval rows scored, fewer only where the job's time limit ended generation)"),
    "eval_generated_tokens": ("Int64", "answer_metric: tokens generated, each answer's up to and including the token "
                                       "that ended it (no padding)"),
}

COLUMNS: dict[str, tuple[str, str]] = {
    # identity and configuration
    "run_id": ("string", "readable run name plus a short hash of the normalised run spec"),
    "config_id": ("string", "the run's configuration without repeat and seed: repeats share it"),
    "status": ("string", describe_statuses()),
    "status_reason": ("string", "why the status is not ok, or a note (e.g. CPU fallback); null when nothing to say"),
    "task": ("string", "classification | causal_lm | seq2seq | image_classification | image_text_retrieval | vision_language"),
    "data_kind": ("string", "the dataset's source kind (hub | path | package | synthetic): the report shows no quality figure for synthetic (random-token) data"),
    # the run's settings, as ftbench.runspec defines them
    **spec_columns(),
    "auto_batch_size_found": ("Int64", "largest per-device batch that fitted (the one measured); null without the search"),
    "auto_batch_size_oom_at": ("Int64", "smallest per-device batch that ran out of memory; null if none did (the limit was reached)"),
    # engine hf_trainer: the Trainer's own settings that change what is measured (null for the loop)
    "hf_max_grad_norm": ("Float64", "engine hf_trainer: gradient clipping norm the Trainer applied (its default 1.0; the loop does not clip)"),
    "hf_optim": ("string", "engine hf_trainer: the Trainer's optimizer name (adamw -> adamw_torch_fused on CUDA, adamw_torch otherwise)"),
    "hf_lr_scheduler": ("string", "engine hf_trainer: the Trainer's learning-rate schedule (linear after lr_warmup_steps)"),
    "hf_dataloader_workers": ("Int64", "engine hf_trainer: dataloader worker processes (0: batches built in the training process)"),
    # where it ran
    "device": ("string", "cuda | cpu: where the run actually trained"),
    "device_name": ("string", "GPU name, or CPU model"),
    "world_size": ("Int64", "devices that trained together"),
    "host": ("string", "host name"),
    "hosts": ("string", "ddp/fsdp: every host the run's ranks ran on, comma-separated (num_nodes of them; num_gpus "
                        "GPUs on each); null for one-process runs"),
    "gpu_names": ("string", "all visible GPUs, comma-separated"),
    "gpu_driver": ("string", "NVIDIA driver version"),
    "cuda_version": ("string", "CUDA version torch was built with"),
    "cpu": ("string", "CPU model of the host"),
    "torch_version": ("string", "torch version"),
    "transformers_version": ("string", "transformers version"),
    "peft_version": ("string", "peft version"),
    "bitsandbytes_version": ("string", "bitsandbytes version, null if not installed"),
    "git_commit": ("string", "commit of the ftbench checkout that measured the run"),
    "slurm_job_id": ("string", "SLURM job id when run under SLURM"),
    # size
    "trainable_params": ("Int64", "parameters updated by the optimizer"),
    "total_params": ("Int64", "all parameters (4-bit weights counted as the values they represent)"),
    # the recipe: which dtype each kind of tensor was kept in (ftbench/recipe.py), to line a row up against a script
    **{name: ("boolean" if name == "recipe_master_weights" else "string", meaning) for name, meaning in RECIPE_COLUMNS.items()},
    # throughput over the measured window (warmup steps excluded)
    "total_steps": ("Int64", "optimizer steps planned, warmup included"),
    "last_step": ("Int64", "index of the last step started (where an oom / diverged / timeout run stopped)"),
    "grad_scaler_skipped_steps": ("Int64", "fp16: steps the GradScaler skipped (inf/NaN gradients, weights not updated); null without fp16"),
    "warmup_steps": ("Int64", "steps run before the measured window, excluded from timing (with warmup_until_stable: the steps it took)"),
    "warmup_settled": ("boolean", "warmup_until_stable: true if step times settled (last 5 within 5% of their median), false if warmup_max_steps ended warmup; null without it"),
    "measured_steps": ("Int64", "steps in the measured window"),
    "measured_time_s": ("Float64", "seconds of the measured window (device synchronised at both ends)"),
    "measured_tokens": ("Int64", "real (unpadded) tokens processed in the measured window, all devices (image tasks: text + image tokens)"),
    "samples_per_s": ("Float64", "samples per second, all devices together"),
    "tokens_per_s": ("Float64", "real tokens per second, all devices together (global)"),
    "tokens_per_s_per_device": ("Float64", "tokens_per_s divided by world_size"),
    "padding_fraction": ("Float64", "share of processed positions that were padding (not counted as tokens)"),
    # tokens trained apart from those processed (instruction data: the completions, loss_on); null where every
    # processed token is trained or the family does not count them apart
    "measured_trained_tokens": ("Int64", "tokens the loss was computed on in the measured window, all devices, padding never counted (instruction: the completion or assistant tokens; loss_on all: every token but each row's first); part of measured_tokens"),
    "trained_tokens_per_s": ("Float64", "trained tokens per second, all devices together (part of tokens_per_s)"),
    "trained_token_fraction": ("Float64", "measured_trained_tokens / measured_tokens: the share of processed tokens the loss is computed on"),
    # image tasks (null for text runs): tokens above count text plus image tokens; here they are apart
    "measured_images": ("Int64", "images processed in the measured window, all devices"),
    "images_per_s": ("Float64", "images per second, all devices together"),
    "images_per_s_per_device": ("Float64", "images_per_s divided by world_size"),
    "image_tokens_per_s": ("Float64", "image tokens per second, all devices; part of tokens_per_s (image_classification and image_text_retrieval: patch + class tokens; vision_language: the image features placed in the decoder's sequence)"),
    "text_tokens_per_s": ("Float64", "real (unpadded) text tokens per second of an image task (0 for image classification; image_text_retrieval: caption tokens; vision_language: prompt and answer); part of tokens_per_s"),
    "packing_efficiency": ("Float64", "packed runs (batching pack / padding_free): real tokens / row capacity of the packed rows; null otherwise"),
    "step_time_median_s": ("Float64", "median seconds per measured step"),
    "step_time_p90_s": ("Float64", "90th percentile seconds per measured step"),
    # compute efficiency (conventions: scripts/ftbench/measure/flops.py)
    "flops_per_step_analytic": ("Float64", "model FLOPs per optimizer step, analytic (6N or 4N+2N_trainable per token, plus attention)"),
    "tflops_per_s": ("Float64", "analytic model TFLOP/s over the measured window, all devices"),
    "mfu": ("Float64", "model FLOPs utilisation: tflops_per_s / (dense peak x devices); null if the peak is unknown"),
    "mfu_peak_tflops": ("Float64", "dense peak TFLOP/s per device used for mfu (config/gpus.yaml)"),
    "mfu_peak_source": ("string", "the config/gpus.yaml entry and dtype the peak came from"),
    "flops_counted_microbatch": ("Float64", "torch.utils.flop_counter FLOPs of one micro-batch forward+backward"),
    "flops_analytic_microbatch": ("Float64", "analytic FLOPs of the same micro-batch (padded shapes, as the counter sees)"),
    "flops_counted_error": ("string", "why the FLOP counter gave no count (e.g. an attention kernel it cannot count)"),
    "flops_counted_ratio": ("Float64", "counted / analytic model FLOPs of one micro-batch (one sample with gradient checkpointing, which is off for the count: recomputation is not model FLOPs; bitsandbytes 4-bit matmuls counted as the matmuls they replace)"),
    "flops_count_time_s": ("Float64", "seconds of the FLOP cross-check's own forward and backward pass (before the first step: part of overhead_s; it also pays lazy CUDA initialisation the first step would otherwise pay); null where the first training step's first micro-batch was counted as it trained, with no pass of its own (one device, eager, padded batches, no checkpointing)"),
    "loader_wait_fraction": ("Float64", "share of measured step time the host spent collating batches; a step's first batch is collated during the step before, while the GPU runs its update (the GPU waits only for what exceeds that)"),
    # GPU sampling through NVML over the measured window, paused like its time for evaluations between steps;
    # null without NVML (never 0)
    "gpu_util_mean": ("Float64", "mean GPU utilisation (%) over the run's GPUs in the measured window, evaluations between steps left out"),
    "gpu_mem_used_peak_mb": ("Float64", "peak device memory in use per GPU as NVML sees it (MiB), all processes"),
    "gpu_power_mean_w": ("Float64", "mean power of all the run's GPUs together (W): energy_j over the measured window's time, evaluations between steps left out of both"),
    "energy_j": ("Float64", "energy of the run's GPUs over the measured window (J), evaluations between steps left out as they are from its time"),
    "energy_j_per_token": ("Float64", "energy_j / measured_tokens"),
    "nvml_samples": ("Int64", "NVML samples taken over the measured window (none during evaluations between steps); 0 without NVML"),
    "gpu_busy_share": ("Float64", "gpu_util_mean / 100: the share of the measured window in which the GPU ran a kernel; null without NVML"),
    "host_bound": ("boolean", f"gpu_busy_share below {HOST_BOUND_BUSY_SHARE}: the GPU waited on the host (Python, kernel launches, the loader) for the "
                              "rest, so on a faster host or with compile this run's speed, and its ranking, may change; null without NVML"),
    # memory
    "memory_estimate_mb": ("Float64", "memory predicted before training (scripts/ftbench/measure/memory_estimate.py), MiB"),
    "memory_estimate_note": ("string", "why memory_estimate_mb is null (e.g. not modelled for compiled runs); null when there is an estimate"),
    "memory_estimate_host_mb": ("Float64", "fsdp_cpu_offload: host memory per process predicted for the offloaded shards "
                                "(weights, gradients, optimizer state), MiB; null otherwise"),
    "memory_estimate_ratio": ("Float64", "memory_estimate_mb / CUDA peak allocated in training, what the estimate models; null unless status ok, and on the CPU (RSS holds the interpreter, libraries and data too)"),
    "peak_memory_allocated_mb": ("Float64", "CUDA max_memory_allocated during training (MiB); null on CPU"),
    "peak_memory_reserved_mb": ("Float64", "CUDA max_memory_reserved during training (MiB); null on CPU"),
    "peak_rss_mb": ("Float64", "process peak resident memory (MiB) of loading and training, before evaluation"),
    "peak_memory_mb": ("Float64", "the run's training memory figure: CUDA reserved on GPU, peak RSS on CPU"),
    "eval_peak_memory_mb": ("Float64", "peak memory of evaluation alone (MiB): CUDA allocated on GPU, resident memory on CPU"),
    # quality
    "final_train_loss": ("Float64", "training loss of the last step"),
    "eval_accuracy": ("Float64", "classification accuracy on the eval split"),
    # image_text_retrieval (scripts/ftbench/tasks/retrieval.py): over the whole scored eval split; a retrieved item
    # is right when its caption text equals the query's (eval images may share a caption), and a tie between
    # a right and a wrong item is a miss
    "eval_recall_at_1_i2t": ("Float64", "image_text_retrieval: share of eval images whose most similar eval caption is theirs or has "
                                        "the same text (image->text recall@1; a tie with a wrong caption is a miss)"),
    "eval_recall_at_1_t2i": ("Float64", "image_text_retrieval: share of eval captions whose most similar eval image is theirs or one "
                                        "with the same caption text (text->image recall@1; a tie with a wrong image is a miss)"),
    "eval_recall_at_1": ("Float64", "image_text_retrieval: mean of eval_recall_at_1_i2t and eval_recall_at_1_t2i (the task's quality figure)"),
    "eval_loss": ("Float64", "mean loss on the eval split (per sample for classification, per target token for LMs, per "
                             "answer token for vision_language; image_text_retrieval: the contrastive loss per eval batch, "
                             "which depends on eval_batch_size)"),
    "eval_perplexity": ("Float64", "exp(eval_loss) for causal_lm / seq2seq / vision_language (its answer tokens)"),
    "eval_token_accuracy": ("Float64", "next-token (causal_lm), target-token (seq2seq) or answer-token (vision_language) accuracy"),
    "eval_samples": ("Int64", "eval examples scored"),
    "eval_generation_score": ("Float64", "instruction data with answer_metric: share of the eval prompts whose answer, "
                                         "generated greedily, matches the reference completion (exact_match, contains or "
                                         "regex after normalisation); its 95% interval: quality_low/high"),
    **GENERATION_COST,
    "eval_majority_class_rate": ("Float64", "classification: share of the most common class among the eval rows the final "
                                           "evaluation scored (the whole eval split, or the seeded stratified sample "
                                           "max_eval_samples or a time limit left), the accuracy of always answering it: what "
                                           "eval_accuracy is read against; null for other tasks and synthetic data"),
    # eval_before_training: the same figures of the model as built, scored before the first step on the final
    # evaluation's examples (train/evaluation.py), so each eval_* above has its starting point beside it
    **{f"base_{figure}": ("Float64", f"eval_before_training: {figure} of the model before training (the same eval "
                                     "examples as the final evaluation); null without eval_before_training")
       for figure in BASE_FIGURES},
    "base_eval_samples": ("Int64", "eval_before_training: eval examples the base evaluation scored (eval_samples unless the "
                                   "job's time limit came first)"),
    **{f"base_{name}": (dtype, f"eval_before_training: {meaning}") for name, (dtype, meaning) in GENERATION_COST.items()},
    "base_eval_time_s": ("Float64", "eval_before_training: seconds of the base evaluation, kept off the clock (not in "
                                    "train_time_s, eval_during_training_s or the measured window)"),
    # data: source rows preparation left out, by rule, summed over the source splits (the data manifest's
    # rows_dropped); null for synthetic data. Filter or sum them like any count: runs.rows_dropped_duplicates.
    **{f"rows_dropped_{rule}": ("Int64", f"source rows dropped: {meaning}") for rule, meaning in prepared.DROP_REASONS.items()},
    "rows_dropped_total": ("Int64", "source rows dropped by every rule above together"),
    # time
    "startup_s": ("Float64", "seconds from the job's process start to its run beginning: interpreter start and imports (a warm-started job: its client's start, the fork and any wait for the warm process; ddp/fsdp: the slowest rank's, from its own start); part of overhead_s, before load_time_s"),
    "load_time_s": ("Float64", "seconds to read data and build the model"),
    "overhead_s": ("Float64", "seconds of the job outside training steps and evaluation: process start (imports included) to the first step, plus after the last step"),
    "warm_start": ("boolean", "the job ran in a process forked from a warm one that had imported the stack (warmstart.py): its overhead_s holds no imports of torch or transformers"),
    "warm_start_wait_s": ("Float64", "seconds a warm-started job waited for the workflow's warm process to finish importing the stack (the first jobs of a local workflow can start before it is ready); part of overhead_s and wall_time_s, a cost of the workflow's start rather than of the configuration, and left out of the projection"),
    "first_step_s": ("Float64", "seconds of the first step (warmup; includes compilation and lazy init)"),
    "compile_time_s": ("Float64", "estimated torch.compile time: first step minus the median measured step"),
    "train_time_s": ("Float64", "seconds of the training loop, warmup included"),
    "eval_time_s": ("Float64", "seconds of evaluation"),
    "wall_time_s": ("Float64", "seconds of the whole training job: from its process start (interpreter start, imports, data "
                               "and model loading included; a warm-started job from its client's start, warmstart.py) to the "
                               "end of training and evaluation, before its result is written; ddp/fsdp: the longest of its "
                               "ranks' processes (each started by torchrun); holds overhead_s, train_time_s and eval_time_s"),
    # cost: computed at collect from config/prices.yaml (conventions: scripts/ftbench/report/cost.py), so a price
    # change re-runs collect and report, never training. Null where the device has no price (a warning says so).
    "gpu_model": ("string", "price-table model the device matched ('cpu' for a CPU run); null when none matched"),
    "billed_devices": ("Int64", "devices paid for: the GPUs that trained together; 1 (the machine) for a CPU run"),
    "price_per_device_hour": ("Float64", "$ per device-hour of gpu_model under the experiment's provider and pricing"),
    "price_per_hour": ("Float64", "$ per hour of the run: price_per_device_hour x billed_devices"),
    "price_source": ("string", "which price was used (model, $/device-hour, table and provider/pricing), or why none"),
    "cost_per_1m_tokens": ("Float64", "$ per million real tokens processed (divides by tokens_per_s: prompts included; image tasks: text + image tokens) at the measured global throughput"),
    "cost_per_1m_trained_tokens": ("Float64", "$ per million trained tokens (divides by trained_tokens_per_s: instruction data's completion tokens); null where trained tokens are not counted apart"),
    "cost_per_1k_samples": ("Float64", "$ per thousand training samples at the measured throughput"),
    "cost_per_1k_images": ("Float64", "$ per thousand training images at the measured throughput; null for text runs"),
    "projected_tokens": ("Float64", "tokens of the configured training budget (config key budget)"),
    "projected_hours": ("Float64", "wall hours of the training budget's job: projected_train_hours + projected_eval_hours + projected_overhead_hours"),
    "projected_pflops": ("Float64", "model PFLOPs of the training budget (analytic FLOPs per token x budget tokens)"),
    "projected_train_hours": ("Float64", "wall hours of the budget's training steps at this run's measured tokens_per_s"),
    "projected_eval_hours": ("Float64", "wall hours evaluation adds to the budget: the final evaluation and the one before training once each, and the measured seconds of a subset evaluation between steps x those the trainer schedules for the budget's steps (eval_every)"),
    "projected_overhead_hours": ("Float64", "wall hours of one job's start and end as measured (overhead_s: imports, data and model load, writing results)"),
    "projected_gpu_hours": ("Float64", "device-hours of the configured training budget: projected wall hours x billed_devices"),
    "projected_cost": ("Float64", "$ of the configured training budget: projected_gpu_hours x price_per_device_hour"),
    "energy_cost_per_1m_tokens": ("Float64", "electricity $ per million tokens from NVML energy (GPU boards only); null without NVML"),
    "projected_energy_cost": ("Float64", "electricity $ of the training budget from NVML energy; null without NVML"),
    # 95% intervals and stability: computed at collect from the row and the run's steps.parquet by the functions the
    # report computes them with (scripts/ftbench/report/analysis.py run_figures), so they are what the report shows
    "quality_metric": ("string", "the figure that judges the run for its task: accuracy (classification, image_classification) | "
                                 "token accuracy (causal_lm, seq2seq) | answer token accuracy (vision_language) | recall@1 "
                                 "(image_text_retrieval); null without it, and for synthetic data (its accuracy measures nothing)"),
    "quality": ("Float64", "the run's value of quality_metric (eval_accuracy, eval_token_accuracy or eval_recall_at_1), in [0, 1]"),
    "quality_low": ("Float64", "95% Wilson interval of quality on eval_samples (eval sequences for language models): low end"),
    "quality_high": ("Float64", "95% Wilson interval of quality on eval_samples: high end"),
    "base_quality": ("Float64", "eval_before_training: quality_metric of the model before training (base_eval_accuracy, "
                                "base_eval_token_accuracy or base_eval_recall_at_1): what fine-tuning started from"),
    "tokens_per_s_low": ("Float64", "95% within-run interval of tokens_per_s, low end: the ratio interval (sum of tokens over "
                                    "sum of step times, t on the measured steps of steps.parquet) relative to its mean, times "
                                    "tokens_per_s; the measurement noise of this process, not run-to-run variation (repeats "
                                    "give that); null without a measured window of 2 steps or more (status ok or timeout)"),
    "tokens_per_s_high": ("Float64", "95% within-run interval of tokens_per_s: high end (see tokens_per_s_low)"),
    "tokens_per_s_median_based": ("Float64", "tokens per measured step / median measured step time, relative to the window "
                                             "mean and scaled like the interval (tokens_per_s x mean / median step time); "
                                             "below tokens_per_s: a stretch of fast steps, above: slow ones"),
    "unstable": ("boolean", "tokens_per_s and tokens_per_s_median_based differ by more than 3% of the latter, or the median "
                            "step time of the window's second half differs from its first half's by more than 5%: "
                            "tokens_per_s is not a stable figure; also true for a window of one measured step (too short to "
                            "measure a rate: unstable_reason says so); null without a measured window"),
    "unstable_reason": ("string", "why the run is unstable, with the figures (the report's note); null when it is not"),
    "cost_per_1m_tokens_low": ("Float64", "95% interval of cost_per_1m_tokens, low end: at tokens_per_s_high (cost = price / throughput)"),
    "cost_per_1m_tokens_high": ("Float64", "95% interval of cost_per_1m_tokens, high end: at tokens_per_s_low (inf when that is 0)"),
    "projected_cost_low": ("Float64", "95% interval of projected_cost, low end: at tokens_per_s_high"),
    "projected_cost_high": ("Float64", "95% interval of projected_cost, high end: at tokens_per_s_low"),
    # evaluations during training (eval_every) and the quality target (experiment key target), computed at collect
    # from each run's evals.parquet (conventions: scripts/ftbench/report/quality_target.py)
    "evaluations_during_training": ("Int64", "eval_every: evaluations between steps (one before the first included, unless "
                                             "eval_before_training scored the whole split there: base_*), each on the eval "
                                             "subset; null without eval_every"),
    "eval_during_training_s": ("Float64", "eval_every: seconds of those evaluations, kept off the clock (not in train_time_s or the measured window)"),
    "stopped_at_target": ("boolean", "stop_at_target: true when the run stopped early because an evaluation reached the target (status stays ok)"),
    "target_metric": ("string", "the experiment's quality target: its eval figure; null without a target"),
    "target_value": ("Float64", "the experiment's quality target: the value to reach (at least; at most for a loss or perplexity)"),
    "target_reached": ("boolean", "whether an evaluation of the run reached the target; false: not reached; null when the run has no evaluation of that figure"),
    "tokens_to_target": ("Float64", "training tokens until the target was reached, interpolated linearly between the two evaluations that straddle it; null when not reached"),
    "train_s_to_target": ("Float64", "seconds of training steps until the target (warmup included, evaluations excluded), interpolated the same way"),
    "hours_to_target": ("Float64", "tokens_to_target at the run's measured tokens_per_s, in hours"),
    "gpu_hours_to_target": ("Float64", "hours_to_target x billed_devices"),
    "cost_to_target": ("Float64", "$ of reaching the target: hours_to_target x price_per_hour"),
    "cost_to_target_low": ("Float64", "cost_to_target where the optimistic end of the evaluations' 95% intervals reaches the target"),
    "cost_to_target_high": ("Float64", "cost_to_target where the pessimistic end reaches it (inf: that end never does)"),
}


# Columns copied from the run spec as they are.
SPEC_COLUMNS = tuple(spec_columns())


def row_from_result(result: dict) -> dict:
    """Flatten one run's metrics.json (metrics, spec, environment) into a table row."""
    spec = result["spec"]
    env = result.get("environment", {})
    libraries = env.get("libraries", {})
    row = {key: spec.get(key) for key in SPEC_COLUMNS}
    row["config_id"] = spec.get("config_id", spec["run_id"])
    row["task"] = spec["model_def"].get("task", "classification")
    row["data_kind"] = spec.get("dataset_def", {}).get("source", {}).get("kind")
    row.update({key: value for key, value in result["metrics"].items() if key in COLUMNS})
    row.update(
        host=env.get("host"),
        gpu_names=", ".join(env.get("gpu_names", [])) or None,
        gpu_driver=env.get("gpu_driver"),
        cuda_version=env.get("cuda_version"),
        cpu=env.get("cpu"),
        torch_version=libraries.get("torch"),
        transformers_version=libraries.get("transformers"),
        peft_version=libraries.get("peft"),
        bitsandbytes_version=libraries.get("bitsandbytes"),
        git_commit=env.get("git_commit"),
        slurm_job_id=env.get("slurm_job_id"),
    )
    metrics = result["metrics"]
    row.update(gpu_busy(metrics))
    row["peak_memory_mb"] = metrics.get("peak_memory_reserved_mb", metrics.get("peak_rss_mb"))
    # The estimate models the tensors of training on the device (memory_estimate.py): compare it with
    # the CUDA peak allocated alone. A CPU run's RSS also holds the interpreter, libraries and data.
    measured = metrics.get("peak_memory_allocated_mb")
    estimate = metrics.get("memory_estimate_mb")
    # Only a finished run's peak is the run's peak: an OOM run's high-water mark stops where it failed.
    finished = metrics.get("status") == "ok"
    row["memory_estimate_ratio"] = estimate / measured if finished and estimate and measured else None
    return row
