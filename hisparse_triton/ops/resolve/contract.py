"""The ``resolve`` contract: its result type and its argument rules.

Shared by every implementation of the op (the torch reference, the Triton launcher, the
registered custom op), so that all of them accept and reject exactly the same inputs with
the same messages. Nothing here computes a result or reads a tensor value.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from hisparse_triton.ops.resolve.workspace import ResolveWorkspace
from hisparse_triton.tuning import MAX_RESOLVE_WIDTH

__all__ = ["ResolveResult", "TOPK_DTYPES", "check_resolve_args", "check_resolve_extras",
           "check_rows_out"]


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


def check_resolve_args(
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
        check_resolve_extras(R, K, H, device, counters, out, workspace)
    return R, K, S, P, HB, H


def _explain_resolve_args(*args) -> tuple[int, int, int, int, int, int]:
    """``check_resolve_args`` one rule at a time: raises naming the first bad value (or
    accepts what the fast path refused only for a harmless reason, e.g. a size-1 stride-0
    dimension). ``args``: ``check_resolve_args``'s, all positional."""
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
        check_resolve_extras(R, K, H, device, counters, out, workspace)
    return R, K, S, P, HB, H


def check_rows_out(op: str, out: object, R: int, K: int, device: torch.device) -> None:
    """An op's ``out=`` argument: a writable int32 ``[R, K]`` tensor on ``device``
    (``ValueError`` naming ``op`` otherwise)."""
    if not isinstance(out, torch.Tensor) or out.dtype != torch.int32 \
            or tuple(out.shape) != (R, K):
        raise ValueError(f"{op}: out must be an int32 tensor [{R}, {K}], got "
                         f"{getattr(out, 'dtype', type(out).__name__)} of shape "
                         f"{tuple(getattr(out, 'shape', ()))}")
    if out.device != device:
        raise ValueError(f"{op}: out is on {out.device} but topk is on {device}")
    if any(stride == 0 and size > 1 for stride, size in zip(out.stride(), out.shape)):
        raise ValueError(f"{op}: out is written and must not have a stride-0 (expanded) "
                         f"dimension, got strides {out.stride()}")


def check_resolve_extras(R: int, K: int, H: int, device: torch.device,
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
        check_rows_out("resolve", out, R, K, device)
    if workspace is not None:
        if not isinstance(workspace, ResolveWorkspace):
            raise TypeError(f"resolve: workspace must be a ResolveWorkspace, got "
                            f"{type(workspace).__name__}")
        if workspace.device != device:
            raise ValueError(f"resolve: the workspace is on {workspace.device} but topk is on "
                             f"{device}")
