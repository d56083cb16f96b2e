"""Residency resolution on the device: ``resolve`` as ONE Triton launch, one program per row.

``resolve`` has the signature, return type and semantics of ``hisparse_triton.reference.resolve``
(read that docstring for the rules, the corrupted-state rules and the optional ``counters``,
``out`` and ``workspace`` arguments); this module launches one of two kernels with that
contract, bit-identical to the reference and to each other:

- ``hash`` (``kernels/resolve_hash.py``): a per-row open-addressing hash table of the top-k
  columns' host rows in the workspace, no sort; for top-k up to ``HASH_MAX_WIDTH`` (2,048)
  against up to ``HASH_MAX_SLOTS`` (4,096) hot slots, with host rows that fit int32
  (``num_host_blocks * block_size < 2**31 - 1``). A row whose insertion overflows (a column
  still unplaced after ``PROBES`` rounds) is resolved by the sorted code in the same launch.
- ``sorted`` (``kernels/resolve_sorted.py``): sort + binary search, every width up to
  ``MAX_RESOLVE_WIDTH`` (32,768), int64 keys when the host pool needs them.

The dispatch (``_launch``) reads ``K`` (top-k), ``H`` (hot slots per row), ``block_size`` and
``num_host_blocks`` only, never the batch rows ``R`` or a tensor value: ``hash`` when
``hash_applies(K, H, block_size, num_host_blocks)``, i.e. ``K <= 2048 and H <= 4096 and
num_host_blocks * block_size < 2**31 - 1``, and no sorted-kernel knob is given; ``sorted``
otherwise. ``_resolve(..., variant="sorted" | "hash")`` forces one (``"hash"`` where it does
not apply raises ``ValueError``; the sorted kernel's knobs ``sort_width`` / ``block_h`` /
``gather_search`` imply ``sorted``). Within ``sorted``: ``W = scratch_width(K)`` (``K`` rounded
up to a power of two, >= 16); keys sorted in registers when ``W <= MAX_SORT_WIDTH`` (2,048),
else 2,048-key tiles merged in scratch; int64 keys when ``(num_host_blocks * block_size + 1)
* W > 2**31``; ``min(next_pow2(max(H, 16)), MAX_BLOCK_H)`` LRU positions per step.
``resolve_variants`` lists every variant a shape can launch
(``ops.resolve.variants.time_resolve_variants`` times them).
The launcher validates shapes, dtypes and devices only; it never reads tensor values, so it is CUDA-graph capturable
(with a workspace, a repeated call allocates nothing). ``BoundResolve`` (the runtime's decode
path) checks and prepares a call shape once and launches with ``kernel[grid](...)``, Triton's
own launch path: the launch a CUDA graph captures.
The warps come from ``kernels/launch_config.resolve_launch_warps`` (per warp size; HIP's
limits checked). On AMD GPUs ``tl.debug_barrier()`` is a bare ``s_barrier``: the memory-model
argument for the hand-offs is in ``kernels/resolve_sorted.py`` and docs/kernels.md.
"""

from __future__ import annotations

import os
from typing import Any, NamedTuple, Optional

import torch

from hisparse_triton.kernels import resolve_hash as _hash
from hisparse_triton.kernels.gather import device_guard
from hisparse_triton.kernels.resolve_hash import _resolve_hash_kernel
from hisparse_triton.kernels.resolve_sorted import (  # noqa: F401 (jit helpers others reuse)
    _lower_bound,
    _resolve_kernel,
    _sorted_tile,
)
from hisparse_triton.ops.resolve.contract import (
    ResolveResult,
    check_resolve_args as _check_resolve_args,
)
from hisparse_triton.kernels.launch_config import KernelLaunch, resolve_launch_warps
from hisparse_triton.ops.resolve.workspace import (
    HASH_BUCKET_SLOTS,
    HASH_MAX_SLOTS,
    HASH_MAX_WIDTH,
    ResolveWorkspace,
    hash_buckets,
    restore_resolve_state,
    scratch_width,
)
from hisparse_triton.tuning import MAX_RESOLVE_WIDTH  # (torch-free home; see there)

__all__ = ["BoundResolve", "GATHER_SEARCH", "HASH_MAX_SLOTS", "HASH_MAX_WIDTH", "MAX_BLOCK_H",
           "MAX_RESOLVE_WIDTH", "MAX_SORT_WIDTH", "VARIANTS", "ResolveWorkspace", "resolve",
           "resolve_launch", "resolve_variants", "restore_resolve_state"]

