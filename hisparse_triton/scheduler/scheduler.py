"""``HiSparseScheduler``: the CPU-only half of the runtime (admission, block tables, residency).

A serving stack runs one scheduler (in its scheduler process) and one ``HiSparseWorker`` per
GPU rank. The scheduler owns every decision and no tensor; each step it emits one
``StepPlan`` that every worker applies (request ids never leave the scheduler, only state
rows and block ids do)::

    cached = scheduler.add_request(id, prompt_len, max_new_tokens, token_ids)  # admission
    rows = scheduler.append_slots(id, n)    # {layer: int64 [n]} device rows of n new tokens
    scheduler.truncate(id, new_len)         # rejected drafts, before the next step()
    scheduler.verify_drafts(id, accepted)   # async: drafts appended with num_draft_tokens
    scheduler.free_request(id)              # a finished request
    plan = scheduler.step()                 # -> every worker: worker.apply(plan)
    ...  forward: the model writes KV at `rows`, worker.resolve_rows(...) per index group  ...
    ...  worker.mirror(plan) after the forward  ...

``step()`` closes the step: its plan carries every table change since the previous plan and
the tokens appended since then, mirrored to the host pool after the forward; they count as
durable from the NEXT ``step()`` on.

This class orders the work of its parts: ``requests`` (the request table), ``coordinator``
and ``managers`` (a manager per device group), ``capacity`` (what a call needs, counted
first), ``residency`` (when pages leave the GPU: *dirty* -> *clean pinned* -> *clean
unpinned*, readable in its free block until reused -> *lost*, read from the host),
``durability`` (carries out the residency decisions), ``bookkeeping`` (the memory check
before anything is built), ``block_pool``, ``prefix_cache`` (a request with ``token_ids``
reuses the longest cached prefix; models with sliding-window layers get no hits),
``plan_builder``, ``stats``; ``queries`` holds the read-only calls (a mixin).
The decode step runs over the batch at once: a plain ``append_decode`` (one token each, no
token ids, the started pages fitting; ``Capacity.plain_decode``) and ``step()`` read and
write the requests' lengths as numpy columns by state row (``requests.RequestColumns``);
anything else takes the general path, one request after the other (``append_slots``).
Chunked prefill: with ``max_num_batched_tokens`` set, a request may not have more tokens
appended since its last plan than that (``UncommittedTokensError``: step first).

Every public call is all-or-nothing: it counts what it needs and refuses before changing
anything; compound changes (admission with prefix adoption, reclaim and offload, free) also
run in a ``journal.transaction()``. ``can_admit`` / ``can_append`` answer without raising;
``check_invariants`` checks the bookkeeping's rules.
"""

from __future__ import annotations

from contextlib import nullcontext
from functools import partial
from typing import Callable, Hashable, Optional, Sequence

import numpy as np

from hisparse_triton.config import ACTIVE_TAIL_PAGES, EngineConfig
from hisparse_triton.errors import HiSparseError, PrefillStagingError, SchedulerStateError
from hisparse_triton.groups import PlanGroups
from hisparse_triton.scheduler.block_pool import BlockPool
from hisparse_triton.scheduler.bookkeeping import check_plan
from hisparse_triton.scheduler.capacity import Admission, Capacity, DecodeCount
from hisparse_triton.scheduler.coordinator import GroupCoordinator
from hisparse_triton.scheduler.durability import Durability
from hisparse_triton.scheduler.invariants import scheduler_problems, scheduler_snapshot
from hisparse_triton.scheduler.journal import Journal
from hisparse_triton.scheduler.plan_builder import PlanBuilder, pack_mirror_rows_wide
from hisparse_triton.scheduler.prefix_cache import PrefixCache
from hisparse_triton.scheduler.queries import SchedulerQueries
from hisparse_triton.scheduler.read_holds import ReadHolds
from hisparse_triton.scheduler.requests import (
    Request,
    RequestTable,
    check_id_list,
    int_at_least,
)
from hisparse_triton.scheduler.residency import ResidencyPolicy, watermark_value
from hisparse_triton.scheduler.stats import Counters, SchedulerStats
from hisparse_triton.scheduler.transfer import KVExport, KVImport
from hisparse_triton.specs import KVCacheConfig, cdiv
from hisparse_triton.staging import PrefillStaging
from hisparse_triton.step_plan import StepPlan, TableLayout

#: Default ``free_block_watermark``: offload once 10% or less of the device pool is free.
DEFAULT_FREE_BLOCK_WATERMARK = 0.1
_REFUSALS = (HiSparseError, ValueError)   # what can_admit / can_append turn into False


