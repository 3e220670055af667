"""Count the host work and kernels of a training step per model structure: the figures behind HOST_UNITS in
scripts/ftbench/experiment/step_time.py.

A tiny model of each structure (Llama's gated blocks and GPT-2's plain ones, width 64, built as a run builds it:
ftbench's build_model on the CPU) takes a forward and a backward pass of one 8-token row; per pass it counts the
aten operations dispatched (a TorchDispatchMode), those that are not views (kernels on a GPU) and the Python
function calls (sys.setprofile). Two depths (30 and 10 blocks) separate what a block costs from what the model's
ends cost. A unit of host work is one operation or PY_CALL_UNITS calls: with --time, the CPU time per step of each
variant is fitted as seconds per operation and per call, which is where that weight comes from.

    python scripts/count_host_ops.py                          # the per-block and per-Linear table
    python scripts/count_host_ops.py --time                   # and the CPU time per step against operations and calls
    python scripts/count_host_ops.py --device cuda --time     # on a GPU: bitsandbytes' CUDA path, the host's own time

The counts are of the code installed here (torch, transformers, peft, bitsandbytes): count again after upgrading
them. On a CPU bitsandbytes runs its CPU path, and its CUDA path runs more Python per 4-bit Linear (calibration.py's
qlora_host_factor); on a GPU the tiny model is launch-bound, so its time per step is the host's.
"""

from __future__ import annotations

import argparse
import collections
import sys
import threading
import time
import warnings

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ftbench.experiment import step_time
from ftbench.runspec import RunSpec
from ftbench.train import modeling
from ftbench.train.devices import autocast_args

VIEWS = {"view", "_unsafe_view", "t", "transpose", "slice", "unsqueeze", "expand", "detach", "select", "alias",
         "as_strided", "permute", "squeeze", "reshape", "split", "chunk", "unbind", "empty_like", "empty",
         "split_with_sizes", "lift_fresh"}
LLAMA = {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
         "vocab_size": 512, "max_position_embeddings": 64}
GPT2 = {"n_embd": 64, "n_head": 4, "vocab_size": 512, "n_positions": 64}
# variant -> (architecture, the run's settings)
VARIANTS = {
    "gated full bf16_true": ("llama", {"method": "full", "precision": "bf16_true"}),
    "gated full bf16": ("llama", {"method": "full"}),
    "gated full bf16 gc": ("llama", {"method": "full", "gradient_checkpointing": True}),
    "gated lora bf16": ("llama", {"method": "lora"}),
    "gated lora bf16 no dropout": ("llama", {"method": "lora", "lora_dropout": 0.0}),
    "gated lora bf16 gc": ("llama", {"method": "lora", "gradient_checkpointing": True}),
    "gated lora bf16 fp32 base": ("llama", {"method": "lora", "lora_base_dtype": "fp32"}),
    "gated qlora bf16": ("llama", {"method": "qlora", "qlora_quant_type": "nf4", "qlora_double_quant": True}),
    "plain full bf16": ("gpt2", {"method": "full"}),
    "plain lora bf16": ("gpt2", {"method": "lora"}),
    "plain full bf16 gc": ("gpt2", {"method": "full", "gradient_checkpointing": True}),
}
DEPTHS = (30, 10)


class Counting(TorchDispatchMode):
    """Aten operations dispatched, and those of them that are not views."""

    def __init__(self):
        super().__init__()
        self.operations = 0
        self.kernels = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.operations += 1
        self.kernels += func.__name__.split(".")[0] not in VIEWS
        return func(*args, **(kwargs or {}))


class Calls:
    """Python function calls made while it is entered (every thread: autograd runs hooks on its own)."""

    def __init__(self):
        self.calls = 0

    def _profile(self, frame, event, arg):
        if event == "call":
            self.calls += 1

    def __enter__(self):
        sys.setprofile(self._profile)
        threading.setprofile(self._profile)
        return self

    def __exit__(self, *exc):
        sys.setprofile(None)
        threading.setprofile(None)


def spec_of(architecture: str, settings: dict, depth: int) -> RunSpec:
    if architecture == "llama":
        source = {"kind": "config", "architecture": "LlamaConfig", "overrides": {**LLAMA, "num_hidden_layers": depth}}
    else:
        source = {"kind": "config", "architecture": "GPT2Config", "overrides": {**GPT2, "n_layer": depth}}
    base = RunSpec(model="tiny", dataset="tokens", model_def={"task": "causal_lm", "source": source},
                   dataset_def={"source": {"kind": "synthetic"}}, precision="bf16", batch_size=1, seq_len=8,
                   lora_rank=16, lora_targets="all-linear")
    spec = base.replace(**settings)
    return spec if spec.method == "full" else spec.replace(lora_alpha=2 * spec.lora_rank)  # as runspec.normalise sets it


def stepper(spec: RunSpec, device: torch.device):
    """A function that runs one forward pass and returns its loss, on the model as a run builds it."""
    model = modeling.build_model(spec, None, device, pad_token_id=0, vocab_size=512).model
    model.train()
    ids = torch.randint(0, 512, (1, 8), device=device)
    autocast = autocast_args(device, spec.precision)

    def forward():
        with torch.autocast(**autocast):
            return model(input_ids=ids, labels=ids).loss
    for _ in range(2):  # lazy initialisation out of the way
        forward().backward()
    return forward


