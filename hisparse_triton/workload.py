"""Synthetic top-k traces (for ``simulate``, ``advise``, tests and benchmarks) and pool sizing.

Two generators, both keyed by ``(request, index group)`` and called once per decode step with
the request's current length (``next(key, seq_len) -> [topk] int32``; while the history is
no longer than ``k`` the selection is the whole history, padded with -1, as a DSA indexer
does):

- ``TopkTrace`` (``locality``): one knob, the fraction of each step's ``k`` positions kept
  from the previous step's selection; the rest are fresh positions drawn uniformly.
- ``CalibratedTrace``: a score model whose LRU miss rates at ``k = 2048`` reproduce the
  published GLM-5.1 curve (buffer = k: 30%, 2k: 13.4%, 4k: 6.7%; ``PUBLISHED_MISS_RATES``)
  within one point at a 32K-token history (``CalibratedParams``; ``calibration_rates``
  measures it). Every position ``p`` has a score ``w * s(p) + d_t(p)``: ``s`` a fixed
  standard normal (how relevant the token is to this request: the stable working set),
  ``d_t`` a drift that moves as an AR(1) process of unit variance
  (``d_t = rho * d_{t-1} + sqrt(1 - rho^2) * e_t``, ``d_0`` standard normal, ``e_t`` uniform
  of unit variance: the part of relevance that follows the current query). A step selects the attention sinks (the first ``sink_fraction * k``
  positions), the recency window (the last ``recent_fraction * k``), a few fresh positions
  drawn uniformly (``fresh_fraction * k``: one-off lookups) and fills the rest of ``k``
  with the highest scores.

``plan_for_workload`` sizes both pools of a planner ``KVCacheConfig`` for a workload (what
``simulate`` and the tests build a runtime from).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Hashable, Mapping, Optional, Protocol

import numpy as np

from hisparse_triton.config import ACTIVE_TAIL_PAGES, GIB, EngineConfig, HiSparseConfig
from hisparse_triton.specs import KVCacheConfig, KVCacheSpec, cdiv, round_up

#: Trace generators ``make_trace`` builds (``simulate --workload``).
WORKLOADS = ("calibrated", "locality")

#: Published LRU miss rates of a GLM-5.1 top-k trace at k = 2048, by buffer size in units of
#: k (buffer = k, 2k, 4k): what ``CalibratedTrace`` reproduces.
PUBLISHED_MISS_RATES: dict[int, float] = {1: 0.30, 2: 0.134, 4: 0.067}
#: The top-k and history length (tokens) the published curve and the calibration refer to.
CALIBRATION_TOPK = 2048
CALIBRATION_HISTORY = 16 * CALIBRATION_TOPK


class TraceGenerator(Protocol):
    """What ``simulate`` and ``advise`` draw top-k selections from."""

    topk: int

    def next(self, key: Hashable, seq_len: int) -> np.ndarray: ...

    def forget(self, key_prefix: Optional[Hashable] = None) -> None: ...


def _check_topk(topk: object) -> int:
    if not isinstance(topk, (int, np.integer)) or isinstance(topk, bool) or topk < 1:
        raise ValueError(f"topk must be a positive int, got {topk!r}.")
    return int(topk)


def _whole_history(rng: np.random.Generator, k: int, seq_len: int) -> np.ndarray:
    out = np.full(k, -1, dtype=np.int32)
    if seq_len > 0:
        out[:seq_len] = rng.permutation(seq_len)
    return out


class _KeyedTrace:
    """Per-key state shared by both generators (``forget`` by request)."""

    def __init__(self, topk: int, seed: int) -> None:
        self.topk = _check_topk(topk)
        self._rng = np.random.default_rng(seed)
        self._state: dict[Hashable, object] = {}

    def forget(self, key_prefix: Optional[Hashable] = None) -> None:
        """Drop the history of every key ``(key_prefix, ...)`` (or of all keys)."""
        if key_prefix is None:
            self._state.clear()
            return
        for key in [k for k in self._state
                    if isinstance(k, tuple) and k and k[0] == key_prefix]:
            del self._state[key]


class TopkTrace(_KeyedTrace):
    """Top-k positions per ``(request, index group)`` key, step after step.

    - ``topk``: positions per selection (``k``).
    - ``locality``: in ``[0, 1]``; fraction of a step's selection repeated from the
      previous step's.
    - ``seed``: the trace is a pure function of the seed and the call sequence.
    """

    def __init__(self, topk: int, locality: float, seed: int = 0) -> None:
        super().__init__(topk, seed)
        if not 0.0 <= locality <= 1.0:
            raise ValueError(f"locality must be in [0, 1], got {locality!r}.")
        self.locality = locality

    def next(self, key: Hashable, seq_len: int) -> np.ndarray:
        """``[topk] int32``: the next selection for ``key`` over positions ``[0, seq_len)``.

        Distinct positions in random order; -1 padding while ``seq_len < topk``.
        """
        k = self.topk
        if seq_len <= k:
            out = _whole_history(self._rng, k, seq_len)
            self._state[key] = out[:max(seq_len, 0)].copy()
            return out
        previous = self._state.get(key)
        previous = previous[previous < seq_len] if previous is not None else previous
        keep_n = 0 if previous is None else min(int(round(self.locality * k)), previous.size)
        keep = (self._rng.choice(previous, keep_n, replace=False) if keep_n
                else np.empty(0, dtype=np.int64))
        taken = np.zeros(seq_len, dtype=bool)
        taken[keep] = True
        fresh = self._rng.choice(np.flatnonzero(~taken), k - keep_n, replace=False)
        chosen = np.concatenate([keep, fresh])
        self._rng.shuffle(chosen)
        out = chosen.astype(np.int32)
        self._state[key] = out.copy()
        return out


@dataclass(frozen=True)
class CalibratedParams:
    """Parameters of ``CalibratedTrace`` (defaults: fitted to ``PUBLISHED_MISS_RATES`` at
    ``k = 2048`` and a 32K-token history).

    - ``drift``: ``rho`` of the AR(1) drift, per decode step (0 = a new drift every step,
      1 = frozen).
    - ``stable_weight``: ``w``, weight of the fixed relevance against the drift.
    - ``fresh_fraction``: share of ``k`` drawn uniformly from the rest of the history.
    - ``sink_fraction`` / ``recent_fraction``: shares of ``k`` always taken from the start
      (attention sinks) and the end (recency window) of the history (at least 1 each).
    """

    drift: float = 0.55
    stable_weight: float = 2.8
    fresh_fraction: float = 0.065
    sink_fraction: float = 1 / 128
    recent_fraction: float = 1 / 32

    def __post_init__(self) -> None:
        checks = {"drift": 0 <= self.drift <= 1, "stable_weight": self.stable_weight >= 0}
        for name in ("fresh_fraction", "sink_fraction", "recent_fraction"):
            checks[name] = 0 <= getattr(self, name) <= 1
        for name, ok in checks.items():
            value = getattr(self, name)
            if not ok or not math.isfinite(value):
                raise ValueError(f"CalibratedParams.{name} out of range: {value!r}.")
        if self.fresh_fraction + self.sink_fraction + self.recent_fraction > 1:
            raise ValueError("CalibratedParams: fresh + sink + recent fractions exceed 1.")


#: Scale of a centred uniform [-0.5, 0.5) draw to unit variance.
_UNIFORM_SCALE = float(np.sqrt(12.0))


class _Scores:
    """One key's per-position scores: the fixed part and the drift (float32, grown on
    demand)."""

    __slots__ = ("stable", "drift", "length")

    def __init__(self) -> None:
        self.stable = np.empty(0, dtype=np.float32)
        self.drift = np.empty(0, dtype=np.float32)
        self.length = 0


class CalibratedTrace(_KeyedTrace):
    """The calibrated score model (module docstring): ``next(key, seq_len)`` advances the
    key's drift one step and returns ``[topk] int32`` distinct positions in random order."""

    def __init__(self, topk: int, seed: int = 0,
                 params: Optional[CalibratedParams] = None) -> None:
        super().__init__(topk, seed)
        self.params = params if params is not None else CalibratedParams()
        p, k = self.params, self.topk
        self._sink = max(1, round(p.sink_fraction * k)) if p.sink_fraction else 0
        self._recent = max(1, round(p.recent_fraction * k)) if p.recent_fraction else 0
        self._fresh = round(p.fresh_fraction * k)
        self._noise = math.sqrt(max(0.0, 1.0 - p.drift * p.drift))

    def _scores(self, key: Hashable, seq_len: int) -> _Scores:
        state = self._state.get(key)
        if not isinstance(state, _Scores):
            state = _Scores()
            self._state[key] = state
        if seq_len > state.stable.size:
            grow = max(seq_len, 2 * state.stable.size) - state.stable.size
            state.stable = np.concatenate([state.stable, np.zeros(grow, np.float32)])
            state.drift = np.concatenate([state.drift, np.zeros(grow, np.float32)])
        if seq_len > state.length:  # new tokens: a relevance and a stationary drift
            n = seq_len - state.length
            state.stable[state.length:seq_len] = self._rng.standard_normal(n, np.float32)
            state.drift[state.length:seq_len] = self._rng.standard_normal(n, np.float32)
            state.length = seq_len
        return state

    def next(self, key: Hashable, seq_len: int) -> np.ndarray:
        k = self.topk
        if seq_len <= k:
            if seq_len > 0:
                self._scores(key, seq_len)
            return _whole_history(self._rng, k, seq_len)
        p = self.params
        state = self._scores(key, seq_len)
        drift = state.drift[:seq_len]
        drift *= p.drift
        # Innovations uniform on [-sqrt(3), sqrt(3)] (unit variance): 4x cheaper to draw
        # than normals, and the drift stays close to a standard normal.
        noise = self._rng.random(seq_len, np.float32)
        noise -= 0.5
        noise *= self._noise * _UNIFORM_SCALE
        drift += noise
        score = p.stable_weight * state.stable[:seq_len]
        score += drift
        sink, recent = min(self._sink, k), min(self._recent, max(0, k - self._sink))
        fixed = np.concatenate([np.arange(sink), np.arange(seq_len - recent, seq_len)])
        score[fixed] = -np.inf
        fresh_n = min(self._fresh, k - fixed.size)
        top_n = k - fixed.size - fresh_n
        top = np.argpartition(-score, top_n)[:top_n] if top_n else np.empty(0, np.int64)
        chosen = [fixed, top]
        if fresh_n:
            taken = np.zeros(seq_len, dtype=bool)
            taken[fixed] = True
            taken[top] = True
            chosen.append(self._rng.choice(np.flatnonzero(~taken), fresh_n, replace=False))
        out = np.concatenate(chosen).astype(np.int32)
        self._rng.shuffle(out)
        return out


