"""``hisparse_triton.metrics``: samples that equal the runtime's own stats, per index group
counters from the same copy, the steady-state window, the Prometheus collector's families,
the missing-extra error, and the step timer (device events on a GPU; skipped on the CPU)."""

from __future__ import annotations

import importlib
import math
import sys

import numpy as np
import pytest
import torch

from hisparse_triton.metrics import (
    HiSparseMetrics,
    MetricsServer,
    StepTimer,
    VerdictSettings,
)
from hisparse_triton.presets import build_kv_cache_spec
from hisparse_triton.runtime import HiSparseRuntime
from hisparse_triton.workload import plan_for_workload

prom = pytest.importorskip("prometheus_client", reason="the metrics extra is not installed")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

B, TOPK, BUFFER, PROMPT = 4, 8, 16, 64
#: The verdict's model: the whole tiny preset in 10 MiB of GPU memory and of host memory (the
#: runtime here is a 4-layer cut of it, so its own pools would not describe the preset).
VERDICT = VerdictSettings(preset="tiny", gpu_memory_gib=0.01, host_pool_gib=0.01)
NEEDS_CUDA = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="device step timings and the host-sync check need "
                                       "CUDA (CUDA events); this machine has no GPU")


def make_runtime(**kwargs) -> HiSparseRuntime:
    spec = build_kv_cache_spec("tiny", num_layers=4, block_size=B)
    plan = plan_for_workload(spec, max_model_len=160, num_requests=2, topk=TOPK,
                             device_buffer_size=BUFFER)
    return HiSparseRuntime(plan.kv_cache_config, plan.config, max_num_seqs=2, device="cpu",
                           backend="torch", free_block_watermark=1.0, **kwargs)


def decode(rt: HiSparseRuntime, steps: int, metrics: HiSparseMetrics | None = None,
           seed: int = 0, ids=(0, 1)) -> None:
    """``steps`` decode steps of ``ids`` (admitted with a PROMPT-token prompt on first use)."""
    rng = np.random.default_rng(seed)
    for rid in ids:
        if not rt.has_request(rid):
            rt.add_request(rid, PROMPT, 64)
            rt.append_slots(rid, PROMPT)
            rt.commit()
    for _ in range(steps):
        for rid in ids:
            rt.append_slots(rid, 1)
        for leader in rt.leaders:
            topk = np.stack([rng.choice(rt.seq_len(rid), TOPK, replace=False) for rid in ids])
            rt.resolve(leader, list(ids), torch.from_numpy(topk.astype(np.int32)))
        rt.commit()
        if metrics is not None:
            metrics.sample()


@pytest.fixture
def rt():
    runtime = make_runtime()
    yield runtime
    runtime.close()


# ----------------------------------------------------------------------------- samples
def test_a_sample_equals_the_runtime_stats(rt):
    metrics = HiSparseMetrics(rt)
    decode(rt, 6, metrics)
    metrics.flush()
    last, stats = metrics.latest(), rt.stats()
    for name in ("hits", "misses", "masked", "h2d_bytes", "d2h_bytes", "plans"):
        assert getattr(last.worker, name) == getattr(stats, name), name
    for name in ("host_blocks", "host_blocks_total", "device_blocks", "offloaded_requests",
                 "num_requests", "unpinned_pages"):
        assert getattr(last.scheduler, name) == getattr(stats, name), name
    assert stats.misses > 0 and stats.offloaded_requests == 2
    # Per index group, from the same copy: the groups add up to the totals.
    assert [g.leader for g in last.groups] == list(rt.leaders)
    assert sum(g.hits for g in last.groups) == stats.hits
    assert sum(g.misses for g in last.groups) == stats.misses
    assert sum(g.h2d_bytes for g in last.groups) == stats.h2d_bytes
    # Rows each way: a miss is copied into both layers of its index group.
    row = rt.host_cache(rt.source_layers[0]).shape[-1]
    assert last.h2d_rows == 2 * stats.misses and last.h2d_rows * row == stats.h2d_bytes
    assert last.d2h_rows * row == stats.d2h_bytes and last.d2h_rows > 0


