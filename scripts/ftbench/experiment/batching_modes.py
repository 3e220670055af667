"""The ``batching`` modes, torch-free so that parse-time checks (config.py) can read them without importing
torch; the modes themselves are in train/batching.py, and which task families may be packed is each
family's ``packable`` (its ``not_packable`` says why not)."""

PACKED = ("pack", "padding_free")
MEGA_BATCHES = 50  # global batches per length-sorted mega-batch: large enough to find similar lengths,
# small enough that a batch's examples still come from a random 50-batch slice of the epoch
