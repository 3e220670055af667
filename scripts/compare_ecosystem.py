"""One configuration trained three ways on one GPU: ftbench, a plain PEFT loop, and transformers.Trainer.

Does ftbench measure what users run? The plain loop is written the way PEFT's documentation writes one: the model
made in bf16 (``dtype=torch.bfloat16``; from its config, with random weights, since no checkpoint is downloaded),
``get_peft_model``, bf16 autocast, fused AdamW; full fine-tuning is the plain mixed-precision loop (fp32 weights,
bf16 autocast); QLoRA loads the weights through bitsandbytes (nf4, bf16 compute, double quantisation) and runs
peft's ``prepare_model_for_kbit_training``. The Trainer gets a model made the same way (``bf16=True``,
``adamw_torch_fused``, no gradient clipping, as the loop). All three train on full-length random tokens
(labels = inputs, no padding) and time the same warmup and measured steps with the device synchronised.

Each way runs in its own process, so each peak of allocated memory is its own. Printed: peak allocated memory
(GiB) and tokens/s per way, and ftbench's ratios to the PEFT loop and to the Trainer.

    python scripts/compare_ecosystem.py --shape 8b --method lora --batch 2 --seq 1024
    python scripts/compare_ecosystem.py --shape 1b --method full,lora,qlora --out compare.json

Needs a CUDA GPU, peft, and for QLoRA bitsandbytes. Results: scripts/README.md.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Where the ways train: the GPU (what the comparison is for), or the CPU where there is none (a check of the script).
DEVICE = "cuda" if os.environ.get("COMPARE_DEVICE", "cuda") == "cuda" else "cpu"

# Llama shapes (config-built, random weights): Llama 3.2 1B and Llama 3 8B.
SHAPES = {
    "1b": {"hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32,
           "num_key_value_heads": 8, "vocab_size": 128256, "max_position_embeddings": 8192, "tie_word_embeddings": True},
    # A tiny shape for a CPU check of the script itself (tests/test_compare_ecosystem.py).
    "tiny": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
             "num_key_value_heads": 2, "vocab_size": 1000, "max_position_embeddings": 256, "tie_word_embeddings": True},
    "8b": {"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
           "num_key_value_heads": 8, "vocab_size": 128256, "max_position_embeddings": 8192, "tie_word_embeddings": False},
}
LORA = {"r": 16, "lora_alpha": 32, "lora_dropout": 0.05, "target_modules": "all-linear"}
LEARNING_RATE = 2e-4


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    results = []
    for method in args.method.split(","):
        row = {"shape": args.shape, "method": method, "batch": args.batch, "seq": args.seq}
        for way in args.ways.split(","):
            row[way] = run_way(way, method, args)
            print(json.dumps({"method": method, "way": way, **row[way]}), flush=True)
        results.append(row)
    print_table(results, args.ways.split(","))
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))
    return 0


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="1b")
    parser.add_argument("--method", default="lora", help="full, lora, qlora, or several comma-separated")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10, help="measured steps after the warmup")
    parser.add_argument("--ways", default="ftbench,peft,trainer")
    parser.add_argument("--out", help="write the results as JSON here")
    parser.add_argument("--child", help=argparse.SUPPRESS)  # one way, in this process: "way:method"
    return parser.parse_args(argv)


def run_way(way: str, method: str, args) -> dict:
    """One way in a process of its own; its JSON result line, or the error it ended with."""
    command = [sys.executable, __file__, "--child", f"{way}:{method}", "--shape", args.shape, "--batch", str(args.batch),
               "--seq", str(args.seq), "--warmup", str(args.warmup), "--steps", str(args.steps)]
    process = subprocess.run(command, capture_output=True, text=True)
    lines = [line for line in process.stdout.splitlines() if line.startswith("{")]
    if process.returncode != 0 or not lines:
        return {"error": (process.stderr or process.stdout).strip().splitlines()[-1:]}
    return json.loads(lines[-1])


# ---------------------------------------------------------------------------------------------------------------
# The three ways, each in its own process


def child(args) -> dict:
    way, method = args.child.split(":")
    return {"ftbench": ftbench_way, "peft": plain_loop_way, "trainer": trainer_way}[way](method, args)


def ftbench_way(method: str, args) -> dict:
    """ftbench's own job (``python -m ftbench train``) on its prepared synthetic tokens."""
    sys.path.insert(0, str(ROOT / "scripts"))
    from ftbench.experiment import config as ftconfig
    from ftbench.experiment import matrix
    from ftbench.tasks import registry

    config = {
        "models": {"llama": {"task": "causal_lm", "source": {"kind": "config", "architecture": "LlamaConfig",
                                                             "overrides": SHAPES[args.shape]}}},
        "datasets": {"tokens": {"source": {"kind": "synthetic"}, "train_size": args.batch * (args.warmup + args.steps),
                                "eval_size": args.batch}},
        "defaults": {"method": method, "precision": "bf16", "batch_size": args.batch, "seq_len": args.seq,
                     "max_steps": args.warmup + args.steps, "warmup_steps": args.warmup, "learning_rate": LEARNING_RATE,
                     "lora_rank": LORA["r"], "lora_alpha": LORA["lora_alpha"], "lora_dropout": LORA["lora_dropout"],
                     "lora_targets": LORA["target_modules"], "num_gpus": 1, "eval_batch_size": args.batch},
        "matrix": {"model": ["llama"], "dataset": ["tokens"]},
    }
    ftconfig.validate_config(config)
    (spec,) = matrix.expand_runs(config)
    with tempfile.TemporaryDirectory() as folder:
        data, out = Path(folder) / "data", Path(folder) / "run" / "metrics.json"
        registry.prepare(spec.dataset, spec.dataset_def, spec.model_def, spec.seq_len, data)
        out.parent.mkdir()
        subprocess.run([sys.executable, "-m", "ftbench", "train", "--spec", spec.to_json(), "--data", str(data),
                        "--out", str(out)], check=True, cwd=ROOT, capture_output=True,
                       env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT / "scripts"),
                                                                                       os.environ.get("PYTHONPATH")]))})
        metrics = json.loads(out.read_text())["metrics"]
    if metrics["status"] != "ok":
        raise SystemExit(f"ftbench run {metrics['status']}: {metrics.get('status_reason')}")
    peak = metrics.get("peak_memory_allocated_mb")
    return {"peak_gib": peak / 1024 if peak is not None else None, "tokens_per_s": metrics["tokens_per_s"],
            "frozen_dtype": metrics.get("recipe_frozen_dtype"), "trainable_dtype": metrics.get("recipe_trainable_dtype")}


