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

Importing this package needs neither torch nor ``prometheus_client``: only building the
collector or the server asks for ``prometheus_client`` (an ``ImportError`` naming the
extra), and torch is imported where a runtime is used.
"""

from __future__ import annotations

from hisparse_triton.metrics.prometheus import METRICS, HiSparseCollector
from hisparse_triton.metrics.sampler import DEFAULT_WINDOW, HiSparseMetrics, MetricsSample
from hisparse_triton.metrics.server import MetricsServer
from hisparse_triton.metrics.timing import StepTimer, StepTimes
from hisparse_triton.metrics.verdict import (
    Deployment,
    Observation,
    Verdict,
    VerdictSettings,
    live_verdict,
)

__all__ = ["DEFAULT_WINDOW", "Deployment", "HiSparseCollector", "HiSparseMetrics", "METRICS",
           "MetricsSample", "MetricsServer", "Observation", "StepTimer", "StepTimes",
           "Verdict", "VerdictSettings", "live_verdict"]
