"""Measurement, with no training in it: the statuses and step records of a run and their summary, FLOPs,
TFLOP/s and MFU with their conventions, a model's shape from its config, the memory estimate, GPU sampling
through NVML, the GPU peak table and the environment a result came from. Imports only the ground modules;
torch is imported only where a measurement needs it (the FLOP counter), so collect and parse stay torch-free.
"""