#: Most keys sorted in registers by one program; wider rows are merged in scratch.
MAX_SORT_WIDTH = 2048
#: Most LRU positions one program handles per step.
MAX_BLOCK_H = 4096
#: Search the sorted keys in registers with ``tl.gather`` (when one tile holds them all)
#: instead of in the row's key scratch.
GATHER_SEARCH = True
#: The kernels ``_resolve(variant=...)`` can launch.
VARIANTS = ("hash", "sorted")
#: Warps of the hash kernel at tiles of 1,024 and more.
HASH_WARPS = 8
#: Element offsets past this need int64 arithmetic in the hash kernel (``OFF64``).
_I32_OFFSETS = 2**31


class _Launch(NamedTuple):
    """Constexprs and options of one resolve call shape's launch(es) (a function of the
    shapes only): the sorted kernel's, or the hash kernel's and its fallback launch's."""

    block_k: int
    sort: int
    block_h: int
    key64: bool
    in_regs: bool
    num_warps: int
    constexprs: dict  # the launch's keyword arguments
    variant: str = "sorted"  # "hash" | "sorted"
    fallback: Optional[dict] = None  # hash: the fallback launch's keyword arguments


_LAUNCHES: dict[tuple, _Launch] = {}


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def hash_applies(K: int, H: int, block_size: int, num_host_blocks: int) -> bool:
    """Whether the hash kernel can take a call shape (top-k and slots within its tiles, host
    rows that fit int32)."""
    return (K <= HASH_MAX_WIDTH and H <= HASH_MAX_SLOTS
            and num_host_blocks * block_size < 2**31 - 1)


def _launch(K: int, H: int, block_size: int, num_host_blocks: int, has_counters: bool,
            sort_width: Optional[int] = None, block_h: Optional[int] = None,
            num_warps: Optional[int] = None, gather_search: Optional[bool] = None,
            block_r: int = 256, variant: Optional[str] = None, probes: Optional[int] = None,
            hash_mul: Optional[int] = None) -> _Launch:
    """The launch of a call shape (memoised: the decode loop repeats a few shapes)."""
    key = (K, H, block_size, num_host_blocks, has_counters, sort_width, block_h, num_warps,
           gather_search, block_r, variant, probes, hash_mul)
    launch = _LAUNCHES.get(key)
    if launch is not None:
        return launch
    for name, value in (("sort_width", sort_width), ("block_h", block_h), ("block_r", block_r)):
        if value is not None and (value < 16 or value & (value - 1)):
            raise ValueError(f"resolve: {name} must be a power of two >= 16, got {value}")
    if num_warps is not None and num_warps not in (1, 2, 4, 8, 16, 32):
        raise ValueError(f"resolve: num_warps must be a power of two <= 32, got {num_warps}")
    if variant is not None and variant not in VARIANTS:
        raise ValueError(f"resolve: variant must be one of {VARIANTS}, got {variant!r}")
    if probes is not None and not 1 <= probes <= HASH_BUCKET_SLOTS:
        raise ValueError(f"resolve: probes (key slots per hash bucket) must be in "
                         f"[1, {HASH_BUCKET_SLOTS}], got {probes}")
    eligible = hash_applies(K, H, block_size, num_host_blocks)
    sorted_knobs = sort_width is not None or block_h is not None or gather_search is not None
    if variant == "hash" and (not eligible or sorted_knobs):
        raise ValueError(
            f"resolve: variant 'hash' takes top-k <= {HASH_MAX_WIDTH}, slots <= "
            f"{HASH_MAX_SLOTS} and host rows below 2**31, without sorted-kernel knobs; got "
            f"K={K}, H={H}, host rows {num_host_blocks * block_size}")
    use_hash = variant == "hash" or (variant is None and eligible and not sorted_knobs)
    block_k = scratch_width(K)
    sort = min(block_k, sort_width or MAX_SORT_WIDTH)
    bh = min(_pow2(max(H, 16)), block_h or MAX_BLOCK_H)
    key64 = (num_host_blocks * block_size + 1) * block_k > 2**31
    tile = max(sort, bh)
    in_regs = (GATHER_SEARCH if gather_search is None else bool(gather_search)) \
        and sort == block_k
    # the sorted kernel's constexprs (its own launch, or the hash kernel's fallback launch)
    sorted_warps = resolve_launch_warps(tile, None if use_hash else num_warps)
    constexprs = dict(BLOCK_SIZE=block_size, BLOCK_K=block_k, LOG2_K=block_k.bit_length() - 1,
                      SORT=sort, LOG2_SORT=sort.bit_length() - 1, BLOCK_H=bh, BLOCK_R=block_r,
                      KEY64=key64, HAS_COUNTERS=has_counters, IN_REGS=in_regs, FLAGGED=False,
                      num_warps=sorted_warps)
    if use_hash:
        warps = resolve_launch_warps(tile, num_warps or (HASH_WARPS if tile >= 1024 else 4))
        fallback = {**constexprs, "FLAGGED": True}
        constexprs = dict(BLOCK_SIZE=block_size, BLOCK_K=block_k, BLOCK_H=bh,
                          BLOCK_R=block_r, HAS_COUNTERS=has_counters,
                          LOG2_NB=hash_buckets(K).bit_length() - 1,
                          PROBES=probes or _hash.PROBES,
                          HASH_MUL=_hash.HASH_MUL if hash_mul is None else int(hash_mul),
                          FULL_K=K == block_k, FULL_H=H == bh, num_warps=warps)
        launch = _Launch(block_k, sort, bh, key64, in_regs, warps, constexprs, "hash",
                         fallback)
    else:
        launch = _Launch(block_k, sort, bh, key64, in_regs, sorted_warps, constexprs)
    _LAUNCHES[key] = launch
    return launch