def test_the_split_halves_give_the_same_samples(rt):
    both = HiSparseMetrics(worker=rt.worker, scheduler=rt.scheduler)
    worker_only = HiSparseMetrics(worker=rt.worker)
    decode(rt, 3)
    both.sample()
    worker_only.sample()
    assert both.latest().worker == rt.worker.stats()
    assert both.latest().scheduler == rt.scheduler.stats()
    assert worker_only.latest().scheduler is None
    assert worker_only.latest().worker == both.latest().worker


def test_the_window_leaves_out_what_came_before_it(rt):
    metrics = HiSparseMetrics(rt, window=3)
    decode(rt, 2, metrics)
    early = metrics.observation()
    assert early.since_start and early.samples == 1
    assert (early.hits, early.misses) == (metrics.latest().worker.hits,
                                          metrics.latest().worker.misses)
    decode(rt, 5, metrics, seed=1)
    samples = metrics.samples()
    assert len(samples) == 4 and [s.index for s in samples] == [3, 4, 5, 6]
    seen = metrics.observation()
    assert not seen.since_start and seen.samples == 4
    assert seen.misses == samples[-1].worker.misses - samples[0].worker.misses
    assert seen.hits == samples[-1].worker.hits - samples[0].worker.hits
    assert seen.columns == 3 * 2 * 2 * TOPK     # 3 steps x 2 requests x 2 index groups x k
    per_group = metrics.group_miss_rates()
    for i, leader in enumerate(rt.leaders):
        d_hits = samples[-1].groups[i].hits - samples[0].groups[i].hits
        d_miss = samples[-1].groups[i].misses - samples[0].groups[i].misses
        assert per_group[leader] == pytest.approx(d_miss / (d_hits + d_miss))


class _Late:
    """A snapshot whose copy has not landed until ``landed`` is set."""

    def __init__(self, inner, flag):
        self.inner, self.flag = inner, flag

    def ready(self):
        return self.flag["landed"]

    def result(self):
        return self.inner.result()

    def groups(self):
        return self.inner.groups()


def test_a_sample_is_published_only_once_its_copy_landed(rt, monkeypatch):
    metrics = HiSparseMetrics(rt)
    flag = {"landed": False}
    real = rt.worker.stats_async
    monkeypatch.setattr(rt.worker, "stats_async", lambda: _Late(real(), flag))
    decode(rt, 2, metrics)
    assert metrics.latest() is None              # nothing waited for, nothing published
    flag["landed"] = True
    decode(rt, 1, metrics)
    assert [s.index for s in metrics.samples()] == [0, 1, 2]
    flag["landed"] = False
    decode(rt, 1, metrics)
    assert metrics.latest().index == 2
    metrics.flush()                             # the end of a run waits for the copy
    assert metrics.latest().index == 3 and metrics.latest().worker == rt.worker.stats()


def test_bad_arguments_are_refused(rt):
    with pytest.raises(ValueError, match="a runtime, or a worker"):
        HiSparseMetrics(rt, worker=rt.worker)
    with pytest.raises(ValueError, match="needs a runtime or a worker"):
        HiSparseMetrics()
    with pytest.raises(ValueError, match="window must be an int >= 1 or None, got 0"):
        HiSparseMetrics(rt, window=0)
    with pytest.raises(ValueError, match="VerdictSettings or None, got dict"):
        HiSparseMetrics(rt, verdict={"preset": "tiny"})
    with pytest.raises(ValueError, match="unknown preset 'nope'"):
        VerdictSettings(preset="nope")
    with pytest.raises(ValueError, match="without VerdictSettings"):
        HiSparseMetrics(rt).verdict()


