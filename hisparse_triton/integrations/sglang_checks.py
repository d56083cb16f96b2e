"""Argument checks of SGLang 0.5.23's HiSparse swap-in and plan replay (both backends).

``check_swap_in`` validates the arguments of ``load_cache_to_device_buffer_mla`` and
``check_copy_planned`` those of ``copy_cache_planned_mla`` (SGLang's names and argument
conventions, ``hisparse_triton.integrations.sglang``); each returns the geometry both backends
need. They read no tensor values (no device sync), so a call that passes them can be captured
in a CUDA graph. The rules are the ones SGLang's own wrappers assert (``hot_buffer_size >=
num_top_k``, the miss-plan dtypes), plus the ones SGLang's CUDA kernel assumes without checking
and that keep every access inside the tensors: the shapes every index reaches, one device for
all index tensors, and contiguous KV pools (rows are addressed as ``loc * item_size_bytes``
bytes from the pool's start, as SGLang's kernel does). A failed check raises ``TypeError`` /
``ValueError`` naming the argument and changes nothing.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
from torch import Tensor

__all__ = ["CopyGeometry", "MAX_HOT_BUFFER", "MAX_TOP_K", "SwapInGeometry",
           "check_copy_planned", "check_swap_in"]

#: Largest hot buffer: LRU entries are int16 slot numbers.
MAX_HOT_BUFFER = 32767
#: Largest ``num_top_k`` the Triton resolve sorts in one ``tl.sort`` (DeepSeek-V3.2 / GLM-5
#: select 2,048); larger ones run on SGLang's own kernel (the torch model has no limit).
MAX_TOP_K = 2048
_INDEX_DTYPES = (torch.int32, torch.int64)


def _fail(op: str, message: str, kind: type = ValueError) -> None:
    raise kind(f"{op}: {message}")


def _tensor(op: str, name: str, t, dtypes: tuple[torch.dtype, ...], ndim: Optional[int],
            device: Optional[torch.device]) -> Tensor:
    if not isinstance(t, Tensor):
        _fail(op, f"{name} must be a torch.Tensor, got {type(t).__name__}", TypeError)
    if dtypes and t.dtype not in dtypes:
        want = " or ".join(str(d) for d in dtypes)
        _fail(op, f"{name} must be {want}, got {t.dtype}", TypeError)
    if ndim is not None and t.dim() != ndim:
        _fail(op, f"{name} must be {ndim}-D, got shape {tuple(t.shape)}")
    if device is not None and t.device != device:
        _fail(op, f"{name} is on {t.device} but top_k_tokens is on {device}; the index "
                  "tensors must all be on one device")
    return t


def _at_least(op: str, name: str, t: Tensor, rows: int, cols: int, what: str) -> None:
    if t.shape[0] < rows or t.shape[1] < cols:
        _fail(op, f"{name} has shape {tuple(t.shape)}; it needs at least {rows} rows and "
                  f"{cols} columns ({what})")


def _int(op: str, name: str, value, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        _fail(op, f"{name} must be an int, got {type(value).__name__}", TypeError)
    if value < minimum:
        _fail(op, f"{name} must be >= {minimum}, got {value}")
    return value


def _pool(op: str, name: str, pool, item_size_bytes: int, device: torch.device,
          host: bool) -> int:
    """A contiguous KV pool addressed in rows of ``item_size_bytes``; returns its rows."""
    _tensor(op, name, pool, (), None, None)
    if pool.device != device and not (host and pool.device.type == "cpu"):
        where = "the CPU (pinned, for a CUDA kernel) or " if host else ""
        _fail(op, f"{name} is on {pool.device}; it must be on {where}{device}")
    if not pool.is_contiguous():
        _fail(op, f"{name} must be contiguous (rows are addressed as loc * item_size_bytes "
                  f"from its start), got shape {tuple(pool.shape)} strides {pool.stride()}")
    return pool.numel() * pool.element_size() // item_size_bytes


def _plan(op: str, miss_src, miss_dst, miss_count, rows: int, cols: int,
          device: torch.device, what: str) -> None:
    _tensor(op, "miss_src", miss_src, (torch.int64,), 2, device)
    _tensor(op, "miss_dst", miss_dst, (torch.int32,), 2, device)
    _tensor(op, "miss_count", miss_count, (torch.int32,), 1, device)
    _at_least(op, "miss_src", miss_src, rows, cols, what)
    _at_least(op, "miss_dst", miss_dst, rows, cols, what)
    if miss_count.numel() < rows:
        _fail(op, f"miss_count has {miss_count.numel()} entries for {rows} rows")


class SwapInGeometry(NamedTuple):
    """What ``load_cache_to_device_buffer_mla`` needs besides its tensors (host-side ints)."""

    batch: int          # rows of top_k_tokens (CUDA-graph padding rows included)
    top_k: int          # num_top_k: columns read / written per row
    hot: int            # hot_buffer_size: LRU slots per request; slot ``hot`` is the newest
    states: int         # request-pool rows every state table has
    width: int          # columns of device_buffer_tokens / device_buffer_locs
    context: int        # columns of host_cache_locs (positions with a host location)
    host_rows: int      # rows of item_size_bytes in host_cache
    device_rows: int    # rows of item_size_bytes in device_buffer
    plan: bool          # the caller records the miss plan (miss_src / miss_dst / miss_count)


def check_swap_in(top_k_tokens, device_buffer_tokens, host_cache_locs, device_buffer_locs,
                  host_cache, device_buffer, top_k_device_locs, req_pool_indices, seq_lens,
                  lru_slots, item_size_bytes, num_top_k, hot_buffer_size, num_real_reqs,
                  miss_src, miss_dst, miss_count) -> SwapInGeometry:
    """Check ``load_cache_to_device_buffer_mla``'s arguments (see the module docstring)."""
    op = "load_cache_to_device_buffer_mla"
    _tensor(op, "top_k_tokens", top_k_tokens, (torch.int32,), 2, None)
    device = top_k_tokens.device
    K = _int(op, "num_top_k", num_top_k, 1)
    H = _int(op, "hot_buffer_size", hot_buffer_size, 1)
    if H < K:
        _fail(op, f"hot_buffer_size ({H}) must be >= num_top_k ({K})")
    if H > MAX_HOT_BUFFER:
        _fail(op, f"hot_buffer_size {H} is over {MAX_HOT_BUFFER} (lru_slots are int16)")
    item = _int(op, "item_size_bytes", item_size_bytes, 1)
    bs = top_k_tokens.shape[0]
    if top_k_tokens.shape[1] < K:
        _fail(op, f"top_k_tokens has {top_k_tokens.shape[1]} columns for num_top_k={K}")
    _tensor(op, "top_k_device_locs", top_k_device_locs, (torch.int32,), 2, device)
    _at_least(op, "top_k_device_locs", top_k_device_locs, bs, K, "one row per top-k row")
    _tensor(op, "device_buffer_tokens", device_buffer_tokens, (torch.int32,), 2, device)
    _tensor(op, "device_buffer_locs", device_buffer_locs, (torch.int32,), 2, device)
    if device_buffer_locs.shape != device_buffer_tokens.shape:
        _fail(op, f"device_buffer_locs has shape {tuple(device_buffer_locs.shape)} but "
                  f"device_buffer_tokens has {tuple(device_buffer_tokens.shape)}")
    width = device_buffer_tokens.shape[1]
    if width < H + 1:
        _fail(op, f"device_buffer_tokens has {width} columns; it needs hot_buffer_size + 1 = "
                  f"{H + 1} (slot {H} holds the newest token)")
    _tensor(op, "host_cache_locs", host_cache_locs, (torch.int64,), 2, device)
    _tensor(op, "lru_slots", lru_slots, (torch.int16,), 2, device)
    if lru_slots.shape[1] < H:
        _fail(op, f"lru_slots has {lru_slots.shape[1]} columns for hot_buffer_size={H}")
    for name, t in (("req_pool_indices", req_pool_indices), ("seq_lens", seq_lens)):
        _tensor(op, name, t, _INDEX_DTYPES, 1, device)
        if t.numel() < bs:
            _fail(op, f"{name} has {t.numel()} entries for {bs} rows of top_k_tokens")
    if num_real_reqs is not None:
        _tensor(op, "num_real_reqs", num_real_reqs, (torch.int32,), None, device)
        if num_real_reqs.numel() < 1:
            _fail(op, "num_real_reqs is empty; it holds the number of real rows")
    plan = miss_src is not None
    if plan:
        if miss_dst is None or miss_count is None:
            _fail(op, "miss_src, miss_dst and miss_count must be given together")
        _plan(op, miss_src, miss_dst, miss_count, bs, K, device, "one row per top-k row, "
              "num_top_k columns")
    elif miss_dst is not None or miss_count is not None:
        _fail(op, "miss_src, miss_dst and miss_count must be given together")
    host_rows = _pool(op, "host_cache", host_cache, item, device, host=True)
    device_rows = _pool(op, "device_buffer", device_buffer, item, device, host=False)
    states = min(device_buffer_tokens.shape[0], host_cache_locs.shape[0], lru_slots.shape[0])
    return SwapInGeometry(bs, K, H, states, width, host_cache_locs.shape[1], host_rows,
                          device_rows, plan)


