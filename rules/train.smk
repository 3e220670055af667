rule train:
    """Train and measure one configuration; writes metrics.json (with a status) and per-step records."""
    input:
        data=get_run_data,
    output:
        metrics="results/runs/{run_id}/metrics.json",
        steps="results/runs/{run_id}/steps.parquet",
    log:
        "logs/train/{run_id}.log",
    params:
        spec=get_run_spec_json,
    threads: workflow.cores
    resources:
        gpu=get_run_gpus,
    shell:
        "python {workflow.basedir}/scripts/train.py --spec {params.spec:q} --data {input.data}"
        " --out {output.metrics} --threads {threads} > {log} 2>&1"
