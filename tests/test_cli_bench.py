"""``hisparse-triton bench`` on CPU (torch paths only) and the measurement library's workloads."""

from __future__ import annotations

import contextlib
import io
import json
import sys

import pytest
import torch

from hisparse_triton import benchmarks as bm
from hisparse_triton.cli import main

TINY = ["bench", "--rows", "128,256", "--row-bytes", "16,132", "--layers", "1,2",
        "--batch", "1,2", "--top-k", "64", "--hot-slots", "128", "--seq-len", "1024",
        "--miss-ratios", "1,0.5", "--warmup-ms", "0.5", "--rep-ms", "1", "--device", "cpu",
        "--no-progress"]


def _has_matplotlib() -> bool:
    return bm.plot_available()


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """One tiny CPU sweep through the CLI, with --json (and --plot when matplotlib, the
    ``bench`` extra, is installed)."""
    out = tmp_path_factory.mktemp("bench")
    flags = ["--json", str(out / "r.json")]
    if _has_matplotlib():
        flags += ["--plot", str(out / "r.png")]
    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        rc = main(TINY + flags)
    return rc, stdout.getvalue(), stderr.getvalue(), out


@pytest.mark.skipif(not _has_matplotlib(), reason="--plot needs matplotlib (the bench extra)")
def test_tiny_sweep_writes_a_png(tiny_run):
    rc, _, stderr, out = tiny_run
    assert rc == 0, stderr
    png = (out / "r.png").read_bytes()
    assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 5000


def test_tiny_sweep_writes_json_and_table(tiny_run):
    rc, stdout, stderr, out = tiny_run
    assert rc == 0, stderr
    result = json.loads((out / "r.json").read_text())
    assert result["schema"] == bm.SCHEMA and result["schema_version"] == bm.VERSION
    assert result["device"] == "cpu" and result["kernel_timings"] is False
    assert any("kernel timings need a GPU" in n for n in result["notes"])
    assert "kernel timings need a GPU" in stdout  # the table says it too
    env = result["environment"]
    assert env["torch"] == torch.__version__ and env["triton"]
    # The environment names the machine's GPU even when the sweep ran on the CPU.
    assert env["gpu"] == (torch.cuda.get_device_name() if torch.cuda.is_available() else None)

    transfers = result["transfers"]
    ops = {f["op"] for f in transfers}
    assert ops == {"gather", "backup", "restore", "spill"}
    assert {f["method"] for f in transfers} == {"torch", "eager", "contiguous"}
    for f in transfers:
        assert f["time_us"] > 0 and f["gbps"] > 0, f
        assert f["vs_eager"] > 0 and f["vs_contiguous"] > 0, f
        assert f["bytes"] == f["rows"] * f["layers"] * f["row_bytes"]
        if f["method"] == "eager":
            assert f["vs_eager"] == 1.0
        if f["method"] == "contiguous":
            assert f["vs_contiguous"] == 1.0
        if f["method"] in ("torch", "eager"):
            assert f["verified"] is True, f
    # Kernel methods at every miss ratio; baselines once per (op, size).
    gather_torch = [f for f in transfers if f["op"] == "gather" and f["method"] == "torch"]
    assert len(gather_torch) == 2 * 2 * 2 * 2  # rows x row_bytes x layers x miss ratios
    assert {f["miss_ratio"] for f in gather_torch} == {1.0, 0.5}
    half = next(f for f in gather_torch if f["miss_ratio"] == 0.5 and f["rows"] == 256)
    assert half["plan"] == [8, 64]  # 256 rows as rows of 32 valid columns of 64
    eager = [f for f in transfers if f["method"] == "eager" and f["op"] == "gather"]
    assert len(eager) == 2 * 2 * 2 and all(f["miss_ratio"] is None for f in eager)
    restore = [f for f in transfers if f["op"] == "restore" and f["method"] == "torch"]
    assert {f["pages"] for f in restore} == {2, 4}

    res = result["resolve"]
    assert {(f["batch"], f["method"]) for f in res} == {(1, "torch"), (2, "torch")}
    for f in res:
        assert f["time_us"] > 0 and f["p20_us"] <= f["time_us"] <= f["p80_us"]
        assert (f["top_k"], f["hot_slots"]) == (64, 128) and f["verified"] is True
        # The workload prescribes the step's miss ratio exactly (32 of 64 columns miss).
        assert f["measured_miss_ratio"] == f["miss_ratio"]

    assert all(t["status"] == "not measured" for t in result["targets"])


