"""Pure-torch oracle of every kernel: the bit-exact semantics (DESIGN.md section 7).

This module is the specification the Triton kernels in ``hisparse_triton.kernels`` must match
byte for byte, and the runtime's CPU backend. It works on any device.

Conventions shared by all functions:
- ids (positions, rows, blocks, slots) are int32; address arithmetic is int64;
- block 0 of every pool is the null block ("no page") in block tables;
- nothing here (or in a kernel) reads or writes outside the pools, whatever the ids say.
"""

from __future__ import annotations

import weakref
from typing import NamedTuple, Optional

import torch

from hisparse_triton.row_table import RowTable
from hisparse_triton.tuning import pow2_alignment


class ResolveResult(NamedTuple):
    """What ``resolve`` returns for ``R`` batch rows of ``K`` top-k columns.

    - ``rows``: ``[R, K] int32`` device row ids for the attention kernel; -1 = masked.
    - ``miss_src``: ``[R, K] int32`` host rows to gather; the first ``miss_count[r]`` entries of
      row ``r`` are valid (misses in column order of first occurrence), the rest are -1.
    - ``miss_dst``: ``[R, K] int32`` device rows (hot slots) the misses go to; same layout.
    - ``miss_count``: ``[R] int32`` distinct misses per row.
    - ``stats``: ``[R, 3] int32`` per row ``(hits, misses, masked)``;
      ``hits + misses + masked == K`` for non-padding rows (a duplicate of a miss column is a
      hit: it is served from the slot its first occurrence filled); padding rows count zeros.
    """

    rows: torch.Tensor
    miss_src: torch.Tensor
    miss_dst: torch.Tensor
    miss_count: torch.Tensor
    stats: torch.Tensor


_INT32_MAX = 2**31 - 1
#: Sort key base of columns that do not go to the host path (sorts after every host key).
_RESOLVE_KEY_SENTINEL = 1 << 62


def _check_resolve_args(
    topk: torch.Tensor,
    state_rows: torch.Tensor,
    seq_lens: torch.Tensor,
    resident_blocks: torch.Tensor,
    host_blocks: torch.Tensor,
    hot_blocks: torch.Tensor,
    slot_host_rows: torch.Tensor,
    lru: torch.Tensor,
    block_size: int,
    num_device_blocks: int,
    num_host_blocks: int,
) -> tuple[int, int, int, int, int, int]:
    """Validate ``resolve``'s arguments (shapes, dtypes, devices, sizes; never tensor values).

    Returns ``(R, K, S, P, HB, H)``. Raises ``TypeError`` / ``ValueError`` naming the bad value.
    Shared by the reference and the Triton launcher so both reject exactly the same inputs.
    """
    tensors = {
        "topk": (topk, 2), "state_rows": (state_rows, 1), "seq_lens": (seq_lens, 1),
        "resident_blocks": (resident_blocks, 2), "host_blocks": (host_blocks, 2),
        "hot_blocks": (hot_blocks, 2), "slot_host_rows": (slot_host_rows, 2), "lru": (lru, 2),
    }
    for name, (t, ndim) in tensors.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"resolve: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype != torch.int32:
            raise TypeError(f"resolve: {name} must be int32, got {t.dtype}")
        if t.dim() != ndim:
            raise ValueError(f"resolve: {name} must be {ndim}-D, got shape {tuple(t.shape)}")
        if t.device != topk.device:
            raise ValueError(f"resolve: {name} is on {t.device} but topk is on {topk.device}; "
                             "all tensors must be on one device")
    for name, v in (("block_size", block_size), ("num_device_blocks", num_device_blocks),
                    ("num_host_blocks", num_host_blocks)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"resolve: {name} must be a positive int, got {v!r}")
    for name, v in (("num_device_blocks", num_device_blocks),
                    ("num_host_blocks", num_host_blocks)):
        if v * block_size > _INT32_MAX:
            raise ValueError(f"resolve: {name} * block_size = {v * block_size} row ids do not "
                             "fit int32")
    R, K = topk.shape
    S, P = resident_blocks.shape
    HB = hot_blocks.shape[1]
    H = slot_host_rows.shape[1]
    if K < 1:
        raise ValueError(f"resolve: topk must have at least one column, got shape "
                         f"{tuple(topk.shape)}")
    expect = {"state_rows": (R,), "seq_lens": (S,), "host_blocks": (S, P),
              "hot_blocks": (S, HB), "slot_host_rows": (S, H), "lru": (S, H)}
    for name, shape in expect.items():
        got = tuple(tensors[name][0].shape)
        if got != shape:
            raise ValueError(f"resolve: {name} has shape {got}, expected {shape} "
                             f"(R={R}, K={K}, S={S}, P={P}, HB={HB}, H={H})")
    if H < K:
        raise ValueError(f"resolve: {H} hot slots per request cannot hold top-k {K} (need H >= K)")
    if HB * block_size < H:
        raise ValueError(f"resolve: {HB} hot blocks of {block_size} rows cannot hold {H} slots")
    for name, t in (("slot_host_rows", slot_host_rows), ("lru", lru)):
        if any(stride == 0 and size > 1 for stride, size in zip(t.stride(), t.shape)):
            raise ValueError(f"resolve: {name} is updated in place and must not have a stride-0 "
                             f"(expanded) dimension, got strides {t.stride()}")
    return R, K, S, P, HB, H


