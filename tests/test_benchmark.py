"""scripts/benchmark_overhead.py: the harness-overhead benchmark runs end to end on the CPU.

Its figures on a GPU go in the closing notes; here we check what it compares and how it reports."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT, write_config


def run_benchmark(script: str, tmp_path, tiny_config_factory, batch_size: int, *args: str):
    """Run scripts/<script> on run 0 of a tiny LoRA experiment on the CPU: (its process, its JSON figures)."""
    config = write_config(tmp_path, tiny_config_factory(defaults={"method": "lora", "lora_rank": 4, "batch_size": batch_size,
                                                                  "seq_len": 32, "device": "cpu", "num_gpus": 0}))
    out = tmp_path / "figures.json"
    process = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / script), "--config", str(config), "--run", "0", *args, "--out", str(out)],
        capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert process.returncode == 0, process.stderr[-3000:]
    return process, json.loads(out.read_text())


@pytest.mark.slow
def test_overhead_benchmark_rotates_the_sides_and_reports_within_trial_ratios(tmp_path, tiny_config_factory):
    process, results = run_benchmark("benchmark_overhead.py", tmp_path, tiny_config_factory, 8,
                                     "--steps", "4", "--warmup", "1", "--trials", "3", "--batch-size", "6", "--sync-side")
    trials = results["trials"]
    assert len(trials) == 3 and results["steps"] == 4 and results["batch_size"] == 6 and results["device"] == "cpu"
    # Each of the first three sides goes first once in three trials (then the order runs back).
    assert sorted(trial["order"][0] for trial in trials) == ["bare", "ftbench", "ftbench_no_nvml"]
    # --sync-side: a fourth, ftbench with a sync after every measured step, for the attribution it reports.
    assert all(trial["no_sync_over_sync"] == pytest.approx(trial["ftbench_typical_step_tokens_per_s"]
                                                           / trial["ftbench_sync_every_step_typical_step_tokens_per_s"])
               for trial in trials)
    assert "ftbench / ftbench synchronising every step: median" in process.stdout
    assert "then back" in process.stdout
    for trial in trials:
        # The verdicts' ratios are of the typical (median) step; the window's are kept beside them.
        assert trial["ftbench_over_bare"] == pytest.approx(
            trial["ftbench_typical_step_tokens_per_s"] / trial["bare_typical_step_tokens_per_s"])
        assert trial["nvml_on_over_off"] == pytest.approx(
            trial["ftbench_typical_step_tokens_per_s"] / trial["ftbench_no_nvml_typical_step_tokens_per_s"])
        assert trial["window_ftbench_over_bare"] == pytest.approx(trial["ftbench_tokens_per_s"] / trial["bare_tokens_per_s"])
        for side in ("bare", "ftbench", "ftbench_no_nvml", "ftbench_sync_every_step"):
            assert trial[f"{side}_tokens_per_s"] > 0 and trial[f"{side}_typical_step_tokens_per_s"] > 0
            # A window is never shorter than its steps at the median step's pace by much (ties in 4 steps).
            assert trial[f"{side}_stall_share"] > -0.5
        assert trial["nvml_samples"] == 0  # a CPU has nothing to sample
        # Every pass in the order run, with its steps' speeds (is a host's noise within passes or between them?).
        assert [entry["side"] for entry in trial["passes"]] == trial["order"] + trial["order"][::-1]
        assert len(trial["order"]) == 4
        assert all(len(entry["step_tokens_per_s"]) == 4 for entry in trial["passes"])
    ratios = sorted(trial["ftbench_over_bare"] for trial in trials)
    assert results["median_ftbench_over_bare"] == pytest.approx(ratios[1])
    assert results["range_ftbench_over_bare"] == pytest.approx([ratios[0], ratios[2]])
    geometric_mean = math.exp(sum(math.log(ratio) for ratio in ratios) / 3)
    assert results["mean_ftbench_over_bare"] == pytest.approx(geometric_mean)
    low, high = results["interval_ftbench_over_bare"]
    assert low <= geometric_mean <= high
    assert f"ftbench/bare {geometric_mean:.3f} (95% interval {low:.3f}-{high:.3f}" in process.stdout
    assert results["verdict_ftbench_over_bare"] in process.stdout
    window = sorted(trial["window_ftbench_over_bare"] for trial in trials)
    assert results["median_window_ftbench_over_bare"] == pytest.approx(window[1])


@pytest.mark.slow
def test_gpus_runs_one_lane_per_gpu_on_cores_of_its_own_and_settles_their_trials_together(tmp_path, tiny_config_factory):
    """A launch-bound example needs tens of trials: --gpus runs them on several GPUs at once, each lane a process that
    sees only its GPU and runs on its own share of the cores, and settles every lane's trials as one verdict. On a CPU
    the lanes train on the CPU: what is checked is the lanes' placement and the pooling."""
    process, results = run_benchmark("benchmark_overhead.py", tmp_path, tiny_config_factory, 4, "--steps", "2",
                                     "--warmup", "1", "--trials", "1", "--gpus", "0,1")
    lane_files = [f"{tmp_path / 'figures.json'}.gpu{number}.json" for number in (0, 1)]
    lanes = [json.loads(Path(path).read_text()) for path in lane_files]
    assert [lane["cuda_visible_devices"] for lane in lanes] == ["0", "1"]
    cores = [set(lane["cpu_cores"]) for lane in lanes]
    assert all(cores) and not cores[0] & cores[1] and cores[0] | cores[1] <= os.sched_getaffinity(0)
    assert all(len(lane["trials"]) == 1 and lane["device"] == "cpu" for lane in lanes)
    # One verdict over both lanes' trials, each trial naming the lane file it was measured into.
    assert [trial["pooled_from"] for trial in results["trials"]] == lane_files
    assert results["device"] == "cpu" and results["run_id"] == lanes[0]["run_id"]
    both = _load_benchmark_module().summarise_trials([lane["trials"][0] for lane in lanes])
    assert results["interval_ftbench_over_bare"] == pytest.approx(both["interval_ftbench_over_bare"])
    assert "lane 0: GPU 0, CPU cores" in process.stdout and "lane 1: GPU 1" in process.stdout
    assert "2 trials (2 of them measured into 2 earlier files)" in process.stdout


