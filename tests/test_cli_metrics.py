"""``hisparse-triton metrics``: the demo workload served over HTTP and scraped over loopback
with a real HTTP client (urllib), in a separate process; the scrape's counters equal the
runtime's stats the run reports, and its verdict is the run's."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from hisparse_triton.cli import main

prom = pytest.importorskip("prometheus_client", reason="the metrics extra is not installed")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
DEMO = ["--requests", "2", "--output-len", "24", "--no-verify", "--no-progress"]
MODEL = ["--gpu-memory-gib", "0.01", "--host-pool-gib", "0.01", "--step-ms", "1:1,64:2",
         "--link-gbps", "0.2"]


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env


def _read_until(stream, text: str, deadline: float) -> list[str]:
    lines = []
    while time.monotonic() < deadline:
        line = stream.readline()
        if not line:
            break
        lines.append(line)
        if text in line:
            return lines
    raise AssertionError(f"never printed {text!r}; got:\n{''.join(lines)}")


def _get(url: str) -> tuple[str, str]:
    with urllib.request.urlopen(url, timeout=30) as reply:
        return reply.read().decode(), reply.headers["Content-Type"]


def _samples(text: str) -> dict[str, dict[tuple, float]]:
    out: dict[str, dict[tuple, float]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
    return out


@pytest.mark.parametrize("stop", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_serve_and_scrape_over_loopback(tmp_path, stop):
    out_json = tmp_path / "metrics.json"
    proc = subprocess.Popen(
        [sys.executable, "-m", "hisparse_triton", "metrics", "--serve", "0", *DEMO, *MODEL,
         "--json", str(out_json)], cwd=tmp_path, env=_env(), stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 240
        first = _read_until(proc.stderr, "serving http://", deadline)[-1]
        url = first.split("serving ", 1)[1].split()[0]
        assert url.startswith("http://127.0.0.1:") and url.endswith("/metrics")
        _read_until(proc.stderr, "workload done", deadline)
        text, kind = _get(url)
        verdict_line, _ = _get(url.replace("/metrics", "/verdict"))
        assert proc.poll() is None                       # still serving
    finally:
        proc.send_signal(stop)                           # how a server is stopped
        try:
            _, err = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
    assert proc.returncode == 0, err
    assert kind.startswith("text/plain") and "version=" in kind
    doc = json.loads(out_json.read_text())
    assert doc["schema"] == "hisparse-triton/metrics" and doc["url"] == url
    report, sample = doc["report"], doc["sample"]
    got = _samples(text)

    def one(name: str) -> float:
        return got[name][()]

    # Counters: the scrape equals the runtime's stats at the end of the run.
    assert one("hisparse_cache_hits_total") == report["hits"] > 0
    assert one("hisparse_cache_misses_total") == report["misses"] > 0
    assert one("hisparse_cache_masked_total") == report["masked"]
    assert one("hisparse_host_to_device_bytes_total") == report["h2d_bytes"] > 0
    assert one("hisparse_device_to_host_bytes_total") == report["d2h_bytes"] > 0
    assert one("hisparse_host_to_device_rows_total") == sample["h2d_rows"] == \
        2 * report["misses"]                             # 2 layers per index group
    assert one("hisparse_device_to_host_rows_total") * 64 == report["d2h_bytes"]
    assert one("hisparse_host_blocks_total") == report["host_pool_blocks"] - 1  # null block
    assert one("hisparse_host_blocks_used") == 0         # every request freed at the end
    assert one("hisparse_unpinned_pages_total") == report["unpinned_pages"]
    groups = got["hisparse_index_group_cache_misses_total"]
    assert len(groups) == report["index_groups"] and sum(groups.values()) == report["misses"]
    # The verdict: the run's, as gauges and as one line.
    verdict = doc["verdict"]
    assert verdict_line.strip() == verdict["text"]
    assert got["hisparse_verdict_info"][(("error", ""), ("recommended", _rec(verdict)),
                                         ("text", verdict["text"]))] == 1.0
    tokens = {dict(k)["setting"]: v for k, v in
              got["hisparse_estimated_tokens_per_second"].items()}
    assert tokens["current"] == pytest.approx(verdict["tokens_per_s"])
    assert tokens["all_gpu"] == pytest.approx(verdict["all_gpu_tokens_per_s"])
    assert one("hisparse_estimated_speedup_vs_all_gpu") == pytest.approx(
        verdict["speedup_vs_all_gpu"])
    assert one("hisparse_observed_miss_rate") == pytest.approx(verdict["miss_rate"])
    assert one("hisparse_link_bytes_per_second") == 0.2e9
    assert "stopped" in err


def _rec(verdict: dict) -> str:
    rec = verdict["recommended"]
    if rec["mode"] == "all-gpu":
        return "all-gpu"
    return f"block_size={rec['block_size']},device_buffer_size={rec['device_buffer_size']}"


def test_without_serve_the_last_scrape_is_printed(capsys):
    assert main(["metrics", *DEMO, *MODEL]) == 0
    out = capsys.readouterr().out
    assert "# TYPE hisparse_cache_hits_total counter" in out
    assert "HiSparse verdict: miss rate" in out and "hisparse_verdict_info{" in out
    assert "step timing: " in out


def test_duration_ends_the_server(capsys):
    start = time.monotonic()
    assert main(["metrics", "--serve", "0", "--duration", "0.5", *DEMO]) == 0
    err = capsys.readouterr().err
    assert "serving http://127.0.0.1:" in err and "for 0.5 s" in err
    assert time.monotonic() - start < 120


@pytest.mark.parametrize("argv, message", [
    (["--duration", "3"], "hisparse-triton metrics: error: --duration applies to --serve."),
    (["--link-gbps", "5", "--bench-json", "x.json"],
     "hisparse-triton metrics: error: give --link-gbps or --bench-json, not both."),
])
def test_bad_flags(argv, message, capsys):
    assert main(["metrics", *argv]) == 1
    assert capsys.readouterr().err.strip() == message


def test_a_busy_port_is_a_clear_error(capsys):
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        assert main(["metrics", "--serve", str(port), *DEMO]) == 1
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith(f"hisparse-triton metrics: error: cannot serve metrics on "
                          f"127.0.0.1:{port}: ")


def test_the_missing_extra_is_named(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "prometheus_client", None)
    assert main(["metrics", *DEMO]) == 1
    err = capsys.readouterr().err.strip()
    assert "pip install 'hisparse-triton[metrics]'" in err and len(err.splitlines()) == 1
