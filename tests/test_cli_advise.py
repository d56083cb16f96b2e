"""``hisparse-triton advise``: the sweep, its numbers and the recommendation."""

from __future__ import annotations

import json
import math

import pytest

from hisparse_triton import advisor
from hisparse_triton.benchmarks import plot_available
from hisparse_triton.cli import main

SMALL = ["advise", "--preset", "tiny", "--gpu-memory-gib", "0.01", "--host-pool-gib", "0.01",
         "--buffers", "32,64,128", "--block-sizes", "8,16", "--steps", "24", "--streams", "2"]


def run_json(capsys, *flags):
    rc = main([*SMALL, *flags, "--json", "-"])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    return json.loads(captured.out), captured.err


def test_sweep_numbers_and_recommendation(capsys):
    p, table = run_json(capsys, "--link-gbps", "0.002", "--step-ms", "1")
    assert p["schema"] == "hisparse-triton/advise" and p["schema_version"] == 1
    assert p["preset"] == "tiny" and p["context_len"] == 512 and p["top_k"] == 32
    rows = p["settings"]
    assert [(r["block_size"], r["device_buffer_size"]) for r in rows] == [
        (8, 32), (8, 64), (8, 128), (16, 32), (16, 64), (16, 128)]
    for r in rows:
        assert 0 < r["miss_rate"] < 1 and r["hit_rate"] == pytest.approx(1 - r["miss_rate"])
        assert r["rows_per_step"] == pytest.approx(r["miss_rate"] * 32 * 4)   # 4 index groups
        assert r["bytes_per_step"] == pytest.approx(r["miss_rate"] * 32 * 8 * 64)  # 8 layers
        assert r["batch"] == math.floor(r["concurrency"])
        link_s = r["batch"] * r["bytes_per_step"] / 0.002e9
        assert r["link_ms_per_step"] == pytest.approx(link_s * 1e3)
        assert r["tokens_per_s"] == pytest.approx(r["batch"] / (1e-3 + link_s))
    for block in (8, 16):  # a bigger buffer misses less and costs more GPU memory
        mine = [r for r in rows if r["block_size"] == block]
        assert mine[0]["miss_rate"] > mine[1]["miss_rate"] > mine[2]["miss_rate"]
        assert mine[0]["gpu_bytes_per_request"] < mine[2]["gpu_bytes_per_request"]
    best = max(rows, key=lambda r: r["tokens_per_s"])
    rec = p["recommended"]
    assert rec["tokens_per_s"] >= best["tokens_per_s"] * (1 - advisor.RECOMMEND_TOLERANCE)
    assert "tokens/s = batch / (step_s" in p["formula"]
    assert "recommended: block_size" in table and "formula:" in table and " <-" in table


def test_link_time_decides_at_a_slow_link(capsys):
    """At a very slow link the gathers dominate: the biggest buffer (fewest misses) wins."""
    p, _ = run_json(capsys, "--link-gbps", "0.001", "--step-ms", "0.001", "--max-batch", "8")
    assert p["recommended"]["device_buffer_size"] == 128
    assert all(r["batch"] <= 8 for r in p["settings"])


def test_link_speed_from_a_bench_result(tmp_path, capsys):
    bench = {"schema": "hisparse-triton/bench", "device": "cuda:0",
             "environment": {"gpu": "NVIDIA Test"},
             "transfers": [
                 {"op": "gather", "method": "triton", "row_bytes": 64, "rows": 16,
                  "gbps": 2.0, "verified": True},
                 {"op": "gather", "method": "triton", "row_bytes": 64, "rows": 100000,
                  "gbps": 40.0, "verified": True},
                 {"op": "gather", "method": "triton", "row_bytes": 64, "rows": 16,
                  "gbps": 99.0, "verified": False},   # wrong bytes: never used
                 {"op": "backup", "method": "triton", "row_bytes": 64, "rows": 16,
                  "gbps": 80.0}]}
    path = tmp_path / "b.json"
    path.write_text(json.dumps(bench))
    p, _ = run_json(capsys, "--bench-json", str(tmp_path))  # a directory: its newest .json
    assert "bench gather figures (triton, 64 B rows" in p["link_source"]
    assert "NVIDIA Test" in p["link_source"]
    # each setting gathers a few hundred rows per launch: the 16-row figure is nearer
    assert {r["link_gbps"] for r in p["settings"]} == {2.0}


def test_recorded_trace_and_plot(tmp_path, capsys):
    from hisparse_triton.trace import sample_trace_path

    flags = ["--trace", sample_trace_path(), "--context-len", "106"]
    if plot_available():
        flags += ["--plot", str(tmp_path / "a.png")]
    rc = main(["advise", "--preset", "tiny", "--buffers", "32,64", "--block-sizes", "16",
               *flags, "--json", "-"])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    p = json.loads(captured.out)
    assert p["trace"].startswith("recorded trace") and len(p["settings"]) == 2
    if plot_available():
        assert (tmp_path / "a.png").read_bytes().startswith(b"\x89PNG")


@pytest.mark.parametrize("flags, code, message", [
    (["--buffers", "16"], 1, "--buffers 16 is smaller than top-k 32"),
    (["--context-len", "30"], 1, "not longer than top-k"),
    (["--context-len", "5000"], 1, "exceeds the tiny preset's max context"),
    (["--link-gbps", "1", "--bench-json", "x.json"], 1, "not both"),
    (["--bench-json", "/nonexistent"], 1, "no such file or directory"),
    (["--buffers", "40000"], 2, "argument --buffers: must be an integer in [1, 32768]"),
    (["--gpu-memory-gib", "1e12"], 2, "argument --gpu-memory-gib: must be a number in"),
])
def test_bad_flags(capsys, flags, code, message):
    assert main(["advise", "--preset", "tiny", *flags]) == code
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1


def test_a_setting_that_does_not_fit_is_listed(capsys):
    rc = main(["advise", "--preset", "deepseek-v3.2-fp8", "--host-pool-gib", "0.01",
               "--buffers", "2048", "--block-sizes", "64", "--steps", "4", "--streams", "1",
               "--json", "-"])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    p, table = json.loads(captured.out), captured.err
    assert all("error" in r for r in p["settings"]) and p["recommended"] is None
    assert "does not fit" in table and "recommended: none" in table
