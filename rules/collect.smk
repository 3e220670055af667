# Costs are computed here from the measured throughput (scripts/ftbench/report/cost.py). The price table is an
# input, so editing a price re-runs collect and report, never training; the experiment's `prices` key
# (provider, pricing, its own prices) is a param, so editing it does the same. Checked at parse time so a
# bad provider or model name stops `snakemake -n` with the key that names it.
from ftbench.report import cost as ftbench_cost  # noqa: E402
from ftbench.measure import gpu_table as ftbench_gpu_table  # noqa: E402

PRICE_SETTINGS = {key: value for key, value in config.get("prices", {}).items() if key != "table"}
PRICES_TABLE = config.get("prices", {}).get("table") or str(Path(workflow.basedir) / "config" / "prices.yaml")
# MFU is computed here too, from the GPU peak table (GPU_TABLE): editing a peak re-runs collect and report,
# never training. Read at parse time too, so a broken table stops the workflow before training rather than at collect.
with stop_on_ftbench_error():
    ftbench_cost.resolve({**PRICE_SETTINGS, "table": PRICES_TABLE})
    ftbench_gpu_table.load_peaks(GPU_TABLE)


rule collect:
    """One row per run into results/metrics.parquet (columns: scripts/ftbench/report/columns.py) and a CSV twin,
    with each run's cost from the price table and its MFU from the GPU peak table."""
    input:
        metrics=all_run_metrics(),
        # Each run's evaluations (read beside its metrics.json): when it reached the target.
        evals=all_run_evals(),
        prices=PRICES_TABLE,
        gpu_peaks=GPU_TABLE,
    output:
        parquet="results/metrics.parquet",
        csv="results/metrics.csv",
        # Printed by the Snakefile when Snakemake ends (onsuccess/onerror): runs per status, and why.
        summary="results/summary.txt",
    log:
        "logs/collect.log",
    threads: 1
    # Reads one small JSON per run: seconds and well under a GB even for thousands of runs.
    resources:
        mem_mb=lambda wildcards, attempt: 2000 * attempt,
        runtime=lambda wildcards, attempt: 10 * attempt,
    conda:
        "../envs/analysis.yaml"
    params:
        prices=json.dumps(PRICE_SETTINGS, sort_keys=True),
        budget=json.dumps(config.get("budget")),
        target=json.dumps(config.get("target")),
    shell:
        "python -m ftbench collect --parquet {output.parquet} --csv {output.csv}"
        " --prices-table {input.prices:q} --price-settings {params.prices:q} --budget {params.budget:q} --target {params.target:q}"
        " --gpu-peaks {input.gpu_peaks:q} --summary {output.summary}"
        " {input.metrics} > {log} 2>&1"