def make_trace(workload: str, topk: int, *, seed: int = 0,
               locality: float = 0.8) -> TraceGenerator:
    """A generator by name (``WORKLOADS``): ``"calibrated"`` or ``"locality"``."""
    if workload == "calibrated":
        return CalibratedTrace(topk, seed=seed)
    if workload == "locality":
        return TopkTrace(topk, locality, seed=seed)
    raise ValueError(f"unknown workload {workload!r}; choose from {', '.join(WORKLOADS)}.")


def stream_selections(generator: TraceGenerator, *, history: int, steps: int,
                      key: Hashable = ("calibration", 0)) -> list[np.ndarray]:
    """``steps`` selections of one key, decoding one token per step from a ``history``-token
    prompt (``seq_len = history + 1, history + 2, ...``); -1 padding dropped."""
    out = []
    for step in range(steps):
        sel = generator.next(key, history + step + 1)
        out.append(sel[sel >= 0])
    return out


def calibration_rates(*, topk: int = CALIBRATION_TOPK, history: int = CALIBRATION_HISTORY,
                      steps: int = 160, warmup: int = 32, seed: int = 0,
                      params: Optional[CalibratedParams] = None) -> dict[int, float]:
    """LRU miss rates of ``CalibratedTrace`` by buffer size in units of ``topk`` (the keys of
    ``PUBLISHED_MISS_RATES``): one stream of ``steps`` decode steps after a ``history``-token
    prompt, every position through the buffer, misses counted after ``warmup`` steps (the
    steady state). Pure numpy; about a second at the defaults."""
    from hisparse_triton.policies import step_keys, stream_misses

    selections = [step_keys(s) for s in stream_selections(
        CalibratedTrace(topk, seed=seed, params=params), history=history, steps=steps)]
    lookups = sum(s.size for s in selections[warmup:])
    rates = {}
    for factor in PUBLISHED_MISS_RATES:
        misses = stream_misses("lru", selections, factor * topk, distinct=True)
        rates[factor] = int(misses[warmup:].sum()) / lookups
    return rates


