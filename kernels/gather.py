"""Host -> device row gather and whole-page restore; the row/page copy kernel they share.

``copy_rows_kernel`` moves *spans* (a row of ``row_bytes``, or a whole page of
``block_size * row_bytes``) of every layer of one ``RowTable`` into another, following a plan
of span ids (``[R, K]`` shared by all layers, or ``[L, R, K]`` per layer) and a device-side
count per plan row. It is direction-agnostic: ``gather_rows`` / ``restore_pages`` here (host
-> device) and ``backup_rows`` / ``spill_pages`` in ``backup.py`` (device -> host) are typed
launchers over it with their own default launch configs (``hisparse_triton.tuning``).

Launch shape (``C`` = ``rows_per_program``, ``LP`` = ``layers_per_program``):
- a *work item* is ``C`` consecutive plan columns of one plan row: ``R * cdiv(K, C)`` items,
  numbered column-chunk-major (item ``i`` = chunk ``i // R`` of row ``i % R``), so the items
  holding misses (the first columns of every row) are spread over all programs;
- grid = ``(min(items, programs // layer_groups), layer_groups)`` with ``layer_groups =
  cdiv(L, LP)`` and ``programs`` = ``grid_programs``, or by default (0) ``GRID_PROGRAMS_PER_SM``
  per SM of the launch's device (``DEFAULT_SM_COUNT`` where none can be queried); a program
  walks items grid-stride, skips an item whose first column is past ``counts[r]`` after one
  scalar load, and otherwise copies its ``C`` spans for each of its ``LP`` layers, ``chunk``
  bytes of every span per step as a ``[C, chunk / word]`` tile.
The grid never depends on the batch size beyond being capped, never on the counts (which stay
on the device), and a launch has a fixed shape for a fixed plan shape (CUDA-graph friendly).
What depends only on the tables and the plan's shape (launch shape, word views, offsets, pool
checks) is prepared once and kept with the destination table.

Accesses: the pools are passed reinterpreted as ``word``-byte words (``int32``, or ``int16`` /
``uint8`` when rows are only 2- or 1-byte aligned) and each thread moves ``VEC`` contiguous
words: 16-byte accesses when the span size, the block strides, every layer offset and both
pools' base addresses are multiples of 16, narrower otherwise (chosen on the host from the
table geometry and the ``RowTable``'s own copy of its offsets). Addresses are int64; rows per
block are compile-time constants, so a span id splits into block and offset with a shift and
a mask. Cache hints: loads ``.cg`` (each source byte is read once), stores into the host pool
``.cs`` (streaming), stores into the device pool the default (attention reads them next).

Safety: a span id outside ``[0, num_spans)`` of the source loads zeros (the destination is
zero-filled, never given stale or foreign bytes); outside ``[0, num_spans)`` of the
destination nothing is stored; columns at or past ``counts[r]`` are not touched; a table
whose layers do not fit its pool cannot be built. So whatever the ids say, no byte
outside the addressed pools' rows is read or written.

Pools may live on different devices: on CUDA the host pool is pinned CPU memory (checked once
per pool), which the kernel dereferences directly (unified addressing); plans, counts and
both tables' offsets (``RowTable.device``) live on the CUDA device. Under ``TRITON_INTERPRET=1``
everything is on the CPU.
"""

from __future__ import annotations

import dataclasses
import weakref
from contextlib import nullcontext
from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl

from hisparse_triton.kernels.launch_config import KernelLaunch, check_launch
from hisparse_triton.ops.copy.contract import check_copy_args, table_alignment
from hisparse_triton.row_table import RowTable
from hisparse_triton.tuning import CopyConfig, default_config, next_pow2, pow2_alignment

__all__ = ["DEFAULT_SM_COUNT", "GRID_PROGRAMS_PER_SM", "BoundCopy", "LaunchShape",
           "copy_launch", "copy_rows_kernel", "device_guard", "gather_rows", "launch_copy",
           "launch_shape", "restore_pages", "sm_count", "validate_pool"]