@pytest.mark.slow
def test_stopping_a_gpus_run_stops_its_lanes(tmp_path, tiny_config_factory):
    """`timeout` stops the process it started: lanes left running would hold their GPUs after it."""
    config = write_config(tmp_path, tiny_config_factory(defaults={"method": "lora", "lora_rank": 4, "batch_size": 4,
                                                                  "seq_len": 32, "device": "cpu", "num_gpus": 0}))
    out = tmp_path / "figures.json"
    process = subprocess.Popen([sys.executable, str(ROOT / "scripts" / "benchmark_overhead.py"), "--config", str(config),
                                "--steps", "2", "--warmup", "1", "--trials", "100", "--gpus", "0,1", "--out", str(out)],
                               stdout=subprocess.PIPE, text=True, cwd=tmp_path)
    assert [process.stdout.readline().split(":")[0] for _ in range(2)] == ["lane 0", "lane 1"]
    lanes = [pid for pid in os.listdir("/proc") if pid.isdigit() and _command_line_of(pid).count(f"{out}.gpu") == 1]
    assert len(lanes) == 2
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=120) != 0
    assert not [pid for pid in lanes if _command_line_of(pid)]  # both ended (and were reaped) with it


def _command_line_of(pid: str) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
    except OSError:  # ended
        return ""


def test_gpus_is_refused_before_any_lane_starts_when_it_cannot_run(tmp_path, tiny_config_factory, monkeypatch, capsys):
    benchmark = _load_benchmark_module()
    config = write_config(tmp_path, tiny_config_factory(defaults={"method": "lora", "lora_rank": 4, "batch_size": 8,
                                                                  "seq_len": 32, "device": "cpu", "num_gpus": 0}))
    # An experiment the workflow would refuse: one line naming the file and the key, not a traceback.
    bad = write_config(tmp_path, tiny_config_factory(defaults={"batch_size": 32, "epochs": 1, "warmup_steps": 50,
                                                               "device": "cpu", "num_gpus": 0}), name="bad.yaml")
    monkeypatch.chdir(tmp_path)
    too_many = ",".join(str(gpu) for gpu in range(len(os.sched_getaffinity(0)) + 1))
    for arguments, message in ((["--gpus", "0,0", "--out", "o.json"], "expected distinct GPUs separated by commas"),
                               (["--gpus", "0,1"], "--gpus: needs --out"),
                               (["--gpus", too_many, "--out", "o.json"], "CPU cores to run them on"),
                               (["--gpus", "0", "--out", "o.json", "--pool", "missing.json"],
                                "--pool: missing.json: cannot be read"),
                               (["--gpus", "0", "--out", "o.json", "--run", "7"], "--run: expected an index of"),
                               (["--config", str(bad), "--gpus", "0", "--out", "o.json"],
                                f"{bad}: config key defaults.warmup_steps: 50")):
        monkeypatch.setattr(sys, "argv", ["benchmark_overhead.py", "--config", str(config), "--trials", "1", *arguments])
        with pytest.raises(SystemExit) as exit_:
            benchmark.main()
        error = capsys.readouterr().err + (exit_.value.code if isinstance(exit_.value.code, str) else "")
        assert exit_.value.code != 0 and message in error, (arguments, error)
        assert not list(tmp_path.glob("o.json.gpu*")), arguments  # no lane started
    assert benchmark.core_ranges([0, 1, 2, 3, 8, 10, 11]) == "0-3,8,10-11"


