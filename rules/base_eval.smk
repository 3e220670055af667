# The evaluation before training (eval_before_training), computed once per model as built and shared by the train
# jobs of every run that starts from those weights, in this experiment and in any other of this folder
# (ftbench/experiment/base_evaluation.py says which runs share one, ftbench/train/base_eval_job.py computes it).

from ftbench.experiment import base_evaluation as ftbench_base_evaluation

# base_eval_id -> the run (on one device) whose model the shared job builds and scores.
BASE_EVALS = ftbench_base_evaluation.shared_evaluations(RUNS.values())


wildcard_constraints:
    base_eval_id="|".join(map(re.escape, BASE_EVALS)) or "NO_BASE_EVAL",


def get_run_base_eval(wildcards):
    """The shared evaluation a run's train job reads: none for a run that scores its own (or none at all)."""
    run = RUNS[wildcards.run_id]
    return [ftbench_base_evaluation.base_eval_path(run)] if ftbench_base_evaluation.shares_base_evaluation(run) else []


def get_base_eval_key_json(wildcards):
    """What the evaluation depends on, and nothing else: another experiment whose first run of these weights has
    other settings (a learning rate, a LoRA rank) finds it unchanged and scores nothing again."""
    return json.dumps(ftbench_base_evaluation.base_eval_key(BASE_EVALS[wildcards.base_eval_id]), sort_keys=True)


def get_base_eval_spec_file(wildcards):
    """The spec of the run the job builds, in a file (not a param: which run of these weights stands for them
    changes nothing the job computes)."""
    from ftbench import atomic

    path = Path(".snakemake", "ftbench", "base_eval_specs", f"{wildcards.base_eval_id}.json")
    text = BASE_EVALS[wildcards.base_eval_id].to_json()
    if not path.is_file() or path.read_text(encoding="utf-8") != text:
        atomic.write_text(path, text)
    return str(path)


def _base_eval_run(wildcards):
    return BASE_EVALS[wildcards.base_eval_id]


def get_base_eval_threads(wildcards):
    return ftbench_resources.train_threads(_base_eval_run(wildcards), local=not _cluster_jobs(), cores=workflow.cores,
                                           nodes=_train_nodes())


def get_base_eval_runtime(wildcards, attempt=1):
    """The train job's estimate for the same run (get_train_runtime: the speed decided once per invocation):
    ample for one evaluation, and the same number wherever it is evaluated."""
    os.environ.setdefault(ftbench_resources.TRAIN_SPEED_ENV, ftbench_resources.train_speed(local=not _cluster_jobs()))
    return ftbench_resources.train_runtime_minutes(_base_eval_run(wildcards), attempt)


rule base_eval:
    """Score the model as built, once for every run that starts from it; the train jobs read the result."""
    input:
        data=lambda wildcards: f"results/data/{_base_eval_run(wildcards).data_id}",
    output:
        f"{ftbench_base_evaluation.BASE_EVAL_DIR}/{{base_eval_id}}.json",
    log:
        "logs/base_eval/{base_eval_id}.log",
    params:
        key=get_base_eval_key_json,
        spec_file=get_base_eval_spec_file,
    # A train job's share of the machine, one GPU for a GPU run.
    threads: get_base_eval_threads
    resources:
        gpu=lambda wildcards: ftbench_resources.train_gpus(_base_eval_run(wildcards)),
        gres=lambda wildcards: ftbench_resources.train_gres(_base_eval_run(wildcards)),
        cpus_per_gpu=lambda wildcards: ftbench_resources.train_cpus_per_gpu(_base_eval_run(wildcards), _train_nodes()),
        slurm_partition=lambda wildcards: ftbench_resources.train_partition(os.environ),
        mem_mb=lambda wildcards, attempt: ftbench_resources.train_mem_mb(_base_eval_run(wildcards), attempt),
        runtime=get_base_eval_runtime,
    conda:
        "../envs/train.yaml"
    shell:
        "python -m ftbench base-eval --spec-file {params.spec_file:q} --data {input.data}"
        " --out {output} --threads {threads} --time-limit-s $(( {resources.runtime} * 60 )) > {log} 2>&1"
