"""Resolve figures: latency of one decode step of ``ops.resolve`` per method.

Every timed call starts from the same state: ``ResolveWorkload`` snapshots a warm hot buffer
(full, LRU order of real use) and ``restore()`` puts it back before each call (untimed), so
the step's miss ratio is exactly the prescribed one (``measured_miss_ratio`` is read from the
``stats`` of a checked call). Methods:

- ``triton``: one call through ``ops.resolve`` (one kernel launch), CUDA events around the
  call, L2 flushed after the restore (``timing.event_time``). When the CPU cannot enqueue the
  launches faster than the GPU runs them, the figure includes that launch cost: it is what an
  eager Python caller pays;
- ``triton_graph`` (CUDA, with ``triton``): the same call captured in a CUDA graph and
  replayed (the decode-loop cost, no launch overhead); same restore / flush before each replay;
- ``torch``: ``ops.resolve(backend="torch")`` (the reference), wall clock.

Verification: from the snapshot, every method's outputs and new state must equal the torch
reference's bit for bit (``verified``); ``vs_torch`` is the speed-up over the reference.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from hisparse_triton.benchmarks.figures import Figure, round_sig
from hisparse_triton.benchmarks.settings import GRAPH_METHOD, KERNEL_METHODS, BenchSettings
from hisparse_triton.benchmarks.timing import (
    Measurer,
    Timing,
    capture_graph,
    event_time,
    sync,
    wall_time,
)
from hisparse_triton.benchmarks.workloads import ResolveWorkload

WRONG_RESULT = "outputs or state differ from the torch reference"


def _ops() -> Any:
    from hisparse_triton import ops  # looked up at call time (tests patch it)

    return ops


def _same(a: Any, b: Any) -> bool:
    return all(torch.equal(x.cpu(), y.cpu()) for x, y in zip(a, b))


class ResolveBench(Measurer):
    """Measures the resolve figures of one sweep (``BenchSettings``) on ``device``;
    ``step(note)`` is called after every figure (progress)."""

    s: BenchSettings

    def __init__(self, settings: BenchSettings, device: torch.device,
                 step: Optional[Callable[[str], None]] = None, *, probe: Any = None) -> None:
        super().__init__(settings, device, step, probe=probe)
        self.methods = [m for m in self.methods if m in KERNEL_METHODS]

    def case(self, batch: int, ratio: float) -> list[Figure]:
        """Figures of every method for ``batch`` requests at miss ratio ``ratio``."""
        s = self.s
        params: dict[str, Any] = {"batch": batch, "top_k": s.top_k, "hot_slots": s.hot_slots,
                                  "seq_len": s.seq_len, "miss_ratio": ratio}
        figures: list[Figure] = []
        try:
            work = ResolveWorkload(batch, s.top_k, s.hot_slots, s.seq_len, ratio, self.device,
                                   seed=s.seed)
            expected = self._reference(work)
        except Exception as exc:  # noqa: BLE001 - the case fails, the run goes on
            for method in self.methods:
                figures.append(Figure("resolve", method, params,
                                      error=f"{type(exc).__name__}: {exc}"))
                self.step(f"resolve b{batch} {method}")
            return figures
        stats = expected[0][4].sum(dim=0).cpu()  # ResolveResult.stats: (hits, misses, masked)
        params["measured_miss_ratio"] = round_sig(int(stats[1]) / max(int(stats.sum()), 1))
        params["state_bytes"] = work.state_bytes
        for method in self.methods:
            note = f"resolve b{batch} k{s.top_k} h{s.hot_slots} {method}"
            figures += self._measure(work, method, params, expected)
            self.step(note)
        torch_fig = next((f for f in figures if f.method == "torch" and f.time_us), None)
        if torch_fig is not None:
            for fig in figures:
                if fig.time_us:
                    fig.vs_torch = torch_fig.time_us / fig.time_us
        return figures

    def _call(self, work: ResolveWorkload, backend: str) -> Callable[[], Any]:
        ops = _ops()
        return lambda: ops.resolve(*work.args(), **work.kwargs, backend=backend)

    def _reference(self, work: ResolveWorkload) -> tuple[Any, tuple[torch.Tensor, ...]]:
        """The torch reference's outputs and new state from the snapshot."""
        from hisparse_triton.ops.resolve import reference

        work.restore()
        out = reference.resolve(*work.args(), **work.kwargs)
        return tuple(t.clone() for t in out), (work.slot_host_rows.clone(), work.lru.clone())

    def _check(self, work: ResolveWorkload, run: Callable[[], Any],
               expected: tuple[Any, tuple[torch.Tensor, ...]]) -> Optional[bool]:
        if not self.s.verify:
            return None
        work.restore()
        out = run()
        sync(self.device)
        ok = _same(out, expected[0]) and _same((work.slot_host_rows, work.lru), expected[1])
        return ok

    def _measure(self, work: ResolveWorkload, method: str, params: dict[str, Any],
                 expected: tuple[Any, tuple[torch.Tensor, ...]]) -> list[Figure]:
        try:
            call = self._call(work, method)
            ok = self._check(work, call, expected)
            timing = self._time(call, work, host_part=method != "triton")
        except Exception as exc:  # noqa: BLE001
            return [Figure("resolve", method, params, error=f"{type(exc).__name__}: {exc}")]
        figures = [Figure("resolve", method, params, timing, verified=ok,
                          error=None if ok is not False else WRONG_RESULT)]
        if method == "triton" and self.cuda and self.s.graph:
            try:
                work.restore()
                graph, output = capture_graph(call)

                def replay() -> Any:
                    graph.replay()
                    return output

                ok = self._check(work, replay, expected)
                timing = self._time(graph.replay, work, host_part=False)
                figures.append(Figure("resolve", GRAPH_METHOD, params, timing, verified=ok,
                                      error=None if ok is not False else WRONG_RESULT))
            except Exception as exc:  # noqa: BLE001
                figures.append(Figure("resolve", GRAPH_METHOD, params,
                                      error=f"{type(exc).__name__}: {exc}"))
        return figures

    def _time(self, fn: Callable[[], Any], work: ResolveWorkload, *, host_part: bool) -> Timing:
        if self.cuda and not host_part:
            return self.watched(lambda: event_time(fn, work.restore, self.flush,
                                                   warmup_ms=self.s.warmup_ms,
                                                   rep_ms=self.s.rep_ms))

        def setup() -> None:
            work.restore()
            self.flush()

        return self.watched(lambda: wall_time(fn, self.device, warmup_ms=self.s.warmup_ms,
                                              rep_ms=self.s.rep_ms, setup=setup))