@triton.jit
def copy_rows_kernel(
    dst_ptr, src_ptr,                      # pools as words (int32 / int16 / uint8)
    dst_layers_ptr, src_layers_ptr,        # [L] int64 byte offset of each layer's span 0
    src_ids_ptr, dst_ids_ptr, counts_ptr,  # plan [L?, R, K] int32, counts [R] int32
    src_stride_l, src_stride_r, src_stride_k,
    dst_stride_l, dst_stride_r, dst_stride_k,
    counts_stride,
    num_plan_rows, num_cols, num_layers, num_items,
    src_block_stride, src_num_spans,       # bytes from block to block, valid span ids
    dst_block_stride, dst_num_spans,
    span_vecs,                             # span size in VEC-word vectors
    SRC_PER_BLOCK: tl.constexpr,           # spans per block: block_size (rows) or 1 (pages)
    DST_PER_BLOCK: tl.constexpr,
    STORE_CACHE: tl.constexpr,             # "" (device rows read soon) or ".cs" (to the host)
    HAS_COUNTS: tl.constexpr,
    COLS: tl.constexpr,                    # plan columns per work item
    LAYERS: tl.constexpr,                  # layers per program
    CHUNK_VECS: tl.constexpr,              # vectors of a span moved per step
    VEC: tl.constexpr,                     # words per access
    WORD_BYTES: tl.constexpr,
):
    """Copy span ``src_ids[l, r, j]`` of layer ``l`` to span ``dst_ids[l, r, j]`` for every
    ``j < counts[r]``; see the module docstring for the launch shape and the bounds rules.
    The source is streamed (each byte read once): loads are cached in L2 only (``.cg``);
    stores into the host pool are streaming stores (``.cs``), stores into the device pool
    keep the default policy (attention reads those rows next)."""
    pid = tl.program_id(0)
    num_progs = tl.num_programs(0)
    layer_begin = tl.program_id(1) * LAYERS
    layer_end = tl.minimum(layer_begin + LAYERS, num_layers)
    col_offs = tl.arange(0, COLS)
    word_offs = tl.arange(0, CHUNK_VECS * VEC)
    span_words = span_vecs * VEC
    span_bytes = tl.cast(span_words, tl.int64) * WORD_BYTES
    for item in range(pid, num_items, num_progs):
        row = tl.cast(item % num_plan_rows, tl.int64)
        col0 = (item // num_plan_rows) * COLS
        if HAS_COUNTS:
            count = tl.minimum(tl.load(counts_ptr + row * counts_stride), num_cols)
        else:
            count = num_cols
        if col0 < count:
            cols = col0 + col_offs
            active = cols < count
            src_plan = src_ids_ptr + row * src_stride_r + cols.to(tl.int64) * src_stride_k
            dst_plan = dst_ids_ptr + row * dst_stride_r + cols.to(tl.int64) * dst_stride_k
            for layer in range(layer_begin, layer_end):
                lyr = tl.cast(layer, tl.int64)
                src_id = tl.load(src_plan + lyr * src_stride_l, mask=active, other=-1)
                dst_id = tl.load(dst_plan + lyr * dst_stride_l, mask=active, other=-1)
                src_ok = active & (src_id >= 0) & (src_id < src_num_spans)
                dst_ok = active & (dst_id >= 0) & (dst_id < dst_num_spans)
                # Ids are non-negative int32 here: block / offset by a constant (shifts for a
                # power-of-two block size), then widened for the byte address.
                s = tl.where(src_ok, src_id, 0)
                d = tl.where(dst_ok, dst_id, 0)
                src_byte = tl.load(src_layers_ptr + lyr) \
                    + (s // SRC_PER_BLOCK).to(tl.int64) * src_block_stride \
                    + (s % SRC_PER_BLOCK).to(tl.int64) * span_bytes
                dst_byte = tl.load(dst_layers_ptr + lyr) \
                    + (d // DST_PER_BLOCK).to(tl.int64) * dst_block_stride \
                    + (d % DST_PER_BLOCK).to(tl.int64) * span_bytes
                src_word = tl.multiple_of(src_byte // WORD_BYTES, VEC)
                dst_word = tl.multiple_of(dst_byte // WORD_BYTES, VEC)
                load_ok = (src_ok & dst_ok)[:, None]
                store_ok = dst_ok[:, None]
                for w0 in range(0, span_words, CHUNK_VECS * VEC):
                    words = w0 + word_offs
                    in_span = (words < span_words)[None, :]
                    vals = tl.load(src_ptr + src_word[:, None] + words[None, :],
                                   mask=load_ok & in_span, other=0, cache_modifier=".cg")
                    tl.store(dst_ptr + dst_word[:, None] + words[None, :], vals,
                             mask=store_ok & in_span, cache_modifier=STORE_CACHE)


#: ``validate_pool`` results by ``id(pool)``: (weak ref, device it was checked for).
_POOL_CHECKS: dict[int, tuple[weakref.ref, torch.device]] = {}


def validate_pool(pool: torch.Tensor, device: torch.device) -> None:
    """Check once that a kernel running on ``device`` can dereference ``pool``.

    A pool on ``device`` is fine; a CPU pool used by a CUDA kernel must be pinned (page-locked,
    e.g. ``cudaHostRegister``-ed): Triton then passes its host address, which CUDA's unified
    addressing maps for the device. Raises ``ValueError`` otherwise. Cached per pool tensor.
    """
    key = id(pool)
    entry = _POOL_CHECKS.get(key)
    if entry is not None and entry[0]() is pool and entry[1] == device:
        return
    if pool.device != device:
        if not (device.type == "cuda" and pool.device.type == "cpu"):
            raise ValueError(f"a kernel on {device} cannot address a pool on {pool.device}.")
        if not pool.is_pinned():
            raise ValueError(f"the CPU pool of {pool.numel()} B at 0x{pool.data_ptr():x} is not "
                             f"pinned; a CUDA kernel can only read pinned host memory (pin it "
                             f"with cudaHostRegister, or use the torch backend).")
    _POOL_CHECKS[key] = (weakref.ref(pool, lambda _ref, k=key: _POOL_CHECKS.pop(k, None)), device)


def _kernel_device(dst: RowTable, src: RowTable, device: torch.device) -> torch.device:
    for name, table in (("dst", dst), ("src", src)):
        if table.device != device:
            raise ValueError(f"{name}.layer_offsets is on {table.device} but the plan is on "
                             f"{device}; the offset tables live on the device the kernel "
                             f"runs on.")
    validate_pool(dst.pool, device)
    validate_pool(src.pool, device)
    return device


#: Programs per SM of a default launch (``CopyConfig.grid_programs == 0``), and the SM count
#: assumed where none can be queried (CPU tensors, the interpreter): an H100 / H200 SXM.
GRID_PROGRAMS_PER_SM = 32
DEFAULT_SM_COUNT = 132
_SM_COUNTS: dict[torch.device, int] = {}


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of ``device`` (cached); ``DEFAULT_SM_COUNT`` off CUDA."""
    count = _SM_COUNTS.get(device)
    if count is None:
        count = DEFAULT_SM_COUNT
        if device.type == "cuda":
            count = torch.cuda.get_device_properties(device).multi_processor_count
        _SM_COUNTS[device] = count
    return count


class LaunchShape(NamedTuple):
    """How ``launch_copy`` launches ``copy_rows_kernel`` (all host-side ints)."""

    config: CopyConfig
    span_bytes: int    # bytes one plan entry moves (a row, or a page)
    access_bytes: int  # bytes per thread access: the alignment of every address, <= config's
    word_bytes: int    # element size the pools are viewed as (min(access, 4))
    chunk_vecs: int    # accesses per span per inner step
    num_items: int     # work items: R * cdiv(K, rows_per_program)
    grid: tuple[int, int]


def launch_shape(dst: RowTable, src: RowTable, rows: int, cols: int, *, pages: bool,
                 kernel: str, config: Optional[CopyConfig] = None,
                 device: Optional[torch.device] = None,
                 programs_per_sm: int = 0) -> LaunchShape:
    """The launch of a ``[rows, cols]`` plan between ``src`` and ``dst`` on ``device`` (the
    SM count sizes a default grid; default: the tables' device). Reads no tensor values.

    ``programs_per_sm`` (0 = no budget): cap the grid at ``programs_per_sm x sm_count``
    programs in all (``grid_programs`` of the config is lowered to it; when the budget is
    below the config's layer groups, each program walks more layers: ``layers_per_program``
    is raised so that the grid's axis 1 fits it)."""
    span = dst.row_bytes * (dst.block_size if pages else 1)
    if config is None:
        config = default_config(kernel, span, dst.num_layers)
    if programs_per_sm:
        budget = programs_per_sm * sm_count(device or dst.device)
        programs = min(config.grid_programs or budget, budget)
        groups = -(-dst.num_layers // config.layers_per_program)
        layers = config.layers_per_program if groups <= programs else \
            -(-dst.num_layers // programs)
        config = dataclasses.replace(config, grid_programs=programs, layers_per_program=layers)
    access = pow2_alignment(span, src.block_stride, dst.block_stride, table_alignment(src),
                            table_alignment(dst), src.pool.data_ptr(), dst.pool.data_ptr(),
                            cap=config.access_bytes)
    chunk_vecs = max(1, min(config.chunk_bytes, next_pow2(span)) // access)
    # (plain ints: triton.cdiv is a jit function, slow to call from the host)
    num_items = rows * -(-cols // config.rows_per_program)
    layer_groups = -(-dst.num_layers // config.layers_per_program)
    programs = config.grid_programs or GRID_PROGRAMS_PER_SM * sm_count(device or dst.device)
    grid = (max(1, min(num_items, programs // layer_groups)), layer_groups)
    return LaunchShape(config, span, access, min(access, 4), chunk_vecs, num_items, grid)


class _Prepared(NamedTuple):
    """Everything of a copy launch that depends on the tables and the plan's shape only."""

    grid: tuple[int, int]
    args: tuple  # the kernel's arguments before the plan tensors
    sizes: tuple  # the int arguments after the plan strides
    constexprs: dict


def _prepare(dst: RowTable, src: RowTable, device: torch.device, rows: int, cols: int, *,
             pages: bool, kernel: str, config: Optional[CopyConfig],
             programs_per_sm: int = 0) -> _Prepared:
    _kernel_device(dst, src, device)
    shape = launch_shape(dst, src, rows, cols, pages=pages, kernel=kernel, config=config,
                         device=device, programs_per_sm=programs_per_sm)
    word = shape.word_bytes
    config = shape.config
    check_launch(f"{kernel} (copy_rows_kernel)", config.num_warps, device)  # warp size, limits
    return _Prepared(
        shape.grid,
        (dst.word_view(word), src.word_view(word), dst.device_offsets(device),
         src.device_offsets(device)),
        (rows, cols, dst.num_layers, shape.num_items,
         src.block_stride, src.num_blocks if pages else src.num_rows,
         dst.block_stride, dst.num_blocks if pages else dst.num_rows,
         shape.span_bytes // shape.access_bytes),
        dict(SRC_PER_BLOCK=1 if pages else src.block_size,
             DST_PER_BLOCK=1 if pages else dst.block_size,
             STORE_CACHE=".cs" if kernel in ("backup", "spill") else "",
             COLS=config.rows_per_program, LAYERS=config.layers_per_program,
             CHUNK_VECS=shape.chunk_vecs, VEC=shape.access_bytes // word, WORD_BYTES=word,
             num_warps=config.num_warps, num_stages=config.num_stages))


def _plan_strides(ids: torch.Tensor) -> tuple[int, int, int]:
    strides = ids.stride()
    return strides if len(strides) == 3 else (0, *strides)


def launch_copy(dst: RowTable, src: RowTable, src_ids: torch.Tensor, dst_ids: torch.Tensor,
                counts: Optional[torch.Tensor], *, pages: bool, kernel: str,
                config: Optional[CopyConfig] = None) -> None:
    """Check the arguments and launch ``copy_rows_kernel`` once for all layers.

    ``pages=False``: rows (``copy_rows`` semantics); ``pages=True``: whole blocks
    (``copy_pages`` semantics). ``kernel`` names the default config (``tuning.default_config``)
    used when ``config`` is None. Reads no tensor values on the host, so it does not
    synchronise with the device. What depends only on the tables and the plan's shape (launch
    shape, word views, offsets, pool checks) is prepared once and cached on ``dst``.
    """
    launch = copy_launch(dst, src, src_ids, dst_ids, counts, pages=pages, kernel=kernel,
                         config=config)
    if launch is not None:
        with device_guard(src_ids):
            launch()


def copy_launch(dst: RowTable, src: RowTable, src_ids: torch.Tensor, dst_ids: torch.Tensor,
                counts: Optional[torch.Tensor], *, pages: bool, kernel: str,
                config: Optional[CopyConfig] = None) -> Optional[KernelLaunch]:
    """The launch ``launch_copy`` makes for these arguments (checked the same way), without
    making it; None for an empty plan (nothing to launch)."""
    check_copy_args(dst, src, src_ids, dst_ids, counts, pages=pages)
    shape = src_ids.shape
    rows, cols = shape[-2], shape[-1]
    if rows == 0 or cols == 0:
        return None
    device = src_ids.device
    dst.check_pool()
    src.check_pool()
    key = ("copy", src, device, rows, cols, pages, kernel, config, dst.pool.data_ptr(),
           src.pool.data_ptr())
    prepared = dst.cached(key, lambda: _prepare(dst, src, device, rows, cols, pages=pages,
                                                kernel=kernel, config=config))
    has_counts = counts is not None
    args = (*prepared.args, src_ids, dst_ids, counts if has_counts else src_ids,
            *_plan_strides(src_ids), *_plan_strides(dst_ids),
            counts.stride(0) if has_counts else 0, *prepared.sizes)
    return KernelLaunch(copy_rows_kernel, prepared.grid, args,
                        dict(HAS_COUNTS=has_counts, **prepared.constexprs))


class BoundCopy:
    """A copy between two fixed tables (a runtime's pools): ``bound(src_ids, dst_ids,
    counts)`` has the semantics of ``launch_copy``, with the checks and launch arguments of a
    plan *layout* (shapes, strides, dtypes, device, whether there are counts) computed on its
    first call and kept, so a later call of that layout (the decode path's miss plan, a
    mirror's rows: the same tensors or new ones every call) is a dictionary lookup and one
    ``copy_rows_kernel[grid](...)`` launch (Triton's own launch path; under a CUDA graph
    capture, the launch the graph records). ``shaped`` is the same call.

    ``programs_per_sm``: a per-SM budget of programs (0 = none: the config's grid, by
    default ``GRID_PROGRAMS_PER_SM`` per SM): the grid is capped at ``programs_per_sm x
    sm_count`` programs over both axes (``launch_shape(..., programs_per_sm=)``), so a
    gather leaves the rest of every SM to compute kernels running beside it. Exact for any
    budget, 1 included (programs walk the work items grid-stride)."""

    def __init__(self, dst: RowTable, src: RowTable, *, pages: bool, kernel: str,
                 config: Optional[CopyConfig] = None, programs_per_sm: int = 0) -> None:
        if not isinstance(programs_per_sm, int) or isinstance(programs_per_sm, bool) \
                or programs_per_sm < 0:
            raise ValueError(f"programs_per_sm must be a non-negative int, got "
                             f"{programs_per_sm!r}.")
        self._dst, self._src = dst, src
        self._pages, self._kernel, self._config = pages, kernel, config
        self.programs_per_sm = programs_per_sm
        self._calls: dict[tuple, Optional[tuple]] = {}

    @property
    def config(self) -> Optional[CopyConfig]:
        """The launch config given (None: ``tuning.default_config`` per launch)."""
        return self._config

    def __call__(self, src_ids: torch.Tensor, dst_ids: torch.Tensor,
                 counts: Optional[torch.Tensor] = None) -> None:
        try:
            key = (src_ids.shape, src_ids.stride(), src_ids.dtype, src_ids.device,
                   dst_ids.shape, dst_ids.stride(), dst_ids.dtype, dst_ids.device,
                   None if counts is None else (counts.shape, counts.stride(), counts.dtype,
                                                counts.device))
        except AttributeError:   # not tensors: the checks name what is wrong
            key = None
        call = self._calls.get(key, False)
        if call is False:   # a new layout: checked, its launch prepared
            call = self._prepare(src_ids, dst_ids, counts)
            self._calls[key] = call
        if call is not None:
            grid, head, tail, constexprs = call
            with device_guard(src_ids):
                copy_rows_kernel[grid](*head, src_ids, dst_ids,
                                       counts if counts is not None else src_ids,
                                       *tail, **constexprs)

    shaped = __call__

    def _prepare(self, src_ids: torch.Tensor, dst_ids: torch.Tensor,
                 counts: Optional[torch.Tensor]) -> Optional[tuple]:
        """``(grid, arguments before the plan, arguments after it, constexprs)`` of a plan
        layout (None: an empty plan, nothing to launch); ``ValueError`` for bad arguments."""
        dst, src = self._dst, self._src
        check_copy_args(dst, src, src_ids, dst_ids, counts, pages=self._pages)
        rows, cols = src_ids.shape[-2], src_ids.shape[-1]
        if rows == 0 or cols == 0:
            return None
        dst.check_pool()
        src.check_pool()
        prepared = _prepare(dst, src, src_ids.device, rows, cols, pages=self._pages,
                            kernel=self._kernel, config=self._config,
                            programs_per_sm=self.programs_per_sm)
        has_counts = counts is not None
        tail = (*_plan_strides(src_ids), *_plan_strides(dst_ids),
                counts.stride(0) if has_counts else 0, *prepared.sizes)
        return (prepared.grid, prepared.args, tail,
                dict(HAS_COUNTS=has_counts, **prepared.constexprs))


_NO_GUARD = nullcontext()


def device_guard(tensor: torch.Tensor):
    """Triton launches on the current CUDA device: make it ``tensor``'s (a no-op context
    when it already is, or off CUDA)."""
    if tensor.is_cuda and tensor.get_device() != torch.cuda.current_device():
        return torch.cuda.device(tensor.device)
    return _NO_GUARD


def gather_rows(dst: RowTable, src: RowTable, src_rows: torch.Tensor, dst_rows: torch.Tensor,
                counts: Optional[torch.Tensor] = None,
                config: Optional[CopyConfig] = None) -> None:
    """Host -> device row gather: ``reference.copy_rows`` semantics, one launch for all layers.

    ``src`` is the host pool's table (pinned CPU memory on CUDA), ``dst`` the device pool's;
    ``src_rows``/``dst_rows``: ``[R, K]`` or ``[L, R, K] int32`` (e.g. resolve's miss plan),
    ``counts``: ``[R] int32`` or None, all on the kernel's device. ``config`` defaults to
    ``default_config("gather", row_bytes, num_layers)``.
    """
    launch_copy(dst, src, src_rows, dst_rows, counts, pages=False, kernel="gather",
                config=config)


def restore_pages(dst: RowTable, src: RowTable, src_blocks: torch.Tensor,
                  dst_blocks: torch.Tensor, counts: Optional[torch.Tensor] = None,
                  config: Optional[CopyConfig] = None) -> None:
    """Host -> device whole-page copy: ``reference.copy_pages`` semantics, one launch.

    Block-id plans ``[R, K]`` / ``[L, R, K] int32``; ``config`` defaults to
    ``default_config("restore", block_size * row_bytes, num_layers)``.
    """
    launch_copy(dst, src, src_blocks, dst_blocks, counts, pages=True, kernel="restore",
                config=config)
