"""The scheduler's request table: live requests by id, their state rows, id checks (no torch).

A live request owns one *state row* of the workers' per-request tables (``[0,
max_num_seqs)``, lowest free row first). ``Request`` holds what the scheduler knows about
one request besides its device blocks (each group's manager owns those, by state row): its
lengths, host blocks, prompt page hashes and residency progress. Its four lengths live in
the table's ``RequestColumns`` (numpy arrays by state row, read through properties), with
copies of the reservations and host blocks, so a decode step reads and writes them for the
whole batch at once.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from operator import attrgetter
from typing import Hashable, Iterator, NamedTuple, Optional, Sequence

import numpy as np

from hisparse_triton.errors import (
    DuplicateRequestError,
    ReservationExceededError,
    UncommittedTokensError,
    UnknownRequestError,
)
from hisparse_triton.scheduler.journal import Journal
from hisparse_triton.scheduler.plan_builder import MirrorSpans
from hisparse_triton.scheduler.prefix_cache import page_hashes
from hisparse_triton.specs import cdiv

#: ``pending_from`` of a request with nothing pending (no unverified draft, no import in
#: flight): every token it has may become durable.
NO_PENDING = int(np.iinfo(np.int64).max)


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
    if type(request_ids) in (list, tuple):
        return
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
    an emitted plan's mirror (less when a verification or an import needs positions
    mirrored again), ``planned_len`` in an emitted plan (what ``max_num_batched_tokens``
    counts from), ``committed_len`` durable on the host; ``committed_len <= scheduled_len
    <= planned_len <= seq_len <= reserved_tokens``. ``host_blocks``: one host block per
    reserved page (``host_array`` the same as int64). ``token_ids``: the ids of tokens
    ``[0, len(token_ids))`` (the prompt, then the ids appended with ``append_slots(...,
    token_ids=)``; None for a request added without ids; ``chain_open`` False once an
    append came without them: later pages are not hashed). ``page_hashes``: the chained
    hashes of the full pages of ``token_ids``; pages ``[0, published_pages)`` were
    considered for the prefix cache. ``released_pages``: resident pages ``[0, released_pages)`` left the request's
    ownership (unpinned or lost). ``hot``: hot group position -> the request's hot region
    (``None`` until it offloads; the hot managers fill it). The four lengths live in the
    table's ``RequestColumns`` (read and written like attributes).
    """

    request_id: Hashable
    row: int
    prompt_len: int
    max_new_tokens: int
    host_blocks: list[int]
    page_hashes: list[bytes] = field(default_factory=list)
    host_array: np.ndarray = field(default=None, repr=False)  # type: ignore[assignment]
    published_pages: int = 0
    hot: Optional[dict[int, list[int]]] = None
    token_ids: Optional[list[int]] = None
    chain_open: bool = True
    drafts: list[tuple[int, int]] = field(default_factory=list)
    #: Where the lengths live (``RequestTable.columns``; a row of its own if not given).
    columns: "RequestColumns" = field(default=None, repr=False)  # type: ignore[assignment]

    def __post_init__(self) -> None:
        if self.host_array is None:
            self.host_array = np.asarray(self.host_blocks, dtype=np.int64)
        if self.columns is None:
            self.columns = RequestColumns(self.row + 1)
        self._slot = self.row   # its entry of ``columns`` (the state row it was given)

    @property
    def reserved_tokens(self) -> int:
        return self.prompt_len + self.max_new_tokens

    def check_append(self, num_tokens: object, max_uncommitted: Optional[int]) -> int:
        """The length after ``num_tokens`` more tokens; ``ReservationExceededError`` past
        the reservation, ``UncommittedTokensError`` past ``max_uncommitted`` tokens since
        the last plan (``max_num_batched_tokens``; None: no limit)."""
        request_id = self.request_id
        num_tokens = int_at_least(f"request {request_id!r}: num_tokens", num_tokens, 0)
        self.check_not_importing("append to")
        new_len = self.seq_len + num_tokens
        if new_len > self.reserved_tokens:
            raise ReservationExceededError(
                f"request {request_id!r}: appending {num_tokens} tokens to {self.seq_len} "
                f"exceeds its reservation of {self.reserved_tokens} (prompt "
                f"{self.prompt_len} + max_new_tokens {self.max_new_tokens}).", request_id)
        if max_uncommitted is not None and new_len - self.planned_len > max_uncommitted:
            raise UncommittedTokensError(
                f"request {request_id!r}: appending {num_tokens} tokens would leave "
                f"{new_len - self.planned_len} tokens uncommitted, more than "
                f"max_num_batched_tokens={max_uncommitted}; commit (step) the chunk before "
                f"appending more.", request_id)
        return new_len

    def new_token_ids(self, num_tokens: int, token_ids: object) -> Optional[np.ndarray]:
        """The ids an append of ``num_tokens`` adds to ``token_ids`` (``[n] int64``; None:
        none). ``token_ids``: the appended tokens' ids (``num_tokens`` ints) or None;
        ``ValueError`` naming the request for anything else, or for ids that contradict the
        prompt's at positions it already knows."""
        if token_ids is not None:
            try:
                ids = np.asarray(token_ids)
            except (TypeError, ValueError):
                ids = np.asarray([], dtype=object)
            if ids.ndim != 1 or ids.size != num_tokens \
                    or (ids.size and not np.issubdtype(ids.dtype, np.integer)):
                raise ValueError(f"request {self.request_id!r}: token_ids must be "
                                 f"{num_tokens} ints (one per appended token), got "
                                 f"{getattr(ids, 'size', '?')} of {ids.dtype}.")
            ids = ids.astype(np.int64)
        if self.token_ids is None or not self.chain_open:
            return None
        known, start = len(self.token_ids), self.seq_len
        if start + num_tokens <= known:
            new = None
        elif token_ids is None:
            return np.zeros(0, dtype=np.int64)     # the chain ends here
        else:
            new = ids[known - start:] if known > start else ids
        if token_ids is not None and known > start:
            overlap = ids[:known - start].tolist()
            if overlap != self.token_ids[start:start + len(overlap)]:
                raise ValueError(f"request {self.request_id!r}: token_ids of positions "
                                 f"{start}..{start + len(overlap) - 1} differ from its "
                                 f"prompt's.")
        return new

    def host_rows(self, start: int, end: int, block_size: int) -> np.ndarray:
        """``[end - start] int64`` host rows of positions ``[start, end)``."""
        positions = np.arange(start, end, dtype=np.int64)
        return self.host_array[positions // block_size] * block_size + positions % block_size

    def host_row_ranges(self, start: int, end: int, block_size: int) -> list[tuple[int, int]]:
        """The host rows of positions ``[start, end)`` as ``(lo, hi)`` ranges, one per page."""
        B, out = block_size, []
        for page in range(start // B, cdiv(end, B)):
            base = self.host_blocks[page] * B
            out.append((base + max(start - page * B, 0), base + min(end - page * B, B)))
        return out

    def check_truncate(self, new_len: object) -> int:
        """``new_len`` as an int if ``truncate`` may keep that many tokens: ``ValueError``
        naming the request unless ``committed_len <= new_len <= seq_len`` (durable tokens
        may be on the host only, published or shared: they are never rolled back)."""
        new_len = int_at_least(f"request {self.request_id!r}: new_len", new_len, 0)
        self.check_not_importing("truncate")
        if new_len > self.seq_len:
            raise ValueError(f"request {self.request_id!r}: cannot truncate to {new_len} "
                             f"tokens, it has {self.seq_len}.")
        if new_len < self.committed_len:
            raise ValueError(
                f"request {self.request_id!r}: cannot truncate to {new_len} tokens: its "
                f"first {self.committed_len} are durable (committed by a step() or "
                f"commit()); roll back rejected tokens before the step that commits them, "
                f"or append them with num_draft_tokens (drafts stay undurable until "
                f"verify_drafts).")
        return new_len

    def check_not_importing(self, what: str) -> None:
        """``ValueError`` naming the request while a transport writes its prompt."""
        if self.importing:
            raise ValueError(f"request {self.request_id!r}: cannot {what} it while its "
                             f"prompt's KV is being imported (finish_import or abort_import "
                             f"first).")

    def check_drafts(self, num_tokens: int, num_draft_tokens: object) -> int:
        """``num_draft_tokens`` as an int if the last that many of an append of
        ``num_tokens`` tokens may be drafts: ``ValueError`` naming the request unless
        ``0 <= num_draft_tokens <= num_tokens`` and the drafts come after the prompt."""
        count = int_at_least(f"request {self.request_id!r}: num_draft_tokens",
                             num_draft_tokens, 0)
        if count > num_tokens:
            raise ValueError(f"request {self.request_id!r}: num_draft_tokens {count} exceeds "
                             f"the {num_tokens} tokens appended.")
        start = self.seq_len + num_tokens - count
        if count and start < self.prompt_len:
            raise ValueError(f"request {self.request_id!r}: draft tokens start at position "
                             f"{start}, inside its {self.prompt_len}-token prompt (drafts "
                             f"follow the prompt).")
        return count

    def check_verify(self, num_accepted: object) -> tuple[int, int, int]:
        """``(start, count, num_accepted)`` of the oldest pending draft run if
        ``verify_drafts`` may accept ``num_accepted`` of its drafts; ``ValueError`` naming
        the request without a pending run or unless ``0 <= num_accepted <= count``."""
        accepted = int_at_least(f"request {self.request_id!r}: num_accepted", num_accepted, 0)
        if not self.drafts:
            raise ValueError(f"request {self.request_id!r}: no draft tokens wait for "
                             f"verification (append them with num_draft_tokens).")
        start, count = self.drafts[0]
        if accepted > count:
            raise ValueError(f"request {self.request_id!r}: {accepted} drafts accepted of the "
                             f"{count} appended at positions {start}..{start + count - 1}.")
        return start, count, accepted

    def snapshot(self) -> tuple:
        """Comparable state (tests)."""
        return (self.row, self.prompt_len, self.max_new_tokens, list(self.host_blocks),
                list(self.page_hashes), self.published_pages, self.seq_len,
                self.scheduled_len, self.planned_len, self.committed_len, self.released_pages,
                None if self.hot is None else {k: list(v) for k, v in self.hot.items()},
                None if self.token_ids is None else list(self.token_ids), self.chain_open,
                list(self.drafts), self.pending_from, self.importing)


def _draft_problems(req: Request) -> list[str]:
    """Broken rules of ``req``'s pending drafts: runs ordered, disjoint, after the prompt,
    inside ``seq_len``; ``pending_from`` their first position (or the import's)."""
    end, problems = req.prompt_len, []
    for start, count in req.drafts:
        if count < 1 or start < end or start + count > req.seq_len:
            problems.append(f"request {req.request_id!r}: draft runs {req.drafts} are not "
                            f"ordered runs after its prompt inside its {req.seq_len} tokens")
            break
        end = start + count
    expected = req.drafts[0][0] if req.drafts else NO_PENDING
    if req.importing:
        if req.drafts or req.pending_from != req.committed_len:
            problems.append(f"request {req.request_id!r}: importing with drafts or pending "
                            f"from {req.pending_from}, not its {req.committed_len} cached")
    elif req.pending_from != expected:
        problems.append(f"request {req.request_id!r}: pending from {req.pending_from}, its "
                        f"drafts say {expected}")
    return problems


_ROW = attrgetter("row")


def state_rows_of(reqs: Sequence[Request]) -> np.ndarray:
    """``[len(reqs)] int64``: the requests' state rows, in order."""
    return np.fromiter(map(_ROW, reqs), dtype=np.int64, count=len(reqs))


class Batch(NamedTuple):
    """Distinct live requests named by a batch's ids (``RequestTable.batch``). Read only."""

    reqs: list[Request]         # their requests, in batch order
    rows: np.ndarray            # [R] int64 their state rows (not writeable)
    tracking: list[int]         # batch indices of the requests added with token ids


class RequestColumns:
    """The requests' per-state-row numbers, for the batch paths (decode, step) to read and
    write many at once: the lengths ``seq_len``, ``scheduled_len``, ``committed_len``,
    ``released_pages`` and the reservation ``reserved`` (``[max_num_seqs] int64``),
    ``tracks_ids`` (``bool``: added with token ids), ``pending_from`` (``int64``: the
    first position that may not become durable, ``NO_PENDING`` for none), ``importing``
    (``bool``: a transport writes the prompt) and ``host`` (``[max_num_seqs, pages]
    int32``: the host blocks, 0 past the last). A ``Request`` reads and writes its lengths
    here through properties. Entries of free rows mean nothing. Changes are journaled by
    their callers like any other state."""

    LENGTHS = ("seq_len", "scheduled_len", "planned_len", "committed_len", "released_pages")

    def __init__(self, max_num_seqs: int, host_width: int = 0) -> None:
        self.seq_len = np.zeros(max_num_seqs, dtype=np.int64)
        self.scheduled_len = np.zeros(max_num_seqs, dtype=np.int64)
        self.planned_len = np.zeros(max_num_seqs, dtype=np.int64)
        self.committed_len = np.zeros(max_num_seqs, dtype=np.int64)
        self.released_pages = np.zeros(max_num_seqs, dtype=np.int64)
        #: Scalar access as plain Python ints (``Request``'s properties).
        self.views = {name: memoryview(getattr(self, name)) for name in self.LENGTHS}
        self.reserved = np.zeros(max_num_seqs, dtype=np.int64)
        self.tracks_ids = np.zeros(max_num_seqs, dtype=bool)
        self.pending_from = np.full(max_num_seqs, NO_PENDING, dtype=np.int64)
        self.importing = np.zeros(max_num_seqs, dtype=bool)
        self.host = np.zeros((max_num_seqs, host_width), dtype=np.int32)

    def set_host_row(self, row: int, blocks: Sequence[int]) -> None:
        """State row ``row``'s host blocks (the table widens when they do not fit)."""
        width = self.host.shape[1]
        if len(blocks) > width:
            wider = np.zeros((self.host.shape[0], len(blocks)), dtype=np.int32)
            wider[:, :width] = self.host
            self.host = wider
        self.host[row, :len(blocks)] = blocks
        self.host[row, len(blocks):] = 0


def _length(name: str) -> property:
    """A ``Request`` length kept in ``columns`` (its state row's entry)."""
    def get(req: Request) -> int:
        return req.columns.views[name][req._slot]

    def put(req: Request, value: int) -> None:
        req.columns.views[name][req._slot] = value
    return property(get, put, doc=f"The request's ``{name}`` (``RequestColumns``).")


for _name in RequestColumns.LENGTHS:
    setattr(Request, _name, _length(_name))
Request.pending_from = property(   # type: ignore[attr-defined]
    lambda req: int(req.columns.pending_from[req._slot]),
    doc="The first position that may not become durable (``RequestColumns``).")
Request.importing = property(   # type: ignore[attr-defined]
    lambda req: bool(req.columns.importing[req._slot]),
    doc="Whether a transport is writing the prompt (``RequestColumns``).")


class RequestTable:
    """Live requests by id (a read-only mapping) and the free state rows."""

    def __init__(self, max_num_seqs: int, journal: Journal, host_width: int = 0) -> None:
        self.max_num_seqs = max_num_seqs
        self._journal = journal
        self._by_id: dict[Hashable, Request] = {}
        #: The live requests' lengths, reservations and host blocks by state row.
        self.columns = RequestColumns(max_num_seqs, host_width)
        self._order: Optional[tuple[list[Request], np.ndarray]] = None   # in_order()
        self._tracking: Optional[tuple[Optional[np.ndarray]]] = None   # tracking_in_order()
        self._free_rows = list(range(max_num_seqs - 1, -1, -1))  # pop() -> lowest row
        #: Live requests whose prompt a transport is writing (``importing``).
        self.num_importing = 0

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

    def in_order(self) -> tuple[list[Request], np.ndarray]:
        """The live requests in table order (oldest first) and their ``[n] int64`` state
        rows (kept until a request comes or goes; do not change them)."""
        if self._order is None:
            reqs = list(self._by_id.values())
            rows = state_rows_of(reqs)
            rows.flags.writeable = False
            self._order = (reqs, rows)
        return self._order

    def _reorder(self) -> None:
        """A request came or went: ``in_order`` is built anew (after an undo too)."""
        self._forget_order()
        self._journal.record(self._forget_order)

    def _forget_order(self) -> None:
        self._order = self._tracking = None

    def tracking_in_order(self) -> Optional[np.ndarray]:
        """``[n] bool``: which of the ``in_order`` requests were added with token ids; None
        when none was (kept like ``in_order``; do not change it)."""
        if self._tracking is None:
            tracks = self.columns.tracks_ids[self.in_order()[1]]
            self._tracking = (tracks if np.count_nonzero(tracks) else None,)
        return self._tracking[0]

    def lookup(self, request_ids: Sequence[Hashable]) -> Optional[list[Request]]:
        """The live requests of hashable ``request_ids``, in order; None when one is not
        live (``get`` names it)."""
        reqs = list(map(self._by_id.get, request_ids))
        return None if None in reqs else reqs

    def batch(self, request_ids: Sequence[Hashable]) -> Optional[Batch]:
        """The ``Batch`` of ``request_ids`` (a list or tuple) when they are distinct, hashable
        and live, else None."""
        try:
            if len(set(request_ids)) != len(request_ids):
                return None
        except TypeError:
            return None
        reqs = self.lookup(request_ids)
        if reqs is None:
            return None
        rows = state_rows_of(reqs)
        rows.flags.writeable = False
        return Batch(reqs, rows, self.columns.tracks_ids[rows].nonzero()[0].tolist())

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
            host_blocks: list[int], page_hashes: list[bytes],
            token_ids: Optional[Sequence[int]] = None) -> Request:
        """A new live request on the lowest free state row (the caller checked one is free)."""
        j, cols = self._journal, self.columns
        row = j.pop(self._free_rows)
        for name in RequestColumns.LENGTHS:
            j.write(getattr(cols, name), row, 0)
        j.write(cols.reserved, row, prompt_len + max_new_tokens)
        j.write(cols.tracks_ids, row, token_ids is not None)
        j.write(cols.pending_from, row, NO_PENDING)
        j.write(cols.importing, row, False)
        old_host = cols.host[row].tolist()
        cols.set_host_row(row, host_blocks)
        j.record(lambda: cols.set_host_row(row, old_host))
        req = Request(request_id=request_id, row=row, prompt_len=prompt_len,
                      max_new_tokens=max_new_tokens, host_blocks=host_blocks,
                      page_hashes=list(page_hashes),
                      token_ids=(None if token_ids is None
                                 else np.asarray(token_ids, dtype=np.int64).tolist()),
                      columns=cols)
        j.setitem(self._by_id, request_id, req)
        self._reorder()
        return req

    def start_cached(self, req: Request, pages: int, block_size: int) -> None:
        """A new request starts with its first ``pages`` prompt pages present and durable
        (a prefix hit; they are published already)."""
        j, cached = self._journal, pages * block_size
        for name in ("seq_len", "scheduled_len", "planned_len", "committed_len"):
            j.setattr(req, name, cached)
        j.setattr(req, "published_pages", pages)

    def extend_tokens(self, req: Request, ids: Optional[np.ndarray], block_size: int) -> None:
        """Record the ids ``new_token_ids`` returned for an append (an empty array closes
        the chain) and hash the pages they complete."""
        if ids is None:
            return
        j = self._journal
        if not ids.size:
            j.setattr(req, "chain_open", False)
            return
        tokens, hashes = req.token_ids, req.page_hashes
        assert tokens is not None
        known, pages = len(tokens), len(hashes)
        tokens.extend(ids.tolist())
        j.record(lambda: tokens.__delitem__(slice(known, None)))
        if len(tokens) // block_size > pages:
            hashes.extend(page_hashes(np.asarray(tokens, dtype=np.int64), block_size,
                                      pages, hashes[-1] if hashes else b""))
            j.record(lambda: hashes.__delitem__(slice(pages, None)))

    def set_seq_lens(self, rows: np.ndarray, seq_lens: np.ndarray) -> None:
        """The requests of state rows ``rows`` (distinct) get ``seq_lens`` (a decode step)."""
        self._journal.write(self.columns.seq_len, rows, seq_lens)

    def truncate(self, req: Request, new_len: int, block_size: int) -> None:
        """``req`` keeps its first ``new_len`` tokens (``check_truncate`` passed): its
        lengths, its pending drafts (those past the end dropped), and the ids and page
        hashes of tokens past the end (the prompt's ids stay: they are known)."""
        j = self._journal
        j.setattr(req, "seq_len", new_len)
        j.setattr(req, "scheduled_len", min(req.scheduled_len, new_len))
        j.setattr(req, "planned_len", min(req.planned_len, new_len))
        if req.drafts:
            self._set_drafts(req, [(start, min(count, new_len - start))
                                   for start, count in req.drafts if start < new_len])
        if req.token_ids is not None:
            keep = max(new_len, req.prompt_len)
            if len(req.token_ids) > keep:
                j.setattr(req, "token_ids", req.token_ids[:keep])
            if len(req.token_ids) >= new_len:
                j.setattr(req, "chain_open", True)
            if len(req.page_hashes) > len(req.token_ids) // block_size:
                j.setattr(req, "page_hashes",
                          req.page_hashes[:len(req.token_ids) // block_size])

    # -- drafts ----------------------------------------------------------------------------
    def _set_drafts(self, req: Request, runs: list[tuple[int, int]]) -> None:
        """``req``'s pending draft runs become ``runs`` (oldest first), ``pending_from``
        their first position."""
        self._journal.setattr(req, "drafts", runs)
        first = runs[0][0] if runs else NO_PENDING
        if req.pending_from != first:
            self._journal.write(self.columns.pending_from, req.row, first)

    def mark_drafts(self, req: Request, count: int) -> None:
        """The last ``count`` tokens of ``req`` (just appended) are drafts."""
        if count:
            self._set_drafts(req, [*req.drafts, (req.seq_len - count, count)])

    def verify(self, req: Request, num_accepted: int, block_size: int) -> None:
        """The oldest pending run of ``req`` was verified (``check_verify`` passed):
        ``num_accepted`` of its drafts stay, the rest leave the sequence and every later
        token moves down by their count (its KV was written at the moved position: the
        stack corrects the positions of steps scheduled before the verification). Tokens
        from the first rejected position on are mirrored again (``scheduled_len``); their ids
        and the page hashes from that position's page on are spliced and hashed again."""
        (start, count), *later = req.drafts
        first, rejected = start + num_accepted, count - num_accepted
        self._set_drafts(req, [(s - rejected, c) for s, c in later])
        if not rejected:
            return
        j = self._journal
        new_len = req.seq_len - rejected
        j.setattr(req, "seq_len", new_len)
        j.setattr(req, "scheduled_len", min(req.scheduled_len, first))
        # Planned tokens past the rejected ones moved down with them (still planned).
        j.setattr(req, "planned_len", req.planned_len - min(max(req.planned_len - first, 0),
                                                            rejected))
        tokens = req.token_ids
        if tokens is not None and len(tokens) > first:
            tokens = tokens[:first] + tokens[first + rejected:]
            j.setattr(req, "token_ids", tokens)
            pages = first // block_size
            hashes = req.page_hashes[:pages]
            hashes += page_hashes(np.asarray(tokens, dtype=np.int64), block_size, pages,
                                  hashes[-1] if hashes else b"")
            j.setattr(req, "page_hashes", hashes)
            if len(tokens) >= new_len:
                j.setattr(req, "chain_open", True)

    # -- imports ---------------------------------------------------------------------------
    def start_import(self, req: Request, length: int, durable: int) -> None:
        """``req`` holds ``length`` tokens whose bytes a transport writes; the first
        ``durable`` (a cached prefix) are durable, nothing else may become durable or be
        mirrored until ``finish_import``."""
        j, cols = self._journal, self.columns
        j.setattr(req, "seq_len", length)
        j.setattr(req, "scheduled_len", length)
        j.setattr(req, "planned_len", length)
        j.write(cols.pending_from, req.row, durable)
        j.write(cols.importing, req.row, True)
        j.setattr(self, "num_importing", self.num_importing + 1)

    def finish_import(self, req: Request, durable: int) -> None:
        """The transport wrote every byte: tokens ``[0, durable)`` (on the host) are
        durable, the rest (on the device) are mirrored with the next plan."""
        j, cols = self._journal, self.columns
        j.setattr(req, "committed_len", durable)
        j.setattr(req, "scheduled_len", durable)
        j.write(cols.pending_from, req.row, NO_PENDING)
        j.write(cols.importing, req.row, False)
        j.setattr(self, "num_importing", self.num_importing - 1)

    def remove(self, req: Request) -> None:
        """Forget ``req``; its state row is free again."""
        j = self._journal
        if req.importing:
            j.write(self.columns.importing, req.row, False)
            j.setattr(self, "num_importing", self.num_importing - 1)
        j.replace_list(self._free_rows, sorted([*self._free_rows, req.row], reverse=True))
        j.delitem(self._by_id, req.request_id)
        self._reorder()

    def clear(self) -> None:
        self._by_id.clear()
        self.num_importing = 0
        self.columns.importing[:] = False
        self._forget_order()

    def schedule_mirror(self, block_size: int) -> MirrorSpans:
        """Every request's tokens not yet in a mirrored plan, in table order (the one-token
        spans with their host rows); they are scheduled from now on."""
        reqs, rows = self.in_order()
        cols, B = self.columns, block_size
        start, end = cols.scheduled_len[rows], cols.seq_len[rows]
        count = end - start
        if np.count_nonzero(count == 1) == len(reqs):   # the decode step: one token each
            rows_1, start_1, spans = rows, start, []
        else:
            if not np.count_nonzero(count):
                return MirrorSpans()
            single = count == 1
            rows_1, start_1 = rows[single], start[single]
            spans = [(reqs[i].host_array, reqs[i].row, int(start[i]), int(end[i]))
                     for i in (count > 1).nonzero()[0].tolist()]
        page = start_1 // B
        host = cols.host   # [max_num_seqs, pages] int32, C-contiguous: one flat gather
        single_host = host.reshape(-1)[rows_1 * host.shape[1] + page].astype(np.int64)
        single_host -= page   # host[row, page] * B + start % B, as (block - page) * B + start
        single_host *= B
        single_host += start_1
        work = MirrorSpans(spans=spans, single_rows=rows_1, single_positions=start_1,
                           single_host=single_host)
        self._journal.write(cols.scheduled_len, rows, end)   # the unmoved keep theirs
        self._journal.write(cols.planned_len, rows, end)
        return work

    # -- batches -------------------------------------------------------------------------
    def decode_token_ids(self, request_ids: Sequence[Hashable],
                         token_ids: Optional[Sequence[int]]) -> list[Optional[list[int]]]:
        """``append_decode``'s ``token_ids`` (one int per request, or None) as one
        ``append_slots`` argument per request; ``ValueError`` for another length."""
        if token_ids is None:
            return [None] * len(request_ids)
        if isinstance(token_ids, (str, bytes)) or len(token_ids) != len(request_ids):
            raise ValueError(f"append_decode: token_ids must hold one id per request "
                             f"({len(request_ids)}), got {token_ids!r}.")
        return [[t] for t in token_ids]

    def state_rows(self, request_ids: Sequence[Optional[Hashable]]) -> np.ndarray:
        """``[R] int32`` state rows (-1 for ``None`` = padding); ``DuplicateRequestError`` for
        an id named twice, ``UnknownRequestError`` for an unknown one."""
        check_id_list(request_ids)
        rows, seen = [], set()
        importing = self.num_importing > 0   # none in the common case: no per-row read
        for request_id in request_ids:
            if request_id is None:
                rows.append(-1)
                continue
            req = self.get(request_id, "resolve")
            if importing:
                req.check_not_importing("resolve")
            row = req.row
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
            if not 0 <= req.committed_len <= min(req.scheduled_len, req.pending_from) \
                    or not req.scheduled_len <= req.planned_len <= req.seq_len \
                    <= req.reserved_tokens:
                problems.append(f"request {request_id!r}: lengths out of order (committed "
                                f"{req.committed_len}, scheduled {req.scheduled_len}, "
                                f"planned {req.planned_len}, "
                                f"pending from {req.pending_from}, seq {req.seq_len}, reserved "
                                f"{req.reserved_tokens})")
            problems += _draft_problems(req)
            if req.host_array.tolist() != req.host_blocks or 0 in req.host_blocks \
                    or len(req.host_blocks) != cdiv(req.reserved_tokens, block_size):
                problems.append(f"request {request_id!r}: host blocks inconsistent")
            problems += self._column_problems(req)
        return problems + self.importing_problems()

    def importing_problems(self) -> list[str]:
        """Whether ``num_importing`` counts the live requests marked importing."""
        marked = sum(req.importing for req in self._by_id.values())
        if marked != self.num_importing or \
                int(np.count_nonzero(self.columns.importing)) != marked:
            return [f"requests: {marked} importing, counted {self.num_importing}"]
        return []

    def _column_problems(self, req: Request) -> list[str]:
        """Whether ``req``'s entries of ``columns`` (but its lengths) say what it holds."""
        cols, row = self.columns, req.row
        host = cols.host[row]
        if req.columns is not cols or req._slot != row \
                or int(cols.reserved[row]) != req.reserved_tokens \
                or bool(cols.tracks_ids[row]) != (req.token_ids is not None) \
                or host[:len(req.host_blocks)].tolist() != req.host_blocks \
                or host[len(req.host_blocks):].any():
            return [f"request {req.request_id!r}: its columns (reservation, token ids, host "
                    f"blocks) disagree with it"]
        return []

    def snapshot(self) -> tuple:
        """Comparable state (tests)."""
        return ({request_id: req.snapshot() for request_id, req in self._by_id.items()},
                list(self._free_rows))


__all__ = ["NO_PENDING", "Batch", "Request", "RequestTable", "check_id_list", "check_lengths", "check_request_id",
           "int_at_least", "state_rows_of"]
