rule report:
    """Figures and the self-contained HTML report (images embedded; opens from disk)."""
    input:
        metrics="results/metrics.parquet",
        steps=all_run_steps(),
    output:
        html="results/report.html",
        figures=directory("results/figures"),
    log:
        "logs/report.log",
    threads: 1
    # Loads every run's per-step table and draws a few figures: minutes at most.
    resources:
        mem_mb=lambda wildcards, attempt: 4000 * attempt,
        runtime=lambda wildcards, attempt: 15 * attempt,
    conda:
        "../envs/analysis.yaml"
    shell:
        "python {workflow.basedir}/scripts/report.py --metrics {input.metrics} --steps {input.steps}"
        " --figures {output.figures} --html {output.html} > {log} 2>&1"
