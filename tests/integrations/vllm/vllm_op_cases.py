"""Test helpers for the vLLM HiSparse ops: a scalar model of each op and random cases.

The scalar models walk vLLM 0.33's CUDA kernels' phases one element at a time
(``csrc/hisparse_kernels.cu``: ``hisparse_resolve_residency_kernel`` phases 1-5,
``hisparse_gather_plan_kernel``, ``hisparse_gather_compact_kernel``,
``hisparse_invalidate_written_slots_kernel``; ``csrc/cache_kernels.cu``:
``cp_gather_and_upconvert_fp8_kv_cache``), generalised as our torch models state (a request's
rows need not be contiguous). They are written independently of the vectorised torch models
in ``vllm_reference`` so that the two check each other; the Triton kernels are then checked
against the torch models, bit for bit.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import torch

POISON = -999


def hot_row(hot_block_table: np.ndarray, request: int, slot: int, hbs: int) -> int:
    return int(hot_block_table[request, slot // hbs]) * hbs + slot % hbs


def attention_of(row: int, hbs: int, stride: int) -> int:
    return -1 if row < 0 else (row // hbs) * stride + row % hbs


@dataclass
class ResolveCase:
    """Every input of one ``hisparse_resolve_residency`` call, as numpy arrays."""

    host_rows: int
    hot_num_blocks: int
    hot_block_size: int
    hot_block_table: np.ndarray           # [requests, hot blocks] int32
    global_indices: np.ndarray            # [R, K] int32
    dgi: np.ndarray                       # [S, H] int32
    lru: np.ndarray                       # [S, H] int16
    request_state_indices: Optional[np.ndarray]
    max_union_rows: int
    attention_block_stride: int
    request_ids: Optional[np.ndarray] = None
    source_block_table: Optional[np.ndarray] = None
    source_block_size: int = 0
    resident_block_table: Optional[np.ndarray] = None
    resident_null_block: int = 0
    stats: np.ndarray = field(default_factory=lambda: np.zeros(2, np.uint64))

    @property
    def shape(self) -> tuple[int, int]:
        return self.global_indices.shape


def naive_resolve(case: ResolveCase) -> dict[str, np.ndarray]:
    """Scalar model of ``hisparse_resolve_residency``; returns every output and the new state
    (outputs start as ``POISON`` so untouched entries show)."""
    R, K = case.shape
    S, H = case.lru.shape
    hbs = case.hot_block_size
    out = {name: np.full((R, K), POISON, np.int64)
           for name in ("hot", "attn", "miss", "resolved", "swap_host", "swap_dev")}
    out["valid"] = np.full(R, POISON, np.int64)
    out["swap_counts"] = np.full(R, POISON, np.int64)
    dgi = case.dgi.astype(np.int64).copy()
    lru = case.lru.astype(np.int64).copy()
    stats = case.stats.astype(np.int64).copy()
    rsi = case.request_state_indices

    def request_of(row: int) -> int:
        return int(case.request_ids[row]) if case.request_ids is not None else row

    def state_of(req: int) -> int:
        if rsi is None:
            return req
        return int(rsi[req]) if 0 <= req < len(rsi) else -1

    def translate(req: int, st: int, pos: int) -> tuple[int, int]:
        g, resident = pos, -1
        if case.source_block_table is not None:
            sbs = case.source_block_size
            table = case.source_block_table
            block = pos // sbs if pos >= 0 else -1
            if 0 <= req < table.shape[0] and 0 <= block < table.shape[1]:
                b = int(table[req, block])
                g = b * sbs + pos % sbs if b > 0 else -1
            else:
                g = -1
            res = case.resident_block_table
            if res is not None:
                block = pos // hbs if pos >= 0 else -1
                if 0 <= st < res.shape[0] and 0 <= block < res.shape[1]:
                    b = int(res[st, block])
                    if b != case.resident_null_block and b >= 0:
                        resident = b * hbs + pos % hbs
        return (-1 if g >= case.host_rows else g), resident

    # Which rows resolve, grouped by request (batch order of first rows); the rest is padding.
    groups: dict[int, list[int]] = {}
    used_states: set[int] = set()
    for row in range(R):
        req = request_of(row)
        st = state_of(req)
        if not 0 <= st < S:
            continue
        if req in groups:
            groups[req].append(row)
        elif st not in used_states:
            used_states.add(st)
            groups[req] = [row]
    resolving = {row for rows in groups.values() for row in rows}
    for row in range(R):
        if row not in resolving:
            for c in range(K):
                out["hot"][row, c] = out["attn"][row, c] = out["resolved"][row, c] = -1
            out["valid"][row] = out["swap_counts"][row] = 0

    for req, rows in groups.items():
        st = state_of(req)
        # Phase 1: translate; resident / invalid columns resolve now; the rest is the union.
        first_ref: dict[int, tuple[int, int]] = {}   # g -> (rank, column) of first reference
        refs: list[tuple[int, int, int]] = []          # (rank, column, g)
        for rank, row in enumerate(rows):
            valid = 0
            for c in range(K):
                g, resident = translate(req, st, int(case.global_indices[row, c]))
                out["resolved"][row, c] = g
                out["miss"][row, c] = 0
                valid += resident >= 0 or g >= 0
                if resident >= 0:
                    out["hot"][row, c] = resident
                elif g < 0:
                    out["hot"][row, c] = -1
                else:
                    refs.append((rank, c, g))
                    first_ref.setdefault(g, (rank, c))
            out["valid"][row] = valid
        if not refs:
            for row in rows:
                out["swap_counts"][row] = 0
            continue
        # Phase 2: LRU walk: hits (an entry keeps its oldest hit) and evictables, in order.
        hit_slot: dict[int, int] = {}
        hits, evictable = [], []
        for p in range(H):
            slot = int(lru[st, p])
            held = int(dgi[st, slot]) if 0 <= slot < H else -1
            if held >= 0 and held in first_ref:
                hits.append(slot)
                hit_slot.setdefault(held, slot)
            else:
                evictable.append(slot)
        # Phase 3: misses in (rank, column) order of first reference take evictables.
        entry_row: dict[int, int] = {g: hot_row(case.hot_block_table, req, s, hbs)
                                     for g, s in hit_slot.items()}
        misses = sorted((pos, g) for g, pos in first_ref.items() if g not in hit_slot)
        served_misses = 0
        served = set(hit_slot)
        for m, ((rank, c), g) in enumerate(misses):
            slot = evictable[m] if m < len(evictable) else -1
            plan_row = rows[m // K]
            out["swap_host"][plan_row, m % K] = g
            if 0 <= slot < H:
                dev = hot_row(case.hot_block_table, req, slot, hbs)
                dgi[st, slot] = g
                out["miss"][rows[rank], c] = 1
                served_misses += 1
                served.add(g)
            else:
                dev = -1
            out["swap_dev"][plan_row, m % K] = dev
            entry_row[g] = dev
        for rank, row in enumerate(rows):
            out["swap_counts"][row] = max(0, min(K, len(misses) - rank * K))
        # Phase 4: every reference reads its entry.
        hits_count = 0
        for rank, c, g in refs:
            value = entry_row[g]
            out["hot"][rows[rank], c] = value
            if g in served and not (first_ref[g] == (rank, c) and g not in hit_slot):
                hits_count += 1
        stats[0] += hits_count
        stats[1] += served_misses
        # Phase 5: stale evictables, then the filled ones, then hits.
        take = min(len(misses), len(evictable))
        lru[st] = evictable[take:] + evictable[:take] + hits
    for row in range(R):
        for c in range(K):
            if out["hot"][row, c] != POISON:
                out["attn"][row, c] = attention_of(int(out["hot"][row, c]), hbs,
                                                   case.attention_block_stride)
    out["dgi"], out["lru"], out["stats"] = dgi, lru, stats
    return out


def random_resolve_case(rng: np.random.Generator, *, rows_per_request: list[int], top_k: int,
                        hot_size: int, hot_block_size: int = 4, source_block_size: int = 4,
                        positions: int = 48, host_blocks: int = 40, shuffle_rows: bool = False,
                        padding_rows: int = 0, resident: bool = True,
                        warm: bool = True, duplicates: bool = False,
                        corrupt_lru: bool = False) -> ResolveCase:
    """A random call in vLLM's form: requests with the given numbers of rows (their rows
    interleaved when ``shuffle_rows``), CUDA-graph padding rows (request -1), source tables
    with null blocks and pages past the table, resident pages, a warm hot state that holds
    some of the selected host rows, positions out of range and duplicate positions."""
    num_req = len(rows_per_request)
    S = num_req + 3
    pages = -(-positions // source_block_size)
    src = rng.integers(1, host_blocks, size=(num_req, pages)).astype(np.int32)
    src[rng.random(src.shape) < 0.15] = 0                       # null blocks: no host row
    res = np.zeros((S, pages + 1), np.int32)
    if resident:
        mask = rng.random((S, pages + 1)) < 0.25
        res[mask] = rng.integers(1, 30, size=int(mask.sum()))
    states = rng.permutation(S)[:num_req].astype(np.int32)
    rsi = np.full(num_req + 2, -1, np.int32)
    rsi[:num_req] = states
    request_ids = np.concatenate([np.full(n, q, np.int32) for q, n in enumerate(rows_per_request)]
                                 + [np.full(padding_rows, -1, np.int32)])
    if shuffle_rows:
        order = rng.permutation(len(request_ids) - padding_rows)
        request_ids[:len(order)] = request_ids[:len(order)][order]
    R = len(request_ids)
    gi = np.stack([rng.choice(positions + 6, size=top_k, replace=duplicates) - 3
                   for _ in range(R)]).astype(np.int32)        # some < 0, some past the pages
    if duplicates:
        gi[:, -1] = gi[:, 0]
    hot_blocks = -(-hot_size // hot_block_size)
    hbt = (rng.permutation(num_req * hot_blocks).reshape(num_req, hot_blocks) + 1).astype(
        np.int32)
    host_rows = host_blocks * source_block_size
    dgi = np.full((S, hot_size), -1, np.int32)
    lru = np.stack([rng.permutation(hot_size) for _ in range(S)]).astype(np.int16)
    if warm:
        for q in range(num_req):
            held = rng.choice(host_rows, size=hot_size, replace=False)
            # Make about half of the slots hold host rows the request selects.
            sel = []
            for c in gi[request_ids == q].reshape(-1):
                page = c // source_block_size
                if c >= 0 and page < pages and src[q, page] > 0:
                    sel.append(src[q, page] * source_block_size + c % source_block_size)
            sel = list(dict.fromkeys(sel))[: hot_size // 2]
            take = rng.random(len(sel)) < 0.6
            chosen = [g for g, t in zip(sel, take) if t]
            held[:len(chosen)] = chosen
            held = np.where(rng.random(hot_size) < 0.2, -1, held)
            # No host row twice (a valid state): drop repeats.
            seen: set[int] = set()
            for i, g in enumerate(held):
                if g >= 0 and g in seen:
                    held[i] = -1
                seen.add(int(g))
            dgi[states[q]] = held
    if corrupt_lru:
        lru[states[0], 0] = hot_size + 5
    return ResolveCase(
        host_rows=host_rows, hot_num_blocks=num_req * hot_blocks + 1,
        hot_block_size=hot_block_size, hot_block_table=hbt, global_indices=gi, dgi=dgi,
        lru=lru, request_state_indices=rsi,
        max_union_rows=min(hot_size, max(rows_per_request) * top_k),
        attention_block_stride=hot_block_size * 3, request_ids=request_ids,
        source_block_table=src, source_block_size=source_block_size,
        resident_block_table=res if resident else None,
        stats=np.array([5, 7], np.uint64))


def resolve_args(case: ResolveCase, device: torch.device = torch.device("cpu"), *,
                 optional_outputs: bool = True) -> tuple[list, dict[str, torch.Tensor]]:
    """vLLM's argument list for ``case`` (fresh tensors) and the tensors the op writes."""
    R, K = case.shape

    def dev(a, dtype=torch.int32):
        return torch.tensor(np.array(a)).to(dtype).to(device)  # a copy: the op writes it

    outs = {name: dev(np.full((R, K), POISON))
            for name in ("hot", "attn", "miss", "resolved", "swap_host", "swap_dev")}
    outs["valid"] = dev(np.full(R, POISON))
    outs["swap_counts"] = dev(np.full(R, POISON))
    outs["dgi"] = dev(case.dgi)
    outs["lru"] = dev(case.lru, torch.int16)
    outs["stats"] = torch.tensor(case.stats.astype(np.int64)).view(torch.uint64).to(device)
    row_bytes = 16
    host = torch.zeros(case.host_rows, row_bytes, dtype=torch.uint8)
    hot = torch.zeros(case.hot_num_blocks, case.hot_block_size, row_bytes, dtype=torch.uint8,
                      device=device)
    opt = (lambda name: outs[name]) if optional_outputs else (lambda name: None)
    args = [host, hot, dev(case.hot_block_table), dev(case.global_indices), outs["hot"],
            outs["dgi"], outs["lru"],
            None if case.request_state_indices is None else dev(case.request_state_indices),
            case.lru.shape[1], case.max_union_rows, opt("miss"), outs["stats"], opt("attn"),
            case.attention_block_stride,
            None if case.request_ids is None else dev(case.request_ids),
            None if case.source_block_table is None else dev(case.source_block_table),
            case.source_block_size, opt("resolved"), opt("valid"), outs["swap_host"],
            outs["swap_dev"], outs["swap_counts"],
            None if case.resident_block_table is None else dev(case.resident_block_table),
            case.hot_block_size if case.resident_block_table is not None else 0,
            case.resident_null_block]
    return args, outs