def test_the_bare_loop_trains_on_the_batches_ftbench_draws_for_the_run(tiny_config_factory, tmp_path):
    """ftbench / bare compares the harness with a plain loop doing the same work. The bare loop drew plain batches of
    one micro-batch per step whatever the run's batching and accumulation: on a length-grouped, accumulating run it
    trained on other batches (other padding, half the tokens per step) than the ftbench side it was compared with."""
    from ftbench.data import prepared
    from ftbench.experiment import matrix
    from ftbench.tasks import registry
    from ftbench.train import trainer

    benchmark = _load_benchmark_module()
    config = tiny_config_factory(defaults={"method": "full", "precision": "fp32", "batch_size": 4, "seq_len": 32,
                                           "batching": "group_by_length", "grad_accum_steps": 2, "max_steps": 4,
                                           "warmup_steps": 1, "learning_rate": 0.001, "device": "cpu", "num_gpus": 0,
                                           "seed": 0, "eval_batch_size": 64},
                                 matrix={"model": ["tiny"], "dataset": ["tiny"]})
    (spec,) = matrix.expand_runs(config)
    data_dir = tmp_path / "data"
    registry.prepare(spec.dataset, spec.dataset_def, spec.model_def, spec.seq_len, data_dir)
    manifest = prepared.verify(data_dir)
    split = registry.load_split(data_dir, "train", manifest)
    bare = [(sum(batch.real_tokens for batch in micro), sum(batch.padded_tokens for batch in micro), len(micro))
            for micro in benchmark.step_batches(spec, split, manifest, 4)]
    metrics, steps = trainer.train_run(spec, data_dir)
    assert metrics["status"] == "ok", metrics.get("status_reason")
    assert [(step["tokens"], step["padded_tokens"]) for step in steps] == [(real, padded) for real, padded, _ in bare]
    assert all(micro_batches == 2 for _, _, micro_batches in bare)


def test_a_side_speed_is_its_window_and_its_median_step():
    """Four steps of 1,000 tokens, one of them stalled: the window's tokens/s carry the stall, the typical
    step does not, and the stall share says how much longer the window was than four typical steps."""
    benchmark = _load_benchmark_module()
    speed = benchmark.Speed.of([1000] * 4, [0.10, 0.10, 0.10, 0.20], window_s=0.50)
    assert speed.window == pytest.approx(8000) and speed.typical_step == pytest.approx(10000)
    assert speed.stall_share == pytest.approx(0.25)
    # Steps of different sizes: the median of each step's own tokens/s, not tokens over a median time.
    mixed = benchmark.Speed.of([1000, 2000, 3000], [0.1, 0.1, 0.5], window_s=0.7)
    assert mixed.typical_step == pytest.approx(10000)


def test_a_trial_runs_each_side_twice_mirrored_so_a_steady_drift_cancels():
    """A host that slows by 5% of a step's time with every pass (the launch-bound H100 trials moved by 10-50%):
    ftbench truly at 0.98 of bare. Each side once, in order, would read 0.98 / 1.05 = 0.933 (it ran one pass
    later); mirrored (bare, ftbench, no-NVML, no-NVML, ftbench, bare) both sides' passes centre on the same
    moment and the ratio is 0.98 exactly."""
    benchmark = _load_benchmark_module()
    true_speed = {"bare": 1000.0, "ftbench": 980.0, "ftbench_no_nvml": 985.0}
    calls: list[str] = []

    def side(name: str):
        def run():
            slowdown = 1 + 0.05 * len(calls)  # each pass takes 5% longer than the first did
            calls.append(name)
            speed = true_speed[name] / slowdown
            return benchmark.Speed(window=speed * 0.9, typical_step=speed, stall_share=0.1 * len(calls))
        return run

    order, speed, passes = benchmark.mirrored_trial({name: side(name) for name in true_speed}, trial=1)
    assert order == ["ftbench", "ftbench_no_nvml", "bare"]
    assert calls == order + order[::-1] == [name for name, _ in passes]
    assert passes[0][1].typical_step == pytest.approx(980.0) and passes[-1][1].typical_step == pytest.approx(980.0 / 1.25)
    row = benchmark.trial_row(order, speed, nvml_samples=0)
    assert row["ftbench_over_bare"] == pytest.approx(0.98) and row["window_ftbench_over_bare"] == pytest.approx(0.98)
    assert row["nvml_on_over_off"] == pytest.approx(980 / 985)
    assert speed["ftbench"].stall_share == pytest.approx((0.1 + 0.6) / 2)  # its first and last pass


