"""``HiSparseScheduler``: the CPU-only half of the runtime (admission, block tables, residency).

A serving stack runs one scheduler (in its scheduler process) and one ``HiSparseWorker`` per
GPU rank. The scheduler owns every decision and no tensor: the host and device
``BlockPool``s, the request table, which pages of a request are on the GPU, and admission.
Each step it emits one ``StepPlan`` (``step()``) that every worker applies; request ids never
leave the scheduler, only state rows and block ids do. This module imports no torch.

A step, as the stack drives it::

    scheduler.add_request(id, prompt_len, max_new_tokens)   # admission (any time)
    rows = scheduler.append_slots(id, n)    # {layer: int64 [n]} device rows of n new tokens
    scheduler.free_request(id)              # a finished request
    plan = scheduler.step()                 # -> every worker: worker.apply(plan)
    ...  forward: the model writes KV at `rows`, worker.resolve_rows(...) per index group  ...
    ...  worker.mirror(plan) after the forward  ...

``step()`` closes the step: the plan carries every table change since the previous plan
and the tokens appended since then, which the workers mirror to the host pool after the
forward. Those tokens count as durable from the NEXT ``step()`` on (by then every worker has
enqueued their mirror, and work of later steps runs after it on the stream), which is when
the pages they complete may leave the GPU and their blocks be reused.

Residency of a request's resident (sparse-MLA) pages: a page is written on the GPU, mirrored
to the host pool, and once it is durable, sealed and outside the last ``ACTIVE_TAIL_PAGES``
pages it is released: its block goes back to the pool and its table entry becomes 0, so
``resolve`` reads it from the host through the request's hot region. A request gets its hot
region (``blocks_per_request`` blocks in every hot group) with its first release, once at
least ``offload_threshold_pages`` pages can be released (default: the hot region's size, so
offloading never costs more device blocks than it frees); when the pool cannot hold the hot
region the release is deferred to a later step (``stats().deferred_offloads``).

Every public call is all-or-nothing (``journal.transaction()``): a call that raises leaves
the scheduler exactly as it was.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Hashable, Iterable, Optional, Sequence

import numpy as np

from hisparse_triton.block_pool import BlockPool
from hisparse_triton.config import ACTIVE_TAIL_PAGES, EngineConfig
from hisparse_triton.errors import (
    CapacityError,
    DuplicateRequestError,
    ReservationExceededError,
    RuntimeClosedError,
    UnknownRequestError,
)
from hisparse_triton.groups import (
    DeviceGroup,
    HotGroup,
    IndexerGroup,
    PlanGroups,
    ResidentGroup,
)
from hisparse_triton.journal import Journal
from hisparse_triton.specs import KVCacheConfig, cdiv
from hisparse_triton.step_plan import StepPlan, TableLayout

#: Occupancy counters kept per device group kind.
KINDS = ("indexer", "resident", "hot", "regular")


@dataclass(frozen=True)
class SchedulerStats:
    """Pool occupancy and residency counters of a scheduler (``HiSparseScheduler.stats()``).

    - ``*_blocks``: device blocks in use now per kind; ``host_blocks``: host blocks in use;
      ``device_blocks_total`` / ``host_blocks_total``: allocatable blocks.
    - ``peak_device_blocks`` / ``peak_host_blocks``: the most blocks in use at any time.
    - ``num_requests``: live requests; ``deferred_offloads``: steps at which a request kept
      its history on the GPU because the pool had no room for its hot region.
    - ``released_pages``: resident page blocks returned to the pool so far.
    - ``steps``: plans emitted.
    """

    resident_blocks: int
    hot_blocks: int
    host_blocks: int
    indexer_blocks: int
    regular_blocks: int
    device_blocks_total: int
    host_blocks_total: int
    peak_device_blocks: int
    peak_host_blocks: int
    num_requests: int
    deferred_offloads: int
    released_pages: int
    steps: int

    @property
    def device_blocks(self) -> int:
        """Device blocks in use over all groups."""
        return self.indexer_blocks + self.resident_blocks + self.hot_blocks + self.regular_blocks


@dataclass
class _Request:
    request_id: Hashable
    row: int                           # state row
    prompt_len: int
    max_new_tokens: int
    host_blocks: list[int]
    pages: dict[int, np.ndarray]       # paged group position -> [width] int64 block ids
    seq_len: int = 0
    scheduled_len: int = 0             # tokens whose mirror is in an emitted plan
    committed_len: int = 0             # tokens whose mirror is durable
    released_pages: int = 0            # resident pages [0, released_pages) left the GPU
    window_freed: dict[int, int] = field(default_factory=dict)  # sliding group -> pages freed
    hot: Optional[dict[int, list[int]]] = None  # hot group position -> blocks (None: not offloaded)

    @property
    def reserved_tokens(self) -> int:
        return self.prompt_len + self.max_new_tokens


def _int_at_least(name: str, value: object, minimum: int) -> int:
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}.")
    return int(value)


def check_request_id(request_id: object) -> None:
    """``ValueError`` unless ``request_id`` can name a request: hashable, not None (padding),
    not NaN (NaN is never equal to itself, so it could never be found again)."""
    if request_id is None:
        raise ValueError("request_id None is reserved for padding rows.")
    try:
        hash(request_id)
    except TypeError:
        raise ValueError(f"request_id must be hashable, got {request_id!r}.") from None
    if request_id != request_id:  # noqa: PLR0124 - NaN check
        raise ValueError(f"request_id {request_id!r} is not equal to itself (NaN); use a "
                         f"str or int id.")


def check_id_list(request_ids: object) -> None:
    """A batch's ids must be a sequence (list/tuple), one per batch row: a lone str would be
    split into characters and a set or dict has no row order."""
    if isinstance(request_ids, (str, bytes)) or not isinstance(request_ids, Sequence):
        raise ValueError(f"request_ids must be a list or tuple of request ids (one per batch "
                         f"row), got {type(request_ids).__name__} {request_ids!r}.")


class HiSparseScheduler:
    """The CPU-only scheduler half of HiSparse (see the module docstring).

    - ``kv_cache_config``: from ``get_hisparse_kv_cache_config``; ``config``: the
      ``EngineConfig`` it was planned for (``config.hisparse`` set).
    - ``max_num_seqs``: live requests at most (state rows of the workers' tables).
    - ``offload_threshold_pages``: a request's history leaves the GPU (and it gets its hot
      region) once at least this many of its pages can be released; default: the hot
      region's blocks. ``1`` offloads as early as possible.
    """

    def __init__(self, kv_cache_config: KVCacheConfig, config: EngineConfig, *,
                 max_num_seqs: int, offload_threshold_pages: Optional[int] = None) -> None:
        if not isinstance(config, EngineConfig) or config.hisparse is None:
            raise ValueError("HiSparseScheduler needs an EngineConfig with hisparse set.")
        if not isinstance(kv_cache_config, KVCacheConfig):
            raise ValueError(f"kv_cache_config must be a KVCacheConfig, got "
                             f"{type(kv_cache_config).__name__}.")
        self.config = config
        self.kv_cache_config = kv_cache_config
        self.max_num_seqs = _int_at_least("max_num_seqs", max_num_seqs, 1)
        self.max_model_len = config.max_model_len
        self.device_buffer_size = int(config.hisparse.device_buffer_size)
        self.groups = PlanGroups.from_config(kv_cache_config, config)
        self.block_size = self.groups.block_size
        self.layout = TableLayout.build(self.groups, self.max_num_seqs)
        self.hot_blocks_per_request = self.groups.hot_blocks_per_request
        hot_widths = [g.width for g in self.groups.hot]
        if hot_widths and min(hot_widths) * self.block_size < self.device_buffer_size:
            raise ValueError(f"hot groups hold {min(hot_widths)} blocks of {self.block_size} "
                             f"rows, fewer than device_buffer_size={self.device_buffer_size}.")
        self.offload_threshold_pages = (
            self.hot_blocks_per_request if offload_threshold_pages is None
            else _int_at_least("offload_threshold_pages", offload_threshold_pages, 1))
        self.num_device_blocks = kv_cache_config.num_blocks
        self.num_host_blocks = kv_cache_config.hisparse_host_num_blocks
        if self.num_host_blocks < 2:
            raise ValueError(f"the host pool needs at least 2 blocks (the null block and one "
                             f"page), the plan has {self.num_host_blocks}.")
        self.journal = Journal()
        self.device_block_pool = BlockPool(self.num_device_blocks, "device", self.journal)
        self.host_block_pool = BlockPool(self.num_host_blocks, "host", self.journal)

        self._resident = self.groups.resident
        self._hot = self.groups.hot
        self._paged = self.groups.paged
        # The names append_slots reports rows under, per paged group (model layer names).
        self._row_names = [group.model_layer_names if isinstance(group, ResidentGroup)
                           else group.layer_names for group in self._paged]
        self._requests: dict[Hashable, _Request] = {}
        self._free_rows = list(range(self.max_num_seqs - 1, -1, -1))  # pop() -> lowest row
        # Pending plan: state rows to reset, and table writes (flat index -> value; a later
        # write of the same entry wins, and a reset drops the row's earlier writes).
        self._resets: dict[int, None] = {}
        self._writes: dict[int, int] = {}
        self._step = 0
        self._counts = {"in_use": dict.fromkeys(KINDS, 0), "peak_device": 0, "peak_host": 0,
                        "deferred_offloads": 0, "released_pages": 0}
        self._closed = False

    # ------------------------------------------------------------------ queries
    @property
    def leaders(self) -> list[str]:
        """Index-group leader layers (what ``resolve_rows`` takes), in model order."""
        return list(self.groups.leaders)

    @property
    def index_groups(self) -> list[tuple[str, ...]]:
        """Every index group's sparse layers, leader first."""
        return [ig.layers for ig in self.groups.index_groups]

    @property
    def source_layers(self) -> tuple[str, ...]:
        return self.groups.source_layers

    @property
    def device_layers(self) -> list[str]:
        """Model layer names ``append_slots`` returns rows for."""
        return self.groups.device_layers

    @property
    def has_pending_changes(self) -> bool:
        """Whether table changes wait for the next plan."""
        return bool(self._resets or self._writes)

    @property
    def step_count(self) -> int:
        """Plans emitted so far (the next plan's ``step`` is this + 1)."""
        return self._step

    def has_request(self, request_id: Hashable) -> bool:
        try:
            return request_id in self._requests
        except TypeError:
            return False

    @property
    def request_ids(self) -> list[Hashable]:
        return list(self._requests)

    def seq_len(self, request_id: Hashable) -> int:
        """Tokens appended so far."""
        return self._request(request_id).seq_len

    def state_row(self, request_id: Hashable) -> int:
        """The request's row in the workers' per-request tables."""
        return self._request(request_id).row

    def state_rows(self, request_ids: Sequence[Optional[Hashable]]) -> np.ndarray:
        """``[R] int32`` state rows (-1 for ``None`` = padding); ``DuplicateRequestError`` for
        an id named twice, ``UnknownRequestError`` for an unknown one."""
        self._check_open()
        check_id_list(request_ids)
        rows, seen = [], set()
        for request_id in request_ids:
            if request_id is None:
                rows.append(-1)
                continue
            row = self._request(request_id, "resolve").row
            if row in seen:
                raise DuplicateRequestError(f"request {request_id!r} appears twice in one "
                                            f"batch.", request_id)
            seen.add(row)
            rows.append(row)
        return np.asarray(rows, dtype=np.int32)

    def host_block_table(self, request_id: Hashable) -> list[int]:
        """The request's host blocks, one per reserved page."""
        return list(self._request(request_id).host_blocks)

    def block_table(self, request_id: Hashable, layer_name: str) -> list[int]:
        """The request's device blocks for a layer's group, one per page (hot: its region)."""
        self._check_open()
        req = self._request(request_id)
        group = self.groups.groups[self.groups.layer_group[
            self.groups.device_layer_name(layer_name)]]
        if isinstance(group, HotGroup):
            return list(req.hot[group.position]) if req.hot else []
        return [int(b) for b in req.pages[group.position][:group.pages(req.seq_len)]]

    def stats(self) -> SchedulerStats:
        """Occupancy and residency counters (plain CPU reads)."""
        self._check_open()
        c = self._counts
        return SchedulerStats(
            resident_blocks=c["in_use"]["resident"], hot_blocks=c["in_use"]["hot"],
            host_blocks=self.host_block_pool.num_used,
            indexer_blocks=c["in_use"]["indexer"], regular_blocks=c["in_use"]["regular"],
            device_blocks_total=self.device_block_pool.capacity,
            host_blocks_total=self.host_block_pool.capacity,
            peak_device_blocks=c["peak_device"], peak_host_blocks=c["peak_host"],
            num_requests=len(self._requests), deferred_offloads=c["deferred_offloads"],
            released_pages=c["released_pages"], steps=self._step)

    def reset_stats(self) -> None:
        """Zero the counters; peaks restart from the current occupancy."""
        self._check_open()
        self._counts.update(deferred_offloads=0, released_pages=0,
                            peak_device=self.device_block_pool.num_used,
                            peak_host=self.host_block_pool.num_used)

    # ------------------------------------------------------------------ lifecycle
    def add_request(self, request_id: Hashable, prompt_len: int, max_new_tokens: int) -> None:
        """Admit a request: reserve host pages for ``prompt_len + max_new_tokens`` and a state row.

        ``DuplicateRequestError`` (a ``ValueError``) for a live id; ``ValueError`` for bad
        lengths or more than ``max_model_len`` tokens; ``CapacityError`` when the host pool or
        the state rows (``max_num_seqs``) are full. Nothing changes on error.
        """
        self._check_open()
        check_request_id(request_id)
        if request_id in self._requests:
            raise DuplicateRequestError(f"request {request_id!r} is already live "
                                        f"(seq_len {self._requests[request_id].seq_len}).",
                                        request_id)
        prompt_len = _int_at_least(f"request {request_id!r}: prompt_len", prompt_len, 1)
        max_new_tokens = _int_at_least(f"request {request_id!r}: max_new_tokens",
                                       max_new_tokens, 0)
        total = prompt_len + max_new_tokens
        if total > self.max_model_len:
            raise ValueError(f"request {request_id!r}: prompt_len {prompt_len} + "
                             f"max_new_tokens {max_new_tokens} = {total} exceeds "
                             f"max_model_len {self.max_model_len}.")
        if not self._free_rows:
            raise CapacityError(f"cannot add request {request_id!r}: all {self.max_num_seqs} "
                                f"state rows (max_num_seqs) are in use.",
                                resource="state rows", needed=1, available=0,
                                request_id=request_id)
        pages = cdiv(total, self.block_size)
        if pages > self.host_block_pool.num_free:
            raise CapacityError(
                f"cannot add request {request_id!r}: it needs {pages} host blocks for "
                f"{total} tokens, {self.host_block_pool.num_free} of "
                f"{self.host_block_pool.capacity} are free.", resource="host blocks",
                needed=pages, available=self.host_block_pool.num_free, request_id=request_id)
        j = self.journal
        with j.transaction():
            host_blocks = self.host_block_pool.allocate(pages, request_id=request_id)
            row = j.pop(self._free_rows)
            req = _Request(request_id=request_id, row=row, prompt_len=prompt_len,
                           max_new_tokens=max_new_tokens, host_blocks=host_blocks,
                           pages={g.position: np.zeros(g.width, dtype=np.int64)
                                  for g in self._paged})
            j.setitem(self._requests, request_id, req)
            self._reset_row(row)
            host_col = row * self.layout.width + self.layout.host_col
            for page, block in enumerate(host_blocks):
                j.setitem(self._writes, host_col + page, block)
            self._track_peaks()

    def append_slots(self, request_id: Hashable, num_tokens: int) -> dict[str, np.ndarray]:
        """Allocate device pages for ``num_tokens`` new tokens; where to write their KV.

        Returns ``{layer_name: [num_tokens] int64}`` device rows for every device layer
        (sparse layers under their model name: their resident rows; indexer and regular
        layers); row ``r`` of a layer is ``device_cache(layer)[r // B, r % B]`` on a worker.
        Layers of one group share one array. ``ReservationExceededError`` past
        ``prompt_len + max_new_tokens``; ``CapacityError`` when the device pool is full.
        Nothing changes on error.
        """
        self._check_open()
        req = self._request(request_id, "append_slots")
        num_tokens = _int_at_least(f"request {request_id!r}: num_tokens", num_tokens, 0)
        new_len = req.seq_len + num_tokens
        if new_len > req.reserved_tokens:
            raise ReservationExceededError(
                f"request {request_id!r}: appending {num_tokens} tokens to {req.seq_len} "
                f"exceeds its reservation of {req.reserved_tokens} (prompt {req.prompt_len} + "
                f"max_new_tokens {req.max_new_tokens}).", request_id)
        new_pages = [g.new_pages(req.seq_len, new_len) for g in self._paged]
        needed = sum(new_pages)
        if needed > self.device_block_pool.num_free:
            raise CapacityError(
                f"request {request_id!r}: appending {num_tokens} tokens needs {needed} device "
                f"blocks, {self.device_block_pool.num_free} of "
                f"{self.device_block_pool.capacity} are free.", resource="device blocks",
                needed=needed, available=self.device_block_pool.num_free,
                request_id=request_id)
        j = self.journal
        out: dict[str, np.ndarray] = {}
        with j.transaction():
            base = req.row * self.layout.width
            for group, count, names in zip(self._paged, new_pages, self._row_names):
                pages = req.pages[group.position]
                if count:
                    first = group.pages(req.seq_len)
                    blocks = self._allocate(group, count, request_id)
                    j.write(pages, slice(first, first + count), blocks)
                    col = base + self.layout.group_cols[group.position] + first
                    for i, block in enumerate(blocks):
                        j.setitem(self._writes, col + i, block)
                rows = self._rows(pages, req.seq_len, new_len, group.block_size)
                for name in names:
                    out[name] = rows
            j.setattr(req, "seq_len", new_len)
            j.setitem(self._writes, base + TableLayout.SEQ_LEN_COL, new_len)
            self._track_peaks()
        return out

    @staticmethod
    def _rows(pages: np.ndarray, start: int, end: int, block_size: int) -> np.ndarray:
        """Device rows of positions ``[start, end)`` given a group's block per page."""
        if end - start == 1:  # the decode step: no vector arithmetic
            return np.array([int(pages[start // block_size]) * block_size
                             + start % block_size], dtype=np.int64)
        positions = np.arange(start, end, dtype=np.int64)
        return pages[positions // block_size] * block_size + positions % block_size

    def free_request(self, request_id: Hashable) -> None:
        """Return every host and device block of the request and its state row."""
        self._check_open()
        req = self._request(request_id, "free_request")
        j = self.journal
        with j.transaction():
            self.host_block_pool.free(req.host_blocks)
            for group in self._paged:
                self._free_device(group, req.pages[group.position])
            if req.hot is not None:
                for position, blocks in req.hot.items():
                    self._free_device(self.groups.groups[position], blocks)
            self._reset_row(req.row)
            j.replace_list(self._free_rows, sorted([*self._free_rows, req.row], reverse=True))
            j.delitem(self._requests, request_id)

    def step(self, *, mirror: bool = True, release: bool = True) -> StepPlan:
        """Close a step: emit the plan every worker applies (see the module docstring).

        1. Tokens of earlier plans' mirrors become durable. With ``release=True``, pages that
           durable tokens sealed are released (resident pages outside the active tail, with
           the hot region on a request's first release; sliding-window pages out of every
           future window); their table changes join this plan.
        2. With ``mirror=True``, every token appended since the last mirrored plan is in this
           plan's mirror rows (a worker must ``mirror(plan)`` after the forward);
           ``mirror=False`` only flushes table changes (its tokens go into a later plan).
        A serving loop calls ``step()`` once per model step with the defaults. (The
        in-process ``HiSparseRuntime`` also flushes table changes mid-step with
        ``mirror=False, release=False``.)
        """
        self._check_open()
        j = self.journal
        with j.transaction():
            released_before = self._counts["released_pages"]
            for req in self._requests.values():
                if req.scheduled_len > req.committed_len:
                    j.setattr(req, "committed_len", req.scheduled_len)
                if release:
                    self._release_resident(req)
                    self._release_window(req)
            host_rows, device_rows = self._mirror_rows() if mirror else (None, None)
            plan = StepPlan.build(
                step=self._step + 1, layout=self.layout.fingerprint, commit=mirror,
                reset_rows=np.fromiter(self._resets, dtype=np.int32, count=len(self._resets)),
                write_index=np.fromiter(self._writes.keys(), dtype=np.int32,
                                        count=len(self._writes)),
                write_value=np.fromiter(self._writes.values(), dtype=np.int32,
                                        count=len(self._writes)),
                mirror_host_rows=host_rows if host_rows is not None else np.zeros(0, np.int32),
                mirror_device_rows=(device_rows if device_rows is not None
                                    else np.zeros((len(self._resident), 0), np.int32)),
                lost=np.zeros((0, 3), dtype=np.int32),
                released_pages=self._counts["released_pages"] - released_before)
            j.setattr(self, "_resets", {})
            j.setattr(self, "_writes", {})
            j.setattr(self, "_step", self._step + 1)
        return plan

    def _mirror_rows(self) -> tuple[np.ndarray, np.ndarray]:
        """Host rows and per-resident-group device rows of every token not yet in a mirrored
        plan; marks them scheduled."""
        B = self.block_size
        host_rows, device_rows = [], []
        for req in self._requests.values():
            if req.seq_len == req.scheduled_len:
                continue
            pos = np.arange(req.scheduled_len, req.seq_len, dtype=np.int64)
            page, offset = pos // B, pos % B
            host_rows.append(np.asarray(req.host_blocks, dtype=np.int64)[page] * B + offset)
            device_rows.append(np.stack([req.pages[g.position][page] * B + offset
                                         for g in self._resident])
                               if self._resident else np.zeros((0, pos.size), np.int64))
            self.journal.setattr(req, "scheduled_len", req.seq_len)
        if not host_rows:
            return np.zeros(0, np.int32), np.zeros((len(self._resident), 0), np.int32)
        return (np.concatenate(host_rows).astype(np.int32),
                np.concatenate(device_rows, axis=1).astype(np.int32))

    # ------------------------------------------------------------------ residency
    def _release_resident(self, req: _Request) -> None:
        if not self._resident:
            return
        B = self.block_size
        limit = min(req.committed_len // B, cdiv(req.seq_len, B) - ACTIVE_TAIL_PAGES)
        first = req.released_pages
        if limit <= first:
            return
        count = limit - first
        j = self.journal
        if req.hot is None:
            if count < self.offload_threshold_pages:
                return
            need = sum(g.width for g in self._hot)
            if self.device_block_pool.num_free + count * len(self._resident) < need:
                self._counts["deferred_offloads"] += 1
                j.record(self._undo_counter("deferred_offloads"))
                return
        base = req.row * self.layout.width
        for group in self._resident:
            pages = req.pages[group.position]
            self._free_device(group, pages[first:limit])
            j.write(pages, slice(first, limit), 0)
            col = base + self.layout.group_cols[group.position]
            for page in range(first, limit):
                j.setitem(self._writes, col + page, 0)
        j.setattr(req, "released_pages", limit)
        self._counts["released_pages"] += count * len(self._resident)
        j.record(self._undo_counter("released_pages", count * len(self._resident)))
        if req.hot is None:
            hot: dict[int, list[int]] = {}
            for group in self._hot:
                blocks = self._allocate(group, group.width, req.request_id)
                hot[group.position] = blocks
                col = base + self.layout.group_cols[group.position]
                for i, block in enumerate(blocks):
                    j.setitem(self._writes, col + i, block)
            j.setattr(req, "hot", hot)
            self._track_peaks()

    def _release_window(self, req: _Request) -> None:
        j = self.journal
        base = req.row * self.layout.width
        for group in self._paged:
            limit = group.releasable_pages(req.committed_len)
            first = req.window_freed.get(group.position, 0)
            if limit <= first:
                continue
            pages = req.pages[group.position]
            self._free_device(group, pages[first:limit])
            j.write(pages, slice(first, limit), 0)
            col = base + self.layout.group_cols[group.position]
            for page in range(first, limit):
                j.setitem(self._writes, col + page, 0)
            j.setitem(req.window_freed, group.position, limit)

    # ------------------------------------------------------------------ helpers
    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeClosedError("the HiSparseScheduler is closed.")

    def close(self) -> None:
        """Drop every request; later calls raise ``RuntimeClosedError``. Idempotent."""
        self._closed = True
        self._requests.clear()

    @property
    def closed(self) -> bool:
        return self._closed

    def _request(self, request_id: Hashable, what: str = "") -> _Request:
        try:
            return self._requests[request_id]
        except (KeyError, TypeError):
            raise UnknownRequestError(request_id, what) from None

    def _kind(self, group: DeviceGroup) -> str:
        if isinstance(group, IndexerGroup):
            return "indexer"
        if isinstance(group, (ResidentGroup, HotGroup)):
            return group.kind
        return "regular"

    def _undo_counter(self, name: str, amount: int = 1):
        counts = self._counts
        return lambda: counts.__setitem__(name, counts[name] - amount)

    def _allocate(self, group: DeviceGroup, count: int, request_id: Hashable) -> list[int]:
        blocks = self.device_block_pool.allocate(count, request_id=request_id)
        self._add_in_use(self._kind(group), count)
        return blocks

    def _free_device(self, group: DeviceGroup, blocks: Iterable[int]) -> None:
        blocks = [int(b) for b in blocks if b]
        self.device_block_pool.free(blocks)
        self._add_in_use(self._kind(group), -len(blocks))

    def _add_in_use(self, kind: str, amount: int) -> None:
        in_use = self._counts["in_use"]
        in_use[kind] += amount
        self.journal.record(lambda: in_use.__setitem__(kind, in_use[kind] - amount))

    def _track_peaks(self) -> None:
        c = self._counts
        old = c["peak_device"], c["peak_host"]
        c["peak_device"] = max(old[0], self.device_block_pool.num_used)
        c["peak_host"] = max(old[1], self.host_block_pool.num_used)
        self.journal.record(lambda: c.update(peak_device=old[0], peak_host=old[1]))

    def _reset_row(self, row: int) -> None:
        """Queue an empty state row for the workers; drop the row's earlier pending writes."""
        j = self.journal
        j.setitem(self._resets, row, None)
        start, end = row * self.layout.width, (row + 1) * self.layout.width
        for index in [i for i in self._writes if start <= i < end]:
            j.delitem(self._writes, index)

    def _debug_snapshot(self) -> dict:
        """Every piece of mutable state as comparable values (tests: a failed call changes
        nothing)."""
        state: dict = {}
        for request_id, req in self._requests.items():
            state[("request", request_id)] = (
                req.row, req.prompt_len, req.max_new_tokens, list(req.host_blocks),
                {k: v.tolist() for k, v in req.pages.items()}, req.seq_len, req.scheduled_len,
                req.committed_len, req.released_pages, dict(req.window_freed),
                None if req.hot is None else {k: list(v) for k, v in req.hot.items()})
        for pool in (self.device_block_pool, self.host_block_pool):
            state[("pool", pool.name)] = (list(pool._free), list(pool._ref))
        state["pending"] = (list(self._resets), list(self._writes.items()))
        state["misc"] = (list(self._free_rows), self._step, repr(self._counts))
        return state


__all__ = ["HiSparseScheduler", "SchedulerStats", "check_id_list", "check_request_id"]
