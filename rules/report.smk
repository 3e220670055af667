# One-sentence caption per figure (also used by report.html): {figure name: text}, for the template.
FIGURE_CAPTIONS = {
    path.stem: " ".join(path.read_text(encoding="utf-8").split())
    for path in sorted((Path(workflow.basedir) / "rules" / "captions" / "figures").glob("*.rst"))
}


rule report:
    """Figures and the self-contained HTML report (images embedded; opens from disk). The figures are
    also marked for Snakemake's own report (`snakemake --report report.html`): one caption file per
    figure in rules/captions/figures/, shown through the template rules/captions/figure.rst."""
    input:
        metrics="results/metrics.parquet",
        steps=all_run_steps(),
    output:
        html=report("results/report.html", caption="captions/report.rst", category="Report"),
        # A figure with no data is not drawn (report.html says why), so the folder holds what exists.
        figures=report(
            directory("results/figures"),
            patterns=["{figure}.png"],
            caption="captions/figure.rst",
            category="Figures",
            labels={"figure": "{figure}"},
        ),
    log:
        "logs/report.log",
    threads: 1
    # Loads every run's per-step table and draws a few figures: minutes at most.
    resources:
        mem_mb=lambda wildcards, attempt: 4000 * attempt,
        runtime=lambda wildcards, attempt: 15 * attempt,
    conda:
        "../envs/analysis.yaml"
    params:
        recommend=json.dumps(config.get("recommend") or {}, sort_keys=True),
        captions=FIGURE_CAPTIONS,
    shell:
        "python -m ftbench report --metrics {input.metrics} --steps {input.steps}"
        " --figures {output.figures} --html {output.html} --recommend {params.recommend:q} > {log} 2>&1"
