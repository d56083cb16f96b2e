"""Decode-step device time from CUDA events, read without a host sync: ``StepTimer``.

``start()`` and ``stop()`` record an event each on the current stream (no wait); ``poll()``
reads the pairs whose end event the device has passed (``Event.query()``, which never
blocks) and adds their elapsed time to a histogram. A pair the device has not reached yet
stays pending for a later poll, so the decode path never waits for the device. Events are
reused from a small pool. On a CPU device there are no device events: the timer records
nothing and ``reason`` says so.
"""

from __future__ import annotations

import contextlib
from collections import deque
from dataclasses import dataclass
from typing import Any, Iterator, Optional

#: Upper bounds (seconds) of the step-time histogram's buckets (``+Inf`` is implied).
STEP_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
#: Event pairs kept pending at most; older ones are read first (``poll`` on ``stop``).
MAX_PENDING = 4096


@dataclass(frozen=True)
class StepTimes:
    """Steps timed so far: ``count``, total ``seconds``, ``buckets`` (cumulative counts per
    upper bound of ``STEP_BUCKETS``, then ``+Inf``) and ``last`` (seconds of the last step
    read, None before the first). ``available`` False (and ``reason``) when the device has
    no events to time with."""

    available: bool
    reason: Optional[str]
    count: int = 0
    seconds: float = 0.0
    buckets: tuple[int, ...] = ()
    last: Optional[float] = None


class StepTimer:
    """Times steps on ``device`` with CUDA events (module docstring). ``enabled=False``
    records nothing (``reason`` says it was turned off)."""

    def __init__(self, device: Any, *, enabled: bool = True) -> None:
        kind = getattr(device, "type", str(device))
        self.available = bool(enabled) and kind == "cuda"
        if not enabled:
            self.reason: Optional[str] = "step timing turned off"
        elif kind != "cuda":
            self.reason = (f"no step timings on a {kind} device: they are read from CUDA "
                           f"events (a GPU), never from host clocks around asynchronous work")
        else:
            self.reason = None
        self._device = device
        self._free: list[Any] = []
        self._pending: deque[tuple[Any, Any]] = deque()
        self._open: Optional[Any] = None
        self._counts = [0] * (len(STEP_BUCKETS) + 1)
        self._count, self._seconds, self._last = 0, 0.0, None

    def _event(self) -> Any:
        if self._free:
            return self._free.pop()
        import torch

        return torch.cuda.Event(enable_timing=True)

    def start(self) -> None:
        """Record the start of a step on the current stream (no wait)."""
        if not self.available:
            return
        if self._open is not None:
            raise ValueError("StepTimer.start(): the previous step was not stopped.")
        import torch

        with torch.cuda.device(self._device):
            event = self._event()
            event.record()
        self._open = event

    def stop(self) -> None:
        """Record the end of the step started last (no wait)."""
        if not self.available:
            return
        if self._open is None:
            raise ValueError("StepTimer.stop(): no step was started.")
        import torch

        with torch.cuda.device(self._device):
            end = self._event()
            end.record()
        self._pending.append((self._open, end))
        self._open = None
        if len(self._pending) > MAX_PENDING:
            self.poll()
            while len(self._pending) > MAX_PENDING:  # the device is far behind: drop
                self._free.extend(self._pending.popleft())

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        """``with timer.step():`` around one step's device work (a step that raises is
        not timed)."""
        self.start()
        try:
            yield
        except BaseException:
            if self._open is not None:
                self._free.append(self._open)
                self._open = None
            raise
        self.stop()

    def poll(self) -> None:
        """Read every pending pair the device has finished, oldest first (never waits)."""
        while self._pending and self._pending[0][1].query():
            start, end = self._pending.popleft()
            seconds = start.elapsed_time(end) / 1e3
            self._free += [start, end]
            self._count += 1
            self._seconds += seconds
            self._last = seconds
            bucket = next((i for i, bound in enumerate(STEP_BUCKETS) if seconds <= bound),
                          len(STEP_BUCKETS))
            self._counts[bucket] += 1

    def times(self) -> StepTimes:
        """The steps read so far (call ``poll`` first for the newest)."""
        cumulative, total = [], 0
        for n in self._counts:
            total += n
            cumulative.append(total)
        return StepTimes(available=self.available, reason=self.reason, count=self._count,
                         seconds=self._seconds, buckets=tuple(cumulative), last=self._last)


__all__ = ["MAX_PENDING", "STEP_BUCKETS", "StepTimer", "StepTimes"]
