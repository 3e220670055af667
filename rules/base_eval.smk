# The evaluation before training (eval_before_training), computed once per model as built and shared by the train
# jobs of every run that starts from those weights, in this experiment and in any other of this folder
# (ftbench/experiment/base_evaluation.py says which runs share one, ftbench/train/base_eval_job.py computes it).

# BASE_EVALS (base_eval_id -> the run whose model the shared job builds) and the input functions: rules/common.smk.

wildcard_constraints:
    base_eval_id="|".join(map(re.escape, BASE_EVALS)) or "NO_BASE_EVAL",


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