def test_trials_stop_before_the_time_limit_and_each_is_written_as_it_ends(tmp_path, monkeypatch):
    """A GPU call has a hard limit: no trial starts that would end past --time-limit-s at the slowest trial's pace,
    and --out holds every finished trial (with the summary so far) as soon as it ends, so a stopped run keeps them."""
    import argparse

    benchmark = _load_benchmark_module()
    clock = [0.0]
    monkeypatch.setattr(benchmark.time, "monotonic", lambda: clock[0])
    out = tmp_path / "figures.json"
    written: list[int] = []

    def side(speed: float):
        def run():
            clock[0] += 10.0  # every pass takes 10 s: a trial (6 passes) 60 s
            if out.exists():
                written.append(len(json.loads(out.read_text())["trials"]))
            return benchmark.Speed.of([1000] * 4, [1000 / speed] * 4, window_s=4000 / speed)
        return run

    results: dict = {"trials": []}
    args = argparse.Namespace(trials=5, time_limit_s=150.0, out=str(out), steps=40, warmup=10)
    benchmark.run_trials({"bare": side(100.0), "ftbench": side(99.0), "ftbench_no_nvml": side(99.5)}, [0], results, args)
    # Trial 0 ends at 60 s, trial 1 at 120 s; trial 2 would end at 180 s > 150 s: not started.
    assert len(results["trials"]) == 2 and clock[0] == 120.0
    assert written == [1] * 6  # no file during trial 0; during trial 1, trial 0 is on disk
    saved = json.loads(out.read_text())
    assert len(saved["trials"]) == 2 and saved["median_ftbench_over_bare"] == pytest.approx(0.99)
    assert saved["trials"][0]["passes"][0]["step_tokens_per_s"] == pytest.approx([100.0] * 4)


def test_a_trial_row_divides_typical_steps_and_windows_alike():
    benchmark = _load_benchmark_module()
    speed = {"bare": benchmark.Speed(window=100.0, typical_step=110.0, stall_share=0.1),
             "ftbench": benchmark.Speed(window=90.0, typical_step=107.8, stall_share=0.2),
             "ftbench_no_nvml": benchmark.Speed(window=95.0, typical_step=107.8, stall_share=0.13)}
    row = benchmark.trial_row(["bare", "ftbench", "ftbench_no_nvml"], speed, nvml_samples=12)
    assert row["ftbench_over_bare"] == pytest.approx(0.98) and row["window_ftbench_over_bare"] == pytest.approx(0.9)
    assert row["nvml_on_over_off"] == pytest.approx(1.0) and row["window_nvml_on_over_off"] == pytest.approx(90 / 95)
    assert row["bare_stall_share"] == 0.1 and row["nvml_samples"] == 12


@pytest.mark.slow
def test_flop_count_benchmark_times_both_counters_on_the_runs_own_pass(tmp_path, tiny_config_factory):
    process, results = run_benchmark("benchmark_flop_count.py", tmp_path, tiny_config_factory, 4, "--trials", "3")
    trials = results["trials"]
    assert sorted(trial["order"][0] for trial in trials) == ["flop_counter_mode", "flop_tally", "plain"]
    assert all(trial[side] > 0 for trial in trials for side in ("plain", "flop_counter_mode", "flop_tally"))
    assert results["median_s"]["flop_tally"] == pytest.approx(sorted(t["flop_tally"] for t in trials)[1])
    assert results["flops_counted"] > 0 and results["device"] == "cpu"
    assert "FlopTally / FlopCounterMode" in process.stdout


def _load_script(name: str):
    """scripts/<name>.py as a module (the scripts are not a package)."""
    import importlib.util
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # where its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def _load_benchmark_module():
    return _load_script("benchmark_overhead")


def _trial(ftbench_over_bare: float, nvml_on_over_off: float) -> dict:
    """A trial whose window ratios equal its typical-step ones (the verdicts read only the latter)."""
    return {"ftbench_over_bare": ftbench_over_bare, "nvml_on_over_off": nvml_on_over_off,
            "window_ftbench_over_bare": ftbench_over_bare, "window_nvml_on_over_off": nvml_on_over_off}


