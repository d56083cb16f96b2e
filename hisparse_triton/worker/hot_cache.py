"""The hot cache of every index group, and the worker's one door to the ops and kernels.

Per index group (``HotCache``): ``slot_host_rows [S, H]`` (host row held by each slot, -1
empty), ``lru [S, H]`` (slot ids, least recently used first) and ``counters [3] int64``
(hits, misses, masked): views of the stacked ``HotState`` (``[G, S, H]``, ``[G, 3]``), so a
plan's resets clear every group's rows with one write. ``HotCache.resolve`` is the decode
call: the resolve (rows, the miss plan, the counters: one launch, or the hash launch and
its fallback launch) and ONE gather launch of the misses into the hot rows of all of the
group's layers; on the Triton backend both are bound to the group's fixed tensors
(``BoundResolve`` / ``BoundCopy``: checks and launch arguments once per shape), so a call is
its shape checks, two lookups and its ``kernel[grid](...)`` launches, and the same launches
are what a CUDA graph captures. When the gather raises,
the resolve is undone (hot state and counters).

Every call the worker makes into ``hisparse_triton.ops`` or ``hisparse_triton.kernels`` is in
this module: ``kernel_backend``, ``new_workspace``, ``validate_tables``, ``copy_rows``,
``MirrorCopy`` (the mirror's copies, bound per table pair on Triton), ``launch_config_source``
and ``HotCache``.
"""

from __future__ import annotations

from types import ModuleType
from typing import TYPE_CHECKING, Iterable, NamedTuple, Optional

import torch

from hisparse_triton.groups import IndexGroup
from hisparse_triton.row_table import RowTable
from hisparse_triton.worker.layers import PoolLayers
from hisparse_triton.worker.placement import on_device
from hisparse_triton.worker.tables import PlanTables

if TYPE_CHECKING:  # pragma: no cover
    from hisparse_triton.ops import ResolveWorkspace
    from hisparse_triton.worker.split_gather import SplitGather

__all__ = ["DEFAULT_GATHER_PROGRAMS_PER_SM", "HostEvent", "HotCache", "HotState", "MirrorCopy",
           "StreamRows", "check_programs_per_sm", "check_topk", "copy_rows", "kernel_backend",
           "launch_config_source", "load_ops", "new_workspace", "split_copy",
           "validate_tables"]


#: Default grid budget of the decode path's gathers, programs per SM (``BoundCopy``'s
#: ``programs_per_sm``): 4 programs of 4 warps use a quarter of an H100 / H200 SM's warp
#: slots and keep 132 x 4 x 8 rows in flight, far above what one PCIe link needs to run at
#: full speed (a model; ``bench/gpu_check.py`` times capped against uncapped gathers).
DEFAULT_GATHER_PROGRAMS_PER_SM = 4


