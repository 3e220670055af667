rule collect:
    """One row per run into results/metrics.parquet (columns: scripts/ftbench/columns.py) and a CSV twin."""
    input:
        all_run_metrics(),
    output:
        parquet="results/metrics.parquet",
        csv="results/metrics.csv",
    log:
        "logs/collect.log",
    shell:
        "python {workflow.basedir}/scripts/collect.py --parquet {output.parquet} --csv {output.csv}"
        " {input} > {log} 2>&1"
