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
    p, table = run_json(capsys, "--link-gbps", "1", "--step-ms", "1")
    assert p["schema"] == "hisparse-triton/advise" and p["schema_version"] == 2
    assert p["preset"] == "tiny" and p["context_len"] == 512 and p["top_k"] == 32
    rows = p["settings"]
    assert [(r["block_size"], r["device_buffer_size"]) for r in rows] == [
        (8, 32), (8, 64), (8, 128), (16, 32), (16, 64), (16, 128)]
    for r in rows:
        assert 0 < r["miss_rate"] < 1 and r["hit_rate"] == pytest.approx(1 - r["miss_rate"])
        assert r["rows_per_step"] == pytest.approx(r["miss_rate"] * 32 * 4)   # 4 index groups
        assert r["bytes_per_step"] == pytest.approx(r["miss_rate"] * 32 * 8 * 64)  # 8 layers
        assert r["batch"] == math.floor(r["concurrency"])
        link_s = r["batch"] * r["bytes_per_step"] / 1e9
        assert r["link_ms_per_step"] == pytest.approx(link_s * 1e3)
        assert r["tokens_per_s"] == pytest.approx(r["batch"] / (1e-3 + link_s))
        assert r["step_ms"] == pytest.approx(1 + link_s * 1e3) and r["supported"]
    for block in (8, 16):  # a bigger buffer misses less and costs more GPU memory
        mine = [r for r in rows if r["block_size"] == block]
        assert mine[0]["miss_rate"] > mine[1]["miss_rate"] > mine[2]["miss_rate"]
        assert mine[0]["gpu_bytes_per_request"] < mine[2]["gpu_bytes_per_request"]
    best = max(rows, key=lambda r: r["tokens_per_s"])
    rec = p["recommended"]
    assert rec["mode"] == "hisparse"   # 40 requests fit against all-GPU's 27
    assert rec["tokens_per_s"] >= best["tokens_per_s"] * (1 - advisor.RECOMMEND_TOLERANCE)
    assert "tokens/s = Q x batch / step_s" in p["formula"]
    assert "recommended: block_size" in table and "formula:" in table and " <-" in table


def test_link_time_decides_at_a_slow_link(capsys):
    """At a very slow link the gathers dominate: the biggest buffer (fewest misses) wins."""
    p, _ = run_json(capsys, "--link-gbps", "0.001", "--step-ms", "0.001", "--max-batch", "8")
    assert p["crossover"]["setting"]["device_buffer_size"] == 128   # the best HiSparse one
    assert p["recommended"]["mode"] == "all-gpu"   # all-GPU holds 8 too, with no gathers
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
    p, err = run_json(capsys, "--bench-json", str(tmp_path))  # a directory: its newest .json
    assert "bench gather figures (triton, 64 B rows" in p["link_source"]
    assert f"read from {path}" in p["link_source"] and f"link speed from {path}" in err
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
    assert all("error" in r for r in p["settings"]) and p["recommended"]["mode"] == "all-gpu"
    assert "does not fit" in table and "no HiSparse setting of the sweep fits" in table


def _bench_result(device, gpu=None, **extra):
    return {"schema": "hisparse-triton/bench", "device": device,
            "environment": {"gpu": gpu},
            "transfers": [{"op": "gather", "method": "torch" if device == "cpu" else "triton",
                           "row_bytes": 64, "rows": 512, "gbps": 3.0, "verified": True},
                          {"op": "gather", "method": "contiguous", "row_bytes": 64,
                           "rows": 512, "gbps": 90.0}], **extra}


def test_bench_json_takes_only_a_gpu_gather_result(tmp_path, capsys):
    import os
    import time

    cpu = tmp_path / "cpu.json"
    cpu.write_text(json.dumps(_bench_result("cpu")))
    assert main([*SMALL, "--bench-json", str(cpu)]) == 1
    err = capsys.readouterr().err.strip()
    assert f"--bench-json {cpu}: a CPU bench result (device cpu)" in err
    assert "host -> device link" in err and len(err.splitlines()) == 1
    # a directory: the newest GPU gather result, not the newest JSON of any kind
    gpu = tmp_path / "gpu.json"
    gpu.write_text(json.dumps(_bench_result("cuda:0", gpu="NVIDIA H200")))
    (tmp_path / "plan.json").write_text(json.dumps({"schema": "hisparse-triton/plan"}))
    now = time.time()
    os.utime(gpu, (now - 10, now - 10))
    os.utime(cpu, (now - 5, now - 5))
    p, err = run_json(capsys, "--bench-json", str(tmp_path))
    assert f"read from {gpu}" in p["link_source"] and "NVIDIA H200" in p["link_source"]
    # the contiguous copy is not a row gather: never taken as the link speed
    assert {r["link_gbps"] for r in p["settings"]} == {3.0}
    gpu.unlink()
    assert main([*SMALL, "--bench-json", str(tmp_path)]) == 1
    err = capsys.readouterr().err.strip()
    assert "none of its 2 .json files is a GPU gather result" in err
    assert "cpu.json: a CPU bench result" in err and "plan.json: not a bench result" in err


