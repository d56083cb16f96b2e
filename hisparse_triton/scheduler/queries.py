"""``SchedulerQueries``: the read-only half of ``HiSparseScheduler`` (no torch).

Plain CPU reads of the scheduler's parts, with no side effect: the plan's layers, a
request's lengths, rows and tables, the pools' free blocks, the counters. A mixin:
``HiSparseScheduler`` builds the parts it reads (``groups``, ``plan_builder``,
``devices``, ``capacity``, the pools, ``counters`` and the request table) and inherits
these queries.
"""

from __future__ import annotations

from typing import Callable, Hashable, Optional, Sequence

import numpy as np

from hisparse_triton.errors import RuntimeClosedError
from hisparse_triton.scheduler.requests import Request
from hisparse_triton.scheduler.stats import SchedulerStats

def _per_request(read: Callable[[Request], object], doc: str) -> Callable:
    """A scheduler query of one live request: ``read(request)``; ``UnknownRequestError``
    for an unknown id."""
    def query(self: "SchedulerQueries", request_id: Hashable):
        return read(self._request(request_id))
    query.__doc__ = doc
    return query


class SchedulerQueries:
    """Read-only queries of a ``HiSparseScheduler`` (see the module docstring)."""

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeClosedError("the HiSparseScheduler is closed.")

    def _request(self, request_id: Hashable, what: str = "") -> Request:
        self._check_open()
        return self._requests.get(request_id, what)

    leaders = property(lambda self: list(self.groups.leaders),
                       doc="Index-group leader layers (what ``resolve_rows`` takes).")
    index_groups = property(lambda self: [ig.layers for ig in self.groups.index_groups],
                            doc="Every index group's sparse layers, leader first.")
    source_layers = property(lambda self: self.groups.source_layers)
    device_layers = property(lambda self: self.groups.device_layers,
                             doc="Model layer names ``append_slots`` returns rows for.")
    has_pending_changes = property(lambda self: self.plan_builder.has_pending_changes,
                                   doc="Whether table changes wait for the next plan.")
    step_count = property(lambda self: self.plan_builder.step,
                          doc="Plans emitted so far (the next plan's ``step`` is this + 1).")
    request_ids = property(lambda self: list(self._requests))
    row_layer_names = property(
        lambda self: list(self.devices.row_names),
        doc="The layers of each paged group, in ``append_group_rows`` order.")
    closed = property(lambda self: self._closed)

    def has_request(self, request_id: Hashable) -> bool:
        self._check_open()
        return request_id in self._requests

    seq_len = _per_request(lambda r: r.seq_len,
                           "Tokens present so far (cached prefix + appended).")
    unpinned_pages = _per_request(
        lambda r: r.released_pages, "How many of the request's leading resident pages left "
        "its ownership (unpinned: readable until their blocks are reused; or lost: read from "
        "the host).")
    is_offloaded = _per_request(lambda r: r.hot is not None, "Whether the request holds a "
                                "hot region (its committed pages may leave the GPU).")
    pending_drafts = _per_request(
        lambda r: list(r.drafts), "The request's draft runs waiting for ``verify_drafts``: "
        "``[(start, count)]``, oldest first (empty: none).")
    is_importing = _per_request(lambda r: r.importing, "Whether a transport is writing the "
                                "request's prompt (``import_request`` until ``finish_import``).")
    state_row = _per_request(lambda r: r.row,
                             "The request's row in the workers' per-request tables.")
    host_block_table = _per_request(lambda r: list(r.host_blocks),
                                    "The request's host blocks, one per reserved page.")

    def state_rows(self, request_ids: Sequence[Optional[Hashable]]) -> np.ndarray:
        """``[R] int32`` state rows (-1 for ``None`` = padding); ``DuplicateRequestError`` for
        an id named twice, ``UnknownRequestError`` for an unknown one."""
        self._check_open()
        return self._requests.state_rows(request_ids)

    def block_table(self, request_id: Hashable, layer_name: str) -> list[int]:
        """The request's device blocks for a layer's group, one per page (0 = the page is
        not on the GPU); for a hot layer its hot region."""
        req = self._request(request_id)
        position = self.groups.layer_group[self.groups.device_layer_name(layer_name)]
        return self.devices.managers[position].table(req)

    @property
    def available_device_blocks(self) -> int:
        """Device blocks an ``append_slots`` may take now: free blocks (cached ones
        included: taking one loses its page) minus the hot regions reserved for requests
        that have not offloaded yet and the blocks held for rows read in place (0 at
        least)."""
        return max(self.capacity.available_device_blocks, 0)

    held_device_blocks = property(
        lambda self: self.read_holds.total(),
        doc="Device blocks kept from any new owner until the step ends because a resolve "
            "read their pages in place (``hold_reads``).")

    truly_free_device_blocks = property(
        lambda self: self.device_block_pool.num_truly_free,
        doc="Free device blocks that hold no readable page (what the watermark watches).")

    def stats(self) -> SchedulerStats:
        """Occupancy and residency counters (plain CPU reads)."""
        self._check_open()
        return self.counters.stats(
            self.devices.in_use(), self.device_block_pool, self.host_block_pool,
            num_requests=len(self._requests), steps=self.plan_builder.step,
            offloaded_requests=sum(r.hot is not None for r in self._requests.values()))

    def reset_stats(self) -> None:
        """Zero the cumulative counters; peaks restart from the current occupancy."""
        self._check_open()
        self.counters.reset(self.device_block_pool.num_used, self.host_block_pool.num_used)


__all__ = ["SchedulerQueries"]
