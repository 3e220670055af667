"""One configuration trained three ways on one GPU: ftbench, a plain PEFT loop, and transformers.Trainer.

Does ftbench measure what users run? The plain loop is written the way PEFT's documentation writes one: the model
made in bf16 (``dtype=torch.bfloat16``; from its config, with random weights, since no checkpoint is downloaded),
``get_peft_model``, bf16 autocast, fused AdamW; full fine-tuning is the plain mixed-precision loop (fp32 weights,
bf16 autocast); QLoRA loads the weights through bitsandbytes (nf4, bf16 compute, double quantisation) and runs
peft's ``prepare_model_for_kbit_training``. The Trainer gets a model made the same way (``bf16=True``,
``adamw_torch_fused``, no gradient clipping, as the loop). All three train on full-length random tokens
(labels = inputs, no padding) and time the same warmup and measured steps with the device synchronised.

Each way runs in its own process, so each peak of allocated memory is its own. Each way reports what it trained as
well as how fast: the dtypes its frozen and trainable parameters had during its steps (read inside them: the loop's
before its optimizer step, the Trainer's in a callback) and the tokens of its measured steps (counted from the
batches it trained on). Printed: peak allocated memory (GiB) and tokens/s per way, ftbench's ratios to the PEFT loop
and to the Trainer, and a line for any way that trained another recipe or other tokens than ftbench's.

    python scripts/compare_ecosystem.py --shape 8b --method lora --batch 2 --seq 1024
    python scripts/compare_ecosystem.py --shape 1b --method full,lora,qlora --out compare.json

Needs a CUDA GPU, peft, and for QLoRA bitsandbytes (``COMPARE_DEVICE=cpu`` runs full fine-tuning and LoRA on the
CPU: a check of the script, not a comparison). Results: scripts/README.md.
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
    if DEVICE == "cuda" and not cuda_visible():
        print("compare_ecosystem.py: the three ways train on a CUDA GPU and none is visible here "
              "(COMPARE_DEVICE=cpu checks the script on the CPU: full and lora only)", file=sys.stderr)
        return 2
    results = []
    for method in args.method.split(","):
        row = {"shape": args.shape, "method": method, "batch": args.batch, "seq": args.seq}
        for way in args.ways.split(","):
            row[way] = run_way(way, method, args)
            print(json.dumps({"method": method, "way": way, **row[way]}), flush=True)
        results.append(row)
    print_table(results, args.ways.split(","))
    for line in differences(results):
        print(line)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))
    return 0


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="1b")
    parser.add_argument("--method", default="lora", help="full, lora, qlora, or several comma-separated")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--warmup", type=int, default=3, help="steps before the measured ones, excluded from timing")
    parser.add_argument("--steps", type=int, default=10, help="measured steps after the warmup")
    parser.add_argument("--ways", default="ftbench,peft,trainer")
    parser.add_argument("--out", help="write the results as JSON here")
    parser.add_argument("--child", help=argparse.SUPPRESS)  # one way, in this process: "way:method"
    args = parser.parse_args(argv)
    if args.warmup < 0 or args.steps < 1:
        parser.error(f"--warmup {args.warmup} --steps {args.steps}: expected --warmup 0 or more and --steps 1 or more")
    return args


def cuda_visible() -> bool:
    import torch

    return torch.cuda.is_available()


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
    """ftbench's own job (``python -m ftbench train``) on its prepared synthetic tokens, on DEVICE (never a fallback
    to the CPU where a GPU was meant)."""
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
                     "lora_targets": LORA["target_modules"], "num_gpus": 1, "device": DEVICE,
                     "eval_batch_size": args.batch},
        "matrix": {"model": ["llama"], "dataset": ["tokens"]},
    }
    ftconfig.validate_config(config)
    (spec,) = matrix.expand_runs(config)
    with tempfile.TemporaryDirectory() as folder:
        data, out = Path(folder) / "data", Path(folder) / "run" / "metrics.json"
        registry.prepare(spec.dataset, spec.dataset_def, spec.model_def, spec.seq_len, data)
        out.parent.mkdir()
        subprocess.run([sys.executable, "-m", "ftbench", "train", "--spec", spec.to_json(), "--data", str(data),
                        "--out", str(out)], check=True, capture_output=True)
        metrics = json.loads(out.read_text())["metrics"]
    if metrics["status"] != "ok":
        raise SystemExit(f"ftbench run {metrics['status']}: {metrics.get('status_reason')}")
    peak = metrics.get("peak_memory_allocated_mb")
    return {"peak_gib": peak / 1024 if peak is not None else None, "tokens_per_s": metrics["tokens_per_s"],
            "frozen_dtype": metrics.get("recipe_frozen_dtype"), "trainable_dtype": metrics.get("recipe_trainable_dtype"),
            "trained_tokens": metrics["measured_tokens"]}


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


DTYPE_NAMES = {"torch.float32": "fp32", "torch.bfloat16": "bf16", "torch.float16": "fp16"}


def parameter_dtypes(model) -> dict:
    """The dtypes the model's frozen and trainable parameters have now, named as ftbench's recipe columns name them:
    a 4-bit base by its quantisation type alone (its norms and head are kept in fp32 beside it), no frozen
    parameters None."""
    def names(params) -> str | None:
        return "+".join(sorted({DTYPE_NAMES.get(str(p.dtype), str(p.dtype)) for p in params})) or None

    params = list(model.parameters())
    quantised = any(getattr(p, "quant_state", None) is not None for p in params)
    return {"frozen_dtype": "nf4" if quantised else names(p for p in params if not p.requires_grad),
            "trainable_dtype": names(p for p in params if p.requires_grad)}


def plain_loop_way(method: str, args) -> dict:
    import torch

    torch.manual_seed(0)
    model = build_model(method, args).train()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LEARNING_RATE, fused=True)
    vocab = SHAPES[args.shape]["vocab_size"]
    batches = [torch.randint(0, vocab, (args.batch, args.seq), device=DEVICE) for _ in range(4)]
    started, tokens, dtypes = None, 0, {}
    for step in range(args.warmup + args.steps):
        if step == args.warmup:
            synchronize()
            started = time.perf_counter()
        ids = batches[step % len(batches)]
        with torch.autocast(DEVICE, dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        dtypes = parameter_dtypes(model)  # as this step trained them
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step >= args.warmup:
            tokens += ids.numel()
    synchronize()
    elapsed = time.perf_counter() - started
    return {"peak_gib": peak_gib(), "tokens_per_s": tokens / elapsed, **dtypes, "trained_tokens": tokens}


def trainer_way(method: str, args) -> dict:
    """transformers.Trainer's steps: the window from the end of the warmup's last step (the start of training
    with no warmup) to the end of the last, the device synchronised at both; its tokens counted in training_step,
    the dtypes read in a callback before each optimizer step."""
    import torch
    import transformers

    torch.manual_seed(0)
    model = build_model(method, args)
    vocab = SHAPES[args.shape]["vocab_size"]
    total = args.warmup + args.steps
    rows = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, vocab, (args.batch * total, args.seq)).tolist()]
    marks, seen = [], {"tokens": 0, "dtypes": {}}

    class StepClock(transformers.TrainerCallback):
        def on_train_begin(self, *unused, **kwargs):
            synchronize()
            marks.append(time.perf_counter())

        def on_pre_optimizer_step(self, *unused, **kwargs):
            seen["dtypes"] = parameter_dtypes(kwargs["model"])

        def on_step_end(self, *unused, **kwargs):
            synchronize()
            marks.append(time.perf_counter())

    class CountingTrainer(transformers.Trainer):
        def training_step(self, model, inputs, num_items_in_batch=None):
            if self.state.global_step >= args.warmup:  # the steps done so far: this one is measured
                seen["tokens"] += int(inputs["input_ids"].numel())
            return super().training_step(model, inputs, num_items_in_batch)

    with tempfile.TemporaryDirectory() as folder:
        training = transformers.TrainingArguments(
            output_dir=folder, per_device_train_batch_size=args.batch, max_steps=total, learning_rate=LEARNING_RATE,
            bf16=True, optim="adamw_torch_fused", max_grad_norm=0.0, lr_scheduler_type="constant", report_to=[],
            save_strategy="no", logging_strategy="no", disable_tqdm=True, dataloader_num_workers=0,
            remove_unused_columns=False, use_cpu=DEVICE == "cpu")
        trainer = CountingTrainer(model=model, args=training, train_dataset=rows,
                                  data_collator=transformers.default_data_collator, callbacks=[StepClock()])
        trainer.train()
    elapsed = marks[-1] - marks[args.warmup]  # marks[0]: training's start; marks[k]: the end of step k
    return {"peak_gib": peak_gib(), "tokens_per_s": seen["tokens"] / elapsed, **seen["dtypes"],
            "trained_tokens": seen["tokens"]}


def print_table(results: list[dict], ways: list[str]) -> None:
    print(f"\n{'shape':5} {'method':6} {'batch x seq':>11} " + " ".join(f"{way + ' GiB':>12} {way + ' tok/s':>14}" for way in ways)
          + "   ftbench/peft tok/s, mem   ftbench/trainer tok/s, mem")
    for row in results:
        cells = []
        for way in ways:
            result = row[way]
            cells.append(f"{result.get('peak_gib') or float('nan'):12.2f} {result.get('tokens_per_s') or float('nan'):14,.0f}")
        ratios = [ratio_cell(row.get("ftbench", {}), row.get(other, {})) for other in ("peft", "trainer")]
        print(f"{row['shape']:5} {row['method']:6} {row['batch']:>5} x {row['seq']:<5} " + " ".join(cells)
              + f"   {ratios[0]:>22}   {ratios[1]:>22}")


def ratio_cell(mine: dict, theirs: dict) -> str:
    """ftbench's tokens/s and peak memory over another way's, three decimals ("1.022, 1.000"); memory "-" where a
    way has no peak (the CPU), the whole cell "-" where either way has no speed."""
    if "tokens_per_s" not in mine or "tokens_per_s" not in theirs:
        return "-"
    memory = f"{mine['peak_gib'] / theirs['peak_gib']:.3f}" if mine["peak_gib"] and theirs["peak_gib"] else "-"
    return f"{mine['tokens_per_s'] / theirs['tokens_per_s']:.3f}, {memory}"


COMPARED = ("frozen_dtype", "trainable_dtype", "trained_tokens")  # what every way must share for its ratio to mean anything


def differences(results: list[dict]) -> list[str]:
    """A line for each way that trained another recipe or other tokens than ftbench's way: its ratio compares
    different work."""
    lines = []
    for row in results:
        mine = row.get("ftbench", {})
        for way in ("peft", "trainer"):
            theirs = row.get(way, {})
            if "tokens_per_s" not in mine or "tokens_per_s" not in theirs:
                continue
            differ = [f"{key} {theirs.get(key)} (ftbench {mine.get(key)})" for key in COMPARED if theirs.get(key) != mine.get(key)]
            if differ:
                lines.append(f"{row['method']}: {way} trained other work than ftbench: " + ", ".join(differ))
    return lines


if __name__ == "__main__":
    parsed = parse_args(sys.argv[1:])
    if parsed.child:
        print(json.dumps(child(parsed)))
        sys.exit(0)
    sys.exit(main())
