"""Carrying out the residency decisions: ``residency.py`` decides, ``Durability`` acts (no torch).

What follows from tokens becoming durable (``make_durable``: full pages published for prefix
reuse, durable pages outside the active tail unpinned, sliding-window pages out of every
window released) and from a counted call that needs room (``run_reclaim``: the requests the
reclaim plan chose offload). Every change goes through the managers (``coordinator``), the
prefix cache and the journal, like the scheduler's own.
"""

from __future__ import annotations

from functools import partial
from typing import Optional

import numpy as np

from hisparse_triton.scheduler.block_pool import BlockPool
from hisparse_triton.scheduler.coordinator import GroupCoordinator
from hisparse_triton.scheduler.journal import Journal
from hisparse_triton.scheduler.prefix_cache import PrefixCache
from hisparse_triton.scheduler.requests import Request, RequestTable
from hisparse_triton.scheduler.residency import Reclaim, ResidencyPolicy
from hisparse_triton.scheduler.stats import Counters


class Durability:
    """The scheduler's residency actions (see the module docstring). ``prefix``: the prefix
    cache when prefix caching is on (no sliding-window group), else None."""

    def __init__(self, *, requests: RequestTable, devices: GroupCoordinator,
                 policy: ResidencyPolicy, prefix: Optional[PrefixCache], counters: Counters,
                 device_pool: BlockPool, host_pool: BlockPool, journal: Journal) -> None:
        self.requests, self.devices, self.policy, self.prefix = requests, devices, policy, prefix
        self.counters, self.journal = counters, journal
        self.device_pool, self.host_pool = device_pool, host_pool
        self.block_size = policy.block_size
        # A page is published only with a block in every full-history group but the
        # resident ones (whose GPU copies are optional: the host has the page).
        self.prefix_required = [m.position for m in devices.paged
                                if m.position not in devices.resident_positions]

    def track_peaks(self) -> None:
        self.counters.track_peaks(self.device_pool.num_used, self.host_pool.num_used)

    def offload(self, req: Request) -> None:
        """``req`` takes its hot regions (reserved at admission)."""
        self.devices.offload(req)
        self.track_peaks()

    def release_resident(self, req: Request, pressure: bool) -> None:
        """Unpin the durable pages the policy lets go (offloading the request first)."""
        span = self.policy.release_range(req, pressure) if self.devices.resident else None
        if span is None:
            return
        with self.journal.transaction():
            if span.offload:
                self.offload(req)
            self.devices.unpin(req, span.first, span.limit, drop=self.policy.always_offload)

    def run_reclaim(self, reclaim: Optional[Reclaim]) -> None:
        """Offload the requests a counted call chose (their pages stay readable in the free
        queue; only blocks actually reused are lost)."""
        for req in reclaim.requests if reclaim is not None else ():
            self.release_resident(req, pressure=True)

    def make_durable(self) -> int:
        """Mark the mirrored tokens durable (up to each request's first pending position:
        unverified drafts and imports in flight never are); publish and release what that
        allows. Returns the pages released (unpinned or out of every window).

        The lengths move for every request at once; then the requests with something to
        publish or release act, in table order (as if one after the other: each acts on
        its own pages, and a request's lengths are read only by its own actions)."""
        values = self.counters.values
        before = values["unpinned_pages"] + values["window_released_pages"]
        pressure = self.policy.under_pressure(self.device_pool.num_truly_free)
        reqs, rows = self.requests.in_order()
        cols = self.requests.columns
        # Mirrored tokens become durable up to the first pending one (a draft not verified
        # yet, an imported prompt a transport still writes).
        durable = np.minimum(cols.scheduled_len[rows], cols.pending_from[rows])
        newly = durable > cols.committed_len[rows]
        if np.count_nonzero(newly):   # committed_len <= durable: all take durable
            self.journal.write(cols.committed_len, rows, durable)
        # Only requests added with token ids have page hashes to publish.
        tracking = self.requests.tracking_in_order() if self.prefix is not None else None
        publish = newly & tracking if tracking is not None else None
        release = (self.policy.releasable_limits(durable, cols.seq_len[rows])
                   > cols.released_pages[rows]) if self.devices.resident else None
        acting = self.devices.windowed or _any(publish) or _any(release)
        for i in range(len(reqs)) if acting else ():
            self._act(reqs[i], publish is not None and publish[i],
                      release is not None and release[i], pressure)
        return values["unpinned_pages"] + values["window_released_pages"] - before

    def publish(self, req: Request) -> None:
        """Publish ``req``'s full pages that became durable since the last call (a request
        added with token ids; no-op without prefix caching)."""
        if self.prefix is None or not req.page_hashes:
            return
        keep_gpu_copies = not self.policy.always_offload   # 1.0: pages leave at once
        self.prefix.publish_durable(req, partial(
            self.devices.page_blocks, req, resident=keep_gpu_copies),
            self.prefix_required, self.block_size)

    def _act(self, req: Request, publish: bool, release: bool, pressure: bool) -> None:
        """What newly durable tokens let ``req`` do: publish its full pages, release its
        resident pages (``release``: it has some past those released), its window pages."""
        if publish:
            self.publish(req)
        if release:
            self.release_resident(req, pressure)
        self.devices.release_windows(req)


def _any(mask: Optional[np.ndarray]) -> bool:
    return mask is not None and bool(np.count_nonzero(mask))


__all__ = ["Durability"]
