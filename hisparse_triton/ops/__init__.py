"""Public ops (``resolve``, ``copy_rows``, ``copy_pages``) and their backend dispatch.

Also re-exported here: ``ResolveWorkspace`` (reusable outputs and scratch of ``resolve``) and
``restore_resolve_state`` (undo the last ``resolve`` made with a workspace).

Each op has the signature of its contract in ``hisparse_triton.reference`` plus a keyword
``backend``:

- ``"auto"``: the Triton kernels when the op's tensors are on CUDA, the torch reference
  otherwise;
- ``"triton"``: the Triton kernels; on CPU tensors only under ``TRITON_INTERPRET=1`` (the
  interpreter, for tests), else ``BackendUnavailableError`` (never a silent fallback);
- ``"torch"``: the reference (``reference.py``) on whatever device the tensors are;
- ``None``: ``$HISPARSE_TRITON_BACKEND`` (read at every call), default ``"auto"``.

The op's device is the device of its index tensors (``topk``; ``src_rows`` / ``src_blocks``):
the device the kernels run on. Pools may be elsewhere (a pinned CPU host pool on CUDA).

The ops are also registered as ``torch.library`` custom ops under the ``hisparse_triton``
namespace (``torch.ops.hisparse_triton.{resolve,copy_rows,copy_pages}``): CPU kernel = the
reference, CUDA kernel = Triton, fake kernels for ``torch.compile`` (fixed output shapes; the
copy ops declare the destination pool mutated, ``resolve`` declares ``slot_host_rows`` and
``lru`` mutated). Custom ops take tensors and scalars only, so a ``RowTable`` travels flattened
as ``(pool, offsets, row_bytes, block_size, block_stride, num_rows)`` with ``offsets`` a list of
ints (the table's own copy: the op rebuilds the table without reading a device tensor).

Eager calls (plain tensors, no ``torch.compile`` / export tracing, no dispatch mode) skip the
``torch.library`` dispatch and call the chosen implementation directly: the custom-op layer
costs tens of microseconds of host time per call (argument defaults, autograd and
ADInplaceOrView wrappers), more than a Triton launch. Traced calls go through the registered
op so that ``torch.compile`` sees one opaque node. There, ``torch`` runs the registered op only
when every tensor is on the CPU (the op's CUDA kernel is Triton: a CPU plan over a CUDA pool
would reach it) and calls the reference directly otherwise; ``triton`` on CPU (the
interpreter) calls the kernel launcher directly.

``validate_table`` checks a table for a device (alignment, pinning for a CUDA kernel); the
kernels do it on first use otherwise. A ``RowTable`` checks its layers against its pool when
it is built, from its own copy of the offsets.
"""

from __future__ import annotations

import os
from typing import Optional

import torch
from torch import Tensor

from hisparse_triton.ops.copy import contract as copy_contract
from hisparse_triton.ops.copy import reference as copy_reference
from hisparse_triton.ops.resolve import reference
from hisparse_triton.ops.resolve.contract import ResolveResult, check_resolve_extras
from hisparse_triton.ops.resolve.workspace import ResolveWorkspace, restore_resolve_state
from hisparse_triton.row_table import RowTable

__all__ = ["BACKENDS", "ENV_VAR", "BackendUnavailableError", "ResolveWorkspace", "copy_pages",
           "copy_rows", "resolve", "restore_resolve_state", "select_backend", "validate_table"]

#: Accepted ``backend`` values.
BACKENDS = ("auto", "triton", "torch")
#: Environment variable read when ``backend`` is None.
ENV_VAR = "HISPARSE_TRITON_BACKEND"


class BackendUnavailableError(RuntimeError):
    """The Triton backend was asked for where it cannot run (CPU tensors, no interpreter)."""


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def select_backend(backend: Optional[str], device: torch.device) -> str:
    """``"triton"`` or ``"torch"``: what ``backend`` (or ``$HISPARSE_TRITON_BACKEND``) means
    for tensors on ``device``; raises ``ValueError`` for an unknown name and
    ``BackendUnavailableError`` for ``"triton"`` on CPU without ``TRITON_INTERPRET=1``."""
    return _choose(backend, device.type == "cuda", device)


