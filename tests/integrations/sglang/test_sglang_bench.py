"""``hisparse_triton.benchmarks.sglang_swap_in`` (the GPU check's SGLang section) on a CPU:
the arguments it builds are SGLang's layout with the asked miss ratio, the CPU run writes its
report, and the GPU check's summary reads such a report."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import torch

from hisparse_triton.benchmarks import sglang_swap_in as bench

ROOT = Path(__file__).resolve().parents[3]


def test_arguments_plan_the_asked_misses():
    args, kwargs = bench.swap_in_args(3, 16, 32, row_bytes=656, seq_len=200, miss_ratio=0.25,
                                      device="cpu")
    top_k, held, lru = args[0], args[1], args[9]
    assert top_k.shape == (3, 16) and held.shape == (4, 32 + 64) and lru.shape == (4, 32)
    for b in range(3):
        slots = set(held[b + 1, :32].tolist())
        assert len(slots) == 32 and sum(t in slots for t in top_k[b].tolist()) == 12
    from hisparse_triton.integrations import sglang_reference

    sglang_reference.load_cache_to_device_buffer_mla(*args, **kwargs)
    assert kwargs["miss_count"].tolist() == [4, 4, 4]
    assert torch.equal(args[0], top_k)


def test_cpu_run_writes_its_report(tmp_path):
    path = tmp_path / "sglang.json"
    assert bench.main(["--device", "cpu", "--json", str(path), "--miss-ratios", "0.5,1"]) == 0
    report = json.loads(path.read_text())
    assert report["schema"] == bench.SCHEMA
    assert [r["miss_ratio"] for r in report["runs"]] == [0.5, 1.0]
    assert [r["misses_per_request"] for r in report["runs"]] == [32.0, 64.0]
    assert all("no CUDA device" in r["skipped"] for r in report["runs"])


def test_gpu_check_summarises_the_section(monkeypatch):
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "bench" / "gpu_check.py")
    gpu_check = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "gpu_check", gpu_check)
    spec.loader.exec_module(gpu_check)
    run = {"miss_ratio": 0.134, "times": {"ours_swap_in_us": 30.1, "ours_resolve_only_us": 9.0,
                                          "ours_replay_us": 12.0},
           "graph": {"exact": True, "replay_us": 25.0},
           "sglang": {"exact": {"lru_slots": True}, "sglang_swap_in_us": 40.0,
                      "sglang_resolve_only_us": 11.0, "sglang_replay_us": 14.0}}
    skipped = {"miss_ratio": 1.0, "times": {}, "graph": {},
               "sglang": {"skipped": "sglang.kernels.ops.kvcache.hisparse does not import"}}
    report = {"steps": {"sglang-swap-in": {"result": {"runs": [run, skipped]}}}}
    lines = gpu_check.sglang_lines(report)
    assert "ours 30.1 us" in lines[0] and "SGLang 40.0 us" in lines[0]
    assert lines[0].endswith("bit-exact")
    assert "SGLang skipped (sglang.kernels" in lines[1]
    assert "sglang-swap-in" in [s.name for s in gpu_check.STEPS]
