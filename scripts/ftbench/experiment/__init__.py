"""The experiment: an experiment file loaded, validated and expanded into runs, before any job starts.

Owns the schema (``experiment_schema.yaml`` filled in with RunSpec's settings), loading (strict YAML),
reference checks, the one feasibility check per run (``config.check_run``, which asks the run's task family
for its rules), warnings, the matrix expansion into ``RunSpec``s with stable ids, and the settings reference
(``config/README.md``). Snakemake imports it on every invocation, so it is torch-free: it may import
``ftbench.tasks``, ``ftbench.data``, ``ftbench.measure`` and the ground modules, nothing above.
"""