def _hash_call_constexprs(launch: _Launch, topk: torch.Tensor, state: tuple,
                          rows: torch.Tensor, one_off: bool) -> dict:
    """The hash launch's constexprs that depend on a call's tensors, not only its shape:
    ``POS64`` (positions compared as int64: int64 / uint64 / uint32 top-k), ``OFF64`` (an
    element offset of some tensor reaches 2**31 elements: int64 offsets) and
    ``CLEAN_FIRST`` (a one-off table, not clean yet)."""
    seq_lens, resident, host, hot, slot_rows, lru = state
    K, P, HB, H = topk.shape[1], resident.shape[1], hot.shape[1], lru.shape[1]
    reach = max((K - 1) * max(topk.stride(1), rows.stride(1)),
                (P - 1) * max(resident.stride(1), host.stride(1)),
                (HB - 1) * hot.stride(1), (H - 1) * max(slot_rows.stride(1), lru.stride(1)))
    return {**launch.constexprs,
            "POS64": topk.dtype in (torch.int64, torch.uint64, torch.uint32),
            "OFF64": reach >= _I32_OFFSETS, "CLEAN_FIRST": one_off}


def _kernel_of(variant: str) -> Any:
    """The jit kernel of a variant (looked up at call time: a launch recorder may replace
    it)."""
    return _resolve_hash_kernel if variant == "hash" else _resolve_kernel


def _strides(topk: torch.Tensor, state_rows: torch.Tensor, state: tuple,
             rows: torch.Tensor) -> tuple:
    seq_lens, resident, host, hot, slot_rows, lru = state
    return (*topk.stride(), state_rows.stride(0), seq_lens.stride(0), *resident.stride(),
            *host.stride(), *hot.stride(), *slot_rows.stride(), *lru.stride(), *rows.stride())


def _sorted_args(topk: torch.Tensor, state_rows: torch.Tensor, state: tuple,
                 rows: torch.Tensor, bufs: Any, counters: Optional[torch.Tensor],
                 sizes: tuple) -> tuple:
    """The positional arguments of the sorted kernel (``state``: the six state tensors;
    ``sizes``: ``(K, S, P, H, num_device_blocks, num_host_blocks)``)."""
    K, S, P, H, num_device_blocks, num_host_blocks = sizes
    cnt = counters if counters is not None else bufs.stats
    return (topk, state_rows, *state, rows, bufs.miss_src, bufs.miss_dst, bufs.miss_count,
            bufs.stats, bufs.touched, bufs.old_slot_rows, bufs.old_lru, bufs.owner, bufs.cls,
            bufs.run_pos, bufs.colbuf, bufs.colm, bufs.keys, bufs.keys2, cnt, bufs.fallback,
            K, S, P, H, *_strides(topk, state_rows, state, rows),
            counters.stride(0) if counters is not None else 0, num_device_blocks,
            num_host_blocks)


