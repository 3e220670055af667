"""Where and how jobs run: what a train job asks a scheduler for (GPUs, threads, walltime, memory), what a
SLURM cluster offers, GPU slots for local jobs running at once, the lifeline that ends a local job when its
Snakemake dies, and the warm process train jobs fork from. Snakemake imports it at parse time, so it is
torch-free; it may import tasks, measure, data and the ground modules.
"""
