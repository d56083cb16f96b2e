"""A tiny DeepSeek-V3.2-shaped model that decodes through ``HiSparseRuntime``, bit-exact with
the same model keeping every KV row dense.

The model (random weights, float32, a few layers, a small vocabulary) has the shape of
DeepSeek-V3.2's sparse attention ("DSA"):

- every layer writes one latent KV row per token: ``kv_lora_rank`` compressed values plus
  ``rope_dim`` rotary key values, ``16 x float32 = 64 B``, exactly one row of the ``tiny``
  preset's sparse cache;
- index-group leaders also run a lightning indexer: one ``16 x float32 = 64 B`` key per token
  (one row of the preset's indexer cache), query heads scored against the WHOLE history
  (``sum_h w_h * relu(q_h . k_t)``, causal), top-k positions per query (-1 where a query has
  fewer than ``k`` positions to choose from);
- sparse MLA attention in the absorbed form: each head scores only the selected latent rows
  (``q_nope . c_kv + q_pe . k_pe``) and sums their compressed parts; followers of an index
  group reuse their leader's selection (index sharing);
- an RMSNorm + SiLU-gated MLP per layer, an untied LM head.

All KV-cache access goes through a ``KVStore`` (add, append, write, indexer keys, select,
commit, free) with two implementations that the model and the decode loop cannot tell apart:

- ``DenseStore``: every row of every layer in plain per-request tensors;
- ``HiSparseStore``: a ``HiSparseRuntime`` (or anything with its API, e.g. a facade over a
  scheduler + worker pair): rows written as bytes into ``device_cache(layer)`` at the rows
  ``append_slots`` returns, the indexer keys read back through the indexer block table, and
  the latent rows of a selection read ONLY at the row ids ``resolve`` returns.

The model is exact by construction: both stores hand the model the same float32 tensors, of
the same shapes, in the same order (selected rows in top-k column order, masked columns as
zeros excluded by a ``-inf`` score), so every later op computes the same bits. ``--check``
runs both and asserts that tokens and logits are identical.

Decoding: greedy, continuous batching of requests with different prompt lengths, chunked
prefill (one ``commit()`` after every step, so a prompt streams through the device pool a
chunk at a time). Each step resolves, per index group, one row per request over the whole
batch: the union of the positions its queries selected (one query when decoding, a chunk's
queries in prefill; a union wider than the hot buffer takes more than one resolve).

Hooks for what comes next: ``KVStore.add`` returns how many prompt tokens are already cached
(prefix reuse; ``Workload.shared_prefix_len`` makes prompts share a prefix), ``spec_tokens``
(query tokens per decode step, speculative decoding; only 1 is enabled), and ``RuntimeLike``
(what ``HiSparseStore`` needs of a runtime, so a facade over a scheduler + worker pair fits).

Run it::

    python examples/tiny_dsa.py --requests 4 --check
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from dataclasses import dataclass, field
from typing import Hashable, Iterable, Optional, Protocol, Sequence

import torch

from hisparse_triton import HiSparseRuntime
from hisparse_triton.commands.argtypes import nonnegative_int, positive_int
from hisparse_triton.layout import group_kind
from hisparse_triton.presets import (
    INDEXER_LAYER_NAME,
    SPARSE_LAYER_NAME,
    build_kv_cache_spec,
    get_preset,
)
from hisparse_triton.specs import cdiv
from hisparse_triton.workload import plan_for_workload

#: The preset whose cache geometry is the model's tensors (64 B rows, block 16, top-k 32).
PRESET = "tiny"


# ============================================================================ the model
@dataclass(frozen=True)
class TinyDSAConfig:
    """Shapes of the model; the cache rows must match the ``tiny`` preset's byte sizes.

    - latent KV row: ``kv_lora_rank + rope_dim`` float32 (``16 x 4 = 64 B``);
    - indexer key row: ``index_dim`` float32 (``16 x 4 = 64 B``), ``index_rope_dim`` of them
      rotary;
    - ``index_share``: sparse layers per indexer (layers ``i % index_share == 0`` lead);
    - ``topk``: positions the indexer selects per query.
    """

    num_layers: int = 4
    vocab_size: int = 96
    hidden: int = 64
    num_heads: int = 4
    kv_lora_rank: int = 12
    rope_dim: int = 4
    index_heads: int = 4
    index_dim: int = 16
    index_rope_dim: int = 4
    ffn: int = 128
    topk: int = 32
    index_share: int = 2
    rope_theta: float = 10_000.0

    @property
    def latent_dim(self) -> int:
        """Float32 values in one latent KV row."""
        return self.kv_lora_rank + self.rope_dim

    @classmethod
    def for_preset(cls, name: str = PRESET, **overrides: int) -> "TinyDSAConfig":
        """A config whose rows are exactly the preset's rows (``ValueError`` otherwise)."""
        geometry = get_preset(name)
        values = {"topk": geometry.index_topk, "index_share": geometry.index_share,
                  **overrides}
        config = cls(**values)
        for what, floats, row_bytes in (
                ("latent KV", config.latent_dim, geometry.mla_row_bytes),
                ("indexer key", config.index_dim, geometry.indexer_row_bytes)):
            if floats * 4 != row_bytes:
                raise ValueError(f"a {what} row of {floats} float32 is {floats * 4} B, the "
                                 f"{name!r} preset's rows are {row_bytes} B.")
        return config

    def is_leader(self, layer: int) -> bool:
        return layer % self.index_share == 0

    def sparse_layer(self, layer: int) -> str:
        return SPARSE_LAYER_NAME.format(i=layer)

    def indexer_layer(self, layer: int) -> str:
        """The indexer cache a layer's selection comes from (its leader's)."""
        return INDEXER_LAYER_NAME.format(i=layer - layer % self.index_share)


