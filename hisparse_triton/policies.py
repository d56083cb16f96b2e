"""Hot-buffer replacement policies on top-k traces: the runtime's LRU, FIFO and the offline
optimum (Belady). Pure numpy; no torch.

A *stream* is what one hot buffer sees: one (request, index group) pair, step after step.
Each step of a stream is the array of positions that step's top-k selection sends through
the buffer (valid positions whose page is not resident on the GPU), in column order; a
position that appears twice in one step counts once. Every policy starts from an empty
buffer of ``capacity`` slots and must hold all of a step's positions at once (a step never
has more distinct positions than ``capacity``: the runtime checks ``top_k <=
device_buffer_size``). A miss is a position the buffer does not hold when its step starts
(one gather).

- ``lru_misses``: exactly the runtime's rule (``reference.resolve``): the distinct misses,
  in column order of first occurrence, take the evictable slots (every slot not hit this
  step, empty slots first since they are the least recently used) oldest first; the new
  order is the unused evictable slots (old order), then the filled slots (miss order), then
  the hit slots (old order). A step with no position leaves the order untouched. On the
  same trace it gives the runtime's ``stats().misses`` exactly.
- ``fifo_misses``: evicts the slot filled longest ago among those not hit this step; hits
  change nothing.
- ``belady_misses``: the offline optimum: evicts, among the slots not hit this step, those
  whose position is used again farthest in the future (never again = infinitely far).
  No replacement policy that holds each step's positions can miss less.
"""

from __future__ import annotations

from typing import Iterable, Mapping, Sequence

import numpy as np

#: Policies ``policy_misses`` knows, in report order.
POLICIES = ("lru", "fifo", "belady")

Stream = Sequence[np.ndarray]


def step_keys(positions: np.ndarray) -> np.ndarray:
    """``[n] int64``: the distinct values of ``positions`` in order of first occurrence."""
    flat = np.asarray(positions, dtype=np.int64).ravel()
    if flat.size == 0:
        return flat
    _, first = np.unique(flat, return_index=True)
    return flat[np.sort(first)]


def _check_capacity(capacity: int) -> int:
    if isinstance(capacity, bool) or not isinstance(capacity, (int, np.integer)) \
            or capacity < 1:
        raise ValueError(f"capacity must be an int >= 1, got {capacity!r}.")
    return int(capacity)


def _check_policy(policy: str) -> None:
    if policy not in POLICIES:
        raise ValueError(f"unknown policy {policy!r}; choose from {', '.join(POLICIES)}.")


def _next_uses(steps: Sequence[np.ndarray]) -> list[np.ndarray]:
    """For every step's keys, the index of the next step using the same key (``inf`` = never),
    as ``float64`` arrays aligned with ``steps``."""
    sizes = [s.size for s in steps]
    if not sum(sizes):
        return [np.empty(0) for _ in steps]
    keys = np.concatenate(steps)
    when = np.repeat(np.arange(len(steps)), sizes)
    order = np.lexsort((when, keys))
    nxt = np.full(keys.size, np.inf)
    same = keys[order[1:]] == keys[order[:-1]]
    nxt[order[:-1][same]] = when[order[1:]][same]
    return np.split(nxt, np.cumsum(sizes)[:-1])


