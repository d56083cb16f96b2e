"""How a figure is timed: medians of many calls, caches flushed, rotated inputs.

- ``device_time``: device-only work on CUDA (Triton kernels, contiguous copies):
  ``triton.testing.do_bench`` (CUDA events around each call, L2 cleared before each, median
  and the 20th / 80th percentiles).
- ``event_time``: the same with an untimed ``setup`` before every call (``resolve`` restores
  its state there): CUDA events, the L2 flush after ``setup``.
- ``wall_time``: work with a host part (torch paths, eager baseline), and everything on CPU:
  ``perf_counter`` around each call, the device synchronised before and after.
- ``capture_graph``: a CUDA graph of a callable (warmed up on a side stream first).

Every function returns a ``Timing`` in milliseconds. ``Rotation`` makes each call use the next
input of a rotation whose buffers span more than the L2 (so no call is served from cache).
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable, NamedTuple, Optional

import torch


class Timing(NamedTuple):
    """Median and spread (20th / 80th percentile) of one timed call, in ms; ``probe_us``:
    the CPU-speed probe around the measurement (``noise.CpuProbe``; the slower of the
    samples before and after), when one ran."""

    median_ms: float
    p20_ms: float
    p80_ms: float
    reps: int
    probe_us: Optional[float] = None


def _quantile(sorted_times: list[float], q: float) -> float:
    return sorted_times[min(len(sorted_times) - 1, max(0, round(q * (len(sorted_times) - 1))))]


def summarise(times: list[float]) -> Timing:
    """``Timing`` of a list of per-call times (ms)."""
    ordered = sorted(times)
    return Timing(float(statistics.median(ordered)), _quantile(ordered, 0.2),
                  _quantile(ordered, 0.8), len(ordered))


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class L2Flush:
    """Writes a buffer of ``nbytes`` (CUDA only; a no-op elsewhere) to evict the L2."""

    def __init__(self, device: torch.device, nbytes: int) -> None:
        self.buffer = (torch.empty(max(nbytes, 4) // 4, dtype=torch.int32, device=device)
                       if device.type == "cuda" else None)

    def __call__(self) -> None:
        if self.buffer is not None:
            self.buffer.zero_()


class Rotation:
    """Calls ``fn(i)`` for ``i = 0, 1, ..., n - 1, 0, ...``: each call uses the next
    buffer / plan of a rotation."""

    def __init__(self, n: int, fn: Callable[[int], Any]) -> None:
        self.n = max(1, n)
        self.fn = fn
        self.i = 0

    def __call__(self) -> Any:
        i = self.i
        self.i = (i + 1) % self.n
        return self.fn(i)


def _reps(estimate_ms: float, budget_ms: float, lo: int, hi: int) -> int:
    return int(min(hi, max(lo, budget_ms / max(estimate_ms, 1e-4))))


def wall_time(fn: Callable[[], Any], device: torch.device, *, warmup_ms: float, rep_ms: float,
              setup: Optional[Callable[[], None]] = None, max_reps: int = 1000) -> Timing:
    """Wall time of ``fn`` with ``device`` synchronised around every call; ``setup`` runs
    untimed before every call (state restore, L2 flush). At least 3 timed calls.

    For work with a host part (CPU indexing, synchronous copies): CUDA events would miss the
    CPU time spent before the first kernel."""
    setup = setup or (lambda: None)
    setup()
    sync(device)
    start = time.perf_counter()
    fn()
    sync(device)
    estimate = (time.perf_counter() - start) * 1e3
    for _ in range(_reps(estimate, warmup_ms, 0, max_reps)):
        setup()
        fn()
    times = []
    for _ in range(_reps(estimate, rep_ms, 3, max_reps)):
        setup()
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append((time.perf_counter() - t0) * 1e3)
    return summarise(times)


def device_time(fn: Callable[[], Any], *, warmup_ms: float, rep_ms: float,
                min_reps: int = 10) -> Timing:
    """``triton.testing.do_bench`` of device-only work (CUDA): CUDA-event time of every call,
    L2 cleared before each; at least ``min_reps`` timed calls (``do_bench`` is asked again
    when ``rep_ms`` held fewer, as it does for calls of several ms)."""
    import triton.testing

    times = list(triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="all"))
    if len(times) < min_reps:
        more = (min_reps - len(times)) * (statistics.median(times) + 0.1) * 1.2
        times += triton.testing.do_bench(fn, warmup=0, rep=more, return_mode="all")
    return summarise(times)


def event_time(fn: Callable[[], Any], setup: Callable[[], None], flush: L2Flush, *,
               warmup_ms: float, rep_ms: float, max_reps: int = 10000) -> Timing:
    """CUDA-event time of ``fn``, each call preceded by ``setup()`` then ``flush()`` (both
    untimed, in stream order). ``do_bench`` with a setup hook."""
    fn()  # compile / allocate
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(3):
        setup()
        flush()
        fn()
    torch.cuda.synchronize()
    estimate = (time.perf_counter() - t0) * 1e3 / 3
    for _ in range(_reps(estimate, warmup_ms, 1, max_reps)):
        setup()
        flush()
        fn()
    n = _reps(estimate, rep_ms, 5, max_reps)
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
    for i in range(n):
        setup()
        flush()
        starts[i].record()
        fn()
        ends[i].record()
    torch.cuda.synchronize()
    return summarise([s.elapsed_time(e) for s, e in zip(starts, ends)])


def capture_graph(fn: Callable[[], Any], warmup_calls: int = 2) -> tuple[Any, Any]:
    """``(graph, output)``: ``fn`` captured in a CUDA graph after ``warmup_calls`` calls on a
    side stream (compilation, allocator warm-up); ``graph.replay()`` reruns it and rewrites
    ``output`` (what ``fn`` returned during capture) in place."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(warmup_calls):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        output = fn()
    torch.cuda.synchronize()
    return graph, output


class Measurer:
    """What the measuring classes share: the sweep ``settings``, the ``device``, the progress
    callback ``step(note)`` (called after every figure), an L2 flush of
    ``settings.rotate_bytes`` (CUDA) for wall-clock calls and the run's CPU-speed ``probe``
    (``noise.CpuProbe``, sampled around every timing by ``watched``; a new one when none is
    given); ``methods`` the ones that run on ``device`` (``triton`` needs CUDA)."""

    def __init__(self, settings: Any, device: torch.device,
                 step: Optional[Callable[[str], None]] = None, *, probe: Any = None) -> None:
        from hisparse_triton.benchmarks.noise import CpuProbe

        self.s = settings
        self.device = device
        self.cuda = device.type == "cuda"
        self.step = step or (lambda note: None)
        self.flush = L2Flush(device, settings.rotate_bytes if self.cuda else 0)
        self.methods = [m for m in settings.methods if self.cuda or m != "triton"]
        self.probe = probe if probe is not None else CpuProbe()

    def watched(self, measure: Callable[[], Timing]) -> Timing:
        """``measure()`` with the CPU-speed probe sampled just before and just after it; the
        slower sample goes into the timing's ``probe_us``."""
        before = self.probe.sample()
        timing = measure()
        return timing._replace(probe_us=max(before, self.probe.sample()))


def gbps(nbytes: int, ms: float) -> float:
    """Decimal GB/s (1e9 bytes per second) of ``nbytes`` moved in ``ms`` milliseconds."""
    return nbytes / (ms * 1e-3) / 1e9 if ms > 0 else float("inf")
