"""``HiSparseRuntime``: pools, block tables, request lifecycle and the decode-step resolve.

The runtime turns a planner ``KVCacheConfig`` into memory and bookkeeping (DESIGN.md
section 6):

- a ``HostPool`` holding every source (sparse-MLA) layer's full history, and ONE
  ``DevicePool`` whose blocks every device group draws from one ``BlockPool`` (a block handed
  to a group is used at that group's in-block byte offsets); a separate host ``BlockPool``;
- per-request block tables kept twice: Python lists/arrays on the CPU (the allocator's view)
  and persistent device tensors indexed by the request's *state row* in
  ``[0, max_num_seqs)`` (what the kernels read). The device copies are updated with small
  non-blocking writes when a table changes, so the decode path never waits for the device.

Lifecycle of a request::

    add_request(id, prompt_len, max_new_tokens)   # reserve host pages + a state row
    rows = append_slots(id, n)                    # device rows to write n new tokens' KV at
    ...  the model writes KV at rows[layer] of device_cache(layer)  ...
    commit()                                      # mirror new rows to host, release old pages
    ids = resolve(leader, [id, ...], topk)        # per index group, every decode step
    free_request(id)

Ordering on CUDA: every transfer is enqueued on the current stream. ``commit()`` enqueues
the device->host mirror of new rows and then, on the CPU, returns sealed resident pages to
the device block pool. A released block is only written again by work enqueued later
(a gather in ``resolve``, the model's KV write into rows from ``append_slots``), which the
stream runs after the mirror has read it, so no event or host sync is needed. This holds as
long as the caller writes KV and calls the runtime on one stream; a caller using several
streams must make them wait on the current stream after ``commit()``.

Host syncs: ``add_request``, ``append_slots``, ``commit``, ``free_request``, ``resolve`` and
``resolve_rows`` never wait for the device on CUDA (table updates are staged through pinned
memory and copied with ``non_blocking=True``; counters accumulate on the device; with the
``torch`` backend on CUDA the reference ops do sync). ``stats()`` reads the device counters
(one sync); ``host_cache`` read on the CPU needs a ``torch.cuda.synchronize()`` first.

Row lifetime: the rows ``resolve`` returns stay valid until the next ``commit()`` or
``free_request()`` (which may hand their blocks to other requests) and, for hot rows, the
next ``resolve`` of the same index group for the same request (which may evict them). So a
step is: ``append_slots`` -> write KV -> ``resolve`` per index group -> attention ->
``commit()``.

Shared host pool (``kv_cache_config.hisparse_shared_host_pool``): the tensor-parallel ranks
of one node hold ONE host pool (MLA KV is identical on every TP rank). Each rank builds its
own runtime with ``tp_rank`` and the same ``host_pool_name``; rank 0 creates the pool and is
the only one that mirrors device->host in ``commit()``; the others attach to it and keep
identical bookkeeping. See ``HiSparseRuntime`` for the contract.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Hashable, Iterable, Optional, Sequence

import numpy as np
import torch

from hisparse_triton.block_pool import BlockPool
from hisparse_triton.config import ACTIVE_TAIL_PAGES, EngineConfig
from hisparse_triton.errors import (
    CapacityError,
    DuplicateRequestError,
    HiSparseError,
    ReservationExceededError,
    RuntimeClosedError,
    UnknownRequestError,
)
from hisparse_triton.layout import (
    HISPARSE_RESIDENT_SUFFIX,
    group_kind,
    split_index_groups,
    underlying_layer_name,
)
from hisparse_triton.pools import DevicePool, HostPool
from hisparse_triton.row_table import RowTable
from hisparse_triton.specs import (
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
    SlidingWindowSpec,
    UniformTypeKVCacheSpecs,
    cdiv,
)

BACKENDS = ("auto", "triton", "torch")
_INT32_MAX = 2**31 - 1


@dataclass(frozen=True)
class HiSparseStats:
    """Counters and pool occupancy of a runtime (``HiSparseRuntime.stats()``).

    - ``hits``: resolved top-k columns served from a resident page or a hot slot;
      ``misses``: distinct host rows gathered (once per index group, however many follower
      layers copy them); ``masked``: columns that resolved to -1.
    - ``h2d_bytes``: bytes gathered host -> device (misses x row bytes x layers of the index
      group); ``d2h_bytes``: bytes mirrored device -> host by ``commit()`` (0 on a rank that
      does not write a shared host pool).
    - ``*_blocks``: blocks in use now (device pool: indexer, resident, hot, regular; host
      pool: host), ``device_blocks_total``/``host_blocks_total``: allocatable blocks.
    - ``peak_device_blocks``/``peak_host_blocks``: the most blocks in use at any time.
    - ``num_requests``: live requests; ``deferred_offloads``: commits at which a request
      kept its history on the GPU because the pool had no room for its hot region.
    """

    hits: int
    misses: int
    masked: int
    h2d_bytes: int
    d2h_bytes: int
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

    @property
    def device_blocks(self) -> int:
        """Device blocks in use over all groups."""
        return self.indexer_blocks + self.resident_blocks + self.hot_blocks + self.regular_blocks

    @property
    def hit_rate(self) -> float:
        """``hits / (hits + misses)`` (1.0 when nothing was resolved)."""
        total = self.hits + self.misses
        return self.hits / total if total else 1.0


@dataclass
class _Group:
    """One device group that holds per-request pages (indexer, resident, hot or regular)."""

    index: int                 # position in HiSparseRuntime._groups
    kind: str                  # "indexer" | "resident" | "hot" | "regular"
    spec: KVCacheGroupSpec
    block_size: int
    pages_per_request: int     # block-table width (hot: blocks_per_request)
    sliding_window: Optional[int] = None
    table: Optional[torch.Tensor] = None   # [S, pages_per_request] int32 on the device


@dataclass
class _IndexGroup:
    """A leader sparse layer and its followers; they share one resident and one hot group."""

    leader: str
    layers: tuple[str, ...]    # underlying sparse layer names, leader first
    resident: _Group
    hot: _Group
    device_table: RowTable     # their rows in the device pool
    host_table: RowTable       # their rows in the host pool
    row_bytes: int
    slot_host_rows: torch.Tensor = field(repr=False, default=None)  # [S, H] int32
    lru: torch.Tensor = field(repr=False, default=None)             # [S, H] int32
    # [hits, misses, masked] int64, accumulated on the device by resolve() (one sum + one
    # add per call; bytes are derived in stats()).
    counters: torch.Tensor = field(repr=False, default=None)

    @property
    def bytes_per_miss(self) -> int:
        """Bytes one gathered host row moves: a row of the leader and of every follower."""
        return self.row_bytes * len(self.layers)


@dataclass
class _MirrorSet:
    """Source layers of one row size, mirrored device -> host by one copy launch."""

    layers: tuple[str, ...]
    row_bytes: int
    resident_of_layer: torch.Tensor  # [L] int64 index into the resident groups, on the device
    device_table: RowTable
    host_table: RowTable


@dataclass
class _Request:
    request_id: Hashable
    row: int                          # state row
    prompt_len: int
    max_new_tokens: int
    host_blocks: list[int]
    pages: dict[int, np.ndarray]      # group index -> [pages_per_request] int64 block ids
    seq_len: int = 0
    committed_len: int = 0
    released_pages: int = 0           # resident pages [0, released_pages) left the GPU
    window_freed: dict[int, int] = field(default_factory=dict)  # sliding group -> pages freed
    hot: Optional[dict[int, list[int]]] = None  # hot group index -> blocks (None: not offloaded)

    @property
    def reserved_tokens(self) -> int:
        return self.prompt_len + self.max_new_tokens


def _positive_int(name: str, value: object, minimum: int = 1) -> int:
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}.")
    return int(value)


def _check_id_list(request_ids: object) -> None:
    """A batch's ids must be a sequence, one per row: a lone str id would be split into
    characters."""
    if isinstance(request_ids, (str, bytes)) or not hasattr(request_ids, "__len__"):
        raise ValueError(f"request_ids must be a list of request ids (one per batch row), "
                         f"got {type(request_ids).__name__} {request_ids!r}.")


def _parse_device(device: object) -> torch.device:
    """``device`` (``None`` = CUDA when available, else CPU) as a usable ``torch.device``;
    ``ValueError`` naming it when it is not a device name or is CUDA on a machine without."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        parsed = torch.device(device)  # type: ignore[arg-type]
    except (RuntimeError, TypeError, ValueError) as exc:
        raise ValueError(f"device {device!r} is not a torch device: {exc}") from None
    if parsed.type not in ("cpu", "cuda"):
        raise ValueError(f"device {device!r}: the runtime runs on a cpu or cuda device.")
    if parsed.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {device!r}: CUDA is not available on this machine.")
        if parsed.index is not None and parsed.index >= torch.cuda.device_count():
            raise ValueError(f"device {device!r}: this machine has "
                             f"{torch.cuda.device_count()} CUDA device(s).")
    return parsed