class CopyGeometry(NamedTuple):
    """What ``copy_cache_planned_mla`` needs besides its tensors (host-side ints)."""

    rows: int           # plan rows (requests of the step, padding included)
    columns: int        # plan columns (the most misses one row can list)
    host_rows: int
    device_rows: int


def check_copy_planned(miss_src, miss_dst, miss_count, num_real_reqs, host_cache,
                       device_buffer, item_size_bytes) -> CopyGeometry:
    """Check ``copy_cache_planned_mla``'s arguments (see the module docstring)."""
    op = "copy_cache_planned_mla"
    _tensor(op, "miss_src", miss_src, (torch.int64,), 2, None)
    device = miss_src.device
    item = _int(op, "item_size_bytes", item_size_bytes, 1)
    _tensor(op, "miss_dst", miss_dst, (torch.int32,), 2, device)
    _tensor(op, "miss_count", miss_count, (torch.int32,), 1, device)
    rows = min(miss_src.shape[0], miss_dst.shape[0], miss_count.numel())
    columns = min(miss_src.shape[1], miss_dst.shape[1])
    _tensor(op, "num_real_reqs", num_real_reqs, (torch.int32,), None, device)
    if num_real_reqs.numel() < 1:
        _fail(op, "num_real_reqs is empty; it holds the number of real rows")
    host_rows = _pool(op, "host_cache", host_cache, item, device, host=True)
    device_rows = _pool(op, "device_buffer", device_buffer, item, device, host=False)
    return CopyGeometry(rows, columns, host_rows, device_rows)