def build_model(method: str, args):
    """The model as the ecosystem's documentation builds it, on the GPU."""
    import torch
    import transformers

    config = transformers.LlamaConfig(**SHAPES[args.shape], use_cache=False)
    if method == "qlora":
        model = quantised_model(config)
    else:
        with torch.device(DEVICE):  # full fine-tuning: fp32 weights (mixed precision); LoRA: the base in bf16
            model = transformers.AutoModelForCausalLM.from_config(
                config, dtype=torch.float32 if method == "full" else torch.bfloat16)
    if method == "full":
        return model
    import peft

    return peft.get_peft_model(model, peft.LoraConfig(task_type="CAUSAL_LM", **LORA))


def quantised_model(config):
    """bitsandbytes quantises while loading: random bf16 weights saved once, loaded back in 4 bits (nf4, bf16
    compute, double quantisation), then peft's k-bit preparation (fp32 norms and head, input gradients)."""
    import peft
    import torch
    import transformers

    folder = Path(tempfile.gettempdir()) / f"compare-ecosystem-{config.hidden_size}-{config.num_hidden_layers}"
    if not (folder / "config.json").exists():
        with torch.device("cuda"):
            model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
        model.save_pretrained(folder)
        del model
        torch.cuda.empty_cache()
    quantisation = transformers.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                                   bnb_4bit_use_double_quant=True, bnb_4bit_compute_dtype=torch.bfloat16)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, quantization_config=quantisation,
                                                              dtype=torch.bfloat16, device_map={"": 0})
    torch.cuda.reset_peak_memory_stats()  # the save above is no part of training
    return peft.prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)


