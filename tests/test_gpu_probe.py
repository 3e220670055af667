"""The GPU probe (measure/gpu_probe.py) and what it feeds (experiment/probes.py): its arithmetic on the CPU device
with a fake clock, the clock synchronising before every read, the figures' mapping to the step-time parameters
(directly and scaled by a calibrated GPU model's probe), the probed basis between calibrated and datasheet only,
a GPU the table lacks added from its probe, and the command without Snakemake or datasets installed."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
import yaml

from conftest import ROOT
from ftbench import cli
from ftbench.errors import FtbenchError
from ftbench.experiment import calibration as calibrations
from ftbench.experiment import prediction, probes
from ftbench.measure import gpu_probe, gpu_table
from ftbench.report import prediction as report_prediction

GPUS = gpu_table.load_peaks(ROOT / "config" / "gpus.yaml")
H200 = next(gpu for gpu in GPUS if gpu["name"] == "H200")
H100 = next(gpu for gpu in GPUS if gpu["name"] == "H100 SXM")
L4 = next(gpu for gpu in GPUS if gpu["name"] == "L4")
WIDTHS = ((64, 256), (128, 384))


def fake_clock(seconds: float):
    """A clock that runs the function once (the CPU device does the work) and says it took ``seconds``."""
    calls = []

    def clock(fn):
        fn()
        calls.append(fn)
        return seconds
    clock.calls = calls
    return clock


def test_the_probes_arithmetic_on_the_cpu_device_with_a_fake_clock():
    clock = fake_clock(1e-3)
    result = gpu_probe.run_probe(torch, "cpu", clock, widths=WIDTHS, tokens=32, elements=4096)
    # each width's figure is the median of its two shapes (square and MLP): 2 x tokens x width x out per call
    for width, intermediate in WIDTHS:
        expected = (2 * 32 * width * width + 2 * 32 * width * intermediate) / 2 / 1e-3 / 1e12
        for dtype in gpu_probe.DTYPES:
            assert result.matmul_tflops[dtype][width] == pytest.approx(expected)
    # bytes read plus written per second: a copy 2 x 4 bytes, an add 3 x, bf16 half of that, AdamW 28 per parameter
    assert result.bandwidth_gbs["copy_fp32"] == pytest.approx(2 * 4 * 4096 / 1e-3 / 1e9)
    assert result.bandwidth_gbs["add_fp32"] == pytest.approx(3 * 4 * 4096 / 1e-3 / 1e9)
    assert result.bandwidth_gbs["add_bf16"] == pytest.approx(3 * 2 * 4096 / 1e-3 / 1e9)
    assert result.bandwidth_gbs["scale_bf16"] == pytest.approx(2 * 2 * 4096 / 1e-3 / 1e9)
    assert result.bandwidth_gbs["adamw_fp32"] == pytest.approx(28 * 4096 / 1e-3 / 1e9)
    # host: the step's seconds over the aten operations it dispatched (counted, not guessed)
    assert result.host_ops_per_step > 20
    assert result.host_op_s == pytest.approx(1e-3 / result.host_ops_per_step)
    assert result.kernel_s is None  # the kernel floor needs CUDA
    assert result.device_name == "cpu"
    figures = result.figures()
    assert set(figures["matmul_tflops"]) == {"bf16", "fp16", "fp32"} and figures["host_ops_per_step"] == result.host_ops_per_step
    text = "\n".join(gpu_probe.summary(result, {"bf16": 1.0}, 100.0))
    assert "probe took" in text and "of peak" in text and "us per aten operation" in text


def test_the_clock_synchronises_the_device_before_every_read_and_warms_up(monkeypatch):
    """Every perf_counter read comes right after a synchronisation, and warm-up calls are not timed: a function
    that is slow on its first calls and then takes 10 ms reads 10 ms."""
    now = [0.0]
    events = []

    def perf_counter():
        events.append("read")
        return now[0]

    def synchronize():
        events.append("sync")
    monkeypatch.setattr(gpu_probe.time, "perf_counter", perf_counter)
    durations = iter([5.0, 5.0] + [0.01] * 10_000)  # two slow warm-up calls

    def fn():
        now[0] += next(durations)
        events.append("call")
    clock = gpu_probe.synced_clock(synchronize, round_s=0.05, rounds=3, warmup=2)
    assert clock(fn) == pytest.approx(0.01)
    reads = [index for index, event in enumerate(events) if event == "read"]
    assert reads and all(events[index - 1] == "sync" for index in reads)
    assert events[:4] == ["call", "call", "sync", "read"]  # warm-up before the first read


def probe_figures(compute: float, memory: float, gpu: dict, width_half: float, kernel_s=3e-6, host_op_s=10e-6) -> dict:
    """Figures a probe would print for a GPU whose matmuls reach ``compute`` at large width and whose kernels move
    ``memory`` of its bandwidth."""
    peak = gpu["dense_tflops"]["bf16"]
    rates = {width: peak * compute / (1 + width_half / width) for width, _ in gpu_probe.WIDTHS}
    return {"device_name": f"NVIDIA {gpu['name']}", "memory_gb": gpu["memory_gb"], "matmul_tflops": {"bf16": rates},
            "bandwidth_gbs": {"copy_fp32": gpu["memory_bandwidth_gbs"] * memory,
                              "adamw_fp32": gpu["memory_bandwidth_gbs"] * memory}, "kernel_s": kernel_s,
            "host_op_s": host_op_s}


def test_a_probe_maps_directly_to_the_parameters_it_stands_for():
    calibration = calibrations.priors()
    figures = probe_figures(0.6, 0.7, L4, calibration.params["width_half"], kernel_s=4e-6, host_op_s=9e-6)
    params = probes.probed_params(figures, L4, calibration)
    assert params["compute_efficiency"] == pytest.approx(0.6)
    assert params["memory_efficiency"] == pytest.approx(0.7)
    assert params["gpu_op_s"] == pytest.approx(4e-6) and params["host_op_s"] == pytest.approx(9e-6)
    assert params["from_probe"] == "direct"


def test_a_probe_is_scaled_by_a_calibrated_gpus_probe_where_the_file_has_one():
    """The H100 is calibrated (0.77 compute, 13 us per host unit) and probed at 0.70 and 10 us; an H200 probed at
    0.77 and 12 us is predicted at 0.77 x 0.77 / 0.70 and 13 us x 1.2: what the probe measured differently, carried
    over onto what the fit to training runs learned."""
    shipped = calibrations.load(ROOT / "config" / "calibration.yaml")
    width_half = shipped.params["width_half"]
    h100 = probe_figures(0.70, 0.80, H100, width_half, kernel_s=3e-6, host_op_s=10e-6)
    h200 = probe_figures(0.77, 0.88, H200, width_half, kernel_s=2.4e-6, host_op_s=12e-6)
    merged = probes.with_probes(shipped, {"H100 SXM": h100, "H200": h200}, GPUS)
    mine, theirs = merged.params_for("H200"), shipped.params_for("H100 SXM")
    assert mine["compute_efficiency"] == pytest.approx(theirs["compute_efficiency"] * 0.77 / 0.70)
    assert mine["memory_efficiency"] == pytest.approx(theirs["memory_efficiency"] * 0.88 / 0.80)
    assert mine["host_op_s"] == pytest.approx(theirs["host_op_s"] * 1.2)
    assert mine["host_step_s"] == pytest.approx(theirs["host_step_s"] * 1.2)
    assert mine["gpu_op_s"] == pytest.approx(theirs["gpu_op_s"] * 0.8)
    assert "H100 SXM" in merged.probed["H200"]["from_probe"]
    # the calibrated H100 keeps its fitted parameters: measured runs take precedence over a probe
    assert merged.params_for("H100 SXM") == shipped.params_for("H100 SXM")
    assert prediction.basis("H100 SXM", merged) == "calibrated"


def test_probed_sits_between_calibrated_and_datasheet_with_the_datasheets_width():
    shipped = calibrations.load(ROOT / "config" / "calibration.yaml")
    width_half = shipped.params["width_half"]
    figures = probe_figures(0.5, 0.6, L4, width_half)
    # without a probe of a calibrated GPU model the probe is kept but not used: its direct figures predicted an
    # H100's runs worse than its datasheet did
    assert probes.with_probes(shipped, {"L4": figures}, GPUS).is_probed("L4") is False
    assert "not used until the file also holds a probe of H100 SXM" in probes.reference_missing(shipped, {"L4": figures})
    # with one: an H100 probed at its calibrated efficiencies and host terms carries the L4's figures over as they are
    h100 = shipped.params_for("H100 SXM")
    reference = probe_figures(h100["compute_efficiency"], h100["memory_efficiency"], H100, width_half,
                              kernel_s=h100["gpu_op_s"], host_op_s=h100["host_op_s"])
    figures = probe_figures(0.5, 0.6, L4, width_half, kernel_s=h100["gpu_op_s"], host_op_s=h100["host_op_s"])
    merged = probes.with_probes(shipped, {"H100 SXM": reference, "L4": figures}, GPUS)
    assert probes.reference_missing(shipped, {"H100 SXM": reference, "L4": figures}) is None
    assert prediction.basis("L4", merged) == "probed"
    assert prediction.BASES["probed"] == "probed on this GPU model"
    assert prediction.basis("A100", merged) == "datasheet"
    assert prediction.basis("L4", merged, measured=True) == "measured"
    # the spread a probe has earned is unmeasured: it keeps the prior's width, the datasheet its measured transfer_sd
    assert merged.spread("L4", 0.3) == calibrations.PROBED_SD == calibrations.DEFAULT_TRANSFER_SD
    assert merged.spread("A100", 0.3) == merged.transfer_sd
    # and the probe moves the prediction: the L4's efficiencies are its own, not the calibrated models' median
    assert merged.params_for("L4")["compute_efficiency"] == pytest.approx(0.5)
    assert shipped.params_for("L4")["compute_efficiency"] != pytest.approx(0.5)
    # a probe without a 16-bit matmul figure keeps the calibrated models' compute efficiency, its other figures its own
    partial = probes.with_probes(shipped, {"H100 SXM": reference, "L4": {**figures, "matmul_tflops": {}}}, GPUS)
    assert partial.params_for("L4")["compute_efficiency"] == shipped.params_for("L4")["compute_efficiency"]
    assert partial.params_for("L4")["memory_efficiency"] == pytest.approx(0.6)
    # the user's own runs fitted over it keep the probe for the GPU models they did not run on
    assert calibrations.Calibration(shipped.params, {"H200": dict(shipped.gpus["H100 SXM"])}).over(merged).is_probed("L4")


def test_a_probe_file_round_trips_and_adds_a_gpu_the_table_lacks(tmp_path):
    path = tmp_path / "probed.yaml"
    figures = probe_figures(0.5, 0.6, L4, 110.0)
    probes.save(path, "L4", figures)
    entry = probes.new_gpu_entry("Blackwell X", "NVIDIA Blackwell X (test)", 180.0, {"bf16": 2000.0, "fp32": 80.0}, 8000.0)
    probes.save(path, "Blackwell X", {**figures, "device_name": "NVIDIA Blackwell X (test)"}, entry)
    loaded, added = probes.load(path)
    assert set(loaded) == {"L4", "Blackwell X"} and loaded["L4"]["kernel_s"] == figures["kernel_s"]
    assert not report_prediction.with_probe_file(calibrations.priors(), GPUS, path)[0].is_probed("L4")  # no reference
    assert [gpu["name"] for gpu in added] == ["Blackwell X"]
    shipped = calibrations.load(ROOT / "config" / "calibration.yaml")
    probes.save(path, "H100 SXM", probe_figures(0.7, 0.8, H100, 110.0))
    calibration, gpus = report_prediction.with_probe_file(shipped, GPUS, path)
    assert gpu_table.entry_for("NVIDIA Blackwell X (test)", gpus)["name"] == "Blackwell X"
    assert calibration.is_probed("Blackwell X") and calibration.is_probed("L4") and not calibration.is_probed("H100 SXM")
    assert report_prediction.with_probe_file(calibrations.priors(), GPUS, tmp_path / "none.yaml")[1] == GPUS
    path.write_text(yaml.safe_dump({"probes": {"L4": {"device_name": "x"}}}), encoding="utf-8")
    with pytest.raises(FtbenchError, match="probes.L4: missing matmul_tflops"):
        probes.load(path)


def test_probe_gpu_refuses_a_gpu_the_table_lacks_before_measuring(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(ROOT)
    measured = []
    monkeypatch.setattr(gpu_probe, "run_probe", lambda *args, **kwargs: measured.append(1))
    with pytest.raises(SystemExit):
        cli.run(cli.probe_gpu, ["--device", "cpu", "--out", str(tmp_path / "p.yaml")])
    assert "matches no GPU of config/gpus.yaml" in capsys.readouterr().err and not measured
    with pytest.raises(SystemExit):
        cli.run(cli.probe_gpu, ["--device", "cpu", "--peak-tflops", "bf16:9", "--bandwidth-gbs", "9"])
    assert "--peak-tflops 'bf16:9': expected dtype=TFLOP/s" in capsys.readouterr().err and not measured


def test_probe_gpu_writes_the_probe_and_a_new_gpus_entry(tmp_path, monkeypatch, capsys):
    """The command end to end on the CPU device (small shapes, a fake clock): the file plan reads, with the
    device's entry for the GPU table and the parameters printed."""
    monkeypatch.chdir(ROOT)
    real = gpu_probe.run_probe
    monkeypatch.setattr(gpu_probe, "run_probe", lambda torch_module, device, **kw: real(
        torch_module, device, fake_clock(1e-3), widths=WIDTHS, tokens=16, elements=1024))
    out = tmp_path / "probed.yaml"
    cli.run(cli.probe_gpu, ["--device", "cpu", "--out", str(out), "--name", "CPU test", "--peak-tflops",
                            "bf16=0.5,fp16=0.5,fp32=1", "--bandwidth-gbs", "20"])
    printed = capsys.readouterr().out
    assert "CPU test probed (direct): compute_efficiency" in printed and f"wrote CPU test's probe to {out}" in printed
    loaded, added = probes.load(out)
    assert loaded["CPU test"]["device_name"] == "cpu" and added[0]["match"] == "cpu"


