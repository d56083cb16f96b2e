"""``HiSparseCollector``: the Prometheus view of a ``HiSparseMetrics`` (needs
``prometheus_client``, the ``metrics`` extra: ``pip install 'hisparse-triton[metrics]'``).

A custom collector: every scrape reads the newest published sample and the verdict (never
the device), so a scrape on the HTTP server's thread costs the decode loop nothing. Names
follow the style of vLLM's HiSparse connector metrics (``vllm:hisparse_cache_hits``,
``vllm:hisparse_cache_misses``, ``vllm:hisparse_host_to_device_bytes``,
``vllm:hisparse_host_cache_usage_perc``) with a ``hisparse_`` prefix and Prometheus's
conventions: counters end in ``_total``, units are base units (``_bytes``, ``_seconds``),
``_perc`` gauges are fractions (1 = 100%, as vLLM's). ``METRICS`` lists every family.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator, Optional

#: Where to get ``prometheus_client``.
EXTRA_HINT = "pip install 'hisparse-triton[metrics]' (or pip install prometheus_client)"


def require_prometheus() -> Any:
    """The ``prometheus_client`` module; ``ImportError`` naming the ``metrics`` extra."""
    try:
        import prometheus_client
        import prometheus_client.core  # noqa: F401  (the metric families)
    except ImportError as exc:
        raise ImportError(f"the HiSparse Prometheus collector needs prometheus_client, which "
                          f"is not installed: {EXTRA_HINT}.") from exc
    return prometheus_client


def _worker(field: str) -> Callable[[Any], Optional[float]]:
    return lambda s: getattr(s.worker, field)


def _scheduler(get: Callable[[Any], float]) -> Callable[[Any], Optional[float]]:
    return lambda s: None if s.scheduler is None else get(s.scheduler)


def _fraction(used: int, total: int) -> float:
    return used / total if total else 0.0


#: ``(name, kind, documentation, value of a MetricsSample)``: the families read from the
#: newest sample (``counter`` names get ``_total`` in the exposition). None = absent.
SAMPLE_METRICS: tuple[tuple[str, str, str, Callable[[Any], Optional[float]]], ...] = (
    ("hisparse_cache_hits", "counter",
     "Top-k columns served from a resident page or a hot-buffer slot (every index group).",
     _worker("hits")),
    ("hisparse_cache_misses", "counter",
     "Distinct host rows gathered into hot buffers (once per index group).",
     _worker("misses")),
    ("hisparse_cache_masked", "counter",
     "Top-k columns that resolved to -1 (padding, out of range, no page).",
     _worker("masked")),
    ("hisparse_host_to_device_rows", "counter",
     "Rows copied host -> device (each miss into every layer of its index group).",
     lambda s: s.h2d_rows),
    ("hisparse_host_to_device_bytes", "counter",
     "Bytes gathered host -> device into hot buffers.", _worker("h2d_bytes")),
    ("hisparse_device_to_host_rows", "counter",
     "Rows mirrored device -> host (write-through of new KV rows).", lambda s: s.d2h_rows),
    ("hisparse_device_to_host_bytes", "counter",
     "Bytes mirrored device -> host by this worker.", _worker("d2h_bytes")),
    ("hisparse_plans_applied", "counter", "Step plans the worker applied.",
     _worker("plans")),
    ("hisparse_unpinned_pages", "counter",
     "Resident pages unpinned (left the GPU's ownership, readable until reused).",
     _scheduler(lambda st: st.unpinned_pages)),
    ("hisparse_lost_pages", "counter",
     "Unpinned pages whose device block went to another owner.",
     _scheduler(lambda st: st.lost_pages)),
    ("hisparse_host_blocks_used", "gauge", "Host pool blocks owned by requests.",
     _scheduler(lambda st: st.host_blocks)),
    ("hisparse_host_blocks_total", "gauge", "Allocatable host pool blocks.",
     _scheduler(lambda st: st.host_blocks_total)),
    ("hisparse_host_cache_usage_perc", "gauge",
     "Host pool usage, 1 = 100% (blocks owned / allocatable).",
     _scheduler(lambda st: _fraction(st.host_blocks, st.host_blocks_total))),
    ("hisparse_device_blocks_used", "gauge",
     "Device pool blocks owned by requests (every group kind).",
     _scheduler(lambda st: st.device_blocks)),
    ("hisparse_device_blocks_total", "gauge", "Allocatable device pool blocks.",
     _scheduler(lambda st: st.device_blocks_total)),
    ("hisparse_device_cache_usage_perc", "gauge",
     "Device pool usage, 1 = 100% (blocks owned / allocatable).",
     _scheduler(lambda st: _fraction(st.device_blocks, st.device_blocks_total))),
    ("hisparse_requests_running", "gauge", "Live requests.",
     _scheduler(lambda st: st.num_requests)),
    ("hisparse_requests_offloaded", "gauge",
     "Live requests holding a hot region (their history read through the hot buffer).",
     _scheduler(lambda st: st.offloaded_requests)),
)

#: Every family a collector can emit: ``(name in the exposition, kind)``.
METRICS: tuple[tuple[str, str], ...] = (
    *((name + "_total" if kind == "counter" else name, kind)
      for name, kind, _, _ in SAMPLE_METRICS),
    ("hisparse_index_group_cache_hits_total", "counter"),
    ("hisparse_index_group_cache_misses_total", "counter"),
    ("hisparse_index_group_miss_rate", "gauge"),
    ("hisparse_observed_miss_rate", "gauge"),
    ("hisparse_observed_columns", "gauge"),
    ("hisparse_step_duration_seconds", "histogram"),
    ("hisparse_step_timing_info", "info"),
    ("hisparse_estimated_tokens_per_second", "gauge"),
    ("hisparse_estimated_batch", "gauge"),
    ("hisparse_estimated_speedup_vs_all_gpu", "gauge"),
    ("hisparse_recommended_speedup_vs_all_gpu", "gauge"),
    ("hisparse_recommended_all_gpu", "gauge"),
    ("hisparse_recommended_block_size", "gauge"),
    ("hisparse_recommended_device_buffer_size", "gauge"),
    ("hisparse_link_bytes_per_second", "gauge"),
    ("hisparse_verdict_info", "info"),
)


class HiSparseCollector:
    """A ``prometheus_client`` collector over a ``HiSparseMetrics`` (module docstring):
    ``registry.register(HiSparseCollector(metrics))``. ``ImportError`` naming the
    ``metrics`` extra when ``prometheus_client`` is missing."""

    def __init__(self, metrics: Any) -> None:
        self._prom = require_prometheus()
        self.metrics = metrics

    def describe(self) -> list[Any]:
        """The families' names (no samples), for the registry's duplicate check."""
        core = self._prom.core
        kinds = {"counter": core.CounterMetricFamily, "gauge": core.GaugeMetricFamily,
                 "histogram": core.HistogramMetricFamily, "info": core.InfoMetricFamily}
        out = []
        for name, kind in METRICS:
            base = name[:-len("_total")] if kind == "counter" else name
            base = base[:-len("_info")] if kind == "info" else base
            out.append(kinds[kind](base, ""))
        return out

    def collect(self) -> Iterator[Any]:
        """Every family of the newest published sample and of the verdict."""
        core = self._prom.core
        sample = self.metrics.latest()
        if sample is not None:
            for name, kind, doc, get in SAMPLE_METRICS:
                value = get(sample)
                if value is None:
                    continue
                klass = core.CounterMetricFamily if kind == "counter" else \
                    core.GaugeMetricFamily
                yield klass(name, doc, value=float(value))
            yield from self._groups(core, sample)
            yield from self._steps(core, sample)
        observed = self.metrics.observation()
        yield core.GaugeMetricFamily(
            "hisparse_observed_miss_rate", "Misses / (hits + misses) over the steady-state "
            "window of samples (the verdict's input).", value=observed.miss_rate)
        yield core.GaugeMetricFamily(
            "hisparse_observed_columns", "Top-k columns resolved in the steady-state window.",
            value=float(observed.columns))
        if self.metrics.verdict_settings is not None:
            yield from self._verdict(core)

    def _groups(self, core: Any, sample: Any) -> Iterator[Any]:
        hits = core.CounterMetricFamily(
            "hisparse_index_group_cache_hits", "Cache hits of one index group.",
            labels=["index_group"])
        misses = core.CounterMetricFamily(
            "hisparse_index_group_cache_misses", "Cache misses of one index group.",
            labels=["index_group"])
        rate = core.GaugeMetricFamily(
            "hisparse_index_group_miss_rate", "Misses / (hits + misses) of one index group "
            "over the steady-state window.", labels=["index_group"])
        rates = self.metrics.group_miss_rates()
        for g in sample.groups:
            hits.add_metric([g.leader], float(g.hits))
            misses.add_metric([g.leader], float(g.misses))
            rate.add_metric([g.leader], rates.get(g.leader, 0.0))
        yield from (hits, misses, rate)

    def _steps(self, core: Any, sample: Any) -> Iterator[Any]:
        from hisparse_triton.metrics.timing import STEP_BUCKETS

        steps = sample.steps
        yield core.InfoMetricFamily(
            "hisparse_step_timing", "Whether decode steps are timed with device events.",
            value={"available": str(steps.available).lower(), "reason": steps.reason or ""})
        if not steps.available:
            return
        bounds = [f"{b:g}" for b in STEP_BUCKETS] + ["+Inf"]
        yield core.HistogramMetricFamily(
            "hisparse_step_duration_seconds", "Device time of a decode step (CUDA events).",
            buckets=list(zip(bounds, map(float, steps.buckets))), sum_value=steps.seconds)

    def _verdict(self, core: Any) -> Iterator[Any]:
        try:
            v = self.metrics.verdict()
        except ValueError as exc:
            yield core.InfoMetricFamily(
                "hisparse_verdict", "The live verdict in one line (or why there is none).",
                value={"text": "", "recommended": "", "error": " ".join(str(exc).split())})
            return
        rec = v.recommended
        tokens = core.GaugeMetricFamily(
            "hisparse_estimated_tokens_per_second", "The advise model's decode throughput "
            "estimate, fed by the observed miss rate.", labels=["setting"])
        batch = core.GaugeMetricFamily(
            "hisparse_estimated_batch", "Requests decoded together in the estimate.",
            labels=["setting"])
        if v.tokens_per_s is not None:
            tokens.add_metric(["current"], v.tokens_per_s)
            batch.add_metric(["current"], float(v.batch))
        tokens.add_metric(["all_gpu"], v.all_gpu_tokens_per_s)
        batch.add_metric(["all_gpu"], float(v.all_gpu_batch))
        if rec is not None:
            tokens.add_metric(["recommended"], rec["tokens_per_s"])
            batch.add_metric(["recommended"], float(rec["batch"]))
        yield from (tokens, batch)
        if v.speedup_vs_all_gpu is not None:
            yield core.GaugeMetricFamily(
                "hisparse_estimated_speedup_vs_all_gpu", "Estimated throughput of the current "
                "setting / keeping every layer on the GPU.", value=v.speedup_vs_all_gpu)
        if rec is not None:
            yield core.GaugeMetricFamily(
                "hisparse_recommended_speedup_vs_all_gpu", "Estimated throughput of the "
                "setting advise recommends / all-GPU.", value=v.recommended_speedup_vs_all_gpu)
            yield core.GaugeMetricFamily(
                "hisparse_recommended_all_gpu", "1 when advise recommends keeping every layer "
                "on the GPU (no HiSparse), else 0.", value=float(rec["mode"] == "all-gpu"))
            if rec["mode"] == "hisparse":
                yield core.GaugeMetricFamily(
                    "hisparse_recommended_block_size", "The KV block size advise recommends.",
                    value=float(rec["block_size"]))
                yield core.GaugeMetricFamily(
                    "hisparse_recommended_device_buffer_size", "The hot-buffer rows advise "
                    "recommends.", value=float(rec["device_buffer_size"]))
        yield core.GaugeMetricFamily(
            "hisparse_link_bytes_per_second", "The host -> device gather speed the verdict "
            "assumes.", value=v.link_gbps * 1e9)
        what = "none" if rec is None else ("all-gpu" if rec["mode"] == "all-gpu" else
                                           f"block_size={rec['block_size']},"
                                           f"device_buffer_size={rec['device_buffer_size']}")
        yield core.InfoMetricFamily(
            "hisparse_verdict", "The live verdict in one line (or why there is none).",
            value={"text": v.text, "recommended": what, "error": ""})


__all__ = ["EXTRA_HINT", "HiSparseCollector", "METRICS", "SAMPLE_METRICS",
           "require_prometheus"]
