"""The scheduler's request table: live requests by id, their state rows, id checks (no torch).

A live request owns one *state row* of the workers' per-request tables (``[0,
max_num_seqs)``, lowest free row first). ``Request`` holds what the scheduler knows about
one request besides its device blocks (each group's manager owns those, by state row): its
lengths, host blocks, prompt page hashes and residency progress.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Hashable, Iterator, Optional, Sequence

import numpy as np

from hisparse_triton.errors import (
    DuplicateRequestError,
    ReservationExceededError,
    UncommittedTokensError,
    UnknownRequestError,
)
from hisparse_triton.scheduler.journal import Journal
from hisparse_triton.specs import cdiv


def int_at_least(name: str, value: object, minimum: int) -> int:
    """``value`` as an int; ``ValueError`` naming ``name`` unless it is an int >= ``minimum``."""
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


def check_lengths(request_id: Hashable, prompt_len: object, max_new_tokens: object,
                  max_model_len: int) -> tuple[int, int]:
    """A new request's ``(prompt_len, max_new_tokens)`` as ints; ``ValueError`` naming the
    request for a bad length or more than ``max_model_len`` tokens."""
    prompt_len = int_at_least(f"request {request_id!r}: prompt_len", prompt_len, 1)
    max_new_tokens = int_at_least(f"request {request_id!r}: max_new_tokens",
                                  max_new_tokens, 0)
    total = prompt_len + max_new_tokens
    if total > max_model_len:
        raise ValueError(f"request {request_id!r}: prompt_len {prompt_len} + "
                         f"max_new_tokens {max_new_tokens} = {total} exceeds "
                         f"max_model_len {max_model_len}.")
    return prompt_len, max_new_tokens


@dataclass(eq=False)
class Request:
    """One live request.

    Lengths (tokens): ``seq_len`` present (cached prefix + appended), ``scheduled_len`` in
    an emitted plan's mirror, ``committed_len`` durable on the host; ``committed_len <=
    scheduled_len <= seq_len <= reserved_tokens``. ``host_blocks``: one host block per
    reserved page (``host_array`` the same as int64). ``page_hashes``: the full prompt
    pages' chained hashes; pages ``[0, published_pages)`` were considered for the prefix
    cache. ``released_pages``: resident pages ``[0, released_pages)`` left the request's
    ownership (unpinned or lost). ``hot``: hot group position -> the request's hot region
    (``None`` until it offloads; the hot managers fill it).
    """

    request_id: Hashable
    row: int
    prompt_len: int
    max_new_tokens: int
    host_blocks: list[int]
    page_hashes: list[bytes] = field(default_factory=list)
    host_array: np.ndarray = field(default=None, repr=False)  # type: ignore[assignment]
    published_pages: int = 0
    seq_len: int = 0
    scheduled_len: int = 0
    committed_len: int = 0
    released_pages: int = 0
    hot: Optional[dict[int, list[int]]] = None

    def __post_init__(self) -> None:
        if self.host_array is None:
            self.host_array = np.asarray(self.host_blocks, dtype=np.int64)

    @property
    def reserved_tokens(self) -> int:
        return self.prompt_len + self.max_new_tokens

    def check_append(self, num_tokens: object, max_uncommitted: Optional[int]) -> int:
        """The length after ``num_tokens`` more tokens; ``ReservationExceededError`` past
        the reservation, ``UncommittedTokensError`` past ``max_uncommitted`` tokens since
        the last plan (``max_num_batched_tokens``; None: no limit)."""
        request_id = self.request_id
        num_tokens = int_at_least(f"request {request_id!r}: num_tokens", num_tokens, 0)
        new_len = self.seq_len + num_tokens
        if new_len > self.reserved_tokens:
            raise ReservationExceededError(
                f"request {request_id!r}: appending {num_tokens} tokens to {self.seq_len} "
                f"exceeds its reservation of {self.reserved_tokens} (prompt "
                f"{self.prompt_len} + max_new_tokens {self.max_new_tokens}).", request_id)
        if max_uncommitted is not None and new_len - self.scheduled_len > max_uncommitted:
            raise UncommittedTokensError(
                f"request {request_id!r}: appending {num_tokens} tokens would leave "
                f"{new_len - self.scheduled_len} tokens uncommitted, more than "
                f"max_num_batched_tokens={max_uncommitted}; commit (step) the chunk before "
                f"appending more.", request_id)
        return new_len

    def snapshot(self) -> tuple:
        """Comparable state (tests)."""
        return (self.row, self.prompt_len, self.max_new_tokens, list(self.host_blocks),
                list(self.page_hashes), self.published_pages, self.seq_len,
                self.scheduled_len, self.committed_len, self.released_pages,
                None if self.hot is None else {k: list(v) for k, v in self.hot.items()})


class RequestTable:
    """Live requests by id (a read-only mapping) and the free state rows."""

    def __init__(self, max_num_seqs: int, journal: Journal) -> None:
        self.max_num_seqs = max_num_seqs
        self._journal = journal
        self._by_id: dict[Hashable, Request] = {}
        self._free_rows = list(range(max_num_seqs - 1, -1, -1))  # pop() -> lowest row

    # -- mapping ---------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._by_id)

    def __contains__(self, request_id: object) -> bool:
        try:
            return request_id in self._by_id
        except TypeError:
            return False

    def __getitem__(self, request_id: Hashable) -> Request:
        return self._by_id[request_id]

    def __iter__(self) -> Iterator[Hashable]:
        return iter(self._by_id)

    def values(self):
        return self._by_id.values()

    def items(self):
        return self._by_id.items()

    def get(self, request_id: Hashable, what: str = "") -> Request:
        """The live request; ``UnknownRequestError`` (naming ``what`` was asked) otherwise."""
        try:
            return self._by_id[request_id]
        except (KeyError, TypeError):
            raise UnknownRequestError(request_id, what) from None

    @property
    def num_free_rows(self) -> int:
        return len(self._free_rows)

    def check_new(self, request_id: object) -> None:
        """``ValueError`` unless ``request_id`` can name a new request (``DuplicateRequestError``
        for a live one)."""
        check_request_id(request_id)
        if request_id in self._by_id:
            raise DuplicateRequestError(f"request {request_id!r} is already live "
                                        f"(seq_len {self._by_id[request_id].seq_len}).",
                                        request_id)

    # -- changes (journaled) ---------------------------------------------------------------
    def add(self, request_id: Hashable, prompt_len: int, max_new_tokens: int,
            host_blocks: list[int], page_hashes: list[bytes]) -> Request:
        """A new live request on the lowest free state row (the caller checked one is free)."""
        j = self._journal
        row = j.pop(self._free_rows)
        req = Request(request_id=request_id, row=row, prompt_len=prompt_len,
                      max_new_tokens=max_new_tokens, host_blocks=host_blocks,
                      page_hashes=page_hashes)
        j.setitem(self._by_id, request_id, req)
        return req

    def start_cached(self, req: Request, pages: int, block_size: int) -> None:
        """A new request starts with its first ``pages`` prompt pages present and durable
        (a prefix hit; they are published already)."""
        j, cached = self._journal, pages * block_size
        for name in ("seq_len", "scheduled_len", "committed_len"):
            j.setattr(req, name, cached)
        j.setattr(req, "published_pages", pages)

    def remove(self, req: Request) -> None:
        """Forget ``req``; its state row is free again."""
        j = self._journal
        j.replace_list(self._free_rows, sorted([*self._free_rows, req.row], reverse=True))
        j.delitem(self._by_id, req.request_id)

    def clear(self) -> None:
        self._by_id.clear()

    def schedule_mirror(self) -> list[tuple[np.ndarray, int, int, int]]:
        """Spans ``(host_array, row, start, end)`` of every request's tokens not yet in a
        mirrored plan, in table order; they are scheduled from now on."""
        spans = []
        for req in self._by_id.values():
            if req.scheduled_len != req.seq_len:
                spans.append((req.host_array, req.row, req.scheduled_len, req.seq_len))
                self._journal.setattr(req, "scheduled_len", req.seq_len)
        return spans

    # -- batches -------------------------------------------------------------------------
    def state_rows(self, request_ids: Sequence[Optional[Hashable]]) -> np.ndarray:
        """``[R] int32`` state rows (-1 for ``None`` = padding); ``DuplicateRequestError`` for
        an id named twice, ``UnknownRequestError`` for an unknown one."""
        check_id_list(request_ids)
        rows, seen = [], set()
        for request_id in request_ids:
            if request_id is None:
                rows.append(-1)
                continue
            row = self.get(request_id, "resolve").row
            if row in seen:
                raise DuplicateRequestError(f"request {request_id!r} appears twice in one "
                                            f"batch.", request_id)
            seen.add(row)
            rows.append(row)
        return np.asarray(rows, dtype=np.int32)

    # -- checks ----------------------------------------------------------------------------
    def check_invariants(self, block_size: int) -> list[str]:
        """Broken rules, as messages: rows distinct and disjoint from the free rows, lengths
        ordered, host blocks one per reserved page."""
        problems = []
        rows = [req.row for req in self._by_id.values()]
        if sorted(rows + self._free_rows) != list(range(self.max_num_seqs)):
            problems.append("requests: live and free state rows do not partition "
                            f"[0, {self.max_num_seqs})")
        for request_id, req in self._by_id.items():
            if req.request_id != request_id:
                problems.append(f"request {request_id!r} is filed as {req.request_id!r}")
            if not 0 <= req.committed_len <= req.scheduled_len <= req.seq_len \
                    <= req.reserved_tokens:
                problems.append(f"request {request_id!r}: lengths out of order (committed "
                                f"{req.committed_len}, scheduled {req.scheduled_len}, seq "
                                f"{req.seq_len}, reserved {req.reserved_tokens})")
            if req.host_array.tolist() != req.host_blocks or 0 in req.host_blocks \
                    or len(req.host_blocks) != cdiv(req.reserved_tokens, block_size):
                problems.append(f"request {request_id!r}: host blocks inconsistent")
        return problems

    def snapshot(self) -> tuple:
        """Comparable state (tests)."""
        return ({request_id: req.snapshot() for request_id, req in self._by_id.items()},
                list(self._free_rows))


__all__ = ["Request", "RequestTable", "check_id_list", "check_lengths", "check_request_id",
           "int_at_least"]