def _hash_args(topk: torch.Tensor, state_rows: torch.Tensor, state: tuple,
               rows: torch.Tensor, bufs: Any, counters: Optional[torch.Tensor],
               sizes: tuple) -> tuple:
    """The positional arguments of the hash kernel (as ``_sorted_args``)."""
    K, S, P, H, num_device_blocks, num_host_blocks = sizes
    cnt = counters if counters is not None else bufs.stats
    return (topk, state_rows, *state, rows, bufs.miss_src, bufs.miss_dst, bufs.miss_count,
            bufs.stats, bufs.touched, bufs.old_slot_rows, bufs.old_lru, bufs.owner,
            bufs.fallback, cnt, bufs.table, K, S, P, H,
            *_strides(topk, state_rows, state, rows),
            counters.stride(0) if counters is not None else 0, bufs.table.stride(0),
            num_device_blocks, num_host_blocks)


def _launches(launch: _Launch, topk: torch.Tensor, state_rows: torch.Tensor, state: tuple,
              rows: torch.Tensor, bufs: Any, counters: Optional[torch.Tensor], sizes: tuple,
              one_off: bool) -> tuple[tuple[str, tuple, dict], ...]:
    """``(variant, args, kwargs)`` of every launch of a call, in order: the sorted kernel
    alone, or the hash kernel and its fallback launch (the sorted kernel, ``FLAGGED``)."""
    sorted_args = _sorted_args(topk, state_rows, state, rows, bufs, counters, sizes)
    if launch.variant != "hash":
        return (("sorted", sorted_args, launch.constexprs),)
    return (("hash", _hash_args(topk, state_rows, state, rows, bufs, counters, sizes),
             _hash_call_constexprs(launch, topk, state, rows, one_off)),
            ("sorted", sorted_args, launch.fallback))


class BoundResolve:
    """A resolve whose state tensors never change (a runtime's tables, hot state, counters
    and workspace): what depends only on them and on a call's shape (argument checks, launch
    shape, strides, buffers, the kernels' arguments) is done once per shape and kept, so a
    call on the decode path is a dictionary lookup and its ``kernel[grid](...)`` launches
    (Triton's own launch path; under a CUDA graph capture, the launches the graph records):
    one for the sorted kernel, two for the hash kernel (the hash launch and its fallback
    launch, both of grid ``(R,)``).

    ``bound(topk, state_rows, out)`` has the semantics of ``resolve(topk, state_rows,
    seq_lens, ..., counters=counters, out=out, workspace=workspace)``; a call of a new shape
    (or dtype, strides, device, ``out``) runs the full checks first. The state tensors must
    keep their storage and shape (views of a runtime's persistent tables do).
    """

    def __init__(self, seq_lens: torch.Tensor, resident_blocks: torch.Tensor,
                 host_blocks: torch.Tensor, hot_blocks: torch.Tensor,
                 slot_host_rows: torch.Tensor, lru: torch.Tensor, *, block_size: int,
                 num_device_blocks: int, num_host_blocks: int, counters: torch.Tensor,
                 workspace: ResolveWorkspace) -> None:
        self._state = (seq_lens, resident_blocks, host_blocks, hot_blocks, slot_host_rows,
                       lru)
        self._sizes = (block_size, num_device_blocks, num_host_blocks)
        self._counters, self._workspace = counters, workspace
        self._calls: dict[tuple, _BoundCall] = {}

    def _prepare(self, topk: torch.Tensor, state_rows: torch.Tensor,
                 out: torch.Tensor) -> "_BoundCall":
        seq_lens, resident, host, hot, slot_rows, lru = self._state
        block_size, num_device_blocks, num_host_blocks = self._sizes
        counters, workspace = self._counters, self._workspace
        R, K, S, P, _, H = _check_resolve_args(
            topk, state_rows, seq_lens, resident, host, hot, slot_rows, lru, block_size,
            num_device_blocks, num_host_blocks, counters, out, workspace)
        if not topk.is_cuda:
            _check_backend(topk.device)
        launch = _launch(K, H, block_size, num_host_blocks, True)
        bufs = workspace.buffers(R, K, H)
        result = ResolveResult(out, *bufs[1:5])
        launches = tuple((variant, args[2:], kwargs) for variant, args, kwargs in _launches(
            launch, topk, state_rows, self._state, out, bufs, counters,
            (K, S, P, H, num_device_blocks, num_host_blocks), False))
        return _BoundCall(R, launches, bufs, result)

    def __call__(self, topk: torch.Tensor, state_rows: torch.Tensor,
                 out: torch.Tensor) -> ResolveResult:
        """Resolve ``topk [R, K]`` for ``state_rows [R] int32`` into ``out [R, K] int32``
        (see the class docstring); returns the call's ``ResolveResult`` (views of the
        workspace and ``out``)."""
        key = (topk.shape, topk.dtype, topk.device, topk.stride(), state_rows.shape,
               state_rows.dtype, state_rows.device, state_rows.stride(), id(out))
        call = self._calls.get(key)
        if call is None or call.result.rows is not out:
            call = self._calls[key] = self._prepare(topk, state_rows, out)
        self._workspace.last = call.bufs
        if call.rows:
            grid = (call.rows,)
            with device_guard(topk):
                for variant, args, kwargs in call.launches:
                    _kernel_of(variant)[grid](topk, state_rows, *args, **kwargs)
        return call.result