# --------------------------------------------------------------------------- pool sizing
@dataclass(frozen=True)
class WorkloadPlan:
    """A planner result sized for a workload: what ``HiSparseRuntime`` is built from.

    ``all_gpu_bytes_per_page``: GPU bytes one page of tokens costs when every layer stays on
    the GPU (sparse MLA + indexer + regular), the baseline ``simulate`` compares with.
    """

    config: EngineConfig
    kv_cache_spec: dict[str, KVCacheSpec]
    kv_cache_config: KVCacheConfig
    all_gpu_bytes_per_page: int
    block_size: int


def steady_device_blocks(groups, base: EngineConfig, num_requests: int,
                         prefill_tokens: int) -> int:
    """Device blocks of a HiSparse deployment at steady state: per running request the
    indexer's (and regular layers') full history and, per resident/hot pair, the hot region
    + ``ACTIVE_TAIL_PAGES`` + 1 (a partial page); plus one prefill chunk of resident pages
    (``prefill_tokens``: they stay on the GPU until its ``commit()``) and the null block.
    Not room for every request's whole history: the runtime runs under memory pressure."""
    from hisparse_triton.layout import group_kind

    block = groups[0].block_size
    per_request = resident = 0
    for group in groups[1:]:
        kind = group_kind(group)
        if kind in ("indexer", "regular"):
            per_request += group.blocks_per_request(base)
        elif kind == "hot":
            per_request += group.kv_cache_spec.blocks_per_request + ACTIVE_TAIL_PAGES + 1
        elif kind == "resident":
            resident += 1
    return 1 + num_requests * per_request + resident * cdiv(prefill_tokens, block)


