"""Exception types of the HiSparse runtime.

Every error the runtime raises for a caller's mistake or a full pool is a ``HiSparseError``,
so a serving loop can catch them all in one place; each also derives from the builtin class
a Python programmer would expect (``ValueError``, ``LookupError``, ``MemoryError``,
``RuntimeError``, ``OSError``, ``ImportError``). Messages name the request and the numbers involved. A call that raises
leaves the runtime exactly as it was before the call.
"""

from __future__ import annotations

from typing import Hashable, Optional


class HiSparseError(Exception):
    """Base class of every error raised by hisparse-triton's runtime."""


class CapacityError(HiSparseError, MemoryError):
    """A pool (host blocks, device blocks, request state rows, host RAM) cannot hold a request.

    Attributes: ``resource`` (what ran out), ``needed`` and ``available`` (in that resource's
    unit), ``request_id`` (``None`` when not about one request).
    """

    def __init__(self, message: str, *, resource: str = "", needed: int = 0,
                 available: int = 0, request_id: Optional[Hashable] = None) -> None:
        super().__init__(message)
        self.resource = resource
        self.needed = needed
        self.available = available
        self.request_id = request_id


class HostMemoryError(CapacityError):
    """The machine has too little available RAM for the requested host pool."""


class UnknownRequestError(HiSparseError, LookupError):
    """A call named a request id that was never added or was already freed."""

    def __init__(self, request_id: Hashable, what: str = "") -> None:
        suffix = f" ({what})" if what else ""
        super().__init__(f"unknown request {request_id!r}{suffix}: it was never added with "
                         f"add_request() or it was already freed.")
        self.request_id = request_id

    def __str__(self) -> str:  # LookupError subclasses would otherwise repr() the message
        return str(self.args[0])


class DuplicateRequestError(HiSparseError, ValueError):
    """``add_request`` with an id that is live, or one id twice in one batch."""

    def __init__(self, message: str, request_id: Hashable) -> None:
        super().__init__(message)
        self.request_id = request_id


class ReservationExceededError(HiSparseError, ValueError):
    """``append_slots`` past the ``prompt_len + max_new_tokens`` reserved at admission."""

    def __init__(self, message: str, request_id: Hashable) -> None:
        super().__init__(message)
        self.request_id = request_id


class BlockPoolError(HiSparseError, ValueError):
    """A block allocator misuse: double free, the null block, an id outside the pool."""


class SchedulerStateError(HiSparseError, AssertionError):
    """The scheduler's bookkeeping broke one of its own rules (``check_invariants``): a bug
    or state changed behind the scheduler's back, never a caller's mistake."""


class SharedHostPoolError(HiSparseError, OSError):
    """A shared host pool cannot be created (its file exists, no permission) or attached
    (its file is missing, a symbolic link, not accessible, of another size or plan
    fingerprint, or stale), or a stale-pool cleanup was refused. Attribute: ``path`` (the
    pool's backing file)."""

    def __init__(self, message: str, path: str = "") -> None:
        super().__init__(message)
        self.path = path

    def __str__(self) -> str:  # OSError would otherwise format the args tuple
        return str(self.args[0])


class RuntimeClosedError(HiSparseError, RuntimeError):
    """A call on a ``HiSparseRuntime`` (or pool) after ``close()``."""


class UncommittedTokensError(ReservationExceededError):
    """``append_slots`` would leave more tokens uncommitted than ``max_num_batched_tokens``
    (chunked prefill: commit the chunk before appending the next one)."""


class UnsupportedVersionError(HiSparseError, ImportError):
    """The installed torch or Triton is outside the supported range (``hisparse_triton.compat``).
    Attributes: ``package``, ``found`` (its version, ``None`` when missing), ``supported``."""

    def __init__(self, message: str, package: str, found: Optional[str],
                 supported: str) -> None:
        super().__init__(message)
        self.package = package
        self.found = found
        self.supported = supported

    def __str__(self) -> str:  # ImportError would otherwise show only the message arg anyway
        return str(self.args[0])


class ReadOnlyViewError(HiSparseError, RuntimeError):
    """A write to a read-only view: an attached rank's view of a shared host pool (only the
    creating rank writes the pool)."""


class PrefillStagingError(CapacityError):
    """A prefill chunk references more distinct host-only rows than its staging rows hold
    (``resolve_prefill``): a reserved region too small, blocks lent for fewer rows, or the
    free device blocks cannot lend the rows the chunk's bound needs
    (``HiSparseScheduler.borrow_prefill_staging``). ``needed``: the chunk's distinct
    host-only rows (or its bound); ``available``: the staging rows there are (or could be
    lent)."""
