"""A tiny DeepSeek-V3.2-shaped model decoding through HiSparse, bit-exact with the same model
keeping every KV row dense.

The model (random weights, a few layers, a small vocabulary) has the shape of DeepSeek-V3.2's
sparse attention ("DSA"):

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
- an RMSNorm + ReLU-gated MLP per layer, an untied LM head.

Batch invariance. A token's logits do not depend on what it is batched with, so runs that
schedule the same requests differently give the same bits: prefix reuse (a request skips its
cached prefix, which the dense run computes) and speculative decoding (two query tokens per
step instead of one) are compared with a plain dense run. Every matrix product sums
integers: weights are 7-bit integers times a scale, activations are rounded to a 1/256 grid
(10 bits) and stored KV rows to a 1/32 grid (8 bits, like DeepSeek's fp8 cache) before they
are multiplied, and attention weights to a 1/1024 grid before they weigh rows, with every
partial sum below 2**24, so float32 adds them exactly in any order; the rotary tables are
computed once; the remaining float work is element-wise or per row (RMSNorm, softmax, a
stable sort for the top-k).

All KV-cache access goes through a ``KVStore`` (add, append, begin, write, indexer keys,
select, commit, free) with three implementations that the model and the decode loop cannot
tell apart:

- ``DenseStore``: every row of every layer in plain per-request tensors;
- ``SplitStore``: a ``HiSparseScheduler`` + ``HiSparseWorker`` pair driven as a serving stack
  drives them: scheduling calls (``add_request`` with the prompt's token ids for prefix
  reuse, ``append_slots``, ``free_request``), then ``plan = scheduler.step()``,
  ``worker.apply(plan)``, the forward (KV written at the rows ``append_slots`` returned, the
  indexer keys read through the worker's block table, the latent rows of a selection read
  ONLY at the rows ``resolve_rows`` / ``resolve_prefill`` return), ``worker.mirror(plan)``.
  With ``--tp 2`` two processes (gloo) run it: rank 0 schedules and broadcasts each plan
  (``broadcast_plan``) and the step's rows; both ranks hold the model (same seed) and a
  worker over one shared host pool in ``/dev/shm``, and compute the same tokens;
- ``HiSparseStore``: the same over the in-process ``HiSparseRuntime`` facade.

Decoding: greedy, continuous batching of requests with different prompt lengths, prefill in
chunks (``max_num_batched_tokens`` makes the runtime refuse a larger uncommitted chunk) whose
selections go through the runtime's prefill staging (``resolve_prefill``: rows with a device
copy in place, host-only rows staged into a region the scheduler keeps free, hot buffers
untouched), a shared prompt prefix reused from the prefix cache, and speculative decoding
with ``Q`` query tokens per decode step (the last accepted token and ``Q - 1`` draft tokens
from a drafter, the dense greedy continuation): their top-k selections resolve as ONE
``[R, Q, K]`` union per index group. With ``--mtp Q`` the drafter is wrong at random
(``--draft-error``): the model's outputs accept 0..Q drafts per step and the rejected ones
are rolled back (``truncate``, after the forward, before the step commits), still
bit-identical to the dense one-token-at-a-time run; without it every draft must be accepted.
With ``--async`` the loop runs in vLLM's async-scheduling order (``max_concurrent_batches``
2): step N+1 is scheduled (its drafts appended as drafts, ``append_slots(...,
num_draft_tokens=)``) and run (its KV written at the positions step N's accepted tokens
give, read through the block tables) before the runtime hears step N's verification
(``verify_drafts``: the rejected drafts leave, step N+1's tokens move down), still
bit-identical to the dense run.

Run it::

    python examples/tiny_dsa.py --requests 4 --check
    python examples/tiny_dsa.py --tp 2 --spec-tokens 2 --shared-prefix-len 64 \
        --max-running 2 --check
    python examples/tiny_dsa.py --mtp 3 --free-block-watermark 1 --check
    python examples/tiny_dsa.py --mtp 3 --draft-error 0.4 --async --requests 3 \
        --max-running 2 --prompt-len 40 60 --max-new-tokens 80 --free-block-watermark 1 --check
    python examples/tiny_dsa.py --requests 1 --prompt-len 2048 2048 --max-model-len 2056 \
        --chunk-size 128 --max-num-batched-tokens 128 --device-blocks 180 --check

The last one prefills a 2,048-token prompt (plus the 8 new tokens: ``--max-model-len`` must
hold 2,056) in 16 chunks of 128 through the prefill staging, over a pool of 180 blocks that
cannot keep its history on the GPU. The async one generates 80 tokens per request so that
pages whose positions held rejected drafts leave the GPU and are read back from the host.
``tests/test_tiny_dsa.py`` runs every command above.
"""

from __future__ import annotations

import abc
import argparse
import dataclasses
import json
import math
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Hashable, Iterable, Optional, Protocol, Sequence

import numpy as np
import torch

from hisparse_triton import HiSparseRuntime
from hisparse_triton.commands.argtypes import (
    bounded_int,
    bounded_number,
    nonnegative_int,
    positive_int,
)
from hisparse_triton.distributed import broadcast_host_pool_secret
from hisparse_triton.errors import HiSparseError
from hisparse_triton.layout import group_kind
from hisparse_triton.presets import (
    INDEXER_LAYER_NAME,
    SPARSE_LAYER_NAME,
    build_kv_cache_spec,
    get_preset,
)
from hisparse_triton.scheduler import HiSparseScheduler
from hisparse_triton.specs import cdiv
from hisparse_triton.staging import scheduler_host_rows_bound
from hisparse_triton.step_plan import StepPlan
from hisparse_triton.worker import HiSparseWorker
from hisparse_triton.workload import WorkloadPlan, plan_for_workload

#: The preset whose cache geometry is the model's tensors (64 B rows, block 16, top-k 32).
PRESET = "tiny"

# Integer grids of the model's arithmetic (see "Batch invariance" above).
ACT_SCALE, ACT_LIMIT = 256.0, 1023.0    # activations entering a product: 1/256 steps, 10 bits
KV_SCALE, KV_LIMIT = 32.0, 127.0        # stored KV and indexer rows: 1/32 steps, 8 bits
PROB_SCALE = 1024.0                     # attention weights: 1/1024 steps
WEIGHT_SCALE, WEIGHT_LIMIT = 16.0, 63.0  # weights: 7-bit integers
EXACT_LIMIT = 2 ** 24                   # float32 adds integers below this exactly


# ============================================================================ the model
@dataclass(frozen=True)
class TinyDSAConfig:
    """Shapes of the model; the cache rows must match the ``tiny`` preset's byte sizes.

    - latent KV row: ``kv_lora_rank + rope_dim`` float32 (``16 x 4 = 64 B``);
    - indexer key row: ``index_dim`` float32 (``16 x 4 = 64 B``), ``index_rope_dim`` of them
      rotary;
    - ``index_share``: sparse layers per indexer (layers ``i % index_share == 0`` lead);
    - ``topk``: positions the indexer selects per query;
    - ``max_positions``: positions the rotary tables cover (the preset's context).
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
    max_positions: int = 1024

    @property
    def latent_dim(self) -> int:
        """Float32 values in one latent KV row."""
        return self.kv_lora_rank + self.rope_dim

    @classmethod
    def for_preset(cls, name: str = PRESET, **overrides: int) -> "TinyDSAConfig":
        """A config whose rows are exactly the preset's rows (``ValueError`` otherwise)."""
        geometry = get_preset(name)
        values = {"topk": geometry.index_topk, "index_share": geometry.index_share,
                  "max_positions": geometry.max_model_len, **overrides}
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

    A step: ``add`` / ``append`` / ``free`` (scheduling), ``begin()``, the forward
    (``write``, ``indexer_keys``, ``select``), ``commit()``. Rows are ``[n, d] float32``;
    ``d`` is the layer's row width. Layer names are the preset's sparse
    (``model.layers.{i}.self_attn.attn``) and indexer (``model.layers.{i}.self_attn.indexer``)
    names.
    """

    def add(self, request: Hashable, prompt_len: int, max_new_tokens: int,
            token_ids: Optional[Sequence[int]] = None) -> int:
        """Admit a request; returns how many prompt tokens are already cached (prefix
        reuse by ``token_ids``: their KV is there and must not be computed again)."""
        ...

    def append(self, request: Hashable, num_tokens: int) -> None:
        """Make room for the request's next ``num_tokens`` tokens in every layer."""
        ...

    def begin(self) -> None:
        """Every scheduling call of the step is done; the forward starts."""
        ...

    def write(self, layer: str, request: Hashable, rows: torch.Tensor) -> None:
        """Store ``[n, d] float32`` rows of the ``n`` tokens appended in this step."""
        ...

    def indexer_keys(self, layer: str, request: Hashable) -> torch.Tensor:
        """``[T, d] float32``: the indexer layer's keys of the request's whole history."""
        ...

    def select(self, leader: str, requests: Sequence[Optional[Hashable]],
               topk: torch.Tensor) -> Selection:
        """Select ``topk`` (``[R, Q, K] int64`` positions, -1 = none) for the index group
        led by ``leader``; ``None`` requests are padding rows."""
        ...

    def truncate(self, request: Hashable, new_len: int) -> None:
        """Keep the request's first ``new_len`` tokens (rejected drafts dropped; after the
        forward that verified them, before ``commit``)."""
        ...

    def append_drafts(self, request: Hashable, num_tokens: int, num_drafts: int) -> None:
        """Async scheduling (the pooled stores only): ``append`` of ``num_tokens`` tokens
        whose last ``num_drafts`` are drafts the forward verifies; the store may be told
        their verification a step later (``verify``)."""
        ...

    def place(self, request: Hashable, start: int) -> None:
        """Async scheduling: this step's tokens of the request sit at positions ``start,
        start + 1, ...`` (the corrected positions: the previous step's rejected drafts are
        not dropped from the store yet); ``write`` puts their rows there."""
        ...

    def verify(self, request: Hashable, num_accepted: int) -> None:
        """Async scheduling: the request's oldest ``append_drafts`` run was verified: its
        first ``num_accepted`` drafts stay, the others leave and later tokens move down."""
        ...

    def commit(self) -> None:
        """End of a step: the rows written so far are final."""
        ...

    def free(self, request: Hashable) -> None:
        """Drop a finished request."""
        ...


def _grid(x: torch.Tensor, scale: float, limit: float) -> torch.Tensor:
    """Integer-valued float32 ``round(x * scale)`` clamped to ``[-limit, limit]``."""
    return torch.round(x * scale).clamp_(-limit, limit)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) / x.shape[-1] + eps) * weight


