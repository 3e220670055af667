"""What does a job's FLOP cross-check cost? FlopCounterMode vs ftbench's FlopTally vs no counter at all.

Every train job counts one micro-batch's forward + backward with a FLOP counter (flops_counted_ratio);
that pass is part of the job's overhead_s. This times three ways of running that same pass, on the run's
own model, micro-batch and precision, in one process on one machine:
- plain: forward and backward with no counter (what the pass would cost anyway);
- flop_counter_mode: torch.utils.flop_counter.FlopCounterMode (ftbench's counter before FlopTally);
- flop_tally: flops.FlopTally (what the jobs use now).
Each trial runs the three in an order that rotates from trial to trial; the device is synchronised
before each clock read. It also checks that both counters give the same total.

    python scripts/benchmark_flop_count.py --config config/examples/llama-methods.yaml --run 0 --trials 5

Prints one line per trial and the median seconds and ratios.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from ftbench.tasks import registry
from ftbench.measure import flops
from ftbench.experiment import matrix
from ftbench.train import modeling
from ftbench.experiment import config as ftbench_config
from ftbench.train.devices import Distributed, autocast_args, choose_device, synchronize


def timed(device: torch.device, work) -> tuple[float, int | None]:
    synchronize(device)
    start = time.perf_counter()
    total = work()
    synchronize(device)
    return time.perf_counter() - start, total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="config/config.yaml")
    parser.add_argument("--run", type=int, default=0, help="index of the run in the expanded matrix")
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--out", help="write the figures as JSON here")
    args = parser.parse_args()

    from torch.utils.flop_counter import FlopCounterMode

    spec = matrix.expand_runs(ftbench_config.load_config(args.config))[args.run]
    with tempfile.TemporaryDirectory(prefix="ftbench-flops-") as data_dir:
        manifest = registry.prepare(spec.dataset, spec.dataset_def, spec.model_def, spec.seq_len, data_dir)
        split = registry.load_split(data_dir, "train", manifest)
        device, _ = choose_device(spec, Distributed())
        model = modeling.build_model(spec, len(manifest["label_names"] or []) or None, device, manifest["pad_token_id"]).model
        model.train()
        indices = np.arange(min(spec.batch_size, len(split)))
        inputs = registry.family(manifest["task"]).collate(split, indices, manifest["pad_token_id"]).to(device).inputs
        autocast = autocast_args(device, spec.precision)

        def plain():
            with torch.autocast(**autocast):
                loss = model(**inputs).loss
            loss.backward()
            model.zero_grad(set_to_none=True)

        def flop_counter_mode():
            counter = FlopCounterMode(display=False, custom_mapping=flops.attention_flop_formulas())
            with counter:
                plain()
            return counter.get_total_flops()

        sides = {"plain": plain, "flop_counter_mode": flop_counter_mode,
                 "flop_tally": lambda: flops.counted_flops(model, inputs, autocast)}
        names = list(sides)
        for name in names:  # once each before timing: first calls load kernels and fill caches
            sides[name]()
        trials = []
        for trial in range(args.trials):
            order = names[trial % len(names):] + names[: trial % len(names)]
            seconds, totals = {}, {}
            for name in order:
                seconds[name], totals[name] = timed(device, sides[name])
            if totals["flop_counter_mode"] != totals["flop_tally"]:
                raise SystemExit(f"the counters disagree: FlopCounterMode {totals['flop_counter_mode']}, "
                                 f"FlopTally {totals['flop_tally']}")
            trials.append({"order": order, **seconds})
            print(f"trial {trial} ({' > '.join(order)}): plain {seconds['plain']:.3f} s, FlopCounterMode "
                  f"{seconds['flop_counter_mode']:.3f} s, FlopTally {seconds['flop_tally']:.3f} s", flush=True)
    median = {name: statistics.median(trial[name] for trial in trials) for name in names}
    results = {"run_id": spec.run_id, "device": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu",
               "flops_counted": totals["flop_tally"], "median_s": median,
               "tally_over_counter_mode": statistics.median(t["flop_tally"] / t["flop_counter_mode"] for t in trials),
               "trials": trials}
    print(f"{spec.run_id} on {results['device']}: median plain {median['plain']:.3f} s, FlopCounterMode "
          f"{median['flop_counter_mode']:.3f} s, FlopTally {median['flop_tally']:.3f} s; FlopTally / FlopCounterMode "
          f"= {results['tally_over_counter_mode']:.2f} (same total: {totals['flop_tally']:.4g} FLOPs)")
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
