"""The ``plan_prefill`` contract: its result type and its argument rules.

Shared by every implementation of the op (the torch reference, the Triton launcher, the
registered custom op), so that all of them accept and reject exactly the same inputs with
the same messages. Nothing here computes a result or reads a tensor value.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from hisparse_triton.ops.prefill.workspace import PrefillWorkspace
from hisparse_triton.ops.resolve.contract import TOPK_DTYPES, check_rows_out

__all__ = ["PrefillPlan", "check_prefill_args"]

_INT32_MAX = 2**31 - 1
_TOPK_DTYPE_SET = frozenset(TOPK_DTYPES)


class PrefillPlan(NamedTuple):
    """What ``plan_prefill`` returns for a chunk of ``T`` query tokens of ``K`` selections,
    against a staging region of ``C`` rows.

    - ``rows``: ``[T, K] int32`` device rows for the attention kernel: a resident row, a
      staging row's (``dst_rows[0, rank]``) or -1 (masked, or beyond the region).
    - ``src_rows``: ``[1, C] int32`` host row staged into staging row ``i`` for
      ``i < staged``; -1 after (the gather's source plan).
    - ``dst_rows``: ``[1, C] int32`` the device row of staging row ``i``:
      ``staging_first_row + i``, or a workspace's map (``PrefillWorkspace.map_staging``)
      (the gather's destinations).
    - ``staged``: ``[1] int32`` rows to copy: ``min(needed, C)`` (the gather's count).
    - ``needed``: ``[1] int32`` distinct host-only rows the chunk references; the chunk
      fits the region when ``needed <= C``.
    """

    rows: torch.Tensor
    src_rows: torch.Tensor
    dst_rows: torch.Tensor
    staged: torch.Tensor
    needed: torch.Tensor


#: ``plan_prefill``'s tensor arguments and their ranks, in order.
_TENSORS = (("topk", 2), ("state_rows", 1), ("seq_lens", 1), ("resident_blocks", 2),
            ("host_blocks", 2))


def check_prefill_args(
    topk: torch.Tensor,
    state_rows: torch.Tensor,
    seq_lens: torch.Tensor,
    resident_blocks: torch.Tensor,
    host_blocks: torch.Tensor,
    block_size: int,
    num_device_blocks: int,
    num_host_blocks: int,
    staging_first_row: int,
    staging_rows: int,
    out: Optional[torch.Tensor] = None,
    workspace: Optional[PrefillWorkspace] = None,
) -> tuple[int, int, int, int]:
    """Validate ``plan_prefill``'s arguments (shapes, dtypes, devices, sizes; never tensor
    values). Returns ``(T, K, S, P)``; raises ``TypeError`` / ``ValueError`` naming the bad
    value."""
    tensors = (topk, state_rows, seq_lens, resident_blocks, host_blocks)
    device = None
    shapes = []
    for (name, ndim), t in zip(_TENSORS, tensors):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"plan_prefill: {name} must be a torch.Tensor, got "
                            f"{type(t).__name__}")
        if name == "topk":
            if t.dtype not in _TOPK_DTYPE_SET:
                raise TypeError(f"plan_prefill: topk must be an integer tensor (int8 ... "
                                f"int64, uint8 ... uint64), got {t.dtype}")
        elif t.dtype is not torch.int32:
            raise TypeError(f"plan_prefill: {name} must be int32, got {t.dtype}")
        if t.dim() != ndim:
            raise ValueError(f"plan_prefill: {name} must be {ndim}-D, got shape "
                             f"{tuple(t.shape)}")
        if device is None:
            device = t.device
        elif t.device != device:
            raise ValueError(f"plan_prefill: {name} is on {t.device} but topk is on {device}; "
                             "all tensors must be on one device")
        shapes.append(tuple(t.shape))
    T, K = shapes[0]
    S, P = shapes[3]
    if K < 1:
        raise ValueError(f"plan_prefill: topk must have at least one column, got shape "
                         f"{shapes[0]}")
    expect = ((T,), (S,), (S, P), (S, P))
    for (name, _), shape, want in zip(_TENSORS[1:], shapes[1:], expect):
        if shape != want:
            raise ValueError(f"plan_prefill: {name} has shape {shape}, expected {want} "
                             f"(T={T}, K={K}, S={S}, P={P})")
    for name, v, low in (("block_size", block_size, 1),
                         ("num_device_blocks", num_device_blocks, 1),
                         ("num_host_blocks", num_host_blocks, 1),
                         ("staging_first_row", staging_first_row, 0),
                         ("staging_rows", staging_rows, 0)):
        if isinstance(v, bool) or not isinstance(v, int) or v < low:
            raise ValueError(f"plan_prefill: {name} must be an int >= {low}, got {v!r}")
    for name, v in (("num_device_blocks", num_device_blocks),
                    ("num_host_blocks", num_host_blocks)):
        if v * block_size > _INT32_MAX:
            raise ValueError(f"plan_prefill: {name} * block_size = {v * block_size} row ids "
                             "do not fit int32")
    device_rows = num_device_blocks * block_size
    if staging_first_row + staging_rows > device_rows:
        raise ValueError(f"plan_prefill: staging rows [{staging_first_row}, "
                         f"{staging_first_row + staging_rows}) lie outside the "
                         f"{device_rows} device rows")
    if out is not None:
        check_rows_out("plan_prefill", out, T, K, device)
    if workspace is not None:
        if not isinstance(workspace, PrefillWorkspace):
            raise TypeError(f"plan_prefill: workspace must be a PrefillWorkspace, got "
                            f"{type(workspace).__name__}")
        if not workspace.matches(num_host_blocks * block_size, staging_rows,
                                 staging_first_row, device):
            raise ValueError(f"plan_prefill: {workspace!r} was not built for "
                             f"num_host_rows={num_host_blocks * block_size}, capacity_rows="
                             f"{staging_rows}, first_row={staging_first_row} on {device}")
    return T, K, S, P
