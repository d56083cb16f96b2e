"""``ResolveWorkspace``: every buffer a ``resolve`` call needs, allocated once and reused;
``restore_resolve_state``: undo the last call made with one.

A decode step resolves every index group; allocating the outputs and the scratch tables of
each call costs host time (one allocation and one view per buffer) and, inside a CUDA graph,
fixed addresses matter. A workspace holds, per call shape ``(R rows, K columns, H slots)``:

- the miss plan and counts the call returns: ``miss_src``, ``miss_dst`` ``[R, K] int32``,
  ``miss_count [R] int32``, ``stats [R, 3] int32`` (and ``rows [R, K] int32`` when the call
  gets no ``out=``);
- the pre-call hot state of every resolved row, for ``restore_resolve_state``:
  ``old_slot_rows`` / ``old_lru`` ``[R, H] int32`` (the state rows' ``slot_host_rows`` and
  ``lru`` as they were) and ``touched [R] int32`` (1 = the call resolved this batch row and
  may have changed its state row; 0 = padding or a repeated state row);
- the kernel's scratch tables (sort keys, slot owners, run winners, miss numbering) and the
  hash kernel's per-row table (``table [R, hash_table_words]``, allocated clean,
  ``INT32_MIN`` in every word, and left clean by every call: each call resets the words it
  used) and its ``fallback [R] int32`` flags (the rows its fallback launch resolves).

Results that live in the workspace are valid until the next call with the same workspace
(every call overwrites them); keep ``rows`` in a caller-owned ``out=`` tensor when they must
outlive it. Buffers grow lazily: a call with a larger shape reallocates (this allocates, so
size the workspace up front, or make one call of each shape, before capturing a CUDA graph);
the views of each shape are built once and cached, so a repeated call allocates nothing and
builds no views.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

__all__ = ["HASH_BUCKET_SLOTS", "HASH_MAX_SLOTS", "HASH_MAX_WIDTH", "ResolveBuffers",
           "ResolveWorkspace", "hash_buckets", "hash_table_words", "restore_resolve_state",
           "scratch_width"]

_ALIGN = 16  # elements: every view starts 64-byte aligned (Triton specialises on 16 bytes)


#: Widest top-k and most hot slots the hash kernel (``kernels/resolve_hash.py``) takes.
HASH_MAX_WIDTH = 2048
HASH_MAX_SLOTS = 4096
#: Key slots per bucket of the hash table (``kernels/resolve_hash.PROBES``): the most keys a
#: bucket holds, and the probes of every lookup.
HASH_BUCKET_SLOTS = 8
#: Buckets per (power-of-two rounded) top-k column: load <= 1 / (2 x 8) = 1/16 per slot.
HASH_BUCKETS_PER_COLUMN = 2
#: A clean hash-table word (``kernels/resolve_hash.py``: every call leaves its words so).
HASH_EMPTY = -(2**31)


def hash_buckets(top_k: int) -> int:
    """Buckets ``NB`` of the per-row hash table at a top-k width (a power of two)."""
    return HASH_BUCKETS_PER_COLUMN * scratch_width(top_k)


def hash_table_words(top_k: int, slots: int) -> int:
    """int32 words of the per-row hash table of a call shape (per bucket ``HASH_BUCKET_SLOTS``
    keys and as many aux words, then one counter per bucket), 0 when the shape is not the
    hash kernel's."""
    if top_k > HASH_MAX_WIDTH or slots > HASH_MAX_SLOTS:
        return 0
    return (2 * HASH_BUCKET_SLOTS + 1) * hash_buckets(top_k)


def scratch_width(top_k: int) -> int:
    """Columns of the per-row key scratch: ``top_k`` rounded up to a power of two (>= 16)."""
    return 1 << max(4, (top_k - 1).bit_length())