@pytest.mark.slow
def test_probe_gpu_runs_without_snakemake_or_datasets(tmp_path):
    """The GPU image has torch, transformers, pandas and yaml but not Snakemake or datasets: the command's imports
    must not need them (its --help, which imports everything but the probe's torch)."""
    blocker = ("import sys, importlib.abc, runpy\n"
               "class Block(importlib.abc.MetaPathFinder):\n"
               "    def find_spec(self, name, path, target=None):\n"
               "        if name.split('.')[0] in {'snakemake', 'datasets', 'matplotlib', 'seaborn', 'peft'}:\n"
               "            raise ImportError('blocked ' + name)\n"
               "sys.meta_path.insert(0, Block())\n"
               "sys.argv = ['ftbench', 'probe-gpu', '--help']\n"
               "runpy.run_module('ftbench', run_name='__main__')\n")
    done = subprocess.run([sys.executable, "-c", blocker], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={"PYTHONPATH": str(ROOT / "scripts"), "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stderr
    assert "--peak-tflops" in done.stdout


def test_the_kernel_floor_is_per_kernel_gpu_time(monkeypatch):
    """The CUDA path's arithmetic with a stand-in for torch: GPU seconds of the queued kernels over their number,
    retried with a longer sleep while the host could not queue them all before the sleep ended."""
    tries = iter([(0.5, False), (0.006, True)])
    cycles = []

    def queued(torch_module, x, kernels, sleep_cycles):
        cycles.append(sleep_cycles)
        return next(tries)
    monkeypatch.setattr(gpu_probe, "_queued_kernels", queued)
    fake_torch = type("FakeTorch", (), {"zeros": staticmethod(lambda *args, **kwargs: torch.zeros(1))})
    result = gpu_probe.ProbeResult("fake", None)
    gpu_probe.probe_kernel_floor(fake_torch, result, kernels=2000)
    assert result.kernel_s == pytest.approx(0.006 / 2000)
    assert cycles[1] == 4 * cycles[0]


def test_the_shipped_reference_probe_makes_another_gpus_probe_move_its_prediction_and_label(tmp_path):
    """config/calibration-probed.yaml ships a probe of the calibrated GPU model (the reference): a user's probe of
    another GPU model added to it is used at once. An H200 probed with the reference's figures but matmuls 0.8x as
    fast is predicted at 0.8x the H100's fitted compute efficiency (the two have the same dense peak), its GPU-bound
    run slower than its datasheet-only prediction, labelled probed, with the prior's width (unmeasured)."""
    from ftbench.report import cost

    shipped = calibrations.load(ROOT / "config" / "calibration.yaml")
    (calibrated,) = shipped.gpus
    reference, added = probes.load(ROOT / probes.DEFAULT_PROBES)
    assert list(reference) == [calibrated] and added == []  # the calibrated model's probe, and nothing else
    path = tmp_path / "probed.yaml"
    path.write_text((ROOT / probes.DEFAULT_PROBES).read_text(encoding="utf-8"), encoding="utf-8")
    figures = reference[calibrated]
    slower = {dtype: {width: 0.8 * value for width, value in by_width.items()}
              for dtype, by_width in figures["matmul_tflops"].items()}
    probes.save(path, "H200", {**figures, "device_name": "NVIDIA H200", "matmul_tflops": slower,
                               "bandwidth_gbs": {kernel: value * H200["memory_bandwidth_gbs"] / H100["memory_bandwidth_gbs"]
                                                 for kernel, value in figures["bandwidth_gbs"].items()}})
    merged, gpus = report_prediction.with_probe_file(shipped, GPUS, path)
    assert H200["dense_tflops"]["bf16"] == H100["dense_tflops"]["bf16"]
    assert merged.params_for("H200")["compute_efficiency"] == pytest.approx(
        0.8 * shipped.params_for(calibrated)["compute_efficiency"], rel=1e-6)
    runs = matrix_runs(tmp_path)
    budget, prices = {"tokens": 1e9}, cost.resolve({})
    before = report_prediction.priced_table(runs, GPUS, shipped, prices, budget).set_index("gpu").loc["H200"]
    after = report_prediction.priced_table(runs, gpus, merged, prices, budget).set_index("gpu").loc["H200"]
    assert before["basis"] == "datasheet only (uncalibrated)" and after["basis"] == "probed on this GPU model"
    assert after["tokens_per_s"] < 0.9 * before["tokens_per_s"]  # GPU-bound: the slower matmuls count
    assert merged.spread("H200", 0.0) == calibrations.PROBED_SD == 0.3  # the probed spread is unmeasured: the prior


def matrix_runs(tmp_path):
    """One GPU-bound run (a 1B Llama shape, full fine-tuning at 4 x 2048)."""
    from test_prediction import experiment, llama, runs_of

    return runs_of(experiment(tmp_path, {"big": llama(2048, 16, 5632, 32, 4, 32000)}, {"method": ["full"]},
                              {"batch_size": 4, "seq_len": 2048}))