def test_json_to_stdout_is_pure_json(capsys):
    rc = main(["bench", "--rows", "64", "--row-bytes", "32", "--layers", "1", "--ops", "gather",
               "--methods", "torch,eager", "--top-k", "16", "--warmup-ms", "0.5",
               "--rep-ms", "1", "--device", "cpu", "--no-progress", "--json", "-"])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    result = json.loads(captured.out)
    assert [f["method"] for f in result["transfers"]] == ["torch", "eager"]
    assert "vs_contiguous" not in result["transfers"][0]  # no contiguous baseline measured
    assert "Transfers" in captured.err  # the table went to stderr


def test_plot_without_matplotlib_is_one_clear_line(monkeypatch, capsys, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import raises ImportError
    rc = main(["bench", "--quick", "--device", "cpu", "--plot", str(tmp_path / "x.png")])
    err = capsys.readouterr().err.strip()
    assert rc == 1
    assert len(err.splitlines()) == 1 and "matplotlib" in err and "bench" in err
    assert not (tmp_path / "x.png").exists()


@pytest.mark.parametrize("flags, message", [
    (["--rows", "0"], "--rows"),
    (["--rows", "abc"], "--rows"),
    (["--ops", "gather,bogus"], "bogus"),
    (["--miss-ratios", "1.5"], "(0, 1]"),
    # output paths are checked before the sweep (a missing directory used to end a finished
    # sweep in a FileNotFoundError traceback)
    (["--json", "/nonexistent-dir/out.json"], "argument --json: directory"),
    (["--plot", "/nonexistent-dir/out.png"], "argument --plot: directory"),
    (["--json", "/"], "is a directory"),
])
def test_bad_flags_exit_2_with_one_line(flags, message, capsys):
    rc = main(["bench", *flags])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1 and message in err


def test_inconsistent_settings_exit_1(capsys):
    rc = main(["bench", "--device", "cpu", "--top-k", "64", "--hot-slots", "32"])
    err = capsys.readouterr().err.strip()
    assert rc == 1 and "--hot-slots=32" in err and len(err.splitlines()) == 1


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA behaviour")
def test_cuda_or_triton_only_requests_refused_without_gpu(capsys):
    assert main(["bench", "--device", "cuda"]) == 1
    assert "no CUDA device" in capsys.readouterr().err
    assert main(["bench", "--device", "cpu", "--methods", "triton"]) == 1
    assert "needs a CUDA device" in capsys.readouterr().err


def _tiny_settings(**kw):
    base = dict(row_bytes=(48,), rows=(128,), layers=(2,), miss_ratios=(1.0,), top_k=32,
                batch=(1,), hot_slots=64, seq_len=512, ops=("gather", "backup"),
                methods=("torch", "eager"), warmup_ms=0.2, rep_ms=0.5, rotate_bytes=1 << 16)
    base.update(kw)
    return bm.BenchSettings(**base)


@pytest.mark.parametrize("sampled", [False, True])
def test_a_wrong_copy_is_reported_not_timed_as_good(monkeypatch, sampled):
    from hisparse_triton import ops
    from hisparse_triton.benchmarks import transfers

    if sampled:  # large plans are checked on a sample of their rows
        monkeypatch.setattr(transfers, "VERIFY_BYTES", 48 * 16)
    monkeypatch.setattr(ops, "copy_rows", lambda *a, **k: None)  # moves nothing
    result = bm.run_bench(_tiny_settings(), torch.device("cpu"))
    bad = [f for f in result["transfers"] if f["method"] == "torch"]
    assert bad and all(f["verified"] is False for f in bad)
    assert all("differ" in f["error"] for f in bad)
    assert all(f.get("verified") is True for f in result["transfers"] if f["method"] == "eager")


def test_a_failing_method_is_recorded_and_the_cli_fails(monkeypatch, capsys):
    from hisparse_triton import ops

    def boom(*args, **kwargs):
        raise RuntimeError("kaput")

    monkeypatch.setattr(ops, "copy_pages", boom)
    rc = main(["bench", "--rows", "128", "--row-bytes", "32", "--layers", "1", "--ops",
               "restore,gather", "--methods", "torch,eager", "--top-k", "16", "--device",
               "cpu", "--warmup-ms", "0.5", "--rep-ms", "1", "--no-progress", "--json", "-"])
    captured = capsys.readouterr()
    assert rc == 1 and "kaput" in captured.err
    result = json.loads(captured.out)
    failed = [f for f in result["transfers"] if f.get("error")]
    assert [(f["op"], f["method"]) for f in failed] == [("restore", "torch")]
    assert any(f["op"] == "gather" and f["gbps"] for f in result["transfers"])


def test_flat_row_indices_address_the_row_table_rows():
    pools = bm.make_pools(row_bytes=24, layers=3, num_rows=200, device=torch.device("cpu"))
    assert pools.num_rows == 256  # rounded up to whole blocks
    rows = torch.tensor([[0, 63, 64, 130, 255]])
    h = bm.host_flat_rows(rows, 3, pools.num_rows)[0]
    d = bm.device_flat_rows(rows, 3)[0]
    pools.device.pool.copy_(torch.randint(0, 256, pools.device.pool.shape, dtype=torch.uint8))
    for layer in range(3):
        host_view = pools.host.row_view(layer).reshape(-1, 24)
        dev_view = pools.device.row_view(layer).reshape(-1, 24)
        for j, r in enumerate(rows[0].tolist()):
            assert torch.equal(pools.host_flat[h[layer * 5 + j]], host_view[r])
            assert torch.equal(pools.device_flat[d[layer * 5 + j]], dev_view[r])


def test_row_plans_are_distinct_and_shaped_like_decode():
    num, width, counts = bm.plan_geometry(1000, 256, 0.3)
    assert width == 256 and sum(counts) == 1000 and max(counts) == round(0.3 * 256)
    assert num == len(counts) == -(-1000 // 77)
    plans = bm.make_row_plans(1000, 256, 0.3, 5000, 4000, torch.device("cpu"), variants=3,
                              seed=1)
    assert plans.src.shape == (3, num, 256) and plans.counts.shape == (3, num)
    for v in range(3):
        valid = torch.arange(256)[None, :] < plans.counts[v][:, None]
        assert torch.equal(plans.src[v][valid].long(), plans.src_valid[v])
        assert torch.equal(plans.dst[v][valid].long(), plans.dst_valid[v])
        assert (plans.src[v][~valid] == -1).all()
    assert plans.src_valid.unique().numel() == 3000  # disjoint across the rotation
    assert plans.dst_valid.unique().numel() == 3000


def test_evaluate_targets():
    def gather(gbps, contig, eager, rows=8192, **kw):
        return {"op": "gather", "method": "triton", "row_bytes": 656, "rows": rows,
                "gbps": gbps, "vs_contiguous": contig, "vs_eager": eager,
                "launch_config": "builtin", **kw}

    def resolve(method, us, vs_torch):
        return {"method": method, "batch": 64, "top_k": 2048, "hot_slots": 4096,
                "time_us": us, "vs_torch": vs_torch, "verified": True}

    result = {
        "transfers": [gather(50.0, 0.9, 12.0), gather(46.0, 0.85, 11.0),
                      gather(5.0, 0.1, 1.0, rows=512),  # below 4k rows: not a target case
                      gather(1.0, 0.01, 0.1, verified=False),  # wrong bytes: never counted
                      gather(47.0, 0.86, 11.5, launch_config="tuned"),
                      gather(49.0, 0.88, 11.9, method="triton_graph"),
                      {"op": "backup", "method": "triton", "row_bytes": 656, "rows": 4096,
                       "gbps": 30.0, "vs_contiguous": 0.6, "vs_eager": 9.0}],
        "resolve": [resolve("triton", 40.0, 10.0), resolve("triton_graph", 12.0, 33.0)],
    }
    targets = {t["target"].split(",")[0]: t for t in bm.evaluate_targets(result)}
    gather_t = targets["gather GB/s"]
    assert gather_t["status"] == "met" and gather_t["worst"] == 46.0 and gather_t["cases"] == 2
    assert gather_t["tuned_worst"] == 47.0 and gather_t["graph_worst"] == 49.0
    assert targets["backup GB/s"]["status"] == "missed"
    assert targets["backup GB/s"]["ratio"] == pytest.approx(30 / 45, rel=1e-3)
    latency = targets["resolve latency"]
    assert latency["status"] == "met" and latency["basis"] == "CUDA graph replay"
    assert latency["ratio"] == pytest.approx(15 / 12, rel=1e-3)
    assert latency["eager_worst"] == 40.0
    assert targets["gather and backup vs torch eager"]["status"] == "missed"  # backup 9x
    lines = bm.target_lines(bm.evaluate_targets(result))
    assert any("MISSED" in line and "backup" in line for line in lines)
    # Without a graph figure, resolve latency falls back to the eager launches.
    result["resolve"] = [resolve("triton", 14.0, 10.0)]
    latency = {t["target"].split(",")[0]: t for t in bm.evaluate_targets(result)}[
        "resolve latency"]
    assert latency["basis"] == "eager launches" and latency["status"] == "met"
    empty = bm.evaluate_targets({"transfers": [], "resolve": []})
    assert {t["status"] for t in empty} == {"not measured"}


def test_quick_cpu_defaults_are_small():
    s = bm.BenchSettings.for_device(torch.device("cpu"), quick=True)
    s.validate()
    assert bm.count_steps(s, torch.device("cpu")) <= 16
    full = bm.BenchSettings.for_device(torch.device("cpu"))
    assert "triton" in full.methods  # skipped on CPU, but listed
    assert bm.count_steps(full, torch.device("cpu")) < bm.count_steps(
        bm.override(full, layers=(1, 4)), torch.device("cpu"))


def _gpu_check_module():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "bench" / "gpu_check.py"
    spec = importlib.util.spec_from_file_location("gpu_check", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("gpu_check", module)  # dataclasses look their module up
    spec.loader.exec_module(sys.modules["gpu_check"])
    return sys.modules["gpu_check"]


def test_gpu_check_dry_run_writes_one_json(tmp_path, capsys):
    """``bench/gpu_check.py --dry-run``: the GPU-check flow on the CPU, reduced (bench and
    tune in subprocesses; the pytest step is covered by the summary parser test)."""
    gpu_check = _gpu_check_module()
    out = tmp_path / "out"
    rc = gpu_check.main(["--dry-run", "--out", str(out), "--skip", "tests"])
    printed = capsys.readouterr().out
    assert rc == 0, printed
    (result_file,) = out.glob("*.json")  # <gpu or cpu>-<date>.json, the pieces folded in
    report = json.loads(result_file.read_text())
    assert report["schema"] == "hisparse-triton/gpu-check" and report["dry_run"] is True
    env = report["environment"]
    for key in ("gpu", "driver", "torch", "triton", "python"):
        assert key in env
    steps = report["steps"]
    assert set(steps) == {"decode-checks", "bench-targets", "tune"}
    assert all(s["rc"] == 0 and not s["timed_out"] for s in steps.values())
    sections = steps["decode-checks"]["result"]["sections"]
    assert "overlap_step" in sections and "skipped" in sections["split_gather"]
    assert not any("error" in v for v in sections.values())
    assert "device_info" in report
    bench = report["bench"]
    assert bench["schema"] == bm.SCHEMA and bench["transfers"] and bench["resolve"]
    assert {f["step"] for f in bench["transfers"]} == {"bench-targets"}
    assert steps["tune"]["result"]["dry_run"] is True
    assert {t["status"] for t in report["targets"]} == {"not measured"}
    assert (out / "logs.txt").exists() and not (out / "bench-targets.json").exists()
    assert (out / "bench.png").exists() == _has_matplotlib()
    assert "bench-targets" in printed and "performance targets" in printed
    assert len(list(out.iterdir())) <= 8  # the device tool returns at most 8 files


def test_gpu_check_plan_fits_the_budget():
    gpu_check = _gpu_check_module()
    import argparse

    full = gpu_check.plan(argparse.Namespace(only=None, skip="", dry_run=False, quick=False))
    names = [s.name for s in full]
    assert names[:6] == ["decode-checks", "decode-step", "bench-targets", "tests",
                         "bench-resolve", "tune"]
    # Install, the first four steps and their SIGINT grace fit the default budget (330 s) and
    # leave room under the device tool's 600 s per command.
    assert sum(s.limit_s for s in full[:4]) + 60 <= 600
    quick = gpu_check.plan(argparse.Namespace(only=None, skip="", dry_run=False, quick=True))
    assert sum(s.quick_limit_s for s in quick) <= 240
    only = gpu_check.plan(argparse.Namespace(only="tests,tune", skip="tune", dry_run=False,
                                             quick=False))
    assert [s.name for s in only] == ["tests"]


class _Clock:
    """A fake ``time`` for gpu_check: every step runs to its time limit."""

    def __init__(self):
        self.now = 1000.0

    def time(self):
        return self.now


@pytest.mark.parametrize("quick", [False, True])
def test_gpu_check_worst_case_timeline(tmp_path, monkeypatch, quick):
    """Every step running into its limit (plus the SIGINT grace): the steps start in priority
    order, none starts past the budget, and the whole run ends inside one 600 s device call
    with room to spare."""
    import importlib

    gpu_check = _gpu_check_module()
    env_module = importlib.import_module("hisparse_triton.benchmarks.environment")
    clock = _Clock()
    calls = []

    def fake_run(cmd, log, timeout, env=None):
        calls.append((cmd, timeout, env or {}))
        clock.now += timeout + gpu_check.GRACE_S
        if "--cache" in cmd:  # tune wrote a cache
            (tmp_path / "tuning-cache.json").write_text("{}")
        return {"cmd": cmd, "rc": None, "timed_out": True, "wall_s": timeout, "tail": ""}

    monkeypatch.setattr(gpu_check, "time", clock)
    monkeypatch.setattr(gpu_check, "_run", fake_run)
    monkeypatch.setattr(gpu_check, "ensure_installed", lambda log: {"rc": 0})
    monkeypatch.setattr(env_module, "environment",
                        lambda: {"cuda_available": True, "gpu": "NVIDIA Test"})
    rc = gpu_check.main(["--out", str(tmp_path)] + (["--quick"] if quick else []))
    assert rc == 1  # every step timed out
    report = json.loads((tmp_path / f"nvidia-test-{report_date()}.json").read_text())
    ran = [name for name, s in report["steps"].items() if not s.get("skipped")]
    expected = ["decode-checks", "decode-step", "bench-targets", "tests"]
    assert ran[:4] == expected  # even when every step runs into its limit
    budget = 240 if quick else 330
    assert clock.now - 1000.0 <= budget + gpu_check.GRACE_S  # ends inside the budget
    assert all(timeout >= gpu_check.MIN_STEP_S for _, timeout, _ in calls)
    tuned = [env for cmd, _, env in calls if "bench" in cmd and env]
    assert all("HISPARSE_TRITON_TUNING_CACHE" in env for env in tuned)
    tests = next(cmd for cmd, _, _ in calls if "pytest" in cmd)
    assert ("tests" in tests) != quick and "--durations=15" in tests


def report_date():
    from datetime import date

    return date.today().isoformat()


def test_gpu_check_pytest_summary_and_merge():
    gpu_check = _gpu_check_module()
    text = ("....\nFAILED tests/test_x.py::test_a - boom\n"
            "=== 1 failed, 40 passed, 3 skipped, 2 warnings in 12.3s ===\n")
    assert gpu_check.pytest_summary(text) == {"failed": 1, "passed": 40, "skipped": 3,
                                              "warning": 2,
                                              "failed_tests": ["tests/test_x.py::test_a"]}
    assert gpu_check.pytest_summary("no summary") == {}
    a = {"transfers": [{"op": "gather", "method": "triton", "row_bytes": 656, "rows": 8192,
                        "gbps": 50.0, "vs_contiguous": 0.9, "vs_eager": 20.0},
                       {"op": "gather", "method": "eager", "row_bytes": 656, "rows": 8192,
                        "gbps": 2.5}],
         "resolve": [], "settings": {"x": 1}, "wall_s": 2}
    tuned = {"transfers": [{"op": "gather", "method": "triton", "row_bytes": 656,
                            "rows": 8192, "layers": None, "gbps": 55.0,
                            "launch_config": "tuned"}], "resolve": [], "wall_s": 1}
    b = {"transfers": [], "resolve": [{"method": "triton", "batch": 64, "top_k": 2048,
                                       "hot_slots": 4096, "time_us": 20.0}], "wall_s": 3}
    merged = gpu_check.merge_bench([("a", a), ("x", None), ("tuned", tuned), ("b", b)])
    assert len(merged["transfers"]) == 3 and len(merged["resolve"]) == 1
    assert merged["steps"] == {"a": {"x": 1}, "tuned": None, "b": None}
    filled = merged["transfers"][2]
    assert filled["vs_eager"] == 22.0 and filled["vs_eager_from"] == "a"
    targets = {t["target"].split(",")[0]: t for t in merged["targets"]}
    assert targets["gather GB/s"]["status"] == "met"
    assert targets["gather GB/s"]["tuned_worst"] == 55.0
    assert targets["resolve latency"]["status"] == "missed"
    assert gpu_check.merge_bench([("x", None)]) is None
    lines = gpu_check.summary_lines({"environment": {"gpu": "G"}, "steps": {
        "tests": {"rc": 0, "wall_s": 3.0, "summary": {"passed": 4}}}, "bench": merged,
        "targets": merged["targets"], "wall_s": 9, "budget_s": 380})
    assert lines[0].startswith("gpu_check on G") and "4 passed" in lines[1]
    assert any("resolve latency" in line and "MISSED" in line for line in lines)


def test_out_of_memory_is_one_line(monkeypatch, capsys):
    # `bench --rows 100000000000` used to end in the allocator's RuntimeError traceback
    def oom(*args, **kwargs):
        raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to "
                           "allocate 65600000000000 bytes.")

    monkeypatch.setattr(bm, "run_bench", oom)
    rc = main(["bench", "--rows", "64", "--ops", "gather", "--methods", "torch",
               "--device", "cpu", "--no-progress"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 1 and len(err) == 1 and "Traceback" not in err[0]
    assert err[0].startswith("hisparse-triton bench: error: out of memory for this sweep")
    assert "--rows" in err[0]

    def bug(*args, **kwargs):  # any other RuntimeError is a bug: not disguised as OOM
        raise RuntimeError("something else")

    monkeypatch.setattr(bm, "run_bench", bug)
    with pytest.raises(RuntimeError, match="something else"):
        main(["bench", "--rows", "64", "--ops", "gather", "--methods", "torch",
              "--device", "cpu", "--no-progress"])


def test_interrupted_sweep_keeps_its_figures(monkeypatch, capsys):
    def stop(self, batch, ratio):
        raise KeyboardInterrupt

    monkeypatch.setattr(bm.ResolveBench, "case", stop)
    rc = main(["bench", "--rows", "64", "--row-bytes", "32", "--layers", "1", "--ops",
               "gather,resolve", "--methods", "torch,eager", "--top-k", "16", "--device", "cpu",
               "--warmup-ms", "0.5", "--rep-ms", "1", "--no-progress", "--json", "-"])
    captured = capsys.readouterr()
    assert rc == 130 and "interrupted" in captured.err
    result = json.loads(captured.out)
    assert result["interrupted"] is True and result["resolve"] == []
    assert len(result["transfers"]) == 2  # gather torch + eager, measured before the stop


@pytest.mark.parametrize("op", ["gather", "backup", "restore", "spill"])
def test_triton_method_plumbing(op, kernel_device):
    """The bench's pools, plans and checks drive the real kernels (interpreter on CPU, CUDA on
    a GPU, where the CUDA-graph replay of the rotation is measured and checked too)."""
    import os

    if kernel_device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs TRITON_INTERPRET=1 (set by conftest without CUDA)")
    settings = _tiny_settings(row_bytes=(16,), rows=(128,), top_k=32, rotate_bytes=1 << 12,
                              ops=(op,), methods=("triton",), rep_ms=0.1, warmup_ms=0.1)
    bench = bm.TransferBench(settings, kernel_device)
    bench.methods = ["triton"]  # the sweep leaves the interpreter out on CPU; test it anyway
    figures: list = []
    bench.group(16, 2, figures)
    methods = {"triton", "triton_graph"} if kernel_device.type == "cuda" else {"triton"}
    assert {f.method for f in figures} == methods
    for f in figures:
        assert f.error is None and f.verified is True and f.gbps > 0, f.to_json()
        assert f.extra["launch_config"] == "builtin"


def test_resolve_triton_plumbing(kernel_device):
    """Resolve figures of the Triton kernel (and, on CUDA, its graph replay) are checked bit
    for bit against the reference from the same restored state."""
    import os

    if kernel_device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs TRITON_INTERPRET=1 (set by conftest without CUDA)")
    settings = _tiny_settings(top_k=8, hot_slots=16, seq_len=256, rep_ms=0.1, warmup_ms=0.1,
                              methods=("triton", "torch"), ops=("resolve",))
    bench = bm.ResolveBench(settings, kernel_device)
    bench.methods = ["triton", "torch"]  # the interpreter too on CPU
    figures = bench.case(2, 0.5)
    methods = ["triton", "triton_graph", "torch"] if kernel_device.type == "cuda" \
        else ["triton", "torch"]
    assert [f.method for f in figures] == methods
    for f in figures:
        assert f.error is None and f.verified is True and f.time_us > 0, f.to_json()
        assert f.params["measured_miss_ratio"] == 0.5 and f.vs_torch > 0


def test_a_wrong_resolve_is_reported(monkeypatch):
    from hisparse_triton import ops
    from hisparse_triton.ops.resolve import reference

    def off_by_one(*args, **kwargs):
        kwargs.pop("backend", None)
        out = reference.resolve(*args, **kwargs)
        return out._replace(rows=out.rows + 1)

    monkeypatch.setattr(ops, "resolve", off_by_one)
    settings = _tiny_settings(top_k=8, hot_slots=16, seq_len=256, methods=("torch",),
                              ops=("resolve",))
    (fig,) = bm.ResolveBench(settings, torch.device("cpu")).case(1, 1.0)
    assert fig.verified is False and "differ" in fig.error


@pytest.mark.parametrize("ratio", [1.0, 0.3, 0.067])
def test_resolve_workload_prescribes_the_miss_ratio(ratio):
    from hisparse_triton.ops.resolve import reference

    work = bm.ResolveWorkload(3, 64, 160, 1024, ratio, torch.device("cpu"), seed=2)
    assert (work.slot_host_rows >= 0).all()  # warm: every slot holds a row
    outs = []
    for _ in range(2):  # the same state every call
        work.restore()
        outs.append(reference.resolve(*work.args(), **work.kwargs))
    assert all(torch.equal(a, b) for a, b in zip(*outs))
    hits, misses, masked = outs[0].stats.sum(dim=0).tolist()
    assert masked == 0 and misses == 3 * (64 - round((1 - ratio) * 64))
    assert misses / (3 * 64) == work.expected_miss_ratio


def test_run_bench_checkpoints_after_every_case():
    seen = []
    settings = _tiny_settings(rows=(64, 128), methods=("torch",))
    result = bm.run_bench(settings, torch.device("cpu"), checkpoint=seen.append)
    assert len(seen) == 4  # 2 sizes x gather, backup
    assert all(not r["finished"] for r in seen) and result["finished"] is True
    assert [len(r["transfers"]) for r in seen] == [1, 2, 3, 4]


@pytest.mark.parametrize("preset, layers, row_bytes", [
    ("deepseek-v3.2-fp8", (1, 61), 656),      # one layer per index group; the 61-layer mirror
    ("glm-5-indexshare", (4, 78), 656),       # a leader and 3 followers; the 78-layer mirror
    ("deepseek-v3.2-bf16", (1, 61), 1152),
])
def test_preset_covers_the_model_shapes(preset, layers, row_bytes):
    from hisparse_triton.cli import build_parser
    from hisparse_triton.commands import bench

    args = build_parser().parse_args(["bench", "--preset", preset, "--device", "cpu"])
    settings = bench.settings_from_args(args, torch.device("cpu"))
    assert settings.layers == layers and settings.row_bytes == (row_bytes,)
    assert settings.top_k == 2048 and settings.hot_slots >= 4096
    # explicit flags still win
    args = build_parser().parse_args(["bench", "--preset", preset, "--device", "cpu",
                                      "--layers", "2", "--topk", "64"])
    settings = bench.settings_from_args(args, torch.device("cpu"))
    assert settings.layers == (2,) and settings.top_k == 64 and settings.row_bytes == (row_bytes,)


def test_threads_default_to_one_on_cpu_and_are_recorded(capsys):
    threads = torch.get_num_threads()
    try:
        base = ["bench", "--rows", "64", "--row-bytes", "32", "--layers", "1", "--ops",
                "gather", "--methods", "torch", "--top-k", "16", "--warmup-ms", "0.5",
                "--rep-ms", "1", "--device", "cpu", "--no-progress", "--json"]
        assert main(base) == 0
        captured = capsys.readouterr()
        assert json.loads(captured.out)["torch_threads"] == 1
        assert "1 torch CPU thread" in captured.err
        assert main([*base, "--threads", "100000"]) == 1
        err = capsys.readouterr().err.strip()
        assert "--threads 100000 exceeds the" in err and len(err.splitlines()) == 1
    finally:
        torch.set_num_threads(threads)


def test_a_large_cpu_run_states_its_memory_first(monkeypatch, capsys):
    from hisparse_triton.benchmarks.settings import host_memory_estimate
    from hisparse_triton.commands import bench

    settings = bm.BenchSettings.for_device(torch.device("cpu"))
    est = host_memory_estimate(bm.override(settings, layers=(1, 61), row_bytes=(656,)))
    # the largest pair: 4096 rows x 61 layers x 656 B in each of the two pools
    assert est["pools"] == 2 * 4096 * 61 * 656 and est["staging"] == 3 * 4096 * 61 * 656
    assert 1 << 30 < est["total"] < 2 << 30       # measured: about 1.2 GiB peak RSS
    resolve_only = host_memory_estimate(bm.override(settings, ops=("resolve",)))
    assert resolve_only["pools"] == 0 and resolve_only["total"] < 1 << 30
    flags = ["bench", "--rows", "64", "--row-bytes", "32", "--layers", "1", "--ops", "gather",
             "--methods", "torch", "--top-k", "16", "--warmup-ms", "0.5", "--rep-ms", "1",
             "--device", "cpu", "--no-progress"]
    monkeypatch.setattr(bench, "LARGE_RUN_BYTES", 1)
    assert main(flags) == 0
    assert "bench: this CPU sweep needs about" in capsys.readouterr().err
    assert main(["bench", "--preset", "deepseek-v3.2-fp8", "--rows", "4096",
                 "--row-bytes", "656000", "--device", "cpu", "--no-progress"]) == 1
    err = capsys.readouterr().err.strip()
    assert "more than the" in err and "--layers" in err and len(err.splitlines()) == 1
