"""Synthetic top-k traces with temporal locality (for ``simulate``, tests and benchmarks).

A real indexer's selection drifts slowly from one decode step to the next: most of the rows
a query picks were picked by the previous query too. ``TopkTrace`` models that with one knob,
``locality``: the fraction of each step's ``k`` positions kept from the previous step's
selection of the same (request, index group); the rest are fresh positions drawn uniformly
from the rest of the history. While the history is no longer than ``k`` the selection is the
whole history (padded with -1), as a DSA indexer does.

``plan_for_workload`` sizes both pools of a planner ``KVCacheConfig`` for a workload (what
``simulate`` and the tests build a runtime from).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Hashable, Mapping, Optional

import numpy as np

from hisparse_triton.config import ACTIVE_TAIL_PAGES, GIB, EngineConfig, HiSparseConfig
from hisparse_triton.specs import KVCacheConfig, KVCacheSpec, cdiv


class TopkTrace:
    """Top-k positions per ``(request, index group)`` key, step after step.

    - ``topk``: positions per selection (``k``).
    - ``locality``: in ``[0, 1]``; fraction of a step's selection repeated from the
      previous step's.
    - ``seed``: the trace is a pure function of the seed and the call sequence.
    """

    def __init__(self, topk: int, locality: float, seed: int = 0) -> None:
        if not isinstance(topk, int) or topk < 1:
            raise ValueError(f"topk must be a positive int, got {topk!r}.")
        if not 0.0 <= locality <= 1.0:
            raise ValueError(f"locality must be in [0, 1], got {locality!r}.")
        self.topk = topk
        self.locality = locality
        self._rng = np.random.default_rng(seed)
        self._previous: dict[Hashable, np.ndarray] = {}

    def next(self, key: Hashable, seq_len: int) -> np.ndarray:
        """``[topk] int32``: the next selection for ``key`` over positions ``[0, seq_len)``.

        Distinct positions in random order; -1 padding while ``seq_len < topk``.
        """
        k = self.topk
        out = np.full(k, -1, dtype=np.int32)
        if seq_len <= 0:
            self._previous[key] = out[:0]
            return out
        if seq_len <= k:
            chosen = self._rng.permutation(seq_len)
        else:
            previous = self._previous.get(key)
            previous = previous[previous < seq_len] if previous is not None else previous
            keep_n = 0 if previous is None else min(int(round(self.locality * k)),
                                                    previous.size)
            keep = (self._rng.choice(previous, keep_n, replace=False) if keep_n
                    else np.empty(0, dtype=np.int64))
            taken = np.zeros(seq_len, dtype=bool)
            taken[keep] = True
            candidates = np.flatnonzero(~taken)
            fresh = self._rng.choice(candidates, k - keep_n, replace=False)
            chosen = np.concatenate([keep, fresh])
            self._rng.shuffle(chosen)
        out[:chosen.size] = chosen
        self._previous[key] = out[:chosen.size].copy()
        return out

    def forget(self, key_prefix: Optional[Hashable] = None) -> None:
        """Drop the history of every key ``(key_prefix, ...)`` (or of all keys)."""
        if key_prefix is None:
            self._previous.clear()
            return
        for key in [k for k in self._previous
                    if isinstance(k, tuple) and k and k[0] == key_prefix]:
            del self._previous[key]


# --------------------------------------------------------------------------- pool sizing
@dataclass(frozen=True)
class WorkloadPlan:
    """A planner result sized for a workload: what ``HiSparseRuntime`` is built from.

    ``all_gpu_bytes_per_token``: GPU bytes one token costs when every layer stays on the GPU
    (sparse MLA + indexer + regular), the baseline ``simulate`` compares with.
    """

    config: EngineConfig
    kv_cache_spec: dict[str, KVCacheSpec]
    kv_cache_config: KVCacheConfig
    all_gpu_bytes_per_page: int
    block_size: int


def plan_for_workload(kv_cache_spec: Mapping[str, KVCacheSpec], *, max_model_len: int,
                      num_requests: int, topk: int, device_buffer_size: Optional[int] = None,
                      prompt_len: int = 0, host_blocks: Optional[int] = None,
                      device_blocks: Optional[int] = None) -> WorkloadPlan:
    """Plan both pools for ``num_requests`` live requests of up to ``max_model_len`` tokens.

    Host: every request's full reservation plus the null block and a copy-on-write tail.
    Device: per request the indexer's (and regular layers') full history plus, per
    resident/hot pair, ``blocks_per_request + ACTIVE_TAIL_PAGES + 1`` blocks (the most a
    request pins before or after its history leaves the GPU), plus one prompt's resident
    pages (a prefill holds them until its ``commit()``) and the null block.
    ``host_blocks`` / ``device_blocks`` override the computed counts.
    """
    from hisparse_triton.layout import (
        get_hisparse_kv_cache_config, get_hisparse_kv_cache_groups, group_kind)

    spec = dict(kv_cache_spec)
    probe = HiSparseConfig(index_topk=topk, device_buffer_size=device_buffer_size,
                           host_pool_gib=1.0)
    base = EngineConfig(max_model_len=max_model_len, hisparse=probe)
    groups = get_hisparse_kv_cache_groups(base, spec)
    if groups is None:
        raise ValueError("the kv_cache_spec has no MLA layers: HiSparse does not apply.")
    source = groups[0]
    block = source.block_size
    pages = cdiv(max_model_len, block)
    if host_blocks is None:
        host_blocks = num_requests * pages + 2
    host_budget = host_blocks * source.page_size_bytes
    if device_blocks is None:
        per_request = 0
        resident = 0
        for group in groups[1:]:
            kind = group_kind(group)
            if kind in ("indexer", "regular"):
                per_request += group.blocks_per_request(base)
            elif kind == "hot":
                per_request += group.kv_cache_spec.blocks_per_request + ACTIVE_TAIL_PAGES + 1
            elif kind == "resident":
                resident += 1
        device_blocks = 1 + num_requests * per_request + resident * cdiv(prompt_len, block)
    hisparse = HiSparseConfig(index_topk=topk, device_buffer_size=device_buffer_size,
                              host_pool_gib=max(host_budget / GIB, 1e-9))
    config = EngineConfig(max_model_len=max_model_len, hisparse=hisparse,
                          num_gpu_blocks_override=device_blocks)
    kv_cache_config = get_hisparse_kv_cache_config(config, groups, 0, host_budget)
    all_gpu = sum(s.page_size_bytes for s in spec.values())
    return WorkloadPlan(config=config, kv_cache_spec=spec, kv_cache_config=kv_cache_config,
                        all_gpu_bytes_per_page=all_gpu, block_size=block)
