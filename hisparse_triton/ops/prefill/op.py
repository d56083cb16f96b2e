"""``plan_prefill`` / ``stage_prefill``: backend dispatch and the registered custom op.

The custom op ``hisparse_triton::plan_prefill`` takes the tensors and sizes of
``reference.plan_prefill`` (no keywords) and returns ``(rows, src_rows, counts)`` as fresh
tensors (``counts = [staged, needed]``); it mutates nothing. CPU kernel: the reference; CUDA
kernel: the Triton launcher (``hisparse_triton.kernels.prefill``, with a one-off
workspace); fake kernel: the output shapes. A traced call with ``out`` / ``workspace`` runs
the op, then places its results with torch ops.

``stage_prefill`` is the whole prefill staging of one index group: the plan, then the
copy family's ``copy_rows`` of the staged host rows into the staging region of every layer
of the group (one gather launch).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from hisparse_triton.ops import registry
from hisparse_triton.ops.backends import choose_backend, is_eager
from hisparse_triton.ops.copy.op import copy_rows
from hisparse_triton.ops.prefill import reference
from hisparse_triton.ops.prefill.contract import PrefillPlan, check_prefill_args
from hisparse_triton.ops.prefill.workspace import PrefillWorkspace
from hisparse_triton.row_table import RowTable

__all__ = ["FAMILY", "plan_prefill", "plan_prefill_op", "stage_prefill"]

#: The family name in ``registry.OP_TABLE``.
FAMILY = "prefill"

_KERNEL: list = []


def _prefill_kernel():
    """``kernels.prefill.plan_prefill`` (the module is imported on first use)."""
    if not _KERNEL:
        from hisparse_triton.kernels import prefill as module

        _KERNEL.append(module)
    return _KERNEL[0].plan_prefill


def _op_outputs(plan: PrefillPlan) -> tuple[Tensor, Tensor, Tensor]:
    """The custom op's fresh outputs: ``(rows, src_rows, [staged, needed])``."""
    return plan.rows.clone(), plan.src_rows.clone(), torch.cat([plan.staged, plan.needed])


def _plan_cpu(topk: Tensor, state_rows: Tensor, seq_lens: Tensor, resident_blocks: Tensor,
              host_blocks: Tensor, block_size: int, num_device_blocks: int,
              num_host_blocks: int, staging_first_row: int,
              staging_rows: int) -> tuple[Tensor, Tensor, Tensor]:
    return _op_outputs(reference.plan_prefill(
        topk, state_rows, seq_lens, resident_blocks, host_blocks, block_size=block_size,
        num_device_blocks=num_device_blocks, num_host_blocks=num_host_blocks,
        staging_first_row=staging_first_row, staging_rows=staging_rows))


def _plan_cuda(topk, state_rows, seq_lens, resident_blocks, host_blocks, block_size,
               num_device_blocks, num_host_blocks, staging_first_row, staging_rows):
    return _op_outputs(_prefill_kernel()(
        topk, state_rows, seq_lens, resident_blocks, host_blocks, block_size=block_size,
        num_device_blocks=num_device_blocks, num_host_blocks=num_host_blocks,
        staging_first_row=staging_first_row, staging_rows=staging_rows))


def _plan_fake(topk, state_rows, seq_lens, resident_blocks, host_blocks, block_size,
               num_device_blocks, num_host_blocks, staging_first_row, staging_rows):
    T, K = topk.shape
    return (topk.new_empty((T, K), dtype=torch.int32),
            topk.new_empty((1, staging_rows), dtype=torch.int32),
            topk.new_empty((2,), dtype=torch.int32))


#: The family's op definitions (``registry.register_family`` registers them).
DEFINITIONS = (registry.OpDefinition("plan_prefill", reference=_plan_cpu, triton=_plan_cuda,
                                     fake=_plan_fake),)
plan_prefill_op = registry.register_family(FAMILY, DEFINITIONS)["plan_prefill"]


def plan_prefill(topk: Tensor, state_rows: Tensor, seq_lens: Tensor, resident_blocks: Tensor,
                 host_blocks: Tensor, *, block_size: int, num_device_blocks: int,
                 num_host_blocks: int, staging_first_row: int, staging_rows: int,
                 out: Optional[Tensor] = None, workspace: Optional[PrefillWorkspace] = None,
                 backend: Optional[str] = None) -> PrefillPlan:
    """Map a prefill chunk's ``topk [T, K]`` positions to device rows and plan the staging of
    its host-only rows (semantics: ``reference.plan_prefill``; returns ``PrefillPlan``).
    ``out [T, K] int32`` receives the rows; ``workspace`` (``PrefillWorkspace``) holds every
    output and the Triton kernels' scratch (no allocation; valid until its next call). On
    the Triton backend: four launches, no host sync."""
    args = (topk, state_rows, seq_lens, resident_blocks, host_blocks)
    sizes = dict(block_size=block_size, num_device_blocks=num_device_blocks,
                 num_host_blocks=num_host_blocks, staging_first_row=staging_first_row,
                 staging_rows=staging_rows)
    on_cuda = topk.is_cuda
    choice = choose_backend(backend, on_cuda, topk.device)
    eager = is_eager(args) and (out is None or type(out) is Tensor)
    if choice == "triton" and (eager or not on_cuda):
        return _prefill_kernel()(*args, **sizes, out=out, workspace=workspace)
    if choice == "torch" and (eager or on_cuda):
        return reference.plan_prefill(*args, **sizes, out=out, workspace=workspace)
    return _traced_plan(args, sizes, out, workspace)


def _traced_plan(args: tuple, sizes: dict, out: Optional[Tensor],
                 workspace: Optional[PrefillWorkspace]) -> PrefillPlan:
    """Traced calls: the registered op (fresh outputs) plus torch ops that place the results
    where the keywords ask."""
    check_prefill_args(*args, *sizes.values(), out, workspace)
    if workspace is not None and workspace.mapped:
        raise ValueError("plan_prefill: a workspace with a staging map "
                         "(PrefillWorkspace.map_staging) is for eager calls; a traced call "
                         "stages into consecutive rows (staging_first_row + i)")
    rows, src_rows, counts = plan_prefill_op(*args, *sizes.values())
    return reference.emit_plan(rows, src_rows, counts, sizes["staging_first_row"], out,
                               workspace)


def stage_prefill(device_table: RowTable, host_table: RowTable, topk: Tensor,
                  state_rows: Tensor, seq_lens: Tensor, resident_blocks: Tensor,
                  host_blocks: Tensor, *, block_size: int, num_device_blocks: int,
                  num_host_blocks: int, staging_first_row: int, staging_rows: int,
                  out: Optional[Tensor] = None, workspace: Optional[PrefillWorkspace] = None,
                  backend: Optional[str] = None) -> PrefillPlan:
    """``plan_prefill``, then copy the staged host rows of every layer of ``host_table``
    into their staging rows of ``device_table`` (``copy_rows`` with the plan's device-side
    count: one launch). Returns the plan; ``plan.rows`` index ``device_table``'s rows of
    every layer. On the Triton backend: five launches, no host sync."""
    plan = plan_prefill(topk, state_rows, seq_lens, resident_blocks, host_blocks,
                        block_size=block_size, num_device_blocks=num_device_blocks,
                        num_host_blocks=num_host_blocks, staging_first_row=staging_first_row,
                        staging_rows=staging_rows, out=out, workspace=workspace,
                        backend=backend)
    copy_rows(device_table, host_table, plan.src_rows, plan.dst_rows, plan.staged,
              backend=backend)
    return plan