def plan_for_workload(kv_cache_spec: Mapping[str, KVCacheSpec], *, max_model_len: int,
                      num_requests: int, topk: int, device_buffer_size: Optional[int] = None,
                      prompt_len: int = 0, host_blocks: Optional[int] = None,
                      device_blocks: Optional[int] = None,
                      prefill_chunk: Optional[int] = None,
                      max_num_batched_tokens: Optional[int] = None,
                      max_decode_query_len: int = 1,
                      tensor_parallel_size: int = 1) -> WorkloadPlan:
    """Plan both pools for ``num_requests`` live requests of up to ``max_model_len`` tokens.

    Host: every request's full reservation plus the null block and a copy-on-write tail.
    Device: ``steady_device_blocks`` with one prefill of ``prefill_chunk`` tokens (default
    ``prompt_len``: a prompt prefilled in one chunk). ``host_blocks`` / ``device_blocks``
    override the computed counts. ``max_num_batched_tokens`` (chunked prefill: tokens a
    request may append between two plans), ``max_decode_query_len`` (query tokens per
    decode step, speculative decoding; the default hot buffer grows with it) and
    ``tensor_parallel_size`` (ranks > 1 on one node share one host pool) go into the
    ``EngineConfig`` the plan is made for.
    """
    from hisparse_triton.layout import (
        SHARED_HOST_POOL_ALIGNMENT, get_hisparse_kv_cache_config, get_hisparse_kv_cache_groups)

    spec = dict(kv_cache_spec)
    probe = HiSparseConfig(index_topk=topk, device_buffer_size=device_buffer_size,
                           host_pool_gib=1.0, max_decode_query_len=max_decode_query_len)
    base = EngineConfig(max_model_len=max_model_len, hisparse=probe,
                        max_num_batched_tokens=max_num_batched_tokens,
                        tensor_parallel_size=tensor_parallel_size)
    groups = get_hisparse_kv_cache_groups(base, spec)
    if groups is None:
        raise ValueError("the kv_cache_spec has no MLA layers: HiSparse does not apply.")
    source = groups[0]
    block = source.block_size
    if host_blocks is None:
        host_blocks = num_requests * cdiv(max_model_len, block) + 2
    # A shared host pool aligns every block (HiSparseLayout.host_block_stride).
    stride = (round_up(source.page_size_bytes, SHARED_HOST_POOL_ALIGNMENT)
              if base.shared_host_pool else source.page_size_bytes)
    host_budget = host_blocks * stride
    if device_blocks is None:
        chunk = prompt_len if prefill_chunk is None else min(prefill_chunk, prompt_len)
        device_blocks = steady_device_blocks(groups, base, num_requests, chunk)
    hisparse = HiSparseConfig(index_topk=topk, device_buffer_size=device_buffer_size,
                              host_pool_gib=max(host_budget / GIB, 1e-9),
                              max_decode_query_len=max_decode_query_len)
    config = EngineConfig(max_model_len=max_model_len, hisparse=hisparse,
                          num_gpu_blocks_override=device_blocks,
                          max_num_batched_tokens=max_num_batched_tokens,
                          tensor_parallel_size=tensor_parallel_size)
    kv_cache_config = get_hisparse_kv_cache_config(config, groups, 0, host_budget)
    all_gpu = sum(s.page_size_bytes for s in spec.values())
    return WorkloadPlan(config=config, kv_cache_spec=spec, kv_cache_config=kv_cache_config,
                        all_gpu_bytes_per_page=all_gpu, block_size=block)


__all__ = [
    "CALIBRATION_HISTORY", "CALIBRATION_TOPK", "CalibratedParams", "CalibratedTrace",
    "PUBLISHED_MISS_RATES", "TopkTrace", "TraceGenerator", "WORKLOADS", "WorkloadPlan",
    "calibration_rates", "make_trace", "plan_for_workload", "steady_device_blocks",
    "stream_selections",
]
