"""Argument checks of the vLLM 0.33 HiSparse ops (shared by the torch models and the kernels).

Each ``check_*`` validates shapes, dtypes, layouts and devices of one op's arguments and
returns the geometry both backends need. They read no tensor values (no device sync), so a
call that passes them can be captured in a CUDA graph. The rules are vLLM's own (the checks
its CUDA ops make), plus the ones that keep every access inside the tensors: all index
tensors on one device (the op's device), the host cache on the CPU or on that device, and
``batch_size`` within the tables it indexes.

A failed check raises ``RuntimeError``, as vLLM's ops do (every argument check of vLLM 0.33's
five ops is a ``TORCH_CHECK``, which surfaces in Python as ``RuntimeError``; so does the
dispatcher's refusal of an argument of the wrong type), and changes nothing. The message is
``"<op>: <vLLM's message>: <the bad value>"`` where vLLM's op makes the same check (its text
verbatim, so code that matches vLLM's messages matches ours), ``"<op>: <the bad value>"`` for
the checks only this implementation makes.
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Union

import torch
from torch import Tensor

__all__ = ["FP8_HEAD_DIM", "FP8_ROW_BYTES", "GatherGeometry", "MAX_HOT_SIZE", "ResolveGeometry",
           "UpconvertGeometry", "check_gather_compact", "check_gather_plan",
           "check_invalidate_written_slots", "check_resolve_residency", "check_upconvert",
           "check_upconvert_addresses", "checked"]

#: Largest hot buffer (slots per request): LRU slots are int16.
MAX_HOT_SIZE = 32768
#: An ``fp8_ds_mla`` KV row: 512 fp8 values, 4 fp32 scales, 64 bf16 rope values.
FP8_ROW_BYTES = 656
#: The bf16 row the FP8 up-convert writes: 512 dequantised values + 64 rope values.
FP8_HEAD_DIM = 576
_INT32_MAX = 2**31 - 1
_FP8_CACHE_DTYPES = (torch.uint8, torch.float8_e4m3fn, torch.float8_e5m2)


#: Accepted argument signatures -> the check's result (see ``checked``).
_ACCEPTED: dict[tuple, object] = {}
_MAX_ACCEPTED = 4096


def checked(check, args: tuple):
    """``check(*args)``, remembered by the arguments' signature: every tensor's dtype, shape,
    strides and device, and every other argument itself (all the checks look at; the
    one address check, ``check_upconvert``'s alignment, is redone by its launcher). A call in
    a layout already accepted costs one tuple and one lookup; a new layout runs the full check
    (which raises on bad input and remembers nothing)."""
    key = (check, *[(a.dtype, a.shape, a.stride(), a.device)
                    if a.__class__ is Tensor else a for a in args])
    result = _ACCEPTED.get(key)
    if result is None:
        result = check(*args)
        if len(_ACCEPTED) >= _MAX_ACCEPTED:
            _ACCEPTED.clear()
        _ACCEPTED[key] = result
    return result


#: vLLM's message for one aspect of a tensor check: one text for every aspect, or a mapping
#: ``{"tensor" | "dtype" | "ndim" | "device" | "layout" | "shape": text}`` (aspects it lacks
#: are checks vLLM does not make).
Vllm = Union[str, dict, None]


def _vllm(vllm: Vllm, aspect: str) -> Optional[str]:
    return vllm.get(aspect) if isinstance(vllm, dict) else vllm


def _fail(op: str, message: str, vllm: Vllm = None, aspect: str = "") -> None:
    """Raise the ``RuntimeError`` vLLM's ``TORCH_CHECK`` raises (see the module docstring)."""
    text = _vllm(vllm, aspect)
    raise RuntimeError(f"{op}: {text}: {message}" if text else f"{op}: {message}")


def _tensor(op: str, name: str, t, dtype: Optional[torch.dtype], ndim: Optional[int],
            device: Optional[torch.device], vllm: Vllm = None) -> Tensor:
    if not isinstance(t, Tensor):
        _fail(op, f"{name} must be a torch.Tensor, got {type(t).__name__}", vllm, "tensor")
    if dtype is not None and t.dtype != dtype:
        _fail(op, f"{name} must be {dtype}, got {t.dtype}", vllm, "dtype")
    if ndim is not None and t.dim() != ndim:
        _fail(op, f"{name} must be {ndim}-D, got shape {tuple(t.shape)}", vllm, "ndim")
    if device is not None and t.device != device:
        _fail(op, f"{name} is on {t.device} but the op's index tensors are on {device}; they "
                  "must all be on one device", vllm, "device")
    return t


def _contiguous(op: str, name: str, t: Tensor, vllm: Vllm = None) -> None:
    if not t.is_contiguous():
        _fail(op, f"{name} must be contiguous, got strides {t.stride()}", vllm, "layout")


def _row_major(op: str, name: str, t: Tensor, vllm: Vllm = None) -> None:
    if t.dim() and t.shape[-1] > 1 and t.stride(-1) != 1:
        _fail(op, f"{name} must be row-major (last stride 1), got strides {t.stride()}", vllm,
              "layout")


def _plan(op: str, name: str, t, R: int, K: int, device: torch.device, *,
          row_major_only: bool = False, what: str = "", vllm: Vllm = None) -> None:
    """An int32 ``[R, K]`` plan / output tensor on ``device``: contiguous, or only row-major."""
    _tensor(op, name, t, torch.int32, 2, device, vllm)
    if tuple(t.shape) != (R, K):
        _fail(op, f"{name} has shape {tuple(t.shape)}, expected {(R, K)}{what}", vllm, "shape")
    (_row_major if row_major_only else _contiguous)(op, name, t, vllm)


def _per_row(op: str, name: str, t, R: int, device: torch.device, what: str = "rows",
             vllm: Vllm = None) -> None:
    """A contiguous int32 tensor with at least ``R`` entries (one per row)."""
    _tensor(op, name, t, torch.int32, None, device, vllm)
    _contiguous(op, name, t, vllm)
    if t.numel() < R:
        _fail(op, f"{name} has {t.numel()} entries for {R} {what}", vllm, "shape")


#: vLLM's checks of every op's host cache (``check_2d_rows``).
_HOST_CACHE = {"tensor": "host_cache must be 2D", "ndim": "host_cache must be 2D",
               "layout": "host_cache must be contiguous"}


def _host_cache(op: str, host_cache, row_bytes: int, device: torch.device,
                vllm: bool = True) -> int:
    """Checks the host cache ``[host_rows, row_width]``; returns ``host_rows``. ``vllm``:
    vLLM's op makes these checks with ``check_2d_rows`` (its messages)."""
    texts = _HOST_CACHE if vllm else {}
    _tensor(op, "host_cache", host_cache, None, 2, None, texts)
    if host_cache.device.type != "cpu" and host_cache.device != device:
        _fail(op, f"host_cache is on {host_cache.device}; it must be on the CPU (pinned, for "
                  f"a CUDA kernel) or on {device}")
    _contiguous(op, "host_cache", host_cache, texts)
    if host_cache.shape[1] * host_cache.element_size() != row_bytes:
        _fail(op, f"host_cache rows are {host_cache.shape[1] * host_cache.element_size()} B "
                  f"but the cache rows are {row_bytes} B",
              "host_cache row width mismatch" if vllm else None)
    return host_cache.shape[0]


class ResolveGeometry(NamedTuple):
    """What ``hisparse_resolve_residency`` needs besides its tensors (host-side ints)."""

    num_rows: int          # R: rows of global_indices (tokens of the step)
    top_k: int             # K
    hot_size: int          # slots per request (= region_stride)
    num_states: int        # rows of device_global_indices / lru_slots
    hot_block_size: int
    host_rows: int


def check_resolve_residency(
        host_cache, hot_cache, hot_block_table, global_indices, hot_indices,
        device_global_indices, lru_slots, request_state_indices, region_stride: int,
        max_union_rows: int, miss_mask, stats, attention_indices, attention_block_stride: int,
        request_ids, source_block_table, source_block_size: int, resolved_global_indices,
        valid_counts, swap_host_physical_rows, swap_device_physical_rows, swap_counts,
        resident_block_table, resident_block_size: int,
        resident_null_block: int) -> ResolveGeometry:
    """Validate ``hisparse_resolve_residency``'s arguments (vLLM's checks plus one device)."""
    op = "hisparse_resolve_residency"
    i32 = torch.int32
    _tensor(op, "global_indices", global_indices, i32, 2, None, {
        "dtype": "global_indices/hot_indices must be int32",
        "ndim": "global_indices must be row-major 2D"})
    device = global_indices.device
    _row_major(op, "global_indices", global_indices, "global_indices must be row-major 2D")
    R, K = global_indices.shape
    _tensor(op, "hot_cache", hot_cache, None, 3, device,
            {"ndim": "hot_cache must be [num_blocks, block_size, row_width]"})
    row_bytes = hot_cache.shape[2] * hot_cache.element_size()
    if row_bytes % 16:
        _fail(op, f"rows of {row_bytes} B", "KV rows must be 16-byte aligned")
    if hot_cache.stride(2) != 1 or hot_cache.stride(1) * hot_cache.element_size() != row_bytes:
        _fail(op, f"hot_cache strides {hot_cache.stride()}", "hot-cache rows must be contiguous")
    hbs = hot_cache.shape[1]
    hot_rows = hot_cache.shape[0] * hbs
    host_rows = _host_cache(op, host_cache, row_bytes, device)
    hot_table = "hot_block_table must be a 2D int32 CUDA tensor"
    _tensor(op, "hot_block_table", hot_block_table, i32, 2, device,
            {"dtype": hot_table, "ndim": hot_table})
    _row_major(op, "hot_block_table", hot_block_table)
    _plan(op, "hot_indices", hot_indices, R, K, device, vllm={
        "dtype": "global_indices/hot_indices must be int32",
        "shape": "hot_indices must have one contiguous row per launch row",
        "layout": "hot_indices must have one contiguous row per launch row"})
    dgi = "device_global_indices must be contiguous 2D"
    _tensor(op, "device_global_indices", device_global_indices, i32, 2, device,
            {"dtype": "device_global_indices must be int32", "ndim": dgi})
    _contiguous(op, "device_global_indices", device_global_indices, dgi)
    lru = "lru_slots must be contiguous with one row per request state"
    _tensor(op, "lru_slots", lru_slots, torch.int16, 2, device,
            {"dtype": "lru_slots must be int16", "ndim": lru})
    _contiguous(op, "lru_slots", lru_slots, lru)
    S, H = lru_slots.shape
    if device_global_indices.shape[0] != S:
        _fail(op, f"lru_slots has {S} state rows but device_global_indices has "
                  f"{device_global_indices.shape[0]}", lru)
    if H < K:
        _fail(op, f"hot buffer size {H} (lru_slots columns) < top_k {K}",
              "hot buffer size must be >= top_k")
    if H > MAX_HOT_SIZE:
        _fail(op, f"hot buffer size {H} > {MAX_HOT_SIZE}", "hot buffer size must fit int16 slots")
    if region_stride != H:
        _fail(op, f"region_stride {region_stride}, LRU size (lru_slots columns) {H}",
              "region_stride must match the LRU size")
    if device_global_indices.shape[1] != region_stride:
        _fail(op, f"device_global_indices has {device_global_indices.shape[1]} columns, "
                  f"region_stride is {region_stride}",
              "device_global_indices must cover the full hot region")
    if hot_block_table.shape[1] < -(-region_stride // hbs):
        _fail(op, f"hot_block_table has {hot_block_table.shape[1]} columns; {region_stride} "
                  f"slots of {hbs}-row blocks need {-(-region_stride // hbs)}",
              "hot_block_table has too few columns")
    if hot_rows >= _INT32_MAX:
        _fail(op, f"{hot_rows} hot-cache rows", "hot indices must fit int32")
    if (request_ids is None) != (source_block_table is None):
        _fail(op, f"request_ids is {'None' if request_ids is None else 'given'}, "
                  f"source_block_table {'None' if source_block_table is None else 'given'}",
              "request_ids and source_block_table must be provided together")
    need_hot_rows = R
    if source_block_table is not None:
        _per_row(op, "request_ids", request_ids, R, device, vllm="request_ids must be "
                 "contiguous int32 on CUDA with one entry per row")
        source = "source_block_table must be a row-major 2D int32 CUDA tensor"
        _tensor(op, "source_block_table", source_block_table, i32, 2, device,
                {"dtype": source, "ndim": source})
        _row_major(op, "source_block_table", source_block_table, source)
        if source_block_size <= 0:
            _fail(op, f"source_block_size {source_block_size}",
                  "source_block_size must be positive")
        need_hot_rows = source_block_table.shape[0]
    if hot_block_table.shape[0] < need_hot_rows:
        _fail(op, f"hot_block_table has {hot_block_table.shape[0]} rows, needs "
                  f"{need_hot_rows} (one per {'request' if request_ids is not None else 'row'})",
              "hot_block_table has too few rows")
    if resident_block_table is not None:
        if source_block_table is None:
            _fail(op, "resident_block_table given without them",
                  "resident lookup requires request_ids and source_block_table")
        resident = "resident_block_table must be a row-major 2D int32 CUDA tensor"
        _tensor(op, "resident_block_table", resident_block_table, i32, 2, device,
                {"dtype": resident, "ndim": resident})
        _row_major(op, "resident_block_table", resident_block_table, resident)
        if resident_block_size != hbs:
            _fail(op, f"resident block size {resident_block_size}, hot block size {hbs}",
                  "resident and hot block sizes must match")
        if resident_null_block < 0:
            _fail(op, f"resident_null_block {resident_null_block}",
                  "resident null block must be non-negative")
    for name, t, text in (
            ("resolved_global_indices", resolved_global_indices,
             "resolved_global_indices must be contiguous int32 matching indices"),
            ("miss_mask", miss_mask,
             "miss_mask must be a contiguous int32 CUDA tensor matching global_indices")):
        if t is not None:
            _plan(op, name, t, R, K, device, vllm={a: text for a in ("dtype", "ndim", "shape",
                                                                     "layout")})
    if valid_counts is not None:
        counts = "valid_counts must be int32 on CUDA with one entry per row"
        _tensor(op, "valid_counts", valid_counts, i32, 1, device,
                {"dtype": counts, "ndim": counts})
        if valid_counts.shape[0] != R:
            _fail(op, f"valid_counts has {valid_counts.shape[0]} entries for {R} rows", counts)
    swaps = (swap_host_physical_rows, swap_device_physical_rows, swap_counts)
    if any(t is None for t in swaps) != all(t is None for t in swaps):
        _fail(op, "give all of swap_host_physical_rows, swap_device_physical_rows and "
                  "swap_counts, or none", "compact swap tensors must be provided together")
    if swap_counts is not None:
        swap = {a: "compact swaps must be contiguous int32 matching indices"
                for a in ("dtype", "ndim", "shape", "layout")}
        _plan(op, "swap_host_physical_rows", swap_host_physical_rows, R, K, device, vllm=swap)
        _plan(op, "swap_device_physical_rows", swap_device_physical_rows, R, K, device,
              vllm=swap)
        _per_row(op, "swap_counts", swap_counts, R, device, vllm=swap)
    if request_state_indices is not None:
        rsi = "request_state_indices must be contiguous 1D int32 on CUDA"
        _tensor(op, "request_state_indices", request_state_indices, i32, 1, device,
                {"dtype": rsi, "ndim": rsi})
        _contiguous(op, "request_state_indices", request_state_indices, rsi)
    elif S < R:
        _fail(op, f"device_global_indices has {S} rows for {R} rows (no "
                  "request_state_indices)", "device_global_indices has too few rows")
    if stats is not None:
        text = "stats must be a contiguous two-element uint64 CUDA tensor"
        _tensor(op, "stats", stats, torch.uint64, 1, device, {"dtype": text, "ndim": text})
        if stats.shape[0] != 2 or not stats.is_contiguous():
            _fail(op, f"stats has shape {tuple(stats.shape)}, strides {stats.stride()}", text)
    if attention_indices is not None:
        text = "attention_indices must be row-major int32 matching global_indices"
        _plan(op, "attention_indices", attention_indices, R, K, device, row_major_only=True,
              vllm={a: text for a in ("dtype", "ndim", "shape", "layout")})
        if attention_block_stride < hbs:
            _fail(op, f"attention_block_stride {attention_block_stride} < {hbs} rows per hot "
                      "block", "attention block stride must cover one hot block")
    if R and K and not 0 < max_union_rows <= H:
        _fail(op, f"max_union_rows {max_union_rows}, hot_size {H}",
              "max_union_rows must be in [1, hot_size]")
    return ResolveGeometry(R, K, H, S, hbs, host_rows)


class GatherGeometry(NamedTuple):
    """What the gather ops need besides their tensors."""

    num_rows: int
    top_k: int
    hot_block_size: int   # 1 for a 2-D staging buffer
    hot_rows: int
    host_rows: int
    row_bytes: int


def _hot_cache(op: str, hot_cache, device: torch.device, paged_only: bool) -> tuple[int, int, int]:
    """``(hot_block_size, hot_rows, row_bytes)`` of a paged (3-D) or staging (2-D) cache."""
    shape = "hot_cache must be [num_blocks, block_size, row_width]" if paged_only else \
        "hot_cache must be a 2D staging buffer or paged 3D cache"
    _tensor(op, "hot_cache", hot_cache, None, None, device)
    if hot_cache.dim() != 3 and (paged_only or hot_cache.dim() != 2):
        _fail(op, f"hot_cache has shape {tuple(hot_cache.shape)}", shape)
    row_bytes = hot_cache.shape[-1] * hot_cache.element_size()
    if row_bytes % 16:
        _fail(op, f"rows of {row_bytes} B", "KV rows must be 16-byte aligned")
    if hot_cache.stride(-1) != 1 or hot_cache.stride(-2) * hot_cache.element_size() != row_bytes \
            and hot_cache.dim() == 3:
        _fail(op, f"hot_cache strides {hot_cache.stride()}", "hot-cache rows must be contiguous")
    if hot_cache.dim() == 2 and hot_cache.stride(0) * hot_cache.element_size() != row_bytes:
        _fail(op, f"hot_cache strides {hot_cache.stride()}", "hot-cache rows must be contiguous")
    hbs = hot_cache.shape[1] if hot_cache.dim() == 3 else 1
    return hbs, hot_cache.shape[0] * hbs, row_bytes


def check_gather_plan(host_cache, hot_cache, global_indices, hot_indices, miss_mask,
                      request_state_indices, attention_indices,
                      attention_block_stride: int) -> GatherGeometry:
    """Validate ``hisparse_gather_plan``'s arguments."""
    op = "hisparse_gather_plan"
    i32 = torch.int32
    index = "global_indices must be contiguous 2D"
    _tensor(op, "global_indices", global_indices, i32, 2, None,
            {"dtype": "plan tensors must be int32", "ndim": index})
    device = global_indices.device
    _contiguous(op, "global_indices", global_indices, index)
    R, K = global_indices.shape
    match = "hot_indices/miss_mask must match contiguous 2D global_indices"
    for name, t in (("hot_indices", hot_indices), ("miss_mask", miss_mask)):
        _plan(op, name, t, R, K, device, what=" (global_indices)",
              vllm={"dtype": "plan tensors must be int32", "ndim": match, "shape": match,
                    "layout": match})
    hbs, hot_rows, row_bytes = _hot_cache(op, hot_cache, device, paged_only=False)
    host_rows = _host_cache(op, host_cache, row_bytes, device)
    if request_state_indices is not None:
        _per_row(op, "request_state_indices", request_state_indices, R, device, vllm={
            a: "request_state_indices must be int32 on CUDA with one entry per row"
            for a in ("dtype", "shape")})
    if attention_indices is not None:
        text = ("attention_indices must be a contiguous int32 CUDA tensor matching "
                "global_indices")
        _plan(op, "attention_indices", attention_indices, R, K, device,
              vllm={a: text for a in ("dtype", "ndim", "shape", "layout")})
        if R and K and attention_block_stride < hbs:
            _fail(op, f"attention_block_stride {attention_block_stride} < {hbs} rows per hot "
                      "block", "attention block stride must cover one hot block")
    return GatherGeometry(R, K, hbs, hot_rows, host_rows, row_bytes)


def check_gather_compact(host_cache, hot_cache, miss_global_indices, miss_hot_indices,
                         miss_counts) -> GatherGeometry:
    """Validate ``hisparse_gather_compact``'s arguments."""
    op = "hisparse_gather_compact"
    i32 = torch.int32
    plan = {a: "compact miss plan must be matching contiguous int32 CUDA tensors"
            for a in ("dtype", "ndim", "shape", "layout")}
    _tensor(op, "miss_global_indices", miss_global_indices, i32, 2, None, plan)
    device = miss_global_indices.device
    _contiguous(op, "miss_global_indices", miss_global_indices, plan)
    R, K = miss_global_indices.shape
    _plan(op, "miss_hot_indices", miss_hot_indices, R, K, device,
          what=" (miss_global_indices)", vllm=plan)
    _per_row(op, "miss_counts", miss_counts, R, device, vllm=plan)
    hbs, hot_rows, row_bytes = _hot_cache(op, hot_cache, device, paged_only=True)
    host_rows = _host_cache(op, host_cache, row_bytes, device)
    return GatherGeometry(R, K, hbs, hot_rows, host_rows, row_bytes)


def check_invalidate_written_slots(device_global_indices, request_state_indices,
                                   req_id_per_token, written_slots) -> int:
    """Validate ``hisparse_invalidate_written_slots``'s arguments; returns the token count."""
    op = "hisparse_invalidate_written_slots"
    same = "HiSparse invalidation tensors must be on the same CUDA device"
    text = "device_global_indices must be a contiguous 2D int32 CUDA tensor"
    _tensor(op, "device_global_indices", device_global_indices, torch.int32, 2, None,
            {"dtype": text, "ndim": text})
    device = device_global_indices.device
    _contiguous(op, "device_global_indices", device_global_indices, text)
    for name, t, dtype, kind in (
            ("request_state_indices", request_state_indices, torch.int32, "int32"),
            ("req_id_per_token", req_id_per_token, torch.int32, "int32"),
            ("written_slots", written_slots, torch.int64, "int64")):
        text = f"{name} must be a contiguous 1D {kind} CUDA tensor"
        vllm = {"dtype": text, "ndim": text, "layout": text, "device": same}
        _tensor(op, name, t, dtype, 1, device, vllm)
        _contiguous(op, name, t, vllm)
    if req_id_per_token.numel() != written_slots.numel():
        _fail(op, f"req_id_per_token has {req_id_per_token.numel()} entries, written_slots "
                  f"{written_slots.numel()}",
              "req_id_per_token and written_slots must have equal length")
    if written_slots.numel() > _INT32_MAX:
        _fail(op, f"{written_slots.numel()} tokens",
              "HiSparse invalidation grid exceeds CUDA limits")
    return written_slots.numel()


_UPCONVERT = "cp_gather_and_upconvert_fp8_kv_cache"


def check_upconvert_addresses(src_cache: Tensor, dst: Tensor) -> None:
    """The FP8 gather reads 4-byte scale words and writes 4-byte-aligned rows."""
    if src_cache.data_ptr() % 4 or dst.data_ptr() % 4:
        _fail(_UPCONVERT,
              f"src_cache (0x{src_cache.data_ptr():x}) and dst (0x{dst.data_ptr():x}) must be "
              "4-byte aligned")


class UpconvertGeometry(NamedTuple):
    """What ``cp_gather_and_upconvert_fp8_kv_cache`` needs besides its tensors."""

    total_tokens: int
    batch_size: int
    block_size: int
    cache_rows: int       # rows of src_cache (num_blocks * block_size)
    host_rows: int        # rows of host_cache (0 without it)
    num_mapped: int       # entries of host_row_ids (0 without host rows)


def check_upconvert(src_cache, dst, block_table, workspace_starts, batch_size: int,
                    seq_starts, host_cache, host_row_ids, device_row_ids) -> UpconvertGeometry:
    """Validate ``cp_gather_and_upconvert_fp8_kv_cache``'s arguments."""
    op = _UPCONVERT
    i32 = torch.int32
    _tensor(op, "block_table", block_table, i32, 2, None, {"dtype": "block_table must be int32"})
    device = block_table.device
    _row_major(op, "block_table", block_table)
    _tensor(op, "src_cache", src_cache, None, 3, device,
            {"device": "src_cache and block_table must be on the same device"})
    if src_cache.dtype not in _FP8_CACHE_DTYPES:
        _fail(op, f"got {src_cache.dtype}",
              "src_cache must be uint8, float8_e4m3fn, or float8_e5m2")
    if src_cache.shape[2] != FP8_ROW_BYTES or src_cache.stride(2) != 1:
        _fail(op, f"src_cache must be [num_blocks, block_size, {FP8_ROW_BYTES}] with "
                  f"contiguous rows, got shape {tuple(src_cache.shape)} strides "
                  f"{src_cache.stride()}")
    if src_cache.stride(0) % 4 or src_cache.stride(1) % 4:
        _fail(op, f"src_cache rows must be 4-byte aligned, got strides {src_cache.stride()}")
    check_upconvert_addresses(src_cache, dst)
    _tensor(op, "dst", dst, torch.bfloat16, 2, device,
            {"dtype": "dst must be bfloat16",
             "device": "src_cache and dst must be on the same device"})
    if dst.shape[1] != FP8_HEAD_DIM:
        _fail(op, f"dst rows hold {dst.shape[1]} values, not {FP8_HEAD_DIM}",
              "head_dim must be 576 for MLA")
    if dst.shape[0] and (dst.stride(1) != 1 or dst.stride(0) % 2):
        _fail(op, f"dst rows must be contiguous and 4-byte aligned, got strides {dst.stride()}")
    _per_row(op, "workspace_starts", workspace_starts, 0, device, vllm={
        "dtype": "workspace_starts must be int32",
        "device": "src_cache and workspace_starts must be on the same device"})
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 0:
        _fail(op, f"batch_size must be a non-negative int, got {batch_size!r}")
    if batch_size > workspace_starts.numel() or batch_size > block_table.shape[0]:
        _fail(op, f"batch_size {batch_size} exceeds workspace_starts "
                  f"({workspace_starts.numel()} entries) or block_table "
                  f"({block_table.shape[0]} rows)")
    if seq_starts is not None:
        _per_row(op, "seq_starts", seq_starts, batch_size, device, "requests (batch_size)",
                 vllm={"dtype": "seq_starts must be int32",
                       "device": "src_cache and seq_starts must be on the same device"})
    if (host_cache is None) != (host_row_ids is None):
        _fail(op, "host_cache and host_row_ids must be provided together")
    if device_row_ids is not None and host_row_ids is None:
        _fail(op, "device_row_ids needs host_cache and host_row_ids")
    host_rows = num_mapped = 0
    if host_cache is not None:
        host_rows = _host_cache(op, host_cache, FP8_ROW_BYTES, device, vllm=False)
        if host_cache.element_size() != 1:
            _fail(op, f"host_cache must hold bytes (uint8 / fp8), got {host_cache.dtype}")
        _per_row(op, "host_row_ids", host_row_ids, 0, device)
        num_mapped = host_row_ids.numel()
        if device_row_ids is not None:
            _per_row(op, "device_row_ids", device_row_ids, 0, device)
            if device_row_ids.numel() != num_mapped:
                _fail(op, f"device_row_ids has {device_row_ids.numel()} entries, host_row_ids "
                          f"{num_mapped}")
    return UpconvertGeometry(dst.shape[0], batch_size, src_cache.shape[1],
                             src_cache.shape[0] * src_cache.shape[1], host_rows, num_mapped)