def stream_misses(policy: str, stream: Stream, capacity: int, *,
                  distinct: bool = False) -> np.ndarray:
    """``[steps] int64``: the misses of every step of one stream under ``policy``.

    The buffer is ``capacity`` slots, each with a priority; a step's misses replace the
    lowest-priority slots that the step does not hit (empty slots first). LRU: a priority is
    a use stamp (misses stamped in miss order, then hits in their old order); FIFO: the
    fill stamp; Belady: minus the step of the next use. ``distinct=True``: every step is
    already ``step_keys`` of itself (int64, no repeats), so it is not deduplicated again.
    """
    _check_policy(policy)
    capacity = _check_capacity(capacity)
    steps = list(stream) if distinct else [step_keys(s) for s in stream]
    out = np.zeros(len(steps), dtype=np.int64)
    top = max((int(k.max()) for k in steps if k.size), default=-1)
    low = min((int(k.min()) for k in steps if k.size), default=0)
    if low < 0:
        raise ValueError(f"positions must be >= 0, got {low}.")
    slot_of = np.full(top + 1, -1, dtype=np.int64)    # key -> slot, -1 = not held
    held = np.full(capacity, -1, dtype=np.int64)      # slot -> key, -1 = empty
    prio = np.full(capacity, -np.inf)                 # empty slots go first
    nexts = _next_uses(steps) if policy == "belady" else None
    stamp = 0
    for i, keys in enumerate(steps):
        if keys.size == 0:
            continue
        if keys.size > capacity:
            raise ValueError(f"step {i} sends {keys.size} distinct positions through a buffer "
                             f"of {capacity} slots; a step must fit the buffer (top_k <= "
                             f"device_buffer_size).")
        slots = slot_of[keys]
        hit = slots >= 0
        misses = keys[~hit]
        n = misses.size
        out[i] = n
        hit_slots = slots[hit]
        if n:
            masked = prio.copy()
            masked[hit_slots] = np.inf
            victims = np.argpartition(masked, n - 1)[:n] if n < capacity else \
                np.arange(capacity)
            old = held[victims]
            slot_of[old[old >= 0]] = -1
            held[victims] = misses
            slot_of[misses] = victims
        if policy == "lru":
            if n:
                prio[victims] = stamp + np.arange(n)
            order = np.argsort(prio[hit_slots], kind="stable")
            prio[hit_slots[order]] = stamp + n + np.arange(hit_slots.size)
            stamp += n + hit_slots.size
        elif policy == "fifo":
            if n:
                prio[victims] = stamp + np.arange(n)
            stamp += n
        else:
            nxt = -nexts[i]
            prio[slot_of[keys]] = nxt
    return out


def lru_misses(stream: Stream, capacity: int) -> int:
    """Misses of the runtime's LRU on one stream."""
    return int(stream_misses("lru", stream, capacity).sum())


def fifo_misses(stream: Stream, capacity: int) -> int:
    """Misses of FIFO on one stream."""
    return int(stream_misses("fifo", stream, capacity).sum())


def belady_misses(stream: Stream, capacity: int) -> int:
    """Misses of the offline optimum on one stream."""
    return int(stream_misses("belady", stream, capacity).sum())


def policy_misses(policy: str, streams: Iterable[Stream], capacity: int) -> int:
    """Total misses of ``policy`` (one of ``POLICIES``) over independent ``streams``."""
    _check_policy(policy)
    return sum(int(stream_misses(policy, stream, capacity).sum()) for stream in streams)


def compare_policies(streams: Mapping[object, Stream] | Sequence[Stream], capacity: int,
                     policies: Sequence[str] = POLICIES) -> dict[str, dict[str, float]]:
    """``{policy: {"misses": n, "miss_rate": n / lookups}}`` over every stream; ``lookups`` =
    the distinct positions of every step (what a buffer is asked for)."""
    for policy in policies:
        _check_policy(policy)
    values = list(streams.values()) if isinstance(streams, Mapping) else list(streams)
    values = [[step_keys(step) for step in stream] for stream in values]
    lookups = sum(step.size for stream in values for step in stream)
    out: dict[str, dict[str, float]] = {}
    for policy in policies:
        misses = sum(int(stream_misses(policy, stream, capacity, distinct=True).sum())
                     for stream in values)
        out[policy] = {"misses": misses, "miss_rate": misses / lookups if lookups else 0.0}
    return out


__all__ = ["POLICIES", "belady_misses", "compare_policies", "fifo_misses", "lru_misses",
           "policy_misses", "step_keys", "stream_misses"]
