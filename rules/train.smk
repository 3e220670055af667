rule train:
    """Train and measure one configuration; writes metrics.json (with a status), per-step records and its evaluations."""
    input:
        data=get_run_data,
        # The evaluation before training shared by the runs of the same weights (rules/base_eval.smk); none for a
        # run that scores its own.
        base_eval=get_run_base_eval,
    output:
        metrics="results/runs/{run_id}/metrics.json",
        steps="results/runs/{run_id}/steps.parquet",
        # Every evaluation of the run: during training (eval_every) and the final one.
        evals="results/runs/{run_id}/evals.parquet",
    log:
        "logs/train/{run_id}.log",
    params:
        spec=get_run_spec_json,
        spec_file=get_run_spec_file,
    threads: get_train_threads
    # A dp/ddp/fsdp run gets its N GPUs on one machine and starts torchrun inside the job; a multi-node
    # run (num_nodes, SLURM only) gets num_nodes nodes with gres gpu:N on each, and its job starts one
    # torchrun per node with srun (ftbench/train/ddp.py). A CPU run (num_gpus 0 or device cpu) asks for no GPU.
    # `tasks` stays unset on purpose: on a GPU job the SLURM plugin turns it into --ntasks-per-gpu, which
    # torchrun does not want.
    resources:
        gpu=get_train_gpus,
        gres=get_train_gres,
        cpus_per_gpu=get_train_cpus_per_gpu,
        slurm_partition=get_train_partition,
        nodes=get_train_nodes,
        mem_mb=get_train_mem_mb,
        runtime=get_train_runtime,
    conda:
        "../envs/train.yaml"
    # --time-limit-s is the job's walltime, the very `runtime` (minutes) the scheduler gets (sbatch -t) and
    # `snakemake -n` shows: one number per job, decided where the invocation is planned (get_train_runtime).
    # The job keeps its own margin inside it: training stops early enough to evaluate and write its results
    # with status=timeout instead of being killed with nothing.
    # --watch-pid $PPID: this shell's parent is Snakemake; locally the job ends when it dies (lifeline.py).
    # FTBENCH_BASE_EVAL: the shared evaluation before training the job takes instead of scoring (empty: it scores).
    shell:
        "FTBENCH_BASE_EVAL={input.base_eval:q} python -m ftbench train --spec-file {params.spec_file:q} --data {input.data}"
        " --out {output.metrics} --threads {threads} --time-limit-s $(( {resources.runtime} * 60 ))"
        " --watch-pid $PPID > {log} 2>&1"