def test_trials_that_agree_resolve_the_ratio_and_scattered_ones_do_not():
    benchmark = _load_benchmark_module()
    # The H100 batch-32 figures: a 1.5% overhead, trials within 0.6% of each other.
    steady = benchmark.summarise_trials([_trial(r, 1.0) for r in (0.989, 0.984, 0.990, 0.985, 0.985, 0.985)])
    assert steady["resolved"] and steady["median_ftbench_over_bare"] == pytest.approx(0.985)
    assert steady["range_ftbench_over_bare"] == [0.984, 0.990]
    low, high = steady["interval_ftbench_over_bare"]
    assert 0.983 < low < steady["mean_ftbench_over_bare"] < high < 0.989
    # The batch-8 figures, launch-bound: the median (0.99) looks fine, but trials span 0.85-1.08.
    scattered = benchmark.summarise_trials([_trial(r, 1.0) for r in (0.851, 1.076, 1.077, 1.044, 0.861, 0.936)])
    assert not scattered["resolved"] and scattered["median_ftbench_over_bare"] == pytest.approx(0.990)
    assert scattered["verdict_ftbench_over_bare"] == "not resolved" and steady["verdict_ftbench_over_bare"] == "meets"
    # Either ratio scattering is enough to leave the result unresolved.
    assert not benchmark.summarise_trials([_trial(0.99, r) for r in (0.95, 1.02, 1.0)])["resolved"]


def test_a_ratio_settles_by_the_interval_of_its_trials_mean():
    """Launch-bound trials scatter by more than the 3% margin: some fall below 0.97 even when the harness costs
    nothing. Enough of them still settle the ratio (their mean's interval clears the target); few leave it open,
    saying how many would do; trials that scatter below it miss; identical trials settle at once."""
    benchmark = _load_benchmark_module()
    # 8 trials of the 1B batch-2 H100 run (issue 30's shape): two below 0.97, mean 0.998.
    h100 = (0.997, 0.958, 1.011, 0.988, 0.980, 1.082, 0.997, 0.979)
    eight = benchmark.summarise_trials([_trial(r, 1.0) for r in h100])
    assert eight["verdict_ftbench_over_bare"] == "not resolved"
    needed = eight["trials_to_settle_ftbench_over_bare"]
    assert needed > len(h100)
    # The same scatter, repeated to that many trials, settles it: the interval narrows as 1 / sqrt(trials).
    more = benchmark.summarise_trials([_trial(h100[i % len(h100)], 1.0) for i in range(3 * len(h100))])
    assert more["verdict_ftbench_over_bare"] == "meets" and more["interval_ftbench_over_bare"][0] >= 0.97
    assert min(more["range_ftbench_over_bare"]) < 0.97  # a rule needing every trial above the target never would
    below = benchmark.summarise_trials([_trial(r, 1.0) for r in (0.90, 0.85, 0.93, 0.96, 0.88)])
    assert below["verdict_ftbench_over_bare"] == "misses" and below["interval_ftbench_over_bare"][1] < 0.97
    assert benchmark.summarise_trials([_trial(0.95, 1.0)] * 2)["verdict_ftbench_over_bare"] == "misses"
    one = benchmark.summarise_trials([_trial(1.2, 1.0)])
    assert one["verdict_ftbench_over_bare"] == "not resolved" and one["interval_ftbench_over_bare"] is None
    # Trials close together on both sides of the target settle nothing; at a mean on the target no count would.
    straddling = benchmark.summarise_trials([_trial(1.0, r) for r in (0.985, 1.0, 1.005)])
    assert straddling["verdict_nvml_on_over_off"] == "not resolved" and not straddling["resolved"]
    on_target = benchmark.summarise_trials([_trial(r, 1.0) for r in (0.96, 0.98)])
    assert on_target["trials_to_settle_ftbench_over_bare"] is None
    # A ratio and its reciprocal settle alike (logs): 1/x above 1/target exactly when x is below target.
    flipped = benchmark.settle([1 / r for r in h100 * 3], 1 / 0.97)
    assert flipped.verdict == "misses"