class Selection(Protocol):
    """The rows one index group selected for one step."""

    def gather(self, layer: str) -> torch.Tensor:
        """``[R, Q, K, d] float32`` rows of ``layer`` at the selected positions (top-k
        column order; zeros where the position is -1). Call it in the layer's forward, after
        the layer wrote this step's rows and before the next ``select`` of the index group."""
        ...


class KVStore(Protocol):
    """Every KV-cache access of the model and the decode loop.

    Rows are ``[n, d] float32``; ``d`` is the layer's row width. Layer names are the
    preset's sparse (``model.layers.{i}.self_attn.attn``) and indexer
    (``model.layers.{i}.self_attn.indexer``) names.
    """

    def add(self, request: Hashable, prompt_len: int, max_new_tokens: int) -> int:
        """Admit a request; returns how many prompt tokens are already cached (prefix
        reuse: their KV need not be computed)."""
        ...

    def append(self, request: Hashable, num_tokens: int) -> None:
        """Make room for the request's next ``num_tokens`` tokens in every layer."""
        ...

    def write(self, layer: str, request: Hashable, rows: torch.Tensor) -> None:
        """Store ``[n, d] float32`` rows of the ``n`` tokens appended last."""
        ...

    def indexer_keys(self, layer: str, request: Hashable) -> torch.Tensor:
        """``[T, d] float32``: the indexer layer's keys of the request's whole history."""
        ...

    def select(self, leader: str, requests: Sequence[Optional[Hashable]],
               topk: torch.Tensor) -> Selection:
        """Select ``topk`` (``[R, Q, K] int64`` positions, -1 = none) for the index group
        led by ``leader``; ``None`` requests are padding rows."""
        ...

    def commit(self) -> None:
        """End of a step: the rows written so far are final."""
        ...

    def free(self, request: Hashable) -> None:
        """Drop a finished request."""
        ...


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def _rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotate the pairs of the last dim of ``x [..., n]`` by ``positions [...]`` (int64)."""
    half = x.shape[-1] // 2
    inv_freq = theta ** (-torch.arange(half, dtype=torch.float32, device=x.device) / half)
    angle = positions.clamp(min=0).to(torch.float32).unsqueeze(-1) * inv_freq
    cos, sin = torch.cos(angle), torch.sin(angle)
    while cos.dim() < x.dim():
        cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    a, b = x[..., :half], x[..., half:]
    return torch.cat([a * cos - b * sin, a * sin + b * cos], dim=-1)


class TinyDSA:
    """The model: random float32 weights drawn from ``seed``; ``forward`` runs one step."""

    def __init__(self, config: TinyDSAConfig, seed: int = 0,
                 device: torch.device | str = "cpu") -> None:
        self.config = config
        self.device = torch.device(device)
        gen = torch.Generator().manual_seed(seed)
        c = config

        def weight(*shape: int) -> torch.Tensor:
            return (torch.randn(*shape, generator=gen) / math.sqrt(shape[0])).to(self.device)

        def norm(n: int) -> torch.Tensor:
            return (1.0 + 0.1 * torch.randn(n, generator=gen)).to(self.device)

        self.embed = torch.randn(c.vocab_size, c.hidden, generator=gen).to(self.device)
        self.layers = []
        for i in range(c.num_layers):
            layer = {
                "attn_norm": norm(c.hidden), "mlp_norm": norm(c.hidden),
                "w_kv": weight(c.hidden, c.latent_dim),                   # -> c_kv | k_pe
                "w_q": weight(c.hidden, c.num_heads * c.latent_dim),      # -> q_nope | q_pe
                "w_o": weight(c.num_heads * c.kv_lora_rank, c.hidden),
                "w_up": weight(c.hidden, 2 * c.ffn), "w_down": weight(c.ffn, c.hidden),
            }
            if c.is_leader(i):
                layer.update({
                    "w_ik": weight(c.hidden, c.index_dim),
                    "w_iq": weight(c.hidden, c.index_heads * c.index_dim),
                    "w_iw": weight(c.hidden, c.index_heads),
                })
            self.layers.append(layer)
        self.final_norm = norm(c.hidden)
        self.lm_head = weight(c.hidden, c.vocab_size)

    # ------------------------------------------------------------------ one step
    def forward(self, store: KVStore, requests: Sequence[Hashable],
                tokens: Sequence[Sequence[int]], starts: Sequence[int]) -> torch.Tensor:
        """Run the step's new tokens of every request; ``[R, Q, vocab] float32`` logits.

        ``tokens[r]``: request ``r``'s new tokens (``Q`` = the longest; shorter rows are
        padded), at positions ``starts[r], starts[r] + 1, ...``; the store already holds
        room for them (``append``). Logits of padded query slots are meaningless.
        """
        c = self.config
        R, Q = len(requests), max(len(t) for t in tokens)
        token_ids = torch.zeros(R, Q, dtype=torch.int64)
        positions = torch.full((R, Q), -1, dtype=torch.int64)
        for r, (toks, start) in enumerate(zip(tokens, starts)):
            token_ids[r, :len(toks)] = torch.as_tensor(list(toks), dtype=torch.int64)
            positions[r, :len(toks)] = torch.arange(start, start + len(toks))
        token_ids, positions = token_ids.to(self.device), positions.to(self.device)
        counts = [len(t) for t in tokens]

        h = self.embed[token_ids]                                   # [R, Q, D]
        topk: Optional[torch.Tensor] = None
        selection: Optional[Selection] = None
        for i, w in enumerate(self.layers):
            name = c.sparse_layer(i)
            x = _rms_norm(h, w["attn_norm"])
            latent = x @ w["w_kv"]                                  # [R, Q, d]
            latent = torch.cat([latent[..., :c.kv_lora_rank],
                                _rope(latent[..., c.kv_lora_rank:], positions, c.rope_theta)],
                               dim=-1)
            self._write(store, name, requests, latent, counts)
            if c.is_leader(i):
                topk = self._indexer(store, i, x, positions, requests, counts)
                selection = store.select(name, requests, topk)
            assert topk is not None and selection is not None
            h = h + self._attention(w, x, positions, topk, selection.gather(name))
            gate, up = (_rms_norm(h, w["mlp_norm"]) @ w["w_up"]).chunk(2, dim=-1)
            h = h + (torch.nn.functional.silu(gate) * up) @ w["w_down"]
        return _rms_norm(h, self.final_norm) @ self.lm_head

    @staticmethod
    def _write(store: KVStore, layer: str, requests: Sequence[Hashable], rows: torch.Tensor,
               counts: Sequence[int]) -> None:
        for r, request in enumerate(requests):
            store.write(layer, request, rows[r, :counts[r]].contiguous())

    def _indexer(self, store: KVStore, i: int, x: torch.Tensor, positions: torch.Tensor,
                 requests: Sequence[Hashable], counts: Sequence[int]) -> torch.Tensor:
        """Write this step's indexer keys, score the whole history; ``[R, Q, K] int64``
        top-k positions in descending score order, -1 where fewer than ``K`` exist."""
        c, w = self.config, self.layers[i]
        R, Q = positions.shape
        nope = c.index_dim - c.index_rope_dim
        key = x @ w["w_ik"]                                          # [R, Q, dI]
        key = torch.cat([key[..., :nope], _rope(key[..., nope:], positions, c.rope_theta)], -1)
        self._write(store, c.indexer_layer(i), requests, key, counts)
        history = [store.indexer_keys(c.indexer_layer(i), request) for request in requests]
        T = max(k.shape[0] for k in history)
        keys = torch.zeros(R, T, c.index_dim, device=self.device)
        for r, k in enumerate(history):
            keys[r, :k.shape[0]] = k
        query = (x @ w["w_iq"]).view(R, Q, c.index_heads, c.index_dim)
        query = torch.cat([query[..., :nope], _rope(query[..., nope:], positions, c.rope_theta)],
                          dim=-1)
        weights = (x @ w["w_iw"]) * (c.index_heads * c.index_dim) ** -0.5   # [R, Q, HI]
        logits = torch.relu(torch.einsum("rqhd,rtd->rqht", query, keys))
        scores = (logits * weights.unsqueeze(-1)).sum(dim=2)                 # [R, Q, T]
        visible = torch.arange(T, device=self.device).view(1, 1, T) <= positions.unsqueeze(-1)
        scores = scores.masked_fill(~visible, float("-inf"))
        k = min(c.topk, T)
        values, index = scores.topk(k, dim=-1)
        index = index.masked_fill(values == float("-inf"), -1)
        topk = torch.full((R, Q, c.topk), -1, dtype=torch.int64, device=self.device)
        topk[..., :k] = index
        return topk

    def _attention(self, w: dict, x: torch.Tensor, positions: torch.Tensor, topk: torch.Tensor,
                   kv: torch.Tensor) -> torch.Tensor:
        """Sparse MLA (absorbed): ``kv [R, Q, K, d]`` are the selected latent rows."""
        c = self.config
        R, Q = positions.shape
        q = (x @ w["w_q"]).view(R, Q, c.num_heads, c.latent_dim)
        q = torch.cat([q[..., :c.kv_lora_rank],
                       _rope(q[..., c.kv_lora_rank:], positions, c.rope_theta)], dim=-1)
        scores = torch.einsum("rqhd,rqkd->rqhk", q, kv) * c.latent_dim ** -0.5
        scores = scores.masked_fill((topk < 0).unsqueeze(2), float("-inf"))
        probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)     # padded queries: all masked
        out = torch.einsum("rqhk,rqkd->rqhd", probs, kv[..., :c.kv_lora_rank])
        return out.reshape(R, Q, c.num_heads * c.kv_lora_rank) @ w["w_o"]


# ============================================================================ the stores
class _DenseSelection:
    def __init__(self, store: "DenseStore", requests: Sequence[Optional[Hashable]],
                 topk: torch.Tensor) -> None:
        self._store, self._requests, self._topk = store, list(requests), topk

    def gather(self, layer: str) -> torch.Tensor:
        R, Q, K = self._topk.shape
        out = torch.zeros(R, Q, K, self._store.row_dims[layer], device=self._store.device)
        for r, request in enumerate(self._requests):
            if request is None:
                continue
            positions = self._topk[r]
            valid = positions >= 0
            out[r][valid] = self._store.rows(layer, request)[positions[valid]]
        return out


class DenseStore:
    """Every row of every layer kept in a per-request ``[max_len, d] float32`` tensor."""

    def __init__(self, row_dims: dict[str, int], device: torch.device | str = "cpu") -> None:
        self.row_dims = dict(row_dims)
        self.device = torch.device(device)
        self._rows: dict[Hashable, dict[str, torch.Tensor]] = {}
        self._len: dict[Hashable, int] = {}
        self._appended: dict[Hashable, int] = {}

    def add(self, request: Hashable, prompt_len: int, max_new_tokens: int) -> int:
        if request in self._rows:
            raise ValueError(f"request {request!r} is already in the store.")
        size = prompt_len + max_new_tokens
        self._rows[request] = {layer: torch.zeros(size, d, device=self.device)
                               for layer, d in self.row_dims.items()}
        self._len[request] = 0
        self._appended[request] = 0
        return 0

    def append(self, request: Hashable, num_tokens: int) -> None:
        length = self._len[request] + num_tokens
        capacity = next(iter(self._rows[request].values())).shape[0]
        if length > capacity:
            raise ValueError(f"request {request!r}: {length} tokens exceed its reservation "
                             f"of {capacity}.")
        self._len[request] = length
        self._appended[request] = num_tokens

    def write(self, layer: str, request: Hashable, rows: torch.Tensor) -> None:
        end = self._len[request]
        if rows.shape != (self._appended[request], self.row_dims[layer]):
            raise ValueError(f"request {request!r}, layer {layer}: rows of shape "
                             f"{tuple(rows.shape)} for {self._appended[request]} appended "
                             f"tokens of {self.row_dims[layer]} values.")
        self._rows[request][layer][end - rows.shape[0]:end] = rows

    def rows(self, layer: str, request: Hashable) -> torch.Tensor:
        """``[T, d] float32`` every row of the request's history."""
        return self._rows[request][layer][:self._len[request]]

    def indexer_keys(self, layer: str, request: Hashable) -> torch.Tensor:
        return self.rows(layer, request)

    def select(self, leader: str, requests: Sequence[Optional[Hashable]],
               topk: torch.Tensor) -> Selection:
        return _DenseSelection(self, requests, topk)

    def commit(self) -> None:
        pass

    def free(self, request: Hashable) -> None:
        for table in (self._rows, self._len, self._appended):
            del table[request]