class HiSparseRuntime:
    """The HiSparse runtime over one planner ``KVCacheConfig`` (see the module docstring).

    - ``kv_cache_config``: from ``get_hisparse_kv_cache_config``; ``config``: the
      ``EngineConfig`` it was planned for (``config.hisparse`` set).
    - ``max_num_seqs``: live requests at most (rows of the per-request device tables).
    - ``device``: where the device pool and tables live (default: CUDA if available, else
      CPU). ``backend``: ``"auto"`` (Triton on CUDA, torch elsewhere), ``"triton"`` (CUDA, or
      CPU under ``TRITON_INTERPRET=1``) or ``"torch"`` (the reference ops).
    - ``offload_threshold_pages``: a request's history leaves the GPU (and it gets its hot
      region) once at least this many of its pages are sealed and outside the active tail;
      default: the hot region's size in blocks, so offloading never costs more device blocks
      than it frees. ``1`` offloads as early as possible.
    - ``host_ram_fraction``: the host pool may use at most this fraction of available RAM.
    - ``tp_rank``, ``host_pool_name``: for a plan with ``hisparse_shared_host_pool`` (one
      host pool per node, shared by the TP ranks), ``host_pool_name`` is required (and is
      refused when the plan does not share the pool): ``tp_rank`` 0 creates the pool
      ``HostPool(shared_name=host_pool_name, create=True)``, every other rank
      (``< config.tensor_parallel_size``) attaches to it. Only rank 0 writes the
      device->host mirror in ``commit()`` (``mirrors_to_host``); other ranks copy nothing
      and count no ``d2h_bytes``, but their bookkeeping (sealing, releasing pages, hot
      regions, host blocks) is identical.

    Shared-pool contract (the caller's duty; nothing checks it across processes):

    1. construct rank 0's runtime before the others attach (an attach to a missing pool
       raises ``SharedHostPoolError``); close rank 0 last or not: attached ranks keep their
       mapping, the file is unlinked by rank 0's ``close()``;
    2. every rank calls ``add_request``/``append_slots``/``commit``/``free_request`` with the
       same arguments in the same order (SPMD), so all ranks allocate the same host blocks;
       every rank writes the same KV bytes into its own device pool;
    3. after ``commit()``, the ranks synchronise before ANY rank resolves rows that commit
       mirrored (rank 0's stream must have finished the mirror: e.g. the step's collective
       on that stream, or ``torch.cuda.synchronize()`` + a barrier); a rank that resolves
       earlier may gather host rows rank 0 has not written yet.
    """

    def __init__(self, kv_cache_config: KVCacheConfig, config: EngineConfig, *,
                 max_num_seqs: int, device: torch.device | str | None = None,
                 backend: str = "auto", offload_threshold_pages: Optional[int] = None,
                 host_ram_fraction: float = 0.9, tp_rank: int = 0,
                 host_pool_name: Optional[str] = None) -> None:
        if config.hisparse is None:
            raise ValueError("HiSparseRuntime needs an EngineConfig with hisparse set.")
        self.shared_host_pool = bool(kv_cache_config.hisparse_shared_host_pool)
        self.tp_rank = _positive_int("tp_rank", tp_rank, minimum=0)
        if self.tp_rank >= config.tensor_parallel_size:
            raise ValueError(f"tp_rank {tp_rank} must be < tensor_parallel_size="
                             f"{config.tensor_parallel_size}.")
        if self.shared_host_pool and host_pool_name is None:
            raise ValueError("kv_cache_config.hisparse_shared_host_pool is True (one host pool "
                             "shared by the TP ranks of the node): pass host_pool_name (the "
                             "same on every rank; tp_rank 0 creates the pool).")
        if not self.shared_host_pool and host_pool_name is not None:
            raise ValueError(f"host_pool_name={host_pool_name!r} was given but "
                             f"kv_cache_config.hisparse_shared_host_pool is False (each rank "
                             f"owns a private host pool); plan with shared_host_pool=True or "
                             f"drop host_pool_name.")
        self.host_pool_name = host_pool_name
        #: Whether ``commit()`` writes the device->host mirror (rank 0 of a shared pool).
        self.mirrors_to_host = not self.shared_host_pool or self.tp_rank == 0
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}.")
        self.max_num_seqs = _positive_int("max_num_seqs", max_num_seqs)
        if (isinstance(host_ram_fraction, bool)
                or not isinstance(host_ram_fraction, (int, float))
                or not 0 < host_ram_fraction <= 1):
            raise ValueError(f"host_ram_fraction must be in (0, 1], got {host_ram_fraction!r}.")
        self.device = _parse_device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        from hisparse_triton import ops  # imported here: it registers torch.library ops

        try:
            ops.select_backend(backend, self.device)
        except ops.BackendUnavailableError as exc:
            raise ValueError(str(exc)) from None
        self._ops = ops
        self.backend = backend
        self.config = config
        self.kv_cache_config = kv_cache_config
        self.max_model_len = config.max_model_len
        self.device_buffer_size = int(config.hisparse.device_buffer_size)
        self._closed = False
        self._host_pool: Optional[HostPool] = None
        self._plan_groups(kv_cache_config)
        self.offload_threshold_pages = (
            self.hot_blocks_per_request if offload_threshold_pages is None
            else _positive_int("offload_threshold_pages", offload_threshold_pages))

        # Pools and allocators.
        self.num_device_blocks = kv_cache_config.num_blocks
        self.num_host_blocks = kv_cache_config.hisparse_host_num_blocks
        if self.num_host_blocks < 2:
            raise ValueError(f"the host pool needs at least 2 blocks (the null block and one "
                             f"page), the plan has {self.num_host_blocks}.")
        self.bytes_per_block = kv_cache_config.bytes_per_block
        host_bytes = max(t.offset + t.size for t in self._host_tensors.values())
        self._requests: dict[Hashable, _Request] = {}
        self._host_pool = HostPool(host_bytes, pin=self.device.type == "cuda",
                                   max_ram_fraction=host_ram_fraction, device=self.device,
                                   shared_name=host_pool_name, create=self.tp_rank == 0)
        try:  # a failure below must not leave the (pinned) host pool to the GC
            self._device_pool = DevicePool(self.num_device_blocks, self.bytes_per_block,
                                           self.device)
            self.device_block_pool = BlockPool(self.num_device_blocks, "device")
            self.host_block_pool = BlockPool(self.num_host_blocks, "host")
            self._build_tables()
        except BaseException:
            self.close()
            raise
        self._free_rows = list(range(self.max_num_seqs - 1, -1, -1))  # pop() -> lowest row
        self._d2h_bytes = 0
        self._in_use = {"indexer": 0, "resident": 0, "hot": 0, "regular": 0}
        self._peak_device = 0
        self._peak_host = 0
        self._deferred_offloads = 0

    # ------------------------------------------------------------------ construction
    def _plan_groups(self, kvc: KVCacheConfig) -> None:
        sources = [g for g in kvc.kv_cache_groups if g.host_resident]
        if len(sources) != 1:
            raise ValueError(f"a HiSparse KVCacheConfig has exactly one host-resident group, "
                             f"got {len(sources)}.")
        self.source_group = sources[0]
        src_spec = self.source_group.kv_cache_spec
        if not isinstance(src_spec, UniformTypeKVCacheSpecs):
            raise ValueError("the source group's spec must be UniformTypeKVCacheSpecs (one "
                             "MLAAttentionSpec per sparse layer, as the planner makes it).")
        self.block_size = self.source_group.block_size
        self.source_layers: tuple[str, ...] = tuple(self.source_group.layer_names)

        self._host_tensors: dict[str, KVCacheTensor] = {}
        self._device_tensors: dict[str, KVCacheTensor] = {}
        for tensor in kvc.kv_cache_tensors:
            target = self._host_tensors if tensor.host_resident else self._device_tensors
            for name in tensor.layers:
                target[name] = tensor
        for layer in self.source_layers:
            if layer not in self._host_tensors:
                raise ValueError(f"source layer {layer!r} has no host KVCacheTensor.")

        self._groups: list[_Group] = []
        self._layer_group: dict[str, _Group] = {}   # group-layer name -> its group
        for spec in kvc.kv_cache_groups:
            if spec.host_resident:
                continue
            kind = group_kind(spec)
            B = spec.block_size
            if kind == "hot":
                width = spec.kv_cache_spec.blocks_per_request
            else:
                width = cdiv(self.max_model_len, B)
            window = (spec.kv_cache_spec.sliding_window
                      if isinstance(spec.kv_cache_spec, SlidingWindowSpec) else None)
            group = _Group(index=len(self._groups), kind=kind, spec=spec, block_size=B,
                           pages_per_request=width, sliding_window=window)
            self._groups.append(group)
            for name in spec.layer_names:
                if name not in self._device_tensors:
                    raise ValueError(f"device layer {name!r} has no KVCacheTensor.")
                self._layer_group[name] = group
        self._resident = [g for g in self._groups if g.kind == "resident"]
        self._hot = [g for g in self._groups if g.kind == "hot"]
        # Groups with a block table that grows with the request (everything but hot).
        self._paged = [g for g in self._groups if g.kind != "hot"]

        # Pair resident group i with the hot group over the same underlying layers.
        hot_by_layers = {tuple(underlying_layer_name(n) for n in g.spec.layer_names): g
                         for g in self._hot}
        self._hot_of: dict[int, _Group] = {}
        self._resident_of_layer: dict[str, _Group] = {}
        for group in self._resident:
            layers = tuple(underlying_layer_name(n) for n in group.spec.layer_names)
            if layers not in hot_by_layers:
                raise ValueError(f"resident group over {layers[0]!r}..{layers[-1]!r} has no "
                                 f"hot group over the same layers.")
            self._hot_of[group.index] = hot_by_layers[layers]
            for layer in layers:
                self._resident_of_layer[layer] = group
        missing = [layer for layer in self.source_layers if layer not in self._resident_of_layer]
        if missing:
            raise ValueError(f"source layers {missing} belong to no resident group.")
        hot_blocks = {g.pages_per_request for g in self._hot}
        self.hot_blocks_per_request = max(hot_blocks) if hot_blocks else 0
        if hot_blocks and min(hot_blocks) * self.block_size < self.device_buffer_size:
            raise ValueError(f"hot groups hold {min(hot_blocks)} blocks of "
                             f"{self.block_size} rows, fewer than device_buffer_size="
                             f"{self.device_buffer_size}.")

        # Index groups (leader first), each inside one resident/hot group.
        self.index_groups: list[tuple[str, ...]] = split_index_groups(src_spec.kv_cache_specs)
        for layers in self.index_groups:
            groups = {self._resident_of_layer[layer].index for layer in layers}
            if len(groups) != 1:
                raise ValueError(f"index group led by {layers[0]!r} spans {len(groups)} "
                                 f"resident groups; the planner keeps index groups whole.")

    def _layer_row_bytes(self, name: str, host: bool) -> int:
        tensor = (self._host_tensors if host else self._device_tensors)[name]
        blocks = self.num_host_blocks if host else self.num_device_blocks
        B = self.block_size if host else self._layer_group[name].block_size
        page, rem = divmod(tensor.size, blocks)
        if rem or page % B:
            raise ValueError(f"layer {name!r}: tensor of {tensor.size} B is not {blocks} pages "
                             f"of {B} rows.")
        return page // B

    def _build_tables(self) -> None:
        S, dev = self.max_num_seqs, self.device
        for group in self._groups:
            group.table = torch.zeros(S, group.pages_per_request, dtype=torch.int32, device=dev)
        self._seq_lens = torch.zeros(S, dtype=torch.int32, device=dev)
        self._host_table = torch.zeros(S, cdiv(self.max_model_len, self.block_size),
                                       dtype=torch.int32, device=dev)
        H = self.device_buffer_size
        self._lru_identity = torch.arange(H, dtype=torch.int32, device=dev)
        host_buf, dev_buf = self._host_pool.tensor, self._device_pool.tensor
        B = self.block_size

        def tables(layers: Sequence[str]) -> tuple[RowTable, RowTable, int]:
            sizes = {self._layer_row_bytes(layer, host=True) for layer in layers}
            if len(sizes) != 1:
                raise ValueError(f"layers {layers[0]!r}..{layers[-1]!r} mix row sizes "
                                 f"{sorted(sizes)} B.")
            row_bytes = sizes.pop()
            resident_names = [layer + HISPARSE_RESIDENT_SUFFIX for layer in layers]
            for layer, name in zip(layers, resident_names):
                if self._layer_row_bytes(name, host=False) != row_bytes:
                    raise ValueError(f"layer {layer!r} has different host and device rows.")
            device_table = RowTable.build(
                dev_buf, [self._device_tensors[n].offset for n in resident_names],
                row_bytes=row_bytes, block_size=B, block_stride=self.bytes_per_block,
                num_rows=self.num_device_blocks * B, device=dev)
            host_table = RowTable.build(
                host_buf, [self._host_tensors[layer].offset for layer in layers],
                row_bytes=row_bytes, block_size=B, block_stride=B * row_bytes,
                num_rows=self.num_host_blocks * B, device=dev)
            for layer in layers:
                if self._host_tensors[layer].block_stride != B * row_bytes:
                    raise ValueError(f"host layer {layer!r} is not contiguous "
                                     f"(block stride {self._host_tensors[layer].block_stride}).")
            return device_table, host_table, row_bytes

        self._index_groups: dict[str, _IndexGroup] = {}
        for layers in self.index_groups:
            resident = self._resident_of_layer[layers[0]]
            device_table, host_table, row_bytes = tables(layers)
            self._index_groups[layers[0]] = _IndexGroup(
                leader=layers[0], layers=layers, resident=resident,
                hot=self._hot_of[resident.index], device_table=device_table,
                host_table=host_table, row_bytes=row_bytes,
                slot_host_rows=torch.full((S, H), -1, dtype=torch.int32, device=dev),
                lru=self._lru_identity.repeat(S, 1),
                counters=torch.zeros(3, dtype=torch.int64, device=dev))
        self._leader_of = {layer: layers[0] for layers in self.index_groups for layer in layers}

        by_size: dict[int, list[str]] = {}
        for layer in self.source_layers:
            by_size.setdefault(self._layer_row_bytes(layer, host=True), []).append(layer)
        resident_pos = {g.index: i for i, g in enumerate(self._resident)}
        self._mirror_sets = []
        for layers in by_size.values():
            device_table, host_table, row_bytes = tables(layers)
            self._mirror_sets.append(_MirrorSet(
                layers=tuple(layers), row_bytes=row_bytes,
                resident_of_layer=torch.tensor(
                    [resident_pos[self._resident_of_layer[layer].index] for layer in layers],
                    dtype=torch.int64, device=dev),
                device_table=device_table, host_table=host_table))
        # Check every table once now (reads the offsets on the host), so that the decode
        # path never does it on first use.
        for table_owner in (*self._index_groups.values(), *self._mirror_sets):
            for table in (table_owner.device_table, table_owner.host_table):
                self._ops.validate_table(table, dev)

    # ------------------------------------------------------------------ small helpers
    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeClosedError("the HiSparseRuntime is closed.")

    def _request(self, request_id: Hashable, what: str = "") -> _Request:
        try:
            return self._requests[request_id]
        except (KeyError, TypeError):
            raise UnknownRequestError(request_id, what) from None

    def _to_device(self, values: np.ndarray | Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        """A small CPU array on the runtime's device without a host sync.

        On CUDA the values are first copied into a pinned staging buffer (torch's caching
        host allocator, which keeps the buffer until the copy has run), so the
        ``non_blocking`` copy is truly asynchronous: a copy from pageable memory would make
        the CPU wait for the stream.
        """
        cpu = torch.as_tensor(np.asarray(values), dtype=dtype)
        if self.device.type == "cpu":
            return cpu
        return cpu.pin_memory().to(self.device, non_blocking=True)

    def _on_device(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` on the runtime's device; a CPU tensor bound for CUDA is staged through
        pinned memory (no host sync; a tensor the caller pinned is copied as is, so the
        caller must not modify it before the stream has run the copy)."""
        if tensor.device == self.device:
            return tensor
        if tensor.device.type == "cpu" and self.device.type == "cuda":
            staged = tensor if tensor.is_pinned() else tensor.pin_memory()
            return staged.to(self.device, non_blocking=True)
        return tensor.to(self.device)

    def _track_peaks(self) -> None:
        self._peak_device = max(self._peak_device, self.device_block_pool.num_used)
        self._peak_host = max(self._peak_host, self.host_block_pool.num_used)

    def _free_device(self, kind: str, blocks: Iterable[int]) -> None:
        blocks = [int(b) for b in blocks if b]
        self.device_block_pool.free(blocks)
        self._in_use[kind] -= len(blocks)

    # ------------------------------------------------------------------ layer access
    def _device_layer_name(self, layer_name: str) -> str:
        """The group-layer name a device layer is known by: a model sparse layer name maps to
        its ``.hisparse_resident`` name; ``KeyError`` for a name that is no device layer."""
        name = layer_name
        if name not in self._layer_group and name in self._resident_of_layer:
            name = layer_name + HISPARSE_RESIDENT_SUFFIX
        if name not in self._layer_group:
            raise KeyError(f"{layer_name!r} is not a device layer of this runtime.")
        return name

    def device_cache(self, layer_name: str) -> torch.Tensor:
        """``[num_blocks, block_size, row_bytes] uint8`` view of a device layer.

        ``layer_name``: an indexer or regular layer, a sparse layer (its resident and hot
        views are these same bytes), or a ``.hisparse_resident``/``.hisparse_hot`` name.
        Row ``r`` of ``append_slots``/``resolve`` is ``view.view(-1, row_bytes)[r]``.
        """
        self._check_open()
        name = self._device_layer_name(layer_name)
        tensor = self._device_tensors[name]
        group = self._layer_group[name]
        return self._device_pool.view(tensor.offset, group.block_size,
                                      self._layer_row_bytes(name, host=False))

    def host_cache(self, layer_name: str) -> torch.Tensor:
        """``[host_num_blocks, block_size, row_bytes] uint8`` view of a source layer's host rows.

        On CUDA, reading it on the CPU right after ``commit()`` needs a
        ``torch.cuda.synchronize()`` first (the mirror runs asynchronously).
        """
        self._check_open()
        name = underlying_layer_name(layer_name)
        if name not in self._host_tensors:
            raise KeyError(f"{layer_name!r} is not a source (sparse) layer of this runtime.")
        tensor = self._host_tensors[name]
        row_bytes = self._layer_row_bytes(name, host=True)
        return self._host_pool.view(tensor.offset, self.num_host_blocks, self.block_size,
                                    row_bytes, tensor.block_stride)

    @property
    def device_layers(self) -> list[str]:
        """Layer names ``append_slots`` returns rows for (model layer names)."""
        names = []
        for group in self._paged:
            for name in group.spec.layer_names:
                names.append(underlying_layer_name(name) if group.kind == "resident" else name)
        return names

    @property
    def leaders(self) -> list[str]:
        """Index-group leader layers (what ``resolve`` takes), in model order."""
        return [layers[0] for layers in self.index_groups]

    def index_group(self, leader_layer: str) -> tuple[str, ...]:
        """The sparse layers (leader first) whose hot rows ``resolve(leader_layer)`` fills."""
        return self._index_group(leader_layer).layers

    def _index_group(self, leader_layer: str) -> _IndexGroup:
        group = self._index_groups.get(underlying_layer_name(leader_layer))
        if group is None:
            leader = self._leader_of.get(underlying_layer_name(leader_layer))
            hint = f"; its leader is {leader!r}" if leader else ""
            raise ValueError(f"{leader_layer!r} is not an index-group leader{hint}.")
        return group

    # ------------------------------------------------------------------ request state
    def has_request(self, request_id: Hashable) -> bool:
        return request_id in self._requests

    @property
    def request_ids(self) -> list[Hashable]:
        return list(self._requests)

    def seq_len(self, request_id: Hashable) -> int:
        """Tokens appended so far."""
        return self._request(request_id).seq_len

    def state_row(self, request_id: Hashable) -> int:
        """The request's row in the per-request device tables."""
        return self._request(request_id).row

    def state_rows(self, request_ids: Sequence[Optional[Hashable]]) -> torch.Tensor:
        """``[R] int32`` state rows on the device (-1 for ``None`` = padding)."""
        _check_id_list(request_ids)
        return self._to_device(self._rows_of(request_ids), torch.int32)

    def block_tables(self, layer_name: str) -> torch.Tensor:
        """``[max_num_seqs, pages] int32`` device block table of a layer's group, by state row.

        Indexer / regular layers: every page; sparse layers: resident pages (0 = the page
        left the GPU); ``.hisparse_hot`` names: the hot region. Index it with
        ``state_rows(...)``. The tensor is updated in place by the runtime.
        """
        self._check_open()
        return self._layer_group[self._device_layer_name(layer_name)].table

    def host_block_table(self, request_id: Hashable) -> list[int]:
        """The request's host blocks, one per reserved page (CPU list)."""
        return list(self._request(request_id).host_blocks)

    def block_table(self, request_id: Hashable, layer_name: str) -> list[int]:
        """The request's device blocks for a layer's group, one per page (CPU list)."""
        req = self._request(request_id)
        self._check_open()
        group = self._layer_group[self._device_layer_name(layer_name)]
        if group.kind == "hot":
            return list(req.hot[group.index]) if req.hot else []
        return [int(b) for b in req.pages[group.index][:cdiv(req.seq_len, group.block_size)]]

    # ------------------------------------------------------------------ lifecycle
    def add_request(self, request_id: Hashable, prompt_len: int, max_new_tokens: int) -> None:
        """Admit a request: reserve host pages for ``prompt_len + max_new_tokens`` and a state row.

        ``DuplicateRequestError`` (a ``ValueError``) for a live id; ``ValueError`` for bad
        lengths or more than ``max_model_len`` tokens; ``CapacityError`` when the host pool
        or the state rows (``max_num_seqs``) are full. Nothing changes on error.
        """
        self._check_open()
        if request_id is None:
            raise ValueError("request_id None is reserved for padding rows.")
        try:
            hash(request_id)
        except TypeError:
            raise ValueError(f"request_id must be hashable, got {request_id!r}.") from None
        if request_id in self._requests:
            raise DuplicateRequestError(f"request {request_id!r} is already live "
                                        f"(seq_len {self._requests[request_id].seq_len}).",
                                        request_id)
        prompt_len = _positive_int(f"request {request_id!r}: prompt_len", prompt_len)
        max_new_tokens = _positive_int(f"request {request_id!r}: max_new_tokens",
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
        host_blocks = self.host_block_pool.allocate(pages, request_id=request_id)
        row = self._free_rows.pop()
        req = _Request(request_id=request_id, row=row, prompt_len=prompt_len,
                       max_new_tokens=max_new_tokens, host_blocks=host_blocks,
                       pages={g.index: np.zeros(g.pages_per_request, dtype=np.int64)
                              for g in self._paged})
        self._requests[request_id] = req
        self._reset_row(row)
        self._host_table[row, :pages].copy_(self._to_device(host_blocks, torch.int32),
                                            non_blocking=True)
        self._track_peaks()

    def _reset_row(self, row: int) -> None:
        """Empty every device table of a state row (small device-side fills, no sync)."""
        self._seq_lens[row] = 0
        self._host_table[row].zero_()
        for group in self._groups:
            group.table[row].zero_()
        for index_group in self._index_groups.values():
            index_group.slot_host_rows[row].fill_(-1)
            index_group.lru[row].copy_(self._lru_identity)

    def append_slots(self, request_id: Hashable, num_tokens: int) -> dict[str, torch.Tensor]:
        """Allocate device pages for ``num_tokens`` new tokens; where to write their KV.

        Returns ``{layer_name: [num_tokens] int64}`` device rows for every device layer
        (sparse layers under their model name: their resident rows; indexer and regular
        layers). Layers of one group share one tensor; different groups get different rows.
        ``ReservationExceededError`` past ``prompt_len + max_new_tokens``;
        ``CapacityError`` when the device pool is full. Nothing changes on error.
        """
        self._check_open()
        req = self._request(request_id, "append_slots")
        num_tokens = _positive_int(f"request {request_id!r}: num_tokens", num_tokens, 0)
        new_len = req.seq_len + num_tokens
        if new_len > req.reserved_tokens:
            raise ReservationExceededError(
                f"request {request_id!r}: appending {num_tokens} tokens to {req.seq_len} "
                f"exceeds its reservation of {req.reserved_tokens} (prompt {req.prompt_len} + "
                f"max_new_tokens {req.max_new_tokens}).", request_id)
        new_pages = {g.index: (cdiv(new_len, g.block_size) - cdiv(req.seq_len, g.block_size))
                     for g in self._paged}
        needed = sum(new_pages.values())
        if needed > self.device_block_pool.num_free:
            raise CapacityError(
                f"request {request_id!r}: appending {num_tokens} tokens needs {needed} device "
                f"blocks, {self.device_block_pool.num_free} of "
                f"{self.device_block_pool.capacity} are free.", resource="device blocks",
                needed=needed, available=self.device_block_pool.num_free,
                request_id=request_id)
        positions = np.arange(req.seq_len, new_len, dtype=np.int64)
        out: dict[str, torch.Tensor] = {}
        for group in self._paged:
            count = new_pages[group.index]
            first = cdiv(req.seq_len, group.block_size)
            if count:
                blocks = self.device_block_pool.allocate(count, request_id=request_id)
                self._in_use[group.kind] += count
                req.pages[group.index][first:first + count] = blocks
                group.table[req.row, first:first + count].copy_(
                    self._to_device(blocks, torch.int32), non_blocking=True)
            B = group.block_size
            rows = req.pages[group.index][positions // B] * B + positions % B
            rows_t = self._to_device(rows, torch.int64)
            for name in group.spec.layer_names:
                key = underlying_layer_name(name) if group.kind == "resident" else name
                out[key] = rows_t
        req.seq_len = new_len
        self._seq_lens[req.row] = new_len
        self._track_peaks()
        return out

    def commit(self) -> None:
        """Mirror rows appended since the last commit to host; release pages that are done.

        1. One copy per row size moves every new row of every source layer from its resident
           page to the host pool (write-through).
        2. Sealed resident pages outside the last ``ACTIVE_TAIL_PAGES`` go back to the device
           pool (their host copy is durable: see the module docstring for the ordering).
           A request's first release also gives it its hot region; if the pool cannot hold
           it, the request keeps its pages resident (still exact) and tries again at the
           next commit (``stats().deferred_offloads`` counts this).
        3. Sliding-window groups release pages that left every future query's window.

        Call it once per step, after the step's attention has read the rows ``resolve``
        returned: released blocks are handed to other requests from here on.

        With a shared host pool only rank 0 (``mirrors_to_host``) copies in step 1; the
        other ranks skip the copy (their rows are the same bytes) and do steps 2-3 alike.
        The ranks must synchronise before resolving rows this commit mirrored (see the
        class docstring).
        """
        self._check_open()
        pending = [req for req in self._requests.values() if req.seq_len > req.committed_len]
        if pending and self.mirrors_to_host:
            self._mirror(pending)
        for req in pending:
            req.committed_len = req.seq_len
        for req in self._requests.values():
            self._release_resident(req)
            self._release_window(req)

    def _mirror(self, pending: list[_Request]) -> None:
        B = self.block_size
        host_rows, device_rows = [], []
        for req in pending:
            pos = np.arange(req.committed_len, req.seq_len, dtype=np.int64)
            page, offset = pos // B, pos % B
            host_rows.append(np.asarray(req.host_blocks, dtype=np.int64)[page] * B + offset)
            device_rows.append(np.stack([req.pages[g.index][page] * B + offset
                                         for g in self._resident]))
        host = np.concatenate(host_rows)                  # [n]
        device = np.concatenate(device_rows, axis=1)      # [num_resident, n]
        n = host.shape[0]
        ops = self._ops
        host_t = self._to_device(host, torch.int32)
        device_t = self._to_device(device, torch.int32)
        for mset in self._mirror_sets:
            layers = len(mset.layers)
            src_rows = device_t.index_select(0, mset.resident_of_layer).unsqueeze(1)  # [L,1,n]
            dst_rows = host_t.view(1, 1, n).expand(layers, 1, n)         # [L, 1, n]
            ops.copy_rows(mset.host_table, mset.device_table, src_rows, dst_rows,
                          backend=self.backend)
            self._d2h_bytes += n * layers * mset.row_bytes

    def _release_resident(self, req: _Request) -> None:
        if not self._resident:
            return
        B = self.block_size
        limit = min(req.committed_len // B, cdiv(req.seq_len, B) - ACTIVE_TAIL_PAGES)
        first = req.released_pages
        if limit <= first:
            return
        count = limit - first
        if req.hot is None:
            if count < self.offload_threshold_pages:
                return
            need = sum(g.pages_per_request for g in self._hot)
            if self.device_block_pool.num_free + count * len(self._resident) < need:
                self._deferred_offloads += 1
                return
        for group in self._resident:
            self._free_device("resident", req.pages[group.index][first:limit])
            req.pages[group.index][first:limit] = 0
            group.table[req.row, first:limit] = 0
        req.released_pages = limit
        if req.hot is None:
            req.hot = {}
            for group in self._hot:
                blocks = self.device_block_pool.allocate(group.pages_per_request,
                                                         request_id=req.request_id)
                self._in_use["hot"] += len(blocks)
                req.hot[group.index] = blocks
                group.table[req.row].copy_(self._to_device(blocks, torch.int32),
                                           non_blocking=True)
            self._track_peaks()

    def _release_window(self, req: _Request) -> None:
        for group in self._paged:
            if group.sliding_window is None:
                continue
            B = group.block_size
            # Future queries start at position committed_len and see the last `window` tokens.
            limit = max(0, req.committed_len - group.sliding_window) // B
            first = req.window_freed.get(group.index, 0)
            if limit <= first:
                continue
            self._free_device(group.kind, req.pages[group.index][first:limit])
            req.pages[group.index][first:limit] = 0
            group.table[req.row, first:limit] = 0
            req.window_freed[group.index] = limit

    def free_request(self, request_id: Hashable) -> None:
        """Return every host and device block of the request and its state row."""
        self._check_open()
        req = self._request(request_id, "free_request")
        self.host_block_pool.free(req.host_blocks)
        for group in self._paged:
            self._free_device(group.kind, req.pages[group.index])
        if req.hot is not None:
            for blocks in req.hot.values():
                self._free_device("hot", blocks)
        self._reset_row(req.row)
        self._free_rows.append(req.row)
        self._free_rows.sort(reverse=True)
        del self._requests[request_id]

    # ------------------------------------------------------------------ decode step
    def _rows_of(self, request_ids: Sequence[Optional[Hashable]]) -> list[int]:
        rows, seen = [], set()
        for request_id in request_ids:
            if request_id is None:
                rows.append(-1)
                continue
            req = self._request(request_id, "resolve")
            if req.row in seen:
                raise DuplicateRequestError(f"request {request_id!r} appears twice in one "
                                            f"batch.", request_id)
            seen.add(req.row)
            rows.append(req.row)
        return rows

    def resolve(self, leader_layer: str, request_ids: Sequence[Optional[Hashable]],
                topk: torch.Tensor) -> torch.Tensor:
        """Resolve one index group's top-k positions into device rows; gather the misses.

        - ``leader_layer``: an index-group leader (``leaders``).
        - ``request_ids``: one per batch row; ``None`` = a padding row (outputs -1).
        - ``topk``: ``[R, K]`` integer token positions on the runtime's device, ``K <=
          device_buffer_size``; any value is allowed: negative, ``>= seq_len`` or huge
          positions resolve to -1.
        Returns ``[R, K] int32`` rows of ``device_cache(layer)`` valid for the leader and
        every follower (-1 = masked), until the next ``commit()``/``free_request()`` or the
        next resolve of this index group for the same request. Misses are gathered host ->
        device into the hot rows of all of the index group's layers in one launch. Counters
        accumulate on the device; nothing here waits for the device (a CPU ``topk`` is staged
        through pinned memory; narrow integer dtypes convert losslessly, 64-bit ones
        saturate). ``DuplicateRequestError`` for one id twice, ``UnknownRequestError``,
        ``ValueError`` for a bad leader or ``topk``; nothing changes on error.
        """
        self._check_open()
        self._index_group(leader_layer)
        self._check_topk(topk)
        _check_id_list(request_ids)
        if topk.shape[0] != len(request_ids):
            raise ValueError(f"topk has {topk.shape[0]} rows but {len(request_ids)} request "
                             f"ids were given.")
        state_rows = self.state_rows(request_ids)
        return self.resolve_rows(leader_layer, state_rows, topk)

    def _check_topk(self, topk: torch.Tensor) -> None:
        if not isinstance(topk, torch.Tensor) or topk.dim() != 2:
            raise ValueError(f"topk must be a 2-D [rows, k] tensor, got "
                             f"{type(topk).__name__} of shape "
                             f"{tuple(getattr(topk, 'shape', ()))}.")
        if topk.dtype.is_floating_point or topk.dtype.is_complex or topk.dtype == torch.bool:
            raise ValueError(f"topk must hold integer positions, got {topk.dtype}.")
        if not 1 <= topk.shape[1] <= self.device_buffer_size:
            raise ValueError(f"top-k width {topk.shape[1]} must be in [1, device_buffer_size="
                             f"{self.device_buffer_size}].")

    def resolve_rows(self, leader_layer: str, state_rows: torch.Tensor,
                     topk: torch.Tensor) -> torch.Tensor:
        """``resolve`` by state rows: the fixed-shape, host-free core (CUDA-graph friendly).

        ``state_rows``: ``[R] int32`` on the runtime's device (``state_rows(ids)``), -1 =
        padding; rows must be distinct. A row that is not live resolves against an empty
        request (all -1). ``topk``: ``[R, K]``, as for ``resolve``. Only shapes are checked.
        """
        self._check_open()
        group = self._index_group(leader_layer)
        self._check_topk(topk)
        R, K = topk.shape
        if (not isinstance(state_rows, torch.Tensor) or state_rows.dtype != torch.int32
                or tuple(state_rows.shape) != (R,)):
            raise ValueError(f"state_rows must be an int32 tensor [{R}], got "
                             f"{getattr(state_rows, 'dtype', type(state_rows).__name__)} of "
                             f"shape {tuple(getattr(state_rows, 'shape', ()))}.")
        if R == 0:
            return torch.empty(0, K, dtype=torch.int32, device=self.device)
        state_rows = self._on_device(state_rows)
        topk = self._on_device(topk)
        if topk.dtype != torch.int32:
            if topk.dtype.itemsize < 4:
                topk = topk.to(torch.int32)           # lossless
            else:  # int64 / uint32 / uint64: saturate, so huge positions mask, never wrap
                topk = topk.to(torch.int64).clamp(-1, _INT32_MAX).to(torch.int32)
        topk = topk.contiguous()
        ops = self._ops
        result = ops.resolve(
            topk, state_rows, self._seq_lens, group.resident.table, self._host_table,
            group.hot.table, group.slot_host_rows, group.lru, block_size=self.block_size,
            num_device_blocks=self.num_device_blocks, num_host_blocks=self.num_host_blocks,
            backend=self.backend)
        ops.copy_rows(group.device_table, group.host_table, result.miss_src, result.miss_dst,
                      result.miss_count, backend=self.backend)
        group.counters += result.stats.sum(dim=0)
        return result.rows

    # ------------------------------------------------------------------ stats / close
    def stats(self) -> HiSparseStats:
        """Counters and occupancy. Reads the device counters: a device sync on CUDA, so call
        it between steps, not inside the decode path."""
        self._check_open()
        groups = list(self._index_groups.values())
        per_group = torch.stack([g.counters for g in groups]).tolist()
        hits, misses, masked = (sum(row[i] for row in per_group) for i in range(3))
        h2d = sum(row[1] * g.bytes_per_miss for row, g in zip(per_group, groups))
        return HiSparseStats(
            hits=hits, misses=misses, masked=masked, h2d_bytes=h2d, d2h_bytes=self._d2h_bytes,
            resident_blocks=self._in_use["resident"], hot_blocks=self._in_use["hot"],
            host_blocks=self.host_block_pool.num_used, indexer_blocks=self._in_use["indexer"],
            regular_blocks=self._in_use["regular"],
            device_blocks_total=self.device_block_pool.capacity,
            host_blocks_total=self.host_block_pool.capacity,
            peak_device_blocks=self._peak_device, peak_host_blocks=self._peak_host,
            num_requests=len(self._requests), deferred_offloads=self._deferred_offloads)

    def reset_stats(self) -> None:
        """Zero the hit/miss/byte counters (occupancy is not a counter)."""
        self._check_open()
        for group in self._index_groups.values():
            group.counters.zero_()
        self._d2h_bytes = 0
        self._deferred_offloads = 0
        self._peak_device = self.device_block_pool.num_used
        self._peak_host = self.host_block_pool.num_used

    def _debug_snapshot(self) -> dict:
        """Every piece of mutable state, as comparable CPU values (tests: "a failed call
        changes nothing"). Copies every device table (a device sync on CUDA)."""
        tensors = {"seq_lens": self._seq_lens, "host_table": self._host_table}
        for group in self._groups:
            tensors[f"group{group.index}.table"] = group.table
        for leader, index_group in self._index_groups.items():
            tensors[f"{leader}.slot_host_rows"] = index_group.slot_host_rows
            tensors[f"{leader}.lru"] = index_group.lru
            tensors[f"{leader}.counters"] = index_group.counters
        state: dict = {name: t.detach().cpu().tolist() for name, t in tensors.items()}
        for request_id, req in self._requests.items():
            state[("request", request_id)] = (
                req.row, req.prompt_len, req.max_new_tokens, list(req.host_blocks),
                {k: v.tolist() for k, v in req.pages.items()}, req.seq_len, req.committed_len,
                req.released_pages, dict(req.window_freed),
                None if req.hot is None else {k: list(v) for k, v in req.hot.items()})
        for pool in (self.device_block_pool, self.host_block_pool):
            state[("pool", pool.name)] = (list(pool._free), list(pool._ref))
        state["misc"] = (list(self._free_rows), dict(self._in_use), self._d2h_bytes,
                         self._peak_device, self._peak_host, self._deferred_offloads)
        return state

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Drop every request and release both pools (unpins the host pool); idempotent."""
        if self._closed:
            return
        self._closed = True
        self._requests.clear()
        if self._host_pool is not None:
            self._host_pool.close()
        if getattr(self, "_device_pool", None) is not None:
            self._device_pool.close()

    def __enter__(self) -> "HiSparseRuntime":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"{len(self._requests)} requests"
        return (f"HiSparseRuntime({len(self.source_layers)} sparse layers, "
                f"{len(self.index_groups)} index groups, {self.num_device_blocks} device / "
                f"{self.num_host_blocks} host blocks, device={self.device}, "
                f"backend={self.backend!r}, {state})")


__all__ = ["BACKENDS", "HiSparseRuntime", "HiSparseStats", "HiSparseError"]
