"""Recorded top-k traces: the ``.npz`` file ``simulate --record`` writes and ``simulate
--trace`` replays (no torch).

A trace is a decode schedule and what the indexer selected at every step: one *record* per
(decode step, request), holding that request's length at the step and, for each of the
trace's index groups ("layers"), its ``top_k`` selected positions. Arrays of the file
(``np.savez_compressed``; every scalar is a 0-d array):

| key | shape, dtype | meaning |
| --- | --- | --- |
| ``format`` | ``str`` | ``"hisparse-triton/topk-trace"`` |
| ``version`` | ``int64`` | ``1``; a reader refuses other versions |
| ``top_k`` | ``int64`` | columns per selection (``K``) |
| ``prompt_len`` | ``[N] int64`` | prompt tokens of request ``i`` (requests are ``0..N-1``) |
| ``output_len`` | ``[N] int64`` | tokens request ``i`` may generate (its reservation is the sum) |
| ``step`` | ``[M] int64`` | decode step of each record, non-decreasing |
| ``request`` | ``[M] int64`` | request of each record; at most one record per (step, request) |
| ``seq_len`` | ``[M] int64`` | the request's tokens at that step, the token being decoded included: positions ``[0, seq_len)`` are valid; per request strictly increasing, in ``(prompt_len, prompt_len + output_len]`` |
| ``positions`` | ``[M, L, K] int32`` | the selected positions per index group, in column order; ``-1`` (or any value outside ``[0, seq_len)``) = no selection |
| ``metadata`` | ``str`` (JSON) | free-form: who wrote it, preset, workload, seed; ``simulate --record`` adds ``"simulate"`` (the run's layers and pool settings, which a replay uses) |

A request is live from its first record to its last: replay admits it (reserving
``prompt_len + output_len`` tokens and prefilling ``prompt_len``) before its first record's
step and frees it after its last. ``L`` index groups are replayed onto the first ``L`` leaders
of the runtime.
"""

from __future__ import annotations

import io
import json
import os
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional, Sequence

import numpy as np

from hisparse_triton.fileio import write_atomically

#: ``format`` of a trace file.
TRACE_FORMAT = "hisparse-triton/topk-trace"
#: ``version`` of the files this module writes; a file of another version is refused.
TRACE_VERSION = 1

_KEYS = ("format", "version", "top_k", "prompt_len", "output_len", "step", "request",
         "seq_len", "positions", "metadata")


class TraceFormatError(ValueError):
    """A trace file that is not a valid ``hisparse-triton/topk-trace`` (says why)."""


