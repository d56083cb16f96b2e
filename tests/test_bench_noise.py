"""``bench`` judges its own noise: a figure whose timed calls disagree, or that was measured
while the CPU ran far below its idle speed, is reported as not a result (beside the figure,
never printed as one); units scale; the no-GPU note is printed once; the plot says what was
and was not timed."""

from __future__ import annotations

import contextlib
import io
import json
import time

import pytest
import torch

from hisparse_triton import benchmarks as bm
from hisparse_triton.benchmarks import noise, plot, report
from hisparse_triton.cli import main
from hisparse_triton.units import format_duration_us


@pytest.fixture(autouse=True)
def _restore_threads():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def _figure(method: str, time_us: float, spread: float = 0.02, probe_us: float = 10.0,
            **params):
    base = {"op": "gather", "row_bytes": 656, "rows": 512, "layers": 1, "miss_ratio": 1.0,
            "method": method, "time_us": time_us, "p20_us": time_us * (1 - spread),
            "p80_us": time_us * (1 + spread), "reps": 20, "probe_us": probe_us,
            "gbps": 336e-6 / time_us, "verified": True}
    base.update(params)
    return base


def _result(device: str, *figures) -> dict:
    return {"device": device, "transfers": list(figures), "resolve": [], "notes": [],
            "environment": {"cpu": "x86_64", "torch": "x", "triton": "y"},
            "kernel_timings": device == "cuda", "wall_s": 1.0}


class _Probe:
    """A probe whose idle reference is 10 us."""

    idle_us = 10.0

    def summary(self):
        return {"what": noise.PROBE_WHAT, "calls_per_sample": 16, "idle_us": 10.0,
                "slowest_us": 400.0}


LOAD = {"load_1min": 3.7, "cpus": 2}


def test_spread_and_a_slow_cpu_make_a_figure_not_a_result():
    ok = _figure("torch", 100.0)
    spread = _figure("contiguous", 8.0, spread=0.5, miss_ratio=None)
    slow = _figure("eager", 40_000.0, probe_us=400.0, miss_ratio=None)
    result = _result("cpu", ok, spread, slow)
    noise.judge_result(result, _Probe(), LOAD)
    assert ok["trusted"] is True and "untrusted" not in ok and ok["cpu_speed"] == 1.0
    assert spread["trusted"] is False and spread["untrusted"] == ["spread +-50% > 25%"]
    assert slow["trusted"] is False
    assert slow["untrusted"] == ["the CPU ran at 2.5% of its idle speed"]
    # the ratios of the good figure to the two bad baselines are not results either
    ok.update(vs_eager=2.0, vs_contiguous=0.1)
    noise.judge_result(result, _Probe(), LOAD)
    assert ok["untrusted_ratios"] == ["vs_eager", "vs_contiguous"]
    assert result["noise"]["untrusted_figures"] == 2 and result["noise"]["figures"] == 3
    assert result["noise"]["load_start"] == LOAD


def test_cuda_events_are_not_judged_by_the_host_probe():
    kernel = _figure("triton", 10.0, probe_us=400.0)
    host = _figure("torch", 300.0, probe_us=400.0)
    noise.judge_result(_result("cuda", kernel, host), _Probe(), LOAD)
    assert kernel["trusted"] is True and host["trusted"] is False


def test_the_table_shows_no_untrusted_figure_as_a_result():
    ok = _figure("torch", 100.0, vs_eager=2.0)
    slow = _figure("eager", 1_234_567.0, probe_us=400.0, miss_ratio=None, vs_eager=1.0)
    result = _result("cpu", ok, slow)
    noise.judge_result(result, _Probe(), LOAD)
    text = report.format_table(result)
    row = next(line for line in text.splitlines() if line.startswith("gather") and "eager" in
               line)
    cells = row.split()
    assert cells[6:10] == ["-", "2", "-", "-"]       # time, +-%, GB/s, x eager
    assert "NOT A RESULT (the CPU ran at 2.5% of its idle speed): measured 1.23 s" in row
    good = next(line for line in text.splitlines() if line.startswith("gather") and "torch"
                in line)
    assert "100.0 us" in good and "baseline not a result: no ratio to it" in good
    assert "NOT RESULTS: 1 of 2 figures were measured under noise" in text
    assert "the machine was busy (load above its CPU count)" in text
    assert text.splitlines()[1].startswith("machine: 2 CPUs for this process, 1-minute load "
                                           "average 3.7 at the start")


def test_targets_leave_out_what_is_not_a_result():
    figures = [_figure("triton", 10.0, rows=8192, gbps=50.0, vs_contiguous=0.9,
                       launch_config="builtin"),
               _figure("triton", 10.0, rows=16384, gbps=5.0, vs_contiguous=0.1,
                       launch_config="builtin", trusted=False)]
    targets = {t["target"].split(",")[0]: t for t in bm.evaluate_targets(
        {"transfers": figures, "resolve": []})}
    assert targets["gather GB/s"]["worst"] == 50.0 and targets["gather GB/s"]["cases"] == 1


def test_time_units_scale():
    assert [format_duration_us(x) for x in (7.4, 999.9, 1_520.0, 2_310_000.0)] == \
        ["7.4 us", "999.9 us", "1.52 ms", "2.31 s"]


class _NoisyOps:
    """``ops`` whose copies take 3 ms longer every other call: their timed calls disagree."""

    def __init__(self, real):
        self.real = real
        self.calls = 0

    def copy_rows(self, *args, **kwargs):
        self.calls += 1
        if self.calls % 2:
            time.sleep(0.003)
        return self.real.copy_rows(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.real, name)


