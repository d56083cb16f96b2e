"""Pure-torch oracle of every kernel: the bit-exact semantics the Triton kernels must match.

This module is the specification the Triton kernels in ``hisparse_triton.kernels`` must match
byte for byte, and the runtime's CPU backend. It works on any device.

Conventions shared by all functions:
- ids (positions, rows, blocks, slots) are int32; address arithmetic is int64;
- block 0 of every pool is the null block ("no page") in block tables;
- nothing here (or in a kernel) reads or writes outside the pools, whatever the ids say.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from hisparse_triton.ops.resolve.workspace import ResolveWorkspace
from hisparse_triton.row_table import RowTable
from hisparse_triton.tuning import MAX_RESOLVE_WIDTH, pow2_alignment


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
#: Integer dtypes ``topk`` may have. Positions are compared as int64, so a value outside
#: ``[0, seq_len)`` masks whatever its width (an int64 or uint64 position never wraps into
#: range; a uint64 beyond int64 reads as negative, which masks too).
TOPK_DTYPES = (torch.int8, torch.uint8, torch.int16, torch.uint16, torch.int32, torch.uint32,
               torch.int64, torch.uint64)
_TOPK_DTYPE_SET = frozenset(TOPK_DTYPES)
_INT32_X7 = (torch.int32,) * 7
#: ``resolve``'s tensor arguments and their ranks, in order.
_RESOLVE_TENSORS = (("topk", 2), ("state_rows", 1), ("seq_lens", 1), ("resident_blocks", 2),
                    ("host_blocks", 2), ("hot_blocks", 2), ("slot_host_rows", 2), ("lru", 2))
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
    counters: Optional[torch.Tensor] = None,
    out: Optional[torch.Tensor] = None,
    workspace: Optional[ResolveWorkspace] = None,
) -> tuple[int, int, int, int, int, int]:
    """Validate ``resolve``'s arguments (shapes, dtypes, devices, sizes; never tensor values).

    Returns ``(R, K, S, P, HB, H)``. Raises ``TypeError`` / ``ValueError`` naming the bad value.
    Shared by the reference and the Triton launcher so both reject exactly the same inputs.
    It runs on every decode call, so valid arguments are accepted with a few C-level tuple
    comparisons; anything else goes to ``_explain_resolve_args`` for the message.
    """
    try:
        shapes = (topk.shape, state_rows.shape, seq_lens.shape, resident_blocks.shape,
                  host_blocks.shape, hot_blocks.shape, slot_host_rows.shape, lru.shape)
        dtypes = (state_rows.dtype, seq_lens.dtype, resident_blocks.dtype, host_blocks.dtype,
                  hot_blocks.dtype, slot_host_rows.dtype, lru.dtype)
        device = topk.device
        devices = (state_rows.device, seq_lens.device, resident_blocks.device,
                   host_blocks.device, hot_blocks.device, slot_host_rows.device, lru.device)
        R, K = shapes[0]
        S, P = shapes[3]
        HB = shapes[5][1]
        H = shapes[6][1]
        ok = (type(block_size) is int and type(num_device_blocks) is int
              and type(num_host_blocks) is int and block_size > 0 and num_device_blocks > 0
              and num_host_blocks > 0
              and max(num_device_blocks, num_host_blocks) * block_size <= _INT32_MAX
              and topk.dtype in _TOPK_DTYPE_SET and dtypes == _INT32_X7
              and devices == (device,) * 7
              and shapes[1:] == ((R,), (S,), (S, P), (S, P), (S, HB), (S, H), (S, H))
              and 0 < K <= H <= HB * block_size and K <= MAX_RESOLVE_WIDTH
              and 0 not in slot_host_rows.stride() and 0 not in lru.stride())
    except (AttributeError, TypeError, ValueError):  # not tensors, wrong ranks
        ok = False
    if not ok:
        return _explain_resolve_args(
            topk, state_rows, seq_lens, resident_blocks, host_blocks, hot_blocks,
            slot_host_rows, lru, block_size, num_device_blocks, num_host_blocks, counters, out,
            workspace)
    if counters is not None and not (
            type(counters) is torch.Tensor and counters.dtype is torch.int64
            and counters.shape == (3,) and counters.device == device) \
            or out is not None and not (
                type(out) is torch.Tensor and out.dtype is torch.int32 and out.shape == (R, K)
                and out.device == device and 0 not in out.stride()) \
            or workspace is not None and not (
                type(workspace) is ResolveWorkspace and workspace.device == device):
        _check_resolve_extras(R, K, H, device, counters, out, workspace)
    return R, K, S, P, HB, H


def _explain_resolve_args(*args) -> tuple[int, int, int, int, int, int]:
    """``_check_resolve_args`` one rule at a time: raises naming the first bad value (or
    accepts what the fast path refused only for a harmless reason, e.g. a size-1 stride-0
    dimension). ``args``: ``_check_resolve_args``'s, all positional."""
    (topk, state_rows, seq_lens, resident_blocks, host_blocks, hot_blocks, slot_host_rows, lru,
     block_size, num_device_blocks, num_host_blocks, counters, out, workspace) = args
    tensors = (topk, state_rows, seq_lens, resident_blocks, host_blocks, hot_blocks,
               slot_host_rows, lru)
    device = None
    shapes = []
    for (name, ndim), t in zip(_RESOLVE_TENSORS, tensors):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"resolve: {name} must be a torch.Tensor, got {type(t).__name__}")
        dtype = t.dtype
        if dtype is not torch.int32 and (name != "topk" or dtype not in _TOPK_DTYPE_SET):
            want = "an integer tensor (int8 ... int64, uint8 ... uint64)" if name == "topk" \
                else "int32"
            raise TypeError(f"resolve: {name} must be {want}, got {dtype}")
        shape = t.shape
        if len(shape) != ndim:
            raise ValueError(f"resolve: {name} must be {ndim}-D, got shape {tuple(shape)}")
        where = t.device
        if device is None:
            device = where
        elif where != device:
            raise ValueError(f"resolve: {name} is on {where} but topk is on {device}; "
                             "all tensors must be on one device")
        shapes.append(shape)
    for name, v in (("block_size", block_size), ("num_device_blocks", num_device_blocks),
                    ("num_host_blocks", num_host_blocks)):
        if type(v) is not int or v < 1:
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"resolve: {name} must be a positive int, got {v!r}")
    for name, v in (("num_device_blocks", num_device_blocks),
                    ("num_host_blocks", num_host_blocks)):
        if v * block_size > _INT32_MAX:
            raise ValueError(f"resolve: {name} * block_size = {v * block_size} row ids do not "
                             "fit int32")
    R, K = shapes[0]
    S, P = shapes[3]
    HB = shapes[5][1]
    H = shapes[6][1]
    if K < 1:
        raise ValueError(f"resolve: topk must have at least one column, got shape "
                         f"{tuple(shapes[0])}")
    if K > MAX_RESOLVE_WIDTH:
        raise ValueError(f"resolve: top-k width {K} is above the supported maximum "
                         f"MAX_RESOLVE_WIDTH = {MAX_RESOLVE_WIDTH}")
    expect = ((R,), (S,), (S, P), (S, P), (S, HB), (S, H), (S, H))
    for i in range(1, 8):
        if shapes[i] != expect[i - 1]:
            raise ValueError(f"resolve: {_RESOLVE_TENSORS[i][0]} has shape "
                             f"{tuple(shapes[i])}, expected {expect[i - 1]} "
                             f"(R={R}, K={K}, S={S}, P={P}, HB={HB}, H={H})")
    if H < K:
        raise ValueError(f"resolve: {H} hot slots per request cannot hold top-k {K} (need H >= K)")
    if HB * block_size < H:
        raise ValueError(f"resolve: {HB} hot blocks of {block_size} rows cannot hold {H} slots")
    for name, t in (("slot_host_rows", slot_host_rows), ("lru", lru)):
        strides = t.stride()
        if 0 in strides and any(st == 0 and n > 1 for st, n in zip(strides, t.shape)):
            raise ValueError(f"resolve: {name} is updated in place and must not have a stride-0 "
                             f"(expanded) dimension, got strides {strides}")
    if counters is not None or out is not None or workspace is not None:
        _check_resolve_extras(R, K, H, device, counters, out, workspace)
    return R, K, S, P, HB, H


