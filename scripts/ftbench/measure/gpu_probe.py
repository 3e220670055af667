"""A one-minute probe of a GPU and its host: the quantities the step-time model's terms stand on
(experiment/step_time.py), measured directly, so a GPU model no run was measured on gets a prediction from its own
figures rather than from another model's (``python -m ftbench probe-gpu``).

What is measured, and the parameter each figure stands for (experiment/calibration.py ``probed_params`` maps them):

- matmul TFLOP/s (``matmul_tflops``): ``[tokens, width] @ [width, out]`` at the hidden widths of the examples'
  models (MiniLM 384 ... an 8B Llama's 4096), each with its square projection (out = width) and its MLP's up
  projection (out = the model's intermediate size), in bf16, fp16 and fp32 (fp32 without TF32, as training runs it).
  Over the datasheet's dense peak they are the matmul efficiency at that width, the compute term's
  ``compute_efficiency / (1 + width_half / width)``: the probe's ``compute_efficiency``.
- bandwidth GB/s (``bandwidth_gbs``): an fp32 copy, an fp32 and a bf16 out-of-place add, a bf16 in-place scale
  (elementwise kernels, bytes read plus written over their time) and a fused AdamW step over 64M fp32 parameters
  (reads parameter, gradient and two moments, writes parameter and moments: 28 bytes per parameter). Over the
  datasheet bandwidth: the memory term's ``memory_efficiency``.
- the kernel floor (``kernel_s``): seconds per tiny kernel run back to back, queued behind a sleeping kernel so
  the host's enqueuing is hidden and CUDA events time the GPU alone: ``gpu_op_s``, the GPU time every kernel costs
  however little it does. CUDA only.
- the host's time per operation (``host_op_s``): a small MLP's forward and backward pass on tiny tensors (every
  kernel waits on the host), its aten operations counted once by a dispatch mode; seconds per step over operations
  per step: ``host_op_s``, the host seconds per unit of host work. On a GPU the step is the host's (the GPU runs
  each tiny kernel faster than the host dispatches it); on the CPU device it includes the (tiny) arithmetic.

Every figure is the median of ROUNDS timings, each after a warm-up and between two device synchronisations
(``synced_clock``): the clock is injected, so the arithmetic is tested on the CPU with a fake one.

Torch is imported by the functions that run kernels, never at import: the module's arithmetic and the command's
argument handling stay importable without it.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass, field
from typing import Callable

# (hidden width, MLP intermediate size) of the examples' models: MiniLM, SmolLM2-135M, GPT-2, Qwen2-0.5B,
# TinyLlama / Llama-3.2-1B, Llama-3-8B
WIDTHS = ((384, 1536), (576, 1536), (768, 3072), (896, 4864), (2048, 5632), (4096, 14336))
MATMUL_TOKENS = 4096  # a micro-batch of 8 x 512 positions
DTYPES = ("bf16", "fp16", "fp32")
STREAM_ELEMENTS = 64 * 2**20  # 256 MiB of fp32: far beyond any cache
ADAMW_BYTES_PER_PARAM = 28  # fp32: read parameter, gradient, two moments (16); write parameter, two moments (12)
QUEUED_KERNELS = 500  # below the launch queue's depth (about 1,024), where the host would block
ROUNDS = 3
ROUND_S = 0.03  # each timing round lasts at least this long (more calls for a short operation)
MAX_CALLS = 5000
TIME_LIMIT_S = 60  # what the probe aims to take on any CUDA GPU (CUDA's start-up and imports not counted)

Clock = Callable[[Callable[[], object]], float]  # seconds per call of a function


def synced_clock(synchronize: Callable[[], None], round_s: float = ROUND_S, rounds: int = ROUNDS,
                 warmup: int = 2) -> Clock:
    """A clock that times ``fn``: ``warmup`` calls untimed, then ``rounds`` rounds of as many calls as fill
    ``round_s``, each between two device synchronisations read with perf_counter; the median round's seconds per
    call."""
    def measure(fn: Callable[[], object]) -> float:
        for _ in range(warmup):
            fn()
        synchronize()
        start = time.perf_counter()
        fn()
        synchronize()
        once = max(time.perf_counter() - start, 1e-7)
        calls = max(1, min(MAX_CALLS, math.ceil(round_s / once)))
        timings = []
        for _ in range(rounds):
            synchronize()
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            synchronize()
            timings.append((time.perf_counter() - start) / calls)
        return statistics.median(timings)
    return measure


@dataclass
class ProbeResult:
    """The probe's figures (the module docstring says what each stands for)."""

    device_name: str
    memory_gb: float | None
    matmul_tflops: dict = field(default_factory=dict)  # dtype -> width -> median TFLOP/s of its shapes
    matmul_shapes: list = field(default_factory=list)  # every (dtype, tokens, width, out, seconds, TFLOP/s)
    bandwidth_gbs: dict = field(default_factory=dict)  # kernel -> GB/s
    kernel_s: float | None = None
    host_op_s: float | None = None
    host_ops_per_step: int | None = None
    seconds: float = 0.0
    notes: list = field(default_factory=list)

    def figures(self) -> dict:
        """What a probe file keeps of it (experiment/calibration.py reads these)."""
        return {"device_name": self.device_name, "memory_gb": self.memory_gb,
                "matmul_tflops": {dtype: {int(w): float(f"{v:.4g}") for w, v in widths.items()}
                                  for dtype, widths in self.matmul_tflops.items()},
                "bandwidth_gbs": {name: float(f"{value:.4g}") for name, value in self.bandwidth_gbs.items()},
                "kernel_s": None if self.kernel_s is None else float(f"{self.kernel_s:.4g}"),
                "host_op_s": None if self.host_op_s is None else float(f"{self.host_op_s:.4g}"),
                "host_ops_per_step": self.host_ops_per_step, "probe_seconds": round(self.seconds, 1)}