class _BoundCall(NamedTuple):
    """A call shape of a ``BoundResolve``: its rows, launches (``(variant, the kernel's
    arguments after topk and state_rows, keywords)`` in order), its workspace buffers and
    result (views of them)."""

    rows: int
    launches: tuple
    bufs: Any
    result: ResolveResult


def resolve_variants(K: int, H: int, block_size: int, num_host_blocks: int
                     ) -> dict[str, dict[str, Any]]:
    """Every kernel variant a call shape can launch, for timing them side by side (what
    ``bench/gpu_check.py`` should call): ``{name: _resolve keywords}``, ``"default"`` first
    (the shape's dispatch), then ``"hash"`` (where it applies) and ``"sorted"``. Each value
    is the keyword set ``_resolve(..., **value)`` takes (``hisparse_triton.ops.resolve.
    variants.time_resolve_variants`` checks and times them)."""
    out: dict[str, dict[str, Any]] = {"default": {}}
    if hash_applies(K, H, block_size, num_host_blocks):
        out["hash"] = {"variant": "hash"}
    out["sorted"] = {"variant": "sorted"}
    return out


def _check_backend(device: torch.device) -> None:
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError(
            f"resolve (triton): tensors are on {device}; the Triton kernels need CUDA tensors, "
            "or TRITON_INTERPRET=1 set before import to run on CPU")


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
    """Triton implementation of ``hisparse_triton.reference.resolve`` (same contract).

    ``topk [R, K]`` (any integer dtype, any strides), ``state_rows [R]``, ``seq_lens [S]``,
    ``resident_blocks / host_blocks [S, P]``, ``hot_blocks [S, HB]``, ``slot_host_rows / lru
    [S, H]`` (int32) on one CUDA device (or CPU under ``TRITON_INTERPRET=1``);
    ``slot_host_rows`` and ``lru`` are updated in place. ``counters [3] int64``, ``out [R, K]
    int32``, ``workspace``: see the reference. One launch, no host synchronisation.
    """
    return _resolve(topk, state_rows, seq_lens, resident_blocks, host_blocks, hot_blocks,
                    slot_host_rows, lru, block_size=block_size,
                    num_device_blocks=num_device_blocks, num_host_blocks=num_host_blocks,
                    counters=counters, out=out, workspace=workspace)


def _resolve(
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
    sort_width: Optional[int] = None,
    block_h: Optional[int] = None,
    num_warps: Optional[int] = None,
    gather_search: Optional[bool] = None,
    block_r: int = 256,
    variant: Optional[str] = None,
    probes: Optional[int] = None,
    hash_mul: Optional[int] = None,
) -> ResolveResult:
    """``resolve`` with launch knobs (tests use small ones to exercise the merge passes and
    several LRU steps per row; a GPU sweep can tune them): ``sort_width`` keys sorted in
    registers (a power of two, default ``MAX_SORT_WIDTH``), ``block_h`` LRU positions per
    step (a power of two, default ``min(next_pow2(H), MAX_BLOCK_H)``), ``num_warps`` (default
    16 for tiles of 2048 and more, 8 for 1024, else 4), ``gather_search`` (default
    ``GATHER_SEARCH``), ``block_r`` earlier rows scanned per step for repeated state rows;
    ``variant`` (``"hash"`` / ``"sorted"``, default by shape: see the module docstring),
    ``probes`` (the hash kernel's insertion rounds before its sorted fallback) and ``hash_mul``
    (its hash multiplier; 0 sends every key to one entry: forced collisions)."""
    state = (seq_lens, resident_blocks, host_blocks, hot_blocks, slot_host_rows, lru)
    dims = _check_resolve_args(topk, state_rows, *state, block_size, num_device_blocks,
                               num_host_blocks, counters, out, workspace)
    if not topk.is_cuda:
        _check_backend(topk.device)
    launches, result = _describe(dims, topk, state_rows, state, block_size, num_device_blocks,
                                 num_host_blocks, counters, out, workspace, sort_width,
                                 block_h, num_warps, gather_search, block_r, variant, probes,
                                 hash_mul)
    if launches:
        with device_guard(topk):
            for launch in launches:
                launch()
    return result


