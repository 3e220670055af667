rule prepare_data:
    """Tokenise one dataset for one tokenizer and sequence length into Parquet shards + manifest."""
    output:
        directory("results/data/{data_id}"),
    log:
        "logs/prepare_data/{data_id}.log",
    params:
        task=get_data_task_json,
        shard_size_mb=SHARD_SIZE_MB,
    threads: 1
    shell:
        "python {workflow.basedir}/scripts/prepare_data.py --task {params.task:q}"
        " --shard-size-mb {params.shard_size_mb} --out {output} > {log} 2>&1"