def matmul_tflops(flops: float, seconds: float) -> float:
    return flops / seconds / 1e12


def matmul_flops(tokens: int, width: int, out: int) -> float:
    """FLOPs of ``[tokens, width] @ [width, out]``: a multiply and an add per weight per token."""
    return 2.0 * tokens * width * out


def bandwidth_gbs(nbytes: float, seconds: float) -> float:
    return nbytes / seconds / 1e9


def _torch_dtype(torch, name: str):
    return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[name]


def probe_matmuls(torch, device, clock: Clock, result: ProbeResult, dtypes=DTYPES, widths=WIDTHS,
                  tokens: int = MATMUL_TOKENS) -> None:
    """Each width's projections in each dtype: the median TFLOP/s of its shapes into ``result.matmul_tflops``."""
    for dtype in dtypes:
        kind = _torch_dtype(torch, dtype)
        for width, intermediate in widths:
            rates = []
            for out in (width, intermediate):
                a = torch.randn(tokens, width, device=device, dtype=kind)
                b = torch.randn(width, out, device=device, dtype=kind)
                seconds = clock(lambda: torch.matmul(a, b))
                rate = matmul_tflops(matmul_flops(tokens, width, out), seconds)
                rates.append(rate)
                result.matmul_shapes.append((dtype, tokens, width, out, seconds, rate))
                del a, b
            result.matmul_tflops.setdefault(dtype, {})[width] = statistics.median(rates)


def probe_bandwidth(torch, device, clock: Clock, result: ProbeResult, elements: int = STREAM_ELEMENTS) -> None:
    """Elementwise kernels and a fused AdamW step: bytes read and written per second."""
    for dtype in ("fp32", "bf16"):
        kind = _torch_dtype(torch, dtype)
        size = torch.finfo(kind).bits // 8
        x = torch.randn(elements, device=device, dtype=kind)
        y = torch.randn(elements, device=device, dtype=kind)
        z = torch.empty_like(x)
        if dtype == "fp32":
            result.bandwidth_gbs["copy_fp32"] = bandwidth_gbs(2 * size * elements, clock(lambda: z.copy_(x)))
        result.bandwidth_gbs[f"add_{dtype}"] = bandwidth_gbs(3 * size * elements, clock(lambda: torch.add(x, y, out=z)))
        if dtype == "bf16":
            result.bandwidth_gbs["scale_bf16"] = bandwidth_gbs(2 * size * elements, clock(lambda: x.mul_(0.999)))
        del x, y, z
    result.bandwidth_gbs["adamw_fp32"] = _adamw_bandwidth(torch, device, clock, elements)