def synchronize() -> None:
    import torch

    if DEVICE == "cuda":
        torch.cuda.synchronize()


def peak_gib() -> float | None:
    import torch

    return torch.cuda.max_memory_allocated() / 2**30 if DEVICE == "cuda" else None


def plain_loop_way(method: str, args) -> dict:
    import torch

    torch.manual_seed(0)
    model = build_model(method, args).train()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LEARNING_RATE, fused=True)
    vocab = SHAPES[args.shape]["vocab_size"]
    batches = [torch.randint(0, vocab, (args.batch, args.seq), device=DEVICE) for _ in range(4)]
    started = None
    for step in range(args.warmup + args.steps):
        if step == args.warmup:
            synchronize()
            started = time.perf_counter()
        ids = batches[step % len(batches)]
        with torch.autocast(DEVICE, dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    synchronize()
    elapsed = time.perf_counter() - started
    return {"peak_gib": peak_gib(), "tokens_per_s": args.batch * args.seq * args.steps / elapsed}


def trainer_way(method: str, args) -> dict:
    import torch
    import transformers

    torch.manual_seed(0)
    model = build_model(method, args)
    vocab = SHAPES[args.shape]["vocab_size"]
    total = args.warmup + args.steps
    rows = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, vocab, (args.batch * total, args.seq)).tolist()]
    step_ends = []

    class StepClock(transformers.TrainerCallback):
        def on_step_end(self, *unused, **kwargs):
            synchronize()
            step_ends.append(time.perf_counter())

    with tempfile.TemporaryDirectory() as folder:
        training = transformers.TrainingArguments(
            output_dir=folder, per_device_train_batch_size=args.batch, max_steps=total, learning_rate=LEARNING_RATE,
            bf16=True, optim="adamw_torch_fused", max_grad_norm=0.0, lr_scheduler_type="constant", report_to=[],
            save_strategy="no", logging_strategy="no", disable_tqdm=True, dataloader_num_workers=0,
            remove_unused_columns=False, use_cpu=DEVICE == "cpu")
        trainer = transformers.Trainer(model=model, args=training, train_dataset=rows,
                                       data_collator=transformers.default_data_collator, callbacks=[StepClock()])
        trainer.train()
    elapsed = step_ends[-1] - step_ends[args.warmup - 1]
    return {"peak_gib": peak_gib(), "tokens_per_s": args.batch * args.seq * args.steps / elapsed}


def print_table(results: list[dict], ways: list[str]) -> None:
    print(f"\n{'shape':5} {'method':6} {'batch x seq':>11} " + " ".join(f"{way + ' GiB':>12} {way + ' tok/s':>14}" for way in ways)
          + "   ftbench/peft tok/s, mem   ftbench/trainer tok/s, mem")
    for row in results:
        cells = []
        for way in ways:
            result = row[way]
            cells.append(f"{result.get('peak_gib') or float('nan'):12.2f} {result.get('tokens_per_s') or float('nan'):14,.0f}")
        ratios = []
        for other in ("peft", "trainer"):
            mine, theirs = row.get("ftbench", {}), row.get(other, {})
            if "tokens_per_s" in mine and "tokens_per_s" in theirs:
                memory = f"{mine['peak_gib'] / theirs['peak_gib']:.3f}" if mine["peak_gib"] and theirs["peak_gib"] else "-"
                ratios.append(f"{mine['tokens_per_s'] / theirs['tokens_per_s']:.3f}, {memory}")
            else:
                ratios.append("-")
        print(f"{row['shape']:5} {row['method']:6} {row['batch']:>5} x {row['seq']:<5} " + " ".join(cells)
              + f"   {ratios[0]:>22}   {ratios[1]:>22}")


if __name__ == "__main__":
    parsed = parse_args(sys.argv[1:])
    if parsed.child:
        print(json.dumps(child(parsed)))
        sys.exit(0)
    sys.exit(main())
