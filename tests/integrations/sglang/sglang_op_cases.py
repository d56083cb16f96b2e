"""Cases for the SGLang swap-in ops: SGLang-shaped state, runners for both backends, and a
scalar walk of SGLang 0.5.23's CUDA kernel (``load_cache_to_device_buffer_kernel`` in
``kernels/jit/csrc/kvcacheio/hisparse.cuh``) phase by phase: its shared-memory hash table
(Knuth hash, linear probing, 2 * top-k slots), the compacted ``s_lru_slots_out`` array (hits
forward from 0, evictables backward from H - 1) and its LRU write-back formula, run with the
threads in order. The walk is an independent transcription used to check the torch model on
inputs where SGLang's kernel has no race (distinct top-k positions, distinct held positions).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

import numpy as np
import torch

#: KV row formats SGLang's DSA pools use: bf16 latent + rope (576 values) and the packed fp8
#: row (512 fp8 values, 4 fp32 scales, 64 bf16 rope values: 656 bytes).
ROW_FORMATS = {"bf16": (torch.bfloat16, 576), "fp8": (torch.uint8, 656)}
POISON = -7


@dataclass
class SwapInCase:
    """SGLang's tables for ``states`` request rows, pools and one call's inputs."""

    device_buffer_tokens: torch.Tensor    # [S, H + P] int32
    device_buffer_locs: torch.Tensor      # [S, H + P] int32
    lru_slots: torch.Tensor               # [S, H] int16
    host_cache_locs: torch.Tensor         # [S, ctx] int64
    host_cache: torch.Tensor              # [host rows, 1, dim]
    device_buffer: torch.Tensor           # [device rows, 1, dim]
    top_k_tokens: torch.Tensor            # [bs, >= K] int32
    req_pool_indices: torch.Tensor        # [bs]
    seq_lens: torch.Tensor                # [bs]
    top_k: int
    hot: int
    num_real: Optional[int] = None
    extra: dict = field(default_factory=dict)

    @property
    def item(self) -> int:
        return self.host_cache.shape[-1] * self.host_cache.element_size()

    def clone(self) -> "SwapInCase":
        """A copy whose tensors can be written; broadcast views (stride 0: read-only tables
        of any size) are shared, not materialised."""
        return SwapInCase(**{k: (v.clone() if isinstance(v, torch.Tensor) and 0 not in v.stride()
                                 else v) for k, v in self.__dict__.items()})


def make_state(states: int, hot: int, page: int, context: int, fmt: str = "bf16",
               seed: int = 0, host_rows: Optional[int] = None) -> dict:
    """Random SGLang-shaped state: every slot of every request has its own device row, slots
    hold distinct positions (some empty), the LRU rows are permutations, every position has
    its own host row, and the pools hold random bytes."""
    g = torch.Generator().manual_seed(seed)
    width = hot + page
    dtype, dim = ROW_FORMATS[fmt]
    device_rows = states * width + 3
    locs = (torch.randperm(device_rows - 3, generator=g) + 3).int().view(states, width)
    tokens = torch.full((states, width), -1, dtype=torch.int32)
    for r in range(states):
        held = torch.randperm(context, generator=g)[:hot].int()
        empty = torch.rand(hot, generator=g) < 0.2
        tokens[r, :hot] = torch.where(empty, -1, held)
    lru = torch.stack([torch.randperm(hot, generator=g) for _ in range(states)]).to(torch.int16)
    host_rows = host_rows or states * context + 5
    hcl = torch.randperm(host_rows, generator=g)[: states * context].view(states, context)
    host, device = _pool(host_rows, dtype, dim, g), _pool(device_rows, dtype, dim, g)
    for r in range(states):       # a held position's device row holds its host row
        for s in range(hot):
            if tokens[r, s] >= 0:
                row_bytes(device)[locs[r, s]] = row_bytes(host)[hcl[r, tokens[r, s]]]
    return dict(device_buffer_tokens=tokens, device_buffer_locs=locs, lru_slots=lru,
                host_cache_locs=hcl.long(), host_cache=host, device_buffer=device)


def _pool(rows: int, dtype: torch.dtype, dim: int, g: torch.Generator) -> torch.Tensor:
    raw = torch.randint(0, 256, (rows, 1, dim * torch.tensor([], dtype=dtype).element_size()),
                        dtype=torch.uint8, generator=g)
    return raw.view(dtype)


def top_k_for(seq_len: int, K: int, g: torch.Generator, near: Optional[list] = None
              ) -> torch.Tensor:
    """Distinct positions in ``[0, seq_len)`` (padded with -1 when ``seq_len < K``), like an
    indexer's top-k; ``near`` (earlier positions) are preferred for half of them."""
    if seq_len <= K:
        picked = torch.randperm(max(seq_len, 0), generator=g).tolist()
    else:
        picked = []
        if near:
            pool = [p for p in dict.fromkeys(near) if 0 <= p < seq_len]
            order = torch.randperm(len(pool), generator=g).tolist()
            picked = [pool[j] for j in order[: K // 2]]
        chosen = set(picked)
        for p in torch.randperm(seq_len, generator=g).tolist():
            if len(picked) == K:
                break
            if p not in chosen:
                picked.append(p)
                chosen.add(p)
        order = torch.randperm(K, generator=g).tolist()
        picked = [picked[j] for j in order]
    return torch.tensor(picked + [-1] * (K - len(picked)), dtype=torch.int32)


def new_case(state: dict, top_k: torch.Tensor, rpi, seq_lens, K: int, hot: int,
             num_real: Optional[int] = None, index_dtype=torch.int64) -> SwapInCase:
    return SwapInCase(**state, top_k_tokens=top_k,
                      req_pool_indices=torch.as_tensor(rpi, dtype=index_dtype),
                      seq_lens=torch.as_tensor(seq_lens, dtype=index_dtype), top_k=K, hot=hot,
                      num_real=num_real)


@dataclass
class Result:
    state: dict                 # the tables and pools after the call
    out: torch.Tensor           # top_k_device_locs
    plan: Optional[tuple]       # (miss_src, miss_dst, miss_count) when recorded


def run(fn: Callable[..., None], case: SwapInCase, *, plan: bool = True, skip_io: bool = False,
        out: Optional[torch.Tensor] = None, **kw) -> Result:
    """Call ``fn`` (SGLang's signature) on a copy of ``case``; outputs start as POISON."""
    return call(fn, case.clone(), plan=plan, skip_io=skip_io, out=out, **kw)


def call(fn: Callable[..., None], c: SwapInCase, *, plan: bool = True, skip_io: bool = False,
         out: Optional[torch.Tensor] = None, **kw) -> Result:
    """``run`` on ``c`` itself (its tensors are the ones written)."""
    bs = c.top_k_tokens.shape[0]
    out = out if out is not None else torch.full((bs, c.top_k), POISON, dtype=torch.int32)
    miss = None
    if plan:
        miss = (torch.full((bs, c.top_k), POISON, dtype=torch.int64),
                torch.full((bs, c.top_k), POISON, dtype=torch.int32),
                torch.full((bs,), POISON, dtype=torch.int32))
    nrr = None if c.num_real is None else torch.tensor([c.num_real], dtype=torch.int32)
    fn(c.top_k_tokens, c.device_buffer_tokens, c.host_cache_locs, c.device_buffer_locs,
       c.host_cache, c.device_buffer, out, c.req_pool_indices, c.seq_lens, c.lru_slots,
       c.item, c.top_k, c.hot, page_size=1, block_size=256, num_real_reqs=nrr,
       miss_src=miss[0] if miss else None, miss_dst=miss[1] if miss else None,
       miss_count=miss[2] if miss else None, skip_io=skip_io, **kw)
    state = {k: getattr(c, k) for k in ("device_buffer_tokens", "device_buffer_locs",
                                        "lru_slots", "host_cache_locs", "host_cache",
                                        "device_buffer")}
    return Result(state, out, miss)


def assert_same(a: Result, b: Result, K: int) -> None:
    """Every table, pool, output and recorded plan entry equal (plan columns past a row's
    count and rows without a count are not part of the contract)."""
    for name in a.state:
        assert torch.equal(bits(a.state[name]), bits(b.state[name])), name
    assert torch.equal(a.out, b.out), (a.out, b.out)
    assert (a.plan is None) == (b.plan is None)
    if a.plan is not None:
        assert torch.equal(a.plan[2], b.plan[2]), (a.plan[2], b.plan[2])
        for r, count in enumerate(a.plan[2].tolist()):
            n = max(0, min(count, K))
            assert torch.equal(a.plan[0][r, :n], b.plan[0][r, :n]), r
            assert torch.equal(a.plan[1][r, :n], b.plan[1][r, :n]), r


def bits(t: torch.Tensor) -> torch.Tensor:
    """``t`` compared bit for bit (float rows may hold NaN patterns)."""
    return t.view(torch.uint8) if t.is_floating_point() else t


def row_bytes(pool: torch.Tensor) -> torch.Tensor:
    """``pool`` as ``[rows, bytes]`` uint8."""
    return pool.reshape(pool.shape[0], -1).view(torch.uint8)


# ------------------------------------------------------------- SGLang's kernel, walked


def _hash_slot(key: int, size: int) -> int:
    return ((key & 0xFFFFFFFF) * 2654435761 & 0xFFFFFFFF) % size


def cuda_walk(case: SwapInCase, plan: bool = True) -> Result:
    """SGLang 0.5.23's ``load_cache_to_device_buffer_kernel`` (MLA, token top-k, generic
    layout) walked with one thread at a time, in thread order, on a copy of ``case``."""
    c = case.clone()
    K, H = c.top_k, c.hot
    bs = c.top_k_tokens.shape[0]
    TOKEN_HIT = -1                       # 0xFFFFFFFF as int32
    tk = c.top_k_tokens.tolist()
    out = torch.full((bs, K), POISON, dtype=torch.int32)
    o = out.tolist()
    dbt = c.device_buffer_tokens.numpy()
    dbl = c.device_buffer_locs.numpy()
    lru = c.lru_slots.numpy()
    hcl = c.host_cache_locs.numpy()
    src = np.full((bs, K), POISON, np.int64)
    dst = np.full((bs, K), POISON, np.int32)
    cnt = np.full(bs, POISON, np.int32)
    host = row_bytes(c.host_cache)
    dev = row_bytes(c.device_buffer)
    real = bs if c.num_real is None else c.num_real
    for bid in range(bs):
        if bid >= real:
            o[bid] = [-1] * K
            continue
        rid = int(c.req_pool_indices[bid])
        seq_len = int(c.seq_lens[bid])
        if seq_len <= H:
            count = min(seq_len, K)
            for i in range(K):
                pos = tk[bid][i]
                o[bid][i] = int(dbl[rid, pos]) if i < count and pos >= 0 else -1
            cnt[bid] = 0
            continue
        hash_size = 2 * K
        keys = [-1] * hash_size
        vals = [0] * hash_size
        s_top_k = [0] * K
        newest = seq_len - 1
        for i in range(K):
            token = tk[bid][i]
            if token == newest:
                s_top_k[i] = TOKEN_HIT
                o[bid][i] = int(dbl[rid, H])
                continue
            slot = _hash_slot(token, hash_size)
            while True:
                old = keys[slot]
                if old == -1:
                    keys[slot] = token
                if old == -1 or old == token:
                    vals[slot] = i
                    break
                slot = (slot + 1) % hash_size
            s_top_k[i] = token
        lru_out = [0] * H
        hits = evicts = 0
        for slot_idx in range(H):
            buf_slot = int(lru[rid, slot_idx])
            token = int(dbt[rid, buf_slot]) if buf_slot >= 0 else -1
            found = -1
            if token >= 0:
                h = _hash_slot(token, hash_size)
                while True:
                    if keys[h] == token:
                        found = vals[h]
                        break
                    if keys[h] == -1:
                        break
                    h = (h + 1) % hash_size
            if found >= 0:
                s_top_k[found] = TOKEN_HIT
                o[bid][found] = int(dbl[rid, buf_slot])
                lru_out[hits] = buf_slot
                hits += 1
            else:
                lru_out[H - 1 - evicts] = buf_slot
                evicts += 1
        misses = 0
        miss_tokens = []
        for i in range(K):
            if s_top_k[i] == TOKEN_HIT:
                continue
            token = s_top_k[i]
            evict = lru_out[H - 1 - misses]
            o[bid][i] = int(dbl[rid, evict])
            dbt[rid, evict] = token
            src[bid, misses] = hcl[rid, token]
            dst[bid, misses] = dbl[rid, evict]
            miss_tokens.append((token, evict))
            misses += 1
        cnt[bid] = misses
        evictable = H - hits
        for i in range(H):
            if i < misses:
                lru[rid, evictable - misses + i] = lru_out[H - 1 - i]
            elif i < evictable:
                lru[rid, i - misses] = lru_out[H - 1 - i]
            else:
                lru[rid, i] = lru_out[i - evictable]
        for token, evict in miss_tokens:
            dev[int(dbl[rid, evict])] = host[int(hcl[rid, token])]
    out.copy_(torch.tensor(o, dtype=torch.int32))
    state = {k: getattr(c, k) for k in ("device_buffer_tokens", "device_buffer_locs",
                                        "lru_slots", "host_cache_locs", "host_cache",
                                        "device_buffer")}
    miss = (torch.from_numpy(src), torch.from_numpy(dst), torch.from_numpy(cnt)) if plan \
        else None
    return Result(state, out, miss)