def test_earlier_trials_pool_with_this_runs_and_only_from_the_same_run_and_gpu_model(tmp_path, tiny_config_factory,
                                                                                   monkeypatch, capsys):
    """Launch-bound examples need more trials than one GPU session gives: --pool settles the trials of earlier --out
    files together (--trials 0: without running any), and refuses a file from another GPU model or run, naming it."""
    from ftbench.experiment import config as ftbench_config, matrix

    benchmark = _load_benchmark_module()
    config = write_config(tmp_path, tiny_config_factory(defaults={"method": "lora", "lora_rank": 4, "batch_size": 8,
                                                                  "seq_len": 32, "device": "cpu", "num_gpus": 0}))
    spec = matrix.expand_runs(ftbench_config.load_config(config))[0]
    h100 = "NVIDIA H100 80GB HBM3"
    sessions = {"first.json": (0.997, 0.958, 1.011, 0.988), "second.json": (0.980, 1.082, 0.996, 0.979, 1.02)}
    for steps, (name, ratios) in zip((40, 60), sessions.items()):
        (tmp_path / name).write_text(json.dumps({
            "run_id": spec.run_id, "batch_size": spec.batch_size, "gpu_sample_interval_s": spec.gpu_sample_interval_s,
            "device": h100, "steps": steps, "warmup": 10, "trials": [_trial(ratio, 1.0) for ratio in ratios]}))

    monkeypatch.chdir(tmp_path)

    def pool(*arguments: str) -> subprocess.CompletedProcess:
        """The script's main() run here (no GPU, nothing trained: a process of its own would only add torch's import)."""
        monkeypatch.setattr(sys, "argv", ["benchmark_overhead.py", "--config", str(config), "--trials", "0", *arguments])
        returncode, message = 0, ""
        try:
            benchmark.main()
        except SystemExit as exit_:
            returncode, message = (exit_.code, "") if isinstance(exit_.code, int) else (1, str(exit_.code))
        out, err = capsys.readouterr()
        return subprocess.CompletedProcess([], returncode, out, err + message)

    def pool_files(*files: str) -> subprocess.CompletedProcess:
        return pool("--pool", *files, "--out", "pooled.json")

    process = pool_files("first.json", "second.json")
    assert process.returncode == 0, process.stderr[-3000:]
    pooled = json.loads((tmp_path / "pooled.json").read_text())
    assert pooled["device"] == h100 and len(pooled["trials"]) == 9
    assert [trial["pooled_from"] for trial in pooled["trials"]] == ["first.json"] * 4 + ["second.json"] * 5
    assert [trial["steps"] for trial in pooled["trials"]] == [40] * 4 + [60] * 5 and pooled["steps"] is None
    together = benchmark.summarise_trials([_trial(r, 1.0) for ratios in sessions.values() for r in ratios])
    assert pooled["interval_ftbench_over_bare"] == pytest.approx(together["interval_ftbench_over_bare"])
    assert pooled["verdict_ftbench_over_bare"] == together["verdict_ftbench_over_bare"]
    assert f"on {h100}, 9 trials (9 of them measured into 2 earlier files)" in process.stdout

    # Pooling the pooled file with one of its sources, or a file twice, counts each trial once, from where it began.
    (tmp_path / "pooled.json").rename(tmp_path / "earlier-pool.json")
    again = pool_files("earlier-pool.json", "first.json", "second.json")
    assert again.returncode == 0, again.stderr[-3000:]
    assert "--pool: 9 trials came more than once" in again.stdout
    assert "9 trials (9 of them measured into 2 earlier files)" in again.stdout  # where they were measured, not pooled
    repooled = json.loads((tmp_path / "pooled.json").read_text())
    assert [trial["pooled_from"] for trial in repooled["trials"]] == ["first.json"] * 4 + ["second.json"] * 5
    assert repooled["interval_ftbench_over_bare"] == pooled["interval_ftbench_over_bare"]

    (tmp_path / "truncated.json").write_text('{"trials": [')
    assert "--pool: truncated.json: cannot be read as a benchmark_overhead --out file" in pool_files("truncated.json").stderr
    broken = json.loads((tmp_path / "first.json").read_text())
    del broken["trials"][2]["window_nvml_on_over_off"]
    (tmp_path / "broken.json").write_text(json.dumps(broken))
    assert "--pool: broken.json: trial 2 lacks a number for one of" in pool_files("broken.json").stderr
    other_gpu = json.loads((tmp_path / "second.json").read_text()) | {"device": "NVIDIA H200"}
    (tmp_path / "second.json").write_text(json.dumps(other_gpu))
    refused = pool_files("first.json", "second.json")
    assert refused.returncode != 0
    assert f"--pool: second.json: device is 'NVIDIA H200', this run's is '{h100}'" in refused.stderr
    nothing = pool()
    assert nothing.returncode != 0 and "--trials: at least 1 (0 only with --pool)" in nothing.stderr

    # Across runs: files of other runs and batches pool only when asked, each trial keeping the run it measured;
    # another GPU model is refused still.
    other_run = {"run_id": "llama1b-other-run", "batch_size": 2, "gpu_sample_interval_s": spec.gpu_sample_interval_s,
                 "device": h100, "steps": 40, "warmup": 10, "trials": [_trial(r, 0.99) for r in (0.93, 0.95, 1.04)]}
    (tmp_path / "other-run.json").write_text(json.dumps(other_run))
    refused = pool_files("first.json", "other-run.json")
    assert refused.returncode != 0 and "--pool: other-run.json: run_id is 'llama1b-other-run'" in refused.stderr
    across = pool("--across-runs", "--pool", "first.json", "other-run.json", "--out", "across.json")
    assert across.returncode == 0, across.stderr[-3000:]
    pooled = json.loads((tmp_path / "across.json").read_text())
    assert pooled["run_id"] is None and pooled["device"] == h100
    assert [trial["run_id"] for trial in pooled["trials"]] == [spec.run_id] * 4 + ["llama1b-other-run"] * 3
    assert [trial["batch_size"] for trial in pooled["trials"]] == [spec.batch_size] * 4 + [2] * 3
    mixed = benchmark.summarise_trials([_trial(r, 1.0) for r in sessions["first.json"]]
                                       + [_trial(r, 0.99) for r in (0.93, 0.95, 1.04)])
    assert pooled["interval_ftbench_over_bare"] == pytest.approx(mixed["interval_ftbench_over_bare"])
    assert pooled["interval_nvml_on_over_off"] == pytest.approx(mixed["interval_nvml_on_over_off"])
    assert f"across 2 runs (llama1b-other-run, {spec.run_id}) on {h100}, 7 trials" in across.stdout
    assert "device is 'NVIDIA H200'" in pool("--across-runs", "--pool", "first.json", "second.json").stderr
    assert "--across-runs: only with --trials 0" in pool("--across-runs", "--trials", "1").stderr