def _check_resolve_extras(R: int, K: int, H: int, device: torch.device,
                          counters: Optional[torch.Tensor], out: Optional[torch.Tensor],
                          workspace: Optional[ResolveWorkspace]) -> None:
    """The optional ``counters`` / ``out`` / ``workspace`` arguments of ``resolve``."""
    if counters is not None:
        if not isinstance(counters, torch.Tensor) or counters.dtype != torch.int64 \
                or tuple(counters.shape) != (3,):
            raise ValueError(f"resolve: counters must be an int64 tensor [3], got "
                             f"{getattr(counters, 'dtype', type(counters).__name__)} of shape "
                             f"{tuple(getattr(counters, 'shape', ()))}")
        if counters.device != device:
            raise ValueError(f"resolve: counters is on {counters.device} but topk is on {device}")
    if out is not None:
        if not isinstance(out, torch.Tensor) or out.dtype != torch.int32 \
                or tuple(out.shape) != (R, K):
            raise ValueError(f"resolve: out must be an int32 tensor [{R}, {K}], got "
                             f"{getattr(out, 'dtype', type(out).__name__)} of shape "
                             f"{tuple(getattr(out, 'shape', ()))}")
        if out.device != device:
            raise ValueError(f"resolve: out is on {out.device} but topk is on {device}")
        if any(stride == 0 and size > 1 for stride, size in zip(out.stride(), out.shape)):
            raise ValueError(f"resolve: out is written and must not have a stride-0 (expanded) "
                             f"dimension, got strides {out.stride()}")
    if workspace is not None:
        if not isinstance(workspace, ResolveWorkspace):
            raise TypeError(f"resolve: workspace must be a ResolveWorkspace, got "
                            f"{type(workspace).__name__}")
        if workspace.device != device:
            raise ValueError(f"resolve: the workspace is on {workspace.device} but topk is on "
                             f"{device}")