@dataclass
class TopkTraceFile:
    """A recorded trace (the arrays of the module docstring); ``validate()`` checks it."""

    top_k: int
    prompt_len: np.ndarray
    output_len: np.ndarray
    step: np.ndarray
    request: np.ndarray
    seq_len: np.ndarray
    positions: np.ndarray
    metadata: dict[str, Any] = field(default_factory=dict)

    @property
    def num_requests(self) -> int:
        return int(self.prompt_len.shape[0])

    @property
    def num_layers(self) -> int:
        """Index groups per record (``L``)."""
        return int(self.positions.shape[1])

    @property
    def num_records(self) -> int:
        return int(self.step.shape[0])

    @property
    def max_len(self) -> int:
        """The longest reservation (``prompt_len + output_len``) of any request."""
        return int((self.prompt_len + self.output_len).max())

    def validate(self) -> "TopkTraceFile":
        """Raise ``TraceFormatError`` naming the first inconsistency; returns ``self``."""
        def bad(message: str) -> TraceFormatError:
            return TraceFormatError(f"invalid top-k trace: {message}.")

        if isinstance(self.top_k, bool) or not isinstance(self.top_k, (int, np.integer)) \
                or self.top_k < 1:
            raise bad(f"top_k must be an int >= 1, got {self.top_k!r}")
        n = self.prompt_len.shape[0] if self.prompt_len.ndim == 1 else -1
        if n < 1 or self.output_len.shape != (n,):
            raise bad(f"prompt_len and output_len must be [N] arrays of one length N >= 1, "
                      f"got {self.prompt_len.shape} and {self.output_len.shape}")
        if (self.prompt_len < 1).any() or (self.output_len < 0).any():
            raise bad("prompt_len must be >= 1 and output_len >= 0 for every request")
        m = self.step.shape[0] if self.step.ndim == 1 else -1
        for name in ("request", "seq_len"):
            if getattr(self, name).shape != (m,):
                raise bad(f"{name} must have the shape of step, [{m}], got "
                          f"{getattr(self, name).shape}")
        if m < 1:
            raise bad("it has no records")
        if self.positions.ndim != 3 or self.positions.shape[0] != m \
                or self.positions.shape[2] != self.top_k or self.positions.shape[1] < 1:
            raise bad(f"positions must be [records={m}, layers>=1, top_k={self.top_k}], got "
                      f"{self.positions.shape}")
        for name in ("prompt_len", "output_len", "step", "request", "seq_len", "positions"):
            if not np.issubdtype(getattr(self, name).dtype, np.integer):
                raise bad(f"{name} must hold integers, got {getattr(self, name).dtype}")
        if (np.diff(self.step) < 0).any() or self.step[0] < 0:
            raise bad("steps must be >= 0 and non-decreasing")
        if (self.request < 0).any() or (self.request >= n).any():
            raise bad(f"request ids must lie in [0, {n})")
        pairs = self.step.astype(np.int64) * n + self.request
        if np.unique(pairs).size != m:
            raise bad("a (step, request) pair appears twice")
        order = np.lexsort((self.step, self.request))
        req, seq = self.request[order], self.seq_len[order]
        same = req[1:] == req[:-1]
        if (seq[1:][same] <= seq[:-1][same]).any():
            raise bad("a request's seq_len must increase from one of its records to the next")
        low = self.prompt_len[self.request]
        high = low + self.output_len[self.request]
        if (self.seq_len <= low).any() or (self.seq_len > high).any():
            i = int(np.flatnonzero((self.seq_len <= low) | (self.seq_len > high))[0])
            raise bad(f"record {i}: seq_len {int(self.seq_len[i])} of request "
                      f"{int(self.request[i])} is outside (prompt_len, prompt_len + "
                      f"output_len] = ({int(low[i])}, {int(high[i])}]")
        return self

    def steps(self) -> Iterator[tuple[int, np.ndarray]]:
        """``(step, record indices)`` in step order, the records in file order."""
        bounds = np.flatnonzero(np.diff(self.step)) + 1
        for chunk in np.split(np.arange(self.num_records), bounds):
            yield int(self.step[chunk[0]]), chunk

    def lifetimes(self) -> tuple[np.ndarray, np.ndarray]:
        """``(first, last)`` record step of every request (``-1`` for one without records)."""
        first = np.full(self.num_requests, -1, dtype=np.int64)
        last = np.full(self.num_requests, -1, dtype=np.int64)
        for i in range(self.num_records - 1, -1, -1):
            first[self.request[i]] = self.step[i]
        for i in range(self.num_records):
            last[self.request[i]] = self.step[i]
        return first, last

    def max_live(self) -> int:
        """The most requests live at once (state rows a replay needs)."""
        first, last = self.lifetimes()
        ok = first >= 0
        events = np.concatenate([first[ok] * 2, last[ok] * 2 + 1])
        deltas = np.concatenate([np.ones(ok.sum(), np.int64), -np.ones(ok.sum(), np.int64)])
        return int(np.cumsum(deltas[np.argsort(events, kind="stable")]).max())

    def streams(self, *, layers: Optional[Sequence[int]] = None) -> dict[tuple[int, int],
                                                                          list[np.ndarray]]:
        """``{(request, layer): [valid positions of each of its records]}``: what one hot
        buffer would be asked for if no page were resident."""
        out: dict[tuple[int, int], list[np.ndarray]] = {}
        layer_ids = range(self.num_layers) if layers is None else layers
        for i in range(self.num_records):
            seq = self.seq_len[i]
            for layer in layer_ids:
                row = self.positions[i, layer]
                out.setdefault((int(self.request[i]), layer), []).append(
                    row[(row >= 0) & (row < seq)].astype(np.int64))
        return out