class RuntimeLike(Protocol):
    """What ``HiSparseStore`` uses of a runtime: ``HiSparseRuntime``'s API. A facade over a
    scheduler + worker pair (or over one TP rank) only needs to provide these."""

    device_buffer_size: int

    def index_group(self, leader_layer: str) -> tuple[str, ...]: ...
    def add_request(self, request_id: Hashable, prompt_len: int,
                    max_new_tokens: int) -> None: ...
    def append_slots(self, request_id: Hashable, num_tokens: int) -> dict[str, torch.Tensor]: ...
    def device_cache(self, layer_name: str) -> torch.Tensor: ...
    def block_table(self, request_id: Hashable, layer_name: str) -> list[int]: ...
    def seq_len(self, request_id: Hashable) -> int: ...
    def resolve(self, leader_layer: str, request_ids: Sequence[Optional[Hashable]],
                topk: torch.Tensor) -> torch.Tensor: ...
    def commit(self) -> None: ...
    def free_request(self, request_id: Hashable) -> None: ...


def _read_rows(cache: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``[..., row_bytes] uint8``: rows ``rows [...] int64`` of ``cache [blocks, B, row_bytes]``
    (zeros where ``rows < 0``)."""
    B, row_bytes = cache.shape[1], cache.shape[2]
    rows = rows.to(cache.device)
    out = torch.zeros(*rows.shape, row_bytes, dtype=torch.uint8, device=cache.device)
    valid = rows >= 0
    picked = rows[valid]
    out[valid] = cache[picked // B, picked % B]
    return out


class _HiSparseSelection:
    """Row ids from ``resolve`` (``rows [R, Q, K] int64``, -1 = masked).

    After one resolve (``snapshot`` None) every layer is read by id at ``gather`` time: the
    ids stay valid for the whole index group until its next resolve. When a step needed
    several resolves, each may evict the previous one's hot rows, so every layer's rows were
    copied out right after each resolve (``snapshot``); positions written in this step
    (``fresh``: resident rows, stable until ``commit``) are read again at ``gather`` time,
    once the layer has written them."""

    def __init__(self, runtime: RuntimeLike, rows: torch.Tensor, fresh: torch.Tensor,
                 snapshot: Optional[dict[str, torch.Tensor]]) -> None:
        self._runtime, self._rows, self._fresh, self._snapshot = runtime, rows, fresh, snapshot

    def gather(self, layer: str) -> torch.Tensor:
        cache = self._runtime.device_cache(layer)
        if self._snapshot is None:
            data = _read_rows(cache, self._rows)
        else:
            data = self._snapshot[layer].clone()
            data[self._fresh] = _read_rows(cache, self._rows[self._fresh])
        return data.view(torch.float32)


class HiSparseStore:
    """The KV rows in a HiSparse runtime's device and host pools (see ``RuntimeLike``).

    Rows are written as their bytes (``float32`` viewed as ``uint8``) into
    ``device_cache(layer)`` at the rows ``append_slots`` returned; nothing is cached across
    requests yet, so ``add`` reports 0 cached tokens."""

    def __init__(self, runtime: RuntimeLike) -> None:
        self.runtime = runtime
        self._slots: dict[Hashable, dict[str, torch.Tensor]] = {}
        self._committed: dict[Hashable, int] = {}
        self._len: dict[Hashable, int] = {}

    def add(self, request: Hashable, prompt_len: int, max_new_tokens: int) -> int:
        self.runtime.add_request(request, prompt_len, max_new_tokens)
        self._committed[request] = 0
        self._len[request] = 0
        return 0

    def append(self, request: Hashable, num_tokens: int) -> None:
        self._slots[request] = self.runtime.append_slots(request, num_tokens)
        self._len[request] += num_tokens

    def write(self, layer: str, request: Hashable, rows: torch.Tensor) -> None:
        slots = self._slots[request][layer]
        cache = self.runtime.device_cache(layer)
        data = rows.contiguous().view(torch.uint8)
        if data.shape != (slots.numel(), cache.shape[2]):
            raise ValueError(f"request {request!r}, layer {layer}: rows of {data.shape[-1]} B "
                             f"for {slots.numel()} appended tokens of {cache.shape[2]} B.")
        B = cache.shape[1]
        cache[slots // B, slots % B] = data.to(cache.device)

    def indexer_keys(self, layer: str, request: Hashable) -> torch.Tensor:
        cache = self.runtime.device_cache(layer)
        B = cache.shape[1]
        blocks = torch.as_tensor(self.runtime.block_table(request, layer), dtype=torch.int64)
        positions = torch.arange(self.runtime.seq_len(request))
        rows = blocks[positions // B] * B + positions % B
        return _read_rows(cache, rows).view(torch.float32)

    def select(self, leader: str, requests: Sequence[Optional[Hashable]],
               topk: torch.Tensor) -> Selection:
        """Resolve, per request, the union of the positions its query slots selected (a
        prefill chunk's queries overlap heavily), in rounds of at most
        ``device_buffer_size`` positions (one round unless a chunk's union is wider), then
        map the rows back to ``[R, Q, K]`` in top-k column order."""
        topk = topk.cpu()
        R, Q, K = topk.shape
        layers = self.runtime.index_group(leader)
        width = self.runtime.device_buffer_size
        empty = torch.empty(0, dtype=torch.int64)
        unions = [torch.unique(topk[r][topk[r] >= 0]) if request is not None else empty
                  for r, request in enumerate(requests)]
        rounds = max(-(-u.numel() // width) for u in unions) if unions else 0
        union_rows = [torch.full((u.numel(),), -1, dtype=torch.int64) for u in unions]
        row_bytes = self.runtime.device_cache(leader).shape[2]
        device = self.runtime.device_cache(leader).device
        union_bytes = ({layer: [torch.zeros(u.numel(), row_bytes, dtype=torch.uint8,
                                            device=device) for u in unions]
                        for layer in layers} if rounds > 1 else None)
        for j in range(rounds):
            pieces = [u[j * width:(j + 1) * width] for u in unions]
            batch = torch.full((R, max(p.numel() for p in pieces)), -1, dtype=torch.int32)
            for r, piece in enumerate(pieces):
                batch[r, :piece.numel()] = piece
            ids = [request if piece.numel() else None for request, piece in zip(requests, pieces)]
            got = self.runtime.resolve(leader, ids, batch).to("cpu", torch.int64)
            for r, piece in enumerate(pieces):
                span = slice(j * width, j * width + piece.numel())
                union_rows[r][span] = got[r, :piece.numel()]
                if union_bytes is not None:          # the next round may evict these rows
                    for layer in layers:
                        union_bytes[layer][r][span] = _read_rows(
                            self.runtime.device_cache(layer), got[r, :piece.numel()])
        rows = torch.full((R, Q, K), -1, dtype=torch.int64)
        snapshot = ({layer: torch.zeros(R, Q, K, row_bytes, dtype=torch.uint8, device=device)
                     for layer in layers} if union_bytes is not None else None)
        for r, union in enumerate(unions):
            valid = topk[r] >= 0
            if not union.numel() or not bool(valid.any()):
                continue
            at = torch.searchsorted(union, topk[r][valid])
            rows[r][valid] = union_rows[r][at]
            if snapshot is not None:
                for layer in layers:
                    snapshot[layer][r][valid.to(device)] = union_bytes[layer][r][at.to(device)]
        committed = torch.tensor([self._committed[r] if r is not None else 0
                                  for r in requests], dtype=torch.int64)
        fresh = (topk >= committed.view(R, 1, 1)) & (rows >= 0)
        return _HiSparseSelection(self.runtime, rows.to(device), fresh.to(device), snapshot)

    def commit(self) -> None:
        self.runtime.commit()
        self._committed.update(self._len)

    def free(self, request: Hashable) -> None:
        self.runtime.free_request(request)
        for table in (self._slots, self._committed, self._len):
            table.pop(request, None)


def dense_store_for(config: TinyDSAConfig, device: torch.device | str = "cpu") -> DenseStore:
    """A ``DenseStore`` with the model's layers (the same names as the runtime's)."""
    row_dims = {}
    for i in range(config.num_layers):
        row_dims[config.sparse_layer(i)] = config.latent_dim
        if config.is_leader(i):
            row_dims[config.indexer_layer(i)] = config.index_dim
    return DenseStore(row_dims, device)


# ============================================================================ decoding
@dataclass
class GenRequest:
    """One request of the workload and what greedy decoding produced for it."""

    request_id: str
    prompt: list[int]
    max_new_tokens: int
    computed: int = 0                     # tokens whose KV is in the store
    tokens: list[int] = field(default_factory=list)
    logits: list[torch.Tensor] = field(default_factory=list)  # [vocab] float32 per token

    def next_chunk(self, chunk_size: int) -> list[int]:
        """The tokens this step computes: the next prefill chunk, or the last new token."""
        if self.computed < len(self.prompt):
            return self.prompt[self.computed:self.computed + chunk_size]
        return [self.tokens[-1]]


@dataclass(frozen=True)
class Workload:
    """Requests to decode. ``shared_prefix_len``: every prompt starts with the same tokens
    (a store with prefix reuse reports them cached in ``add``)."""

    prompt_lens: tuple[int, ...]
    max_new_tokens: int = 8
    shared_prefix_len: int = 0
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.prompt_lens or self.max_new_tokens < 1 or self.shared_prefix_len < 0:
            raise ValueError(f"a workload needs prompts, max_new_tokens >= 1 and "
                             f"shared_prefix_len >= 0, got {self}.")
        short = [n for n in self.prompt_lens if n <= self.shared_prefix_len]
        if short:
            raise ValueError(f"prompts of {short} tokens are not longer than the shared "
                             f"prefix of {self.shared_prefix_len}.")

    @classmethod
    def random(cls, num_requests: int, prompt_len_range: tuple[int, int], *,
               max_new_tokens: int = 8, shared_prefix_len: int = 0,
               seed: int = 0) -> "Workload":
        """Prompts with lengths drawn from ``seed`` in ``[lo, hi]`` (``prompt_len_range``)."""
        lo, hi = prompt_len_range
        if not 1 <= lo <= hi:
            raise ValueError(f"prompt lengths [{lo}, {hi}]: need 1 <= lo <= hi.")
        gen = torch.Generator().manual_seed(seed)
        lens = torch.randint(lo, hi + 1, (num_requests,), generator=gen).tolist()
        return cls(tuple(lens), max_new_tokens, shared_prefix_len, seed)

    @property
    def max_len(self) -> int:
        return max(self.prompt_lens) + self.max_new_tokens

    def requests(self, vocab_size: int) -> list[GenRequest]:
        """The requests ``req-0``, ``req-1``, ... with random prompts (fixed by ``seed``)."""
        gen = torch.Generator().manual_seed(self.seed + 1)
        prefix = torch.randint(vocab_size, (self.shared_prefix_len,), generator=gen).tolist()
        out = []
        for i, length in enumerate(self.prompt_lens):
            rest = torch.randint(vocab_size, (length - len(prefix),), generator=gen).tolist()
            out.append(GenRequest(f"req-{i}", prefix + rest, self.max_new_tokens))
        return out


@dataclass
class DecodeResult:
    """Per request: generated tokens and their ``[n, vocab] float32`` logits."""

    tokens: dict[str, list[int]]
    logits: dict[str, torch.Tensor]
    steps: int


def greedy_decode(model: TinyDSA, store: KVStore, workload: Workload, *, chunk_size: int = 32,
                  max_running: Optional[int] = None, spec_tokens: int = 1) -> DecodeResult:
    """Greedy decoding of ``workload`` through ``store`` (continuous batching).

    Each step every running request computes either its next prefill chunk (at most
    ``chunk_size`` tokens) or its last generated token; the step ends with
    ``store.commit()``. A request is admitted when fewer than ``max_running`` (default: all)
    run, and freed after its ``max_new_tokens``-th token. ``spec_tokens``: query tokens per
    decode step (speculative decoding); only 1 is enabled so far.
    """
    if spec_tokens != 1:
        raise NotImplementedError(f"spec_tokens={spec_tokens}: speculative decoding (a "
                                  f"drafter and one resolve of [R, Q, K]) is not enabled yet; "
                                  f"use 1.")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}.")
    waiting = workload.requests(model.config.vocab_size)
    max_running = len(waiting) if max_running is None else max_running
    if max_running < 1:
        raise ValueError(f"max_running must be >= 1, got {max_running}.")
    running: list[GenRequest] = []
    done: list[GenRequest] = []
    steps = 0
    while waiting or running:
        while waiting and len(running) < max_running:
            request = waiting.pop(0)
            cached = store.add(request.request_id, len(request.prompt),
                               request.max_new_tokens)
            if not 0 <= cached < len(request.prompt):
                raise ValueError(f"{request.request_id}: the store reports {cached} cached "
                                 f"tokens of a {len(request.prompt)}-token prompt (the last "
                                 f"prompt token must be computed for its logits).")
            request.computed = cached
            running.append(request)
        chunks = [request.next_chunk(chunk_size) for request in running]
        for request, chunk in zip(running, chunks):
            store.append(request.request_id, len(chunk))
        logits = model.forward(store, [r.request_id for r in running], chunks,
                               [r.computed for r in running])
        store.commit()
        steps += 1
        for r, (request, chunk) in enumerate(zip(running, chunks)):
            request.computed += len(chunk)
            if request.computed < len(request.prompt):
                continue                                     # mid-prefill: no token yet
            last = logits[r, len(chunk) - 1].cpu()
            request.logits.append(last)
            request.tokens.append(int(last.argmax()))
        for request in [r for r in running if len(r.tokens) == r.max_new_tokens]:
            store.free(request.request_id)
            running.remove(request)
            done.append(request)
    return DecodeResult(tokens={r.request_id: r.tokens for r in done},
                        logits={r.request_id: torch.stack(r.logits) for r in done},
                        steps=steps)


# ============================================================================ set-up
@dataclass(frozen=True)
class RunSpec:
    """One run of the example: model, workload, pools and runtime options."""

    num_requests: int = 4
    num_layers: int = 4
    prompt_len_range: tuple[int, int] = (128, 320)
    max_new_tokens: int = 8
    chunk_size: int = 32
    max_running: Optional[int] = None
    shared_prefix_len: int = 0
    spec_tokens: int = 1
    device_blocks: Optional[int] = None
    offload_threshold_pages: Optional[int] = None
    free_block_watermark: Optional[float] = None
    backend: str = "torch"
    device: str = "cpu"
    seed: int = 0

    def model_config(self) -> TinyDSAConfig:
        return TinyDSAConfig.for_preset(PRESET, num_layers=self.num_layers)

    def workload(self) -> Workload:
        return Workload.random(self.num_requests, self.prompt_len_range,
                               max_new_tokens=self.max_new_tokens,
                               shared_prefix_len=self.shared_prefix_len, seed=self.seed)


def build_runtime(spec: RunSpec) -> HiSparseRuntime:
    """A runtime on the ``tiny`` preset cut to the model's layers, pools sized for the
    workload: the device pool holds the running requests' working set (indexer history,
    hot buffers, active tails) and one prefill chunk per running request, so older pages
    must leave the GPU (``all_gpu_blocks`` is what keeping them would take)."""
    config = spec.model_config()
    workload = spec.workload()
    context = get_preset(PRESET).max_model_len
    if workload.max_len > context:
        raise ValueError(f"a {max(workload.prompt_lens)}-token prompt + {workload.max_new_tokens}"
                         f" new tokens exceeds the {PRESET!r} preset's max_model_len {context}.")
    running = spec.max_running or spec.num_requests
    kv_spec = build_kv_cache_spec(PRESET, num_layers=config.num_layers)
    plan = plan_for_workload(kv_spec, max_model_len=workload.max_len, num_requests=running,
                             topk=config.topk, prompt_len=spec.chunk_size * running,
                             device_blocks=spec.device_blocks)
    return HiSparseRuntime(plan.kv_cache_config, plan.config, max_num_seqs=running,
                           device=spec.device, backend=spec.backend,
                           offload_threshold_pages=spec.offload_threshold_pages,
                           **({} if spec.free_block_watermark is None else
                              {"free_block_watermark": spec.free_block_watermark}))


def all_gpu_blocks(runtime: HiSparseRuntime, spec: RunSpec) -> int:
    """Device blocks that would hold every row of the ``max_running`` longest requests on
    the GPU (each per-request device group but the hot buffers, one block per page)."""
    workload = spec.workload()
    groups = [g for g in runtime.kv_cache_config.kv_cache_groups
              if not g.host_resident and group_kind(g) != "hot"]
    running = spec.max_running or len(workload.prompt_lens)
    longest = sorted(workload.prompt_lens, reverse=True)[:running]
    return sum(cdiv(length + workload.max_new_tokens - 1, group.block_size)
               for group in groups for length in longest)


def run(spec: RunSpec, store: KVStore) -> DecodeResult:
    """Decode ``spec``'s workload with ``spec``'s model through ``store``."""
    model = TinyDSA(spec.model_config(), seed=spec.seed, device=spec.device)
    return greedy_decode(model, store, spec.workload(), chunk_size=spec.chunk_size,
                         max_running=spec.max_running, spec_tokens=spec.spec_tokens)


def run_dense(spec: RunSpec) -> DecodeResult:
    return run(spec, dense_store_for(spec.model_config(), spec.device))


def compare(expected: DecodeResult, actual: DecodeResult) -> list[str]:
    """Differences between two runs (empty = bit-identical tokens and logits)."""
    problems = []
    if set(expected.tokens) != set(actual.tokens):
        problems.append(f"requests differ: {sorted(expected.tokens)} vs {sorted(actual.tokens)}")
    for request in sorted(set(expected.tokens) & set(actual.tokens)):
        if expected.tokens[request] != actual.tokens[request]:
            problems.append(f"{request}: tokens {expected.tokens[request]} vs "
                            f"{actual.tokens[request]}")
        a, b = expected.logits[request], actual.logits[request]
        if a.shape != b.shape or not torch.equal(a, b):
            diff = (a - b).abs().max().item() if a.shape == b.shape else float("nan")
            problems.append(f"{request}: logits differ (max |diff| {diff:.3g})")
    return problems


# ============================================================================ CLI
def main(argv: Optional[Iterable[str]] = None) -> int:
    defaults = RunSpec()
    parser = argparse.ArgumentParser(
        description="Greedy decoding of a tiny DeepSeek-V3.2-shaped model (random weights) "
                    "through the HiSparse runtime; --check compares with a dense KV cache.")
    parser.add_argument("--requests", type=positive_int, default=defaults.num_requests,
                        help=f"requests (default {defaults.num_requests})")
    parser.add_argument("--max-running", type=positive_int, default=None,
                        help="requests decoded together (default: all)")
    parser.add_argument("--layers", type=positive_int, default=defaults.num_layers,
                        help=f"sparse layers (default {defaults.num_layers})")
    parser.add_argument("--prompt-len", type=positive_int, nargs=2, metavar=("LO", "HI"),
                        default=defaults.prompt_len_range,
                        help="prompt lengths drawn from [LO, HI] (default %(default)s)")
    parser.add_argument("--max-new-tokens", type=positive_int, default=defaults.max_new_tokens,
                        help=f"tokens generated per request (default "
                             f"{defaults.max_new_tokens})")
    parser.add_argument("--chunk-size", type=positive_int, default=defaults.chunk_size,
                        help=f"prefill chunk in tokens (default {defaults.chunk_size})")
    parser.add_argument("--shared-prefix-len", type=nonnegative_int, default=0,
                        help="tokens every prompt starts with (default 0)")
    parser.add_argument("--device-blocks", type=positive_int, default=None,
                        help="device pool blocks (default: sized for the workload)")
    parser.add_argument("--offload-threshold-pages", type=positive_int, default=None,
                        help="pages a request keeps before its history leaves the GPU "
                             "(default: the runtime's)")
    parser.add_argument("--backend", choices=("torch", "triton", "auto"), default="torch")
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=positive_int, default=1,
                        help="torch CPU threads (default 1: the ops are small)")
    parser.add_argument("--check", action="store_true",
                        help="also run the dense model and require identical tokens and logits")
    args = parser.parse_args(None if argv is None else list(argv))
    torch.set_num_threads(args.threads)
    spec = RunSpec(num_requests=args.requests, num_layers=args.layers,
                   prompt_len_range=tuple(args.prompt_len), max_new_tokens=args.max_new_tokens,
                   chunk_size=args.chunk_size, max_running=args.max_running,
                   shared_prefix_len=args.shared_prefix_len, device_blocks=args.device_blocks,
                   offload_threshold_pages=args.offload_threshold_pages,
                   backend=args.backend, device=args.device, seed=args.seed)
    try:
        workload = spec.workload()
        runtime = build_runtime(spec)
    except ValueError as exc:
        print(f"tiny_dsa: {exc}", file=sys.stderr)
        return 2
    print(f"tiny_dsa: {spec.num_layers} layers, {spec.num_requests} requests, prompts "
          f"{list(workload.prompt_lens)} tokens, {spec.max_new_tokens} new tokens each, "
          f"prefill chunks of {spec.chunk_size}, backend {runtime.backend}")
    start = time.perf_counter()
    with runtime:
        result = run(spec, HiSparseStore(runtime))
        stats = runtime.stats()
        pool, all_gpu = runtime.device_block_pool.capacity, all_gpu_blocks(runtime, spec)
    elapsed = time.perf_counter() - start
    for request, tokens in sorted(result.tokens.items()):
        print(f"  {request}: {tokens}")
    print(f"{result.steps} steps in {elapsed:.2f} s; device pool {pool} blocks (every row on "
          f"the GPU would take {all_gpu}): {stats.hits} hits, {stats.misses} misses, hit rate "
          f"{stats.hit_rate:.1%}, {stats.h2d_bytes} B gathered, {stats.d2h_bytes} B mirrored")
    if not args.check:
        return 0
    problems = compare(run_dense(spec), result)
    if problems:
        print("check FAILED: HiSparse and dense decoding differ:")
        for problem in problems:
            print(f"  {problem}")
        return 1
    print(f"check: tokens and logits bit-identical to the dense model "
          f"({sum(len(t) for t in result.tokens.values())} tokens, {stats.misses} misses, "
          f"hit rate {stats.hit_rate:.1%})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
