"""``hisparse-triton simulate``: both output forms, the numbers' consistency, bad input."""

import json
import os

import pytest
import torch

from hisparse_triton.cli import main

SMALL = ["simulate", "--requests", "3", "--max-running", "2", "--prompt-len", "100",
         "--output-len", "6"]


@pytest.fixture(autouse=True)
def _restore_threads():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def run_json(capsys, *flags):
    assert main([*SMALL, *flags, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_json_report_is_consistent(capsys):
    r = run_json(capsys)
    assert r["preset"] == "tiny" and r["device"] == "cpu" and r["verified"]
    assert r["decode_steps"] == 2 * 6 and r["resolves"] == r["decode_steps"] * 4
    assert r["resolved_rows"] == 3 * 6 * 4
    assert r["hits"] + r["misses"] + r["masked"] == r["resolved_rows"] * r["topk"]
    assert r["misses"] > 0 and r["masked"] == 0
    assert r["rows_checked"] == (r["resolved_rows"] * r["topk"] - r["masked"]) * 2
    assert r["h2d_bytes"] == r["misses"] * 64 * 2       # 64 B rows, leader + follower
    assert r["d2h_bytes"] == 3 * (100 + 6) * 8 * 64     # every token of 8 sparse layers
    assert r["h2d_seconds"] == pytest.approx(r["h2d_bytes"] / 50e9)
    assert 0 < r["device_peak_bytes"] < r["all_gpu_peak_bytes"]
    assert r["gpu_bytes_saved"] == r["all_gpu_peak_bytes"] - r["device_peak_bytes"]
    # the documented key (it was spelled gpu_savedfraction)
    assert r["gpu_saved_fraction"] == pytest.approx(
        r["gpu_bytes_saved"] / r["all_gpu_peak_bytes"])
    assert 0 < r["hit_rate"] < 1


def test_human_report(capsys):
    assert main([*SMALL, "--link-gbps", "25"]) == 0
    out = capsys.readouterr().out
    for text in ("hisparse-triton simulate: preset tiny", "hit rate", "at 25 GB/s",
                 "GPU memory saved", "verify: exact", "wall time"):
        assert text in out


def test_locality_raises_the_hit_rate(capsys):
    low = run_json(capsys, "--locality", "0", "--no-verify")
    high = run_json(capsys, "--locality", "1", "--no-verify")
    assert not low["verified"] and low["rows_checked"] == 0
    assert high["hit_rate"] > low["hit_rate"]
    assert high["h2d_bytes"] < low["h2d_bytes"]


def test_progress_bar_goes_to_stderr(capsys):
    assert main([*SMALL, "--progress", "--no-verify", "--json"]) == 0
    captured = capsys.readouterr()
    assert "simulate [" in captured.err and "12/12 steps" in captured.err
    json.loads(captured.out)


def test_triton_backend(capsys):
    """Triton kernels inside simulate: on CUDA when present, else the interpreter on CPU."""
    device = ("cuda" if torch.cuda.is_available()
              and os.environ.get("TRITON_INTERPRET") != "1" else "cpu")
    r = json.loads(_run(capsys, "simulate", "--layers", "4", "--requests", "1",
                        "--prompt-len", "80", "--output-len", "1", "--topk", "16",
                        "--backend", "triton", "--device", device, "--json"))
    assert r["backend"] == "triton" and r["verified"] and r["misses"] > 0
    assert r["device"].startswith(device)


def _run(capsys, *argv):
    assert main(list(argv)) == 0
    return capsys.readouterr().out


@pytest.mark.parametrize("flags,code,message", [
    (["--locality", "2"], 2, "must be in [0, 1]"),
    (["--requests", "0"], 2, "must be an integer >= 1"),
    (["--prompt-len", "2000"], 1, "exceed the tiny preset's max context of 1024"),
    (["--device-blocks", "3"], 1, "error: cannot add request 0: its hot region needs"),
    (["--host-blocks", "8"], 1, "increase host_pool_gib"),
    # both used to end in a traceback (torch's RuntimeError) or a crash (libgomp)
    (["--device", "tpu"], 1, "error: device 'tpu' is not a torch device"),
    (["--device", "meta"], 1, "error: device 'meta': the runtime runs on a cpu or cuda"),
    (["--threads", "100000"], 1, "--threads 100000 exceeds the"),
])
def test_bad_input_one_line(capsys, flags, code, message):
    assert main([*SMALL, *flags]) == code
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA path")
def test_cuda_device_without_cuda(capsys):
    assert main([*SMALL, "--device", "cuda"]) == 1
    assert "CUDA is not available" in capsys.readouterr().err