class TraceRecorder:
    """Collects records step by step (``add``) and builds a ``TopkTraceFile``."""

    def __init__(self, top_k: int, num_layers: int, metadata: Optional[dict] = None) -> None:
        self.top_k, self.num_layers = int(top_k), int(num_layers)
        self.metadata = dict(metadata or {})
        self._requests: dict[int, tuple[int, int]] = {}
        self._rows: list[tuple[int, int, int]] = []
        self._positions: list[np.ndarray] = []

    def add_request(self, request: int, prompt_len: int, output_len: int) -> None:
        self._requests[int(request)] = (int(prompt_len), int(output_len))

    def add(self, step: int, requests: Sequence[int], seq_lens: Sequence[int],
            positions: np.ndarray) -> None:
        """One decode step: ``positions`` is ``[len(requests), num_layers, top_k]``."""
        positions = np.asarray(positions, dtype=np.int32)
        if positions.shape != (len(requests), self.num_layers, self.top_k):
            raise ValueError(f"positions must be [{len(requests)}, {self.num_layers}, "
                             f"{self.top_k}], got {positions.shape}.")
        for request, seq_len, row in zip(requests, seq_lens, positions):
            self._rows.append((int(step), int(request), int(seq_len)))
            self._positions.append(row)

    def build(self) -> TopkTraceFile:
        if not self._rows:
            raise ValueError("nothing was recorded.")
        n = max(self._requests) + 1
        prompt = np.zeros(n, dtype=np.int64)
        output = np.zeros(n, dtype=np.int64)
        for request, (p, o) in self._requests.items():
            prompt[request], output[request] = p, o
        rows = np.asarray(self._rows, dtype=np.int64)
        return TopkTraceFile(top_k=self.top_k, prompt_len=prompt, output_len=output,
                             step=rows[:, 0], request=rows[:, 1], seq_len=rows[:, 2],
                             positions=np.stack(self._positions),
                             metadata=self.metadata).validate()


def save_trace(trace: TopkTraceFile, path: str) -> None:
    """Write ``trace`` (validated) to ``path`` atomically, permissions as ``open()`` gives."""
    trace.validate()
    arrays = {
        "format": np.asarray(TRACE_FORMAT), "version": np.asarray(TRACE_VERSION, np.int64),
        "top_k": np.asarray(trace.top_k, np.int64),
        "prompt_len": trace.prompt_len.astype(np.int64),
        "output_len": trace.output_len.astype(np.int64),
        "step": trace.step.astype(np.int64), "request": trace.request.astype(np.int64),
        "seq_len": trace.seq_len.astype(np.int64),
        "positions": trace.positions.astype(np.int32),
        "metadata": np.asarray(json.dumps(trace.metadata, sort_keys=True)),
    }
    buffer = io.BytesIO()
    np.savez_compressed(buffer, **arrays)
    write_atomically(path, buffer.getvalue(), suffix=".npz")


def load_trace(path: str) -> TopkTraceFile:
    """Read and validate a trace file; ``TraceFormatError`` says what is wrong with it."""
    try:
        with np.load(path, allow_pickle=False) as data:
            arrays = {key: data[key] for key in data.files}
    except FileNotFoundError:
        raise TraceFormatError(f"trace file {path!r} does not exist.") from None
    except (OSError, ValueError, EOFError) as exc:
        raise TraceFormatError(f"{path!r} is not a readable .npz trace ({exc}).") from None
    missing = [key for key in _KEYS if key not in arrays]
    fmt = str(arrays["format"]) if "format" in arrays else None
    if fmt != TRACE_FORMAT:
        raise TraceFormatError(f"{path!r} is not a {TRACE_FORMAT!r} file (format "
                               f"{fmt!r}).")
    version = int(arrays["version"]) if "version" in arrays else None
    if version != TRACE_VERSION:
        raise TraceFormatError(f"{path!r} is a version {version} trace; this version of "
                               f"hisparse-triton reads version {TRACE_VERSION}.")
    if missing:
        raise TraceFormatError(f"{path!r} lacks {', '.join(missing)}.")
    try:
        metadata = json.loads(str(arrays["metadata"]))
    except json.JSONDecodeError:
        raise TraceFormatError(f"{path!r}: metadata is not JSON.") from None
    trace = TopkTraceFile(top_k=int(arrays["top_k"]), prompt_len=arrays["prompt_len"],
                          output_len=arrays["output_len"], step=arrays["step"],
                          request=arrays["request"], seq_len=arrays["seq_len"],
                          positions=arrays["positions"],
                          metadata=metadata if isinstance(metadata, dict) else {})
    try:
        return trace.validate()
    except TraceFormatError as exc:
        raise TraceFormatError(f"{path!r}: {exc}") from None


def sample_trace_path() -> str:
    """The small trace shipped in the package (``tiny`` preset: 3 requests, 4 index groups,
    top-k 32), for tests and a first ``simulate --trace``."""
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "data",
                        "sample_trace.npz")


__all__ = ["TRACE_FORMAT", "TRACE_VERSION", "TopkTraceFile", "TraceFormatError",
           "TraceRecorder", "load_trace", "sample_trace_path", "save_trace"]
