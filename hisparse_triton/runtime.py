"""``HiSparseRuntime``: the in-process facade over one ``HiSparseScheduler`` and one
``HiSparseWorker``.

A program that runs its scheduler and its model in one process uses this object. It drives
the two halves with the same protocol a serving stack uses: every call does the scheduler's
part, and the table changes reach the worker as plans, one per step in a steady loop: the
first ``resolve`` after a step's appends hands them over with the step's mirror rows
(``HiSparseScheduler.flush``), ``commit()`` mirrors them after the forward and makes them
durable (``HiSparseScheduler.commit_mirrors``). Changes made between two resolves of one step
travel in one more plan at the next resolve; reads (``block_tables``, ``hot_slots``) never
make a plan: they show the worker's tables as of the last plan (``flush()`` hands pending
changes over now). A serving stack that splits the two (a scheduler process, one worker per
GPU rank) uses ``HiSparseScheduler`` and ``HiSparseWorker`` directly; see
``docs/runtime.md``.

Lifecycle of a request::

    add_request(id, prompt_len, max_new_tokens)   # reserve host pages + a state row
    rows = append_slots(id, n)                    # device rows to write n new tokens' KV at
    ...  the model writes KV at rows[layer] of device_cache(layer)  ...
    ids = resolve(leader, [id, ...], topk)        # per index group, every decode step
    commit()                                      # mirror new rows to host, release old pages
    free_request(id)

Ordering on CUDA: every transfer is enqueued on the current stream. ``commit()`` returns
sealed resident pages to the device block pool (CPU bookkeeping) and enqueues the
device->host mirror of the step's new rows. A released block is only written again by work
enqueued after ``commit()`` (a gather in ``resolve``, the model's KV write into rows from
``append_slots``), which the stream runs after the mirror has read it, so no event or host
sync is needed. This holds as long as the caller writes KV and calls the runtime on one
stream; a caller using several streams must make them wait on the current stream after ``commit()``.

Host syncs: ``add_request``, ``append_slots``, ``commit``, ``free_request``, ``resolve`` and
``resolve_rows`` never wait for the device on CUDA (table updates travel as one packed,
pinned, non-blocking copy per plan; counters accumulate on the device; with the ``torch``
backend on CUDA the reference ops do sync). ``stats()`` reads the device counters (one
sync); ``host_cache`` read on the CPU needs a ``torch.cuda.synchronize()`` first.

Row lifetime: ``resolve`` returns the index group's persistent rows tensor (fixed shapes:
CUDA-graph friendly), which its next ``resolve`` overwrites (copy it to keep it). The row
ids in it point at the bytes they pointed at when returned until the next ``commit()``,
whatever is called in between (appends of any request, the same one included, admissions,
``truncate``, ``free_request`` of other requests, ``flush``, more resolves), with three
earlier ends: the request's ``free_request()``; for hot rows, the next resolve of the same
index group for the same request (which may evict them); for rows ``resolve_prefill``
staged, its next call. The scheduler keeps every block a resolve read in place from any new
owner until ``commit()`` (``HiSparseScheduler.hold_reads``): a call that would need one
raises ``CapacityError`` instead (commit first; ``scheduler.held_device_blocks`` counts
them), and a ``truncate`` keeps the dropped pages' blocks until then. So a step is:
``append_slots`` -> write KV -> ``resolve`` per index group -> attention -> ``commit()``.

Every call is all-or-nothing: a call that raises (bad input, a full pool, or torch itself
failing) leaves the scheduler's and the worker's tables as they were.

Shared-pool contract (the caller's duty; nothing checks it across processes):

1. construct rank 0's runtime before the others attach (an attach to a missing pool
   raises ``SharedHostPoolError``); close rank 0 last or not: attached ranks keep their
   mapping, the file is unlinked by rank 0's ``close()``;
2. every rank calls ``add_request``/``append_slots``/``commit``/``free_request`` with the
   same arguments in the same order (SPMD, the ranks advance in lockstep), so all ranks
   allocate the same host blocks; every rank writes the same KV bytes into its own
   device pool;
3. after ``commit()``, the ranks synchronise before ANY rank resolves rows that commit
   mirrored (rank 0's stream must have finished the mirror: e.g. the step's collective
   on that stream, or ``torch.cuda.synchronize()`` + a barrier); a rank that resolves
   earlier may gather host rows rank 0 has not written yet.
A serving stack with several ranks runs ONE scheduler and broadcasts its plans to the
workers instead (``docs/runtime.md``).
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Callable, Hashable, Optional, Sequence, TypeVar

import numpy as np
import torch

from hisparse_triton.config import EngineConfig
from hisparse_triton.errors import HiSparseError, RuntimeClosedError
from hisparse_triton.scheduler import (
    DEFAULT_FREE_BLOCK_WATERMARK,
    HiSparseScheduler,
    SchedulerStats,
    check_id_list,
)
from hisparse_triton.scheduler.transfer import KVExport, KVImport
from hisparse_triton.specs import KVCacheConfig
from hisparse_triton.staging import scheduler_host_rows_bound
from hisparse_triton.step_plan import StepPlan
from hisparse_triton.worker import BACKENDS, HiSparseWorker, WorkerStats
from hisparse_triton.worker.prefill import check_prefill_topk

_T = TypeVar("_T")


@dataclass(frozen=True)
class HiSparseStats(SchedulerStats, WorkerStats):
    """Counters and pool occupancy of a runtime (``HiSparseRuntime.stats()``): every
    ``SchedulerStats`` field (occupancy and residency) and every ``WorkerStats`` field
    (hits, misses, masked, bytes moved each way, plans applied), with ``hit_rate``."""


class RuntimeStatsSnapshot:
    """Occupancy read at ``stats_async()`` time plus device counters copied in the
    background (``HiSparseRuntime.stats_async``)."""

    def __init__(self, scheduler_stats, counters) -> None:
        self._scheduler_stats, self._counters = scheduler_stats, counters

    def ready(self) -> bool:
        return self._counters.ready()

    def result(self) -> HiSparseStats:
        return _combine(self._scheduler_stats, self._counters.result())


def _combine(s: SchedulerStats, w: WorkerStats) -> HiSparseStats:
    return HiSparseStats(**dataclasses.asdict(s), **dataclasses.asdict(w))


def _worker_read(name: str, doc: str) -> Callable:
    """A facade method that is the worker's ``name`` (same signature) on an open runtime."""
    method = getattr(HiSparseWorker, name)

    @functools.wraps(method)
    def read(self: "HiSparseRuntime", *args, **kwargs):
        self._check_open()
        return getattr(self.worker, name)(*args, **kwargs)
    read.__doc__ = doc
    return read


