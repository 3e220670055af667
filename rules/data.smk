# Prepared data of an earlier layout is said once, before the plan (rules/common.smk: say_stale_data).
say_stale_data()


rule prepare_data:
    """Tokenise one dataset for one tokenizer and sequence length into Parquet shards + manifest.

    Shared by every run, of any experiment in this folder, with the same data id. Its params are exactly what
    the data id hashes (ftbench/experiment/matrix.py: data_preparations), never a model's name or architecture:
    another experiment naming other models on the same tokenizer finds them unchanged and re-prepares nothing,
    and a check of one model alone (its vocab_size, its positions) runs in that model's train job."""
    output:
        directory("results/data/{data_id}"),
    log:
        "logs/prepare_data/{data_id}.log",
    params:
        preparation=get_data_preparation_json,
        shard_size_mb=SHARD_SIZE_MB,
        # Not passed to the job: a new layout of prepared data changes it, so Snakemake prepares older data again.
        data_version=ftbench_prepared.MANIFEST_VERSION,
    threads: 1
    # Tokenising is single-threaded here; the memory holds the source table and its token ids (a few
    # GB for millions of rows). Raise runtime for very large hub datasets (download + tokenise).
    resources:
        mem_mb=lambda wildcards, attempt: 4000 * attempt,
        runtime=lambda wildcards, attempt: 30 * attempt,
    conda:
        "../envs/train.yaml"
    shell:
        "python -m ftbench prepare-data --preparation {params.preparation:q}"
        " --shard-size-mb {params.shard_size_mb} --out {output} > {log} 2>&1"
