"""What each ``batching`` mode supports, torch-free so that parse-time checks (config.py) can read it
without importing torch; the modes themselves are in packing.py."""

PACKED = ("pack", "padding_free")
MEGA_BATCHES = 50  # global batches per length-sorted mega-batch: large enough to find similar lengths,
# small enough that a batch's examples still come from a random 50-batch slice of the epoch

# Tasks whose packed loss is exact (packing.py says why), and why the others are not packed.
PACKABLE_TASKS = ("causal_lm",)
NOT_PACKABLE = {
    "classification": "classification pools one token per sequence and transformers' encoder masks do not read "
                      "packed position ids, so packed rows would mix sequences; use group_by_length",
    "seq2seq": "encoder-decoder rows pair each input with its target through cross-attention, which packing "
               "would mix; use group_by_length",
    "image_classification": "every image is the same number of patch tokens: there is no padding to remove; use pad",
    "vision_language": "a packed row would hold several images whose features LLaVA places by counting image "
                       "tokens, which packing does not keep apart; use group_by_length",
    "image_text_retrieval": "a dual encoder pairs each caption with its image and pools one token per caption; "
                            "use group_by_length",
}