class ResolveBuffers(NamedTuple):
    """The buffers of one call shape ``(R, K, H)`` (``W = scratch_width(K)``)."""

    rows: torch.Tensor           # [R, K] int32: device rows (when the call has no ``out``)
    miss_src: torch.Tensor       # [R, K] int32
    miss_dst: torch.Tensor       # [R, K] int32
    miss_count: torch.Tensor     # [R] int32
    stats: torch.Tensor          # [R, 3] int32
    touched: torch.Tensor        # [R] int32
    old_slot_rows: torch.Tensor  # [R, H] int32
    old_lru: torch.Tensor        # [R, H] int32
    owner: torch.Tensor          # [R, H] int32 scratch: first LRU position naming each slot
    cls: torch.Tensor            # [R, H] int32 scratch: class of each LRU position
    run_pos: torch.Tensor        # [R, W] int32 scratch: serving LRU position per key run
    colbuf: torch.Tensor         # [R, W] int32 scratch: miss numbering in column order
    colm: torch.Tensor           # [R, W] int32 scratch: miss number per column
    fallback: torch.Tensor       # [R] int32: 1 = the hash kernel left the row to its fallback
    keys: torch.Tensor           # [R, W] int64 scratch: sorted keys
    keys2: torch.Tensor          # [R, W] int64 scratch: merge buffer (wide top-k)
    table: torch.Tensor          # [R, hash_table_words] int32 hash table (kept clean)


_INT32_FIELDS = ("rows", "miss_src", "miss_dst", "miss_count", "stats", "touched",
                 "old_slot_rows", "old_lru", "owner", "cls", "run_pos", "colbuf", "colm",
                 "fallback")
_INT64_FIELDS = ("keys", "keys2")


def _shapes(R: int, K: int, H: int) -> dict[str, tuple[int, ...]]:
    W = scratch_width(K)
    return {"rows": (R, K), "miss_src": (R, K), "miss_dst": (R, K), "miss_count": (R,),
            "stats": (R, 3), "touched": (R,), "old_slot_rows": (R, H), "old_lru": (R, H),
            "owner": (R, H), "cls": (R, H), "run_pos": (R, W), "colbuf": (R, W),
            "colm": (R, W), "fallback": (R,), "keys": (R, W), "keys2": (R, W),
            "table": (R, hash_table_words(K, H))}


