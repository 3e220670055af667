"""What a new sequence length every step costs, outside ftbench: a plain PyTorch training loop over the same
model at one fixed length, then at a length drawn anew each step (as padded batches of real text have).

Batching modes that pad to the longest row of each batch (pad, group_by_length) change the batch's shape on
every step; packed rows always hold seq_len tokens. On a small model the GPU waits for the host, and a new
shape costs host time (kernel and allocator choices) that a fixed shape pays once. This script measures that
cost alone, so a batching comparison in ftbench's report can be read against it.

    python scripts/benchmark_shape_churn.py                      # the 134M Llama shape of the examples, CUDA
    PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True python scripts/benchmark_shape_churn.py
    python scripts/benchmark_shape_churn.py --tiny --device cpu --steps 4   # a smoke run anywhere

Prints one line per length pattern (ms per step, median of the timed steps, after --warmup steps) and the
ratio of each varying pattern to the fixed one, measured in the same process.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

# SmolLM2-135M's shape with the MiniLM tokenizer's vocabulary, as config/examples/batching-kernels.yaml has it.
LLAMA_134M = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                  num_key_value_heads=3, vocab_size=30522, max_position_embeddings=8192, tie_word_embeddings=True)
TINY = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=512, max_position_embeddings=512, tie_word_embeddings=True)


def padded_batch(batch_size: int, length: int, vocab: int, generator: torch.Generator) -> dict:
    """A right-padded batch whose longest row has ``length`` tokens; the others are shorter, as real text is."""
    ids = torch.randint(1, vocab, (batch_size, length), generator=generator)
    lengths = torch.randint(max(2, length // 4), length + 1, (batch_size,), generator=generator)
    lengths[0] = length
    mask = (torch.arange(length)[None, :] < lengths[:, None]).long()
    ids = ids.masked_fill(mask == 0, 0)
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_steps(model, optimizer, batches: list[dict], device: torch.device, warmup: int) -> list[float]:
    """Seconds per step of a full training step (copy in, forward, backward, optimizer) over ``batches``,
    the first ``warmup`` not kept. The device is synchronised before each clock reading."""
    autocast = dict(device_type=device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")
    times = []
    for index, batch in enumerate(batches):
        synchronize(device)
        start = time.perf_counter()
        inputs = {key: value.to(device) for key, value in batch.items()}
        with torch.autocast(**autocast):
            loss = model(**inputs).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        synchronize(device)
        if index >= warmup:
            times.append(time.perf_counter() - start)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--seq-len", type=int, default=256, help="the fixed length, and the longest varying one")
    parser.add_argument("--steps", type=int, default=35, help="timed steps per pattern")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--tiny", action="store_true", help="a two-layer model (a smoke run, not a measurement)")
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()

    device = torch.device(args.device)
    torch.manual_seed(0)
    config = LlamaConfig(**(TINY if args.tiny else LLAMA_134M))
    config.use_cache = False  # training: no KV cache, as ftbench's build_model sets it
    with torch.device(device):
        model = LlamaForCausalLM(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
    generator = torch.Generator().manual_seed(0)
    count, longest = args.warmup + args.steps, args.seq_len
    patterns = {
        f"fixed {longest}": [longest] * count,
        f"varying {longest * 3 // 4}-{longest}": torch.randint(longest * 3 // 4, longest + 1, (count,), generator=generator).tolist(),
        f"varying {longest // 16}-{longest}": torch.randint(longest // 16, longest + 1, (count,), generator=generator).tolist(),
    }
    results = {}
    for name, lengths in patterns.items():
        batches = [padded_batch(args.batch_size, length, config.vocab_size, generator) for length in lengths]
        times = time_steps(model, optimizer, batches, device, args.warmup)
        results[name] = 1000 * statistics.median(times)
    fixed = results[f"fixed {longest}"]
    allocator = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "default allocator")
    for name, ms in results.items():
        print(f"{device.type} ({allocator}): {name}: {ms:.1f} ms/step, {ms / fixed:.2f}x the fixed length")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as out:
            json.dump({"device": device.type, "allocator": allocator, "ms_per_step": results}, out, indent=2)


if __name__ == "__main__":
    main()