def _choose(backend: Optional[str], on_cuda: bool, device) -> str:
    """``select_backend`` given whether the op's tensors are on CUDA (``device`` only names
    them in the error)."""
    name = backend if backend is not None else os.environ.get(ENV_VAR) or "auto"
    if name == "torch":
        return "torch"
    if name not in BACKENDS:
        source = "backend" if backend is not None else f"${ENV_VAR}"
        raise ValueError(f"{source}={name!r} is not a backend; expected one of "
                         f"{', '.join(BACKENDS)}.")
    if on_cuda:
        return "triton"
    if name == "auto":
        return "torch"
    if _interpreting():
        return "triton"
    raise BackendUnavailableError(
        f"backend 'triton' needs CUDA tensors (got tensors on {device}) or TRITON_INTERPRET=1 "
        f"(the Triton interpreter); use backend='torch' or 'auto' on this machine.")


def validate_table(table: RowTable, device: Optional[torch.device | str] = None) -> int:
    """Check ``table`` for kernels on ``device``: a CPU pool used by a CUDA kernel must be
    pinned (checked once per pool). Returns the power-of-two alignment (<= 16 B) of its layer
    offsets. Raises ``ValueError`` on a bad table (the layers were checked against the pool
    when the table was built)."""
    alignment = copy_contract.table_alignment(table)
    if device is not None and torch.device(device).type == "cuda":
        from hisparse_triton.kernels.gather import validate_pool

        validate_pool(table.pool, torch.device(device))
    return alignment


# ------------------------------------------------------------------ copy_rows / copy_pages


def _flat(table: RowTable) -> tuple[Tensor, list[int], int, int, int, int]:
    return (table.pool, list(table.offsets), table.row_bytes, table.block_size,
            table.block_stride, table.num_rows)


def _copy_launcher(pages: bool, dst: RowTable, src: RowTable):
    """The typed Triton launcher of this direction: device -> host (into a CPU pool from a
    device pool) is ``backup``/``spill``, anything else ``gather``/``restore``."""
    backup, gather = _kernel_modules()
    if dst.pool.is_cpu and not src.pool.is_cpu:
        return backup.spill_pages if pages else backup.backup_rows
    return gather.restore_pages if pages else gather.gather_rows


_KERNELS: list = []


def _kernel_modules():
    """``(kernels.backup, kernels.gather)``, imported on first use (Triton is imported lazily:
    the torch backend never needs it)."""
    if not _KERNELS:
        from hisparse_triton.kernels import backup, gather

        _KERNELS.extend((backup, gather))
    return _KERNELS


def _define_copy_op(name: str, pages: bool):
    """Register ``hisparse_triton::<name>`` (CPU: reference, CUDA: Triton, fake: no-op)."""
    reference_fn = copy_reference.copy_pages if pages else copy_reference.copy_rows

    @torch.library.custom_op(f"hisparse_triton::{name}", mutates_args=("dst_pool",),
                             device_types="cpu")
    def op(dst_pool: Tensor, dst_layer_offsets: list[int], dst_row_bytes: int,
           dst_block_size: int, dst_block_stride: int, dst_num_rows: int,
           src_pool: Tensor, src_layer_offsets: list[int], src_row_bytes: int,
           src_block_size: int, src_block_stride: int, src_num_rows: int,
           src_ids: Tensor, dst_ids: Tensor, counts: Optional[Tensor]) -> None:
        dst = RowTable(dst_pool, dst_layer_offsets, dst_row_bytes, dst_block_size,
                       dst_block_stride, dst_num_rows, device=src_ids.device)
        src = RowTable(src_pool, src_layer_offsets, src_row_bytes, src_block_size,
                       src_block_stride, src_num_rows, device=src_ids.device)
        reference_fn(dst, src, src_ids, dst_ids, counts)

    @op.register_kernel("cuda")
    def _cuda(dst_pool, dst_layer_offsets, dst_row_bytes, dst_block_size, dst_block_stride,
              dst_num_rows, src_pool, src_layer_offsets, src_row_bytes, src_block_size,
              src_block_stride, src_num_rows, src_ids, dst_ids, counts):
        dst = RowTable(dst_pool, dst_layer_offsets, dst_row_bytes, dst_block_size,
                       dst_block_stride, dst_num_rows, device=src_ids.device)
        src = RowTable(src_pool, src_layer_offsets, src_row_bytes, src_block_size,
                       src_block_stride, src_num_rows, device=src_ids.device)
        _copy_launcher(pages, dst, src)(dst, src, src_ids, dst_ids, counts)

    @op.register_fake
    def _fake(*args) -> None:
        return None

    return op


copy_rows_op = _define_copy_op("copy_rows", pages=False)
copy_pages_op = _define_copy_op("copy_pages", pages=True)


