"""Training one run as a job: the one way in (``job.run_job``, from ``python -m ftbench train``), the
launchers (this process, or torchrun for ddp and fsdp), the run's state, the loop and the Trainer engine,
evaluation, model building (full, LoRA, QLoRA), optimizers, the ``batching`` modes, devices, the batch-size
search and test-only fault injection. May import every layer below it (cluster, experiment, tasks,
measure, data, ground); nothing imports it except the commands (``ftbench.cli``).
"""