def _size(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return -(-n // _ALIGN) * _ALIGN


def _carve(buf: torch.Tensor, names: tuple[str, ...], shapes: dict) -> dict[str, torch.Tensor]:
    out, start = {}, 0
    for name in names:
        shape = shapes[name]
        n = 1
        for s in shape:
            n *= s
        out[name] = buf[start:start + n].view(shape)
        start += _size(shape)
    return out


def _need(R: int, K: int, H: int) -> tuple[int, int]:
    shapes = _shapes(R, K, H)
    return (sum(_size(shapes[n]) for n in _INT32_FIELDS),
            sum(_size(shapes[n]) for n in _INT64_FIELDS))


def _check_shape(R: int, K: int, H: int) -> None:
    for name, value, low in (("rows", R, 0), ("width", K, 1), ("slots", H, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"ResolveWorkspace: {name} must be an int >= {low}, got {value!r}")


def _normalise(device: torch.device) -> torch.device:
    """``cuda`` -> ``cuda:<current>`` (tensors always carry an index; compare like them)."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


class ResolveWorkspace:
    """Reusable outputs and scratch of ``resolve`` on one device (see the module docstring).

    ``ResolveWorkspace(device)`` grows on demand; ``ResolveWorkspace(device, max_rows, width,
    slots)`` allocates up front for calls of up to ``max_rows`` rows of ``width`` top-k
    columns against ``slots`` hot slots per request. Not thread-safe: one caller at a time.
    """

    def __init__(self, device: torch.device | str, max_rows: int = 0, width: int = 0,
                 slots: int = 0):
        self.device = _normalise(torch.device(device))
        self._i32 = torch.empty(0, dtype=torch.int32, device=self.device)
        self._i64 = torch.empty(0, dtype=torch.int64, device=self.device)
        self._table = torch.empty(0, dtype=torch.int32, device=self.device)
        self._views: dict[tuple[int, int, int], ResolveBuffers] = {}
        #: The buffers of the most recent call (what ``restore_resolve_state`` reads).
        self.last: Optional[ResolveBuffers] = None
        if max_rows or width or slots:
            self.reserve(max_rows, width, slots)

    def reserve(self, max_rows: int, width: int, slots: int) -> None:
        """Grow the buffers to fit calls of up to ``max_rows x width`` against ``slots``."""
        _check_shape(max_rows, width, slots)
        n32, n64 = _need(max_rows, width, slots)
        nt = _size(_shapes(max_rows, width, slots)["table"])
        if nt > self._table.numel():
            with torch.inference_mode(False):  # (see below) filled clean: kernels keep it so
                self._table = torch.full((nt,), HASH_EMPTY, dtype=torch.int32,
                                         device=self.device)
            self._views.clear()
            self.last = None
        if n32 > self._i32.numel() or n64 > self._i64.numel():
            # Ordinary tensors even inside inference mode: later calls write them in place
            # from either mode.
            with torch.inference_mode(False):
                self._i32 = torch.empty(max(n32, self._i32.numel()), dtype=torch.int32,
                                        device=self.device)
                self._i64 = torch.empty(max(n64, self._i64.numel()), dtype=torch.int64,
                                        device=self.device)
            self._views.clear()  # old views point at the old buffers
            self.last = None

    def buffers(self, rows: int, width: int, slots: int) -> ResolveBuffers:
        """The views of one call shape (cached; grows the buffers first when needed)."""
        views = self._views.get((rows, width, slots))
        if views is None:
            self.reserve(rows, width, slots)
            shapes = _shapes(rows, width, slots)
            views = ResolveBuffers(**_carve(self._i32, _INT32_FIELDS, shapes),
                                   **_carve(self._i64, _INT64_FIELDS, shapes),
                                   **_carve(self._table, ("table",), shapes))
            self._views[(rows, width, slots)] = views
        return views

    @staticmethod
    def allocate(rows: int, width: int, slots: int, device: torch.device) -> ResolveBuffers:
        """One-off buffers (a call without a workspace): the returned outputs are separate
        tensors (they never alias each other), the scratch is carved from one allocation; the
        hash table is not cleared (the kernel launched on it clears it first)."""
        _check_shape(rows, width, slots)
        shapes = _shapes(rows, width, slots)
        scratch = _INT32_FIELDS[5:]
        i32 = torch.empty(sum(_size(shapes[n]) for n in scratch), dtype=torch.int32,
                          device=device)
        i64 = torch.empty(sum(_size(shapes[n]) for n in _INT64_FIELDS), dtype=torch.int64,
                          device=device)
        outputs = {name: torch.empty(shapes[name], dtype=torch.int32, device=device)
                   for name in _INT32_FIELDS[:5]}
        # not filled: the hash kernel clears a one-off table itself (no extra launch)
        table = torch.empty(shapes["table"], dtype=torch.int32, device=device)
        return ResolveBuffers(**outputs, **_carve(i32, scratch, shapes),
                              **_carve(i64, _INT64_FIELDS, shapes), table=table)

    def __repr__(self) -> str:
        return (f"ResolveWorkspace(device={self.device}, int32={self._i32.numel()}, "
                f"int64={self._i64.numel()}, table={self._table.numel()}, "
                f"shapes={sorted(self._views)})")


def restore_resolve_state(workspace: ResolveWorkspace, state_rows: torch.Tensor,
                          slot_host_rows: torch.Tensor, lru: torch.Tensor) -> None:
    """Undo the last ``resolve`` made with ``workspace``: write back the ``slot_host_rows``
    and ``lru`` rows it saved for every batch row it resolved (the failure path, e.g. when
    the gather that follows a resolve raised). ``state_rows``: the ``[R] int32`` the call got;
    ``slot_host_rows`` / ``lru``: its ``[S, H]`` state tensors. Torch ops (a device sync on
    CUDA); raises ``ValueError`` when the workspace holds no call of that shape."""
    bufs = workspace.last if isinstance(workspace, ResolveWorkspace) else None
    if bufs is None:
        raise ValueError("restore_resolve_state: the workspace holds no resolve call to undo "
                         "(pass the workspace the call used, before any other call with it).")
    R, H = bufs.old_lru.shape
    if not isinstance(state_rows, torch.Tensor) or tuple(state_rows.shape) != (R,):
        raise ValueError(f"restore_resolve_state: state_rows must be the [{R}] tensor of the "
                         f"last call, got shape {tuple(getattr(state_rows, 'shape', ()))}.")
    for name, t in (("slot_host_rows", slot_host_rows), ("lru", lru)):
        if not isinstance(t, torch.Tensor) or t.dim() != 2 or t.shape[1] != H \
                or t.dtype != torch.int32:
            raise ValueError(f"restore_resolve_state: {name} must be int32 [S, {H}], got "
                             f"{getattr(t, 'dtype', type(t).__name__)} of shape "
                             f"{tuple(getattr(t, 'shape', ()))}.")
    touched = bufs.touched.to(torch.bool)
    rows = state_rows.to(torch.int64)[touched]
    if rows.numel() and (int(rows.min()) < 0 or int(rows.max()) >= lru.shape[0]):
        raise ValueError("restore_resolve_state: state_rows are not those of the last call.")
    slot_host_rows[rows] = bufs.old_slot_rows[touched]
    lru[rows] = bufs.old_lru[touched]