def numpy_outputs(outs: dict[str, torch.Tensor]) -> dict[str, np.ndarray]:
    result = {k: v.cpu().numpy().astype(np.int64) for k, v in outs.items() if k != "stats"}
    result["stats"] = outs["stats"].cpu().view(torch.int64).numpy()
    return result


def run_resolve(op, case: ResolveCase, device: torch.device = torch.device("cpu"),
                *, optional_outputs: bool = True) -> dict[str, np.ndarray]:
    """Call a ``hisparse_resolve_residency`` implementation on ``case`` (vLLM's argument
    order) and return its outputs and state like ``naive_resolve``."""
    args, outs = resolve_args(case, device, optional_outputs=optional_outputs)
    op(*args)
    return numpy_outputs(outs)


def assert_same(got: dict[str, np.ndarray], want: dict[str, np.ndarray],
                keys: Optional[list[str]] = None) -> None:
    for key in keys or sorted(want):
        np.testing.assert_array_equal(got[key], want[key], err_msg=key)


# ------------------------------------------------------------------------------- FP8 rows


def e4m3_value(byte: int) -> float:
    """The float value of an fp8 e4m3fn byte (written from the format, not from torch)."""
    sign = -1.0 if byte & 0x80 else 1.0
    exp, man = (byte >> 3) & 0xF, byte & 7
    if exp == 15 and man == 7:
        return float("nan")
    if exp == 0:
        return sign * man * 2.0 ** -9
    return sign * (1 + man / 8) * 2.0 ** (exp - 7)