def _padding_resolve_result(R: int, K: int, device: torch.device) -> ResolveResult:
    """The outputs of ``R`` padding rows: -1 everywhere, zero counts."""
    i32 = torch.int32
    return ResolveResult(
        torch.full((R, K), -1, dtype=i32, device=device),
        torch.full((R, K), -1, dtype=i32, device=device),
        torch.full((R, K), -1, dtype=i32, device=device),
        torch.zeros(R, dtype=i32, device=device),
        torch.zeros(R, 3, dtype=i32, device=device),
    )


def resolve(
    topk: torch.Tensor,
    state_rows: torch.Tensor,
    seq_lens: torch.Tensor,
    resident_blocks: torch.Tensor,
    host_blocks: torch.Tensor,
    hot_blocks: torch.Tensor,
    slot_host_rows: torch.Tensor,
    lru: torch.Tensor,
    *,
    block_size: int,
    num_device_blocks: int,
    num_host_blocks: int,
) -> ResolveResult:
    """Resolve top-k positions of one index group into device rows; update the hot state.

    Shapes (``R`` batch rows, ``K`` columns, ``S`` state rows, ``P`` pages per request,
    ``HB`` hot blocks per request, ``H`` hot slots per request, ``HB * block_size >= H >= K``):
    - ``topk``: ``[R, K] int32`` token positions (any value: invalid ones output -1).
    - ``state_rows``: ``[R] int32`` state row of each batch row; -1 = padding row. Two batch
      rows must not name the same state row.
    - ``seq_lens``: ``[S] int32`` tokens of each request.
    - ``resident_blocks``: ``[S, P] int32`` device block of each page in this index group's
      resident group; 0 = not resident.
    - ``host_blocks``: ``[S, P] int32`` host block of each page; 0 = null (masked).
    - ``hot_blocks``: ``[S, HB] int32`` device blocks of each request's hot region; slot ``s``
      is device row ``hot_blocks[st, s // block_size] * block_size + s % block_size``.
    - ``slot_host_rows``: ``[S, H] int32`` host row held by each slot, -1 = empty. Updated in
      place.
    - ``lru``: ``[S, H] int32`` permutation of slot ids, least recently used first. Updated
      in place.

    Semantics per column (DESIGN.md section 7; ``B = block_size``, ``st = state_rows[r]``):
    1. ``pos < 0``, ``pos >= seq_lens[st]`` or page ``pos // B >= P`` -> -1 (masked).
    2. ``resident_blocks[st, pos // B]`` in ``[1, num_device_blocks)`` -> device row
       ``block * B + pos % B`` (hit).
    3. else ``g = host_blocks[st, pos // B] * B + pos % B``; a host block outside
       ``[1, num_host_blocks)`` (0 = null) -> -1 (masked). A hot slot holding ``g`` -> hit,
       output that slot's device row.
    4. else miss: distinct misses, numbered in column order of first occurrence, take the
       evictable slots (every slot not hit this step) in LRU order, oldest first; duplicate
       columns share their first occurrence's slot (and count as hits).
    5. new LRU order = unused evictable slots (old order) + filled slots (miss order) + hit
       slots (old LRU order) [+ invalid LRU entries, see below]. A row with no hit slot and no
       filled slot (every column resident or masked) leaves its LRU untouched. Filled slots'
       ``slot_host_rows`` become their host row. Padding rows output -1, count zeros and touch
       no state.

    Outputs (see ``ResolveResult``): ``miss_src[r, m]`` / ``miss_dst[r, m]`` are the host row and
    the filled slot's device row of miss ``m < miss_count[r]``. ``stats[r] = (hits, misses,
    masked)``: ``masked`` = columns whose output is -1; ``misses`` = plan entries whose
    ``miss_dst`` is not -1 (distinct host rows actually gathered); ``hits`` = the rest (resident
    columns, hot-slot hits, duplicates of a miss column), so the three sum to ``K``.

    Corrupted input never makes this (or the kernel) read or write out of range; it resolves
    deterministically as follows (the kernel matches bit for bit):
    - a ``state_rows`` entry outside ``[0, S)`` is a padding row;
    - LRU position ``p`` is *valid* when ``lru[st, p]`` is in ``[0, H)`` and no earlier
      position names the same slot. Only slots named by a valid position take part (a slot
      missing from ``lru`` is never hit and never filled); invalid positions are neither hit
      nor evictable and move, raw values unchanged and in old order, to the end of the new LRU;
    - a slot whose ``slot_host_rows`` entry is outside ``[0, num_host_blocks * B)`` is empty;
      when several valid slots hold the same host row, the one at the earliest LRU position
      serves it and the others count as empty (evictable);
    - misses beyond the number of evictable slots (only possible with a corrupted ``lru``)
      output -1, count as masked and are left out of the plan;
    - a hot block outside ``[1, num_device_blocks)`` gives its slots device row -1: columns
      they serve output -1 (masked) and their plan entries have ``miss_dst == -1`` (counted in
      ``miss_count``, not in ``stats`` misses; a gather skips them).
    Two batch rows naming the same state row is a caller error: the outputs are then
    unspecified (still in range). Shapes, dtypes and devices are validated (``ValueError`` /
    ``TypeError``) before any state is touched; validation never reads tensor values (this torch
    version does synchronise once, for the state write-back, when run on a GPU; the Triton
    kernel never does).
    """
    R, K, S, P, _, H = _check_resolve_args(
        topk, state_rows, seq_lens, resident_blocks, host_blocks, hot_blocks, slot_host_rows,
        lru, block_size, num_device_blocks, num_host_blocks)
    dev = topk.device
    B = block_size
    i64 = torch.int64
    if R == 0 or S == 0:
        return _padding_resolve_result(R, K, dev)

    st = state_rows.to(i64)
    row_ok = (st >= 0) & (st < S)
    stc = torch.where(row_ok, st, 0)
    col = torch.arange(K, device=dev)
    slot_ids = torch.arange(H, device=dev)

    # Columns: masked / resident / host row g (rules 1-3).
    pos = topk.to(i64)
    posc = pos.clamp(min=0)
    page = posc // B
    off = posc - page * B
    seq = seq_lens.to(i64)[stc]
    inr = row_ok[:, None] & (pos >= 0) & (pos < seq[:, None]) & (page < P)
    if P > 0:
        pagec = torch.where(inr, page, 0)
        srow = stc[:, None].expand(R, K)
        rb = resident_blocks[srow, pagec].to(i64)
        hb = host_blocks[srow, pagec].to(i64)
    else:
        rb = hb = torch.zeros(R, K, dtype=i64, device=dev)
    res = inr & (rb >= 1) & (rb < num_device_blocks)
    hok = inr & ~res & (hb >= 1) & (hb < num_host_blocks)
    g = hb * B + off
    rows = torch.where(res, rb * B + off, -1)

    # Host columns sorted by (g, column): equal host rows form runs, first = first occurrence.
    skey, perm = torch.sort(torch.where(hok, g * K + col, _RESOLVE_KEY_SENTINEL + col), dim=1)
    sg = skey // K
    run_start = torch.ones_like(hok)
    run_start[:, 1:] = sg[:, 1:] != sg[:, :-1]
    # crun[r, c]: sorted index where column c's run (its host row's first occurrence) starts.
    crun = torch.empty_like(perm).scatter_(
        1, perm, torch.where(run_start, col, 0).cummax(1).values)

    # Slots in LRU order: valid positions, held host rows, serving positions.
    lru_raw = lru[stc]
    lr = lru_raw.to(i64)
    sv = row_ok[:, None] & (lr >= 0) & (lr < H)
    lrc = torch.where(sv, lr, 0)
    owner = torch.full((R, H), H, dtype=i64, device=dev).scatter_reduce(
        1, lrc, torch.where(sv, slot_ids, H), reduce="amin", include_self=True)
    valid = sv & (owner.gather(1, lrc) == slot_ids)
    held = slot_host_rows[stc].to(i64).gather(1, lrc)
    held_ok = valid & (held >= 0) & (held < num_host_blocks * B)
    run = torch.searchsorted(skey, torch.where(held_ok, held * K, 0)).clamp(max=K - 1)
    found = held_ok & (sg.gather(1, run) == held)
    run_pos = torch.full((R, K), H, dtype=i64, device=dev).scatter_reduce(
        1, run, torch.where(found, slot_ids, H), reduce="amin", include_self=True)
    serving = found & (run_pos.gather(1, run) == slot_ids)

    # Device row of every slot (-1 for a bad hot block).
    hot = hot_blocks[stc][:, slot_ids // B].to(i64)
    slot_dev = torch.where((hot >= 1) & (hot < num_device_blocks), hot * B + slot_ids % B, -1)

    # Columns: hit (a serving slot holds g) or miss; misses numbered in column order.
    srv_pos = run_pos.gather(1, crun)
    hit = hok & (srv_pos < H)
    hit_rows = slot_dev.gather(1, lrc.gather(1, srv_pos.clamp(max=H - 1)))
    first_col = skey.gather(1, crun) % K
    miss = hok & ~hit
    first_miss = miss & (first_col == col)
    miss_num = torch.cumsum(first_miss, 1) - 1
    col_miss_num = miss_num.gather(1, first_col)
    n_miss = first_miss.sum(1, keepdim=True)

    # LRU: evictables in old order take the misses; rewrite the order (rule 5).
    evict = valid & ~serving
    invalid = ~valid
    n_evict = evict.sum(1, keepdim=True)
    n_serving = serving.sum(1, keepdim=True)
    n_fill = torch.minimum(n_miss, n_evict)
    erank = evict.cumsum(1) - 1
    filled = evict & (erank < n_fill)
    new_pos = torch.where(
        evict, torch.where(filled, n_evict - n_fill + erank, erank - n_fill),
        torch.where(serving, n_evict + serving.cumsum(1) - 1,
                    n_evict + n_serving + invalid.cumsum(1) - 1))
    new_lru = torch.empty_like(lru_raw).scatter_(1, new_pos, lru_raw)
    active = row_ok & ((n_serving + n_fill).squeeze(1) > 0)

    # The plan (column K of the scratch catches the entries that are not written).
    miss_src = torch.full((R, K + 1), -1, dtype=i64, device=dev).scatter_(
        1, torch.where(first_miss & (miss_num < n_fill), miss_num, K), g)[:, :K]
    miss_dst = torch.full((R, K + 1), -1, dtype=i64, device=dev).scatter_(
        1, torch.where(filled, erank, K), slot_dev.gather(1, lrc))[:, :K]
    miss_rows = torch.where(col_miss_num < n_fill,
                            miss_dst.gather(1, col_miss_num.clamp(0, K - 1)), -1)
    rows = torch.where(hit, hit_rows, torch.where(miss, miss_rows, rows))

    masked = (rows == -1).sum(1)
    misses = (miss_dst != -1).sum(1)
    stats = torch.stack([K - masked - misses, misses, masked], dim=1)
    stats = torch.where(row_ok[:, None], stats, 0)
    miss_count = torch.where(row_ok, n_fill.squeeze(1), 0)

    # State, in place (validated above; rows of padding batch rows are never written).
    fill_val = miss_src.gather(1, erank.clamp(0, K - 1))
    new_held = torch.cat([slot_host_rows[stc], torch.zeros(R, 1, dtype=torch.int32, device=dev)], 1)
    new_held = new_held.scatter_(1, torch.where(filled, lrc, H), fill_val.to(torch.int32))[:, :H]
    upd = torch.nonzero(row_ok).squeeze(1)
    slot_host_rows[st[upd]] = new_held[upd]
    upd = torch.nonzero(active).squeeze(1)
    lru[st[upd]] = new_lru[upd]

    i32 = torch.int32
    return ResolveResult(rows.to(i32), miss_src.to(i32), miss_dst.to(i32),
                         miss_count.to(i32), stats.to(i32))


def copy_rows(
    dst: RowTable,
    src: RowTable,
    src_rows: torch.Tensor,
    dst_rows: torch.Tensor,
    counts: Optional[torch.Tensor] = None,
) -> None:
    """Copy rows of every layer from ``src`` to ``dst`` (host -> device gather, or back).

    - ``src_rows``, ``dst_rows``: ``[R, K] int32`` (one plan shared by all layers) or
      ``[L, R, K] int32`` (a plan per layer; an ``expand``-ed stride-0 layer dim is fine).
    - ``counts``: ``[R] int32``: only columns ``j < counts[r]`` are copied; ``None`` = all.
    For every layer ``l``, row ``r``, column ``j < counts[r]``:
    ``dst[l][dst_rows[r, j]] = src[l][src_rows[r, j]]``, where a source row outside
    ``[0, src.num_rows)`` copies zeros and a destination row outside ``[0, dst.num_rows)`` is
    skipped. ``dst.num_layers == src.num_layers`` and ``dst.row_bytes == src.row_bytes``.
    If one destination row is named twice, which source lands there is unspecified; so is
    the result for a row that one call both reads and writes (same pool for src and dst).
    """
    check_copy_args(dst, src, src_rows, dst_rows, counts, pages=False)
    _copy_spans(dst, src, src_rows, dst_rows, counts, pages=False)


def copy_pages(
    dst: RowTable,
    src: RowTable,
    src_blocks: torch.Tensor,
    dst_blocks: torch.Tensor,
    counts: Optional[torch.Tensor] = None,
) -> None:
    """Copy whole blocks (``block_size`` rows) of every layer (restore H2D, spill D2H).

    Same plan shapes and bounds rules as ``copy_rows``, with block ids in place of row ids
    (valid blocks ``[0, num_blocks)``; an invalid source block copies zeros, an invalid
    destination block is skipped). ``dst.block_size == src.block_size``.
    """
    check_copy_args(dst, src, src_blocks, dst_blocks, counts, pages=True)
    _copy_spans(dst, src, src_blocks, dst_blocks, counts, pages=True)


def check_copy_args(dst: RowTable, src: RowTable, src_ids: torch.Tensor, dst_ids: torch.Tensor,
                    counts: Optional[torch.Tensor], *, pages: bool) -> None:
    """The argument rules of ``copy_rows`` / ``copy_pages`` (shared with the Triton launchers).

    Raises ``ValueError`` naming the bad value. Reads shapes, dtypes and devices only (never a
    tensor's values), so it costs no device sync.
    """
    fn = "copy_pages" if pages else "copy_rows"
    names = ("src_blocks", "dst_blocks") if pages else ("src_rows", "dst_rows")
    if dst.num_layers != src.num_layers:
        raise ValueError(f"{fn}: dst has {dst.num_layers} layers but src has {src.num_layers}.")
    if dst.row_bytes != src.row_bytes:
        raise ValueError(f"{fn}: dst.row_bytes={dst.row_bytes} != src.row_bytes={src.row_bytes}.")
    if pages and dst.block_size != src.block_size:
        raise ValueError(f"{fn}: dst.block_size={dst.block_size} != "
                         f"src.block_size={src.block_size}.")
    for name, ids in zip(names, (src_ids, dst_ids)):
        if not isinstance(ids, torch.Tensor) or ids.dtype != torch.int32 or ids.dim() not in (2, 3):
            raise ValueError(f"{fn}: {name} must be an int32 tensor [R, K] or [L, R, K], got "
                             f"{getattr(ids, 'dtype', type(ids).__name__)} with shape "
                             f"{tuple(getattr(ids, 'shape', ()))}.")
        if ids.dim() == 3 and ids.shape[0] != dst.num_layers:
            raise ValueError(f"{fn}: {name} has a layer dim of {ids.shape[0]} but the tables "
                             f"have {dst.num_layers} layers.")
    if src_ids.shape[-2:] != dst_ids.shape[-2:]:
        raise ValueError(f"{fn}: {names[0]} {tuple(src_ids.shape)} and {names[1]} "
                         f"{tuple(dst_ids.shape)} do not have the same [R, K].")
    if src_ids.device != dst_ids.device:
        raise ValueError(f"{fn}: {names[0]} is on {src_ids.device} but {names[1]} is on "
                         f"{dst_ids.device}.")
    if counts is not None:
        rows = src_ids.shape[-2]
        if not isinstance(counts, torch.Tensor) or counts.dtype != torch.int32 \
                or tuple(counts.shape) != (rows,):
            raise ValueError(f"{fn}: counts must be an int32 tensor [{rows}], got "
                             f"{getattr(counts, 'dtype', type(counts).__name__)} with shape "
                             f"{tuple(getattr(counts, 'shape', ()))}.")
        if counts.device != src_ids.device:
            raise ValueError(f"{fn}: counts is on {counts.device} but {names[0]} is on "
                             f"{src_ids.device}.")


#: ``table_alignment`` results by ``id(layer_offsets)``: (weak ref, geometry, alignment).
_TABLE_CHECKS: dict[int, tuple[weakref.ref, tuple, int]] = {}


def _version_of(tensor: torch.Tensor) -> int:
    try:
        return tensor._version
    except RuntimeError:  # inference tensors have no version counter
        return -1


def table_alignment(table: RowTable) -> int:
    """Check once that every layer of ``table`` lies inside its pool; return the largest power
    of two (<= 16) dividing every layer offset.

    The first call for a ``layer_offsets`` tensor reads it on the host (a device sync when it
    lives on CUDA: call this before capturing a CUDA graph); later calls with the same,
    unmodified tensor and table geometry are answered from a cache. Raises ``ValueError``
    naming the first layer that does not fit.
    """
    offsets = table.layer_offsets
    geometry = (_version_of(offsets), table.pool.numel(), table.row_bytes, table.block_size,
                table.block_stride, table.num_rows)
    key = id(offsets)
    entry = _TABLE_CHECKS.get(key)
    if entry is not None and entry[0]() is offsets and entry[1] == geometry:
        return entry[2]
    values = offsets.tolist()
    span = (table.num_blocks - 1) * table.block_stride + table.block_size * table.row_bytes
    for layer, offset in enumerate(values):
        if offset < 0 or offset + span > table.pool.numel():
            raise ValueError(f"layer {layer} at byte offset {offset} spans {span} B and does "
                             f"not fit a pool of {table.pool.numel()} B.")
    alignment = pow2_alignment(*values)
    _TABLE_CHECKS[key] = (weakref.ref(offsets, lambda _ref, k=key: _TABLE_CHECKS.pop(k, None)),
                          geometry, alignment)
    return alignment


_WORD_DTYPES = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _span_windows(pool: torch.Tensor, span_bytes: int, word: int) -> torch.Tensor:
    """``[n - span/word + 1, span/word]`` overlapping view of ``pool`` as ``word``-byte words:
    window ``a`` is the span starting at word ``a`` (any aligned byte address, one index)."""
    n = pool.numel() // word
    words = pool[: n * word].view(_WORD_DTYPES[word])
    span_words = span_bytes // word
    return words.as_strided((n - span_words + 1, span_words), (1, 1))


def _span_addresses(table: RowTable, layer: torch.Tensor, ids: torch.Tensor,
                    pages: bool) -> torch.Tensor:
    """Byte address (int64) of row / block ``ids`` of ``layer`` inside ``table.pool``."""
    base = table.layer_offsets.to(ids.device)[layer]
    if pages:
        return base + ids * table.block_stride
    return base + (ids // table.block_size) * table.block_stride \
        + (ids % table.block_size) * table.row_bytes


def _copy_spans(dst: RowTable, src: RowTable, src_ids: torch.Tensor, dst_ids: torch.Tensor,
                counts: Optional[torch.Tensor], *, pages: bool) -> None:
    """``copy_rows`` (``pages=False``) / ``copy_pages`` (``pages=True``) after the checks.

    Vectorised over every (layer, row, column): the kept entries are picked with two masks
    (counted columns, then valid destinations), their byte addresses computed as int64
    tensors, and the bytes moved with one ``index_select`` on an overlapping word view of the
    source pool and one ``index_copy_`` into the same kind of view of the destination pool
    (torch writes element by element there; the destination spans of distinct ids are
    disjoint, and the tests pin this down against a per-row loop).
    """
    num_layers = dst.num_layers
    rows, cols = src_ids.shape[-2:]
    if rows == 0 or cols == 0:
        return
    device = src_ids.device
    span = dst.row_bytes * (dst.block_size if pages else 1)
    src_limit = src.num_blocks if pages else src.num_rows
    dst_limit = dst.num_blocks if pages else dst.num_rows
    word = pow2_alignment(span, src.block_stride, dst.block_stride, table_alignment(src),
                          table_alignment(dst), src.pool.storage_offset(),
                          dst.pool.storage_offset(), cap=8)

    # Counted columns first (a miss plan is mostly padding), then valid destinations per layer.
    if counts is None:
        row = torch.arange(rows, device=device).repeat_interleave(cols)
        col = torch.arange(cols, device=device).repeat(rows)
    else:
        counted = torch.arange(cols, device=device) < counts.unsqueeze(1)
        row, col = counted.nonzero(as_tuple=True)
    s = src_ids[..., row, col].expand(num_layers, row.numel())
    d = dst_ids[..., row, col].expand(num_layers, row.numel())
    layer, entry = ((d >= 0) & (d < dst_limit)).nonzero(as_tuple=True)
    s = s[layer, entry].long()
    d = d[layer, entry].long()
    src_ok = (s >= 0) & (s < src_limit)
    s = torch.where(src_ok, s, 0)

    src_words = (_span_addresses(src, layer, s, pages) // word).to(src.pool.device)
    dst_words = (_span_addresses(dst, layer, d, pages) // word).to(dst.pool.device)
    data = _span_windows(src.pool, span, word).index_select(0, src_words)
    data.masked_fill_(~src_ok.to(data.device).unsqueeze(1), 0)
    _span_windows(dst.pool, span, word).index_copy_(0, dst_words, data.to(dst.pool.device))
