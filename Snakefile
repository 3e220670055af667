# ftbench: measure what fine-tuning costs. This file only orchestrates; see rules/ for the stages.
#
#   snakemake --cores 2                      run the experiment in config/config.yaml
#   snakemake --cores 2 --configfile X.yaml  run another experiment
#   snakemake -n                             show what would run (validates the config first)

from snakemake.utils import min_version

min_version("9.0")


# The embedded default experiment, unless one is given with --configfile. (Snakemake would otherwise
# deep-merge the two, leaking the default's axes into the user's experiment.)
if not workflow.config_settings.configfiles:

    configfile: "config/config.yaml"


include: "rules/common.smk"
include: "rules/data.smk"
include: "rules/train.smk"
include: "rules/collect.smk"
include: "rules/report.smk"


rule all:
    input:
        "results/metrics.parquet",
        "results/metrics.csv",
        "results/report.html",
    default_target: True
