"""``HiSparseMetrics``: samples a runtime's (or a worker's and a scheduler's) counters without
a host sync, keeps a window of them, and gives the live verdict.

The thread that drives the runtime calls ``sample()`` between steps (every step, or every N
steps: each sample starts one small device -> host copy of the counters, ``stats_async``,
and reads the scheduler's occupancy, which is plain Python). A sample is published once its
copy has landed (``StatsSnapshot.ready()``, never waited for on the decode path);
``flush()`` waits for the ones in flight (for the end of a run). Readers on any thread (a
Prometheus scrape, ``verdict()``) see only published samples, under a lock.

The observed steady-state miss rate is the counters' growth between the oldest and the
newest sample of the window (the last ``window + 1`` samples): cold starts before the window
are left out; with fewer samples it is the growth since the counters started.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Optional

from hisparse_triton.metrics.timing import StepTimer, StepTimes
from hisparse_triton.metrics.verdict import (
    Deployment,
    Observation,
    Verdict,
    VerdictSettings,
    live_verdict,
)

#: Samples in the steady-state window by default (the oldest of ``window + 1`` is the base).
DEFAULT_WINDOW = 16


@dataclass(frozen=True)
class MetricsSample:
    """One published sample: ``index`` (0, 1, ... in order), ``time`` (``time.monotonic()``
    when it was taken), the worker's ``WorkerStats`` and per index group ``GroupCounts``
    (both from one counter copy), the scheduler's ``SchedulerStats`` read at the same point
    (None without a scheduler), ``steps`` (``StepTimes``: the device-timed steps read so
    far), and the rows each way: ``h2d_rows`` (each miss copied into every layer of its
    index group) and ``d2h_rows`` (rows mirrored; None when the source layers' rows differ
    in size)."""

    index: int
    time: float
    worker: Any
    groups: tuple[Any, ...]
    scheduler: Optional[Any]
    steps: StepTimes
    h2d_rows: int
    d2h_rows: Optional[int]


class HiSparseMetrics:
    """Live counters and the verdict of one runtime, or of a worker (+ its scheduler).

    - ``runtime``: a ``HiSparseRuntime``; or ``worker`` (a ``HiSparseWorker``) and
      optionally ``scheduler`` (a ``HiSparseScheduler``; without it the pool and request
      gauges are absent): the split halves of a serving stack, in the worker's process.
    - ``verdict``: ``VerdictSettings`` for the live verdict (None: no verdict).
    - ``window``: samples in the steady-state window (module docstring); None = every
      sample since the first (the first is then the base).
    - ``step_timer``: time steps with CUDA events (``step()``); off, or on a CPU device,
      no step timings (``steps.reason`` says why).
    """

    def __init__(self, runtime: Any = None, *, worker: Any = None, scheduler: Any = None,
                 verdict: Optional[VerdictSettings] = None,
                 window: Optional[int] = DEFAULT_WINDOW, step_timer: bool = True) -> None:
        if runtime is not None:
            if worker is not None or scheduler is not None:
                raise ValueError("give a runtime, or a worker (and a scheduler), not both.")
            worker, scheduler = runtime.worker, runtime.scheduler
        if worker is None:
            raise ValueError("HiSparseMetrics needs a runtime or a worker.")
        if window is not None and (not isinstance(window, int) or isinstance(window, bool)
                                   or window < 1):
            raise ValueError(f"window must be an int >= 1 or None, got {window!r}.")
        if verdict is not None and not isinstance(verdict, VerdictSettings):
            raise ValueError(f"verdict must be VerdictSettings or None, got "
                             f"{type(verdict).__name__}.")
        self.worker, self.scheduler = worker, scheduler
        self.verdict_settings = verdict
        self.window = window
        self.deployment = Deployment.of(worker)
        groups = worker.groups.index_groups
        #: Index-group leaders, in counter order, and the layers each miss is copied into.
        self.leaders = tuple(ig.leader for ig in groups)
        self._group_layers = tuple(len(ig.layers) for ig in groups)
        rows = {int(worker.host_cache(layer).shape[-1]) for layer in
                worker.groups.source_layers}
        self._row_bytes = rows.pop() if len(rows) == 1 else None
        self.timer = StepTimer(worker.device, enabled=step_timer)
        self._pending: deque[tuple[float, Any, Any]] = deque()
        self._samples: deque[MetricsSample] = deque(
            maxlen=None if window is None else window + 1)
        self._taken = 0
        self._lock = threading.Lock()
        self._verdict_lock = threading.Lock()
        self._verdict_key: Optional[tuple[int, int]] = None
        self._verdict: Optional[Verdict] = None
        self._verdict_error: Optional[str] = None

    # ------------------------------------------------------------------ the driving thread
    def sample(self) -> None:
        """Take a sample now (between steps, on the thread that drives the runtime): starts
        the counters' copy (``stats_async``, no host sync), reads the scheduler's occupancy
        and publishes every earlier sample whose copy has landed."""
        scheduler = self.scheduler.stats() if self.scheduler is not None else None
        snapshot = self.worker.stats_async()
        self._pending.append((time.monotonic(), snapshot, scheduler))
        self._publish(wait=False)

    def step(self) -> Any:
        """``with metrics.step():`` around one decode step's device work: its device time
        from CUDA events (a no-op without a GPU)."""
        return self.timer.step()

    def flush(self) -> None:
        """Wait for the samples in flight (their counter copies only) and publish them: for
        the end of a run, not the decode path."""
        self._publish(wait=True)

    def _publish(self, *, wait: bool) -> None:
        self.timer.poll()
        steps = self.timer.times()
        while self._pending and (wait or self._pending[0][1].ready()):
            taken, snapshot, scheduler = self._pending.popleft()
            stats, groups = snapshot.result(), snapshot.groups()
            h2d_rows = sum(g.misses * n for g, n in zip(groups, self._group_layers))
            d2h_rows = (stats.d2h_bytes // self._row_bytes if self._row_bytes else None)
            sample = MetricsSample(index=self._taken, time=taken, worker=stats,
                                   groups=groups, scheduler=scheduler, steps=steps,
                                   h2d_rows=h2d_rows, d2h_rows=d2h_rows)
            self._taken += 1
            with self._lock:
                self._samples.append(sample)

    # ------------------------------------------------------------------ readers (any thread)
    def latest(self) -> Optional[MetricsSample]:
        """The newest published sample (None before the first)."""
        with self._lock:
            return self._samples[-1] if self._samples else None

    def samples(self) -> tuple[MetricsSample, ...]:
        """The published samples of the window, oldest first."""
        with self._lock:
            return tuple(self._samples)

    def _ends(self) -> tuple[Optional[MetricsSample], Optional[MetricsSample], bool]:
        """``(base, last, since_start)`` of the window: ``base`` None (growth since the
        counters started) until the window is full."""
        with self._lock:
            if not self._samples:
                return None, None, True
            n = len(self._samples)
            full = n > 1 if self.window is None else n == self.window + 1
            base = self._samples[0] if full else None
            return base, self._samples[-1], base is None

    def observation(self) -> Observation:
        """Hits and misses over the window (module docstring); zero before any sample."""
        base, last, since_start = self._ends()
        if last is None:
            return Observation(0, 0, 0.0, 0, True)
        hits0, misses0, t0 = ((base.worker.hits, base.worker.misses, base.time)
                              if base is not None else (0, 0, last.time))
        return Observation(hits=last.worker.hits - hits0, misses=last.worker.misses - misses0,
                           seconds=last.time - t0,
                           samples=last.index - (base.index if base else last.index) + 1,
                           since_start=since_start)

    def group_miss_rates(self) -> dict[str, float]:
        """Per index group (by leader), misses / (hits + misses) over the window (0.0 for a
        group that resolved nothing in it)."""
        base, last, _ = self._ends()
        if last is None:
            return {leader: 0.0 for leader in self.leaders}
        out = {}
        for i, g in enumerate(last.groups):
            hits, misses = g.hits, g.misses
            if base is not None:
                hits, misses = hits - base.groups[i].hits, misses - base.groups[i].misses
            out[g.leader] = misses / (hits + misses) if hits + misses else 0.0
        return out

    def verdict(self) -> Verdict:
        """The live verdict over the window (``metrics.verdict.live_verdict``), computed once
        per new sample. ``ValueError`` without ``VerdictSettings``, before any top-k column
        was resolved in the window, or when the advise model refuses the inputs."""
        if self.verdict_settings is None:
            raise ValueError("no verdict: this HiSparseMetrics was built without "
                             "VerdictSettings (pass verdict=VerdictSettings(preset=...)).")
        with self._verdict_lock:
            base, last, _ = self._ends()
            key = (-1 if base is None else base.index, -1 if last is None else last.index)
            if key != self._verdict_key:
                try:
                    verdict, error = live_verdict(self.observation(), self.deployment,
                                                  self.verdict_settings), None
                except ValueError as exc:
                    verdict, error = None, " ".join(str(exc).split())
                self._verdict_key, self._verdict, self._verdict_error = key, verdict, error
            if self._verdict is None:
                raise ValueError(self._verdict_error)
            return self._verdict

    def verdict_text(self) -> str:
        """The verdict in one line, or why there is none yet."""
        try:
            return self.verdict().text
        except ValueError as exc:
            return f"HiSparse verdict: none yet: {exc}"

    def collector(self, **kwargs: Any) -> Any:
        """A Prometheus collector over these metrics (``HiSparseCollector``; needs the
        ``metrics`` extra: ``pip install 'hisparse-triton[metrics]'``)."""
        from hisparse_triton.metrics.prometheus import HiSparseCollector

        return HiSparseCollector(self, **kwargs)


__all__ = ["DEFAULT_WINDOW", "HiSparseMetrics", "MetricsSample"]
