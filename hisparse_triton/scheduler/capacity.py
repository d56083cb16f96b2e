"""``Capacity``: what a scheduler call needs and whether it fits, decided before any change.

Every call that takes blocks is counted here first, from the current state and changing
nothing: an admission (state row, host blocks, the hot region after the prefix hits it
adopts), an append (the paged groups' new blocks) and a decode batch. When the device
blocks do not fit as they are, the residency policy's reclaim plan says whom to offload and
what is available afterwards; a call that cannot fit even then is refused with
``CapacityError`` while nothing has changed yet. Blocks a resolve read in place since the
step began (``read_holds``) are not available, and the requests it read are not reclaimed
from, until the step ends. ``can_admit`` / ``can_append`` are these counts without the
error. No torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Hashable, Optional, Sequence

import numpy as np

from hisparse_triton.errors import CapacityError
from hisparse_triton.scheduler.block_pool import BlockPool
from hisparse_triton.scheduler.coordinator import GroupCoordinator
from hisparse_triton.scheduler.prefix_cache import PrefixCache, PrefixEntry, prompt_page_hashes
from hisparse_triton.scheduler.read_holds import ReadHolds
from hisparse_triton.scheduler.requests import (
    Request,
    RequestTable,
    check_lengths,
)
from hisparse_triton.scheduler.residency import Reclaim, ResidencyPolicy
from hisparse_triton.specs import cdiv


@dataclass
class DecodeCount:
    """A counted plain decode batch (``Capacity.plain_decode``): every request appends one
    token that brings no ids; all the pages it starts fit as the pools are."""

    reqs: list[Request]               # in batch order
    rows: np.ndarray                  # their state rows, [R] int64
    positions: np.ndarray             # their lengths before the token (its position)
    starts: list[tuple[int, list[int]]]   # (batch index, new blocks per paged group) of
                                          # the requests whose token starts a page


@dataclass(frozen=True)
class Admission:
    """A counted admission: what ``add_request`` will take (all of it fits)."""

    prompt_len: int
    max_new_tokens: int
    hashes: list[bytes]            # the prompt's full pages' chained hashes
    hits: list[PrefixEntry]        # the cached prefix it adopts
    new_host: int                  # host blocks to allocate (besides the hits' shared ones)
    reclaim: Optional[Reclaim]     # offloads to run first (None: none needed)
    token_ids: Optional[Sequence[int]] = None   # the prompt's ids (None: not given)


class Capacity:
    """The counting half of a scheduler's calls (see the module docstring)."""

    def __init__(self, *, requests: RequestTable, devices: GroupCoordinator,
                 device_pool: BlockPool, host_pool: BlockPool, prefix: Optional[PrefixCache],
                 policy: ResidencyPolicy, max_model_len: int,
                 max_num_batched_tokens: Optional[int], holds: ReadHolds) -> None:
        self.requests, self.devices, self.prefix, self.policy = requests, devices, prefix, policy
        self.holds = holds
        self.device_pool, self.host_pool = device_pool, host_pool
        self.block_size = policy.block_size
        self.max_model_len = max_model_len
        self.max_num_batched_tokens = max_num_batched_tokens

    @property
    def available_device_blocks(self) -> int:
        """Free device blocks (cached ones included: taking one loses its page) minus the
        hot regions reserved for requests that have not offloaded yet and minus the blocks
        held for rows a resolve read in place (below 0 when those holds exceed the rest)."""
        pool = self.device_pool
        return pool.num_free - self.devices.reserved - self.holds.held_free()

    def fit(self, needed: int, request_id: Hashable = None,
            num_tokens: int = 0) -> tuple[Optional[Reclaim], int]:
        """The reclaim that makes ``needed`` device blocks available (None: they already
        are, or no reclaim can help) and the blocks available then. With ``request_id`` (an
        append of ``num_tokens``): ``CapacityError`` when they do not fit even then."""
        available = self.available_device_blocks
        if needed <= available or not self.devices.resident:
            reclaim = None
        else:
            holds = self.holds
            requests = self.requests.values()
            if holds.active:   # a request a resolve read keeps its pages until the step ends
                requests = [r for r in requests if not holds.is_held(r.row)]
            reclaim = self.policy.plan_reclaim(
                requests, needed, available, self.devices.resident_blocks,
                self.device_pool.ref_count, holds.keeps if holds.active else None)
            available = reclaim.available
        if request_id is not None and needed > available:
            held = self.holds.total()
            because = (f"; {held} more are held until the step ends for rows a resolve read "
                       f"in place: retry after commit" if held else "")
            raise CapacityError(
                f"request {request_id!r}: appending {num_tokens} tokens needs {needed} device "
                f"blocks, {max(available, 0)} of {self.device_pool.capacity} are "
                f"available (free minus reserved hot regions{because}).",
                resource="device blocks", needed=needed, available=max(available, 0),
                request_id=request_id)
        return reclaim, available

    def admission(self, request_id: Hashable, prompt_len: object, max_new_tokens: object,
                  token_ids: Optional[Sequence[int]],
                  imported: Optional[Callable[[int, int], int]] = None) -> Admission:
        """Count a new request (errors as ``add_request`` but for a duplicate id).
        ``imported(prompt_len, cached_pages)``: the device blocks the pages of a prompt a
        transport writes take besides the hot region (``import_request``); they must fit
        too."""
        prompt_len, max_new_tokens = check_lengths(request_id, prompt_len, max_new_tokens,
                                                   self.max_model_len)
        B = self.block_size
        hashes = prompt_page_hashes(request_id, prompt_len, token_ids, B)
        hits = self.prefix.lookup(hashes, (prompt_len - 1) // B) if self.prefix else []
        if not self.requests.num_free_rows:
            raise CapacityError(f"cannot add request {request_id!r}: all "
                                f"{self.requests.max_num_seqs} state rows (max_num_seqs) "
                                f"are in use.", resource="state rows", needed=1, available=0,
                                request_id=request_id)
        host, total = self.host_pool, prompt_len + max_new_tokens
        new_host = cdiv(total, B) - len(hits)
        host_free = host.num_free - sum(1 for e in hits if host.is_free(e.host_block))
        if new_host > host_free:
            raise CapacityError(
                f"cannot add request {request_id!r}: it needs {new_host} host blocks for "
                f"{total} tokens, {host_free} of {host.capacity} are free.",
                resource="host blocks", needed=new_host, available=host_free,
                request_id=request_id)
        hot_cost = self.devices.hot_cost
        extra = imported(prompt_len, len(hits)) if imported is not None else 0
        reclaim, available = self.fit(hot_cost + extra + len(hits) * len(self.devices.paged))
        freed = reclaim.freed if reclaim is not None else frozenset()
        kept = self.holds.keeps   # held blocks were never counted available
        available -= sum(1 for e in hits for b in e.blocks.values()
                         if b and (self.device_pool.is_free(b) or b in freed) and not kept(b))
        if hot_cost + extra > available:
            held = self.holds.total()
            because = (f", and {held} held until the step ends for rows a resolve read in "
                       f"place: retry after commit" if held else "")
            what = (f"its hot region and the {extra} blocks of its imported prompt need "
                    f"{hot_cost + extra}" if imported is not None
                    else f"its hot region needs {hot_cost}")
            raise CapacityError(
                f"cannot add request {request_id!r}: {what} "
                f"device blocks, {max(available, 0)} of {self.device_pool.capacity} "
                f"are available (free minus the hot regions reserved for the other "
                f"requests{because}).", resource="device blocks", needed=hot_cost + extra,
                available=max(available, 0), request_id=request_id)
        return Admission(prompt_len=prompt_len, max_new_tokens=max_new_tokens, hashes=hashes,
                         hits=hits, new_host=new_host, reclaim=reclaim, token_ids=token_ids)

    def append(self, req: Request, num_tokens: object) -> tuple[int, Optional[list[int]],
                                                                 Optional[Reclaim]]:
        """Count an append to ``req``: its new length, the new blocks per paged group
        (None: one token that starts no page) and the reclaim to run first."""
        new_len = req.check_append(num_tokens, self.max_num_batched_tokens)
        devices = self.devices
        if new_len == req.seq_len + 1 and devices.starts_no_page(req.seq_len):
            return new_len, None, None
        counts = devices.count_new_blocks(req, new_len)
        reclaim, _ = self.fit(sum(counts), req.request_id, new_len - req.seq_len)
        return new_len, counts, reclaim

    def plain_decode(self, request_ids: Sequence[Hashable]) -> Optional[DecodeCount]:
        """The common decode step (``append_decode``), counted over the batch at once:
        distinct live ids, each request under its reservation and
        ``max_num_batched_tokens``, none whose token brings or closes a token-id chain
        (added with ``token_ids``, its chain open), every started page's blocks fitting.
        None for anything else (the general path counts it again and reports its error)."""
        batch = self.requests.batch(request_ids)
        if batch is None:
            return None
        cols, reqs, rows = self.requests.columns, batch.reqs, batch.rows
        if self.requests.num_importing and np.count_nonzero(cols.importing[rows]):
            return None
        positions = cols.seq_len[rows]
        if np.count_nonzero(positions >= cols.reserved[rows]):
            return None
        limit = self.max_num_batched_tokens
        if limit is not None and np.count_nonzero(positions - cols.planned_len[rows] >= limit):
            return None
        if batch.tracking and any(reqs[i].chain_open for i in batch.tracking):
            return None
        starts = [(i, self.devices.count_new_blocks(reqs[i], int(positions[i]) + 1))
                  for i in self._starting(positions)]
        if starts and sum(sum(c) for _, c in starts) > self.available_device_blocks:
            return None
        return DecodeCount(reqs=reqs, rows=rows, positions=positions, starts=starts)

    def _starting(self, positions: np.ndarray) -> list[int]:
        """Indices of the ``positions`` whose token starts a page in some paged group."""
        B = self.devices.uniform_block_size
        if B:
            offsets = positions % B
            if np.count_nonzero(offsets) == offsets.size:   # the common step: none
                return []
            return (offsets == 0).nonzero()[0].tolist()
        starts_no_page = self.devices.starts_no_page
        return [i for i, p in enumerate(positions.tolist()) if not starts_no_page(p)]


__all__ = ["Admission", "Capacity", "DecodeCount"]
