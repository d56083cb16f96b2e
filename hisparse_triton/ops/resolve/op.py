"""``resolve``: backend dispatch and the registered custom op.

The custom op ``hisparse_triton::resolve`` takes the tensors and sizes of
``reference.resolve`` (no keywords) and returns its five outputs as fresh tensors; it
declares ``slot_host_rows`` and ``lru`` mutated. CPU kernel: the reference; CUDA kernel: the
Triton launcher (``hisparse_triton.kernels.resolve``); fake kernel: the output shapes. A
traced call with ``counters`` / ``out`` / ``workspace`` runs the op, then places its results
with torch ops.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from hisparse_triton.ops import registry
from hisparse_triton.ops.backends import choose_backend, is_eager
from hisparse_triton.ops.resolve import reference
from hisparse_triton.ops.resolve.contract import ResolveResult, check_resolve_extras
from hisparse_triton.ops.resolve.workspace import ResolveWorkspace

__all__ = ["FAMILY", "resolve", "resolve_op"]

#: The family name in ``registry.OP_TABLE``.
FAMILY = "resolve"


def _resolve_kernel():
    """``kernels.resolve.resolve`` (the module is imported on first use; the function is
    looked up at every call)."""
    if not _RESOLVE:
        from hisparse_triton.kernels import resolve as module

        _RESOLVE.append(module)
    return _RESOLVE[0].resolve


_RESOLVE: list = []


def _resolve_cpu(topk: Tensor, state_rows: Tensor, seq_lens: Tensor, resident_blocks: Tensor,
                 host_blocks: Tensor, hot_blocks: Tensor, slot_host_rows: Tensor, lru: Tensor,
                 block_size: int, num_device_blocks: int,
                 num_host_blocks: int) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    return tuple(reference.resolve(
        topk, state_rows, seq_lens, resident_blocks, host_blocks, hot_blocks, slot_host_rows,
        lru, block_size=block_size, num_device_blocks=num_device_blocks,
        num_host_blocks=num_host_blocks))


def _resolve_cuda(topk, state_rows, seq_lens, resident_blocks, host_blocks, hot_blocks,
                  slot_host_rows, lru, block_size, num_device_blocks, num_host_blocks):
    return tuple(_resolve_kernel()(
        topk, state_rows, seq_lens, resident_blocks, host_blocks, hot_blocks, slot_host_rows,
        lru, block_size=block_size, num_device_blocks=num_device_blocks,
        num_host_blocks=num_host_blocks))


def _resolve_fake(topk, state_rows, seq_lens, resident_blocks, host_blocks, hot_blocks,
                  slot_host_rows, lru, block_size, num_device_blocks, num_host_blocks):
    rows, cols = topk.shape
    return (topk.new_empty((rows, cols), dtype=torch.int32),
            topk.new_empty((rows, cols), dtype=torch.int32),
            topk.new_empty((rows, cols), dtype=torch.int32),
            topk.new_empty((rows,), dtype=torch.int32),
            topk.new_empty((rows, 3), dtype=torch.int32))


#: The family's op definitions (``registry.register_family`` registers them).
DEFINITIONS = (registry.OpDefinition("resolve", reference=_resolve_cpu, triton=_resolve_cuda,
                                     fake=_resolve_fake,
                                     mutates_args=("slot_host_rows", "lru")),)
resolve_op = registry.register_family(FAMILY, DEFINITIONS)["resolve"]


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
    choice = choose_backend(backend, on_cuda, topk.device)
    eager = is_eager(args) and (counters is None or type(counters) is Tensor) \
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
