"""Data, task-neutral: where models' tokenizers and datasets come from (hub names, local paths, package
files), raw tables (loading, cleaning, stratified splits), Parquet shards with their manifest (written,
verified, repaired, read back from memory or disk) and image decoding. What a task family does with them is
in ``ftbench.tasks``. Imports only the ground modules (errors, atomic, runspec); heavy libraries (datasets,
PIL, transformers' tokenizers) are imported where they are used, so the parse-time layers stay light.
"""
