"""``HiSparseWorker``: the GPU-side half of the runtime (pools, device tables, resolve, mirror).

One worker per GPU rank. It owns the tensors: the host pool (created, or attached when the
ranks of a node share it), the device pool, the per-request table arena, the hot state of
every index group and the device counters. It makes no decisions: every table change comes
from the scheduler in a ``StepPlan``, applied in plan order:

    worker.apply(plan)          # before the forward: ONE host -> device copy of the plan
    ...  forward: the model writes KV at the scheduler's rows; per index group
         ids = worker.resolve_rows(leader, state_rows, topk)   -> attention reads ids  ...
    worker.mirror(plan)         # after the forward: new rows device -> host

Parts: ``PlanTables`` (table arena, plan staging, apply / revert), a ``HotCache`` per index
group (hot slots, LRU, counters, resolve + gather), ``HostMirror``, ``PoolLayers`` (layers'
rows in the pools), ``CounterReader``.

Ordering on CUDA: every copy and kernel is enqueued on the current stream; nothing here waits
for the device except ``stats()`` (one counter read) and a plan-staging slot reused before
its copy ran (``tables.STAGING_SLOTS`` pinned buffers, so the CPU may run that many plans
ahead). A released block is written again only by work enqueued after the mirror that read
it, which the stream orders. A caller using several streams must order them itself.

With a shared host pool (the TP ranks of one node): rank 0 creates the pool and is the only
rank whose ``mirror`` copies; every rank applies the same plans, so their tables agree.
"""

from __future__ import annotations

import logging
from typing import Optional, Sequence

import numpy as np
import torch

from hisparse_triton.config import EngineConfig
from hisparse_triton.groups import PlanGroups
from hisparse_triton.layout import underlying_layer_name
from hisparse_triton.memory import check_memory
from hisparse_triton.specs import KVCacheConfig
from hisparse_triton.step_plan import PlanLimits, StepPlan, TableLayout
from hisparse_triton.worker import hot_cache
from hisparse_triton.worker.hot_cache import HotCache, HotState, StreamRows, check_state_rows
from hisparse_triton.worker.adopted import check_disjoint, host_pool_bytes, pool_bytes
from hisparse_triton.worker.layers import PoolLayers
from hisparse_triton.worker.mirror import HostMirror
from hisparse_triton.worker.options import (BACKENDS, check_draft_layers, check_options,
                                            parse_device, plan_fingerprint)
from hisparse_triton.worker.placement import array_on_device, check_readable
from hisparse_triton.worker.pools import DevicePool, HostPool
from hisparse_triton.worker.pool_open import open_device_pool, open_host_pool
from hisparse_triton.worker.sizing import bookkeeping_bytes, memory_requests
from hisparse_triton.worker.stats import CounterReader, StatsSnapshot, WorkerStats
from hisparse_triton.worker.tables import STAGING_SLOTS, PlanTables
from hisparse_triton.worker.views import WorkerViews

logger = logging.getLogger(__name__)

__all__ = ["BACKENDS", "STAGING_SLOTS", "HiSparseWorker", "StatsSnapshot", "WorkerStats",
           "parse_device", "plan_fingerprint"]