def first_occurrences(state_rows: torch.Tensor, num_states: int) -> torch.Tensor:
    """``[R] bool``: batch rows that resolve. A row is resolved when its state row is in
    ``[0, num_states)`` and no earlier batch row names the same state row (a state row named
    twice is resolved by its first batch row; the later ones are padding)."""
    st = state_rows.to(torch.int64)
    ok = (st >= 0) & (st < num_states)
    R = st.numel()
    if R < 2:
        return ok
    _, inverse = torch.unique(st, return_inverse=True)
    index = torch.arange(R, device=st.device)
    first = torch.full((R,), R, dtype=torch.int64, device=st.device).scatter_reduce(
        0, inverse, index, reduce="amin", include_self=True)
    return ok & (first[inverse] == index)


def _emit(result: ResolveResult, touched: torch.Tensor, slot_host_rows: torch.Tensor,
          lru: torch.Tensor, H: int,
          counters: Optional[torch.Tensor], out: Optional[torch.Tensor],
          workspace: Optional[ResolveWorkspace]) -> ResolveResult:
    """Put a computed result where the caller asked for it (``out``, the workspace) and add its
    totals to ``counters``. ``slot_host_rows`` / ``lru``: the pre-call state rows ``[R, H]`` of
    the batch rows (snapshots for ``restore_resolve_state``)."""
    rows = result.rows
    if workspace is not None:
        R, K = rows.shape
        bufs = workspace.buffers(R, K, H)
        for name in ("miss_src", "miss_dst", "miss_count", "stats"):
            getattr(bufs, name).copy_(getattr(result, name))
        bufs.touched.copy_(touched)
        bufs.old_slot_rows.copy_(slot_host_rows)
        bufs.old_lru.copy_(lru)
        workspace.last = bufs
        if out is None:
            bufs.rows.copy_(rows)
            rows = bufs.rows
        result = ResolveResult(rows, bufs.miss_src, bufs.miss_dst, bufs.miss_count, bufs.stats)
    if out is not None:
        out.copy_(rows)
        result = result._replace(rows=out)
    if counters is not None:
        counters += result.stats.sum(0)
    return result


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
    counters: Optional[torch.Tensor] = None,
    out: Optional[torch.Tensor] = None,
    workspace: Optional[ResolveWorkspace] = None,
) -> ResolveResult:
    """Resolve top-k positions of one index group into device rows; update the hot state.

    Shapes (``R`` batch rows, ``K`` columns, ``S`` state rows, ``P`` pages per request,
    ``HB`` hot blocks per request, ``H`` hot slots per request, ``HB * block_size >= H >= K``,
    ``K <= MAX_RESOLVE_WIDTH`` = 32768):
    - ``topk``: ``[R, K]`` token positions, any integer dtype (``TOPK_DTYPES``) and strides;
      any value: invalid ones (negative, ``>= seq_len``, beyond int32) output -1.
    - ``state_rows``: ``[R] int32`` state row of each batch row; -1 = padding row. A state
      row named by several batch rows is resolved by the first of them only; the later ones
      are padding rows.
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

    Optional (keyword) arguments, identical on every backend:
    - ``counters``: ``[3] int64`` on ``topk``'s device; the call adds its totals of ``stats``
      (hits, misses, masked summed over the rows) to it.
    - ``out``: ``[R, K] int32``: written with ``rows`` and returned as ``result.rows`` (a
      caller-owned buffer, e.g. one per index group).
    - ``workspace``: a ``ResolveWorkspace`` on ``topk``'s device. The plan (``miss_src``,
      ``miss_dst``, ``miss_count``, ``stats``; and ``rows`` without ``out``) is written into
      it and returned as views of it, valid until the next call with the same workspace; the
      pre-call ``slot_host_rows`` / ``lru`` of every resolved batch row are kept in it, so that
      ``restore_resolve_state`` can undo the call.

    Semantics per column (``B = block_size``, ``st = state_rows[r]``):
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
    Shapes, dtypes and devices are validated (``ValueError`` / ``TypeError``) before any state
    is touched; validation never reads tensor values (this torch version does synchronise
    once, for the state write-back, when run on a GPU; the Triton kernel never does).
    """
    R, K, S, P, _, H = _check_resolve_args(
        topk, state_rows, seq_lens, resident_blocks, host_blocks, hot_blocks, slot_host_rows,
        lru, block_size, num_device_blocks, num_host_blocks, counters, out, workspace)
    dev = topk.device
    B = block_size
    i64 = torch.int64
    if R == 0 or S == 0:
        empty = torch.zeros(R, H, dtype=torch.int32, device=dev)
        return _emit(_padding_resolve_result(R, K, dev), torch.zeros(R, dtype=torch.int32,
                     device=dev), empty, empty, H, counters, out, workspace)

    st = state_rows.to(i64)
    row_ok = first_occurrences(state_rows, S)
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
    held_raw = slot_host_rows[stc]
    lr = lru_raw.to(i64)
    sv = row_ok[:, None] & (lr >= 0) & (lr < H)
    lrc = torch.where(sv, lr, 0)
    owner = torch.full((R, H), H, dtype=i64, device=dev).scatter_reduce(
        1, lrc, torch.where(sv, slot_ids, H), reduce="amin", include_self=True)
    valid = sv & (owner.gather(1, lrc) == slot_ids)
    held = held_raw.to(i64).gather(1, lrc)
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
    new_held = torch.cat([held_raw, torch.zeros(R, 1, dtype=torch.int32, device=dev)], 1)
    new_held = new_held.scatter_(1, torch.where(filled, lrc, H), fill_val.to(torch.int32))[:, :H]
    upd = torch.nonzero(row_ok).squeeze(1)
    slot_host_rows[st[upd]] = new_held[upd]
    upd = torch.nonzero(active).squeeze(1)
    lru[st[upd]] = new_lru[upd]

    i32 = torch.int32
    result = ResolveResult(rows.to(i32), miss_src.to(i32), miss_dst.to(i32),
                           miss_count.to(i32), stats.to(i32))
    return _emit(result, row_ok.to(i32), held_raw, lru_raw, H, counters, out, workspace)