# ----------------------------------------------------------------------------- Prometheus
def families(metrics: HiSparseMetrics) -> dict[str, object]:
    registry = prom.CollectorRegistry()
    registry.register(metrics.collector())
    text = prom.generate_latest(registry).decode()
    return {f.name: f for f in text_string_to_metric_families(text)}


def values(family) -> dict[tuple, float]:
    return {tuple(sorted(s.labels.items())): s.value for s in family.samples
            if not s.name.endswith("_created")}


def test_the_scrape_carries_the_counters_and_the_verdict(rt):
    metrics = HiSparseMetrics(rt, verdict=VERDICT)
    decode(rt, 5, metrics)
    fam = families(metrics)
    stats = rt.stats()
    one = {name: values(f)[()] for name, f in fam.items() if () in values(f)}
    assert one["hisparse_cache_hits"] == stats.hits
    assert one["hisparse_cache_misses"] == stats.misses
    assert one["hisparse_host_to_device_bytes"] == stats.h2d_bytes
    assert one["hisparse_device_to_host_bytes"] == stats.d2h_bytes
    assert one["hisparse_host_blocks_used"] == stats.host_blocks
    assert one["hisparse_requests_offloaded"] == stats.offloaded_requests == 2
    assert one["hisparse_host_cache_usage_perc"] == pytest.approx(
        stats.host_blocks / stats.host_blocks_total)
    assert fam["hisparse_cache_hits"].type == "counter"      # exposed as ..._total
    groups = values(fam["hisparse_index_group_cache_misses"])
    assert sum(groups.values()) == stats.misses and len(groups) == len(rt.leaders)
    # The verdict, as gauges and one line, equal to metrics.verdict().
    verdict = metrics.verdict()
    tokens = {dict(k)["setting"]: v for k, v in
              values(fam["hisparse_estimated_tokens_per_second"]).items()}
    assert tokens["current"] == pytest.approx(verdict.tokens_per_s)
    assert tokens["all_gpu"] == pytest.approx(verdict.all_gpu_tokens_per_s)
    assert one["hisparse_estimated_speedup_vs_all_gpu"] == pytest.approx(
        verdict.speedup_vs_all_gpu)
    assert one["hisparse_observed_miss_rate"] == pytest.approx(verdict.miss_rate)
    info = fam["hisparse_verdict_info"].samples[0].labels
    assert info["text"] == verdict.text and info["error"] == ""
    timing = fam["hisparse_step_timing_info"].samples[0].labels
    if not torch.cuda.is_available():
        assert timing["available"] == "false" and "CUDA events" in timing["reason"]
        assert "hisparse_step_duration_seconds" not in fam


def test_every_documented_family_can_appear(rt):
    from hisparse_triton.metrics.prometheus import METRICS

    metrics = HiSparseMetrics(rt, verdict=VERDICT)
    decode(rt, 3, metrics)
    seen = set()
    for family in families(metrics).values():
        suffix = "_total" if family.type == "counter" else ""  # the text format: info = gauge
        seen.add(family.name + suffix)
    allowed = {name for name, _ in METRICS}
    assert seen <= allowed
    gpu_only = {"hisparse_step_duration_seconds"}
    on_hisparse_pick = {"hisparse_recommended_block_size",
                        "hisparse_recommended_device_buffer_size"}
    assert allowed - seen <= gpu_only | on_hisparse_pick
    for name in seen:
        assert name.startswith("hisparse_")


def test_before_any_resolve_the_verdict_says_why(rt):
    metrics = HiSparseMetrics(rt, verdict=VERDICT)
    fam = families(metrics)
    assert "hisparse_cache_hits" not in fam          # no sample yet
    error = fam["hisparse_verdict_info"].samples[0].labels["error"]
    assert error == "no top-k column was resolved in the window yet: nothing to judge."
    assert metrics.verdict_text().startswith("HiSparse verdict: none yet: no top-k column")
    without = HiSparseMetrics(rt)
    assert "hisparse_verdict_info" not in families(without)