def _prefill_state_rows(scheduler: HiSparseScheduler, request_ids: Sequence[Optional[Hashable]],
                        topk: torch.Tensor) -> torch.Tensor:
    """``[T] int32`` CPU state rows of a prefill chunk's query tokens (-1 = padding);
    ``ValueError`` / ``UnknownRequestError`` for bad ids or a ``topk`` that does not fit."""
    check_id_list(request_ids)
    if isinstance(topk, torch.Tensor) and topk.dim() == 2 and topk.shape[0] != len(request_ids):
        raise ValueError(f"topk has {topk.shape[0]} rows but {len(request_ids)} request ids "
                         f"were given (one per query token).")
    distinct = [rid for rid in dict.fromkeys(request_ids) if rid is not None]
    rows = dict(zip(distinct, scheduler.state_rows(distinct).tolist()))
    state_rows = torch.tensor([rows[rid] if rid is not None else -1 for rid in request_ids],
                              dtype=torch.int32)
    check_prefill_topk(topk, state_rows)
    return state_rows


def _check_drafts_mirrored(worker: HiSparseWorker) -> None:
    """``ValueError`` when a plan's draft-layer rows were never copied: ``commit()`` makes
    the tokens durable and may hand their blocks to others, so the draft part must be
    mirrored first."""
    due = worker.draft_mirror_due
    if due is not None:
        raise ValueError(f"commit(): the draft layers' rows of plan {due} were not "
                         f"mirrored: once the drafter wrote their KV (after the main forward "
                         f"and truncate), call mirror_draft(), then commit().")


def _delegate(half: str, name: str, doc: str = "") -> property:
    """A read-only attribute of the facade that is ``self.<half>.<name>``."""
    return property(lambda self: getattr(getattr(self, half), name), doc=doc or None)