def restore_resolve_state(workspace: ResolveWorkspace, state_rows: torch.Tensor,
                          slot_host_rows: torch.Tensor, lru: torch.Tensor) -> None:
    """Undo the last ``resolve`` made with ``workspace``: write back the ``slot_host_rows``
    and ``lru`` rows it saved for every batch row it resolved (the failure path, e.g. when
    the gather that follows a resolve raised). ``state_rows``: the ``[R] int32`` the call got;
    ``slot_host_rows`` / ``lru``: its ``[S, H]`` state tensors. Torch ops (a device sync on
    CUDA); raises ``ValueError`` when the workspace holds no call of that shape."""
    bufs = workspace.last if isinstance(workspace, ResolveWorkspace) else None
    if bufs is None:
        raise ValueError("restore_resolve_state: the workspace holds no resolve call to undo "
                         "(pass the workspace the call used, before any other call with it).")
    R, H = bufs.old_lru.shape
    if not isinstance(state_rows, torch.Tensor) or tuple(state_rows.shape) != (R,):
        raise ValueError(f"restore_resolve_state: state_rows must be the [{R}] tensor of the "
                         f"last call, got shape {tuple(getattr(state_rows, 'shape', ()))}.")
    for name, t in (("slot_host_rows", slot_host_rows), ("lru", lru)):
        if not isinstance(t, torch.Tensor) or t.dim() != 2 or t.shape[1] != H \
                or t.dtype != torch.int32:
            raise ValueError(f"restore_resolve_state: {name} must be int32 [S, {H}], got "
                             f"{getattr(t, 'dtype', type(t).__name__)} of shape "
                             f"{tuple(getattr(t, 'shape', ()))}.")
    touched = bufs.touched.to(torch.bool)
    rows = state_rows.to(torch.int64)[touched]
    if rows.numel() and (int(rows.min()) < 0 or int(rows.max()) >= lru.shape[0]):
        raise ValueError("restore_resolve_state: state_rows are not those of the last call.")
    slot_host_rows[rows] = bufs.old_slot_rows[touched]
    lru[rows] = bufs.old_lru[touched]


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
    # Fast accept (every decode call comes here); anything else is explained below.
    try:
        s_shape, d_shape = src_ids.shape, dst_ids.shape
        layers = len(dst.offsets)
        device = src_ids.device
        if (src_ids.dtype is torch.int32 and dst_ids.dtype is torch.int32
                and len(src.offsets) == layers and dst.row_bytes == src.row_bytes
                and (not pages or dst.block_size == src.block_size)
                and (len(s_shape) == 2 or len(s_shape) == 3 and s_shape[0] == layers)
                and (len(d_shape) == 2 or len(d_shape) == 3 and d_shape[0] == layers)
                and s_shape[-2:] == d_shape[-2:] and dst_ids.device == device
                and (counts is None or counts.dtype is torch.int32
                     and counts.shape == (s_shape[-2],) and counts.device == device)):
            return
    except (AttributeError, TypeError, IndexError):
        pass
    fn = "copy_pages" if pages else "copy_rows"
    names = ("src_blocks", "dst_blocks") if pages else ("src_rows", "dst_rows")
    layers = len(dst.offsets)
    if layers != len(src.offsets):
        raise ValueError(f"{fn}: dst has {dst.num_layers} layers but src has {src.num_layers}.")
    if dst.row_bytes != src.row_bytes:
        raise ValueError(f"{fn}: dst.row_bytes={dst.row_bytes} != src.row_bytes={src.row_bytes}.")
    if pages and dst.block_size != src.block_size:
        raise ValueError(f"{fn}: dst.block_size={dst.block_size} != "
                         f"src.block_size={src.block_size}.")
    shapes = []
    for name, ids in zip(names, (src_ids, dst_ids)):
        shape = ids.shape if isinstance(ids, torch.Tensor) else ()
        if ids.dtype is not torch.int32 if shape else True:
            raise ValueError(f"{fn}: {name} must be an int32 tensor [R, K] or [L, R, K], got "
                             f"{getattr(ids, 'dtype', type(ids).__name__)} with shape "
                             f"{tuple(getattr(ids, 'shape', ()))}.")
        if len(shape) == 3:
            if shape[0] != layers:
                raise ValueError(f"{fn}: {name} has a layer dim of {shape[0]} but the tables "
                                 f"have {layers} layers.")
        elif len(shape) != 2:
            raise ValueError(f"{fn}: {name} must be an int32 tensor [R, K] or [L, R, K], got "
                             f"{ids.dtype} with shape {tuple(shape)}.")
        shapes.append(shape)
    if shapes[0][-2:] != shapes[1][-2:]:
        raise ValueError(f"{fn}: {names[0]} {tuple(shapes[0])} and {names[1]} "
                         f"{tuple(shapes[1])} do not have the same [R, K].")
    device = src_ids.device
    if dst_ids.device != device:
        raise ValueError(f"{fn}: {names[0]} is on {device} but {names[1]} is on "
                         f"{dst_ids.device}.")
    if counts is not None:
        rows = shapes[0][-2]
        if not isinstance(counts, torch.Tensor) or counts.dtype is not torch.int32 \
                or counts.shape != (rows,):
            raise ValueError(f"{fn}: counts must be an int32 tensor [{rows}], got "
                             f"{getattr(counts, 'dtype', type(counts).__name__)} with shape "
                             f"{tuple(getattr(counts, 'shape', ()))}.")
        if counts.device != device:
            raise ValueError(f"{fn}: counts is on {counts.device} but {names[0]} is on "
                             f"{device}.")


def table_alignment(table: RowTable) -> int:
    """The largest power of two (<= 16) dividing every layer offset of ``table``.

    A ``RowTable`` checks its layers against its pool by value when it is built and keeps its
    own copy of the offsets, so nothing here reads a tensor; raises ``ValueError`` if the pool
    was resized in place since.
    """
    table.check_pool()
    return table.alignment


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
    base = table.device_offsets(ids.device)[layer]
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
