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
    shell:
        "python {workflow.basedir}/scripts/report.py --metrics {input.metrics} --steps {input.steps}"
        " --figures {output.figures} --html {output.html} > {log} 2>&1"