def resolve_launch(topk: torch.Tensor, state_rows: torch.Tensor, seq_lens: torch.Tensor,
                   resident_blocks: torch.Tensor, host_blocks: torch.Tensor,
                   hot_blocks: torch.Tensor, slot_host_rows: torch.Tensor, lru: torch.Tensor,
                   *, block_size: int, num_device_blocks: int, num_host_blocks: int,
                   counters: Optional[torch.Tensor] = None, out: Optional[torch.Tensor] = None,
                   workspace: Optional[ResolveWorkspace] = None, **knobs: Any
                   ) -> tuple[tuple[KernelLaunch, ...], ResolveResult]:
    """The launches ``_resolve`` makes for these arguments, in order (checked the same way;
    the launch knobs of ``_resolve`` as keywords), without making them, and the result they
    would fill: one launch for the sorted kernel, two for the hash kernel (the hash launch,
    then its fallback launch: the sorted kernel with ``FLAGGED=True``, which resolves the
    rows the first one flagged and returns at once for the others); ``()`` for zero rows.
    Needs no GPU (the compile report compiles them)."""
    state = (seq_lens, resident_blocks, host_blocks, hot_blocks, slot_host_rows, lru)
    dims = _check_resolve_args(topk, state_rows, *state, block_size, num_device_blocks,
                               num_host_blocks, counters, out, workspace)
    names = ("sort_width", "block_h", "num_warps", "gather_search", "block_r", "variant",
             "probes", "hash_mul")
    unknown = set(knobs) - set(names)
    if unknown:
        raise TypeError(f"resolve_launch: unknown keyword(s) {sorted(unknown)}")
    values = dict(dict.fromkeys(names), block_r=256, **knobs)
    return _describe(dims, topk, state_rows, state, block_size, num_device_blocks,
                     num_host_blocks, counters, out, workspace,
                     *(values[name] for name in names))


def _describe(dims: tuple, topk: torch.Tensor, state_rows: torch.Tensor, state: tuple,
              block_size: int, num_device_blocks: int, num_host_blocks: int,
              counters: Optional[torch.Tensor], out: Optional[torch.Tensor],
              workspace: Optional[ResolveWorkspace], sort_width: Optional[int],
              block_h: Optional[int], num_warps: Optional[int], gather_search: Optional[bool],
              block_r: int, variant: Optional[str], probes: Optional[int],
              hash_mul: Optional[int]) -> tuple[tuple[KernelLaunch, ...], ResolveResult]:
    """``resolve_launch`` once the arguments are checked (``dims``: what the checks
    returned)."""
    R, K, S, P, _, H = dims
    has_counters = counters is not None
    launch = _launch(K, H, block_size, num_host_blocks, has_counters, sort_width, block_h,
                     num_warps, gather_search, block_r, variant, probes, hash_mul)
    if workspace is not None:
        bufs = workspace.buffers(R, K, H)
        workspace.last = bufs
    else:
        bufs = ResolveWorkspace.allocate(R, K, H, topk.device)
    rows = out if out is not None else bufs.rows
    result = ResolveResult(rows, *bufs[1:5])
    if R == 0:
        return (), result
    return tuple(KernelLaunch(_kernel_of(variant), (R,), args, kwargs)
                 for variant, args, kwargs in _launches(
                     launch, topk, state_rows, state, rows, bufs, counters,
                     (K, S, P, H, num_device_blocks, num_host_blocks),
                     workspace is None)), result