class _Linear:
    """``y = x @ W`` with ``W`` 7-bit integers times ``scale`` and ``x`` rounded to the
    activation grid: the product sums integers exactly (``[..., fan_in] -> [..., fan_out]``)."""

    def __init__(self, fan_in: int, fan_out: int, gen: torch.Generator,
                 device: torch.device) -> None:
        if fan_in * ACT_LIMIT * WEIGHT_LIMIT >= EXACT_LIMIT:
            raise ValueError(f"a {fan_in}-wide product of the model's grids can exceed "
                             f"2**24: its sums would not be exact.")
        w = torch.randn(fan_in, fan_out, generator=gen) * WEIGHT_SCALE
        self.weight = w.round().clamp_(-WEIGHT_LIMIT, WEIGHT_LIMIT).to(device)
        self.scale = 1.0 / (WEIGHT_SCALE * math.sqrt(fan_in) * ACT_SCALE)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return (_grid(x, ACT_SCALE, ACT_LIMIT) @ self.weight) * self.scale


class _Rope:
    """Rotary tables for positions ``[0, max_positions)`` computed once (math.cos/sin), so
    a position's rotation never depends on the batch it is computed in."""

    def __init__(self, dim: int, theta: float, max_positions: int,
                 device: torch.device) -> None:
        half = dim // 2
        freqs = [theta ** (-i / half) for i in range(half)]
        angles = [[p * f for f in freqs] for p in range(max_positions)]
        self.cos = torch.tensor([[math.cos(a) for a in row] for row in angles],
                                dtype=torch.float32, device=device)
        self.sin = torch.tensor([[math.sin(a) for a in row] for row in angles],
                                dtype=torch.float32, device=device)

    def __call__(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Rotate the pairs of the last dim of ``x [R, Q, (H,) n]`` by ``positions [R, Q]``."""
        index = positions.clamp(min=0)
        cos, sin = self.cos[index], self.sin[index]
        while cos.dim() < x.dim():
            cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
        half = x.shape[-1] // 2
        a, b = x[..., :half], x[..., half:]
        return torch.cat([a * cos - b * sin, a * sin + b * cos], dim=-1)


def _to_kv_grid(rows: torch.Tensor) -> torch.Tensor:
    """What the cache stores: ``rows`` rounded to the KV grid (float32 values)."""
    return _grid(rows, KV_SCALE, KV_LIMIT) / KV_SCALE


class TinyDSA:
    """The model: random weights drawn from ``seed``; ``forward`` runs one step."""

    def __init__(self, config: TinyDSAConfig, seed: int = 0,
                 device: torch.device | str = "cpu") -> None:
        self.config = config
        self.device = torch.device(device)
        gen = torch.Generator().manual_seed(seed)
        c, dev = config, self.device

        def linear(fan_in: int, fan_out: int) -> _Linear:
            return _Linear(fan_in, fan_out, gen, dev)

        def norm(n: int) -> torch.Tensor:
            return (1.0 + 0.1 * torch.randn(n, generator=gen)).to(dev)

        self.embed = torch.randn(c.vocab_size, c.hidden, generator=gen).to(dev)
        self.layers = []
        for i in range(c.num_layers):
            layer: dict[str, Any] = {
                "attn_norm": norm(c.hidden), "mlp_norm": norm(c.hidden),
                "w_kv": linear(c.hidden, c.latent_dim),                   # -> c_kv | k_pe
                "w_q": linear(c.hidden, c.num_heads * c.latent_dim),      # -> q_nope | q_pe
                "w_o": linear(c.num_heads * c.kv_lora_rank, c.hidden),
                "w_up": linear(c.hidden, 2 * c.ffn), "w_down": linear(c.ffn, c.hidden),
            }
            if c.is_leader(i):
                layer.update({
                    "w_ik": linear(c.hidden, c.index_dim),
                    "w_iq": linear(c.hidden, c.index_heads * c.index_dim),
                    "w_iw": linear(c.hidden, c.index_heads),
                })
            self.layers.append(layer)
        self.final_norm = norm(c.hidden)
        self.lm_head = linear(c.hidden, c.vocab_size)
        self.rope = _Rope(c.rope_dim, c.rope_theta, c.max_positions, dev)
        self.index_rope = _Rope(c.index_rope_dim, c.rope_theta, c.max_positions, dev)
        for what, width, a, b in (("indexer score", c.index_dim, ACT_LIMIT, KV_LIMIT),
                                  ("attention score", c.latent_dim, ACT_LIMIT, KV_LIMIT),
                                  ("attention sum", c.topk, PROB_SCALE, KV_LIMIT)):
            if width * a * b >= EXACT_LIMIT:
                raise ValueError(f"the {what} sums {width} products of up to {a * b:.0f}: it "
                                 f"can exceed 2**24 and would not be exact.")

    # ------------------------------------------------------------------ one step
    def forward(self, store: KVStore, requests: Sequence[Hashable],
                tokens: Sequence[Sequence[int]], starts: Sequence[int]) -> torch.Tensor:
        """Run the step's new tokens of every request; ``[R, Q, vocab] float32`` logits.

        ``tokens[r]``: request ``r``'s new tokens (``Q`` = the longest; shorter rows are
        padded), at positions ``starts[r], starts[r] + 1, ...``; the store already holds
        room for them (``append``, ``begin``). Logits of padded query slots are meaningless.
        """
        c = self.config
        R, Q = len(requests), max(len(t) for t in tokens)
        if max(start + len(t) for start, t in zip(starts, tokens)) > c.max_positions:
            raise ValueError(f"positions beyond the model's {c.max_positions}.")
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
            self._write(store, name, requests, self.latent(w, x, positions), counts)
            if c.is_leader(i):
                topk = self._indexer(store, i, x, positions, requests, counts)
                selection = store.select(name, requests, topk)
            assert topk is not None and selection is not None
            h = self.mlp(w, h + self._attention(w, x, positions, topk, selection.gather(name)))
        return self.lm_head(_rms_norm(h, self.final_norm))

    def latent(self, w: dict, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The layer's latent KV rows of ``x [R, Q, D]``, rounded to the stored grid."""
        c = self.config
        latent = w["w_kv"](x)                                       # [R, Q, d]
        return _to_kv_grid(torch.cat([latent[..., :c.kv_lora_rank],
                                      self.rope(latent[..., c.kv_lora_rank:], positions)],
                                     dim=-1))

    def index_key(self, w: dict, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """A leader's indexer key rows of ``x [R, Q, D]``, rounded to the stored grid."""
        c = self.config
        nope = c.index_dim - c.index_rope_dim
        key = w["w_ik"](x)                                          # [R, Q, dI]
        return _to_kv_grid(torch.cat([key[..., :nope], self.index_rope(key[..., nope:],
                                                                      positions)], -1))

    @staticmethod
    def mlp(w: dict, h: torch.Tensor) -> torch.Tensor:
        """``h`` plus the layer's gated MLP of it."""
        gate, up = w["w_up"](_rms_norm(h, w["mlp_norm"])).chunk(2, dim=-1)
        return h + w["w_down"](torch.relu(gate) * up)

    @staticmethod
    def _write(store: KVStore, layer: str, requests: Sequence[Hashable], rows: torch.Tensor,
               counts: Sequence[int]) -> None:
        for r, request in enumerate(requests):
            store.write(layer, request, rows[r, :counts[r]].contiguous())

    def _indexer(self, store: KVStore, i: int, x: torch.Tensor, positions: torch.Tensor,
                 requests: Sequence[Hashable], counts: Sequence[int]) -> torch.Tensor:
        """Write this step's indexer keys, score the whole history; ``[R, Q, K] int64``
        top-k positions in descending score order (ties: lower position first), -1 where
        fewer than ``K`` exist."""
        c, w = self.config, self.layers[i]
        R = positions.shape[0]
        self._write(store, c.indexer_layer(i), requests, self.index_key(w, x, positions),
                    counts)
        history = [store.indexer_keys(c.indexer_layer(i), request) for request in requests]
        T = max(k.shape[0] for k in history)
        keys = torch.zeros(R, T, c.index_dim, device=self.device)
        for r, k in enumerate(history):
            keys[r, :k.shape[0]] = k
        return self.select_topk(w, x, positions, keys)

    def select_topk(self, w: dict, x: torch.Tensor, positions: torch.Tensor,
                    keys: torch.Tensor) -> torch.Tensor:
        """The indexer's choice from ``keys [R, T, dI]`` (request ``r``'s key of position
        ``t``; positions past a query's own are never chosen): ``[R, Q, K] int64`` top-k
        positions in descending score order (ties: lower position first), -1 where fewer
        than ``K`` exist. The same bits for any ``T`` past the longest history."""
        c = self.config
        R, Q = positions.shape
        T = keys.shape[1]
        nope = c.index_dim - c.index_rope_dim
        query = w["w_iq"](x).view(R, Q, c.index_heads, c.index_dim)
        query = torch.cat([query[..., :nope], self.index_rope(query[..., nope:], positions)],
                          dim=-1)
        weights = w["w_iw"](x)                                                # [R, Q, HI]
        logits = torch.relu(torch.einsum("rqhd,rtd->rqht", _grid(query, ACT_SCALE, ACT_LIMIT),
                                         keys * KV_SCALE))                    # exact
        scores = logits[:, :, 0] * weights[..., 0:1]
        for head in range(1, c.index_heads):                                  # fixed order
            scores = scores + logits[:, :, head] * weights[..., head:head + 1]
        visible = torch.arange(T, device=self.device).view(1, 1, T) <= positions.unsqueeze(-1)
        scores = scores.masked_fill(~visible, float("-inf"))
        k = min(c.topk, T)
        values, index = torch.sort(scores, dim=-1, descending=True, stable=True)
        values, index = values[..., :k], index[..., :k]
        topk = torch.full((R, Q, c.topk), -1, dtype=torch.int64, device=self.device)
        topk[..., :k] = index.masked_fill(values == float("-inf"), -1)
        return topk

    def _attention(self, w: dict, x: torch.Tensor, positions: torch.Tensor, topk: torch.Tensor,
                   kv: torch.Tensor) -> torch.Tensor:
        """Sparse MLA (absorbed): ``kv [R, Q, K, d]`` are the selected latent rows."""
        c = self.config
        R, Q = positions.shape
        q = w["w_q"](x).view(R, Q, c.num_heads, c.latent_dim)
        q = torch.cat([q[..., :c.kv_lora_rank],
                       self.rope(q[..., c.kv_lora_rank:], positions)], dim=-1)
        kv_int = kv * KV_SCALE                                     # integers: the stored grid
        scores = torch.einsum("rqhd,rqkd->rqhk", _grid(q, ACT_SCALE, ACT_LIMIT), kv_int)
        scores = scores * (c.latent_dim ** -0.5 / (ACT_SCALE * KV_SCALE))
        scores = scores.masked_fill((topk < 0).unsqueeze(2), float("-inf"))
        probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)     # padded queries: all masked
        out = torch.einsum("rqhk,rqkd->rqhd", torch.round(probs * PROB_SCALE),
                           kv_int[..., :c.kv_lora_rank]) / (PROB_SCALE * KV_SCALE)
        return w["w_o"](out.reshape(R, Q, c.num_heads * c.kv_lora_rank))


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

    def add(self, request: Hashable, prompt_len: int, max_new_tokens: int,
            token_ids: Optional[Sequence[int]] = None) -> int:
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
        self._appended[request] += num_tokens

    def begin(self) -> None:
        pass

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

    def truncate(self, request: Hashable, new_len: int) -> None:
        self._len[request] = new_len   # later writes overwrite the dropped rows

    def commit(self) -> None:
        self._appended = dict.fromkeys(self._appended, 0)

    def free(self, request: Hashable) -> None:
        for table in (self._rows, self._len, self._appended):
            del table[request]


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