def _eager(tensors: tuple[Optional[Tensor], ...]) -> bool:
    """True when a call may skip the ``torch.library`` dispatch: not being traced by
    ``torch.compile`` / export, only plain tensors (no fake / functional subclasses) and no
    ``TorchDispatchMode`` active."""
    if torch.compiler.is_compiling():
        return False
    for t in tensors:
        if t is not None and type(t) is not Tensor:
            return False
    return _current_dispatch_mode() is None


try:
    from torch.utils._python_dispatch import _get_current_dispatch_mode
except ImportError:  # pragma: no cover - very old torch
    def _get_current_dispatch_mode():
        return None


def is_eager(tensors: tuple[Optional[Tensor], ...]) -> bool:
    """Whether a call on ``tensors`` may bypass the ``torch.library`` dispatch (no tracing,
    plain tensors, no dispatch mode): callers that launch kernels directly check this."""
    return _eager(tensors)


def _current_dispatch_mode():
    return _get_current_dispatch_mode()


def _all_cpu(tensors: tuple[Optional[Tensor], ...]) -> bool:
    return all(t is None or t.device.type == "cpu" for t in tensors)


def _copy(op, pages: bool, dst: RowTable, src: RowTable, src_ids: Tensor, dst_ids: Tensor,
          counts: Optional[Tensor], backend: Optional[str]) -> None:
    choice = _choose(backend, src_ids.is_cuda, src_ids.device)
    tensors = (dst.pool, src.pool, src_ids, dst_ids, counts)
    if choice == "torch" and (_eager(tensors) or not _all_cpu(tensors)):
        (copy_reference.copy_pages if pages else copy_reference.copy_rows)(dst, src, src_ids,
                                                                           dst_ids, counts)
    elif choice == "triton" and (_eager(tensors) or not src_ids.is_cuda):
        _copy_launcher(pages, dst, src)(dst, src, src_ids, dst_ids, counts)
    else:  # traced: the registered op (CPU: reference, CUDA: Triton)
        op(*_flat(dst), *_flat(src), src_ids, dst_ids, counts)


def copy_rows(dst: RowTable, src: RowTable, src_rows: Tensor, dst_rows: Tensor,
              counts: Optional[Tensor] = None, *, backend: Optional[str] = None) -> None:
    """Copy rows of every layer from ``src`` to ``dst`` (gather H2D, write-through D2H).

    ``src_rows``/``dst_rows``: ``[R, K]`` or ``[L, R, K] int32``; ``counts``: ``[R] int32`` or
    None (all columns). A source row out of range copies zeros, a destination row out of
    range is skipped (``reference.copy_rows``). One launch for all layers on Triton.
    """
    _copy(copy_rows_op, False, dst, src, src_rows, dst_rows, counts, backend)


def copy_pages(dst: RowTable, src: RowTable, src_blocks: Tensor, dst_blocks: Tensor,
               counts: Optional[Tensor] = None, *, backend: Optional[str] = None) -> None:
    """Copy whole blocks of every layer (restore H2D, spill D2H): ``reference.copy_pages``.

    ``src_blocks``/``dst_blocks``: ``[R, K]`` or ``[L, R, K] int32`` block ids; ``counts``:
    ``[R] int32`` or None.
    """
    _copy(copy_pages_op, True, dst, src, src_blocks, dst_blocks, counts, backend)


# ------------------------------------------------------------------------------ resolve


def _resolve_kernel():
    """``kernels.resolve.resolve`` (the module is imported on first use; the function is
    looked up at every call)."""
    if not _RESOLVE:
        from hisparse_triton.kernels import resolve as module

        _RESOLVE.append(module)
    return _RESOLVE[0].resolve


_RESOLVE: list = []


@torch.library.custom_op("hisparse_triton::resolve", mutates_args=("slot_host_rows", "lru"),
                         device_types="cpu")
def resolve_op(topk: Tensor, state_rows: Tensor, seq_lens: Tensor, resident_blocks: Tensor,
               host_blocks: Tensor, hot_blocks: Tensor, slot_host_rows: Tensor, lru: Tensor,
               block_size: int, num_device_blocks: int,
               num_host_blocks: int) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    return tuple(reference.resolve(
        topk, state_rows, seq_lens, resident_blocks, host_blocks, hot_blocks, slot_host_rows,
        lru, block_size=block_size, num_device_blocks=num_device_blocks,
        num_host_blocks=num_host_blocks))