class HiSparseScheduler(SchedulerQueries):
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
    - ``host_ram_fraction``: the bookkeeping (``scheduler/bookkeeping.py``: 24 B per device
      and host block, the block tables) is checked against this fraction of the available
      RAM before any of it is built (``HostMemoryError``).
    """

    def __init__(self, kv_cache_config: KVCacheConfig, config: EngineConfig, *,
                 max_num_seqs: int,
                 free_block_watermark: float | int = DEFAULT_FREE_BLOCK_WATERMARK,
                 offload_threshold_pages: Optional[int] = None,
                 host_ram_fraction: float = 0.9) -> None:
        if not isinstance(config, EngineConfig) or config.hisparse is None:
            raise ValueError("HiSparseScheduler needs an EngineConfig with hisparse set.")
        if not isinstance(kv_cache_config, KVCacheConfig):
            raise ValueError(f"kv_cache_config must be a KVCacheConfig, got "
                             f"{type(kv_cache_config).__name__}.")
        self.config, self.kv_cache_config = config, kv_cache_config
        self.max_num_seqs = int_at_least("max_num_seqs", max_num_seqs, 1)
        self.max_model_len = config.max_model_len
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.device_buffer_size = int(config.hisparse.device_buffer_size)
        self.groups = PlanGroups.from_config(kv_cache_config, config)
        self.block_size = B = self.groups.block_size
        self.layout = TableLayout.build(self.groups, self.max_num_seqs)
        self.hot_blocks_per_request = self.groups.hot_blocks_per_request
        self.offload_threshold_pages = (
            1 if offload_threshold_pages is None
            else int_at_least("offload_threshold_pages", offload_threshold_pages, 1))
        self.num_device_blocks = kv_cache_config.num_blocks
        self.num_host_blocks = kv_cache_config.hisparse_host_num_blocks
        check_plan(self.groups, self.layout, device_buffer_size=self.device_buffer_size,
                   num_device_blocks=self.num_device_blocks,   # before any per-block state
                   num_host_blocks=self.num_host_blocks, max_num_seqs=self.max_num_seqs,
                   host_ram_fraction=host_ram_fraction)
        self.journal = j = Journal()
        # The last blocks of the device pool hold resolve_prefill's staging rows: never
        # allocated (``hisparse_triton.staging``; the worker derives the same region).
        self.prefill_staging = PrefillStaging.from_plan(kv_cache_config, config)
        self.device_block_pool = BlockPool(self.prefill_staging.first_block, "device", j)
        self.host_block_pool = BlockPool(self.num_host_blocks, "host", j)
        self.free_block_watermark = watermark_value(free_block_watermark)
        self.policy = ResidencyPolicy.from_settings(
            free_block_watermark, self.device_block_pool.capacity, block_size=B,
            offload_threshold_pages=self.offload_threshold_pages,
            window_tokens=None if self.max_num_batched_tokens is None else config.in_flight_tokens)
        self.plan_builder = PlanBuilder(self.layout, j)
        self.counters = Counters(j)
        self._requests = RequestTable(self.max_num_seqs, j, self.layout.host_width)
        self.devices = d = GroupCoordinator(self.groups, self.device_block_pool,
                                            self.plan_builder, j, self.counters,
                                            self.max_num_seqs)
        # Prefix reuse needs every page of every full-history group: none with a window.
        self.prefix_caching = not d.windowed
        self._prefix = PrefixCache(j, self.host_block_pool, self.device_block_pool,
                                   d.resident_positions.__contains__)
        self.durability = Durability(
            requests=self._requests, devices=d, policy=self.policy,
            prefix=self._prefix if self.prefix_caching else None, counters=self.counters,
            device_pool=self.device_block_pool, host_pool=self.host_block_pool, journal=j)
        self.read_holds = ReadHolds(self.max_num_seqs, pool=self.device_block_pool, devices=d,
                                    columns=self._requests.columns, journal=j)
        self.device_block_pool.on_reuse = self._on_device_reuse
        self.device_block_pool.keep = self.read_holds.keeps
        self.host_block_pool.on_reuse = self._prefix.on_host_block_reused
        self.capacity = Capacity(
            requests=self._requests, devices=d, device_pool=self.device_block_pool,
            host_pool=self.host_block_pool, prefix=self._prefix if self.prefix_caching else None,
            policy=self.policy, max_model_len=self.max_model_len,
            max_num_batched_tokens=self.max_num_batched_tokens, holds=self.read_holds)
        #: Each paged group's layers (``devices.row_names``) as the keys of a dict.
        self._group_layers = [dict.fromkeys(names) for names in d.row_names]
        self._closed = False

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
        self._requests.check_new(request_id)
        admission = self.capacity.admission(request_id, prompt_len, max_new_tokens, token_ids)
        with self.journal.transaction():
            self.durability.run_reclaim(admission.reclaim)
            return self._admit(request_id, admission, token_ids is not None)

    def can_admit(self, prompt_len: int, max_new_tokens: int,
                  token_ids: Optional[Sequence[int]] = None) -> bool:
        """Whether ``add_request`` with these arguments (and a new id) would succeed now."""
        return self._answers(self.capacity.admission, "<new>", prompt_len, max_new_tokens,
                             token_ids)

    def _admit(self, request_id: Hashable, admission: Admission, with_tokens: bool) -> int:
        hits = admission.hits
        for entry in hits:   # shared host blocks are never written again
            self.host_block_pool.share(entry.host_block)
        host_blocks = [e.host_block for e in hits] + self.host_block_pool.allocate(
            admission.new_host, request_id=request_id)
        req = self._requests.add(request_id, admission.prompt_len, admission.max_new_tokens,
                                 host_blocks, admission.hashes, admission.token_ids)
        self.plan_builder.reset_row(req.row)
        self.plan_builder.write_host_blocks(req.row, host_blocks)
        self.devices.add_request(req)
        self.counters.add("prefix_query_tokens", req.prompt_len if with_tokens else 0)
        if hits:   # it starts offloaded when a resident page survives only on the host
            host_only = self.devices.adopt_prefix(req, hits, self.counters)
            self._requests.start_cached(req, len(hits), self.block_size)
            self.plan_builder.write_seq_len(req.row, req.seq_len)
            self.counters.add("prefix_hit_tokens", req.seq_len)
            if host_only:
                self.durability.offload(req)
        self.durability.track_peaks()
        return len(hits) * self.block_size

    # ------------------------------------------------------------------ appending
    def append_slots(self, request_id: Hashable, num_tokens: int,
                     token_ids: Optional[Sequence[int]] = None, *,
                     num_draft_tokens: int = 0) -> dict[str, np.ndarray]:
        """Allocate device pages for ``num_tokens`` new tokens; where to write their KV.

        Returns ``{layer_name: [num_tokens] int64}`` device rows for every device layer
        (sparse layers under their model name: their resident rows; indexer and regular
        layers); row ``r`` of a layer is ``device_cache(layer)[r // B, r % B]`` on a worker.
        Layers of one group share one array. ``token_ids``: the appended tokens' ids
        (``num_tokens`` ints): for a request added with ``token_ids`` its generated pages
        are hashed like prompt pages and published once durable (an append without them
        ends that: later pages are not published). ``num_draft_tokens``: the last that many
        of the tokens are drafts a later forward verifies: mirrored like any token but
        never durable (never published, never leaving the GPU) until ``verify_drafts``
        accepts them; an async stack may append (and step) further tokens before that
        (``docs/runtime.md``, "Rollback under async scheduling").
        ``ReservationExceededError`` past ``prompt_len + max_new_tokens``;
        ``UncommittedTokensError`` past ``max_num_batched_tokens`` tokens since the
        request's last plan; ``CapacityError`` when the device pool is full; ``ValueError``
        for bad ``token_ids``, a bad draft count or drafts inside the prompt, or a request
        whose prompt is being imported. Nothing changes on error.
        """
        per_group = self.append_group_rows(request_id, num_tokens, token_ids,
                                           num_draft_tokens=num_draft_tokens)
        return {name: rows for rows, names in zip(per_group, self.devices.row_names)
                for name in names}

    def append_group_rows(self, request_id: Hashable, num_tokens: int,
                          token_ids: Optional[Sequence[int]] = None, *,
                          num_draft_tokens: int = 0) -> list[np.ndarray]:
        """``append_slots`` with one ``[num_tokens] int64`` array of rows per paged group (in
        ``row_layer_names`` order) instead of a dict per layer (cheaper on the decode path)."""
        self._check_open()
        req = self._request(request_id, "append_slots")
        new_len, counts, reclaim = self.capacity.append(req, num_tokens)
        ids = req.new_token_ids(new_len - req.seq_len, token_ids)
        drafts = (req.check_drafts(new_len - req.seq_len, num_draft_tokens)
                  if num_draft_tokens else 0)
        start = req.seq_len
        if counts is None and not drafts:   # the decode step: one token, no new page
            rows = self.devices.row_at(req, start)
            self._grow(req, new_len, None, ids)
            return [np.array([row], dtype=np.int64) for row in rows]
        with self.journal.transaction() if reclaim is not None or drafts else nullcontext():
            self.durability.run_reclaim(reclaim)
            self._grow(req, new_len, counts, ids)
            self._requests.mark_drafts(req, drafts)
            rows = self.devices.rows(req, start, new_len)
        return rows

    def can_append(self, request_id: Hashable, num_tokens: int) -> bool:
        """Whether ``append_slots(request_id, num_tokens)`` would succeed now."""
        return self._answers(lambda: self.capacity.append(self._request(request_id),
                                                          num_tokens))

    def append_decode(self, request_ids: Sequence[Hashable],
                      token_ids: Optional[Sequence[int]] = None) -> dict[str, np.ndarray]:
        """``append_slots(id, 1)`` for every request of a decode batch, in one call:
        ``{layer: int64 [R]}`` rows, row ``r`` for ``request_ids[r]`` (layers of one group
        share one array); ``token_ids``: the new token of each request (``R`` ints) or None.
        All-or-nothing; the same errors as ``append_slots``."""
        self._check_open()
        check_id_list(request_ids)
        count = self.capacity.plain_decode(request_ids) if token_ids is None else None
        if count is not None:
            return self._by_layer(self._append_plain_decode(count))
        per_request = self._requests.decode_token_ids(request_ids, token_ids)
        columns = []   # the general path: one request after the other, all or nothing
        with self.journal.transaction():
            for request_id, ids in zip(request_ids, per_request):
                self._request(request_id, "append_decode")
                columns.append([int(rows[0])
                                for rows in self.append_group_rows(request_id, 1, ids)])
        table = np.array(columns, dtype=np.int64).reshape(len(columns),
                                                          len(self._group_layers)).T
        return self._by_layer(table)

    def _append_plain_decode(self, count: DecodeCount) -> np.ndarray:
        """Grow a counted plain decode batch by one token each; ``[paged groups, R]`` rows.
        The requests between two that start a page grow together; the order of every
        change (pool, plan writes) is the one-by-one order."""
        reqs, rows, positions = count.reqs, count.rows, count.positions
        if not count.starts:   # the common step: every request grows together
            self._advance(rows, positions)
            return self.devices.decode_rows(rows, positions)
        done = 0
        for i, counts in count.starts:
            self._advance(rows[done:i], positions[done:i])
            self.devices.grow(reqs[i], int(positions[i]) + 1, counts)
            self._advance(rows[i:i + 1], positions[i:i + 1])
            self.durability.track_peaks()
            done = i + 1
        self._advance(rows[done:], positions[done:])
        return self.devices.decode_rows(rows, positions)

    def _advance(self, rows: np.ndarray, positions: np.ndarray) -> None:
        """The requests of ``rows`` (at ``positions`` tokens) one token longer, tables too."""
        if rows.size:
            seq_lens = positions + 1
            self._requests.set_seq_lens(rows, seq_lens)
            self.plan_builder.write_seq_lens(rows, seq_lens)

    def _by_layer(self, table: np.ndarray) -> dict[str, np.ndarray]:
        """``append_decode``'s result: each paged group's rows (``table [paged groups, R]
        int64``) under each of its layers (``devices.row_names``), group after group."""
        groups = zip(self._group_layers, table)   # (fromkeys of a dict: presized, no hashing)
        out: dict[str, np.ndarray] = dict.fromkeys(*next(groups, ((), None)))
        for names, rows in groups:
            out.update(dict.fromkeys(names, rows))
        return out

    def _grow(self, req: Request, new_len: int, counts: Optional[list[int]],
              ids: Optional[np.ndarray] = None) -> None:
        """Grow ``req`` to ``new_len`` tokens: ``counts`` new blocks per paged group (known
        to fit; None: no page starts); ``ids``: what ``new_token_ids`` returned."""
        if counts is not None:
            self.devices.grow(req, new_len, counts)
        self._requests.extend_tokens(req, ids, self.block_size)
        self.journal.setattr(req, "seq_len", new_len)
        self.plan_builder.write_seq_len(req.row, new_len)
        if counts is not None:
            self.durability.track_peaks()

    def truncate(self, request_id: Hashable, new_len: int) -> None:
        """Keep the request's first ``new_len`` tokens, drop the rest (rejected drafts;
        ``docs/runtime.md``, rollback): ``seq_len`` back, the device blocks of pages past the
        end freed in every group, hot slots holding the dropped host rows emptied (the next
        plan's ``invalidate``), dropped token ids and page hashes forgotten (never
        published), pending drafts past the end dropped. The host blocks stay reserved, so a
        mirror already planned for the dropped tokens writes only the request's own rows
        past its end (read by nothing, overwritten later). ``ValueError`` past ``seq_len``
        or below the durable prefix (``committed_len``: with drafts appended as such, it
        never passes the oldest unverified one); nothing changes on error."""
        req = self._request(request_id, "truncate")
        new_len = req.check_truncate(new_len)
        if new_len == req.seq_len:
            return
        self._roll_back(req, new_len, new_len,
                        lambda: self._requests.truncate(req, new_len, self.block_size))

    def verify_drafts(self, request_id: Hashable, num_accepted: int) -> None:
        """The forward verified the request's oldest pending drafts (``append_slots(...,
        num_draft_tokens=k)``): the first ``num_accepted`` of those ``k`` stay (they may
        become durable once mirrored), the other ``k - num_accepted`` leave the sequence.

        Tokens appended after the run (steps an async stack scheduled before this
        verification) move down by the rejected count: the stack wrote their KV at the
        moved positions (as vLLM's model runner corrects the positions of a step scheduled
        on optimistic ones), so the request ends ``rejected`` tokens shorter. What changes,
        as ``truncate``: the device blocks of pages past the new end are freed (kept until
        the step ends when a resolve read the request in place), hot slots holding host
        rows from the first rejected position on are emptied by the next plan, every token
        from that position on is mirrored again with the next plan (its bytes changed), the
        token ids (when tracked) and page hashes from there are spliced and hashed again.
        Call it once per run, oldest first, when the verification is known (before or
        after later steps were scheduled). ``ValueError`` when no drafts are pending or
        ``num_accepted`` is not in ``[0, k]``; nothing changes on error."""
        req = self._request(request_id, "verify_drafts")
        start, count, accepted = req.check_verify(num_accepted)
        rejected = count - accepted
        if not rejected:
            with self.journal.transaction():
                self._requests.verify(req, accepted, self.block_size)
            return
        self._roll_back(req, start + accepted, req.seq_len - rejected,
                        lambda: self._requests.verify(req, accepted, self.block_size))

    def _roll_back(self, req: Request, first: int, new_len: int,
                   lengths: Callable[[], object]) -> None:
        """Positions of ``req`` from ``first`` on change (dropped, or rewritten), and it ends
        at ``new_len``: hot slots holding their host rows are emptied, the blocks of pages
        past ``new_len`` freed (kept until the step ends for a request a resolve read in
        place), then ``lengths()`` updates the request table; all or nothing."""
        holds = self.read_holds
        with self.journal.transaction():
            if req.hot is not None:   # hot slots may hold the dropped host rows
                self.plan_builder.invalidate(req.row, req.host_row_ranges(
                    first, req.seq_len, self.block_size))
            # A resolve may have read the dropped pages in place: keep their blocks.
            self.devices.truncate(req, new_len,
                                  holds.keep if holds.is_held(req.row) else None)
            lengths()
            self.plan_builder.write_seq_len(req.row, new_len)

    # ------------------------------------------------------------------ ending
    def free_request(self, request_id: Hashable) -> None:
        """Return every block of the request (tail first) and its state row. Published
        prefix pages stay readable in their free blocks until those are reused."""
        self._check_open()
        req = self._request(request_id, "free_request")
        with self.journal.transaction():
            self.devices.free(req)
            self.host_block_pool.free(req.host_blocks[::-1])
            self.plan_builder.reset_row(req.row)
            self.read_holds.forget(req.row)     # its rows end with it
            self._requests.remove(req)

    # ------------------------------------------------------------------ disaggregation
    def import_request(self, request_id: Hashable, prompt_len: int, max_new_tokens: int,
                       token_ids: Optional[Sequence[int]] = None) -> KVImport:
        """Admit a request whose prompt KV a transport writes (the decode side of
        prefill/decode disaggregation); returns where each prompt token's bytes go.

        Like ``add_request`` (host pages for ``prompt_len + max_new_tokens``, a state row,
        with ``token_ids`` the longest cached prefix reused and left out of the transfer),
        then the prompt's memory: the source layers' pages before the resident tail (the
        last ``ACTIVE_TAIL_PAGES`` pages, where new tokens are appended) stay in the host
        pool only (the request starts offloaded, with its hot region), the tail's pages and
        every page of the other device groups (indexer, regular) get device blocks. The
        ``KVImport`` names the host rows and, per device layer, the device rows the
        transport writes (``docs/runtime.md``, "Prefill/decode disaggregation"). Until
        ``finish_import`` the request cannot be appended to, resolved, rolled back or
        exported, and nothing of it becomes durable, published or mirrored; ``abort_import``
        (or ``free_request``) returns everything. Errors as ``add_request`` (the device
        blocks of the prompt's pages count with the hot region); nothing changes on error.
        """
        self._check_open()
        self._requests.check_new(request_id)
        admission = self.capacity.admission(request_id, prompt_len, max_new_tokens, token_ids,
                                            imported=self._import_blocks)
        B, prompt_len = self.block_size, admission.prompt_len
        with self.journal.transaction():
            self.durability.run_reclaim(admission.reclaim)
            cached = self._admit(request_id, admission, token_ids is not None)
            req = self._requests[request_id]
            pages = cdiv(prompt_len, B)
            tail = self._import_tail(pages, cached // B)
            if tail and req.hot is None:
                self.durability.offload(req)
            # Pages before the tail are host-only (a cached page's GPU copy stays readable).
            self.devices.unpin(req, 0, tail, drop=self.policy.always_offload)
            for m in self.devices.paged:
                first = m.group.pages(self._import_start(m, tail * B, cached))
                m.allocate_pages(req, first, m.group.pages(prompt_len) - first)
            self._requests.start_import(req, prompt_len, cached)
            self.plan_builder.write_seq_len(req.row, prompt_len)
            self.durability.track_peaks()
        tail_start = tail * B
        host_rows = req.host_rows(cached, tail_start, B)
        device_rows = {}
        for m, names in zip(self.devices.paged, self.devices.row_names):
            rows = m.rows(req, self._import_start(m, tail_start, cached), prompt_len)
            device_rows.update(dict.fromkeys(names, rows))
        return KVImport(request_id=request_id, state_row=req.row, cached_len=cached,
                        tail_start=tail_start, prompt_len=prompt_len, host_rows=host_rows,
                        device_rows=device_rows, source_layers=tuple(self.source_layers))

    def can_import(self, prompt_len: int, max_new_tokens: int,
                   token_ids: Optional[Sequence[int]] = None) -> bool:
        """Whether ``import_request`` with these arguments (and a new id) would succeed now
        (the prompt's device pages counted with the hot region); changes nothing."""
        return self._answers(partial(self.capacity.admission, imported=self._import_blocks),
                             "<new>", prompt_len, max_new_tokens, token_ids)

    @staticmethod
    def _import_tail(pages: int, cached_pages: int) -> int:
        """The first page of an imported prompt of ``pages`` pages that goes to the device
        (the resident tail; the cached prefix's pages come before it)."""
        return max(pages - ACTIVE_TAIL_PAGES, cached_pages)

    def _import_start(self, m, tail_start: int, cached: int) -> int:
        """The first prompt position of an imported request that paged group ``m`` holds on
        the device: the resident tail's in a resident group, the first past the cached
        prefix in the other paged groups."""
        return tail_start if m.position in self.devices.resident_positions else cached

    def _import_blocks(self, prompt_len: int, cached_pages: int) -> int:
        """Device blocks an imported prompt's pages take (``_import_start`` on)."""
        B = self.block_size
        tail_start = self._import_tail(cdiv(prompt_len, B), cached_pages) * B
        return sum(m.group.pages(prompt_len)
                   - m.group.pages(self._import_start(m, tail_start, cached_pages * B))
                   for m in self.devices.paged)

    def finish_import(self, request_id: Hashable) -> None:
        """The transport wrote every byte ``import_request`` named (call it only once all of
        them completed and are visible to the workers): the host part of the prompt is
        durable now and its full pages are published for prefix reuse (with
        ``token_ids``); the tail, on the device, is mirrored with the next plan and durable
        from the step after, as appended tokens are. The request decodes from here on.
        ``ValueError`` for a request that is not importing; nothing changes on error."""
        req = self._request(request_id, "finish_import")
        if not req.importing:
            raise ValueError(f"request {request_id!r}: finish_import of a request that is not "
                             f"being imported.")
        with self.journal.transaction():
            # The pages before the tail are exactly those released at import.
            self._requests.finish_import(req, min(req.released_pages * self.block_size,
                                                  req.seq_len))
            self.durability.publish(req)
            self.devices.release_windows(req)

    def abort_import(self, request_id: Hashable) -> None:
        """The transport failed or was cancelled: return everything ``import_request`` took
        (host and device blocks, the hot region, the state row; a cached prefix it shared
        stays cached), as ``free_request``. No transport may write its rows afterwards.
        ``ValueError`` for a request that is not importing; nothing changes on error."""
        req = self._request(request_id, "abort_import")
        if not req.importing:
            raise ValueError(f"request {request_id!r}: abort_import of a request that is not "
                             f"being imported (free_request ends a request).")
        self.free_request(request_id)

    def export_request(self, request_id: Hashable) -> KVExport:
        """Where a request's KV lives, for a transport to read (the prefill side of
        prefill/decode disaggregation): the host row of every token for the source layers
        (the host pool holds all of them once durable) and the device rows of every other
        device layer (``KVExport``). The rows keep their bytes while the request lives: free
        it only once the transport read them. ``ValueError`` while tokens are not durable
        (``step()`` / ``commit_mirrors()`` after the mirror of the last plan that carried
        them; the facade's ``commit()``) or the request is being imported; nothing changes."""
        req = self._request(request_id, "export_request")
        req.check_not_importing("export")
        n = req.seq_len
        if req.committed_len < n:
            raise ValueError(f"request {request_id!r}: tokens {req.committed_len}..{n - 1} "
                             f"are not durable yet (their host copies come with the mirror of "
                             f"the plan that carries them): step() or commit_mirrors() after "
                             f"that mirror first (the facade: commit()).")
        host_rows = req.host_rows(0, n, self.block_size)
        device_rows = {}
        resident = self.devices.resident_positions
        for m, names in zip(self.devices.paged, self.devices.row_names):
            if m.position in resident:
                continue
            rows = m.rows(req, 0, n)
            rows[rows < m.block_size] = -1   # block 0, the null block: a released page
            device_rows.update(dict.fromkeys(names, rows))
        return KVExport(request_id=request_id, num_tokens=n, host_rows=host_rows,
                        device_rows=device_rows, source_layers=tuple(self.source_layers))

    def reset_prefix_cache(self) -> int:
        """Forget every published prefix page (their free blocks become truly free);
        returns how many pages were dropped."""
        self._check_open()
        with self.journal.transaction():
            return self._prefix.clear()

    # ------------------------------------------------------------------ steps
    def step(self) -> StepPlan:
        """Close a step: emit the plan every worker applies (see the module docstring).

        1. Tokens of earlier plans' mirrors become durable (``commit_mirrors``): their full
           pages are published for prefix reuse, requests that should offload take their hot
           regions and unpin durable pages outside the active tail, sliding-window pages out
           of every future window are released. Their table changes join this plan.
        2. Every token appended since the last plan that mirrored is in this plan's mirror
           rows: a worker must ``mirror`` the plan after the forward wrote their KV.
        A serving loop calls it once per model step, after the step's appends. The plan has
        ``commit`` set: a worker applies it only after every earlier plan's mirror.
        """
        self._check_open()
        self._release_holds()
        return self._build(commit=True, released_pages=self.durability.make_durable())

    def flush(self) -> StepPlan:
        """A plan of the table changes made since the last plan, with the mirror rows of the
        tokens appended since, but nothing made durable or released (``commit`` False).

        A worker may apply it while earlier plans' mirrors are due; its ``mirror`` copies
        them all, in plan order. For a caller that changes the tables between two resolves of
        one forward, or that drives the protocol in one process and declares durability
        itself with ``commit_mirrors`` (the facade ``HiSparseRuntime`` does both). A serving
        loop that makes all of a step's changes before ``step()`` never needs it.
        """
        self._check_open()
        return self._build(commit=False, released_pages=0)

    def _build(self, *, commit: bool, released_pages: int) -> StepPlan:
        work = self._requests.schedule_mirror(self.block_size)
        host_rows, device_rows = pack_mirror_rows_wide(
            work, [m.blocks for m in self.devices.resident], self.block_size,
            self.devices.resident_decode_rows)
        return self.plan_builder.build(commit=commit, mirror_host_rows=host_rows,
                                       mirror_device_rows=device_rows,
                                       released_pages=released_pages)

    def commit_mirrors(self) -> None:
        """Every plan emitted so far has been mirrored (every worker enqueued its
        ``mirror``): its tokens are durable from now on instead of from the next ``step()``.
        Newly durable full pages are published; the residency rules release what they let
        go (their table changes wait for the next plan). Optional: ``step()`` does the same
        first. A loop calls it after the forward to hand released blocks to the next step's
        appends one step earlier. It ends the step: blocks held for rows read in place
        (``hold_reads``) may get new owners again."""
        self._check_open()
        self._release_holds()
        self.durability.make_durable()

    def hold_reads(self, request_ids: Optional[Sequence[Optional[Hashable]]] = None) -> None:
        """The rows of these requests (None: of every live request) were read in place by a
        resolve since the step began; keep the blocks they point at from any new owner
        until the step ends (the next ``step()`` or ``commit_mirrors()``): their unpinned
        pages' blocks are not reused (nor counted available: a call that would need them
        raises ``CapacityError``), their pages are not reclaimed, and blocks ``truncate``
        drops from them are kept until then. An id may repeat (a prefill chunk's tokens);
        ``None`` entries (padding) are skipped; ``UnknownRequestError`` for an unknown id,
        ``ValueError`` for anything but a list or tuple; nothing changes on error. The
        facade calls it for every resolve; a split stack needs it only when it changes
        tables between a resolve and the end of that step (``docs/runtime.md``, "The row
        lifetime")."""
        self._check_open()
        if request_ids is None:
            self.read_holds.hold_all()
            return
        check_id_list(request_ids)
        rows = [self._request(rid, "hold_reads").row for rid in dict.fromkeys(request_ids)
                if rid is not None]
        self.read_holds.hold(np.asarray(rows, dtype=np.int64))

    def borrow_prefill_staging(self, rows: int) -> list[int]:
        """Device blocks for ``rows`` staging rows of ``resolve_prefill`` (a plan that
        reserves no staging region: ``HiSparseConfig.prefill_staging_rows = 0``), lent until
        the step ends (the next ``step()`` or ``commit_mirrors()``): the blocks lent earlier
        in the step, plus new ones when they hold fewer than ``rows`` rows (in the order
        staging rows use them; pass them to ``worker.resolve_prefill(...,
        staging_blocks=)``). New blocks come from the free ones as for an append (reclaim
        included): one that held another request's unpinned page makes that page lost, a
        change that must reach the workers before they stage (``has_pending_changes``:
        hand a ``flush()`` plan over). Call ``hold_reads`` for the chunk's requests first
        (their pages are then not taken, and the chunk's bound stays valid).
        ``PrefillStagingError`` (a ``CapacityError``) when the free blocks cannot hold them,
        ``ValueError`` for a bad count or a plan with a reserved region; nothing changes on
        error."""
        self._check_open()
        rows = int_at_least("rows", rows, 0)
        staging = self.prefill_staging
        if not staging.lent:
            raise ValueError(f"borrow_prefill_staging: this plan reserves a staging region "
                             f"of {staging.capacity_rows} rows (prefill_staging_rows); "
                             f"resolve_prefill stages there, nothing is lent.")
        lent = self.read_holds.lent_blocks()
        missing = -(-rows // self.block_size) - len(lent)
        if missing <= 0:
            return lent
        reclaim, available = self.capacity.fit(missing)
        if missing > available:
            held = self.read_holds.total()
            raise PrefillStagingError(
                f"resolve_prefill needs {rows} staging rows ({missing} more device blocks of "
                f"{self.block_size} rows) but {max(available, 0)} blocks are free beside the "
                f"hot regions reserved for other requests and the {held} held for this "
                f"step's reads and staging: commit() first (the held blocks return), "
                f"prefill fewer tokens per chunk, or reserve a region with "
                f"HiSparseConfig.prefill_staging_rows.", resource="prefill staging rows",
                needed=rows, available=(len(lent) + max(available, 0)) * self.block_size)
        with self.journal.transaction():
            self.durability.run_reclaim(reclaim)
            blocks = self.device_block_pool.allocate(missing)
            self.read_holds.lend(blocks)
            self.durability.track_peaks()
        return lent + blocks

    def _release_holds(self) -> None:
        """The step ends: release the read holds (all-or-nothing)."""
        holds = self.read_holds
        if holds.active or holds.kept_blocks():
            with self.journal.transaction():
                holds.release()

    # ------------------------------------------------------------------ pool hooks
    def _on_device_reuse(self, block: int) -> None:
        """A device block that held readable pages went to a new owner."""
        self.devices.on_reuse(block)
        self._prefix.on_device_block_reused(block)

    # ------------------------------------------------------------------ lifecycle
    def _answers(self, count, *args) -> bool:
        """Whether a counting call accepts (``False`` for anything the real call refuses)."""
        self._check_open()
        try:
            count(*args)
        except _REFUSALS:
            return False
        return True

    def close(self) -> None:
        """Drop every request; later calls raise ``RuntimeClosedError``. Idempotent."""
        self._closed = True
        self._requests.clear()

    # ------------------------------------------------------------------ checks
    def check_invariants(self) -> None:
        """``SchedulerStateError`` listing every broken bookkeeping rule (none: returns)."""
        problems = scheduler_problems(self)
        if problems:
            raise SchedulerStateError("scheduler state is inconsistent:\n- "
                                      + "\n- ".join(problems))

    def _debug_snapshot(self) -> dict:
        """Every piece of mutable state as comparable values (tests: a failed call changes
        nothing; ``invariants.scheduler_snapshot``)."""
        return scheduler_snapshot(self)


__all__ = ["DEFAULT_FREE_BLOCK_WATERMARK", "HiSparseScheduler", "SchedulerStats"]