class _PoolSelection:
    """Row ids of one index group's selection (``rows [R, Q, K] int64``, -1 = masked),
    read at ``gather`` time: they stay valid for every layer of the group until its next
    selection (and a layer's own rows of this step are read after it wrote them)."""

    def __init__(self, store: "_PoolStore", rows: torch.Tensor) -> None:
        self._store, self._rows = store, rows

    def gather(self, layer: str) -> torch.Tensor:
        return _read_rows(self._store.cache(layer), self._rows).view(torch.float32)


class _PoolStore(abc.ABC):
    """What the pooled stores share: rows written as their bytes (``float32`` viewed as
    ``uint8``) into the device cache at the rows the scheduler handed out, indexer keys read
    through a block table, selections resolved into row ids. Subclasses provide the
    runtime calls (``_resolve``, ``_slots``, ``_history``, ``cache``, ...)."""

    #: Hot-buffer rows per request and query tokens one resolve may carry.
    buffer_size: int
    max_query_len: int

    def __init__(self) -> None:
        self._len: dict[Hashable, int] = {}
        #: Resolve calls as (leader, topk shape) (what a step asked of the runtime).
        self.resolve_shapes: list[tuple[str, tuple[int, ...]]] = []
        #: Prefill staging calls as (leader, [tokens, K]).
        self.prefill_shapes: list[tuple[str, tuple[int, ...]]] = []
        #: Async scheduling: where each request's tokens of this step start (``place``).
        self._starts: dict[Hashable, int] = {}

    # Subclass hooks ------------------------------------------------------------------
    @abc.abstractmethod
    def cache(self, layer: str) -> torch.Tensor:
        """``[blocks, B, row_bytes] uint8`` device cache of a layer."""

    @abc.abstractmethod
    @abc.abstractmethod
    def _slots(self, request: Hashable, layer: str) -> torch.Tensor:
        """``[n] int64`` device rows of the request's tokens appended in this step."""

    @abc.abstractmethod
    def _history(self, layer: str, request: Hashable) -> tuple[torch.Tensor, int]:
        """The layer's ``[pages] int64`` block table for the request and its length."""

    @abc.abstractmethod
    def _resolve(self, leader: str, requests: Sequence[Optional[Hashable]],
                 topk: torch.Tensor) -> torch.Tensor:
        """Resolve a decode step's ``topk`` (``[R, Q, K]`` int32) into device rows."""

    @abc.abstractmethod
    def _resolve_prefill(self, leader: str, tokens: Sequence[Hashable],
                         topk: torch.Tensor) -> torch.Tensor:
        """Rows of a prefill chunk's ``topk`` (``[T, K]`` int32, request ``tokens[t]`` per
        query token) through prefill staging."""

    # Shared ---------------------------------------------------------------------------
    def _admitted(self, request: Hashable, cached: int) -> int:
        self._len[request] = cached
        return cached

    def place(self, request: Hashable, start: int) -> None:
        self._starts[request] = start

    def _placed_slots(self, layer: str, request: Hashable, count: int) -> torch.Tensor:
        """``[count] int64`` device rows of positions ``start ..`` (``place``), read through
        the layer's block table as a model runner computes its slot mapping from corrected
        positions: a rejected draft's position gets the next token's bytes."""
        blocks, _ = self._history(layer, request)
        B = self.cache(layer).shape[1]
        positions = torch.arange(self._starts[request], self._starts[request] + count)
        return blocks[positions // B] * B + positions % B

    def write(self, layer: str, request: Hashable, rows: torch.Tensor) -> None:
        slots = (self._placed_slots(layer, request, rows.shape[0]) if request in self._starts
                 else self._slots(request, layer))
        cache = self.cache(layer)
        data = rows.contiguous().view(torch.uint8)
        if data.shape != (slots.numel(), cache.shape[2]):
            raise ValueError(f"request {request!r}, layer {layer}: rows of {data.shape[-1]} B "
                             f"for {slots.numel()} appended tokens of {cache.shape[2]} B.")
        B = cache.shape[1]
        slots = slots.to(cache.device)
        cache[slots // B, slots % B] = data.to(cache.device)

    def indexer_keys(self, layer: str, request: Hashable) -> torch.Tensor:
        cache = self.cache(layer)
        B = cache.shape[1]
        blocks, length = self._history(layer, request)
        positions = torch.arange(length)
        rows = blocks[positions // B] * B + positions % B
        return _read_rows(cache, rows).view(torch.float32)

    def select(self, leader: str, requests: Sequence[Optional[Hashable]],
               topk: torch.Tensor) -> Selection:
        """Requests that decode this step (at most ``max_decode_query_len`` query tokens)
        resolve their ``[Q, K]`` selections as ONE union in their hot buffers; requests
        that prefill a chunk (more query tokens) go through prefill staging: every query
        token's selections become rows read in place or staged from the host, without
        touching the hot buffers. Both kinds may share a step."""
        topk = topk.cpu()
        R, Q, K = topk.shape
        q = min(Q, self.max_query_len)
        prefilling = [r for r, request in enumerate(requests)
                      if request is not None and bool((topk[r, q:] >= 0).any())]
        rows = torch.full((R, Q, K), -1, dtype=torch.int64)
        decoding = [None if r in prefilling else request for r, request in enumerate(requests)]
        if any(request is not None for request in decoding):
            got = self._resolve(leader, decoding, topk[:, :q].to(torch.int32))
            self.resolve_shapes.append((leader, (R, q, K)))
            rows[:, :q] = got.to("cpu", torch.int64)
        if prefilling:
            tokens = [requests[r] for r in prefilling for _ in range(Q)]
            got = self._resolve_prefill(leader, tokens,
                                        topk[prefilling].reshape(-1, K).to(torch.int32))
            self.prefill_shapes.append((leader, (len(tokens), K)))
            rows[prefilling] = got.to("cpu", torch.int64).view(len(prefilling), Q, K)
        return _PoolSelection(self, rows.to(self.cache(leader).device))

    def _forget(self, request: Hashable) -> None:
        self._len.pop(request, None)
        self._starts.pop(request, None)


class RuntimeLike(Protocol):
    """What ``HiSparseStore`` uses of a runtime: ``HiSparseRuntime``'s API."""

    device_buffer_size: int
    config: Any

    def add_request(self, request_id: Hashable, prompt_len: int, max_new_tokens: int,
                    token_ids: Optional[Sequence[int]] = None) -> int: ...
    def append_slots(self, request_id: Hashable, num_tokens: int, *,
                     num_draft_tokens: int = 0) -> dict[str, torch.Tensor]: ...
    def verify_drafts(self, request_id: Hashable, num_accepted: int) -> None: ...
    def device_cache(self, layer_name: str) -> torch.Tensor: ...
    def block_table(self, request_id: Hashable, layer_name: str) -> list[int]: ...
    def seq_len(self, request_id: Hashable) -> int: ...
    def resolve(self, leader_layer: str, request_ids: Sequence[Optional[Hashable]],
                topk: torch.Tensor) -> torch.Tensor: ...
    def resolve_prefill(self, leader_layer: str, request_ids: Sequence[Optional[Hashable]],
                        topk: torch.Tensor) -> torch.Tensor: ...
    def commit(self) -> None: ...
    def truncate(self, request_id: Hashable, new_len: int) -> None: ...
    def free_request(self, request_id: Hashable) -> None: ...


class HiSparseStore(_PoolStore):
    """The KV rows in an in-process ``HiSparseRuntime`` (the facade over one scheduler and
    one worker): ``append_slots`` rows, ``resolve`` by request ids, ``commit()`` per step."""

    def __init__(self, runtime: RuntimeLike) -> None:
        super().__init__()
        self.runtime = runtime
        self.buffer_size = runtime.device_buffer_size
        self.max_query_len = runtime.config.hisparse.max_decode_query_len
        self._slot_rows: dict[Hashable, dict[str, torch.Tensor]] = {}

    def add(self, request: Hashable, prompt_len: int, max_new_tokens: int,
            token_ids: Optional[Sequence[int]] = None) -> int:
        return self._admitted(request, self.runtime.add_request(
            request, prompt_len, max_new_tokens, token_ids))

    def append(self, request: Hashable, num_tokens: int) -> None:
        self.append_drafts(request, num_tokens, 0)

    def append_drafts(self, request: Hashable, num_tokens: int, num_drafts: int) -> None:
        rows = self.runtime.append_slots(request, num_tokens, num_draft_tokens=num_drafts)
        earlier = self._slot_rows.get(request)
        if earlier is not None:
            rows = {layer: torch.cat([earlier[layer], r]) for layer, r in rows.items()}
        self._slot_rows[request] = rows
        self._len[request] += num_tokens

    def begin(self) -> None:
        pass   # the facade hands its plans to the worker when a resolve needs them

    def cache(self, layer: str) -> torch.Tensor:
        return self.runtime.device_cache(layer)

    def _slots(self, request: Hashable, layer: str) -> torch.Tensor:
        return self._slot_rows[request][layer]

    def _history(self, layer: str, request: Hashable) -> tuple[torch.Tensor, int]:
        blocks = torch.as_tensor(self.runtime.block_table(request, layer), dtype=torch.int64)
        return blocks, self.runtime.seq_len(request)

    def _resolve(self, leader: str, requests: Sequence[Optional[Hashable]],
                 topk: torch.Tensor) -> torch.Tensor:
        return self.runtime.resolve(leader, requests, topk)

    def _resolve_prefill(self, leader: str, tokens: Sequence[Hashable],
                         topk: torch.Tensor) -> torch.Tensor:
        return self.runtime.resolve_prefill(leader, tokens, topk)

    def truncate(self, request: Hashable, new_len: int) -> None:
        self.runtime.truncate(request, new_len)   # before commit(): not durable yet
        self._len[request] = new_len

    def verify(self, request: Hashable, num_accepted: int) -> None:
        self.runtime.verify_drafts(request, num_accepted)   # before commit(): undurable

    def commit(self) -> None:
        self.runtime.commit()
        self._slot_rows.clear()
        self._starts.clear()

    def free(self, request: Hashable) -> None:
        self.runtime.free_request(request)
        self._slot_rows.pop(request, None)
        self._forget(request)


# ---------------------------------------------------------------------------- split + TP
class StepLink(Protocol):
    """How the ranks of a tensor-parallel group share a step (rank 0 schedules)."""

    rank: int

    def share(self, value: Any) -> Any:
        """Rank 0's ``value`` on every rank (a collective: every rank calls it)."""
        ...

    def share_plan(self, plan: Optional[StepPlan]) -> StepPlan:
        """Rank 0's plan on every rank."""
        ...

    def barrier(self) -> None:
        ...


class LocalLink:
    """One process: nothing to share."""

    rank = 0

    def share(self, value: Any) -> Any:
        return value

    def share_plan(self, plan: Optional[StepPlan]) -> StepPlan:
        assert plan is not None
        return plan

    def barrier(self) -> None:
        pass


class GlooLink:
    """The ranks of the default ``torch.distributed`` group (gloo: CPU tensors)."""

    def __init__(self) -> None:
        import torch.distributed as dist

        self._dist = dist
        self.rank = dist.get_rank()

    def share(self, value: Any) -> Any:
        box = [value]
        self._dist.broadcast_object_list(box, src=0)
        return box[0]

    def share_plan(self, plan: Optional[StepPlan]) -> StepPlan:
        from hisparse_triton.distributed import broadcast_plan

        return broadcast_plan(plan, src=0)

    def barrier(self) -> None:
        self._dist.barrier()


class SplitStore(_PoolStore):
    """The KV rows in a ``HiSparseWorker``, scheduled by a ``HiSparseScheduler``, driven by
    the serving-stack protocol: scheduling calls -> ``plan = scheduler.step()`` -> (every
    rank) ``worker.apply(plan)`` -> forward -> ``worker.mirror(plan)``.

    Tensor parallelism (``link`` a ``GlooLink``): only rank 0 holds the ``scheduler``; it
    shares the outcome of every ``add`` (the cached prefix), and at ``begin()`` the plan
    (``broadcast_plan``) and the step's rows (state row of every request, device rows of the
    tokens appended); every rank writes the same KV into its own device pool; rank 0's
    worker mirrors into the host pool the ranks share, and the ranks meet at a barrier after
    the mirror, before anyone reads the host pool again. The other ranks check that they
    appended what rank 0 scheduled (``RuntimeError`` otherwise).
    """

    def __init__(self, worker: HiSparseWorker, scheduler: Optional[HiSparseScheduler] = None,
                 link: Optional[StepLink] = None) -> None:
        super().__init__()
        self.worker = worker
        self.scheduler = scheduler
        self.link: StepLink = link if link is not None else LocalLink()
        if (scheduler is not None) != (self.link.rank == 0):
            raise ValueError(f"rank {self.link.rank}: the scheduler lives on rank 0 (and only "
                             f"there).")
        self.buffer_size = worker.device_buffer_size
        self.max_query_len = worker.config.hisparse.max_decode_query_len
        self._appended: dict[Hashable, list] = {}   # rank 0: slot dicts; others: counts
        self._plan: Optional[StepPlan] = None
        self._step_rows: dict[str, Any] = {"rows": {}, "slots": {}}

    @property
    def leads(self) -> bool:
        return self.scheduler is not None

    # ------------------------------------------------------------------ scheduling
    def add(self, request: Hashable, prompt_len: int, max_new_tokens: int,
            token_ids: Optional[Sequence[int]] = None) -> int:
        outcome: Any = None
        error: Optional[BaseException] = None
        if self.leads:
            try:
                outcome = self.scheduler.add_request(request, prompt_len, max_new_tokens,
                                                     token_ids)
            except (HiSparseError, ValueError) as exc:
                error, outcome = exc, f"rank 0 refused request {request!r}: {exc}"
        outcome = self.link.share(outcome)
        if error is not None:
            raise error
        if isinstance(outcome, str):
            raise RuntimeError(outcome)
        return self._admitted(request, int(outcome))

    def append(self, request: Hashable, num_tokens: int) -> None:
        self.append_drafts(request, num_tokens, 0)

    def append_drafts(self, request: Hashable, num_tokens: int, num_drafts: int) -> None:
        if self.leads:
            entry = self.scheduler.append_slots(request, num_tokens,
                                                num_draft_tokens=num_drafts)
        else:
            entry = num_tokens
        self._appended.setdefault(request, []).append(entry)
        self._len[request] += num_tokens

    def verify(self, request: Hashable, num_accepted: int) -> None:
        """Rank 0's scheduler takes the verification (the next plan carries it to every
        rank); every rank knows the outcome (it computed the same tokens)."""
        if self.leads:
            self.scheduler.verify_drafts(request, num_accepted)

    def truncate(self, request: Hashable, new_len: int) -> None:
        """Rank 0's scheduler rolls back (the next plan carries it to every rank); its
        tokens are in this step's plan, not durable until the next ``step()``."""
        if self.leads:
            self.scheduler.truncate(request, new_len)
        self._len[request] = new_len

    def free(self, request: Hashable) -> None:
        if self.leads:
            self.scheduler.free_request(request)
        self._appended.pop(request, None)
        self._forget(request)

    # ------------------------------------------------------------------ the step
    def begin(self) -> None:
        message = None
        plan = None
        if self.leads:
            plan = self.scheduler.step()
            slots = {request: {layer: np.concatenate([entry[layer] for entry in entries])
                               for layer in entries[0]}
                     for request, entries in self._appended.items()}
            message = {"rows": {r: self.scheduler.state_row(r) for r in self.scheduler.request_ids},
                       "slots": slots}
        plan = self.link.share_plan(plan)
        message = self.link.share(message)
        if not self.leads:
            mine = {r: sum(counts) for r, counts in self._appended.items()}
            theirs = {r: next(iter(s.values())).size for r, s in message["slots"].items()}
            if mine != theirs:
                raise RuntimeError(f"rank {self.link.rank} appended {mine} in step {plan.step}, "
                                   f"rank 0 scheduled {theirs}: the ranks diverged.")
        self.worker.apply(plan)
        self._plan, self._step_rows = plan, message
        self._appended.clear()

    def commit(self) -> None:
        if self._plan is None:
            raise RuntimeError("commit() without begin(): no plan was applied this step.")
        self.worker.mirror(self._plan)
        if not isinstance(self.link, LocalLink):
            if self.worker.device.type == "cuda":
                torch.cuda.synchronize(self.worker.device)   # the mirror has run
            self.link.barrier()    # rank 0's mirror is in the shared pool before any read
        self._plan = None
        self._starts.clear()

    # ------------------------------------------------------------------ worker side
    def cache(self, layer: str) -> torch.Tensor:
        return self.worker.device_cache(layer)

    def _slots(self, request: Hashable, layer: str) -> torch.Tensor:
        return torch.from_numpy(self._step_rows["slots"][request][layer])

    def _history(self, layer: str, request: Hashable) -> tuple[torch.Tensor, int]:
        row = self._step_rows["rows"][request]
        blocks = self.worker.block_tables(layer)[row].to("cpu", torch.int64)
        return blocks, int(self.worker.seq_lens[row])

    def _resolve(self, leader: str, requests: Sequence[Optional[Hashable]],
                 topk: torch.Tensor) -> torch.Tensor:
        rows = self._step_rows["rows"]
        state_rows = torch.tensor([rows[r] if r is not None else -1 for r in requests],
                                  dtype=torch.int32)
        return self.worker.resolve_rows(leader, state_rows, topk)

    def _resolve_prefill(self, leader: str, tokens: Sequence[Hashable],
                         topk: torch.Tensor) -> torch.Tensor:
        """The worker's prefill staging; rank 0 bounds the chunk's host-only rows from its
        scheduler (no device read when the region holds them), the other ranks let the
        worker read its count."""
        rows = self._step_rows["rows"]
        state_rows = torch.tensor([rows[r] for r in tokens], dtype=torch.int32)
        bound = (scheduler_host_rows_bound(self.scheduler, leader, tokens, topk.shape[1])
                 if self.leads else None)
        return self.worker.resolve_prefill(leader, state_rows, topk, host_rows_bound=bound)


# ============================================================================ CUDA graphs
def _read_rows_fixed(cache: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``_read_rows`` at a fixed shape (no host sync, CUDA-graph capturable): ``[...,
    row_bytes] uint8`` rows ``rows [...]`` of ``cache``, zeros where ``rows < 0``."""
    B = cache.shape[1]
    rows = rows.long()
    safe = rows.clamp(min=0)
    picked = cache[safe // B, safe % B]
    return torch.where((rows >= 0).unsqueeze(-1), picked, torch.zeros_like(picked))


class GraphDecode:
    """A decode step of every request at fixed shapes, captured once in a CUDA graph and
    replayed with a new plan each step (``--cuda-graph``): how a serving stack decodes.

    The graph holds the whole decode forward of ``batch`` rows: KV writes at the rows the
    scheduler handed out, every index group's indexer (over the history read through the
    worker's block tables), its ``worker.resolve_rows`` (the gather of the misses inside),
    the attention reading the returned rows, the MLPs and the LM head. Its inputs are
    persistent tensors (tokens, positions, state rows, the new tokens' device rows), filled
    before each replay; what stays eager between replays is the scheduler, ``apply(plan)``
    (before) and ``mirror(plan)`` (after): ``SplitStore.begin`` / ``commit``. A step of
    fewer requests than the graph's batch is padded: a padding row has state row -1 (it
    resolves to -1 everywhere, gathers nothing and touches no hot state), position -1 (it
    selects nothing) and writes its KV back over row 0 of the null block with the bytes
    already there (it changes nothing). Only decode steps of one token per request replay;
    a step with a prefill chunk runs the eager ``TinyDSA.forward``.

    Capture needs CUDA; elsewhere the same fixed-shape step runs eagerly each time (what the
    graph would replay: the CPU tests check it). ``captures``, ``replays``, ``eager_steps``
    and ``padding_rows`` count what happened.
    """

    def __init__(self, model: TinyDSA, store: "SplitStore", batch: int) -> None:
        c, worker = model.config, store.worker
        self.model, self.store, self.batch = model, store, batch
        self.device = dev = worker.device
        self.sparse = [c.sparse_layer(i) for i in range(c.num_layers)]
        written = self.sparse + [c.indexer_layer(i) for i in range(c.num_layers)
                                 if c.is_leader(i)]
        # The graph's inputs (persistent: the graph reads them where they are).
        self.tokens = torch.zeros(batch, dtype=torch.int64, device=dev)
        self.positions = torch.full((batch, 1), -1, dtype=torch.int64, device=dev)
        self.state_rows = torch.full((batch,), -1, dtype=torch.int32, device=dev)
        self.slots = {layer: torch.zeros(batch, dtype=torch.int64, device=dev)
                      for layer in written}
        self.valid = torch.zeros(batch, 1, dtype=torch.bool, device=dev)
        self.graph: Any = None
        self.logits: Optional[torch.Tensor] = None    # the graph's output, [batch, vocab]
        self.captures = self.replays = self.eager_steps = self.padding_rows = 0

    def __call__(self, requests: Sequence[Hashable], tokens: Sequence[Sequence[int]],
                 starts: Sequence[int]) -> torch.Tensor:
        """``[R, 1, vocab]`` logits of a decode step (``TinyDSA.forward``'s contract for one
        token per request), after ``store.begin()`` applied the step's plan."""
        R = len(requests)
        if not 1 <= R <= self.batch or any(len(t) != 1 for t in tokens):
            raise ValueError(f"a graph step takes 1..{self.batch} requests of one token "
                             f"each, got {[len(t) for t in tokens]}.")
        if self.device.type == "cuda" and self.graph is None:
            self._capture()
        self._fill(self.step_inputs(requests, tokens, starts))
        self.padding_rows += self.batch - R
        if self.graph is not None:
            self.graph.replay()
            self.replays += 1
            logits = self.logits
        else:
            logits = self.forward()
            self.eager_steps += 1
        return logits[:R].unsqueeze(1).clone()

    def step_inputs(self, requests: Sequence[Hashable], tokens: Sequence[Sequence[int]],
                    starts: Sequence[int]) -> dict[str, Any]:
        """The graph's inputs for a step (CPU tensors, ``batch`` rows, padding rows last):
        ``tokens``, ``positions``, ``state_rows``, ``valid`` and ``slots`` (per written
        layer, the device row of each request's new token; 0 for padding)."""
        B, rows = self.batch, self.store._step_rows
        inputs: dict[str, Any] = {
            "tokens": torch.zeros(B, dtype=torch.int64),
            "positions": torch.full((B, 1), -1, dtype=torch.int64),
            "state_rows": torch.full((B,), -1, dtype=torch.int32),
            "valid": torch.zeros(B, 1, dtype=torch.bool),
            "slots": {layer: torch.zeros(B, dtype=torch.int64) for layer in self.slots}}
        for r, (request, toks, start) in enumerate(zip(requests, tokens, starts)):
            inputs["tokens"][r] = toks[0]
            inputs["positions"][r, 0] = start
            inputs["state_rows"][r] = rows["rows"][request]
            inputs["valid"][r, 0] = True
            for layer, slots in inputs["slots"].items():
                slots[r] = int(rows["slots"][request][layer][0])
        return inputs

    def padding_inputs(self) -> dict[str, Any]:
        """Inputs of a step whose every row is padding (what the warm-up before the capture
        runs: it changes nothing)."""
        return self.step_inputs([], [], [])

    def _fill(self, inputs: dict[str, Any]) -> None:
        for name in ("tokens", "positions", "state_rows", "valid"):
            getattr(self, name).copy_(inputs[name])
        for layer, slots in inputs["slots"].items():
            self.slots[layer].copy_(slots)

    def _capture(self) -> None:
        """Warm the step (Triton compiles, persistent outputs sized) on padding rows only,
        then capture it."""
        self._fill(self.padding_inputs())
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            self.forward()
        torch.cuda.current_stream(self.device).wait_stream(stream)
        torch.cuda.synchronize(self.device)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.logits = self.forward()
        self.captures += 1

    # ------------------------------------------------------------------ the captured step
    def forward(self) -> torch.Tensor:
        """The decode forward on the graph's inputs: ``[batch, vocab]`` logits. Fixed shapes
        and no host sync: every value stays on the device."""
        model, c, worker = self.model, self.model.config, self.store.worker
        positions = self.positions
        h = model.embed[self.tokens].unsqueeze(1)                   # [B, 1, D]
        topk = rows = None
        for i, w in enumerate(model.layers):
            name = self.sparse[i]
            x = _rms_norm(h, w["attn_norm"])
            self._write(name, model.latent(w, x, positions))
            if c.is_leader(i):
                layer = c.indexer_layer(i)
                self._write(layer, model.index_key(w, x, positions))
                topk = model.select_topk(w, x, positions, self._history(layer))
                rows = worker.resolve_rows(name, self.state_rows, topk)   # [B, 1, K]
            assert topk is not None and rows is not None
            kv = _read_rows_fixed(worker.device_cache(name), rows).view(torch.float32)
            h = model.mlp(w, h + model._attention(w, x, positions, topk, kv))
        return model.lm_head(_rms_norm(h, model.final_norm))[:, 0]

    def _write(self, layer: str, rows: torch.Tensor) -> None:
        """Store ``rows [B, 1, d]`` at the new tokens' device rows; a padding row writes the
        bytes already at its row (row 0 of the null block) back."""
        cache = self.store.worker.device_cache(layer)
        B = cache.shape[1]
        slots = self.slots[layer]
        block, offset = slots // B, slots % B
        data = rows[:, 0].contiguous().view(torch.uint8)
        cache[block, offset] = torch.where(self.valid, data, cache[block, offset])

    def _history(self, layer: str) -> torch.Tensor:
        """``[B, T, dI]`` every request's indexer keys of positions ``0 .. T-1`` (``T``: the
        block table's pages x block size), read through the worker's block table; zeros
        past each request's position."""
        worker = self.store.worker
        cache = worker.device_cache(layer)
        B = cache.shape[1]
        table = worker.block_tables(layer)[self.state_rows.clamp(min=0).long()]
        t = torch.arange(table.shape[1] * B, device=self.device)
        blocks = table[:, t // B].long()                             # [B, T]
        keys = cache[blocks, (t % B).expand_as(blocks)].view(torch.float32)
        visible = t.view(1, -1) <= self.positions                    # [B, T]
        return keys.masked_fill(~visible.unsqueeze(-1), 0.0)


def dense_store_for(config: TinyDSAConfig, device: torch.device | str = "cpu") -> DenseStore:
    """A ``DenseStore`` with the model's layers (the same names as the runtime's)."""
    row_dims = {}
    for i in range(config.num_layers):
        row_dims[config.sparse_layer(i)] = config.latent_dim
        if config.is_leader(i):
            row_dims[config.indexer_layer(i)] = config.index_dim
    return DenseStore(row_dims, device)


# ============================================================================ decoding
class DraftRejectedError(RuntimeError):
    """The model did not accept a draft token of a drafter declared perfect (decoding
    without ``rollback``)."""


@dataclass
class GenRequest:
    """One request of the workload and what greedy decoding produced for it."""

    request_id: str
    prompt: list[int]
    max_new_tokens: int
    computed: int = 0                     # tokens whose KV is in the store
    tokens: list[int] = field(default_factory=list)
    logits: list[torch.Tensor] = field(default_factory=list)  # [vocab] float32 per token

    def next_tokens(self, chunk_size: int, spec_tokens: int,
                    drafts: Optional[Sequence[int]]) -> list[int]:
        """The tokens this step computes: the next prefill chunk, or the last generated
        token followed by up to ``spec_tokens - 1`` draft tokens."""
        if self.computed < len(self.prompt):
            return self.prompt[self.computed:self.computed + chunk_size]
        n = len(self.tokens)
        queries = min(spec_tokens, self.max_new_tokens - n)
        if queries > 1 and drafts is None:
            raise ValueError(f"{self.request_id}: speculative decoding without drafts.")
        return [self.tokens[-1], *(drafts[n:n + queries - 1] if queries > 1 else [])]

    def accept(self, fed: Sequence[int], logits: torch.Tensor, *,
               rollback: bool = False) -> int:
        """Take this step's outputs (``logits [len(fed), vocab]``): nothing mid-prefill, one
        token after the last prompt chunk, one token per query when decoding. A draft the
        model does not choose ends the step's outputs: with ``rollback`` the drafts after
        the model's choice are rejected (returns how many: their KV must be dropped),
        without it ``DraftRejectedError``."""
        self.computed += len(fed)
        if self.computed < len(self.prompt):
            return 0
        decoding = self.computed - len(fed) >= len(self.prompt)
        outputs = range(len(fed)) if decoding else [len(fed) - 1]
        for j in outputs:
            token = int(logits[j].argmax())
            self.logits.append(logits[j].cpu())
            self.tokens.append(token)
            if decoding and j + 1 < len(fed) and token != fed[j + 1]:
                if not rollback:
                    raise DraftRejectedError(
                        f"{self.request_id}: draft token {fed[j + 1]} at output "
                        f"{len(self.tokens) - 1} was rejected (the model chose {token}); "
                        f"without --mtp this example accepts only a perfect drafter.")
                rejected = len(fed) - (j + 1)
                self.computed -= rejected
                return rejected
        return 0


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
    """Per request: generated tokens and their ``[n, vocab] float32`` logits; ``steps``
    model steps, ``cached_tokens`` prompt tokens the store reported cached (not computed),
    ``computed_tokens`` tokens run through the model, ``rejected_tokens`` draft tokens
    rolled back."""

    tokens: dict[str, list[int]]
    logits: dict[str, torch.Tensor]
    steps: int
    cached_tokens: int = 0
    computed_tokens: int = 0
    rejected_tokens: int = 0


def draft_lookahead(spec_tokens: int, async_scheduling: bool) -> int:
    """Tokens a request reserves past its own: under async scheduling, the unverified drafts
    of the step before (``spec_tokens - 1``); none otherwise."""
    return spec_tokens - 1 if async_scheduling else 0


def greedy_decode(model: TinyDSA, store: KVStore, workload: Workload, *, chunk_size: int = 32,
                  max_running: Optional[int] = None, spec_tokens: int = 1,
                  drafts: Optional[dict[str, list[int]]] = None,
                  rollback: bool = False,
                  decode_step: Optional[Callable[..., torch.Tensor]] = None,
                  async_scheduling: bool = False) -> DecodeResult:
    """Greedy decoding of ``workload`` through ``store`` (continuous batching).

    A request is admitted (``store.add`` with its prompt's token ids; it starts after the
    prefix the store reports cached) when fewer than ``max_running`` (default: all) run, and
    freed after its ``max_new_tokens``-th token. Each step every running request computes
    either its next prefill chunk (at most ``chunk_size`` tokens) or, decoding, its last
    token and up to ``spec_tokens - 1`` tokens of ``drafts[request]`` (speculative
    decoding); then ``store.begin()``, the forward, the outputs, ``store.commit()``. When
    the model disagrees with a draft, its choice is the step's last token and, with
    ``rollback``, the later drafts are dropped (``store.truncate`` before ``commit``: they
    are not durable yet), else ``DraftRejectedError``. ``DecodeResult.rejected_tokens``
    counts them. ``decode_step(requests, tokens, starts)``: runs a step in which every
    request decodes one token instead of ``model.forward`` (``GraphDecode``).

    ``async_scheduling`` (vLLM's async scheduling, ``max_concurrent_batches=2``; a pooled
    store): the store learns a step's verification one step late, in vLLM's order:
    schedule step N+1 (``append_drafts``: the last token and the drafts, appended after
    step N's drafts as if all were accepted), its forward (``place``: the tokens at the
    positions the accepted ones give, as a model runner corrects them), then ``verify`` step
    N's drafts (the rejected ones leave the store, step N+1's tokens move down), ``commit``.
    Each request reserves ``spec_tokens - 1`` more tokens: the store holds the unverified
    drafts of the step before on top of them.
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}.")
    if spec_tokens < 1:
        raise ValueError(f"spec_tokens must be >= 1, got {spec_tokens}.")
    if spec_tokens > 1 and drafts is None:
        raise ValueError(f"spec_tokens={spec_tokens} needs drafts (a drafter's continuation "
                         f"of every request).")
    waiting = workload.requests(model.config.vocab_size)
    max_running = len(waiting) if max_running is None else max_running
    if max_running < 1:
        raise ValueError(f"max_running must be >= 1, got {max_running}.")
    running: list[GenRequest] = []
    done: list[GenRequest] = []
    steps = cached_total = computed_total = rejected_total = 0
    lookahead = draft_lookahead(spec_tokens, async_scheduling)
    #: Async: per request, the drafts its last step verified and how many it accepted (the
    #: store hears it after the next step's forward).
    unverified: dict[str, tuple[int, int]] = {}
    while waiting or running:
        while waiting and len(running) < max_running:
            request = waiting.pop(0)
            cached = store.add(request.request_id, len(request.prompt),
                               request.max_new_tokens + lookahead, request.prompt)
            if not 0 <= cached < len(request.prompt):
                raise ValueError(f"{request.request_id}: the store reports {cached} cached "
                                 f"tokens of a {len(request.prompt)}-token prompt (the last "
                                 f"prompt token must be computed for its logits).")
            request.computed = cached
            cached_total += cached
            running.append(request)
        fed = [request.next_tokens(chunk_size, spec_tokens,
                                   drafts.get(request.request_id) if drafts else None)
               for request in running]
        for request, tokens in zip(running, fed):
            if async_scheduling:
                drafting = request.computed >= len(request.prompt)
                store.append_drafts(request.request_id, len(tokens),
                                    len(tokens) - 1 if drafting else 0)
            else:
                store.append(request.request_id, len(tokens))
        store.begin()
        ids, starts = [r.request_id for r in running], [r.computed for r in running]
        if async_scheduling:
            for request in running:
                store.place(request.request_id, request.computed)
        if decode_step is not None and all(len(tokens) == 1 and r.computed >= len(r.prompt)
                                           for r, tokens in zip(running, fed)):
            logits = decode_step(ids, fed, starts)
        else:
            logits = model.forward(store, ids, fed, starts)
        for r, (request, tokens) in enumerate(zip(running, fed)):
            decoding = request.computed >= len(request.prompt)
            rejected = request.accept(tokens, logits[r, :len(tokens)], rollback=rollback)
            rejected_total += rejected
            if async_scheduling:
                earlier = unverified.pop(request.request_id, None)
                if earlier is not None:            # step N's verification reaches the store
                    store.verify(request.request_id, earlier[1])
                if decoding and len(tokens) > 1:
                    unverified[request.request_id] = (len(tokens) - 1,
                                                      len(tokens) - 1 - rejected)
            elif rejected:
                store.truncate(request.request_id, request.computed)
        store.commit()
        steps += 1
        computed_total += sum(len(tokens) for tokens in fed)
        for request in [r for r in running if len(r.tokens) >= r.max_new_tokens]:
            unverified.pop(request.request_id, None)     # freed with the request
            store.free(request.request_id)
            running.remove(request)
            done.append(request)
    return DecodeResult(tokens={r.request_id: r.tokens for r in done},
                        logits={r.request_id: torch.stack(r.logits) for r in done},
                        steps=steps, cached_tokens=cached_total,
                        computed_tokens=computed_total, rejected_tokens=rejected_total)


# ============================================================================ set-up
@dataclass(frozen=True)
class RunSpec:
    """One run of the example: model, workload, pools and runtime options.

    ``max_num_batched_tokens``: the engine's chunk limit (the runtime refuses more
    uncommitted tokens per request; at least ``chunk_size`` and ``spec_tokens``).
    ``spec_tokens``: query tokens per decode step (the hot buffer holds ``spec_tokens + 1``
    top-k selections). ``draft_error``: the chance that a draft token is wrong (``--mtp``:
    a drafter wrong at random; rejected drafts are rolled back); 0: a perfect drafter.
    ``free_block_watermark`` None: the runtime's default.
    ``max_model_len``: the model's context (default: the preset's 1024 tokens).
    ``device_blocks``: the blocks requests may use (default: sized for the workload); the
    prefill staging region comes on top of them.
    ``cuda_graph``: decode steps through a ``GraphDecode`` of ``max_running`` rows (a
    ``SplitStore`` on one rank, one query token per step).
    ``async_scheduling``: vLLM's async scheduling (``greedy_decode``): drafts verified a
    step late, the engine's ``max_concurrent_batches`` 2.
    """

    num_requests: int = 4
    num_layers: int = 4
    prompt_len_range: tuple[int, int] = (128, 320)
    max_new_tokens: int = 8
    chunk_size: int = 32
    max_running: Optional[int] = None
    shared_prefix_len: int = 0
    spec_tokens: int = 1
    draft_error: float = 0.0
    max_num_batched_tokens: Optional[int] = None
    device_blocks: Optional[int] = None
    offload_threshold_pages: Optional[int] = None
    free_block_watermark: Optional[float] = None
    backend: str = "torch"
    device: str = "cpu"
    seed: int = 0
    max_model_len: Optional[int] = None
    cuda_graph: bool = False
    async_scheduling: bool = False

    @property
    def context(self) -> int:
        """Tokens a request may hold: ``max_model_len``, or the preset's context."""
        return self.max_model_len or get_preset(PRESET).max_model_len

    def model_config(self) -> TinyDSAConfig:
        return TinyDSAConfig.for_preset(PRESET, num_layers=self.num_layers,
                                        max_positions=self.context)

    def prefill_staging_rows(self) -> int:
        """Staging rows for prefill chunks: every host-only row one step can select, i.e.
        the running requests' whole histories, at most ``tokens x top-k`` of the step (so
        no chunk can overflow the region)."""
        workload = self.workload()
        longest = sorted(workload.prompt_lens, reverse=True)[:self.running]
        history = sum(length + workload.max_new_tokens for length in longest)
        return min(history, self.running * self.chunk_size * self.model_config().topk)

    def workload(self) -> Workload:
        return Workload.random(self.num_requests, self.prompt_len_range,
                               max_new_tokens=self.max_new_tokens,
                               shared_prefix_len=self.shared_prefix_len, seed=self.seed)

    @property
    def running(self) -> int:
        return self.max_running or self.num_requests

    @property
    def lookahead(self) -> int:
        """Tokens a request reserves past its own (``draft_lookahead``)."""
        return draft_lookahead(self.spec_tokens, self.async_scheduling)

    def runtime_options(self) -> dict[str, Any]:
        """Scheduler keyword arguments of this run."""
        options: dict[str, Any] = {"offload_threshold_pages": self.offload_threshold_pages}
        if self.free_block_watermark is not None:
            options["free_block_watermark"] = self.free_block_watermark
        return options

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, values: dict[str, Any]) -> "RunSpec":
        return cls(**{**values, "prompt_len_range": tuple(values["prompt_len_range"])})


def plan_for_spec(spec: RunSpec, *, tensor_parallel_size: int = 1) -> WorkloadPlan:
    """The ``tiny`` preset cut to the model's layers, pools sized for the workload: the
    device pool holds the running requests' working set (indexer history, hot buffers,
    active tails) and one prefill chunk per running request, so older pages must leave the
    GPU (``all_gpu_blocks`` is what keeping them would take)."""
    config = spec.model_config()
    workload = spec.workload()
    context = spec.context
    if workload.max_len > context:
        raise ValueError(f"a {max(workload.prompt_lens)}-token prompt + {workload.max_new_tokens}"
                         f" new tokens exceeds max_model_len {context} (the {PRESET!r} "
                         f"preset's unless --max-model-len is given).")
    limit = spec.max_num_batched_tokens
    if limit is not None and limit < max(spec.chunk_size, spec.spec_tokens):
        raise ValueError(f"max_num_batched_tokens {limit} is below the prefill chunk "
                         f"({spec.chunk_size}) or the speculative tokens per step "
                         f"({spec.spec_tokens}): the runtime would refuse those appends.")
    kv_spec = build_kv_cache_spec(PRESET, num_layers=config.num_layers)

    def plan(device_blocks: Optional[int]) -> WorkloadPlan:
        return plan_for_workload(kv_spec, max_model_len=workload.max_len + spec.lookahead,
                                 num_requests=spec.running, topk=config.topk,
                                 prompt_len=spec.chunk_size * spec.running,
                                 device_blocks=device_blocks, max_num_batched_tokens=limit,
                                 max_decode_query_len=spec.spec_tokens,
                                 tensor_parallel_size=tensor_parallel_size)

    # The prefill staging region: the last blocks of the device pool, on top of the blocks
    # the requests may use (the scheduler never hands them out).
    sized = plan(spec.device_blocks)
    rows = spec.prefill_staging_rows()
    staged = plan(sized.kv_cache_config.num_blocks + cdiv(rows, sized.block_size))
    hisparse = dataclasses.replace(staged.config.hisparse, prefill_staging_rows=rows)
    batches = 2 if spec.async_scheduling else 1       # vLLM's async scheduling: 2 in flight
    return dataclasses.replace(staged, config=dataclasses.replace(
        staged.config, hisparse=hisparse, max_concurrent_batches=batches))


def build_runtime(spec: RunSpec) -> HiSparseRuntime:
    """The in-process facade for ``spec`` (``plan_for_spec``)."""
    plan = plan_for_spec(spec)
    return HiSparseRuntime(plan.kv_cache_config, plan.config, max_num_seqs=spec.running,
                           device=spec.device, backend=spec.backend, **spec.runtime_options())


def build_split(spec: RunSpec) -> tuple[HiSparseScheduler, HiSparseWorker]:
    """A scheduler + worker pair for ``spec`` (``plan_for_spec``), one process."""
    plan = plan_for_spec(spec)
    scheduler = HiSparseScheduler(plan.kv_cache_config, plan.config,
                                  max_num_seqs=spec.running, **spec.runtime_options())
    worker = HiSparseWorker(plan.kv_cache_config, plan.config, max_num_seqs=spec.running,
                            device=spec.device, backend=spec.backend)
    return scheduler, worker


def all_gpu_blocks(kv_cache_config: Any, spec: RunSpec) -> int:
    """Device blocks that would hold every row of the running requests on the GPU, sized as
    ``plan_for_spec`` sizes the HiSparse pool (``max_running`` requests of the workload's
    longest length): the null block and, per request, every page of each device group but
    the hot buffers (the indexer and the MLA layers' whole histories); no hot buffer and no
    prefill staging, which only HiSparse needs."""
    groups = [g for g in kv_cache_config.kv_cache_groups
              if not g.host_resident and group_kind(g) != "hot"]
    longest = spec.workload().max_len
    return 1 + spec.running * sum(cdiv(longest, group.block_size) for group in groups)


def staging_blocks(plan: WorkloadPlan) -> int:
    """Blocks of the device pool that hold the prefill staging region (``plan_for_spec``
    puts them on top of the blocks the requests may use)."""
    return cdiv(plan.config.hisparse.prefill_staging_rows, plan.block_size)


def noisy_drafts(drafts: dict[str, list[int]], error: float, vocab_size: int,
                 seed: int = 0) -> dict[str, list[int]]:
    """``drafts`` with each token replaced, with probability ``error``, by another one (a
    drafter that is wrong at random; fixed by ``seed``)."""
    gen = torch.Generator().manual_seed(seed + 7)
    out = {}
    for request, tokens in sorted(drafts.items()):
        wrong = (torch.rand(len(tokens), generator=gen) < error).tolist()
        shift = torch.randint(1, vocab_size, (len(tokens),), generator=gen).tolist()
        out[request] = [(t + d) % vocab_size if w else t
                        for t, w, d in zip(tokens, wrong, shift)]
    return out


def run(spec: RunSpec, store: KVStore,
        drafts: Optional[dict[str, list[int]]] = None) -> DecodeResult:
    """Decode ``spec``'s workload with ``spec``'s model through ``store``. With
    ``spec.spec_tokens > 1`` the drafts default to the dense greedy continuation, wrong at
    random with ``spec.draft_error`` (then rejected drafts are rolled back)."""
    if spec.spec_tokens > 1 and drafts is None:
        drafts = run_dense(spec).tokens
    if drafts is not None and spec.draft_error > 0:
        drafts = noisy_drafts(drafts, spec.draft_error, spec.model_config().vocab_size,
                              spec.seed)
    model = TinyDSA(spec.model_config(), seed=spec.seed, device=spec.device)
    decode_step = None
    if spec.async_scheduling and not isinstance(store, _PoolStore):
        raise ValueError("async scheduling runs through a pooled store (split or facade).")
    if spec.cuda_graph:
        if not isinstance(store, SplitStore) or not isinstance(store.link, LocalLink) \
                or spec.spec_tokens != 1 or spec.async_scheduling:
            raise ValueError("cuda_graph decodes through the scheduler + worker pair on one "
                             "rank (--store split, --tp 1), one query token per step.")
        decode_step = store.graph = GraphDecode(model, store, spec.running)
    return greedy_decode(model, store, spec.workload(), chunk_size=spec.chunk_size,
                         max_running=spec.max_running, spec_tokens=spec.spec_tokens,
                         drafts=drafts, rollback=spec.draft_error > 0,
                         decode_step=decode_step, async_scheduling=spec.async_scheduling)


def run_dense(spec: RunSpec) -> DecodeResult:
    """The reference: every row dense, every prompt token computed, one query token per
    decode step."""
    plain = dataclasses.replace(spec, spec_tokens=1, draft_error=0.0, cuda_graph=False,
                                async_scheduling=False)
    return run(plain, dense_store_for(spec.model_config(), spec.device))


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


# ============================================================================ tensor parallel
@dataclass
class RankResult:
    """What one tensor-parallel rank decoded, and its worker's (and rank 0's scheduler's)
    counters."""

    rank: int
    result: DecodeResult
    worker: dict[str, int]
    scheduler: Optional[dict[str, int]]


def run_tp(spec: RunSpec, world: int = 2, drafts: Optional[dict[str, list[int]]] = None,
           timeout_s: float = 300.0) -> list[RankResult]:
    """Decode ``spec`` on ``world`` tensor-parallel ranks: ``world`` processes of this
    script join a gloo group; rank 0 schedules and broadcasts, every rank computes (see
    ``SplitStore``). Returns every rank's result; ``RuntimeError`` with the failing rank's
    output when a rank fails or the run outlasts ``timeout_s``."""
    if world < 2:
        raise ValueError(f"tensor parallelism needs world >= 2, got {world}.")
    if spec.spec_tokens > 1 and drafts is None:
        drafts = run_dense(spec).tokens
    with tempfile.TemporaryDirectory(prefix="tiny-dsa-tp-") as tmp:
        job = Path(tmp) / "job.json"
        job.write_text(json.dumps({"spec": spec.to_json(), "drafts": drafts, "world": world,
                                   "pool": f"tiny-dsa-{uuid.uuid4().hex[:12]}",
                                   "dir": tmp}))
        procs, logs = [], []
        for rank in range(world):
            log = open(Path(tmp) / f"rank{rank}.log", "w")
            logs.append(log)
            procs.append(subprocess.Popen(
                [sys.executable, str(Path(__file__).resolve()), "--tp-rank", str(rank),
                 "--tp-job", str(job)], stdout=log, stderr=subprocess.STDOUT))
        deadline = time.monotonic() + timeout_s
        failed = None
        try:
            while True:          # the first rank to fail stops the others (no hang)
                codes = [proc.poll() for proc in procs]
                bad = [(rank, code) for rank, code in enumerate(codes) if code not in (None, 0)]
                if bad:
                    failed = (bad[0][0], f"exit code {bad[0][1]}")
                    break
                if all(code == 0 for code in codes):
                    break
                if time.monotonic() > deadline:
                    failed = (codes.index(None), f"still running after {timeout_s:g} s")
                    break
                time.sleep(0.05)
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
            for log in logs:
                log.close()
        if failed is not None:
            rank, why = failed
            tail = (Path(tmp) / f"rank{rank}.log").read_text()[-3000:]
            raise RuntimeError(f"tensor-parallel rank {rank} failed ({why}):\n{tail}")
        out = []
        for rank in range(world):
            saved = torch.load(Path(tmp) / f"rank{rank}.pt")
            out.append(RankResult(rank, DecodeResult(**saved["result"]), saved["worker"],
                                  saved["scheduler"]))
        return out


def _tp_rank_main(rank: int, job_path: str) -> int:
    """One rank of ``run_tp`` (this script with ``--tp-rank``/``--tp-job``)."""
    import torch.distributed as dist

    job = json.loads(Path(job_path).read_text())
    spec, world, tmp = RunSpec.from_json(job["spec"]), job["world"], job["dir"]
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/pg", rank=rank,
                            world_size=world, timeout=timedelta(seconds=120))
    worker = None
    try:
        plan = plan_for_spec(spec, tensor_parallel_size=world)
        scheduler = (HiSparseScheduler(plan.kv_cache_config, plan.config,
                                       max_num_seqs=spec.running, **spec.runtime_options())
                     if rank == 0 else None)

        def make_worker(secret: Optional[str]) -> HiSparseWorker:
            return HiSparseWorker(plan.kv_cache_config, plan.config,
                                  max_num_seqs=spec.running, device=spec.device,
                                  backend=spec.backend, tp_rank=rank,
                                  host_pool_name=job["pool"], host_pool_secret=secret)

        if rank == 0:                      # rank 0 creates the shared host pool first ...
            worker = make_worker(None)
        # ... and sends its secret: the others attach only to the pool it made.
        secret = broadcast_host_pool_secret(worker.host_pool_secret if rank == 0 else None)
        if rank != 0:
            worker = make_worker(secret)
        result = run(spec, SplitStore(worker, scheduler, GlooLink()), job["drafts"])
        dist.barrier()                     # every rank is done with the shared pool
        torch.save({"result": dataclasses.asdict(result),
                    "worker": dataclasses.asdict(worker.stats()),
                    "scheduler": (dataclasses.asdict(scheduler.stats())
                                  if scheduler is not None else None)},
                   Path(tmp) / f"rank{rank}.pt")
    finally:
        if worker is not None:
            worker.close()
        dist.destroy_process_group()
    return 0


# ============================================================================ CLI
def pool_line(spec: RunSpec, plan: WorkloadPlan) -> str:
    """The device pool next to what keeping every row on the GPU would take, like with
    like: both sized for the same running requests at the same length, null block included."""
    kv_cache_config = plan.kv_cache_config
    pool, staging = kv_cache_config.num_blocks, staging_blocks(plan)
    all_gpu = all_gpu_blocks(kv_cache_config, spec)
    longest = spec.workload().max_len
    verdict = ("smaller" if pool < all_gpu else
               "not smaller: at this size the hot buffers and the staging cost as much as the "
               "histories they keep off the GPU")
    running = f"{spec.running} running request{'s' if spec.running != 1 else ''}"
    return (f"device pool {pool} blocks ({pool - staging} for {running}: indexer histories, "
            f"hot buffers, active tails and prefill chunks; {staging} of prefill staging); "
            f"every row of the same {running} on the GPU instead (indexer and MLA pages of "
            f"{longest} tokens each, no hot buffer, no staging) would take {all_gpu}: the pool "
            f"is {verdict}")


def _report(spec: RunSpec, plan: WorkloadPlan, ranks: list[tuple[str, DecodeResult, dict,
                                                                  Optional[dict]]],
            elapsed: float) -> None:
    first = ranks[0][1]
    for request, tokens in sorted(first.tokens.items()):
        print(f"  {request}: {tokens}")
    print(f"{first.steps} steps in {elapsed:.2f} s ({first.computed_tokens} tokens computed, "
          f"{first.cached_tokens} prompt tokens reused from the prefix cache, "
          f"{first.rejected_tokens} draft tokens rolled back)")
    print(pool_line(spec, plan))
    if spec.shared_prefix_len and not first.cached_tokens:
        print(f"  no prompt token was reused: all {spec.running} requests were admitted "
              f"together, before any shared prefix was durable on the host; --max-running "
              f"below --requests ({spec.num_requests}) lets later requests find it")
    for name, _, worker, scheduler in ranks:
        total = worker["hits"] + worker["misses"]
        line = (f"  {name}: {worker['hits']} hits, {worker['misses']} misses, hit rate "
                f"{worker['hits'] / total if total else 1.0:.1%}, {worker['h2d_bytes']} B "
                f"gathered, {worker['d2h_bytes']} B mirrored, {worker['plans']} plans")
        if scheduler is not None:
            line += (f"; {scheduler['unpinned_pages']} pages unpinned, "
                     f"{scheduler['lost_pages']} lost, {scheduler['prefix_hit_tokens']} prefix "
                     f"tokens hit")
        print(line)


def _decode(spec: RunSpec, store: str, tp: int, drafts: Optional[dict[str, list[int]]]
            ) -> list[tuple[str, DecodeResult, dict, Optional[dict]]]:
    """Decode through the chosen store; per rank: name, result, worker and scheduler stats."""
    if tp > 1:
        return [(f"rank {r.rank}", r.result, r.worker, r.scheduler)
                for r in run_tp(spec, tp, drafts)]
    if store == "split":
        scheduler, worker = build_split(spec)
        with worker:
            store = SplitStore(worker, scheduler)
            result = run(spec, store, drafts)
            graph = getattr(store, "graph", None)
            if graph is not None:
                how = (f"captured {graph.captures} time(s), replayed {graph.replays} times"
                       if graph.captures else
                       f"no CUDA on {worker.device}: the fixed-shape step ran eagerly "
                       f"{graph.eager_steps} times")
                print(f"decode steps at a fixed batch of {graph.batch}: {how}; "
                      f"{graph.padding_rows} padding rows")
            return [("worker", result, dataclasses.asdict(worker.stats()),
                     dataclasses.asdict(scheduler.stats()))]
    with build_runtime(spec) as runtime:
        result = run(spec, HiSparseStore(runtime), drafts)
        stats = dataclasses.asdict(runtime.stats())
        return [("runtime", result, {**stats, "plans": runtime.worker.stats().plans}, stats)]


def main(argv: Optional[Iterable[str]] = None) -> int:
    defaults = RunSpec()
    parser = argparse.ArgumentParser(
        description="Greedy decoding of a tiny DeepSeek-V3.2-shaped model (random weights) "
                    "through the HiSparse scheduler and worker; --check compares with a dense "
                    "KV cache.")
    parser.add_argument("--requests", type=positive_int, default=defaults.num_requests,
                        help=f"requests (default {defaults.num_requests})")
    parser.add_argument("--max-running", type=positive_int, default=None,
                        help="requests decoded together (default: all)")
    parser.add_argument("--layers", type=positive_int, default=defaults.num_layers,
                        help=f"sparse layers (default {defaults.num_layers})")
    parser.add_argument("--prompt-len", type=positive_int, nargs=2, metavar=("LO", "HI"),
                        default=defaults.prompt_len_range,
                        help="prompt lengths drawn from [LO, HI] (default %(default)s)")
    parser.add_argument("--max-model-len", type=positive_int, default=None,
                        help="tokens a request may hold (default: the tiny preset's 1024)")
    parser.add_argument("--max-new-tokens", type=positive_int, default=defaults.max_new_tokens,
                        help=f"tokens generated per request (default "
                             f"{defaults.max_new_tokens})")
    parser.add_argument("--chunk-size", type=positive_int, default=defaults.chunk_size,
                        help=f"prefill chunk in tokens (default {defaults.chunk_size})")
    parser.add_argument("--max-num-batched-tokens", type=positive_int, default=None,
                        help="the engine's chunk limit: the runtime refuses more uncommitted "
                             "tokens per request (default: unset)")
    parser.add_argument("--shared-prefix-len", type=nonnegative_int, default=0,
                        help="tokens every prompt starts with, reused from the prefix cache "
                             "(default 0)")
    parser.add_argument("--spec-tokens", type=bounded_int(1, 8), default=1,
                        help="query tokens per decode step: the last token and drafts from a "
                             "perfect drafter (default 1)")
    parser.add_argument("--mtp", type=bounded_int(1, 7), default=None, metavar="Q",
                        help="speculative decoding with Q draft tokens per step from a "
                             "drafter wrong at random (--draft-error); rejected drafts are "
                             "rolled back (truncate). Sets --spec-tokens to Q + 1")
    parser.add_argument("--draft-error", type=bounded_number(0.0, 1.0), default=0.3,
                        help="with --mtp: the chance that a draft token is wrong "
                             "(default 0.3)")
    parser.add_argument("--async", dest="async_scheduling", action="store_true",
                        help="vLLM's async scheduling (max_concurrent_batches 2): step N+1 is "
                             "scheduled and run before the runtime hears how many of step N's "
                             "drafts were accepted (verify_drafts after the next forward)")
    parser.add_argument("--device-blocks", type=positive_int, default=None,
                        help="device pool blocks (default: sized for the workload)")
    parser.add_argument("--free-block-watermark", type=bounded_number(0.0, 1.0), default=None,
                        help="free-block fraction below which requests offload (default: the "
                             "runtime's; 1 = every committed page read through the hot buffer)")
    parser.add_argument("--offload-threshold-pages", type=positive_int, default=None,
                        help="pages a request keeps before its history leaves the GPU "
                             "(default: the runtime's)")
    parser.add_argument("--store", choices=("split", "facade"), default="split",
                        help="split: scheduler + worker (default); facade: HiSparseRuntime")
    parser.add_argument("--tp", type=bounded_int(1, 8), default=1,
                        help="tensor-parallel ranks (processes, gloo); > 1 needs --store split")
    parser.add_argument("--backend", choices=("torch", "triton", "auto"), default="torch")
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    parser.add_argument("--cuda-graph", action="store_true",
                        help="decode steps as a serving stack runs them: the decode forward "
                             "(every index group's resolve_rows and gather inside) captured "
                             "once in a CUDA graph of --max-running rows and replayed with a "
                             "new plan each step, smaller batches padded (on a CPU the same "
                             "fixed-shape step runs eagerly); --store split, --tp 1, one "
                             "query token per step")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=positive_int, default=1,
                        help="torch CPU threads (default 1: the ops are small)")
    parser.add_argument("--check", action="store_true",
                        help="also run the dense model and require identical tokens and logits")
    parser.add_argument("--tp-rank", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--tp-job", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(None if argv is None else list(argv))
    if args.tp_rank is not None:
        return _tp_rank_main(args.tp_rank, args.tp_job)
    torch.set_num_threads(args.threads)
    spec = RunSpec(num_requests=args.requests, num_layers=args.layers,
                   prompt_len_range=tuple(args.prompt_len), max_new_tokens=args.max_new_tokens,
                   chunk_size=args.chunk_size, max_running=args.max_running,
                   shared_prefix_len=args.shared_prefix_len,
                   spec_tokens=args.spec_tokens if args.mtp is None else args.mtp + 1,
                   draft_error=0.0 if args.mtp is None else args.draft_error,
                   max_num_batched_tokens=args.max_num_batched_tokens,
                   device_blocks=args.device_blocks,
                   offload_threshold_pages=args.offload_threshold_pages,
                   free_block_watermark=args.free_block_watermark,
                   backend=args.backend, device=args.device, seed=args.seed,
                   max_model_len=args.max_model_len, cuda_graph=args.cuda_graph,
                   async_scheduling=args.async_scheduling)
    try:
        if args.tp > 1 and args.store != "split":
            raise ValueError("--tp > 1 runs the scheduler + worker split (--store split).")
        if args.cuda_graph and (args.store != "split" or args.tp > 1
                                or spec.spec_tokens > 1 or args.async_scheduling):
            raise ValueError("--cuda-graph runs the scheduler + worker pair on one rank "
                             "(--store split, --tp 1), one query token per step, without "
                             "--async.")
        workload = spec.workload()
        plan = plan_for_spec(spec, tensor_parallel_size=args.tp)
    except ValueError as exc:
        print(f"tiny_dsa: {exc}", file=sys.stderr)
        return 2
    print(f"tiny_dsa: {spec.num_layers} layers, {spec.num_requests} requests, prompts "
          f"{list(workload.prompt_lens)} tokens ({spec.shared_prefix_len} shared), "
          f"{spec.max_new_tokens} new tokens each, prefill chunks of {spec.chunk_size}, "
          f"{spec.spec_tokens} query token(s) per decode step, {args.store} store, "
          f"tp {args.tp}, backend {spec.backend}"
          f"{', async scheduling' if spec.async_scheduling else ''}")
    dense = run_dense(spec) if args.check or spec.spec_tokens > 1 else None
    drafts = dense.tokens if dense is not None and spec.spec_tokens > 1 else None
    start = time.perf_counter()
    try:
        ranks = _decode(spec, args.store, args.tp, drafts)
    except (HiSparseError, RuntimeError) as exc:
        print(f"tiny_dsa: {exc}", file=sys.stderr)
        return 1
    _report(spec, plan, ranks, time.perf_counter() - start)
    if dense is None or not args.check:
        return 0
    failed = False
    for name, result, _, _ in ranks:
        problems = compare(dense, result)
        if problems:
            failed = True
            print(f"check FAILED ({name}): HiSparse and dense decoding differ:")
            for problem in problems:
                print(f"  {problem}")
    if failed:
        return 1
    print(f"check: tokens and logits bit-identical to the dense model on "
          f"{len(ranks)} rank(s) ({sum(len(t) for t in ranks[0][1].tokens.values())} tokens)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
