"""``HiSparseScheduler``: the CPU-only half of the runtime (admission, block tables, residency).

A serving stack runs one scheduler (in its scheduler process) and one ``HiSparseWorker`` per
GPU rank. The scheduler owns every decision and no tensor: the host and device
``BlockPool``s, the request table, which pages of a request are on the GPU, the prefix
cache, and admission. Each step it emits one ``StepPlan`` (``step()``) that every worker
applies; request ids never leave the scheduler, only state rows and block ids do. This
module imports no torch.

A step, as the stack drives it::

    cached = scheduler.add_request(id, prompt_len, max_new_tokens, token_ids)  # admission
    rows = scheduler.append_slots(id, n)    # {layer: int64 [n]} device rows of n new tokens
    scheduler.free_request(id)              # a finished request
    plan = scheduler.step()                 # -> every worker: worker.apply(plan)
    ...  forward: the model writes KV at `rows`, worker.resolve_rows(...) per index group  ...
    ...  worker.mirror(plan) after the forward  ...

``step()`` closes the step: the plan carries every table change since the previous plan
and the tokens appended since then, which the workers mirror to the host pool after the
forward. Those tokens count as durable from the NEXT ``step()`` on (by then every worker has
enqueued their mirror, and work of later steps runs after it on the stream).

Residency of a request's resident (sparse-MLA) pages. Every page is in one state:

- *dirty*: on the GPU, not yet durable on the host (the pages being written);
- *clean pinned*: durable on the host, its block still owned by the request;
- *clean unpinned*: its block went back to the device free queue (after every truly free
  block, so it is reused last) but still holds the page: ``resolve`` serves it as a resident
  row, with no transfer, until the block is handed to someone else;
- *lost*: the block was handed to someone else. The plan of that step sets the page's table
  entry to 0 (``StepPlan.lost``) before the new owner writes it; ``resolve`` then reads the
  page from the host pool through the request's hot buffer.

While more than ``free_block_watermark`` of the device blocks are truly free (free and
holding no readable page), clean pages stay pinned and a request needs no hot region: small
batches run at all-GPU speed with no transfers. At or below the watermark, or when a request
outgrows its admission window (``max_num_batched_tokens``: a request longer than one chunk
keeps about one chunk of pages), or when it starts from a prefix that survives only on the
host, the request *offloads*: it takes its hot region (``blocks_per_request`` blocks per hot
group) and unpins its clean pages outside the last ``ACTIVE_TAIL_PAGES``, tail first (the
newest is reused first, so a shared prefix's head survives longest); from then on every page
it completes is unpinned once durable. Admission reserves every request's hot region, so an
offload never fails for lack of blocks.

Prefix reuse: with ``token_ids``, every full page of the prompt is named by a chained hash
(the parent page's hash and the page's token ids). A page is published once its host copy is
durable. ``add_request`` reuses the longest cached prefix whose pages are in the host pool
AND whose indexer (and full-attention) blocks survive on the GPU: host blocks are shared by
reference count (and never written again), surviving GPU copies of resident pages are
adopted, and it returns how many prompt tokens are cached (the caller computes the rest;
at least one prompt token is always left to compute). Free blocks that still hold published
pages are evicted in free-queue (least recently freed) order when space is needed. Models
with sliding-window layers get no prefix hits.

Chunked prefill: with ``max_num_batched_tokens`` set, a request may not have more tokens
appended since its last plan than that (``UncommittedTokensError``: step or commit first).

Every public call is all-or-nothing (``journal.transaction()``): a call that raises leaves
the scheduler exactly as it was.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Hashable, Iterable, Optional, Sequence

import numpy as np

from hisparse_triton.scheduler.block_pool import BlockPool
from hisparse_triton.config import ACTIVE_TAIL_PAGES, EngineConfig
from hisparse_triton.errors import (
    CapacityError,
    DuplicateRequestError,
    ReservationExceededError,
    RuntimeClosedError,
    UncommittedTokensError,
    UnknownRequestError,
)
from hisparse_triton.groups import (
    DeviceGroup,
    HotGroup,
    IndexerGroup,
    PlanGroups,
    ResidentGroup,
    SlidingWindowGroup,
)
from hisparse_triton.scheduler.journal import Journal
from hisparse_triton.scheduler.prefix_cache import PrefixCache, PrefixEntry, page_hashes
from hisparse_triton.specs import KVCacheConfig, cdiv
from hisparse_triton.step_plan import StepPlan, TableLayout

#: Occupancy counters kept per device group kind.
KINDS = ("indexer", "resident", "hot", "regular")
#: Default ``free_block_watermark``: offload once 10% or less of the device pool is free.
DEFAULT_FREE_BLOCK_WATERMARK = 0.1
#: Cumulative counters of ``SchedulerStats`` (zeroed by ``reset_stats``).
_COUNTERS = ("unpinned_pages", "lost_pages", "readopted_pages", "prefix_hit_tokens",
             "prefix_query_tokens", "window_released_pages")


@dataclass(frozen=True)
class SchedulerStats:
    """Pool occupancy and residency counters of a scheduler (``HiSparseScheduler.stats()``).

    Occupancy now: ``*_blocks`` device blocks owned per kind (an unpinned page's block is
    free, not counted), ``host_blocks`` host blocks owned, ``cached_device_blocks`` free
    device blocks that still hold a readable page (unpinned or prefix-cached),
    ``device_blocks_total`` / ``host_blocks_total`` allocatable blocks,
    ``peak_device_blocks`` / ``peak_host_blocks`` the most ever owned, ``num_requests`` live
    requests, ``offloaded_requests`` those holding a hot region.

    Cumulative (``reset_stats`` zeroes them): ``unpinned_pages`` resident page blocks
    unpinned, ``lost_pages`` unpinned pages whose block went to another owner,
    ``readopted_pages`` GPU copies of resident pages adopted by a prefix hit instead of
    being read from the host, ``prefix_hit_tokens`` / ``prefix_query_tokens`` prompt
    tokens found cached / looked up, ``window_released_pages`` sliding-window pages
    released; ``steps`` plans emitted.
    """

    resident_blocks: int
    hot_blocks: int
    host_blocks: int
    indexer_blocks: int
    regular_blocks: int
    cached_device_blocks: int
    device_blocks_total: int
    host_blocks_total: int
    peak_device_blocks: int
    peak_host_blocks: int
    num_requests: int
    offloaded_requests: int
    unpinned_pages: int
    lost_pages: int
    readopted_pages: int
    prefix_hit_tokens: int
    prefix_query_tokens: int
    window_released_pages: int
    steps: int

    @property
    def device_blocks(self) -> int:
        """Device blocks owned over all groups."""
        return self.indexer_blocks + self.resident_blocks + self.hot_blocks + self.regular_blocks


@dataclass
class _Request:
    request_id: Hashable
    row: int                           # state row
    prompt_len: int
    max_new_tokens: int
    host_blocks: list[int]
    pages: dict[int, np.ndarray]       # paged group position -> [width] int64 block ids
    page_hashes: list[bytes] = field(default_factory=list)  # full prompt pages' hashes
    host_array: np.ndarray = field(default=None, repr=False)  # host_blocks as int64
    published_pages: int = 0           # pages [0, published) considered for the prefix cache
    seq_len: int = 0
    scheduled_len: int = 0             # tokens whose mirror is in an emitted plan
    committed_len: int = 0             # tokens whose mirror is durable
    released_pages: int = 0            # resident pages [0, released_pages) are unpinned
    window_freed: dict[int, int] = field(default_factory=dict)  # sliding group -> pages freed
    hot: Optional[dict[int, list[int]]] = None  # hot group position -> blocks (None: not offloaded)

    def __post_init__(self) -> None:
        if self.host_array is None:
            self.host_array = np.asarray(self.host_blocks, dtype=np.int64)

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


def _watermark_blocks(value: object, capacity: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"free_block_watermark must be a fraction in [0, 1] or a block "
                         f"count, got {value!r}.")
    if isinstance(value, float):
        if not 0.0 <= value <= 1.0:
            raise ValueError(f"free_block_watermark {value!r}: a float is a fraction of the "
                             f"device pool in [0, 1] (use an int for a block count).")
        return int(value * capacity)
    if value < 0:
        raise ValueError(f"free_block_watermark must be >= 0 blocks, got {value!r}.")
    return value


class HiSparseScheduler:
    """The CPU-only scheduler half of HiSparse (see the module docstring).

    - ``kv_cache_config``: from ``get_hisparse_kv_cache_config``; ``config``: the
      ``EngineConfig`` it was planned for (``config.hisparse`` set;
      ``config.max_num_batched_tokens`` bounds each request's uncommitted tokens).
    - ``max_num_seqs``: live requests at most (state rows of the workers' tables).
    - ``free_block_watermark``: clean pages stay pinned while more device blocks than this
      are truly free (a float: a fraction of the pool in [0, 1]; an int: a block count);
      ``0.0`` offloads only when no truly free block is left. ``1.0`` is pure HiSparse:
      every request offloads as soon as it can and its committed pages leave the GPU at
      once (dropped, not kept readable), so all history outside the active tail is read
      through the hot buffer (the mode that exercises and measures the host path).
    - ``offload_threshold_pages``: a request that should offload does so once at least this
      many of its pages can be unpinned (default 1).
    """

    def __init__(self, kv_cache_config: KVCacheConfig, config: EngineConfig, *,
                 max_num_seqs: int,
                 free_block_watermark: float | int = DEFAULT_FREE_BLOCK_WATERMARK,
                 offload_threshold_pages: Optional[int] = None) -> None:
        if not isinstance(config, EngineConfig) or config.hisparse is None:
            raise ValueError("HiSparseScheduler needs an EngineConfig with hisparse set.")
        if not isinstance(kv_cache_config, KVCacheConfig):
            raise ValueError(f"kv_cache_config must be a KVCacheConfig, got "
                             f"{type(kv_cache_config).__name__}.")
        self.config = config
        self.kv_cache_config = kv_cache_config
        self.max_num_seqs = _int_at_least("max_num_seqs", max_num_seqs, 1)
        self.max_model_len = config.max_model_len
        self.max_num_batched_tokens = config.max_num_batched_tokens
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
            1 if offload_threshold_pages is None
            else _int_at_least("offload_threshold_pages", offload_threshold_pages, 1))
        self.num_device_blocks = kv_cache_config.num_blocks
        self.num_host_blocks = kv_cache_config.hisparse_host_num_blocks
        if self.num_host_blocks < 2:
            raise ValueError(f"the host pool needs at least 2 blocks (the null block and one "
                             f"page), the plan has {self.num_host_blocks}.")
        self.journal = Journal()
        self.device_block_pool = BlockPool(self.num_device_blocks, "device", self.journal)
        self.host_block_pool = BlockPool(self.num_host_blocks, "host", self.journal)
        self.free_block_watermark = free_block_watermark
        self._watermark = _watermark_blocks(free_block_watermark,
                                            self.device_block_pool.capacity)
        self._always_offload = isinstance(free_block_watermark, float) \
            and free_block_watermark >= 1.0

        self._resident = self.groups.resident
        self._hot = self.groups.hot
        self._paged = self.groups.paged
        self._hot_cost = sum(g.width for g in self._hot)
        # Pages a request keeps pinned before it must offload (None: no limit).
        self._window_pages = (None if self.max_num_batched_tokens is None
                              else cdiv(config.in_flight_tokens, self.block_size))
        # Prefix reuse needs every page of every full-history group; a sliding window
        # drops pages, so a model with one gets no prefix hits.
        self._windowed = self.groups.of_kind(SlidingWindowGroup)
        self.prefix_caching = not self._windowed
        self._prefix_groups = [g for g in self._paged if not isinstance(g, ResidentGroup)]
        # A token at a position that is a multiple of none of these starts no page anywhere
        # (the decode fast path).
        self._block_sizes = sorted({g.block_size for g in self._paged})
        # The names append_slots reports rows under, per paged group (model layer names).
        self._row_names = [group.model_layer_names if isinstance(group, ResidentGroup)
                           else group.layer_names for group in self._paged]
        self._requests: dict[Hashable, _Request] = {}
        self._free_rows = list(range(self.max_num_seqs - 1, -1, -1))  # pop() -> lowest row
        # Pending plan: state rows to reset, table writes (flat index -> value; a later write
        # of the same entry wins, a reset drops the row's earlier writes), pages lost.
        self._resets: dict[int, None] = {}
        self._writes: dict[int, int] = {}
        self._lost: list[tuple[int, int, int]] = []
        self._step = 0
        # Readable pages in free device blocks: unpinned pages of live requests, published
        # prefix pages (device block -> holders), and the free blocks holding any of them.
        self._unpinned: dict[int, list[tuple[_Request, int, int]]] = {}
        self._prefix = PrefixCache(
            self.journal, lambda position: isinstance(self.groups.groups[position],
                                                      ResidentGroup),
            self._uncache_if_unheld)
        self._cached_free: dict[int, None] = {}
        self._hot_reserved = 0
        self._counts: dict = {"in_use": dict.fromkeys(KINDS, 0), "peak_device": 0,
                              "peak_host": 0, **dict.fromkeys(_COUNTERS, 0)}
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
        self._check_open()
        try:
            return request_id in self._requests
        except TypeError:
            return False

    @property
    def request_ids(self) -> list[Hashable]:
        return list(self._requests)

    def seq_len(self, request_id: Hashable) -> int:
        """Tokens present so far (cached prefix + appended)."""
        return self._request(request_id).seq_len

    def unpinned_pages(self, request_id: Hashable) -> int:
        """How many of the request's leading resident pages left its ownership (unpinned:
        readable until their blocks are reused; or lost: read from the host)."""
        return self._request(request_id).released_pages

    def is_offloaded(self, request_id: Hashable) -> bool:
        """Whether the request holds a hot region (its committed pages may leave the GPU)."""
        return self._request(request_id).hot is not None

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
        """The request's device blocks for a layer's group, one per page (0 = the page is
        not on the GPU); for a hot layer its hot region."""
        self._check_open()
        req = self._request(request_id)
        group = self.groups.groups[self.groups.layer_group[
            self.groups.device_layer_name(layer_name)]]
        if isinstance(group, HotGroup):
            return list(req.hot[group.position]) if req.hot else []
        return [int(b) for b in req.pages[group.position][:group.pages(req.seq_len)]]

    @property
    def available_device_blocks(self) -> int:
        """Device blocks an ``append_slots`` may take now: free blocks (cached ones
        included: taking one loses its page) minus the hot regions reserved for requests
        that have not offloaded yet."""
        return self.device_block_pool.num_free - self._hot_reserved

    @property
    def truly_free_device_blocks(self) -> int:
        """Free device blocks that hold no readable page (what the watermark watches)."""
        return self.device_block_pool.num_free - len(self._cached_free)

    def stats(self) -> SchedulerStats:
        """Occupancy and residency counters (plain CPU reads)."""
        self._check_open()
        c, in_use = self._counts, self._counts["in_use"]
        return SchedulerStats(
            resident_blocks=in_use["resident"], hot_blocks=in_use["hot"],
            host_blocks=self.host_block_pool.num_used, indexer_blocks=in_use["indexer"],
            regular_blocks=in_use["regular"], cached_device_blocks=len(self._cached_free),
            device_blocks_total=self.device_block_pool.capacity,
            host_blocks_total=self.host_block_pool.capacity,
            peak_device_blocks=c["peak_device"], peak_host_blocks=c["peak_host"],
            num_requests=len(self._requests),
            offloaded_requests=sum(r.hot is not None for r in self._requests.values()),
            steps=self._step, **{name: c[name] for name in _COUNTERS})

    def reset_stats(self) -> None:
        """Zero the cumulative counters; peaks restart from the current occupancy."""
        self._check_open()
        self._counts.update(dict.fromkeys(_COUNTERS, 0),
                            peak_device=self.device_block_pool.num_used,
                            peak_host=self.host_block_pool.num_used)

    # ------------------------------------------------------------------ admission
    def add_request(self, request_id: Hashable, prompt_len: int, max_new_tokens: int,
                    token_ids: Optional[Sequence[int]] = None) -> int:
        """Admit a request; returns how many prompt tokens are already cached.

        Reserves host pages for ``prompt_len + max_new_tokens`` tokens, a state row, and
        (counted, not yet taken) the request's hot region on the device. With
        ``token_ids`` (the prompt, ``prompt_len`` ints) the longest cached prefix is reused:
        the request starts with that many tokens present (a multiple of ``block_size``,
        less than ``prompt_len``) and the caller appends only the rest. Returns 0 without
        ``token_ids``.

        ``DuplicateRequestError`` (a ``ValueError``) for a live id; ``ValueError`` for bad
        lengths, more than ``max_model_len`` tokens or bad ``token_ids``;
        ``CapacityError`` when the host pool, the device pool (the hot region) or the
        state rows (``max_num_seqs``) are full. Nothing changes on error.
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
        hashes = self._prompt_hashes(request_id, prompt_len, token_ids)
        hits = self._prefix_hits(hashes, prompt_len)
        if not self._free_rows:
            raise CapacityError(f"cannot add request {request_id!r}: all {self.max_num_seqs} "
                                f"state rows (max_num_seqs) are in use.",
                                resource="state rows", needed=1, available=0,
                                request_id=request_id)
        pages = cdiv(total, self.block_size)
        new_host = pages - len(hits)
        free_hits = sum(1 for e in hits if self.host_block_pool.is_free(e.host_block))
        if new_host > self.host_block_pool.num_free - free_hits:
            raise CapacityError(
                f"cannot add request {request_id!r}: it needs {new_host} host blocks for "
                f"{total} tokens, {self.host_block_pool.num_free - free_hits} of "
                f"{self.host_block_pool.capacity} are free.", resource="host blocks",
                needed=new_host, available=self.host_block_pool.num_free - free_hits,
                request_id=request_id)
        j = self.journal
        with j.transaction():
            self._reclaim(self._hot_cost + len(hits) * len(self._paged))
            return self._admit(request_id, prompt_len, max_new_tokens, token_ids is not None,
                               hashes, hits, new_host)

    def _admit(self, request_id: Hashable, prompt_len: int, max_new_tokens: int,
               with_tokens: bool, hashes: list[bytes], hits: list[PrefixEntry],
               new_host: int) -> int:
        adopted_free = sum(1 for e in hits for b in e.blocks.values()
                           if b and self.device_block_pool.is_free(b))
        available = self.available_device_blocks - adopted_free
        if self._hot_cost > available:
            raise CapacityError(
                f"cannot add request {request_id!r}: its hot region needs {self._hot_cost} "
                f"device blocks, {max(available, 0)} of {self.device_block_pool.capacity} "
                f"are available (free minus the hot regions reserved for the other "
                f"requests).", resource="device blocks", needed=self._hot_cost,
                available=max(available, 0), request_id=request_id)
        j = self.journal
        with j.transaction():
            shared = self._adopt_host(hits)
            host_blocks = shared + self._allocate_host(new_host, request_id)
            row = j.pop(self._free_rows)
            req = _Request(request_id=request_id, row=row, prompt_len=prompt_len,
                           max_new_tokens=max_new_tokens, host_blocks=host_blocks,
                           pages={g.position: np.zeros(g.width, dtype=np.int64)
                                  for g in self._paged}, page_hashes=hashes)
            j.setitem(self._requests, request_id, req)
            self._reset_row(row)
            base = row * self.layout.width
            host_col = base + self.layout.host_col
            for page, block in enumerate(host_blocks):
                j.setitem(self._writes, host_col + page, block)
            j.setattr(self, "_hot_reserved", self._hot_reserved + self._hot_cost)
            self._count("prefix_query_tokens", prompt_len if with_tokens else 0)
            if hits:
                self._adopt_device(req, hits)
            self._track_peaks()
        return len(hits) * self.block_size

    def _prompt_hashes(self, request_id: Hashable, prompt_len: int,
                       token_ids: Optional[Sequence[int]]) -> list[bytes]:
        if token_ids is None:
            return []
        try:
            tokens = np.asarray(token_ids)
        except (TypeError, ValueError):
            tokens = np.asarray([], dtype=object)
        if tokens.ndim != 1 or tokens.size != prompt_len \
                or not np.issubdtype(tokens.dtype, np.integer):
            raise ValueError(f"request {request_id!r}: token_ids must be {prompt_len} ints "
                             f"(one per prompt token), got "
                             f"{getattr(tokens, 'size', '?')} of {tokens.dtype}.")
        return page_hashes(tokens.astype(np.int64), self.block_size)

    def _prefix_hits(self, hashes: list[bytes], prompt_len: int) -> list[PrefixEntry]:
        """Entries of the longest cached prefix (at least one prompt token left to compute)."""
        if not self.prefix_caching:
            return []
        return self._prefix.lookup(hashes, (prompt_len - 1) // self.block_size)

    def _adopt_host(self, hits: list[PrefixEntry]) -> list[int]:
        """Share the hit pages' host blocks (reference counts; never written again)."""
        blocks = []
        for entry in hits:
            self._adopt(self.host_block_pool, entry.host_block)
            blocks.append(entry.host_block)
        return blocks

    def _adopt(self, pool: BlockPool, block: int) -> None:
        if pool.ref_count(block):
            pool.touch([block])
        else:
            pool.take(block)
            if pool is self.device_block_pool and block in self._cached_free:
                self.journal.delitem(self._cached_free, block)

    def _adopt_device(self, req: _Request, hits: list[PrefixEntry]) -> None:
        """Give a new request its cached prefix's device pages; it starts offloaded when a
        resident page survives only on the host."""
        j = self.journal
        base = req.row * self.layout.width
        host_only = False
        for page, entry in enumerate(hits):
            for group in self._paged:
                block = entry.blocks.get(group.position, 0)
                if not block:
                    host_only = True
                    continue
                self._adopt(self.device_block_pool, block)
                self._add_in_use(self._kind(group), 1)
                j.write(req.pages[group.position], page, block)
                j.setitem(self._writes, base + self.layout.group_cols[group.position] + page,
                          block)
                if isinstance(group, ResidentGroup):
                    self._count("readopted_pages", 1)
        cached = len(hits) * self.block_size
        for name in ("seq_len", "scheduled_len", "committed_len"):
            j.setattr(req, name, cached)
        j.setattr(req, "published_pages", len(hits))
        j.setitem(self._writes, base + TableLayout.SEQ_LEN_COL, cached)
        self._count("prefix_hit_tokens", cached)
        if host_only:
            self._offload(req)

    # ------------------------------------------------------------------ appending
    def append_slots(self, request_id: Hashable, num_tokens: int) -> dict[str, np.ndarray]:
        """Allocate device pages for ``num_tokens`` new tokens; where to write their KV.

        Returns ``{layer_name: [num_tokens] int64}`` device rows for every device layer
        (sparse layers under their model name: their resident rows; indexer and regular
        layers); row ``r`` of a layer is ``device_cache(layer)[r // B, r % B]`` on a worker.
        Layers of one group share one array. ``ReservationExceededError`` past
        ``prompt_len + max_new_tokens``; ``UncommittedTokensError`` past
        ``max_num_batched_tokens`` tokens since the request's last plan; ``CapacityError``
        when the device pool is full. Nothing changes on error.
        """
        per_group = self.append_group_rows(request_id, num_tokens)
        return {name: rows for rows, names in zip(per_group, self._row_names)
                for name in names}

    @property
    def row_layer_names(self) -> list[tuple[str, ...]]:
        """The layers of each paged group, in the order ``append_group_rows`` returns their
        rows (sparse layers under their model names)."""
        return list(self._row_names)

    def append_group_rows(self, request_id: Hashable, num_tokens: int) -> list[np.ndarray]:
        """``append_slots`` with one ``[num_tokens] int64`` array of rows per paged group (in
        ``row_layer_names`` order) instead of a dict per layer (cheaper on the decode path)."""
        self._check_open()
        req = self._request(request_id, "append_slots")
        num_tokens = _int_at_least(f"request {request_id!r}: num_tokens", num_tokens, 0)
        new_len = req.seq_len + num_tokens
        if new_len > req.reserved_tokens:
            raise ReservationExceededError(
                f"request {request_id!r}: appending {num_tokens} tokens to {req.seq_len} "
                f"exceeds its reservation of {req.reserved_tokens} (prompt {req.prompt_len} + "
                f"max_new_tokens {req.max_new_tokens}).", request_id)
        limit = self.max_num_batched_tokens
        if limit is not None and new_len - req.scheduled_len > limit:
            raise UncommittedTokensError(
                f"request {request_id!r}: appending {num_tokens} tokens would leave "
                f"{new_len - req.scheduled_len} tokens uncommitted, more than "
                f"max_num_batched_tokens={limit}; commit (step) the chunk before appending "
                f"more.", request_id)
        if num_tokens == 1 and all(req.seq_len % b for b in self._block_sizes):
            return [np.array([row], dtype=np.int64)        # the decode step: no new page
                    for row in self._advance_in_page(req)]
        new_pages = [g.new_pages(req.seq_len, new_len) for g in self._paged]
        needed = sum(new_pages)
        j = self.journal
        with j.transaction():
            self._reclaim(needed)
            return self._append(req, new_len, new_pages, needed)

    def _advance_in_page(self, req: _Request) -> list[int]:
        """Append one token that starts no page: its row in every paged group."""
        pos = req.seq_len
        rows = [int(req.pages[g.position][pos // g.block_size]) * g.block_size
                + pos % g.block_size for g in self._paged]
        j = self.journal
        j.setattr(req, "seq_len", pos + 1)
        j.setitem(self._writes, req.row * self.layout.width + TableLayout.SEQ_LEN_COL, pos + 1)
        return rows

    def append_decode(self, request_ids: Sequence[Hashable]) -> dict[str, np.ndarray]:
        """``append_slots(id, 1)`` for every request of a decode batch, in one call:
        ``{layer: int64 [R]}`` rows, row ``r`` for ``request_ids[r]`` (layers of one group
        share one array). All-or-nothing; the same errors as ``append_slots``."""
        self._check_open()
        check_id_list(request_ids)
        table = np.empty((len(self._paged), len(request_ids)), dtype=np.int64)
        with self.journal.transaction():
            for r, request_id in enumerate(request_ids):
                req = self._request(request_id, "append_decode")
                if all(req.seq_len % b for b in self._block_sizes) \
                        and req.seq_len < req.reserved_tokens \
                        and (self.max_num_batched_tokens is None
                             or req.seq_len + 1 - req.scheduled_len <= self.max_num_batched_tokens):
                    table[:, r] = self._advance_in_page(req)
                else:
                    table[:, r] = [int(rows[0])
                                   for rows in self.append_group_rows(request_id, 1)]
        return {name: table[i] for i, names in enumerate(self._row_names) for name in names}

    def _append(self, req: _Request, new_len: int, new_pages: list[int],
                needed: int) -> list[np.ndarray]:
        request_id = req.request_id
        num_tokens = new_len - req.seq_len
        if needed > self.available_device_blocks:
            available = max(self.available_device_blocks, 0)
            raise CapacityError(
                f"request {request_id!r}: appending {num_tokens} tokens needs {needed} device "
                f"blocks, {available} of {self.device_block_pool.capacity} are available "
                f"(free minus reserved hot regions).", resource="device blocks",
                needed=needed, available=available, request_id=request_id)
        j = self.journal
        out: list[np.ndarray] = []
        with j.transaction():
            base = req.row * self.layout.width
            for group, count in zip(self._paged, new_pages):
                pages = req.pages[group.position]
                if count:
                    first = group.pages(req.seq_len)
                    blocks = self._allocate(group, count, request_id)
                    j.write(pages, slice(first, first + count), blocks)
                    col = base + self.layout.group_cols[group.position] + first
                    for i, block in enumerate(blocks):
                        j.setitem(self._writes, col + i, block)
                out.append(self._rows(pages, req.seq_len, new_len, group.block_size))
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
        """Return every block of the request (tail first) and its state row. Published
        prefix pages stay readable in their free blocks until those are reused."""
        self._check_open()
        req = self._request(request_id, "free_request")
        j = self.journal
        with j.transaction():
            for group in self._resident:
                for page in range(req.released_pages):
                    block = int(req.pages[group.position][page])
                    if block:
                        self._drop_unpinned_holder(block, req)
            for group in self._paged:
                pages = req.pages[group.position]
                start = req.released_pages if isinstance(group, ResidentGroup) \
                    else req.window_freed.get(group.position, 0)
                self._free_device(group, pages[start:group.pages(req.seq_len)][::-1])
            if req.hot is not None:
                for position, blocks in req.hot.items():
                    self._free_device(self.groups.groups[position], blocks)
            else:
                j.setattr(self, "_hot_reserved", self._hot_reserved - self._hot_cost)
            self.host_block_pool.free(req.host_blocks[::-1])
            self._reset_row(req.row)
            j.replace_list(self._free_rows, sorted([*self._free_rows, req.row], reverse=True))
            j.delitem(self._requests, request_id)

    def reset_prefix_cache(self) -> int:
        """Forget every published prefix page (their free blocks become truly free);
        returns how many pages were dropped."""
        self._check_open()
        with self.journal.transaction():
            return self._prefix.clear()

    # ------------------------------------------------------------------ steps
    def step(self, *, mirror: bool = True, release: bool = True) -> StepPlan:
        """Close a step: emit the plan every worker applies (see the module docstring).

        1. Tokens of earlier plans' mirrors become durable (and their full prompt pages are
           published for prefix reuse). With ``release=True``: requests that should offload
           take their hot regions and unpin durable pages outside the active tail;
           sliding-window pages out of every future window are released. Their table
           changes join this plan.
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
            released_before = self._counts["unpinned_pages"] + \
                self._counts["window_released_pages"]
            pressure = self._under_pressure()
            for req in list(self._requests.values()):
                if req.scheduled_len > req.committed_len:
                    j.setattr(req, "committed_len", req.scheduled_len)
                    self._publish(req)
                if release:
                    self._release_resident(req, pressure)
                    self._release_window(req)
            host_rows, device_rows = (self._mirror_rows() if mirror else
                                      (np.zeros(0, np.int32),
                                       np.zeros((len(self._resident), 0), np.int32)))
            plan = StepPlan.build(
                step=self._step + 1, layout=self.layout.fingerprint, commit=mirror,
                reset_rows=np.fromiter(self._resets, dtype=np.int32, count=len(self._resets)),
                write_index=np.fromiter(self._writes.keys(), dtype=np.int32,
                                        count=len(self._writes)),
                write_value=np.fromiter(self._writes.values(), dtype=np.int32,
                                        count=len(self._writes)),
                mirror_host_rows=host_rows, mirror_device_rows=device_rows,
                lost=np.asarray(self._lost, dtype=np.int32).reshape(-1, 3),
                released_pages=(self._counts["unpinned_pages"]
                                + self._counts["window_released_pages"] - released_before))
            j.setattr(self, "_resets", {})
            j.setattr(self, "_writes", {})
            j.setattr(self, "_lost", [])
            j.setattr(self, "_step", self._step + 1)
        return plan

    def _mirror_rows(self) -> tuple[np.ndarray, np.ndarray]:
        """Host rows and per-resident-group device rows of every token not yet in a mirrored
        plan; marks them scheduled."""
        B = self.block_size
        resident = [g.position for g in self._resident]
        host_rows: list[np.ndarray] = []
        device_rows: list[np.ndarray] = []
        single_host: list[int] = []              # the decode step: one token per request
        single_device: list[list[int]] = []
        for req in self._requests.values():
            start, end = req.scheduled_len, req.seq_len
            if start == end:
                continue
            if end - start == 1:
                page, offset = divmod(start, B)
                single_host.append(req.host_blocks[page] * B + offset)
                single_device.append([int(req.pages[g][page]) * B + offset for g in resident])
            else:
                pos = np.arange(start, end, dtype=np.int64)
                page, offset = pos // B, pos % B
                host_rows.append(req.host_array[page] * B + offset)
                device_rows.append(np.stack([req.pages[g][page] * B + offset
                                             for g in resident])
                                   if resident else np.zeros((0, pos.size), np.int64))
            self.journal.setattr(req, "scheduled_len", end)
        if single_host:
            host_rows.append(np.asarray(single_host, dtype=np.int64))
            device_rows.append(np.asarray(single_device, dtype=np.int64).reshape(
                len(single_host), len(resident)).T)
        if not host_rows:
            return np.zeros(0, np.int32), np.zeros((len(resident), 0), np.int32)
        return (np.concatenate(host_rows).astype(np.int32),
                np.concatenate(device_rows, axis=1).astype(np.int32))

    # ------------------------------------------------------------------ residency
    def _under_pressure(self) -> bool:
        return self._always_offload or self.truly_free_device_blocks <= self._watermark

    def _should_offload(self, req: _Request, pressure: bool) -> bool:
        if pressure:
            return True
        window = self._window_pages
        return window is not None and cdiv(req.reserved_tokens, self.block_size) > window

    def _release_resident(self, req: _Request, pressure: bool) -> None:
        if not self._resident:
            return
        B = self.block_size
        limit = min(req.committed_len // B, cdiv(req.seq_len, B) - ACTIVE_TAIL_PAGES)
        first = req.released_pages
        if limit <= first:
            return
        if req.hot is None:
            if limit - first < self.offload_threshold_pages \
                    or not self._should_offload(req, pressure):
                return
            self._offload(req)
        # Tail first: the newest unpinned page enters the free queue first (reused first).
        for page in range(limit - 1, first - 1, -1):
            for group in self._resident:
                block = int(req.pages[group.position][page])
                if block:
                    self._unpin(req, group, page, block)
        self.journal.setattr(req, "released_pages", limit)

    def _reclaim(self, needed: int) -> None:
        """Before an allocation of ``needed`` blocks that does not fit: offload requests
        holding durable pages pinned (most such pages first) until it fits or none is left.
        Their pages stay readable in the free queue; only blocks actually reused are lost."""
        if needed <= self.available_device_blocks or not self._resident:
            return
        B = self.block_size

        def pinned_clean(req: _Request) -> int:
            limit = min(req.committed_len // B, cdiv(req.seq_len, B) - ACTIVE_TAIL_PAGES)
            return limit - req.released_pages

        candidates = sorted((r for r in self._requests.values() if pinned_clean(r) > 0),
                            key=lambda r: (-pinned_clean(r), r.row))
        for req in candidates:
            if needed <= self.available_device_blocks:
                break
            self._release_resident(req, pressure=True)

    def _offload(self, req: _Request) -> None:
        """Give the request its hot region (reserved at admission)."""
        j = self.journal
        base = req.row * self.layout.width
        j.setattr(self, "_hot_reserved", self._hot_reserved - self._hot_cost)
        hot: dict[int, list[int]] = {}
        for group in self._hot:
            blocks = self._allocate(group, group.width, req.request_id)
            hot[group.position] = blocks
            col = base + self.layout.group_cols[group.position]
            for i, block in enumerate(blocks):
                j.setitem(self._writes, col + i, block)
        j.setattr(req, "hot", hot)
        self._track_peaks()

    def _unpin(self, req: _Request, group: DeviceGroup, page: int, block: int) -> None:
        """Return a clean page's block to the pool; it stays readable until reused (with
        ``free_block_watermark=1.0`` it is dropped at once: read from the host from now)."""
        j = self.journal
        if self._always_offload:
            j.write(req.pages[group.position], page, 0)
            j.setitem(self._writes, req.row * self.layout.width
                      + self.layout.group_cols[group.position] + page, 0)
        else:
            holders = self._unpinned.get(block)
            if holders is None:
                j.setitem(self._unpinned, block, [(req, group.position, page)])
            else:
                j.append(holders, (req, group.position, page))
        self._free_device(group, [block])
        self._count("unpinned_pages", 1)

    def _drop_unpinned_holder(self, block: int, req: _Request) -> None:
        holders = self._unpinned.get(block)
        if holders is None:
            return
        kept = [h for h in holders if h[0] is not req]
        if kept:
            self.journal.setitem(self._unpinned, block, kept)
        else:
            self.journal.delitem(self._unpinned, block)
        self._uncache_if_unheld(block)

    def _release_window(self, req: _Request) -> None:
        j = self.journal
        base = req.row * self.layout.width
        for group in self._windowed:
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
            self._count("window_released_pages", limit - first)

    # ------------------------------------------------------------------ prefix cache
    def _publish(self, req: _Request) -> None:
        """Publish the request's full prompt pages that just became durable."""
        if not self.prefix_caching or not req.page_hashes:
            return
        end = min(len(req.page_hashes), req.committed_len // self.block_size)
        j = self.journal
        for page in range(req.published_pages, end):
            h = req.page_hashes[page]
            if h in self._prefix:
                continue
            blocks = {g.position: int(req.pages[g.position][page]) for g in self._paged}
            if any(not blocks[g.position] for g in self._prefix_groups):
                continue
            for block in self._prefix.publish(h, req.host_blocks[page], blocks):
                if self.device_block_pool.is_free(block):
                    j.setitem(self._cached_free, block, None)
        if end > req.published_pages:
            j.setattr(req, "published_pages", end)

    # ------------------------------------------------------------------ blocks
    def _allocate(self, group: DeviceGroup, count: int, request_id: Hashable) -> list[int]:
        blocks = self.device_block_pool.allocate(count, request_id=request_id)
        for block in blocks:
            self._evict_device_block(block)
        self._add_in_use(self._kind(group), count)
        return blocks

    def _allocate_host(self, count: int, request_id: Hashable) -> list[int]:
        blocks = self.host_block_pool.allocate(count, request_id=request_id)
        for block in blocks:
            self._prefix.on_host_block_reused(block)
        return blocks

    def _evict_device_block(self, block: int) -> None:
        """A free block was just handed out: every page it still held is gone."""
        j = self.journal
        if block in self._cached_free:
            j.delitem(self._cached_free, block)
        holders = self._unpinned.get(block)
        if holders is not None:
            j.delitem(self._unpinned, block)
            for req, position, page in holders:
                j.write(req.pages[position], page, 0)
                j.setitem(self._writes, req.row * self.layout.width
                          + self.layout.group_cols[position] + page, 0)
                j.append(self._lost, (req.row, position, page))
                self._count("lost_pages", 1)
        self._prefix.on_device_block_reused(block)

    def _free_device(self, group: DeviceGroup, blocks: Iterable[int]) -> None:
        blocks = [int(b) for b in blocks if b]
        self.device_block_pool.free(blocks)
        self._add_in_use(self._kind(group), -len(blocks))
        for block in blocks:
            if (block in self._unpinned or self._prefix.holds_device_block(block)) \
                    and self.device_block_pool.is_free(block):
                self.journal.setitem(self._cached_free, block, None)

    def _uncache_if_unheld(self, block: int) -> None:
        if block in self._cached_free and block not in self._unpinned \
                and not self._prefix.holds_device_block(block):
            self.journal.delitem(self._cached_free, block)

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
        self._check_open()
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

    def _count(self, name: str, amount: int) -> None:
        if amount:
            counts = self._counts
            counts[name] += amount
            self.journal.record(lambda: counts.__setitem__(name, counts[name] - amount))

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
                {k: v.tolist() for k, v in req.pages.items()}, list(req.page_hashes),
                req.published_pages, req.seq_len, req.scheduled_len, req.committed_len,
                req.released_pages, dict(req.window_freed),
                None if req.hot is None else {k: list(v) for k, v in req.hot.items()})
        for pool in (self.device_block_pool, self.host_block_pool):
            state[("pool", pool.name)] = (list(pool._free), list(pool._ref))
        state["pending"] = (list(self._resets), list(self._writes.items()), list(self._lost))
        state["cache"] = (
            sorted((b, sorted((r.row, g, p) for r, g, p in hs))
                   for b, hs in self._unpinned.items()),
            self._prefix.snapshot(),
            list(self._cached_free), self._hot_reserved)
        state["misc"] = (list(self._free_rows), self._step, repr(self._counts))
        return state


__all__ = ["DEFAULT_FREE_BLOCK_WATERMARK", "HiSparseScheduler", "SchedulerStats",
           "check_id_list", "check_request_id"]
