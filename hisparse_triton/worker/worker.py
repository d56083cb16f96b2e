"""``HiSparseWorker``: the GPU-side half of the runtime (pools, device tables, resolve, mirror).

One worker per GPU rank. It owns the tensors: the host pool (created, or attached when the
ranks of a node share it), the device pool, the per-request table arena, the hot state of
every index group and the device counters. It makes no decisions: every table change comes
from the scheduler in a ``StepPlan``, applied in plan order:

    worker.apply(plan)          # before the forward: ONE host -> device copy of the plan
    ...  forward: the model writes KV at the scheduler's rows; per index group
         ids = worker.resolve_rows(leader, state_rows, topk)   -> attention reads ids  ...
    worker.mirror(plan)         # after the forward: new rows device -> host

Tables (``TableLayout``): one int32 arena ``[max_num_seqs, width]``; ``seq_lens``, the host
block table and every device group's block table are column views of it (row stride
``width``), so a plan is applied with one copy and one scatter. Hot state per index group:
``slot_host_rows [S, H]`` (host row held by each slot, -1 empty) and ``lru [S, H]`` (slot ids,
least recently used first), stacked ``[G, S, H]``. Counters ``[G, 3] int64`` (hits, misses,
masked) accumulate on the device.

Ordering on CUDA: every copy and kernel is enqueued on the current stream; nothing here waits
for the device except ``stats()`` (one counter read) and a plan-staging slot reused before
its copy ran (a ring of ``STAGING_SLOTS`` pinned buffers, so the CPU may run that many plans
ahead). A released block is written again only by work enqueued after the mirror that read
it, which the stream orders. A caller using several streams must order them itself.

With a shared host pool (the TP ranks of one node): rank 0 creates the pool and is the only
rank whose ``mirror`` copies; every rank applies the same plans, so their tables agree.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
from dataclasses import dataclass, field
from typing import Optional, Sequence

import numpy as np
import torch

from hisparse_triton.config import EngineConfig
from hisparse_triton.errors import RuntimeClosedError
from hisparse_triton.groups import IndexGroup, PlanGroups
from hisparse_triton.layout import device_row_layout, underlying_layer_name
from hisparse_triton.memory import MemoryRequest, check_memory
from hisparse_triton.worker.pools import DevicePool, HostPool
from hisparse_triton.row_table import RowTable
from hisparse_triton.specs import KVCacheConfig
from hisparse_triton.step_plan import StepPlan, TableLayout

logger = logging.getLogger(__name__)

BACKENDS = ("auto", "triton", "torch")
#: Pinned staging buffers for plans in flight (the CPU may run this many plans ahead).
STAGING_SLOTS = 4


@dataclass(frozen=True)
class WorkerStats:
    """Transfer counters of a worker (``HiSparseWorker.stats()``).

    - ``hits``: resolved top-k columns served from a resident page or a hot slot;
      ``misses``: distinct host rows gathered (once per index group, however many follower
      layers copy them); ``masked``: columns that resolved to -1.
    - ``h2d_bytes``: bytes gathered host -> device (misses x row bytes x layers of the index
      group); ``d2h_bytes``: bytes this worker mirrored device -> host (0 on a rank that
      does not write a shared host pool).
    - ``plans``: plans applied.
    """

    hits: int
    misses: int
    masked: int
    h2d_bytes: int
    d2h_bytes: int
    plans: int

    @property
    def hit_rate(self) -> float:
        """``hits / (hits + misses)`` (1.0 when nothing was resolved)."""
        total = self.hits + self.misses
        return self.hits / total if total else 1.0


class StatsSnapshot:
    """Counters being copied to the host (``HiSparseWorker.stats_async``)."""

    def __init__(self, worker: "HiSparseWorker", counters: torch.Tensor,
                 event: Optional["torch.cuda.Event"], d2h_bytes: int, plans: int) -> None:
        self._worker, self._counters, self._event = worker, counters, event
        self._d2h_bytes, self._plans = d2h_bytes, plans

    def ready(self) -> bool:
        """Whether ``result()`` would return without waiting."""
        return self._event is None or self._event.query()

    def result(self) -> WorkerStats:
        """The counters as of the ``stats_async`` call (waits for the copy only)."""
        if self._event is not None:
            self._event.synchronize()
        stats = self._worker._stats_from(self._counters.tolist())
        return dataclasses.replace(stats, d2h_bytes=self._d2h_bytes, plans=self._plans)


@dataclass
class _IndexGroupState:
    """Device state of one index group: tables, row tables, hot state views, counters."""

    group: IndexGroup
    resident_table: torch.Tensor              # [S, P] int32 view of the arena
    hot_table: torch.Tensor                   # [S, HB] int32 view of the arena
    device_table: RowTable                    # its layers' rows in the device pool
    host_table: RowTable                      # its layers' rows in the host pool
    row_bytes: int
    slot_host_rows: torch.Tensor = field(repr=False)  # [S, H] int32 view
    lru: torch.Tensor = field(repr=False)             # [S, H] int32 view
    counters: torch.Tensor = field(repr=False)        # [3] int64 view
    rows_out: Optional[torch.Tensor] = field(repr=False, default=None)  # [R, K] last rows
    rows_view: Optional[torch.Tensor] = field(repr=False, default=None)  # it, as returned
    bound: Optional[object] = field(repr=False, default=None)  # kernels' BoundResolve
    bound_gather: Optional[object] = field(repr=False, default=None)  # kernels' BoundCopy

    @property
    def layers(self) -> tuple[str, ...]:
        return self.group.layers

    @property
    def bytes_per_miss(self) -> int:
        """Bytes one gathered host row moves: a row of the leader and of every follower."""
        return self.row_bytes * len(self.group.layers)


@dataclass
class _MirrorSet:
    """Source layers of one row size, mirrored device -> host by one copy launch."""

    layers: tuple[str, ...]
    row_bytes: int
    resident_of_layer: torch.Tensor  # [L] int64: row of plan.mirror_device_rows per layer
    device_table: RowTable
    host_table: RowTable


def plan_fingerprint(kv_cache_config: KVCacheConfig) -> str:
    """A short hash of a plan: the ranks sharing one host pool must have planned alike."""
    return hashlib.sha256(repr(kv_cache_config).encode()).hexdigest()[:24]


def parse_device(device: object) -> torch.device:
    """``device`` (``None`` = CUDA when available, else CPU) as a usable ``torch.device``;
    ``ValueError`` naming it when it is not a cpu/cuda device or is CUDA on a machine
    without."""
    if device is None:
        parsed = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    else:
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
        if parsed.index is None:
            parsed = torch.device("cuda", torch.cuda.current_device())
    return parsed


class HiSparseWorker:
    """The tensor-owning worker half of HiSparse (see the module docstring).

    - ``kv_cache_config``, ``config``: the same objects the scheduler was built from.
    - ``max_num_seqs``: state rows (must equal the scheduler's).
    - ``device``: where the device pool and tables live (default: CUDA if available, else
      CPU). ``backend``: ``"auto"`` (Triton on CUDA, torch elsewhere), ``"triton"`` (CUDA, or
      CPU under ``TRITON_INTERPRET=1``) or ``"torch"`` (the reference ops).
    - ``tp_rank``, ``host_pool_name``: for a plan with ``hisparse_shared_host_pool``:
      ``host_pool_name`` is required; rank 0 creates the pool, every other rank attaches;
      only rank 0's ``mirror`` copies (``mirrors_to_host``).
    - ``host_ram_fraction``: the host pool may use at most this fraction of available RAM.
    """

    def __init__(self, kv_cache_config: KVCacheConfig, config: EngineConfig, *,
                 max_num_seqs: int, device: torch.device | str | None = None,
                 backend: str = "auto", tp_rank: int = 0,
                 host_pool_name: Optional[str] = None,
                 host_ram_fraction: float = 0.9) -> None:
        if not isinstance(config, EngineConfig) or config.hisparse is None:
            raise ValueError("HiSparseWorker needs an EngineConfig with hisparse set.")
        if isinstance(max_num_seqs, bool) or not isinstance(max_num_seqs, int) \
                or max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be an int >= 1, got {max_num_seqs!r}.")
        self.shared_host_pool = bool(kv_cache_config.hisparse_shared_host_pool)
        if isinstance(tp_rank, bool) or not isinstance(tp_rank, int) or tp_rank < 0:
            raise ValueError(f"tp_rank must be an int >= 0, got {tp_rank!r}.")
        if tp_rank >= config.tensor_parallel_size:
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
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}.")
        if (isinstance(host_ram_fraction, bool)
                or not isinstance(host_ram_fraction, (int, float))
                or not 0 < host_ram_fraction <= 1):
            raise ValueError(f"host_ram_fraction must be in (0, 1], got {host_ram_fraction!r}.")
        self.tp_rank = tp_rank
        self.host_pool_name = host_pool_name
        #: Whether ``mirror`` writes the host pool (rank 0 of a shared pool, or a private one).
        self.mirrors_to_host = not self.shared_host_pool or tp_rank == 0
        self.device = parse_device(device)
        from hisparse_triton import ops  # imported here: it registers torch.library ops

        try:
            self._kernel_backend = ops.select_backend(backend, self.device)
        except ops.BackendUnavailableError as exc:
            raise ValueError(str(exc)) from None
        self._ops = ops
        self.backend = backend
        self.config = config
        self.kv_cache_config = kv_cache_config
        self.max_num_seqs = max_num_seqs
        self.max_model_len = config.max_model_len
        self.device_buffer_size = int(config.hisparse.device_buffer_size)
        self.groups = PlanGroups.from_config(kv_cache_config, config)
        self.block_size = self.groups.block_size
        self.layout = TableLayout.build(self.groups, max_num_seqs)
        self.num_device_blocks = kv_cache_config.num_blocks
        self.num_host_blocks = kv_cache_config.hisparse_host_num_blocks
        if self.num_host_blocks < 2:
            raise ValueError(f"the host pool needs at least 2 blocks (the null block and one "
                             f"page), the plan has {self.num_host_blocks}.")
        self.bytes_per_block = kv_cache_config.bytes_per_block
        self._closed = False
        self._host_pool: Optional[HostPool] = None
        self._device_pool: Optional[DevicePool] = None
        self._next_step = 1
        self._mirror_due: Optional[StepPlan] = None
        self._last_undo: Optional[tuple] = None
        self._d2h_bytes = 0
        self._plans = 0
        host_bytes = max(t.offset + t.size for t in self.groups.host_tensors.values())
        # Everything this worker will allocate, checked together before anything is.
        check_memory([
            *HostPool.memory_requests(host_bytes, shared=self.shared_host_pool,
                                      create=tp_rank == 0),
            *DevicePool.memory_requests(self.num_device_blocks, self.bytes_per_block,
                                        self.device),
            MemoryRequest("per-request tables and hot state", self.table_bytes, self.device,
                          hint="max_num_seqs or device_buffer_size")],
            max_ram_fraction=host_ram_fraction)
        # The runtime's tensors are ordinary tensors whatever the caller's mode: built
        # outside inference mode and without autograd, so in-place updates work from both.
        with torch.inference_mode(False), torch.no_grad():
            self._host_pool = HostPool(host_bytes, pin=self.device.type == "cuda",
                                       max_ram_fraction=host_ram_fraction, device=self.device,
                                       shared_name=host_pool_name, create=tp_rank == 0,
                                       fingerprint=plan_fingerprint(kv_cache_config))
            try:  # a failure below must not leave the (pinned) host pool to the GC
                self._device_pool = DevicePool(self.num_device_blocks, self.bytes_per_block,
                                               self.device)
                self._build_tables()
            except BaseException:
                self.close()
                raise
        logger.info("HiSparseWorker rank %d on %s: %d device blocks x %d B, %d host blocks "
                    "(%.2f GiB%s), %d index groups, backend %s (%s); %s", tp_rank, self.device,
                    self.num_device_blocks, self.bytes_per_block, self.num_host_blocks,
                    host_bytes / (1 << 30), ", shared" if self.shared_host_pool else "",
                    len(self.groups.index_groups), backend, self._kernel_backend,
                    self._launch_config_source())

    def _launch_config_source(self) -> str:
        """Where the transfer kernels' launch configs come from, for the start-up log."""
        if self._kernel_backend != "triton" or self.device.type != "cuda":
            return "launch configs: not used (reference ops)" \
                if self._kernel_backend != "triton" else "launch configs: built-in defaults"
        from hisparse_triton import tuning_cache

        if tuning_cache.disabled():
            return "launch configs: built-in defaults (tuning cache disabled)"
        cache = tuning_cache.load_current()
        if cache.entries:
            return f"launch configs: tuned ({len(cache.entries)} entries in {cache.path})"
        return f"launch configs: built-in defaults (no tuning cache at {cache.path})"

    # ------------------------------------------------------------------ construction
    @property
    def table_bytes(self) -> int:
        """Device bytes of the per-request tables, hot state and counters."""
        S, H = self.max_num_seqs, self.device_buffer_size
        G = len(self.groups.index_groups)
        return 4 * S * self.layout.width + 2 * 4 * G * S * H + 4 * H + 8 * 3 * G

    def _layer_row_bytes(self, name: str, host: bool) -> int:
        tensor = (self.groups.host_tensors if host else self.groups.device_tensors)[name]
        blocks = self.num_host_blocks if host else self.num_device_blocks
        B = (self.block_size if host
             else self.groups.groups[self.groups.layer_group[name]].block_size)
        page, rem = divmod(tensor.size, blocks)
        if rem or page % B:
            raise ValueError(f"layer {name!r}: tensor of {tensor.size} B is not {blocks} pages "
                             f"of {B} rows.")
        return page // B

    def _build_tables(self) -> None:
        S, dev, L = self.max_num_seqs, self.device, self.layout
        self._arena = torch.zeros(S, L.width, dtype=torch.int32, device=dev)
        self._arena_flat = self._arena.view(-1)
        self.seq_lens = self._arena[:, L.SEQ_LEN_COL]
        self.host_table = self._arena[:, L.host_col:L.host_col + L.host_width]
        self.tables = [self._arena[:, col:col + width]
                       for col, width in zip(L.group_cols, L.group_widths)]
        H = self.device_buffer_size
        G = len(self.groups.index_groups)
        self._lru_identity = torch.arange(H, dtype=torch.int32, device=dev)
        self._slot_host_rows = torch.full((G, S, H), -1, dtype=torch.int32, device=dev)
        self._lru = self._lru_identity.repeat(G, S, 1)
        self._counters = torch.zeros(G, 3, dtype=torch.int64, device=dev)
        self._staging = [torch.empty(0, dtype=torch.int32) for _ in range(STAGING_SLOTS)]
        self._staging_events: list[Optional[torch.cuda.Event]] = [None] * STAGING_SLOTS
        self._staging_next = 0
        self._plan_device = torch.empty(0, dtype=torch.int32, device=dev)
        # Scratch and miss plan of every resolve (calls run one after another on a stream).
        self._workspace = self._ops.ResolveWorkspace(dev)
        host_buf, dev_buf = self._host_pool.tensor, self._device_pool.tensor
        B = self.block_size
        groups = self.groups

        def tables(layers: Sequence[str]) -> tuple[RowTable, RowTable, int]:
            sizes = {self._layer_row_bytes(layer, host=True) for layer in layers}
            if len(sizes) != 1:
                raise ValueError(f"layers {layers[0]!r}..{layers[-1]!r} mix row sizes "
                                 f"{sorted(sizes)} B.")
            row_bytes = sizes.pop()
            device_names = [groups.resident_layer_name[layer] for layer in layers]
            for layer, name in zip(layers, device_names):
                if self._layer_row_bytes(name, host=False) != row_bytes:
                    raise ValueError(f"layer {layer!r} has different host and device rows.")
                if groups.host_tensors[layer].block_stride != B * row_bytes:
                    raise ValueError(f"host layer {layer!r} is not contiguous (block stride "
                                     f"{groups.host_tensors[layer].block_stride}).")
            device_table = RowTable.build(
                dev_buf, [groups.device_tensors[n].offset for n in device_names],
                row_bytes=row_bytes, block_size=B, block_stride=self.bytes_per_block,
                num_rows=self.num_device_blocks * B, device=dev)
            host_table = RowTable.build(
                host_buf, [groups.host_tensors[layer].offset for layer in layers],
                row_bytes=row_bytes, block_size=B, block_stride=B * row_bytes,
                num_rows=self.num_host_blocks * B, device=dev)
            return device_table, host_table, row_bytes

        self._index_groups: dict[str, _IndexGroupState] = {}
        for ig in groups.index_groups:
            device_table, host_table, row_bytes = tables(ig.layers)
            self._index_groups[ig.leader] = _IndexGroupState(
                group=ig, resident_table=self.tables[ig.resident],
                hot_table=self.tables[ig.hot], device_table=device_table,
                host_table=host_table, row_bytes=row_bytes,
                slot_host_rows=self._slot_host_rows[ig.number], lru=self._lru[ig.number],
                counters=self._counters[ig.number])

        if self._kernel_backend == "triton":
            from hisparse_triton.kernels.gather import BoundCopy
            from hisparse_triton.kernels.resolve import BoundResolve

            for state in self._index_groups.values():
                state.bound = BoundResolve(
                    self.seq_lens, state.resident_table, self.host_table, state.hot_table,
                    state.slot_host_rows, state.lru, block_size=B,
                    num_device_blocks=self.num_device_blocks,
                    num_host_blocks=self.num_host_blocks, counters=state.counters,
                    workspace=self._workspace)
                state.bound_gather = BoundCopy(state.device_table, state.host_table,
                                               pages=False, kernel="gather")

        by_size: dict[int, list[str]] = {}
        for layer in groups.source_layers:
            by_size.setdefault(self._layer_row_bytes(layer, host=True), []).append(layer)
        resident_pos = {g.position: i for i, g in enumerate(groups.resident)}
        self._mirror_sets: list[_MirrorSet] = []
        for layers in by_size.values():
            device_table, host_table, row_bytes = tables(layers)
            self._mirror_sets.append(_MirrorSet(
                layers=tuple(layers), row_bytes=row_bytes,
                resident_of_layer=torch.tensor(
                    [resident_pos[groups.resident_of_layer[layer]] for layer in layers],
                    dtype=torch.int64, device=dev),
                device_table=device_table, host_table=host_table))
        # Check every table once now (reads the offsets on the host), so that the decode
        # path never does it on first use.
        for owner in (*self._index_groups.values(), *self._mirror_sets):
            for table in (owner.device_table, owner.host_table):
                self._ops.validate_table(table, dev)

    # ------------------------------------------------------------------ plans
    def apply(self, plan: StepPlan) -> None:
        """Write one plan's table changes: resets first, then the writes (one packed
        host -> device copy, then on-device scatters; no host sync).

        Plans must come in order (``plan.step`` = the previous plan's + 1) and a plan with
        mirror rows must be ``mirror``-ed before the next one is applied; an out-of-order or
        foreign plan is refused (``ValueError``) and changes nothing.
        """
        self._check_open()
        if not isinstance(plan, StepPlan):
            raise ValueError(f"apply takes a StepPlan, got {type(plan).__name__}.")
        if plan.step != self._next_step:
            what = "repeated" if plan.step < self._next_step else "skipped ahead"
            raise ValueError(f"StepPlan {plan.step} is out of order ({what}): this worker "
                             f"expects step {self._next_step}.")
        if self._mirror_due is not None:
            raise ValueError(f"StepPlan {self._mirror_due.step} has mirror rows that were "
                             f"never mirrored: call mirror(plan) after the forward, before "
                             f"applying step {plan.step}.")
        plan.check(self.layout, self.num_device_blocks, self.num_host_blocks, self.block_size)
        if plan.num_mirror and plan.num_resident != len(self.groups.resident):
            raise ValueError(f"StepPlan {plan.step} mirrors {plan.num_resident} resident "
                             f"groups; this plan has {len(self.groups.resident)}.")
        with torch.inference_mode(False), torch.no_grad():
            data = self._upload(plan)
            undo = self._write_tables(plan, data)
        self._last_undo = (plan.step, undo)
        self._next_step += 1
        self._plans += 1
        self._mirror_due = plan if plan.num_mirror else None

    def _upload(self, plan: StepPlan) -> torch.Tensor:
        """The plan's int32 data on the device: one copy through a pinned staging slot."""
        host = torch.from_numpy(plan.data)
        if self.device.type == "cpu":
            return host
        n = host.numel()
        slot = self._staging_next
        event = self._staging_events[slot]
        if event is not None:
            event.synchronize()  # that slot's earlier copy must have read it
        if self._staging[slot].numel() < n:
            self._staging[slot] = torch.empty(max(n, 2 * self._staging[slot].numel(), 1024),
                                              dtype=torch.int32, pin_memory=True)
        if self._plan_device.numel() < n:
            self._plan_device = torch.empty(max(n, 2 * self._plan_device.numel(), 1024),
                                            dtype=torch.int32, device=self.device)
        staged = self._staging[slot][:n]
        staged.copy_(host)
        data = self._plan_device[:n]
        data.copy_(staged, non_blocking=True)
        if event is None:
            event = self._staging_events[slot] = torch.cuda.Event()
        event.record()
        self._staging_next = (slot + 1) % STAGING_SLOTS
        return data

    def _sections(self, plan: StepPlan, data: torch.Tensor):
        r, w = plan.num_resets, plan.num_writes
        return data[:r], data[r:r + w], data[r + w:r + 2 * w]

    def _write_tables(self, plan: StepPlan, data: torch.Tensor) -> tuple:
        """Apply resets and writes; returns what undoes them. On a failure part-way the
        touched entries are restored before the error propagates."""
        resets, index, value = self._sections(plan, data)
        undo: tuple = ()
        if plan.num_resets:
            undo = (resets, self._arena[resets].clone(),
                    self._slot_host_rows[:, resets].clone(), self._lru[:, resets].clone())
        old_values = self._arena_flat[index] if plan.num_writes else None
        try:
            if plan.num_resets:
                self._arena[resets] = 0
                self._slot_host_rows[:, resets] = -1
                self._lru[:, resets] = self._lru_identity
            if plan.num_writes:
                self._arena_flat[index] = value
        except BaseException:
            self._undo_tables(undo, index, old_values)
            raise
        return undo, index, old_values

    def _undo_tables(self, resets_undo: tuple, index: torch.Tensor,
                     old_values: Optional[torch.Tensor]) -> None:
        if old_values is not None:
            self._arena_flat[index] = old_values
        if resets_undo:
            rows, arena, slots, lru = resets_undo
            self._arena[rows] = arena
            self._slot_host_rows[:, rows] = slots
            self._lru[:, rows] = lru

    def _unapply(self, plan: StepPlan) -> None:
        """Undo the last ``apply`` (the in-process runtime's rollback when a later part of
        one of its calls fails)."""
        if self._last_undo is None or self._last_undo[0] != plan.step:
            raise ValueError(f"StepPlan {plan.step} is not the last plan applied.")
        undo, index, old_values = self._last_undo[1]
        with torch.inference_mode(False), torch.no_grad():
            self._undo_tables(undo, index, old_values)
        self._last_undo = None
        self._next_step -= 1
        self._plans -= 1
        self._mirror_due = None

    def mirror(self, plan: StepPlan) -> None:
        """Copy the plan's new rows of every source layer device -> host (one launch per row
        size), after the forward wrote them. On a rank that does not write a shared host
        pool this only records that the step is done; a plan without mirror rows (or one
        already mirrored) needs nothing. ``ValueError`` for a plan other than the last one
        applied."""
        self._check_open()
        step = getattr(plan, "step", None)
        if not isinstance(plan, StepPlan) or step != self._next_step - 1:
            raise ValueError(f"mirror(plan) takes the last plan applied (step "
                             f"{self._next_step - 1}), got step {step!r}.")
        if self._mirror_due is None:  # nothing to copy, or already mirrored
            return
        if self.mirrors_to_host:
            n = plan.num_mirror
            with torch.inference_mode(False), torch.no_grad():
                data = self._plan_device if self.device.type != "cpu" else None
                start = plan.num_resets + 2 * plan.num_writes
                if data is None:
                    packed = torch.from_numpy(plan.data)
                else:
                    packed = data[:plan.data.size]
                host = packed[start:start + n]
                device = packed[start + n:start + n * (1 + plan.num_resident)].view(
                    plan.num_resident, n)
                for mset in self._mirror_sets:
                    layers = len(mset.layers)
                    src = device.index_select(0, mset.resident_of_layer).unsqueeze(1)
                    dst = host.view(1, 1, n).expand(layers, 1, n)
                    self._ops.copy_rows(mset.host_table, mset.device_table, src, dst,
                                        backend=self.backend)
                    self._d2h_bytes += n * layers * mset.row_bytes
        self._mirror_due = None

    # ------------------------------------------------------------------ decode step
    def _index_group(self, leader_layer: str) -> _IndexGroupState:
        state = self._index_groups.get(leader_layer)
        if state is None:
            state = self._index_groups.get(underlying_layer_name(leader_layer))
        if state is None:
            leader = self.groups.leader_of(leader_layer)
            hint = f"; its leader is {leader!r}" if leader else ""
            raise ValueError(f"{leader_layer!r} is not an index-group leader{hint}.")
        return state

    def index_group(self, leader_layer: str) -> tuple[str, ...]:
        """The sparse layers (leader first) whose hot rows ``resolve_rows(leader)`` fills."""
        self._check_open()
        return self._index_group(leader_layer).layers

    def hot_slots(self, leader_layer: str) -> torch.Tensor:
        """``[max_num_seqs, H] int32``: the host row each hot slot of the index group holds,
        by state row (-1 = empty). A live view for inspection; do not write it."""
        self._check_open()
        return self._index_group(leader_layer).slot_host_rows

    def check_topk(self, topk: object) -> None:
        """``ValueError`` unless ``topk`` is an integer ``[R, K]`` tensor, or ``[R, Q, K]``
        (Q speculative query tokens per request, ``Q <= max_decode_query_len``), whose
        ``Q * K`` columns fit the hot buffer (``device_buffer_size``)."""
        if not isinstance(topk, torch.Tensor) or topk.dim() not in (2, 3):
            raise ValueError(f"topk must be a [rows, k] or [rows, q, k] tensor, got "
                             f"{type(topk).__name__} of shape "
                             f"{tuple(getattr(topk, 'shape', ()))}.")
        if topk.dtype.is_floating_point or topk.dtype.is_complex or topk.dtype == torch.bool:
            raise ValueError(f"topk must hold integer positions, got {topk.dtype}.")
        if topk.dim() == 3:
            q = topk.shape[1]
            limit = self.config.hisparse.max_decode_query_len
            if not 1 <= q <= limit:
                raise ValueError(f"topk [rows, q, k] has q={q} query tokens per request; "
                                 f"max_decode_query_len is {limit}.")
        width = topk.shape[-1] * (topk.shape[1] if topk.dim() == 3 else 1)
        if not 1 <= width <= self.device_buffer_size:
            raise ValueError(f"top-k width {width} (q x k) must be in [1, device_buffer_size="
                             f"{self.device_buffer_size}].")

    def resolve_rows(self, leader_layer: str, state_rows: torch.Tensor,
                     topk: torch.Tensor) -> torch.Tensor:
        """Resolve one index group's top-k positions into device rows; gather the misses.

        ``state_rows``: ``[R] int32`` (the scheduler's ``state_rows(ids)``), -1 = padding;
        a row that is not live resolves against an empty request (all -1). ``topk``:
        ``[R, K]`` integer token positions, ``K <= device_buffer_size``; any value is allowed
        (negative, ``>= seq_len`` or huge positions resolve to -1). Speculative decoding:
        ``[R, Q, K]`` (``Q <= max_decode_query_len``, ``Q * K <= device_buffer_size``)
        resolves each request's Q selections as ONE union: a position several draft tokens
        select takes one hot slot and is gathered (and counted as a miss) once; the result
        is ``[R, Q, K]``. Returns ``[R, K] int32``
        rows of ``device_cache(layer)`` valid for the leader and every follower (-1 =
        masked), until the next plan that releases pages or the next resolve of this index
        group for the same request; the tensor is the index group's persistent output,
        overwritten by its next resolve (fixed shapes: CUDA-graph friendly). Misses are
        gathered host -> device into the hot rows of all of the index group's layers in one
        launch; counters accumulate on the device;
        fixed shapes, no host sync (CUDA-graph friendly). Only shapes are checked.
        """
        self._check_open()
        group = self._index_group(leader_layer)
        self.check_topk(topk)
        shape = tuple(topk.shape)
        if topk.dim() == 3:  # Q draft tokens' selections resolve as one union per request
            topk = topk.reshape(shape[0], shape[1] * shape[2])
        R, K = topk.shape
        if (not isinstance(state_rows, torch.Tensor) or state_rows.dtype != torch.int32
                or tuple(state_rows.shape) != (R,)):
            raise ValueError(f"state_rows must be an int32 tensor [{R}], got "
                             f"{getattr(state_rows, 'dtype', type(state_rows).__name__)} of "
                             f"shape {tuple(getattr(state_rows, 'shape', ()))}.")
        if R == 0:
            return torch.empty(shape, dtype=torch.int32, device=self.device)
        # No grad-mode context here: only the kernels (or the reference's int ops) touch
        # the worker's tensors, which works inside and outside inference mode alike.
        state_rows = self._on_device(state_rows, "state_rows")
        topk = self._on_device(topk, "topk")   # any integer dtype: converted in-kernel
        out = group.rows_out
        if out is None or out.shape != (R, K):
            with torch.inference_mode(False):
                out = group.rows_out = torch.empty(R, K, dtype=torch.int32,
                                                   device=self.device)
            group.rows_view = out.view(shape) if len(shape) == 3 else out
        elif group.rows_view.shape != shape:
            group.rows_view = out.view(shape) if len(shape) == 3 else out
        ops = self._ops
        # One launch: rows, the miss plan, the counters; the workspace keeps the pre-call
        # hot state of the rows it resolves, so a failed gather can undo it. The Triton
        # path reuses the checks and launch arguments of this group and shape.
        if group.bound is not None and ops.is_eager((topk, state_rows)):
            result = group.bound(topk, state_rows, out)
        else:
            result = ops.resolve(
                topk, state_rows, self.seq_lens, group.resident_table, self.host_table,
                group.hot_table, group.slot_host_rows, group.lru, block_size=self.block_size,
                num_device_blocks=self.num_device_blocks,
                num_host_blocks=self.num_host_blocks, counters=group.counters, out=out,
                workspace=self._workspace, backend=self._kernel_backend)
        try:
            if group.bound_gather is not None and ops.is_eager((result.miss_src,)):
                group.bound_gather(result.miss_src, result.miss_dst, result.miss_count)
            else:
                ops.copy_rows(group.device_table, group.host_table, result.miss_src,
                              result.miss_dst, result.miss_count,
                              backend=self._kernel_backend)
        except BaseException:  # undo the resolve: hot state and counters
            ops.restore_resolve_state(self._workspace, state_rows, group.slot_host_rows,
                                      group.lru)
            group.counters -= result.stats.sum(dim=0)
            raise
        return group.rows_view

    def _on_device(self, tensor: torch.Tensor, name: str = "tensor") -> torch.Tensor:
        """``tensor`` on the worker's device; a CPU tensor bound for CUDA is staged through
        pinned memory (no host sync). ``ValueError`` naming the device for a tensor on a
        device the worker cannot read (meta, another accelerator or CUDA device)."""
        if tensor.device == self.device:
            return tensor
        if tensor.device.type != "cpu":
            raise ValueError(f"{name} is on {tensor.device}; this worker runs on "
                             f"{self.device} (pass it there, or on the CPU).")
        if tensor.device.type == "cpu" and self.device.type == "cuda":
            staged = tensor if tensor.is_pinned() else tensor.pin_memory()
            return staged.to(self.device, non_blocking=True)
        return tensor.to(self.device)

    def to_device(self, values: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
        """A small CPU array on the worker's device without a host sync (pinned staging)."""
        with torch.inference_mode(False), torch.no_grad():
            cpu = torch.as_tensor(values, dtype=dtype)
            if self.device.type == "cpu":
                return cpu
            return cpu.pin_memory().to(self.device, non_blocking=True)

    # ------------------------------------------------------------------ views
    def device_cache(self, layer_name: str) -> torch.Tensor:
        """``[num_blocks, block_size, row_bytes] uint8`` view of a device layer.

        ``layer_name``: an indexer or regular layer, a sparse layer (its resident and hot
        views are these same bytes), or a ``.hisparse_resident``/``.hisparse_hot`` name.
        Row ``r`` of ``append_slots``/``resolve_rows`` is ``view.view(-1, row_bytes)[r]``.
        """
        self._check_open()
        name = self.groups.device_layer_name(layer_name)
        tensor = self.groups.device_tensors[name]
        group = self.groups.groups[self.groups.layer_group[name]]
        return self._device_pool.view(tensor.offset, group.block_size,
                                      self._layer_row_bytes(name, host=False))

    def device_rows(self, layer_name: str) -> torch.Tensor:
        """``[num_rows, row_bytes] uint8`` flat view of a sparse layer's device cache, for a
        plan made with ``row_aligned_blocks=True`` (``ValueError`` otherwise): the runtime's
        row id ``block * block_size + slot`` is flat row ``block * rows_per_block + slot``
        (``hisparse_triton.layout.device_row_layout(...).flat_row``), so an attention kernel
        can index every sparse layer as one array of rows without a block stride."""
        self._check_open()
        layout = device_row_layout(self.kv_cache_config, layer_name)
        pool = self._device_pool.tensor
        return pool.as_strided((layout.num_rows, layout.row_bytes), (layout.row_bytes, 1),
                               pool.storage_offset() + layout.offset_bytes)

    def host_cache(self, layer_name: str) -> torch.Tensor:
        """``[host_num_blocks, block_size, row_bytes] uint8`` view of a source layer's host
        rows (on CUDA, read it on the CPU only after synchronising with the mirror)."""
        self._check_open()
        name = underlying_layer_name(layer_name)
        if name not in self.groups.host_tensors:
            raise KeyError(f"{layer_name!r} is not a source (sparse) layer of this worker.")
        tensor = self.groups.host_tensors[name]
        row_bytes = self._layer_row_bytes(name, host=True)
        return self._host_pool.view(tensor.offset, self.num_host_blocks, self.block_size,
                                    row_bytes, tensor.block_stride)

    def block_tables(self, layer_name: str) -> torch.Tensor:
        """``[max_num_seqs, pages] int32`` device block table of a layer's group, by state
        row (a view of the table arena, updated in place by ``apply``)."""
        self._check_open()
        return self.tables[self.groups.layer_group[self.groups.device_layer_name(layer_name)]]

    @property
    def leaders(self) -> list[str]:
        return list(self.groups.leaders)

    # ------------------------------------------------------------------ stats / close
    def stats(self) -> WorkerStats:
        """Transfer counters. Reads the device counters: one device sync on CUDA (call it
        between steps; ``snapshot_counters`` + ``read_snapshot`` avoid the sync)."""
        self._check_open()
        return self._stats_from(self._counters.tolist())

    def stats_async(self) -> "StatsSnapshot":
        """Start reading the counters without waiting for the device: the counters are
        copied into pinned host memory on the current stream (after everything enqueued so
        far); ``result()`` on the returned snapshot waits only for that copy. Use it from a
        serving loop's metrics path instead of ``stats()``."""
        self._check_open()
        with torch.inference_mode(False), torch.no_grad():
            if self.device.type == "cpu":
                return StatsSnapshot(self, self._counters.clone(), None, self._d2h_bytes,
                                     self._plans)
            host = torch.empty(self._counters.shape, dtype=torch.int64, pin_memory=True)
            host.copy_(self._counters, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
        return StatsSnapshot(self, host, event, self._d2h_bytes, self._plans)

    def _stats_from(self, per_group: list[list[int]]) -> WorkerStats:
        states = list(self._index_groups.values())
        hits, misses, masked = (sum(row[i] for row in per_group) for i in range(3))
        h2d = sum(row[1] * s.bytes_per_miss for row, s in zip(per_group, states))
        return WorkerStats(hits=hits, misses=misses, masked=masked, h2d_bytes=h2d,
                           d2h_bytes=self._d2h_bytes, plans=self._plans)

    def reset_stats(self) -> None:
        """Zero the transfer counters."""
        self._check_open()
        self._counters.zero_()
        self._d2h_bytes = 0

    def _debug_snapshot(self) -> dict:
        """Every device table and counter as CPU lists (a device sync on CUDA)."""
        tensors = {"arena": self._arena, "slot_host_rows": self._slot_host_rows,
                   "lru": self._lru, "counters": self._counters}
        state: dict = {name: t.detach().cpu().tolist() for name, t in tensors.items()}
        state["misc"] = (self._next_step, self._d2h_bytes, self._plans,
                         None if self._mirror_due is None else self._mirror_due.step)
        return state

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeClosedError("the HiSparseWorker is closed.")

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Release both pools (unpins the host pool; a shared pool's creator unlinks it);
        idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._host_pool is not None:
            self._host_pool.close()
        if self._device_pool is not None:
            self._device_pool.close()

    def __enter__(self) -> "HiSparseWorker":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = ["BACKENDS", "HiSparseWorker", "StatsSnapshot", "WorkerStats", "parse_device",
           "plan_fingerprint"]