def test_all_gpu_row_and_crossover(capsys):
    p, table = run_json(capsys, "--link-gbps", "1", "--step-ms", "1:1,64:2")
    gpu, cross, rec = p["all_gpu"], p["crossover"], p["recommended"]
    assert gpu["batch"] == math.floor(gpu["concurrency"]) and gpu["batch"] > 0
    assert gpu["tokens_per_s"] == pytest.approx(gpu["batch"] / (gpu["step_ms"] / 1e3))
    assert gpu["step_ms"] == pytest.approx(1 + (gpu["batch"] - 1) / 63)
    assert "all-GPU (every layer on the GPU)" in table
    assert rec["mode"] == "hisparse" and rec["tokens_per_s"] > gpu["tokens_per_s"]
    row = next(r for r in p["settings"] if r["block_size"] == rec["block_size"]
               and r["device_buffer_size"] == rec["device_buffer_size"])
    d = cross["requests"]
    assert gpu["batch"] < d <= row["batch"] and cross["all_gpu_batch"] == gpu["batch"]

    def hisparse(n):
        link = n * row["bytes_per_step"] / 1e9
        return n / ((1 + (n - 1) / 63) / 1e3 + link)

    tolerance = 1 + advisor.RECOMMEND_TOLERANCE
    assert hisparse(d) > gpu["tokens_per_s"] * tolerance >= hisparse(d - 1)
    assert f"from {d} concurrent requests on" in table
    # capped at a batch all-GPU holds too, HiSparse only adds gathers: all-GPU wins
    p, table = run_json(capsys, "--link-gbps", "1", "--max-batch", "2")
    assert p["recommended"]["mode"] == "all-gpu" and p["crossover"]["requests"] is None
    assert "recommended: all-GPU (no HiSparse)" in table and "runs no more requests" in table


def test_step_model_and_overlap(capsys):
    p, _ = run_json(capsys, "--link-gbps", "0.002", "--step-ms", "1:10,101:20")
    assert p["step_model"]["points"] == [[1, 10], [101, 20]]
    for r in p["settings"]:
        assert r["compute_ms_per_step"] == pytest.approx(10 + (r["batch"] - 1) / 10)
    p, _ = run_json(capsys, "--link-gbps", "0.002", "--step-ms", "5", "--overlap", "1")
    for r in p["settings"]:   # all of the gathers that fit hide under the compute
        assert r["step_ms"] == pytest.approx(max(5.0, r["link_ms_per_step"]))
    p, _ = run_json(capsys, "--link-gbps", "0.002", "--step-ms", "5", "--overlap", "0.5")
    for r in p["settings"]:
        link = r["link_ms_per_step"]
        assert r["step_ms"] == pytest.approx(5 + link - min(0.5 * link, 5))
    for bad in ("x", "1:0", "2:3,2:4", "0:5"):
        assert main([*SMALL, "--step-ms", bad]) == 2
        err = capsys.readouterr().err.strip()
        assert "argument --step-ms" in err and len(err.splitlines()) == 1


def test_block_sizes_follow_the_attention_kernel(capsys):
    base = ["advise", "--preset", "deepseek-v3.2-fp8", "--buffers", "2048,4096", "--steps",
            "4", "--streams", "1", "--json", "-"]
    assert main(base) == 0
    p = json.loads(capsys.readouterr().out)
    assert p["attention_kernel"] == "FlashMLA sparse" and p["supported_block_sizes"] == [64]
    assert {r["block_size"] for r in p["settings"]} == {64}
    assert main([*base, "--block-sizes", "16,32,64"]) == 0
    captured = capsys.readouterr()
    p = json.loads(captured.out)
    assert {r["block_size"]: r["supported"] for r in p["settings"]} == {
        16: False, 32: False, 64: True}
    assert p["recommended"]["block_size"] in (64, None)
    assert "(not FlashMLA sparse)" in captured.err and "never recommended" in captured.err
    # only unsupported sizes asked: still computed, the recommendation says so
    assert main([*base, "--block-sizes", "16"]) == 0
    captured = capsys.readouterr()
    rec = json.loads(captured.out)["recommended"]
    if rec["mode"] == "hisparse":
        assert rec["supported"] is False and "does not take block size 16" in captured.err


def test_the_tie_rule_never_picks_an_unsupported_size():
    rows = [{"block_size": 16, "device_buffer_size": 64, "tokens_per_s": 100.0,
             "gpu_bytes_per_request": 1, "supported": False},
            {"block_size": 64, "device_buffer_size": 64, "tokens_per_s": 99.8,
             "gpu_bytes_per_request": 2, "supported": True}]
    assert advisor.recommend(rows)["block_size"] == 16      # the plain tie rule
    assert advisor.recommend([r for r in rows if r["supported"]])["block_size"] == 64