def test_a_noisy_run_says_it_is_noisy(monkeypatch, capsys, tmp_path):
    """A machine busy with other work, stood in for: every other call of the torch copies
    takes 3 ms more (their spread), and the CPU-speed probe runs 50x slower after its calibration
    (a CPU shared with other work)."""
    from hisparse_triton import ops
    from hisparse_triton.benchmarks import transfers

    noisy = _NoisyOps(ops)
    monkeypatch.setattr(transfers, "_ops", lambda: noisy)
    calibrated = []
    real_calibrate = noise.CpuProbe.calibrate

    def calibrate(self, samples=5):
        real_calibrate(self, samples)
        calibrated.append(self)
        fast = self._add

        def busy(*args, **kwargs):   # 50 x the idle time: the CPU is shared
            start = time.perf_counter()
            fast(*args, **kwargs)
            spent = time.perf_counter() - start
            time.sleep(49 * spent)
        self._add = busy

    monkeypatch.setattr(noise.CpuProbe, "calibrate", calibrate)
    path = tmp_path / "r.json"
    rc = main(["bench", "--rows", "64", "--row-bytes", "32", "--layers", "1", "--ops",
               "gather", "--methods", "torch,eager", "--top-k", "16", "--warmup-ms", "1",
               "--rep-ms", "30", "--device", "cpu", "--no-progress", "--json", str(path)])
    out = capsys.readouterr().out
    assert rc == 0 and calibrated
    result = json.loads(path.read_text())
    torch_fig = next(f for f in result["transfers"] if f["method"] == "torch")
    eager = next(f for f in result["transfers"] if f["method"] == "eager")
    assert torch_fig["trusted"] is False and eager["trusted"] is False
    assert any(r.startswith("spread +-") for r in torch_fig["untrusted"])
    assert any("of its idle speed" in r for r in eager["untrusted"])
    assert result["noise"]["untrusted_figures"] == 2
    lines = out.splitlines()
    for method in ("torch", "eager"):
        row = next(line for line in lines if line.startswith("gather") and f" {method} " in
                   line)
        assert "NOT A RESULT" in row and row.split()[6] == "-", row
    assert "NOT RESULTS: 2 of 2 figures" in out


def test_the_no_gpu_note_is_printed_once(capsys):
    if torch.cuda.is_available():
        pytest.skip("checks the run without CUDA")
    assert main(["bench", "--rows", "64", "--row-bytes", "32", "--layers", "1", "--ops",
                 "gather", "--top-k", "16", "--warmup-ms", "0.5", "--rep-ms", "1",
                 "--device", "cpu", "--no-progress"]) == 0
    captured = capsys.readouterr()
    assert (captured.out + captured.err).count("kernel timings need a GPU") == 1


def test_the_plot_says_what_was_and_was_not_timed():
    figs = [_figure("torch", 100.0), _figure("eager", 100.0, miss_ratio=None)]
    result = {"settings": {"methods": ["triton", "torch", "eager", "contiguous"],
                           "graph": True}, "kernel_timings": False}
    assert plot.what_was_timed(result, figs) == (
        "timed: torch, eager; NOT timed: triton, triton_graph, contiguous (no GPU: kernel "
        "timings need CUDA)")
    assert [plot.count_label(v) for v in (512, 4096, 262144, 1 << 20)] == \
        ["512", "4k", "256k", "1M"]
    assert plot.plain_label(0.5) == "0.5" and plot.plain_label(20.0) == "20"


@pytest.mark.skipif(not bm.plot_available(), reason="--plot needs matplotlib")
def test_the_plot_draws_untrusted_figures(tmp_path):
    figs = [_figure("torch", 100.0, trusted=True),
            _figure("eager", 100.0, miss_ratio=None, trusted=False)]
    result = {"transfers": figs, "environment": {"cpu": "x86_64"}, "kernel_timings": False,
              "settings": {"methods": ["torch", "eager"], "graph": True}}
    plot.write_plot(result, str(tmp_path / "p.png"))
    assert (tmp_path / "p.png").read_bytes().startswith(b"\x89PNG")


def test_a_real_probe_measures_this_cpu():
    probe = noise.CpuProbe(calls=4)
    probe.calibrate(2)
    assert 0 < probe.idle_us <= probe.slowest_us
    summary = probe.summary()
    assert summary["idle_us"] == pytest.approx(probe.idle_us, rel=1e-3)
    load = noise.machine_load()
    assert load["cpus"] >= 1


def test_the_sweep_records_the_probe_of_every_figure(capsys):
    buf = io.StringIO()
    with contextlib.redirect_stderr(buf):
        assert main(["bench", "--rows", "64", "--row-bytes", "32", "--layers", "1", "--ops",
                     "gather", "--methods", "torch,eager", "--top-k", "16", "--warmup-ms",
                     "0.5", "--rep-ms", "1", "--device", "cpu", "--no-progress",
                     "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    for f in result["transfers"]:
        assert f["probe_us"] > 0 and 0 < f["cpu_speed"] <= 1 and isinstance(f["trusted"], bool)
    assert result["noise"]["probe"]["idle_us"] > 0
    assert set(result["noise"]) >= {"spread_limit_pct", "cpu_speed_limit", "load_start",
                                    "load_end", "untrusted_figures"}