class HiSparseWorker(WorkerViews):
    """The tensor-owning worker half of HiSparse (see the module docstring).

    - ``kv_cache_config``, ``config``: the same objects the scheduler was built from.
    - ``max_num_seqs``: state rows (must equal the scheduler's).
    - ``device``: where the device pool and tables live (default: CUDA if available, else
      CPU). ``backend``: ``"auto"`` (Triton on CUDA, torch elsewhere), ``"triton"`` (CUDA, or
      CPU under ``TRITON_INTERPRET=1``) or ``"torch"`` (the reference ops).
    - ``tp_rank``, ``host_pool_name``: for a plan with ``hisparse_shared_host_pool``:
      ``host_pool_name`` is required; rank 0 creates the pool, every other rank attaches;
      only rank 0's ``mirror`` copies (``mirrors_to_host``).
    - ``host_pool_secret``: the run's secret of a shared pool: rank 0 makes a random one
      (or uses the one given) and exposes it as ``host_pool_secret``; every other rank must
      pass it (``distributed.broadcast_host_pool_secret``), so it never attaches to a file
      someone else created. ``host_pool_group``: a group whose members may attach (the file
      is then mode 0640 and of that group; default: owner only, mode 0600).
    - ``host_ram_fraction``: the host pool may use at most this fraction of available RAM.
    - ``draft_layers``: sparse layers a speculative drafter writes after the main forward
      (e.g. the MTP block's attention): their rows are mirrored by ``mirror(draft=True)``,
      once the drafter ran, instead of by ``mirror()`` (see ``mirror``).
    - ``gather_programs_per_sm``: the decode gathers' grid budget, programs per SM (default
      ``hot_cache.DEFAULT_GATHER_PROGRAMS_PER_SM`` = 4; 0 = the copy kernel's own grid, 32
      per SM): a gather leaves the rest of every SM to the compute kernels beside it.
    - ``split_gather`` (opt-in), ``split_gather_group``: the tensor-parallel ranks of
      ``split_gather_group`` (a ``torch.distributed`` group; None = the default group) split
      every gather: each pulls 1/N of the missed rows from the host pool and the ranks
      exchange them (``all_gather``), so every rank's hot buffers are identical
      (``worker.split_gather``). Every rank must resolve the same index groups in the same
      order (a collective per resolve) and apply the same plans; the host pool must hold the
      same rows on every rank. ``split_gather_fraction``: the exchange's capacity as a share
      of the miss plan's columns (fixed shapes): ``"auto"`` (default: follows the observed
      miss fraction plus a headroom, ``worker.split_capacity``) or a number in (0, 1];
      misses past it are pulled by every rank itself, so every row stays exact.
      ``split_gather_chunks`` (default 2): the pull of chunk ``i + 1`` over the host link
      runs while chunk ``i`` is exchanged.
    - ``device_pool_tensor``, ``host_pool_tensor``: memory the caller allocated, adopted as
      the device pool (on ``device``) and the host pool (a CPU tensor; not with a shared
      pool) instead of allocating them; each at least ``pool_bytes(kv_cache_config)`` bytes,
      any dtype, contiguous (see ``worker.adopted``). On a GPU machine the host tensor must
      be page-locked: a pinned tensor is used as is, another one is registered by the worker
      (``register_host_pool=True``, undone by ``close()``) or refused. The bytes the worker
      uses of the two (the first ``pool_bytes`` of each) must not overlap: the same tensor
      twice, or overlapping views of one storage, is refused with a ``ValueError`` naming
      both address ranges, before anything is allocated. The worker never frees adopted
      memory; ``close()`` only drops its references.

    Before building anything, everything the worker will allocate (``memory_requests``) is
    checked against the available RAM and GPU memory.
    """

    #: ``pool_bytes(kv_cache_config) -> (device_bytes, host_bytes)``: what tensors a caller
    #: hands in must hold at least.
    pool_bytes = staticmethod(pool_bytes)

    def __init__(self, kv_cache_config: KVCacheConfig, config: EngineConfig, *,
                 max_num_seqs: int, device: torch.device | str | None = None,
                 backend: str = "auto", tp_rank: int = 0,
                 host_pool_name: Optional[str] = None,
                 host_ram_fraction: float = 0.9,
                 host_pool_secret: Optional[str] = None,
                 host_pool_group: Optional[str | int] = None,
                 device_pool_tensor: Optional[torch.Tensor] = None,
                 host_pool_tensor: Optional[torch.Tensor] = None,
                 register_host_pool: bool = True,
                 draft_layers: Sequence[str] = (),
                 gather_programs_per_sm: int = hot_cache.DEFAULT_GATHER_PROGRAMS_PER_SM,
                 split_gather: bool = False, split_gather_group: object = None,
                 split_gather_fraction: "float | str" = "auto",
                 split_gather_chunks: int = 2) -> None:
        max_num_seqs, tp_rank = check_options(
            kv_cache_config, config, max_num_seqs, backend, tp_rank, host_pool_name,
            host_ram_fraction, host_pool_secret, host_pool_group)
        self.shared_host_pool = bool(kv_cache_config.hisparse_shared_host_pool)
        if host_pool_tensor is not None and self.shared_host_pool:
            raise ValueError("host_pool_tensor cannot be used with a shared host pool (the "
                             "ranks of a node share a file the worker maps); plan with "
                             "shared_host_pool=False to hand in a host tensor.")
        if device_pool_tensor is not None and host_pool_tensor is not None:
            # the same memory twice: refused before anything is allocated or registered
            device_bytes, host_bytes = pool_bytes(kv_cache_config)
            check_disjoint((("the device pool tensor", device_pool_tensor, device_bytes),
                            ("the host pool tensor", host_pool_tensor, host_bytes)))
        self.device = parse_device(device)
        self.gather_programs_per_sm = hot_cache.check_programs_per_sm(gather_programs_per_sm)
        #: The TP ranks' split of every gather (``worker.split_gather``), or None.
        self.split_gather = hot_cache.make_split_gather(
            split_gather, split_gather_group, self.device, backend,
            fraction=split_gather_fraction, chunks=split_gather_chunks,
            programs_per_sm=self.gather_programs_per_sm)
        # Everything this worker will allocate, checked together before anything is built.
        check_memory(memory_requests(
            kv_cache_config, config, max_num_seqs=max_num_seqs, device=self.device,
            tp_rank=tp_rank, device_pool_given=device_pool_tensor is not None,
            host_pool_given=host_pool_tensor is not None), max_ram_fraction=host_ram_fraction)
        self.tp_rank, self.host_pool_name = tp_rank, host_pool_name
        #: Whether ``mirror`` writes the host pool (rank 0 of a shared pool, or a private one).
        self.mirrors_to_host = not self.shared_host_pool or tp_rank == 0
        self._kernel_backend = hot_cache.kernel_backend(backend, self.device)
        self.backend, self.config, self.kv_cache_config = backend, config, kv_cache_config
        self.max_num_seqs, self.max_model_len = max_num_seqs, config.max_model_len
        self.device_buffer_size = int(config.hisparse.device_buffer_size)
        self.groups = PlanGroups.from_config(kv_cache_config, config)
        self.draft_layers = check_draft_layers(draft_layers, self.groups)
        self.block_size = self.groups.block_size
        self.layout = TableLayout.build(self.groups, max_num_seqs)
        self.num_device_blocks = kv_cache_config.num_blocks
        self.num_host_blocks = kv_cache_config.hisparse_host_num_blocks
        #: What every received plan is checked against: this worker's tables and pools.
        self.plan_limits = PlanLimits(
            layout=self.layout, max_model_len=self.max_model_len, block_size=self.block_size,
            num_device_blocks=self.num_device_blocks, num_host_blocks=self.num_host_blocks,
            resident=tuple(g.position for g in self.groups.resident))
        self.bytes_per_block = kv_cache_config.bytes_per_block
        self._closed = False
        self._host_pool: Optional[HostPool] = None
        self._device_pool: Optional[DevicePool] = None
        # The runtime's tensors are ordinary tensors whatever the caller's mode: built
        # outside inference mode and without autograd, so in-place updates work from both.
        with torch.inference_mode(False), torch.no_grad():
            self._host_pool = open_host_pool(
                kv_cache_config, self.device, tensor=host_pool_tensor,
                register=register_host_pool, max_ram_fraction=host_ram_fraction,
                shared_name=host_pool_name, create=tp_rank == 0, secret=host_pool_secret,
                group=host_pool_group)
            try:  # a failure below must not leave the (pinned) host pool to the GC
                self._device_pool = open_device_pool(kv_cache_config, self.device,
                                                     tensor=device_pool_tensor)
                self._build_parts()
            except BaseException:
                self.close()
                raise
        logger.info("HiSparseWorker rank %d on %s: %d device blocks x %d B, %d host blocks "
                    "(%.2f GiB%s), %d index groups, backend %s (%s); %s", tp_rank, self.device,
                    self.num_device_blocks, self.bytes_per_block, self.num_host_blocks,
                    host_pool_bytes(kv_cache_config) / (1 << 30), ", shared" if self.shared_host_pool else "",
                    len(self.groups.index_groups), backend, self._kernel_backend,
                    hot_cache.launch_config_source(self._kernel_backend, self.device))

    @property
    def table_bytes(self) -> int:
        """Device bytes of the per-request tables, hot state and counters."""
        return bookkeeping_bytes(self.layout, len(self.groups.index_groups), self.max_num_seqs,
                                 self.device_buffer_size)

    #: ``bookkeeping_bytes(layout, num_index_groups, max_num_seqs, slots)``: device bytes of
    #: the tables, hot state and counters (``worker.sizing``).
    bookkeeping_bytes = staticmethod(bookkeeping_bytes)
    #: ``memory_requests(kv_cache_config, config, *, max_num_seqs, device, tp_rank,
    #: device_pool_given, host_pool_given)``: everything a worker for the plan allocates
    #: (``worker.sizing``), checked before anything is built.
    memory_requests = staticmethod(memory_requests)

    def _build_parts(self) -> None:
        dev, groups = self.device, self.groups
        self._layers = PoolLayers(groups, self.kv_cache_config, self._host_pool,
                                  self._device_pool, dev)
        self._hot = HotState(len(groups.index_groups), self.max_num_seqs,
                             self.device_buffer_size, dev)
        self._mirror = HostMirror.build(groups, self._layers,
                                        hot_cache.MirrorCopy(self._kernel_backend),
                                        backend=self.backend, draft_layers=self.draft_layers)
        self._tables = tables = PlanTables(self.plan_limits, dev, self._hot,
                                           mirror_parts=self._mirror.parts)
        workspace = hot_cache.new_workspace(dev)
        self._index_groups: dict[str, HotCache] = {
            ig.leader: HotCache.for_group(ig, tables, self._layers, self._hot, workspace,
                                          self._kernel_backend,
                                          gather_programs_per_sm=self.gather_programs_per_sm,
                                          split_gather=self.split_gather)
            for ig in groups.index_groups}
        hot_cache.validate_tables([*(t for c in self._index_groups.values() for t in c.tables),
                                   *self._mirror.tables], dev)
        self._stats = CounterReader(
            self._hot.counters, [c.bytes_per_miss for c in self._index_groups.values()],
            d2h_bytes=lambda: self._mirror.d2h_bytes, plans=lambda: tables.applied,
            leaders=list(self._index_groups))

    # ------------------------------------------------------------------ plans
    def apply(self, plan: StepPlan) -> None:
        """Write one plan's table changes: resets first, then the writes and invalidations
        (one packed host -> device copy, then on-device scatters; no host sync).

        The plan is untrusted input (it may have crossed a process boundary): the worker
        takes its own copy and checks its structure and every value of every section
        against its own tables and pools (``PlanTables.check``). Plans must come in order
        (``plan.step`` = the previous plan's + 1) and a plan with mirror rows must be
        ``mirror``-ed before the next one is applied. A refused plan raises ``ValueError``
        naming the field and changes nothing.

        With ``split_gather`` at ``split_gather_fraction="auto"``, every
        ``split_capacity.SPLIT_RETUNE_PLANS``-th plan also retunes the split gather's
        capacity, agreed over its group (a small ``all_reduce``: every rank applies every
        plan, in order). The retune runs before the plan is written (it changes a capacity,
        no table), so the tables' write stays the call's last step.
        """
        self._check_open()
        if self.split_gather is not None:   # every few plans: retune its capacity
            self.split_gather.on_plan(plan.step)
        self._tables.apply(plan)

    def revert(self, plan: StepPlan) -> None:
        """Undo ``apply(plan)`` when later work of the same call failed: the tables, the hot
        state and the counters (``plans``, and ``d2h_bytes`` of its mirror) are as before it
        and ``plan.step`` is expected next. ``plan`` must be the last plan applied
        (``ValueError`` otherwise); the host rows it mirrored keep their bytes."""
        self._check_open()
        self._tables.revert(plan)
        self._mirror.uncount(plan.step)

    def mirror(self, plan: Optional[StepPlan] = None, *, draft: bool = False) -> None:
        """Copy the new rows of every applied plan whose mirror is due device -> host, in
        plan order (one launch per row size and plan), after the forward wrote them.

        The rows copied are those of the worker's own copies of the applied plans (several
        are due only when plans without ``commit`` came after one with mirror rows):
        ``mirror()`` mirrors them; ``mirror(plan)`` first checks that ``plan`` is the last
        plan applied (same step and content) and refuses any other with ``ValueError``. On
        a rank that does not write a shared host pool this only records that they are done;
        a plan without mirror rows (or one already mirrored) needs nothing. A copy that
        raises counts no bytes and leaves every mirror due.

        Every source layer's KV of the plan's tokens must be written before the call that
        copies it, and both before the next ``apply``. With ``draft_layers`` (written by the
        drafter after the main forward) ``mirror()`` copies the other layers and
        ``mirror(draft=True)``, once the drafter ran, the draft layers; the next plan is
        refused until both were called."""
        self._check_open()
        tables, mirror = self._tables, self._mirror
        if draft and True not in tables.mirror_parts:
            raise ValueError("mirror(draft=True): this worker has no draft layers (pass "
                             "draft_layers when building it).")
        tables.check_last(plan)
        mirror.copy_due(tables, draft=draft, writes_host=self.mirrors_to_host)

    @property
    def draft_mirror_due(self) -> Optional[int]:
        """The step of the oldest applied plan whose draft-layer rows are still to be copied
        by ``mirror(draft=True)`` (None: none)."""
        due = [d.plan.step for d in self._tables.due if True in d.parts]
        return due[0] if due else None

    # ------------------------------------------------------------------ decode step
    def _index_group(self, leader_layer: str) -> HotCache:
        cache = self._index_groups.get(leader_layer)
        if cache is None:
            cache = self._index_groups.get(underlying_layer_name(leader_layer))
        if cache is None:
            leader = self.groups.leader_of(leader_layer)
            hint = f"; its leader is {leader!r}" if leader else ""
            raise ValueError(f"{leader_layer!r} is not an index-group leader{hint}.")
        return cache

    def index_group(self, leader_layer: str) -> tuple[str, ...]:
        """The sparse layers (leader first) whose hot rows ``resolve_rows(leader)`` fills."""
        self._check_open()
        return self._index_group(leader_layer).layers

    def hot_slots(self, leader_layer: str) -> torch.Tensor:
        """``[max_num_seqs, H] int32``: the host row each hot slot of the index group holds,
        by state row (-1 = empty). A live view for inspection; do not write it."""
        self._check_open()
        return self._index_group(leader_layer).slot_host_rows

    def hot_order(self, leader_layer: str) -> torch.Tensor:
        """``[max_num_seqs, H] int32``: the index group's hot slot ids by state row, least
        recently used first. A live view for inspection; do not write it."""
        self._check_open()
        return self._index_group(leader_layer).lru

    def check_topk(self, topk: object) -> None:
        """``ValueError`` unless ``topk`` is an integer ``[R, K]`` tensor, or ``[R, Q, K]``
        (Q speculative query tokens per request, ``Q <= max_decode_query_len``), whose
        ``Q * K`` columns fit the hot buffer (``device_buffer_size``)."""
        hot_cache.check_topk(topk, device_buffer_size=self.device_buffer_size,
                             max_decode_query_len=self.config.hisparse.max_decode_query_len)

    def resolve_rows(self, leader_layer: str, state_rows: torch.Tensor,
                     topk: torch.Tensor, *,
                     stream: Optional[object] = None) -> "torch.Tensor | StreamRows":
        """Resolve one index group's top-k positions into device rows; gather the misses.

        ``state_rows``: ``[R] int32`` (the scheduler's ``state_rows(ids)``), -1 = padding;
        a row that is not live resolves against an empty request (all -1). ``topk``:
        ``[R, K]`` integer token positions, ``K <= device_buffer_size``; any value is allowed
        (negative, ``>= seq_len`` or huge positions resolve to -1). Speculative decoding:
        ``[R, Q, K]`` (``Q <= max_decode_query_len``, ``Q * K <= device_buffer_size``)
        resolves each request's Q selections as ONE union: a position several draft tokens
        select takes one hot slot and is gathered (and counted as a miss) once; the result
        is ``[R, Q, K]``. Returns ``[R, K] int32`` rows of ``device_cache(layer)`` valid for
        the leader and every follower (-1 = masked), until the next plan applied (it may
        hand a block read in place to a new owner, unless the scheduler holds it:
        ``HiSparseScheduler.hold_reads``) or the next resolve of this index group for the
        same request; the tensor is the
        index group's persistent output, overwritten by its next resolve. Misses are
        gathered host -> device into the hot rows of all of the index group's layers in one
        launch; counters accumulate on the device; fixed shapes, persistent outputs, no host
        sync, no allocation after the first call of a shape: capturable in a CUDA graph
        (docs/runtime.md, "Decode under CUDA graphs"). Only shapes are checked.

        ``stream`` (side-stream mode): the resolve and the gathers run on ``stream`` (a
        ``torch.cuda.Stream`` of this device; ``torch.cpu.Stream`` on a CPU worker) after the
        work the current stream enqueued so far; the leader's rows are gathered first, then
        the followers'. Returns ``StreamRows(rows, events)``: ``events[layer]`` is the event
        the layer's attention waits on (``rows.wait(layer)``), so the followers' gather
        overlaps the leader's attention and the current stream's other work. Persistent
        events, no host sync: CUDA-graph capturable. On CPU the events are no-ops
        (``HostEvent``) and the result is the same as without a stream.
        """
        self._check_open()
        cache = self._index_group(leader_layer)
        self.check_topk(topk)
        return cache.resolve(state_rows, topk, stream=stream)

    def set_gather_programs_per_sm(self, programs_per_sm: int) -> None:
        """Change the decode gathers' grid budget (programs per SM, 0 = none; see the
        ``gather_programs_per_sm`` argument) of every index group; ``ValueError`` for a bad
        value (nothing changes). Call it between steps (not inside a CUDA graph capture)."""
        self._check_open()
        value = hot_cache.check_programs_per_sm(programs_per_sm)
        for cache in self._index_groups.values():
            cache.set_gather_programs_per_sm(value)
        if self.split_gather is not None:
            self.split_gather.set_programs_per_sm(value)
        self.gather_programs_per_sm = value

    def check_resolve(self, leader_layer: str, state_rows: object, topk: object, *,
                      stream: Optional[object] = None) -> None:
        """Every check ``resolve_rows`` makes of its arguments, without resolving: the leader,
        ``topk`` (``check_topk``), ``state_rows`` (``int32 [R]``), that both are on this
        worker's device or the CPU, and ``stream`` (a stream of this device, when given).
        ``ValueError`` naming what is wrong; changes nothing (a caller that must do other
        work first, e.g. hand a plan over, checks first)."""
        self._check_open()
        cache = self._index_group(leader_layer)
        self.check_topk(topk)
        check_state_rows(state_rows, topk.shape[0])
        check_readable(topk, self.device, "topk")
        check_readable(state_rows, self.device, "state_rows")
        if stream is not None:
            cache._stream_events(stream)

    def check_prefill(self, leader_layer: str, state_rows: object, topk: object, *,
                      host_rows_bound: Optional[int] = None,
                      staging_blocks: object = None) -> None:
        """Every check ``resolve_prefill`` makes of its arguments before it stages: the
        leader, ``topk`` (integer ``[T, K]``), ``state_rows`` (``int32 [T]``), both on this
        worker's device or the CPU, ``host_rows_bound``, ``staging_blocks``. ``ValueError``
        naming what is wrong; changes nothing. (Whether the chunk fits its staging rows is
        known only once staged, unless the bound proves it.)"""
        self._check_open()
        self._index_group(leader_layer)
        self._prefill_stager().check(state_rows, topk, host_rows_bound, staging_blocks)

    def resolve_prefill(self, leader_layer: str, state_rows: torch.Tensor,
                        topk: torch.Tensor, *, host_rows_bound: Optional[int] = None,
                        check: bool = True, staging_blocks: object = None) -> torch.Tensor:
        """Rows of one index group's prefill chunk, host-only rows staged on the device.

        ``topk``: ``[T, K]`` integer token positions of the chunk's ``T`` query tokens (any
        integer dtype, any ``K``; -1, negative, ``>= seq_len`` or huge positions are
        masked); ``state_rows``: ``[T] int32``, the state row of each token's request (-1 =
        padding). Returns ``[T, K] int32`` rows of ``device_cache(layer)`` valid for the
        leader and every follower (-1 = masked): a row whose page has a device block in
        place, any other row copied once from the host pool into a staging row (the
        region of ``HiSparseConfig.prefill_staging_rows``, blocks the scheduler never hands
        out, or ``staging_blocks``), for all of the group's layers in one gather launch. Hot buffers and LRU
        state are not touched; nothing is allocated after the first call (a workspace of
        ``4`` bytes per host-pool row, shared by the index groups). Staged rows are valid
        until the next ``resolve_prefill`` (any index group), rows read in place until the
        next plan applied (as ``resolve_rows``'); the tensor is overwritten by the next
        call. A plan that reserves no region (``prefill_staging_rows = 0``) stages into the
        rows of ``staging_blocks``: the blocks ``HiSparseScheduler.borrow_prefill_staging``
        lent for the step, in the order it returned them (none given: no staging rows).

        Overflow (more distinct host-only rows than the region holds): those columns are
        -1 and ``PrefillStagingError`` names both numbers. It is found without a host
        sync when ``host_rows_bound`` (an upper bound the caller knows, e.g.
        ``hisparse_triton.staging.host_rows_bound``) fits the region; otherwise the call
        reads the device count once. ``check=False`` never reads it (``prefill_counts``
        holds it). ``ValueError`` for a bad leader, ``topk`` or ``state_rows``.
        """
        self._check_open()
        cache = self._index_group(leader_layer)
        return self._prefill_stager().stage(cache, state_rows, topk,
                                            host_rows_bound=host_rows_bound, check=check,
                                            staging_blocks=staging_blocks)

    def _prefill_stager(self):
        """The worker's ``PrefillStager``, built (with its workspace) at the first use."""
        stager = self.__dict__.get("_prefill")
        if stager is None:
            from hisparse_triton.worker.prefill import PrefillStager

            stager = PrefillStager.for_plan(self.kv_cache_config, self.config,
                                            device=self.device, kernel=self._kernel_backend)
            self._prefill = stager
        return stager

    @property
    def prefill_counts(self) -> Optional[torch.Tensor]:
        """``[2] int32`` on the device: rows the last ``resolve_prefill`` staged and the
        distinct host-only rows it needed (None before the first call). A live view."""
        stager = self.__dict__.get("_prefill")
        return None if stager is None else stager.counts

    def to_device(self, values: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
        """A small CPU array on the worker's device without a host sync (pinned staging)."""
        return array_on_device(values, dtype, self.device)

    # ------------------------------------------------------------------ stats / close
    def stats(self) -> WorkerStats:
        """Transfer counters. Reads the device counters: one device sync on CUDA (call it
        between steps; ``stats_async`` avoids the sync)."""
        self._check_open()
        return self._stats.read()

    def stats_async(self) -> StatsSnapshot:
        """Start reading the counters without waiting for the device: the counters are
        copied into pinned host memory on the current stream (after everything enqueued so
        far); ``result()`` on the returned snapshot waits only for that copy. Use it from a
        serving loop's metrics path instead of ``stats()``."""
        self._check_open()
        return self._stats.read_async()

    def reset_stats(self) -> None:
        """Zero the transfer counters."""
        self._check_open()
        self._stats.zero()
        self._mirror.zero()

    def _debug_snapshot(self) -> dict:
        """Every device table and counter as CPU lists (a device sync on CUDA)."""
        tables = self._tables
        return {"arena": tables.arena.cpu().tolist(), **self._hot.snapshot(),
                "misc": (tables.next_step, self._mirror.d2h_bytes, tables.applied,
                         tuple((d.plan.step, sorted(d.parts)) for d in tables.due) or None)}

    # Internals the fault-injection tests reach for.
    _arena = property(lambda self: self._tables.arena)
    _lru = property(lambda self: self._hot.lru)
    _slot_host_rows = property(lambda self: self._hot.slot_host_rows)
    _ops = property(lambda self: hot_cache.load_ops())

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