def test_mtp_looks_up_a_union_per_step(capsys):
    p, table = run_json(capsys, "--buffers", "64,128", "--mtp", "2", "--link-gbps", "0.002",
                        "--step-ms", "1")
    assert p["mtp"] == 2 and "2 query tokens per step" in table
    for r in p["settings"]:
        assert r["rows_per_step"] == pytest.approx(r["miss_rate"] * 2 * 32 * 4)
        link_s = r["batch"] * r["bytes_per_step"] / 0.002e9
        assert r["tokens_per_s"] == pytest.approx(2 * r["batch"] / (1e-3 + link_s))
    assert main([*SMALL, "--buffers", "32", "--mtp", "2"]) == 1
    assert "smaller than 2 x top-k 32" in capsys.readouterr().err
    from hisparse_triton.trace import sample_trace_path

    assert main(["advise", "--preset", "tiny", "--trace", sample_trace_path(), "--mtp",
                 "2", "--context-len", "106"]) == 1
    assert "cannot be combined with --trace" in capsys.readouterr().err


def test_default_link_speed_says_where_it_comes_from(capsys):
    from hisparse_triton.link import DEFAULT_LINK_GBPS, MEASURED_ROW_GATHER_GBPS

    p, table = run_json(capsys)
    lo, hi = MEASURED_ROW_GATHER_GBPS
    assert p["link_gbps"] == DEFAULT_LINK_GBPS and lo <= DEFAULT_LINK_GBPS <= hi
    assert "31-37 GB/s" in p["link_source"] and "31-37 GB/s" in table
    assert p["step_model"]["source"].startswith("default, an assumption")


def test_split_bytes_model():
    # one rank: everything over PCIe, no exchange
    assert advisor.split_bytes(100.0, 2048, 656.0, 1, 0.25) == (100.0 * 656, 0.0)
    # 4 ranks, cap = ceil(0.25 x 2048 / 4) = 128 columns per rank: 100 misses all split
    pcie, exchange = advisor.split_bytes(100.0, 2048, 656.0, 4, 0.25)
    assert pcie == pytest.approx(25 * 656) and exchange == pytest.approx(3 * 128 * 656)
    # more misses than N x cap: the rest over every rank's own link
    pcie, _ = advisor.split_bytes(600.0, 2048, 1.0, 4, 0.25)
    assert pcie == pytest.approx(512 / 4 + 88)


def test_tp_split_divides_the_link_time(capsys):
    base, _ = run_json(capsys, "--link-gbps", "1", "--step-ms", "1")
    split, table = run_json(capsys, "--link-gbps", "1", "--step-ms", "1", "--tp-split", "4",
                            "--exchange-gbps", "100000")
    assert base["tp_split"] is None and split["tp_split"]["ranks"] == 4
    for a, b in zip(base["settings"], split["settings"]):
        assert b["link_ms_per_step"] < a["link_ms_per_step"]
        assert b["pcie_bytes_per_rank_per_step"] < a["pcie_bytes_per_rank_per_step"]
        assert b["exchange_bytes_per_rank_per_step"] > 0
    assert "own host link" in table and "split gather:" in table
    rc = main([*SMALL, "--tp-split", "0"])
    assert rc == 2


def test_tp_split_sizes_the_exchange_by_the_miss_rate(capsys):
    """By default (``--split-fraction auto``) each setting's exchange carries the worker's
    auto capacity at its miss rate, so the bytes exchanged follow the misses; the
    recommended setting's capacity is printed as the ``split_gather_fraction`` to use."""
    from hisparse_triton.worker.split_capacity import SPLIT_HEADROOM, capacity_fraction

    flags = ("--link-gbps", "1", "--step-ms", "1", "--tp-split", "4")
    auto, table = run_json(capsys, *flags)
    fixed, _ = run_json(capsys, *flags, "--split-fraction", "0.25")
    one_chunk, _ = run_json(capsys, *flags, "--split-chunks", "1")
    split = auto["tp_split"]
    assert split["fraction"] == "auto" and split["chunks"] == 2
    assert fixed["tp_split"]["fraction"] == 0.25
    q_k, bpc = 32, 8 * 64          # tiny: top-k 32, 8 layers of 64 B rows
    for a, f, c in zip(auto["settings"], fixed["settings"], one_chunk["settings"]):
        if "error" in a or not a["batch"]:
            continue
        frac = capacity_fraction(a["miss_rate"])
        assert a["split_fraction"] == frac >= a["miss_rate"] * (1 + SPLIT_HEADROOM)
        assert f["split_fraction"] == 0.25
        cap = math.ceil(frac * q_k / 4)
        assert a["exchange_bytes_per_rank_per_step"] == pytest.approx(
            3 * cap * bpc * a["batch"])
        assert c["link_ms_per_step"] > a["link_ms_per_step"]   # pipelining hides some
    best = auto["recommended"]
    assert split["recommended_fraction"] == capacity_fraction(best["miss_rate"])
    assert split["recommended_miss_rate"] == best["miss_rate"]
    assert f"(miss rate {100 * best['miss_rate']:.1f}% + 25% headroom" in table
    assert f"split_gather_fraction {split['recommended_fraction']:g}" in table
    assert main([*SMALL, "--tp-split", "2", "--split-fraction", "0"]) == 2
    assert main([*SMALL, "--tp-split", "2", "--split-chunks", "0"]) == 2