class HiSparseRuntime:
    """One scheduler and one worker in one process, with a request-id API (module docstring).

    - ``kv_cache_config``: from ``get_hisparse_kv_cache_config``; ``config``: the
      ``EngineConfig`` it was planned for (``config.hisparse`` set).
    - ``max_num_seqs``: live requests at most (rows of the per-request device tables).
    - ``device``: where the device pool and tables live (default: CUDA if available, else
      CPU). ``backend``: ``"auto"`` (Triton on CUDA, torch elsewhere), ``"triton"`` (CUDA, or
      CPU under ``TRITON_INTERPRET=1``) or ``"torch"`` (the reference ops).
    - ``free_block_watermark``: committed pages stay on the GPU (no transfers at all) while
      more device blocks than this are truly free (a float: fraction of the pool; an int: a
      block count); at or below it, requests take their hot regions and let their committed
      pages go (``HiSparseScheduler``). ``1.0``: offload every request as soon as it can.
    - ``offload_threshold_pages``: a request that should offload does so once at least this
      many of its pages can leave the GPU (default 1).
    - ``host_ram_fraction``: the host pool may use at most this fraction of available RAM.
    - ``tp_rank``, ``host_pool_name``: for a plan with ``hisparse_shared_host_pool`` (one
      host pool per node, shared by the TP ranks), ``host_pool_name`` is required (and is
      refused when the plan does not share the pool): ``tp_rank`` 0 creates the pool, every
      other rank (``< config.tensor_parallel_size``) attaches to it. Only rank 0 writes the
      device->host mirror in ``commit()`` (``mirrors_to_host``); other ranks copy nothing
      and count no ``d2h_bytes``, but their bookkeeping is identical. ``host_pool_secret``:
      required on the other ranks: rank 0's ``worker.host_pool_secret``;
      ``host_pool_group``: see ``HiSparseWorker``.
    - ``draft_layers``: sparse layers a speculative drafter writes after the main forward
      (and after ``truncate``): ``mirror_draft()`` copies their rows once the drafter ran,
      before ``commit()`` (which refuses to end a step whose draft rows were not copied).

    Shared host pools: see the shared-pool contract in the module docstring.
    """

    def __init__(self, kv_cache_config: KVCacheConfig, config: EngineConfig, *,
                 max_num_seqs: int, device: torch.device | str | None = None,
                 backend: str = "auto", offload_threshold_pages: Optional[int] = None,
                 host_ram_fraction: float = 0.9, tp_rank: int = 0,
                 host_pool_name: Optional[str] = None,
                 free_block_watermark: float | int = DEFAULT_FREE_BLOCK_WATERMARK,
                 host_pool_secret: Optional[str] = None,
                 host_pool_group: Optional[str | int] = None,
                 draft_layers: Sequence[str] = ()) -> None:
        if not isinstance(config, EngineConfig) or config.hisparse is None:
            raise ValueError("HiSparseRuntime needs an EngineConfig with hisparse set.")
        self._closed = True  # until both halves exist
        # The worker first: it checks every allocation against RAM and GPU memory before it
        # builds anything, so a plan too large fails before any bookkeeping exists.
        self.worker = HiSparseWorker(kv_cache_config, config, max_num_seqs=max_num_seqs,
                                     device=device, backend=backend, tp_rank=tp_rank,
                                     host_pool_name=host_pool_name,
                                     host_ram_fraction=host_ram_fraction,
                                     host_pool_secret=host_pool_secret,
                                     host_pool_group=host_pool_group,
                                     draft_layers=draft_layers)
        try:
            self.scheduler = HiSparseScheduler(
                kv_cache_config, config, max_num_seqs=max_num_seqs,
                free_block_watermark=free_block_watermark,
                offload_threshold_pages=offload_threshold_pages,
                host_ram_fraction=host_ram_fraction)
        except BaseException:
            self.worker.close()
            raise
        self._closed = False
        self._journal = self.scheduler.journal
        self._row_names = self.scheduler.row_layer_names
        self.config = config
        self.kv_cache_config = kv_cache_config

    # ------------------------------------------------------------------ plain attributes
    device = _delegate("worker", "device")
    backend = _delegate("worker", "backend")
    max_num_seqs = _delegate("scheduler", "max_num_seqs")
    max_model_len = _delegate("scheduler", "max_model_len")
    device_buffer_size = _delegate("scheduler", "device_buffer_size")
    block_size = _delegate("scheduler", "block_size")
    num_device_blocks = _delegate("scheduler", "num_device_blocks")
    num_host_blocks = _delegate("scheduler", "num_host_blocks")
    bytes_per_block = _delegate("worker", "bytes_per_block")
    offload_threshold_pages = _delegate("scheduler", "offload_threshold_pages")
    hot_blocks_per_request = _delegate("scheduler", "hot_blocks_per_request")
    shared_host_pool = _delegate("worker", "shared_host_pool")
    mirrors_to_host = _delegate("worker", "mirrors_to_host",
                                "Whether ``commit()`` writes the device->host mirror (rank 0 "
                                "of a shared pool).")
    tp_rank = _delegate("worker", "tp_rank")
    host_pool_name = _delegate("worker", "host_pool_name")
    device_block_pool = _delegate("scheduler", "device_block_pool")
    host_block_pool = _delegate("scheduler", "host_block_pool")
    source_layers = _delegate("scheduler", "source_layers")
    index_groups = _delegate("scheduler", "index_groups")
    device_layers = _delegate("scheduler", "device_layers",
                              "Layer names ``append_slots`` returns rows for (model names).")
    leaders = _delegate("scheduler", "leaders",
                        "Index-group leader layers (what ``resolve`` takes), in model order.")

    index_group = _worker_read(
        "index_group", "The sparse layers (leader first) whose hot rows "
        "``resolve(leader_layer)`` fills.")
    hot_slots = _worker_read(
        "hot_slots", "``[max_num_seqs, H] int32`` host row held by each hot slot of the index "
        "group, by state row (-1 = empty): a live view for inspection, as of the last plan "
        "handed to the worker (a read never makes a plan).")
    hot_order = _worker_read(
        "hot_order", "``[max_num_seqs, H] int32`` slot ids of the index group by state row, "
        "least recently used first: a live view for inspection.")

    # ------------------------------------------------------------------ request state
    def has_request(self, request_id: Hashable) -> bool:
        return self.scheduler.has_request(request_id)

    @property
    def request_ids(self) -> list[Hashable]:
        return self.scheduler.request_ids

    def seq_len(self, request_id: Hashable) -> int:
        """Tokens appended so far."""
        return self.scheduler.seq_len(request_id)

    def state_row(self, request_id: Hashable) -> int:
        """The request's row in the per-request device tables."""
        return self.scheduler.state_row(request_id)

    def state_rows(self, request_ids: Sequence[Optional[Hashable]]) -> torch.Tensor:
        """``[R] int32`` state rows on the device (-1 for ``None`` = padding)."""
        self._check_open()
        return self.worker.to_device(self.scheduler.state_rows(request_ids), torch.int32)

    def host_block_table(self, request_id: Hashable) -> list[int]:
        """The request's host blocks, one per reserved page (CPU list)."""
        return self.scheduler.host_block_table(request_id)

    def block_table(self, request_id: Hashable, layer_name: str) -> list[int]:
        """The request's device blocks for a layer's group, one per page (CPU list)."""
        return self.scheduler.block_table(request_id, layer_name)

    # ------------------------------------------------------------------ layer access
    device_cache = _worker_read(
        "device_cache", "``[num_blocks, block_size, row_bytes] uint8`` view of a device layer "
        "(an indexer or regular layer, a sparse layer: its resident and hot views are these "
        "bytes, or a ``.hisparse_resident``/``.hisparse_hot`` name). Row ``r`` of "
        "``append_slots``/``resolve`` is ``view[r // B, r % B]`` with ``B = view.shape[1]`` "
        "(the view is strided: see ``HiSparseWorker.device_cache``).")
    device_rows = _worker_read(
        "device_rows", "``[num_rows, row_bytes] uint8`` flat view of a sparse layer for a "
        "row-aligned plan (``ValueError`` for a plan that is not).")
    host_cache = _worker_read(
        "host_cache", "``[host_num_blocks, block_size, row_bytes] uint8`` view of a source "
        "layer's host rows. On CUDA, reading it on the CPU right after ``commit()`` needs a "
        "``torch.cuda.synchronize()`` first (the mirror runs asynchronously).")
    row_bytes = _worker_read(
        "row_bytes", "Bytes of one row of a device layer (a sparse layer's host rows are the "
        "same size).")
    row_offsets = _worker_read(
        "row_offsets", "``[n] int64`` byte offsets of rows (``[n]`` row ids: a ``KVImport``'s, "
        "a ``KVExport``'s) of a layer from the start of its pool: the host pool's "
        "(``host=True``, ``worker.host_pool.data_ptr`` + offset) or the device pool's "
        "(``worker.device_pool.tensor.data_ptr()`` + offset); each row is ``row_bytes(layer)`` "
        "contiguous bytes. For a transport that addresses registered memory "
        "(``docs/runtime.md``, \"Prefill/decode disaggregation\"). ``ValueError`` for a row "
        "outside the pool, ``KeyError`` for an unknown layer.")
    block_tables = _worker_read(
        "block_tables", "``[max_num_seqs, pages] int32`` device block table of a layer's "
        "group, by state row (indexer / regular layers: every page; sparse layers: resident "
        "pages, 0 = the page left the GPU; ``.hisparse_hot`` names: the hot region); index it "
        "with ``state_rows(...)``. Updated in place by every plan the worker applies; a read "
        "never makes a plan: ``flush()`` first to see changes made since the last resolve or "
        "commit.")

    # ------------------------------------------------------------------ lifecycle
    def add_request(self, request_id: Hashable, prompt_len: int, max_new_tokens: int,
                    token_ids: Optional[Sequence[int]] = None) -> int:
        """Admit a request; returns how many prompt tokens are already cached.

        Reserves host pages for ``prompt_len + max_new_tokens``, a state row and the hot
        region. With ``token_ids`` (the prompt) the longest cached prefix is reused: the
        request starts with that many tokens (a multiple of ``block_size``) present and the
        caller appends (and computes) only the rest; 0 without ``token_ids``.
        ``DuplicateRequestError`` (a ``ValueError``) for a live id; ``ValueError`` for bad
        lengths or more than ``max_model_len`` tokens; ``CapacityError`` when the host pool,
        the device pool or the state rows (``max_num_seqs``) are full. Nothing changes on
        error.
        """
        self._check_open()
        return self.scheduler.add_request(request_id, prompt_len, max_new_tokens, token_ids)

    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix page; returns how many were dropped."""
        self._check_open()
        return self.scheduler.reset_prefix_cache()

    def append_slots(self, request_id: Hashable, num_tokens: int,
                     token_ids: Optional[Sequence[int]] = None, *,
                     num_draft_tokens: int = 0) -> dict[str, torch.Tensor]:
        """Allocate device pages for ``num_tokens`` new tokens; where to write their KV.

        Returns ``{layer_name: [num_tokens] int64}`` device rows for every device layer
        (sparse layers under their model name: their resident rows; indexer and regular
        layers). Layers of one group share one tensor; different groups get different rows.
        ``token_ids``: the appended tokens' ids: a request added with ``token_ids`` then
        publishes its generated pages for prefix reuse too (``HiSparseScheduler.append_slots``).
        ``num_draft_tokens``: the last that many tokens are drafts, never durable until
        ``verify_drafts`` accepts them (``docs/runtime.md``, "Rollback under async
        scheduling"). ``ReservationExceededError`` past ``prompt_len + max_new_tokens``;
        ``CapacityError`` when the device pool is full. Nothing changes on error.
        """
        self._check_open()
        with self._journal.transaction():
            per_group = self.scheduler.append_group_rows(request_id, num_tokens, token_ids,
                                                         num_draft_tokens=num_draft_tokens)
            # One copy for all groups: their rows stacked, one view per group.
            views = self.worker.to_device(np.stack(per_group), torch.int64).unbind(0)
            return {name: view for view, names in zip(views, self._row_names)
                    for name in names}

    def truncate(self, request_id: Hashable, new_len: int) -> None:
        """Keep the request's first ``new_len`` tokens, drop the rest (rejected drafts):
        call it after the forward that verified them, before ``commit()`` (committed tokens
        are durable and refused). See ``HiSparseScheduler.truncate``; the changes reach the
        worker with the next plan (the next resolve or commit)."""
        self._check_open()
        self.scheduler.truncate(request_id, new_len)

    def verify_drafts(self, request_id: Hashable, num_accepted: int) -> None:
        """The forward verified the request's oldest drafts (appended with
        ``num_draft_tokens``): the first ``num_accepted`` stay, the others are dropped and
        the tokens appended after them (steps scheduled before this verification, whose KV
        the caller wrote at the corrected positions) move down; call it before or after
        later steps' appends and resolves, before the ``commit()`` that should make the
        accepted ones durable (``HiSparseScheduler.verify_drafts``). The changes reach the
        worker with the next plan."""
        self._check_open()
        self.scheduler.verify_drafts(request_id, num_accepted)

    def pending_drafts(self, request_id: Hashable) -> list[tuple[int, int]]:
        """The request's draft runs waiting for ``verify_drafts``: ``[(start, count)]``."""
        return self.scheduler.pending_drafts(request_id)

    # ------------------------------------------------------------------ disaggregation
    def import_request(self, request_id: Hashable, prompt_len: int, max_new_tokens: int,
                       token_ids: Optional[Sequence[int]] = None) -> KVImport:
        """Admit a request whose prompt KV a transport writes (decode side): returns the
        ``KVImport`` naming, per layer, the host rows (``host_cache``) and device rows
        (``device_cache``) each prompt token's bytes go to; then ``finish_import`` once the
        transport completed, or ``abort_import``. See ``HiSparseScheduler.import_request``
        and ``docs/runtime.md``, "Prefill/decode disaggregation"."""
        self._check_open()
        return self.scheduler.import_request(request_id, prompt_len, max_new_tokens,
                                             token_ids)

    def finish_import(self, request_id: Hashable) -> None:
        """The transport wrote every byte of the import (and, on CUDA, the writes are
        visible to the runtime's stream): the prompt's host part is durable and published,
        its tail is mirrored with the next ``commit()``; the request decodes from here on."""
        self._check_open()
        self.scheduler.finish_import(request_id)

    def abort_import(self, request_id: Hashable) -> None:
        """The transfer failed: everything the import took goes back (blocks, hot region,
        state row); no transport may write its rows afterwards."""
        self._check_open()
        self.scheduler.abort_import(request_id)

    def export_request(self, request_id: Hashable) -> KVExport:
        """Where a request's KV lives, for a transport to read (prefill side): every
        token's host row (source layers) and device rows (indexer, regular layers); needs
        every token durable (``commit()`` first) and, on CUDA, the mirror finished before
        the host rows are read (``torch.cuda.synchronize()``). Keep the request until the
        transport read them. See ``HiSparseScheduler.export_request``."""
        self._check_open()
        return self.scheduler.export_request(request_id)

    def is_importing(self, request_id: Hashable) -> bool:
        """Whether a transport is writing the request's prompt (``import_request`` until
        ``finish_import``)."""
        return self.scheduler.is_importing(request_id)

    def mirror_draft(self) -> None:
        """Copy the draft layers' rows of the step's tokens to the host: call it once the
        drafter wrote their KV (after the main forward and ``truncate``), before
        ``commit()``. ``ValueError`` without ``draft_layers``."""
        self._check_open()
        if not self.worker.draft_layers:
            raise ValueError("mirror_draft(): this runtime has no draft layers (pass "
                             "draft_layers when building it).")
        self._with_plan(lambda: self.worker.mirror(draft=True))

    def commit(self) -> None:
        """End the step: mirror its new rows to host; release pages that are done.

        1. Table changes not yet handed to the worker go over in one plan (with the mirror
           rows of tokens appended since the last plan).
        2. Committed tokens become durable: under memory pressure (or past the admission
           window) a request takes its hot region and unpins its committed pages outside the
           last ``ACTIVE_TAIL_PAGES``: their blocks go back to the pool but stay readable
           until reused (see ``HiSparseScheduler`` for the residency rules). Full prompt
           (and generated, with ``token_ids``) pages are published for prefix reuse. Sliding-window groups release pages that
           left every future query's window. Their table changes wait for the next plan.
        3. One copy per row size moves every new row of every source layer from its resident
           page to the host pool (write-through), for every plan of the step.

        Call it once per step, after the step's attention has read the rows ``resolve``
        returned: released blocks are handed to other requests from here on. With a shared
        host pool only rank 0 (``mirrors_to_host``) copies in step 3 (the shared-pool
        contract in the module docstring).
        """
        self._check_open()

        def work() -> None:
            _check_drafts_mirrored(self.worker)
            self.scheduler.commit_mirrors()
            self.worker.mirror()
        self._with_plan(work)

    def _with_plan(self, work: Callable[[], _T]) -> _T:
        """Hand the pending changes over, then ``work()``; if it raises, the plan is
        reverted and the scheduler's changes undone."""
        with self._journal.transaction():
            plan = self._hand_over()
            try:
                return work()
            except BaseException:
                if plan is not None:
                    self.worker.revert(plan)
                raise

    def flush(self) -> None:
        """Hand the table changes made since the last plan to the worker now (one plan,
        with the mirror rows of the tokens appended since: ``commit()`` copies them). The
        runtime does it before every resolve and at ``commit()``; call it to read current
        tables (``block_tables``, ``hot_slots``) between those."""
        self._check_open()
        self._hand_over()

    def _hand_over(self) -> Optional[StepPlan]:
        """The pending table changes as one plan applied by the worker (None: none)."""
        scheduler = self.scheduler
        if not scheduler.has_pending_changes:
            return None
        with self._journal.transaction():
            plan = scheduler.flush()
            self.worker.apply(plan)
        return plan

    def free_request(self, request_id: Hashable) -> None:
        """Return every host and device block of the request and its state row."""
        self._check_open()
        self.scheduler.free_request(request_id)

    # ------------------------------------------------------------------ decode step
    def resolve(self, leader_layer: str, request_ids: Sequence[Optional[Hashable]],
                topk: torch.Tensor) -> torch.Tensor:
        """Resolve one index group's top-k positions into device rows; gather the misses.

        - ``leader_layer``: an index-group leader (``leaders``).
        - ``request_ids``: one per batch row (a list or tuple); ``None`` = a padding row
          (outputs -1).
        - ``topk``: ``[R, K]`` integer token positions on the runtime's device, ``K <=
          device_buffer_size``; any value is allowed: negative, ``>= seq_len`` or huge
          positions resolve to -1. ``[R, Q, K]`` for Q speculative (MTP) query tokens per
          request: each request's Q selections resolve as one union (a shared position takes
          one slot and one transfer), the result is ``[R, Q, K]``.
        Returns ``[R, K] int32`` rows of ``device_cache(layer)`` valid for the leader and
        every follower (-1 = masked). A row keeps pointing at the bytes it was returned for
        until the next ``commit()`` whatever is called in between, or earlier the request's
        ``free_request()`` and, for a hot row, the next resolve of this index group for the
        same request (the row lifetime in the module docstring): the blocks read in place
        are held from any new owner until ``commit()`` (a call that would need them raises
        ``CapacityError``). The tensor itself is the index group's persistent output,
        overwritten by its next resolve (copy it to keep it). Misses are gathered host ->
        device into the hot rows of all of the index group's layers in one launch. Counters
        accumulate on the device; nothing here waits for the device (a CPU ``topk`` is staged
        through pinned memory; narrow integer dtypes convert losslessly, 64-bit ones
        saturate). ``DuplicateRequestError`` for one id twice, ``UnknownRequestError``,
        ``ValueError`` for a bad leader or ``topk``; nothing changes on error (checked
        before pending table changes are handed over; the hand-over is undone if the
        resolve raises).
        """
        self._check_open()
        self.worker.index_group(leader_layer)
        self.worker.check_topk(topk)
        check_id_list(request_ids)
        if topk.shape[0] != len(request_ids):
            raise ValueError(f"topk has {topk.shape[0]} rows but {len(request_ids)} request "
                             f"ids were given.")
        rows = self.scheduler.state_rows(request_ids)
        state_rows = self.worker.to_device(rows, torch.int32)
        return self._resolve(leader_layer, state_rows, topk, None, rows)

    def resolve_prefill(self, leader_layer: str, request_ids: Sequence[Optional[Hashable]],
                        topk: torch.Tensor) -> torch.Tensor:
        """Rows of one index group's prefill chunk, host-only rows staged on the device.

        - ``request_ids``: one per query token (a list or tuple; tokens of one request
          repeat its id; ``None`` = a padding token, all -1).
        - ``topk``: ``[T, K]`` integer token positions (any ``K``, any integer dtype; -1,
          negative, ``>= seq_len`` or huge positions are masked).
        Returns ``[T, K] int32`` rows of ``device_cache(layer)`` for the leader and every
        follower: rows whose page has a device copy in place, the others copied once from
        the host pool into staging rows: by default (``HiSparseConfig.prefill_staging_rows
        = 0``) in device blocks the scheduler lends until ``commit()``, as many as the
        chunk's bound below needs (``HiSparseScheduler.borrow_prefill_staging``), else in
        the reserved region; hot buffers are not touched. Rows read in place keep their
        bytes until the next ``commit()`` (or the request's ``free_request()``), like
        ``resolve``'s (their blocks are held until then); staged rows until the next
        ``resolve_prefill`` call (any index group, even one that raises) or ``commit()``;
        the tensor is overwritten by the next call. Bounds the
        chunk's host-only rows from the scheduler's tables, then hands pending table changes
        over (as ``resolve`` does): when the bound fits the staging rows nothing waits for
        the device; otherwise (a region smaller than the bound) the call reads the exact
        count once. ``PrefillStagingError`` (naming the rows needed and those there are)
        when the chunk does not fit the region, or the free blocks cannot lend the bound's
        rows (commit first, prefill fewer tokens per chunk, or reserve a region),
        ``UnknownRequestError``, ``ValueError`` for a bad leader or ``topk``; nothing
        changes on error (checked before the hand-over; the hand-over is undone when the
        chunk overflows or torch raises).
        """
        self._check_open()
        scheduler, worker = self.scheduler, self.worker
        worker.index_group(leader_layer)
        rows = _prefill_state_rows(scheduler, request_ids, topk)
        state_rows = worker.to_device(rows.numpy(), torch.int32)
        worker.check_prefill(leader_layer, state_rows, topk)
        with self._journal.transaction():   # undone (holds, lent blocks) if the call raises
            # The chunk's requests first: a block lent below is never one of their pages.
            scheduler.read_holds.hold(rows.numpy())
            # The scheduler's tables are what the worker's are once the pending plan is in.
            bound = scheduler_host_rows_bound(scheduler, leader_layer, request_ids,
                                              topk.shape[1])
            blocks = (scheduler.borrow_prefill_staging(bound)
                      if scheduler.prefill_staging.lent else None)
            call = functools.partial(worker.resolve_prefill, leader_layer, state_rows, topk,
                                     host_rows_bound=bound, staging_blocks=blocks)
            return self._with_plan(call) if scheduler.has_pending_changes else call()

    def resolve_rows(self, leader_layer: str, state_rows: torch.Tensor,
                     topk: torch.Tensor, *, stream: Optional[object] = None):
        """``resolve`` by state rows: the fixed-shape, host-free core (CUDA-graph friendly).

        ``state_rows``: ``[R] int32`` on the runtime's device (``state_rows(ids)``), -1 =
        padding; rows must be distinct. A row that is not live resolves against an empty
        request (all -1). ``topk``: ``[R, K]``, as for ``resolve``. Only shapes are checked.
        ``stream``: the side-stream mode (``HiSparseWorker.resolve_rows``): returns
        ``StreamRows(rows, events)``, the events each layer's attention waits on. The row
        lifetime is ``resolve``'s; since the scheduler does not read device state rows, it
        holds what every live request's rows may point at until ``commit()``.
        """
        self._check_open()
        return self._resolve(leader_layer, state_rows, topk, stream, None)

    def _resolve(self, leader_layer: str, state_rows: torch.Tensor, topk: torch.Tensor,
                 stream: Optional[object], read: Optional[np.ndarray]):
        """``worker.resolve_rows`` after the pending changes were handed over (checked
        first; the plan reverted if the resolve raises), then the rows it read held until
        ``commit()``: the state rows ``read`` (CPU), or every live request (None: the
        scheduler cannot see device state rows without a sync)."""
        scheduler, worker = self.scheduler, self.worker
        if not scheduler.has_pending_changes:   # the decode step: hold what it read after
            out = worker.resolve_rows(leader_layer, state_rows, topk, stream=stream)
            self._hold(read)
            return out
        worker.check_resolve(leader_layer, state_rows, topk, stream=stream)   # then hand over
        call = functools.partial(worker.resolve_rows, leader_layer, state_rows, topk,
                                 stream=stream)
        with self._journal.transaction():   # the holds are undone if the resolve raises
            self._hold(read)
            return self._with_plan(call)

    def _hold(self, read: Optional[np.ndarray]) -> None:
        """Hold the rows a resolve read until ``commit()``: state rows ``read``, or every
        live request's (None)."""
        holds = self.scheduler.read_holds
        if read is None:
            holds.hold_all()
        else:
            holds.hold(read)

    # ------------------------------------------------------------------ stats / close
    def stats(self) -> HiSparseStats:
        """Counters and occupancy. Reads the device counters: a device sync on CUDA, so call
        it between steps, not inside the decode path."""
        self._check_open()
        return _combine(self.scheduler.stats(), self.worker.stats())

    def stats_async(self) -> "RuntimeStatsSnapshot":
        """``stats()`` without a device sync on the decode path: the occupancy is read now,
        the device counters are copied in the background; ``.result()`` returns the
        ``HiSparseStats`` (waiting only for that copy)."""
        self._check_open()
        return RuntimeStatsSnapshot(self.scheduler.stats(), self.worker.stats_async())

    def reset_stats(self) -> None:
        """Zero the hit/miss/byte counters (occupancy is not a counter)."""
        self._check_open()
        self.scheduler.reset_stats()
        self.worker.reset_stats()

    def _debug_snapshot(self) -> dict:
        """Every piece of mutable state, as comparable CPU values (``_runtime_snapshot``)."""
        return _runtime_snapshot(self)

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeClosedError("the HiSparseRuntime is closed.")

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Drop every request and release both pools (unpins the host pool); idempotent."""
        if self._closed:
            return
        self._closed = True
        self.scheduler.close()
        self.worker.close()

    def __enter__(self) -> "HiSparseRuntime":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"{len(self.request_ids)} requests"
        return (f"HiSparseRuntime({len(self.source_layers)} sparse layers, "
                f"{len(self.index_groups)} index groups, {self.num_device_blocks} device / "
                f"{self.num_host_blocks} host blocks, device={self.device}, "
                f"backend={self.backend!r}, {state})")


def _runtime_snapshot(rt: HiSparseRuntime) -> dict:
    """Every piece of ``rt``'s mutable state, as comparable CPU values (tests: "a failed call
    changes nothing"): the scheduler's (pending table changes included) and the worker's.
    Copies every device table (a device sync on CUDA); makes no plan."""
    scheduler, worker = rt.scheduler._debug_snapshot(), rt.worker._debug_snapshot()
    next_step, d2h_bytes, plans, mirror_due = worker.pop("misc")
    state = {**{("scheduler", k): v for k, v in scheduler.items() if k != "misc"},
             **{("worker", k): v for k, v in worker.items()}}
    # "misc"[2] is the d2h byte counter (the one entry TP ranks do not share).
    state["misc"] = (scheduler["misc"], (next_step, plans, mirror_due), d2h_bytes)
    return state


__all__ = ["BACKENDS", "HiSparseError", "HiSparseRuntime", "HiSparseStats"]