def count(spec: RunSpec, device: torch.device) -> dict:
    """Operations, kernels and calls of one forward and one backward pass."""
    forward = stepper(spec, device)
    with Counting() as forward_ops:
        loss = forward()
    with Counting() as backward_ops:
        loss.backward()
    with Calls() as forward_calls:
        loss = forward()
    with Calls() as backward_calls:
        loss.backward()
    return {"forward": (forward_ops.operations, forward_ops.kernels, forward_calls.calls),
            "backward": (backward_ops.operations, backward_ops.kernels, backward_calls.calls)}


def per_block(counts: dict[int, dict]) -> dict:
    """Per block (the difference of the two depths) and for the model's ends (what the deeper one leaves): units
    and kernels per pass."""
    deep, shallow = (counts[depth] for depth in DEPTHS)
    out = {}
    for phase in ("forward", "backward"):
        ops, kernels, calls = (np.array(deep[phase], float) - np.array(shallow[phase], float)) / (DEPTHS[0] - DEPTHS[1])
        out[phase] = {"units": ops + step_time.PY_CALL_UNITS * calls, "kernels": kernels}
        ends = np.array(deep[phase], float) - DEPTHS[0] * np.array([ops, kernels, calls])
        out[f"{phase} ends"] = {"units": ends[0] + step_time.PY_CALL_UNITS * ends[2], "kernels": ends[1]}
    return out


def table(variants: list[str], device: torch.device = torch.device("cpu")) -> dict[str, dict]:
    figures = {}
    for name in variants:
        architecture, settings = VARIANTS[name]
        figures[name] = per_block({depth: count(spec_of(architecture, settings, depth), device) for depth in DEPTHS})
        row = figures[name]
        print(f"{name:<28} per block: forward {row['forward']['units']:6.1f} units {row['forward']['kernels']:5.1f} kernels,"
              f" backward {row['backward']['units']:6.1f} units {row['backward']['kernels']:5.1f} kernels;"
              f" ends: forward {row['forward ends']['units']:5.1f} units, backward {row['backward ends']['units']:5.1f}",
              flush=True)
    return figures


def cpu_times(variants: list[str], repeats: int, device: torch.device) -> None:
    """Each variant's time per step (the 10th percentile of ``repeats``, interleaved) against its operations and
    calls: seconds per operation and per call by least squares, and each variant's time as fitted."""
    torch.set_num_threads(1)
    rows = []
    for name in variants:
        architecture, settings = VARIANTS[name]
        spec = spec_of(architecture, settings, DEPTHS[0])
        figures = count(spec, device)
        forward = stepper(spec, device)
        rows.append((name, forward, sum(figures[p][0] for p in figures), sum(figures[p][2] for p in figures), []))
    for _ in range(repeats):
        for _, forward, _, _, times in rows:
            start = time.perf_counter()
            forward().backward()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            times.append(time.perf_counter() - start)
    measured = np.array([np.percentile(times, 10) for *_, times in rows])
    design = np.array([[ops, calls] for _, _, ops, calls, _ in rows], float)
    (per_op, per_call), *_ = np.linalg.lstsq(design, measured, rcond=None)
    print(f"{device.type}: {per_op * 1e6:.2f} us per operation, {per_call * 1e6:.3f} us per call "
          f"(a call is {per_call / per_op:.3f} operations)")
    for (name, *_), seconds, fitted in zip(rows, measured, design @ [per_op, per_call]):
        print(f"  {name:<28} {seconds * 1e3:7.1f} ms measured, {fitted * 1e3:7.1f} ms fitted ({fitted / seconds:.2f})")
    model_units(dict(zip([row[0] for row in rows], measured)))


def model_units(seconds: dict[str, float]) -> None:
    """The step-time model's host term against the timed variants: seconds per unit of host work as
    step_time.step_ops counts the tiny model (HOST_UNITS), fitted to the variants without 4-bit Linears, each
    variant's time at that rate, and the 4-bit Linears' host time over what HOST_UNITS counts for them: on a GPU,
    where the tiny model's step is the host's, the figure qlora_host_factor stands for (calibration.py)."""
    units = {}
    for name in seconds:
        load, _ = step_time.workload(spec_of(*VARIANTS[name], DEPTHS[0]))
        units[name] = (load.host_ops, load.qlora_host_ops)
    plain = [name for name in seconds if not units[name][1]]
    if not plain:
        return
    total = np.array([units[name][0] for name in plain])
    per_unit = float(total @ np.array([seconds[name] for name in plain]) / (total @ total))
    print(f"HOST_UNITS: {per_unit * 1e6:.2f} us per unit of host work")
    for name in plain:
        print(f"  {name:<28} {per_unit * units[name][0] / seconds[name]:.2f} of its measured time")
    for name in (name for name in seconds if units[name][1]):
        factor = (seconds[name] - per_unit * units[name][0]) / (per_unit * units[name][1])
        print(f"  {name:<28} 4-bit Linears' host time over their HOST_UNITS count: {factor:.2f}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="+", choices=sorted(VARIANTS), default=None)
    parser.add_argument("--time", action="store_true", help="also time each variant's step on this CPU")
    parser.add_argument("--repeats", type=int, default=25)
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    device = torch.device(args.device)
    variants = args.only or list(VARIANTS)
    table(variants, device)
    if args.time:
        cpu_times([name for name in variants if "bf16_true" not in name and "plain" not in name], args.repeats, device)


if __name__ == "__main__":
    main()