def check_programs_per_sm(value: object) -> int:
    """``value`` as a grid budget (an int >= 0; 0 = none); ``ValueError`` naming it
    otherwise."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"gather_programs_per_sm must be an int >= 0 (0 = no budget), got "
                         f"{value!r}.")
    return value


def load_ops() -> ModuleType:
    """``hisparse_triton.ops`` (imported on first use: importing it registers the
    ``torch.library`` ops)."""
    from hisparse_triton import ops

    return ops


def kernel_backend(backend: str, device: torch.device) -> str:
    """``"triton"`` or ``"torch"``: what ``backend`` means on ``device``; ``ValueError`` when
    the Triton backend cannot run there."""
    ops = load_ops()
    try:
        return ops.select_backend(backend, device)
    except ops.BackendUnavailableError as exc:
        raise ValueError(str(exc)) from None


def new_workspace(device: torch.device) -> "ResolveWorkspace":
    """A ``ResolveWorkspace``: scratch and miss plan shared by the resolves of one worker
    (they run one after another on a stream)."""
    return load_ops().ResolveWorkspace(device)


def validate_tables(tables: Iterable[RowTable], device: torch.device) -> None:
    """Check every table for ``device`` now (reads their offsets on the host), so that the
    decode path never does it on first use."""
    ops = load_ops()
    for table in tables:
        ops.validate_table(table, device)


def copy_rows(dst: RowTable, src: RowTable, src_rows: torch.Tensor, dst_rows: torch.Tensor,
              counts: Optional[torch.Tensor] = None, *, backend: Optional[str]) -> None:
    """``hisparse_triton.ops.copy_rows`` (the mirror's device -> host copy)."""
    load_ops().copy_rows(dst, src, src_rows, dst_rows, counts, backend=backend)


def split_copy(backend: str, device: torch.device, *, programs_per_sm: int = 0):
    """The copy a ``SplitGather`` runs: ``copy_rows(dst, src, src_rows, dst_rows, counts)``
    on the worker's backend (``kernel_backend(backend, device)``); on Triton through a
    ``MirrorCopy`` (a ``BoundCopy`` per table pair) at ``programs_per_sm`` (the decode
    gathers' grid budget, which leaves SMs to the exchange running beside the pulls).
    ``copy.set_programs_per_sm(n)`` changes the budget."""
    kernel = kernel_backend(backend, device)
    copier = MirrorCopy(kernel, programs_per_sm=programs_per_sm)

    def copy(dst: RowTable, src: RowTable, src_rows: torch.Tensor, dst_rows: torch.Tensor,
             counts: Optional[torch.Tensor] = None) -> None:
        copier(dst, src, src_rows, dst_rows, counts, backend=kernel)

    copy.set_programs_per_sm = copier.set_programs_per_sm   # type: ignore[attr-defined]
    return copy


def make_split_gather(enabled: object, group: object, device: torch.device, backend: str, *,
                      fraction: "float | str", chunks: int,
                      programs_per_sm: int = 0) -> Optional["SplitGather"]:
    """The worker's ``SplitGather`` over ``group`` (``worker.split_gather``) when ``enabled``
    (a bool; ``ValueError`` otherwise), with ``split_copy``'s copies; None when not."""
    if not isinstance(enabled, bool):
        raise ValueError(f"split_gather must be a bool, got {enabled!r}.")
    if not enabled:
        return None
    from hisparse_triton.worker.split_gather import SplitGather

    return SplitGather(group, device, split_copy(backend, device,
                                                 programs_per_sm=programs_per_sm),
                       fraction=fraction, chunks=chunks)


class HostEvent:
    """The side-stream mode's event on a CPU worker: work runs in order on the CPU, so
    there is nothing to wait for. The API of ``torch.cuda.Event`` (``record``, ``wait``,
    ``query``, ``synchronize``), every method a no-op (``query()`` is always True)."""

    def record(self, stream: Optional[object] = None) -> None:
        return None

    def wait(self, stream: Optional[object] = None) -> None:
        return None

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None


class StreamRows(NamedTuple):
    """What ``resolve_rows(..., stream=)`` returns: ``rows`` (the resolved rows, as without a
    stream) and ``events``: per layer of the index group (leader first), the event its
    attention waits on before reading ``rows`` and the hot rows (the leader's after the
    leader's gather, every follower's after the followers' gather)."""

    rows: torch.Tensor
    events: dict[str, object]

    def wait(self, layer: str, stream: Optional[object] = None) -> None:
        """Make ``stream`` (default: the current one) wait until ``layer``'s rows are in."""
        self.events[layer].wait(stream)


class MirrorCopy:
    """``copy_rows(dst, src, src_rows, dst_rows, counts=None, *, backend)`` for plans that
    are new tensors every call (the mirror's rows: views of a step's packed plan). On the
    Triton backend, outside tracing, each table pair gets a ``BoundCopy``: checks and launch
    arguments once per plan layout, then one ``kernel[grid](...)`` launch per call;
    otherwise ``ops.copy_rows``. ``kernel``: the worker's resolved backend (``"triton"`` or
    ``"torch"``); ``programs_per_sm``: the bound copies' grid budget (0 = none)."""

    def __init__(self, kernel: str, *, programs_per_sm: int = 0) -> None:
        self.kernel = kernel
        self.programs_per_sm = programs_per_sm
        self._bound: dict[tuple[int, int], tuple] = {}
        self._ops: Optional[ModuleType] = None   # hisparse_triton.ops, on first use

    def set_programs_per_sm(self, programs_per_sm: int) -> None:
        """The grid budget of the bound copies (``BoundCopy``'s ``programs_per_sm``); they
        bind again on their next call."""
        self.programs_per_sm = programs_per_sm
        self._bound.clear()

    def __call__(self, dst: RowTable, src: RowTable, src_rows: torch.Tensor,
                 dst_rows: torch.Tensor, counts: Optional[torch.Tensor] = None, *,
                 backend: Optional[str]) -> None:
        ops = self._ops
        if ops is None:
            ops = self._ops = load_ops()
        if self.kernel != "triton" or not ops.is_eager((src_rows, dst_rows, counts)):
            copy_rows(dst, src, src_rows, dst_rows, counts, backend=backend)
            return
        key = (id(dst), id(src))
        entry = self._bound.get(key)
        if entry is None or entry[0] is not dst or entry[1] is not src:
            from hisparse_triton.kernels.gather import BoundCopy

            # the direction names the launch config, as ops.copy_rows does
            kernel = "backup" if dst.pool.is_cpu and not src.pool.is_cpu else "gather"
            entry = self._bound[key] = (dst, src, BoundCopy(
                dst, src, pages=False, kernel=kernel, programs_per_sm=self.programs_per_sm))
        entry[2](src_rows, dst_rows, counts)


def launch_config_source(kernel: str, device: torch.device) -> str:
    """Where the transfer kernels' launch configs come from, for a start-up log line."""
    if kernel != "triton":
        return "launch configs: not used (reference ops)"
    if device.type != "cuda":
        return "launch configs: built-in defaults"
    from hisparse_triton import tuning_cache

    if tuning_cache.disabled():
        return "launch configs: built-in defaults (tuning cache disabled)"
    cache = tuning_cache.load_current()
    if cache.entries:
        return f"launch configs: tuned ({len(cache.entries)} entries in {cache.path})"
    return f"launch configs: built-in defaults (no tuning cache at {cache.path})"


def check_topk(topk: object, *, device_buffer_size: int, max_decode_query_len: int) -> None:
    """``ValueError`` unless ``topk`` is an integer ``[R, K]`` tensor, or ``[R, Q, K]`` with
    ``1 <= Q <= max_decode_query_len``, whose ``Q * K`` columns fit ``device_buffer_size``."""
    if not isinstance(topk, torch.Tensor) or topk.dim() not in (2, 3):
        raise ValueError(f"topk must be a [rows, k] or [rows, q, k] tensor, got "
                         f"{type(topk).__name__} of shape "
                         f"{tuple(getattr(topk, 'shape', ()))}.")
    if topk.dtype.is_floating_point or topk.dtype.is_complex or topk.dtype == torch.bool:
        raise ValueError(f"topk must hold integer positions, got {topk.dtype}.")
    if topk.dim() == 3:
        q = topk.shape[1]
        if not 1 <= q <= max_decode_query_len:
            raise ValueError(f"topk [rows, q, k] has q={q} query tokens per request; "
                             f"max_decode_query_len is {max_decode_query_len}.")
    width = topk.shape[-1] * (topk.shape[1] if topk.dim() == 3 else 1)
    if not 1 <= width <= device_buffer_size:
        raise ValueError(f"top-k width {width} (q x k) must be in [1, device_buffer_size="
                         f"{device_buffer_size}].")


@torch.inference_mode(False)
def _new_rows(R: int, K: int, device: torch.device) -> torch.Tensor:
    """A persistent ``[R, K] int32`` output (an ordinary tensor whatever the caller's mode)."""
    return torch.empty(R, K, dtype=torch.int32, device=device)


class HotState:
    """The hot state of every index group, stacked: ``slot_host_rows [G, S, H] int32`` (-1 =
    empty), ``lru [G, S, H] int32`` (every row starts in slot order) and ``counters [G, 3]
    int64``. Resets of state rows (a ``RowState`` for ``PlanTables``) clear every group."""

    def __init__(self, num_groups: int, max_num_seqs: int, slots: int,
                 device: torch.device) -> None:
        G, S, H = num_groups, max_num_seqs, slots
        self.lru_identity = torch.arange(H, dtype=torch.int32, device=device)
        self.slot_host_rows = torch.full((G, S, H), -1, dtype=torch.int32, device=device)
        self.lru = self.lru_identity.repeat(G, S, 1)
        self.counters = torch.zeros(G, 3, dtype=torch.int64, device=device)

    @staticmethod
    def nbytes(num_groups: int, max_num_seqs: int, slots: int) -> int:
        """Device bytes of the hot state of ``num_groups`` groups."""
        return 2 * 4 * num_groups * max_num_seqs * slots + 4 * slots + 8 * 3 * num_groups

    def snapshot(self) -> dict[str, list]:
        """The hot state and counters as CPU lists (a device sync on CUDA)."""
        return {"slot_host_rows": self.slot_host_rows.cpu().tolist(),
                "lru": self.lru.cpu().tolist(), "counters": self.counters.cpu().tolist()}

    def save_rows(self, rows: torch.Tensor) -> tuple:
        return self.slot_host_rows[:, rows].clone(), self.lru[:, rows].clone()

    def reset_rows(self, rows: torch.Tensor) -> None:
        self.slot_host_rows[:, rows] = -1
        self.lru[:, rows] = self.lru_identity

    def restore_rows(self, rows: torch.Tensor, saved: tuple) -> None:
        slots, lru = saved
        self.slot_host_rows[:, rows] = slots
        self.lru[:, rows] = lru

    def invalidate(self, rows: torch.Tensor, entry_row: torch.Tensor, lo: torch.Tensor,
                   hi: torch.Tensor) -> None:
        """Empty the hot slots that hold dropped host rows (a plan's ``invalidate``).

        ``rows [u]``: distinct state rows; entry ``e`` empties, in every group, each slot of
        state row ``rows[entry_row[e]]`` holding a host row in ``[lo[e], hi[e])``
        (``entry_row``, ``lo``, ``hi``: ``[n]`` integer tensors). Each touched row's LRU
        order then lists its empty slots first, then its held ones, both in their previous
        order (a stable partition: still a permutation; empty slots are reused first). A
        few whole-tensor ops on the device: no host sync, no loop per entry."""
        entry_row = entry_row.long()
        slots = self.slot_host_rows[:, rows]                       # [G, u, H]
        held = slots[:, entry_row]                                 # [G, n, H]
        dropped = (held >= lo.view(1, -1, 1)) & (held < hi.view(1, -1, 1))
        hits = torch.zeros(slots.shape, dtype=torch.int32, device=slots.device)
        hits.index_add_(1, entry_row, dropped.to(torch.int32))
        slots = torch.where(hits > 0, torch.full_like(slots, -1), slots)
        lru = self.lru[:, rows]                                    # [G, u, H] slot ids
        held_at = slots.gather(2, lru.long()) >= 0                 # by LRU position
        key = held_at.to(torch.int32) * lru.shape[2] + self.lru_identity
        self.lru[:, rows] = lru.gather(2, key.argsort(dim=2))
        self.slot_host_rows[:, rows] = slots


class HotCache:
    """One index group's hot cache (see the module docstring).

    - ``group``: the index group; ``resident_table`` / ``hot_table``: its resident and hot
      block tables ``[S, P]`` / ``[S, HB]`` int32; ``seq_lens [S]``, ``host_blocks [S, P]``:
      the request tables it reads (views of the worker's arena).
    - ``device_table`` / ``host_table``: its layers' rows in the device / host pool;
      ``row_bytes``: bytes of one row of one layer.
    - ``state``: the stacked ``HotState`` (the cache holds views of its ``group.number``
      entries); ``workspace``: the shared ``ResolveWorkspace``; ``kernel``: ``"triton"`` or
      ``"torch"``; the sizes: what the resolve checks block ids against.
    """

    def __init__(self, group: IndexGroup, *, seq_lens: torch.Tensor,
                 host_blocks: torch.Tensor, resident_table: torch.Tensor,
                 hot_table: torch.Tensor, device_table: RowTable, host_table: RowTable,
                 row_bytes: int, state: HotState, workspace: "ResolveWorkspace", kernel: str,
                 block_size: int, num_device_blocks: int, num_host_blocks: int,
                 gather_programs_per_sm: int = 0,
                 split_tables: Optional[tuple[tuple[RowTable, RowTable],
                                              tuple[RowTable, RowTable]]] = None,
                 split_gather: Optional["SplitGather"] = None) -> None:
        self.group = group
        #: the tensor-parallel ranks' split of every gather (``worker.split_gather``)
        self.split_gather = split_gather
        self.gather_programs_per_sm = gather_programs_per_sm
        #: ``((leader device, host), (followers device, host))`` tables: the side-stream
        #: mode gathers the leader's rows first, then the followers' (None: no followers).
        self.split_tables = split_tables
        self._events: Optional[tuple] = None     # side-stream mode: (ready, leader, followers)
        self._split_gathers: Optional[tuple] = None
        self.seq_lens, self.host_blocks = seq_lens, host_blocks
        self.resident_table, self.hot_table = resident_table, hot_table
        self.device_table, self.host_table, self.row_bytes = device_table, host_table, row_bytes
        self.slot_host_rows = state.slot_host_rows[group.number]
        self.lru = state.lru[group.number]
        self.counters = state.counters[group.number]
        self.workspace, self.kernel = workspace, kernel
        self._reference = kernel == "torch"   # the reference ops: rows saved before a call
        self.sizes = dict(block_size=block_size, num_device_blocks=num_device_blocks,
                          num_host_blocks=num_host_blocks)
        self.device = seq_lens.device
        self.rows_out: Optional[torch.Tensor] = None   # [R, K] the last call's rows
        self.rows_view: Optional[torch.Tensor] = None  # it, in the shape returned
        self._ops = load_ops()
        self.bound = self.bound_gather = None
        if kernel == "triton":
            from hisparse_triton.kernels.resolve import BoundResolve

            self.bound = BoundResolve(seq_lens, resident_table, host_blocks, hot_table,
                                      self.slot_host_rows, self.lru, counters=self.counters,
                                      workspace=workspace, **self.sizes)
            self._bind_gathers()

    def _bind_gathers(self) -> None:
        """The bound gathers (``BoundCopy``, Triton only) at ``gather_programs_per_sm``: the
        whole group's, and the leader's and followers' of the side-stream mode."""
        from hisparse_triton.kernels.gather import BoundCopy

        def bound(dev: RowTable, host: RowTable) -> "BoundCopy":
            return BoundCopy(dev, host, pages=False, kernel="gather",
                             programs_per_sm=self.gather_programs_per_sm)

        self.bound_gather = bound(self.device_table, self.host_table)
        if self.split_tables is not None:
            self._split_gathers = tuple(bound(dev, host) for dev, host in self.split_tables)

    def set_gather_programs_per_sm(self, programs_per_sm: int) -> None:
        """Change the gathers' grid budget (``BoundCopy``'s ``programs_per_sm``; 0 = none):
        the bound gathers are made again and bind on their next call."""
        self.gather_programs_per_sm = check_programs_per_sm(programs_per_sm)
        if self.bound_gather is not None:
            self._bind_gathers()

    @classmethod
    def for_group(cls, group: IndexGroup, tables: PlanTables, layers: PoolLayers,
                  state: HotState, workspace: "ResolveWorkspace", kernel: str, *,
                  gather_programs_per_sm: int = 0,
                  split_gather: Optional["SplitGather"] = None) -> "HotCache":
        """The hot cache of ``group`` over a worker's tables, pools and hot state."""
        device_table, host_table, row_bytes = layers.row_tables(group.layers)
        split = None
        if len(group.layers) > 1:
            split = (layers.row_tables(group.layers[:1])[:2],
                     layers.row_tables(group.layers[1:])[:2])
        return cls(group, seq_lens=tables.seq_lens, host_blocks=tables.host_blocks,
                   resident_table=tables.group_tables[group.resident],
                   hot_table=tables.group_tables[group.hot], device_table=device_table,
                   host_table=host_table, row_bytes=row_bytes, state=state,
                   workspace=workspace, kernel=kernel, block_size=layers.block_size,
                   num_device_blocks=layers.num_device_blocks,
                   num_host_blocks=layers.num_host_blocks,
                   gather_programs_per_sm=gather_programs_per_sm, split_tables=split,
                   split_gather=split_gather)

    @property
    def layers(self) -> tuple[str, ...]:
        """The group's sparse layers, leader first."""
        return self.group.layers

    @property
    def tables(self) -> tuple[RowTable, RowTable]:
        """``(device_table, host_table)``: what the gather copies between."""
        return self.device_table, self.host_table

    @property
    def bytes_per_miss(self) -> int:
        """Bytes one gathered host row moves: a row of the leader and of every follower."""
        return self.row_bytes * len(self.group.layers)

    def resolve(self, state_rows: torch.Tensor, topk: torch.Tensor, *,
                stream: Optional[object] = None) -> "torch.Tensor | StreamRows":
        """Rows of ``topk`` (``[R, K]``, or ``[R, Q, K]``: each request's Q selections as one
        union; checked by ``check_topk``) for ``state_rows [R] int32``; gathers the misses.
        CPU inputs of a CUDA cache are staged without a host sync. Returns the group's
        persistent output in the shape of ``topk``; ``ValueError`` for bad ``state_rows``.

        ``stream`` (the side-stream mode): run the resolve and the gathers on ``stream``
        after what the current stream enqueued so far, the leader's rows gathered first and
        the followers' after, and return ``StreamRows(rows, events)``: ``events[layer]`` is
        what that layer's attention waits on (``events[layer].wait()`` on its stream). No
        host sync, no device allocation after the first call (persistent events): capturable in a
        CUDA graph. On a CPU worker ``stream`` is a ``torch.cpu.Stream``, the work runs in
        order and the events are ``HostEvent`` no-ops (same API)."""
        if stream is None:
            return self._resolve(state_rows, topk, split=False)
        events = self._stream_events(stream)
        ready, leader_done, followers_done = events
        if self.device.type == "cuda":
            ready.record()            # the caller's stream: top-k and tables written
            ready.wait(stream)
            with torch.cuda.stream(stream):
                rows = self._resolve(state_rows, topk, split=True, events=events)
        else:
            rows = self._resolve(state_rows, topk, split=True, events=events)
        layers = self.group.layers
        return StreamRows(rows, {layer: (leader_done if i == 0 else followers_done)
                                 for i, layer in enumerate(layers)})

    def _stream_events(self, stream: object) -> tuple:
        """The persistent ``(ready, leader, followers)`` events of the side-stream mode;
        ``ValueError`` when ``stream`` is not a stream of this cache's device."""
        if self.device.type == "cuda":
            if not isinstance(stream, torch.cuda.Stream) or stream.device != self.device:
                raise ValueError(f"stream must be a torch.cuda.Stream on {self.device}, got "
                                 f"{stream!r}.")
        elif not isinstance(stream, torch.cpu.Stream):
            raise ValueError(f"stream must be a torch.cpu.Stream on a CPU worker, got "
                             f"{stream!r}.")
        if self._events is None:
            make = torch.cuda.Event if self.device.type == "cuda" else HostEvent
            ready, leader = make(), make()
            followers = make() if len(self.group.layers) > 1 else leader
            self._events = (ready, leader, followers)
        return self._events

    def _resolve(self, state_rows: torch.Tensor, topk: torch.Tensor, *, split: bool,
                 events: Optional[tuple] = None) -> torch.Tensor:
        shape = tuple(topk.shape)
        if topk.dim() == 3:  # Q draft tokens' selections resolve as one union per request
            topk = topk.reshape(shape[0], shape[1] * shape[2])
        R, K = topk.shape
        check_state_rows(state_rows, R)
        if R == 0:
            return torch.empty(shape, dtype=torch.int32, device=self.device)
        # No grad-mode context here: only the kernels (or the reference's int ops) touch
        # the cache's tensors, which works inside and outside inference mode alike.
        state_rows = on_device(state_rows, self.device, "state_rows")
        topk = on_device(topk, self.device, "topk")   # any integer dtype: converted in-kernel
        out, view = self.rows_out, self.rows_view
        if out is None or out.shape != (R, K):
            out, view = _new_rows(R, K, self.device), None
        if view is None or view.shape != shape:
            view = out.view(shape) if len(shape) == 3 else out
        self.rows_out, self.rows_view = out, view
        ops = self._ops
        # The reference resolve writes the hot state with several ops: its rows are saved
        # first. The Triton resolve (its launches) keeps the pre-call state in the
        # workspace, which undoes it when the gather raises.
        saved = self._save_rows(state_rows) if self._reference else None
        result = None
        try:
            # (eager: no tracing, no dispatch mode, plain tensors; the miss plan is then the
            # workspace's plain tensors too, so the gather needs no second check)
            eager = self.bound is not None and ops.is_eager((topk, state_rows))
            if eager:
                result = self.bound(topk, state_rows, out)
            else:
                result = ops.resolve(
                    topk, state_rows, self.seq_lens, self.resident_table, self.host_blocks,
                    self.hot_table, self.slot_host_rows, self.lru, **self.sizes,
                    counters=self.counters, out=out, workspace=self.workspace,
                    backend=self.kernel)
            if self.split_gather is not None:   # the TP ranks split it; a collective
                self.split_gather.gather(self.device_table, self.host_table, result.miss_src,
                                         result.miss_dst, result.miss_count)
                if split:
                    for event in events[1:]:
                        event.record()
            elif split:
                self._gather_split(result, events)
            elif self.bound_gather is not None and (eager or ops.is_eager((result.miss_src,))):
                self.bound_gather(result.miss_src, result.miss_dst, result.miss_count)
            else:
                ops.copy_rows(self.device_table, self.host_table, result.miss_src,
                              result.miss_dst, result.miss_count, backend=self.kernel)
            return self.rows_view
        except BaseException:  # undo the resolve: hot state and counters
            self._undo(state_rows, result, saved)
            raise

    def _gather_split(self, result: object, events: tuple) -> None:
        """The side-stream mode's gathers: the leader's layer, its event, then the
        followers' layers (same miss plan), their event."""
        _, leader_done, followers_done = events
        parts = self.split_tables
        if parts is None:   # a leader alone: one gather
            parts = ((self.device_table, self.host_table),)
        bound = self._split_gathers if parts is self.split_tables else (self.bound_gather,)
        ops = self._ops
        for i, (dev, host) in enumerate(parts):
            if bound is not None and bound[i] is not None and ops.is_eager((result.miss_src,)):
                bound[i](result.miss_src, result.miss_dst, result.miss_count)
            else:
                ops.copy_rows(dev, host, result.miss_src, result.miss_dst, result.miss_count,
                              backend=self.kernel)
            (leader_done if i == 0 else followers_done).record()

    def _save_rows(self, state_rows: torch.Tensor) -> tuple:
        """The hot state of ``state_rows`` (padding clamped to a real row) and the
        counters, before a resolve."""
        rows = state_rows.long().clamp(0, self.slot_host_rows.shape[0] - 1)
        return rows, self.slot_host_rows[rows], self.lru[rows], self.counters.clone()

    def _undo(self, state_rows: torch.Tensor, result: object, saved: Optional[tuple]) -> None:
        """Put the hot state and counters back after a resolve whose call raised."""
        if saved is not None:
            rows, slots, lru, counters = saved
            self.slot_host_rows[rows] = slots
            self.lru[rows] = lru
            self.counters.copy_(counters)
        elif result is not None:
            self._ops.restore_resolve_state(self.workspace, state_rows, self.slot_host_rows,
                                            self.lru)
            self.counters -= result.stats.sum(dim=0)


def check_state_rows(state_rows: object, rows: int) -> None:
    """``ValueError`` unless ``state_rows`` is an ``int32 [rows]`` tensor."""
    if (not isinstance(state_rows, torch.Tensor) or state_rows.dtype != torch.int32
            or tuple(state_rows.shape) != (rows,)):
        raise ValueError(f"state_rows must be an int32 tensor [{rows}], got "
                         f"{getattr(state_rows, 'dtype', type(state_rows).__name__)} of "
                         f"shape {tuple(getattr(state_rows, 'shape', ()))}.")
