"""Live metrics of a HiSparse runtime, exported to Prometheus, with a verdict.

- ``sampler``: ``HiSparseMetrics``: samples a runtime's (or a worker's and a scheduler's)
  counters without a host sync, keeps a steady-state window, gives the verdict;
- ``verdict``: ``live_verdict``: the advise model fed with the observed miss rate: the
  estimated throughput against keeping every layer on the GPU, and the setting advise
  would pick now;
- ``timing``: ``StepTimer``: decode-step device time from CUDA events, read without waiting;
- ``prometheus``: ``HiSparseCollector`` (needs ``prometheus_client``: the ``metrics`` extra,
  ``pip install 'hisparse-triton[metrics]'``);
- ``server``: ``MetricsServer``: ``/metrics`` and ``/verdict`` over HTTP (same extra).

Importing this package needs neither torch nor ``prometheus_client``: names load on first
use, and only the collector and the server ask for ``prometheus_client`` (an ``ImportError``
naming the extra).
"""

from __future__ import annotations

import importlib
from typing import Any

#: Public names -> the module that defines them.
_EXPORTS = {
    "DEFAULT_WINDOW": "hisparse_triton.metrics.sampler",
    "Deployment": "hisparse_triton.metrics.verdict",
    "HiSparseCollector": "hisparse_triton.metrics.prometheus",
    "HiSparseMetrics": "hisparse_triton.metrics.sampler",
    "METRICS": "hisparse_triton.metrics.prometheus",
    "MetricsSample": "hisparse_triton.metrics.sampler",
    "MetricsServer": "hisparse_triton.metrics.server",
    "Observation": "hisparse_triton.metrics.verdict",
    "StepTimer": "hisparse_triton.metrics.timing",
    "StepTimes": "hisparse_triton.metrics.timing",
    "Verdict": "hisparse_triton.metrics.verdict",
    "VerdictSettings": "hisparse_triton.metrics.verdict",
    "live_verdict": "hisparse_triton.metrics.verdict",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'hisparse_triton.metrics' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})