def test_the_server_answers_on_loopback(rt):
    import urllib.error
    import urllib.request

    metrics = HiSparseMetrics(rt, verdict=VERDICT)
    decode(rt, 3, metrics)
    with MetricsServer(metrics) as server:
        assert server.port > 0 and server.url.endswith(f":{server.port}/metrics")
        with urllib.request.urlopen(server.url, timeout=10) as reply:
            text = reply.read().decode()
            assert reply.headers["Content-Type"].startswith("text/plain")
        parsed = {f.name: f for f in text_string_to_metric_families(text)}
        assert values(parsed["hisparse_cache_misses"])[()] == rt.stats().misses
        verdict_url = server.url.replace("/metrics", "/verdict")
        with urllib.request.urlopen(verdict_url, timeout=10) as reply:
            assert reply.read().decode().strip() == metrics.verdict().text
        with pytest.raises(urllib.error.HTTPError, match="404"):
            urllib.request.urlopen(server.url.replace("/metrics", "/nope"), timeout=10)
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(server.url, timeout=2)


def test_without_prometheus_client_only_the_collector_fails(rt, monkeypatch):
    for name in list(sys.modules):
        if name.startswith(("prometheus_client", "hisparse_triton.metrics")):
            monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "prometheus_client", None)   # import -> ImportError
    package = importlib.import_module("hisparse_triton.metrics")
    settings = package.VerdictSettings(preset="tiny", gpu_memory_gib=0.01,
                                       host_pool_gib=0.01)
    metrics = package.HiSparseMetrics(rt, verdict=settings)
    decode(rt, 2, metrics)
    assert metrics.verdict().columns > 0                # sampling and the verdict work
    with pytest.raises(ImportError, match=r"pip install 'hisparse-triton\[metrics\]'"):
        metrics.collector()
    with pytest.raises(ImportError, match=r"hisparse-triton\[metrics\]"):
        package.MetricsServer(metrics)


# ----------------------------------------------------------------------------- step timer
def test_on_the_cpu_steps_are_not_timed_and_the_reason_is_given():
    timer = StepTimer(torch.device("cpu"))
    with timer.step():
        pass
    timer.poll()
    times = timer.times()
    assert not times.available and times.count == 0
    assert "no step timings on a cpu device" in times.reason
    assert StepTimer(torch.device("cpu"), enabled=False).reason == "step timing turned off"


@NEEDS_CUDA
def test_device_events_time_a_step_without_a_host_sync():
    timer = StepTimer(torch.device("cuda"))
    x = torch.randn(2048, 2048, device="cuda")
    torch.cuda.set_sync_debug_mode("error")   # any synchronising call raises
    try:
        with timer.step():
            y = x @ x
        timer.poll()                          # query() never waits
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    timer.poll()
    times = timer.times()
    assert times.available and times.count == 1 and times.seconds > 0
    assert times.buckets[-1] == 1 and math.isfinite(times.last)
    del y


@NEEDS_CUDA
def test_sampling_a_cuda_runtime_does_not_sync():
    spec = build_kv_cache_spec("tiny", num_layers=4, block_size=B)
    plan = plan_for_workload(spec, max_model_len=160, num_requests=2, topk=TOPK,
                             device_buffer_size=BUFFER)
    with HiSparseRuntime(plan.kv_cache_config, plan.config, max_num_seqs=2, device="cuda",
                         free_block_watermark=1.0) as cuda_rt:
        metrics = HiSparseMetrics(cuda_rt, verdict=VERDICT)
        decode(cuda_rt, 2)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            with metrics.step():
                pass
            metrics.sample()
        finally:
            torch.cuda.set_sync_debug_mode(0)
        metrics.flush()
        assert metrics.latest().worker == cuda_rt.stats()
        assert metrics.latest().steps.available