@pytest.mark.slow
def test_parse_benchmark_reports_each_dry_run_and_ftbench_share(tmp_path):
    """scripts/benchmark_parse.py on a 4-run matrix, one dry run each: its table and JSON, not its timings."""
    from ftbench.experiment import config as ftbench_config, matrix

    out = tmp_path / "parse.json"
    process = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "benchmark_parse.py"), "--repeats", "1", "--axis-values", "1",
         "--json", str(out)],
        capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert process.returncode == 0, process.stderr[-3000:]
    results = json.loads(out.read_text())
    assert results["repeats"] == 1
    default_runs = len(matrix.expand_runs(ftbench_config.load_config(ROOT / "config" / "config.yaml")))
    experiments = {result["name"]: result for result in results["experiments"]}
    assert {name: result["runs"] for name, result in experiments.items()} == {"snakemake alone": 0, "default": default_runs, "matrix": 4}
    for result in experiments.values():
        assert len(result["dry_run_samples_s"]) == 1 and result["dry_run_s"] == result["dry_run_samples_s"][0] > 0
    for name in ("default", "matrix"):
        assert experiments[name]["validate_expand_first_s"] > 0 and experiments[name]["validate_expand_s"] > 0
    assert (experiments["default"]["target_s"], experiments["matrix"]["target_s"]) == (2.0, 10.0)
    assert "snakemake -n (median of 1)" in process.stdout and len(process.stdout.splitlines()) == 4


@pytest.mark.slow
def test_shape_churn_benchmark_times_each_length_pattern_against_the_fixed_one(tmp_path):
    """scripts/benchmark_shape_churn.py, a smoke run on the CPU with a two-layer model: one figure per
    length pattern, the fixed length's ratio 1."""
    out = tmp_path / "churn.json"
    process = subprocess.run([sys.executable, str(ROOT / "scripts" / "benchmark_shape_churn.py"), "--tiny", "--device", "cpu",
                              "--batch-size", "4", "--seq-len", "32", "--steps", "3", "--warmup", "1", "--json", str(out)],
                             capture_output=True, text=True, timeout=300)
    assert process.returncode == 0, process.stderr[-2000:]
    result = json.loads(out.read_text())
    assert list(result["ms_per_step"]) == ["fixed 32", "varying 24-32", "varying 2-32"]
    assert all(ms > 0 for ms in result["ms_per_step"].values())
    assert "1.00x the fixed length" in process.stdout.splitlines()[0]


