rule collect:
    """One row per run into results/metrics.parquet (columns: scripts/ftbench/columns.py) and a CSV twin."""
    input:
        all_run_metrics(),
    output:
        parquet="results/metrics.parquet",
        csv="results/metrics.csv",
    log:
        "logs/collect.log",
    threads: 1
    # Reads one small JSON per run: seconds and well under a GB even for thousands of runs.
    resources:
        mem_mb=lambda wildcards, attempt: 2000 * attempt,
        runtime=lambda wildcards, attempt: 10 * attempt,
    conda:
        "../envs/analysis.yaml"
    shell:
        "python {workflow.basedir}/scripts/collect.py --parquet {output.parquet} --csv {output.csv}"
        " {input} > {log} 2>&1"
