# One-sentence caption per figure: {figure name: text}. The template rules/captions/figure.rst shows it in
# Snakemake's own report; the command gets the same captions as JSON for report.html.
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
        evals=all_run_evals(),  # the quality-vs-cost curves
        gpu_table=GPU_TABLE,  # each GPU's memory, drawn as a line on the memory figure
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
        repeat_scoring=(config.get("report") or {}).get("repeat_scoring", "median"),
        captions=FIGURE_CAPTIONS,
        captions_json=json.dumps(FIGURE_CAPTIONS, sort_keys=True),
    shell:
        "python -m ftbench report --metrics {input.metrics} --steps {input.steps} --evals {input.evals}"
        " --figures {output.figures} --html {output.html} --recommend {params.recommend:q}"
        " --repeat-scoring {params.repeat_scoring}"
        " --captions {params.captions_json:q} --gpu-peaks {input.gpu_table:q} > {log} 2>&1"