def bf16_bits_of(value: float) -> int:
    """bf16 bits (round to nearest even; NaN -> 0x7FFF) of a float32 value."""
    bits = struct.unpack("<I", struct.pack("<f", value))[0]
    if (bits & 0x7FFFFFFF) > 0x7F800000:
        return 0x7FFF
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) & 0xFFFF


def naive_upconvert_row(row: bytes) -> list[int]:
    """One 656-byte fp8_ds_mla row -> 576 bf16 bit patterns."""
    scales = struct.unpack("<4f", row[512:528])
    out = []
    for i in range(512):
        product = np.float32(e4m3_value(row[i])) * np.float32(scales[i // 128])
        out.append(bf16_bits_of(float(product)))
    out.extend(struct.unpack("<64H", row[528:656]))
    return out


def random_fp8_rows(rng: np.random.Generator, n: int) -> np.ndarray:
    """``[n, 656] uint8`` rows with random fp8 bytes (no NaN), scales and bf16 rope values."""
    rows = rng.integers(0, 256, size=(n, 656), dtype=np.uint8)
    nan = (rows[:, :512] & 0x7F) == 0x7F
    rows[:, :512][nan] ^= 1
    scales = rng.uniform(0.01, 4.0, size=(n, 4)).astype(np.float32)
    rows[:, 512:528] = scales.view(np.uint8).reshape(n, 16)
    return rows


# ------------------------------------------------------------------------------- gathers


def naive_gather(host: np.ndarray, hot: np.ndarray, src: np.ndarray, dst: np.ndarray,
                 selected: np.ndarray, hbs: int, block_stride: int, hot_rows: int) -> None:
    """vLLM's ``copy_row_warp`` / ``zero_row_warp`` on flat byte arrays: for each selected
    entry, host row ``src`` -> hot row ``dst`` (zeros when ``src >= host rows``); ``src < 0``
    or ``dst`` outside the hot rows skips."""
    host_rows, row_bytes = host.shape
    for (r, c) in zip(*np.nonzero(selected)):
        g, d = int(src[r, c]), int(dst[r, c])
        if g < 0 or d < 0 or d >= hot_rows:
            continue
        off = (d // hbs) * block_stride + (d % hbs) * row_bytes
        hot[off:off + row_bytes] = host[g] if g < host_rows else 0


def naive_gather_plan(host, hot, global_indices, hot_indices, miss_mask, rsi, hbs, block_stride,
                      hot_rows, attention_block_stride) -> np.ndarray:
    """``hisparse_gather_plan_kernel``: returns the attention indices it writes."""
    R, K = global_indices.shape
    padding = np.zeros(R, bool) if rsi is None else rsi[:R] < 0
    attention = np.array([[-1 if padding[r] else attention_of(int(hot_indices[r, c]), hbs,
                                                              attention_block_stride)
                           for c in range(K)] for r in range(R)], np.int64).reshape(R, K)
    naive_gather(host, hot, global_indices, hot_indices,
                 (miss_mask != 0) & ~padding[:, None], hbs, block_stride, hot_rows)
    return attention


def naive_gather_compact(host, hot, miss_global, miss_hot, counts, hbs, block_stride,
                         hot_rows) -> None:
    R, K = miss_global.shape
    selected = np.arange(K)[None, :] < np.clip(counts[:R], 0, K)[:, None]
    naive_gather(host, hot, miss_global, miss_hot, selected, hbs, block_stride, hot_rows)


def naive_invalidate(dgi: np.ndarray, rsi: np.ndarray, req: np.ndarray,
                     written: np.ndarray) -> np.ndarray:
    """``hisparse_invalidate_written_slots_kernel`` on a copy of ``dgi``."""
    out = dgi.copy()
    S = out.shape[0]
    for t in range(len(written)):
        q = int(req[t])
        if not 0 <= q < len(rsi):
            continue
        st, slot = int(rsi[q]), int(written[t])
        if 0 <= st < S and slot >= 0:
            out[st][out[st] == slot] = -1
    return out


def naive_upconvert(src: np.ndarray, dst: np.ndarray, block_table: np.ndarray,
                    workspace_starts: np.ndarray, batch: int, seq_starts=None, host=None,
                    host_row_ids=None, device_row_ids=None) -> None:
    """``cp_gather_and_upconvert_fp8_kv_cache`` on numpy arrays (``dst`` as uint16 bits):
    per request its rows, in request order (a later request overwrites)."""
    T = dst.shape[0]
    nb, B, _ = src.shape
    flat = src.reshape(nb * B, 656)
    for q in range(batch):
        lo = min(int(workspace_starts[q]), T)
        hi = min(int(workspace_starts[q + 1]), T) if q + 1 < batch else T
        for t in range(max(lo, 0), hi):
            s = (int(seq_starts[q]) if seq_starts is not None else 0) + t - lo
            row = None
            if s >= 0 and s // B < block_table.shape[1]:
                b = int(block_table[q, s // B])
                if host is None:
                    if 0 <= b < nb:
                        row = flat[b * B + s % B]
                elif b >= 0 and b * B + s % B < host_row_ids.size:
                    i = b * B + s % B
                    d = int(device_row_ids.reshape(-1)[i]) if device_row_ids is not None else -1
                    h = int(host_row_ids.reshape(-1)[i])
                    if 0 <= d < nb * B:
                        row = flat[d]
                    elif 0 <= h < host.shape[0]:
                        row = host[h]
            dst[t] = naive_upconvert_row(bytes(row)) if row is not None else 0