def _adamw_bandwidth(torch, device, clock: Clock, elements: int) -> float:
    """A fused AdamW step over ``elements`` fp32 parameters in 16 tensors (its states made by a first step)."""
    params = [torch.zeros(elements // 16, device=device, requires_grad=True) for _ in range(16)]
    for param in params:
        param.grad = torch.randn_like(param)
    optimizer = torch.optim.AdamW(params, lr=1e-4, fused=True)
    optimizer.step()
    seconds = clock(optimizer.step)
    total = sum(param.numel() for param in params)
    del optimizer, params
    return bandwidth_gbs(ADAMW_BYTES_PER_PARAM * total, seconds)


def probe_kernel_floor(torch, result: ProbeResult, kernels: int = QUEUED_KERNELS) -> None:
    """GPU seconds per tiny kernel (CUDA only): ``kernels`` in-place adds on one element queued behind a sleeping
    kernel long enough to hide their enqueuing, timed by CUDA events from the sleep's end to the last add's."""
    x = torch.zeros(1, device="cuda")
    for _ in range(10):
        x.add_(1)  # warm-up: the add's kernel loaded, the allocator primed
    cycles = 20_000_000
    for _ in range(8):
        gpu_s, hidden = _queued_kernels(torch, x, kernels, cycles)
        if hidden:
            result.kernel_s = gpu_s / kernels
            return
        cycles *= 4
    result.notes.append("kernel floor: the host could not queue the kernels ahead of the GPU; not measured")


def _queued_kernels(torch, x, kernels: int, cycles: int) -> tuple[float, bool]:
    """(GPU seconds of ``kernels`` adds run back to back, whether they were all queued before the sleep ended)."""
    torch.cuda.synchronize()
    after_sleep, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(cycles)
    after_sleep.record()
    for _ in range(kernels):
        x.add_(1)
    end.record()
    queued = after_sleep.query() is False  # the sleep still ran when the last add was enqueued
    end.synchronize()
    return after_sleep.elapsed_time(end) / 1e3, queued


def _tiny_mlp(torch, device):
    layers = []
    for _ in range(4):
        layers += [torch.nn.Linear(64, 64), torch.nn.LayerNorm(64), torch.nn.GELU()]
    return torch.nn.Sequential(*layers).to(device), torch.randn(8, 64, device=device)


def count_ops(torch, step: Callable[[], object]) -> int:
    """Aten operations one call of ``step`` dispatches (a TorchDispatchMode counting every call)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Counter(TorchDispatchMode):
        calls = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Counter.calls += 1
            return func(*args, **(kwargs or {}))

    with Counter():
        step()
    return Counter.calls


def probe_host(torch, device, clock: Clock, result: ProbeResult) -> None:
    """Host seconds per aten operation: a small MLP's forward and backward on tiny tensors, over its count."""
    model, batch = _tiny_mlp(torch, device)

    def step():
        model.zero_grad(set_to_none=True)
        model(batch).square().mean().backward()

    step()
    result.host_ops_per_step = count_ops(torch, step)
    result.host_op_s = clock(step) / result.host_ops_per_step


def run_probe(torch, device, clock: Clock | None = None, kernel_floor: bool | None = None,
              dtypes=DTYPES, widths=WIDTHS, tokens: int = MATMUL_TOKENS, elements: int = STREAM_ELEMENTS) -> ProbeResult:
    """Every measurement on ``device`` (a torch device), timed by ``clock`` (default: synchronise, perf_counter)."""
    started = time.perf_counter()
    cuda = torch.device(device).type == "cuda"
    if clock is None:
        clock = synced_clock(torch.cuda.synchronize if cuda else (lambda: None))
    name = torch.cuda.get_device_name(device) if cuda else "cpu"
    memory = round(torch.cuda.get_device_properties(device).total_memory / 1e9, 1) if cuda else None
    result = ProbeResult(name, memory)
    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = False  # fp32 as training runs it (gpus.yaml's fp32 peak)
    probe_matmuls(torch, device, clock, result, dtypes, widths, tokens)
    probe_bandwidth(torch, device, clock, result, elements)
    if cuda if kernel_floor is None else kernel_floor:
        probe_kernel_floor(torch, result)
    probe_host(torch, device, clock, result)
    result.seconds = time.perf_counter() - started
    if result.seconds > TIME_LIMIT_S:
        result.notes.append(f"the probe took {result.seconds:.0f} s, over its {TIME_LIMIT_S} s aim: a slow or shared device")
    return result


def summary(result: ProbeResult, peaks: dict | None = None, bandwidth: float | None = None) -> list[str]:
    """The probe's figures as lines of text; efficiencies where the datasheet's ``peaks`` (dtype -> dense
    TFLOP/s) and ``bandwidth`` (GB/s) are known."""
    lines = [f"{result.device_name}" + (f", {result.memory_gb:g} GB" if result.memory_gb else "")]
    widths = sorted({width for rates in result.matmul_tflops.values() for width in rates})
    lines.append("matmul TFLOP/s by width " + " ".join(f"{width:>7}" for width in widths))
    for dtype, rates in result.matmul_tflops.items():
        peak = (peaks or {}).get(dtype)
        cells = " ".join(f"{rates[width]:>7.1f}" for width in widths)
        share = " ".join(f"{rates[width] / peak:>7.2f}" for width in widths) if peak else ""
        lines.append(f"  {dtype:<22}{cells}" + (f"\n  {dtype + ' of peak ' + format(peak, 'g'):<22}{share}" if share else ""))
    for kernel, rate in result.bandwidth_gbs.items():
        lines.append(f"bandwidth {kernel:<14} {rate:>9,.0f} GB/s" + (f" ({rate / bandwidth:.2f} of {bandwidth:g})" if bandwidth else ""))
    lines.append("kernel floor: " + (f"{result.kernel_s * 1e6:.2f} us per kernel" if result.kernel_s else "not measured"))
    if result.host_op_s:
        lines.append(f"host: {result.host_op_s * 1e6:.2f} us per aten operation ({result.host_ops_per_step} per step)")
    lines += [f"note: {note}" for note in result.notes]
    lines.append(f"probe took {result.seconds:.1f} s")
    return lines
