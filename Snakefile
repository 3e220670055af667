# ftbench: measure what fine-tuning costs. This file only orchestrates; see rules/ for the stages.
#
#   snakemake --cores 2                      run the experiment in config/config.yaml
#   snakemake --cores 2 --configfile X.yaml  run another experiment
#   snakemake -n                             show what would run (validates the config first)
#   python -m ftbench check X.yaml           check an experiment file alone (file, line and key of a problem)

from pathlib import Path
import sys
import time

from snakemake.utils import min_version

min_version("9.0")


# The embedded default experiment, unless one is given with --configfile. (Snakemake would otherwise
# deep-merge the two, leaking the default's axes into the user's experiment.)
if not workflow.config_settings.configfiles:
    # ftbench's loader first: a YAML syntax error is then one line with file, line and column (Snakemake's
    # own says only "not valid JSON or YAML"). A --configfile is read by Snakemake before this file runs:
    # for it, `python -m ftbench check X.yaml` says where (the README's troubleshooting table).
    from ftbench.experiment import config as _ftbench_config
    from ftbench.errors import FtbenchError as _FtbenchError

    try:
        _ftbench_config.load_yaml(Path(workflow.basedir) / "config" / "config.yaml")
    except _FtbenchError as _error:
        sys.stderr.write(f"ftbench: {_error}\n")
        sys.exit(1)

    configfile: "config/config.yaml"


from ftbench.report import summary as ftbench_summary


# Checks the experiment (rules/common.smk) before anything else is read.
include: "rules/common.smk"
include: "rules/data.smk"
include: "rules/base_eval.smk"
include: "rules/train.smk"
include: "rules/collect.smk"
include: "rules/report.smk"


# A dry run only warns about a lock and still exits 0 with a plan the real run would refuse: an earlier
# Snakemake killed with SIGKILL (or a power loss) leaves its locks behind. Say so and fail the dry run.
if workflow.output_settings.dryrun and any(Path(".snakemake", "locks").glob("*.lock")):
    sys.stderr.write(
        "ftbench: this directory is locked by another snakemake, running or killed (kill -9, lost session); "
        "if none is running here, run `snakemake --unlock` (with the same --configfile/--profile), then again\n"
    )
    sys.exit(1)

for _message in ftbench_config.experiment_warnings(config):
    sys.stderr.write(f"ftbench: warning: {_message}\n")


rule all:
    input:
        "results/metrics.parquet",
        "results/metrics.csv",
        "results/report.html",
    default_target: True


# The end of an invocation, on the terminal: runs per status and why each is not ok (written by collect),
# and where the report is. After a failed job too: the summary then says whether collect ran this time.
_STARTED = time.time()


onsuccess:
    ftbench_summary.print_outcome(_STARTED, failed_jobs=False)


onerror:
    ftbench_summary.print_outcome(_STARTED, failed_jobs=True)