def test_the_flop_check_cuts_every_run_to_three_steps_whatever_sets_its_length():
    """scripts/check_flop_ratios.py: a run's length set in the defaults, the matrix, an include or an override is
    replaced by 3 steps (2 warmup), one repeat, 8 evaluation examples; nothing else of the experiment changes."""
    check = _load_script("check_flop_ratios")
    experiment = {"models": {"m": {}}, "repeats": 3,
                  "defaults": {"max_steps": 60, "warmup_steps": 10, "batch_size": 8, "eval_every": 20},
                  "matrix": {"model": ["m"], "max_steps": [30, 60], "method": ["full", "lora"]},
                  "include": [{"model": "m", "max_steps": 600, "epochs": 2, "warmup_until_stable": True, "seq_len": 64}],
                  "overrides": [{"when": {"method": "lora"}, "set": {"max_eval_samples": 500, "learning_rate": 0.1}}]}
    short = check.shortened(experiment, Path("/data"))
    assert short["defaults"] == {"max_steps": 3, "warmup_steps": 2, "batch_size": 8, "max_eval_samples": 8}
    assert short["matrix"] == {"model": ["m"], "method": ["full", "lora"]} and short["repeats"] == 1
    assert short["include"] == [{"model": "m", "seq_len": 64}]
    assert short["overrides"] == [{"when": {"method": "lora"}, "set": {"learning_rate": 0.1}}]
    assert experiment["include"][0]["max_steps"] == 600  # the experiment itself is left as it was
    # It trains in a folder of its own: a relative path source is made absolute from where the script runs.
    sourced = check.shortened({"models": {"m": {"source": {"kind": "path", "path": "models/m",
                                                           "tokenizer": {"kind": "path", "path": "/abs/tok"}}}},
                               "datasets": {"d": {"source": {"kind": "path", "path": "../d.csv"}}}}, Path("/data/x"))
    assert sourced["models"]["m"]["source"]["path"] == "/data/x/models/m"
    assert sourced["models"]["m"]["source"]["tokenizer"]["path"] == "/abs/tok"
    assert sourced["datasets"]["d"]["source"]["path"] == "/data/d.csv"
    home = check.shortened({"datasets": {"d": {"source": {"kind": "path", "path": "~/d.csv"}}}}, Path("/data/x"))
    assert home["datasets"]["d"]["source"]["path"] == str(Path("~/d.csv").expanduser().resolve())
    # Selecting runs by their length cannot survive cutting every run to 3 steps: refused, not silently changed.
    for selecting in ({"exclude": [{"method": "lora", "max_steps": 400}]},
                      {"overrides": [{"when": {"max_steps": 400}, "set": {"batch_size": 16}}]}):
        with pytest.raises(SystemExit, match="selects runs by max_steps"):
            check.shortened({**experiment, **selecting}, Path("/data"))
    # A run that trained needs a ratio within 5% of 1; one that did not train has no MFU to check.
    assert not check.needs_attention({"status": "ok", "ratio": 0.96})
    assert check.needs_attention({"status": "ok", "ratio": 1.06}) and check.needs_attention({"status": "ok", "ratio": None})
    assert not check.needs_attention({"status": "oom", "ratio": None})
    assert check.needs_attention({"status": "missing", "ratio": None})  # the job crashed before writing its row


def test_the_flop_check_refuses_a_bad_experiment_before_training_any(tmp_path, tiny_config_factory):
    """A wrong last file (here a model from a package that is not installed) must not cost the GPU time of
    the files before it: every experiment is checked first, and the script names the file and key in one line."""
    good = write_config(tmp_path / "good", tiny_config_factory(defaults={"device": "cpu", "num_gpus": 0}))
    broken = tiny_config_factory(defaults={"device": "cpu", "num_gpus": 0})
    broken["models"]["tiny"]["source"] = {"kind": "package", "package": "no-such-model-pkg", "path": "model"}
    bad = write_config(tmp_path / "bad", broken)
    process = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "check_flop_ratios.py"), str(good), str(bad), "--workdir", str(tmp_path / "work"),
         "--", "--cores", "2"], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert process.returncode == 2, process.stdout + process.stderr[-3000:]
    error_lines = process.stderr.strip().splitlines()
    assert len(error_lines) == 1 and str(bad) in error_lines[0], process.stderr
    assert "models.tiny.source.package" in error_lines[0] and "no-such-model-pkg" in error_lines[0]
    assert not list((tmp_path / "work").glob("*/snakemake.log")) and "snakemake exit" not in process.stdout


@pytest.mark.slow
def test_the_flop_check_trains_each_experiment_short_and_lists_every_run(tmp_path, tiny_config_factory):
    config = write_config(tmp_path, tiny_config_factory(
        defaults={"method": "lora", "lora_rank": 4, "lora_targets": ["query", "value"], "batch_size": 8, "seq_len": 32,
                  "max_steps": 40, "warmup_steps": 5, "device": "cpu", "num_gpus": 0},
        include=[{"model": "tiny", "dataset": "tiny", "method": "full", "max_steps": 500}]))
    process = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "check_flop_ratios.py"), str(config), "--workdir", str(tmp_path / "work"),
         "--", "--cores", "2"], capture_output=True, text=True, timeout=600, cwd=tmp_path)
    lines = process.stdout.splitlines()
    assert lines[0].startswith("config.yaml: 2 runs, snakemake exit 0"), process.stdout + process.stderr[-3000:]
    rows = [line for line in lines if line.startswith("config ")]
    assert len(rows) == 2 and all(" ok " in row for row in rows), process.stdout
    for run_folder in (tmp_path / "work" / "config" / "results" / "runs").iterdir():
        metrics = json.loads((run_folder / "metrics.json").read_text())
        assert metrics["spec"]["max_steps"] == 3 and metrics["metrics"]["measured_steps"] == 1
    assert lines[-1].startswith("2 runs: 2 trained, ratios ")
    assert process.returncode == (1 if "<-- check" in process.stdout else 0)
