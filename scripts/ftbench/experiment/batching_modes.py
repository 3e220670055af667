"""The ``batching`` modes, torch-free so that parse-time checks (config.py) can read them without importing
torch; the modes themselves are in train/batching.py, the batches each step draws in data/batch_order.py, and
which task families may be packed is each family's ``packable`` (its ``not_packable`` says why not)."""

PACKED = ("pack", "padding_free")