@resolve_op.register_kernel("cuda")
def _resolve_cuda(topk, state_rows, seq_lens, resident_blocks, host_blocks, hot_blocks,
                  slot_host_rows, lru, block_size, num_device_blocks, num_host_blocks):
    return tuple(_resolve_kernel()(
        topk, state_rows, seq_lens, resident_blocks, host_blocks, hot_blocks, slot_host_rows,
        lru, block_size=block_size, num_device_blocks=num_device_blocks,
        num_host_blocks=num_host_blocks))


@resolve_op.register_fake
def _resolve_fake(topk, state_rows, seq_lens, resident_blocks, host_blocks, hot_blocks,
                  slot_host_rows, lru, block_size, num_device_blocks, num_host_blocks):
    rows, cols = topk.shape
    return (topk.new_empty((rows, cols), dtype=torch.int32),
            topk.new_empty((rows, cols), dtype=torch.int32),
            topk.new_empty((rows, cols), dtype=torch.int32),
            topk.new_empty((rows,), dtype=torch.int32),
            topk.new_empty((rows, 3), dtype=torch.int32))


def resolve(topk: Tensor, state_rows: Tensor, seq_lens: Tensor, resident_blocks: Tensor,
            host_blocks: Tensor, hot_blocks: Tensor, slot_host_rows: Tensor, lru: Tensor, *,
            block_size: int, num_device_blocks: int, num_host_blocks: int,
            counters: Optional[Tensor] = None, out: Optional[Tensor] = None,
            workspace: Optional[ResolveWorkspace] = None,
            backend: Optional[str] = None) -> ResolveResult:
    """Resolve top-k positions into device rows and a miss plan; update the hot state in place.

    Shapes and semantics: ``reference.resolve`` (``topk [R, K]`` any integer dtype, state
    ``[S, ...]`` int32; returns ``ResolveResult``: ``rows``/``miss_src``/``miss_dst``
    ``[R, K] int32``, ``miss_count [R] int32``, ``stats [R, 3] int32``). Keywords, the same on
    every backend: ``counters [3] int64`` accumulates (hits, misses, masked); ``out [R, K]
    int32`` receives ``rows``; ``workspace`` (``ResolveWorkspace``) holds the plan and scratch
    (no allocation; valid until its next call) and what ``restore_resolve_state`` needs. On
    the Triton backend this is one kernel launch (counters included), no host sync.
    """
    args = (topk, state_rows, seq_lens, resident_blocks, host_blocks, hot_blocks,
            slot_host_rows, lru)
    on_cuda = topk.is_cuda
    choice = _choose(backend, on_cuda, topk.device)
    eager = _eager(args) and (counters is None or type(counters) is Tensor) \
        and (out is None or type(out) is Tensor)
    if choice == "triton" and (eager or not on_cuda):
        return _resolve_kernel()(*args, block_size=block_size,
                                 num_device_blocks=num_device_blocks,
                                 num_host_blocks=num_host_blocks, counters=counters, out=out,
                                 workspace=workspace)
    sizes = dict(block_size=block_size, num_device_blocks=num_device_blocks,
                 num_host_blocks=num_host_blocks)
    if choice == "torch" and (eager or on_cuda):
        return reference.resolve(*args, **sizes, counters=counters, out=out,
                                 workspace=workspace)
    return _traced_resolve(args, sizes, counters, out, workspace)


def _traced_resolve(args: tuple, sizes: dict, counters: Optional[Tensor], out: Optional[Tensor],
                    workspace: Optional[ResolveWorkspace]) -> ResolveResult:
    """Traced calls: the registered op (fresh outputs) plus torch ops that place the results
    where the keywords ask (``torch.compile`` sees one opaque node and a few copies)."""
    topk, state_rows, *_, slot_host_rows, lru = args
    R, K = topk.shape
    S, H = lru.shape
    check_resolve_extras(R, K, H, topk.device, counters, out, workspace)
    if workspace is not None:  # the pre-call state, before the op updates it in place
        touched = reference.first_occurrences(state_rows, S)
        if S:
            rows = torch.where(touched, state_rows.long(), 0)
            old_rows, old_lru = slot_host_rows[rows], lru[rows]
        else:
            old_rows = old_lru = torch.zeros(R, H, dtype=torch.int32, device=topk.device)
        touched = touched.to(torch.int32)
    result = ResolveResult(*resolve_op(*args, **sizes))
    if workspace is None:
        if out is not None:
            out.copy_(result.rows)
            result = result._replace(rows=out)
        if counters is not None:
            counters += result.stats.sum(0)
        return result
    return reference.emit_result(result, touched, old_rows, old_lru, H, counters, out, workspace)
