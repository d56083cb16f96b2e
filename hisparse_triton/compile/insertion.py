"""How the hash resolve's table fills on DeepSeek-V3.2-like rows: a simulation (no GPU).

The cost model (``sass_model``) needs the trip counts of the hash resolve's data-dependent
work, and a launch waits for its *slowest* row. This module simulates, on the host rows of
realistic top-k selections, the two insertion schemes the hash kernel has had:

- ``linear``: the earlier kernel (until issue 35): every pending column ``atomic_cas``-es its
  probe index, ``T = 16 x`` the top-k width (load <= 1/16), linear probing, one probe per
  round; a row needs as many rounds as its slowest key (and its lookups as many probes).
  ``linear_rounds`` replays the parallel rounds exactly (per round the compare-and-swaps of
  one entry are serialised in a random order: the first sets the entry, an equal key joins
  it, any other moves on).
- ``bucket``: the kernel now (``kernels/resolve_hash.py``): ``2 x`` the top-k width buckets of
  ``PROBES`` (8) slots; a column takes a slot of its bucket with one ``atomic_add`` (one
  round, whatever the keys), a lookup scans the bucket's slots. A row overflows (and is
  resolved by the fallback launch) when a bucket receives more than ``PROBES`` keys;
  ``bucket_load`` gives the fullest bucket of a row.

Keys (``topk_host_rows``): ``deepseek`` (the default): a context of 8K-128K tokens; the top-k
(2,048 positions) is the last 128 tokens, the first 16 and clusters of mean 16 tokens at
uniform places until 2,048 distinct positions; pages of 64 tokens on host blocks drawn
without replacement from a 1M-block pool. ``contiguous``: the same positions, each request's
pages on consecutive host blocks. ``random``: 2,048 distinct host rows uniform in 64M (the
worst of the three for a multiplicative hash, which spreads runs of rows evenly).

Per key kind it reports the per-row distribution, the distribution of the maximum over a
batch (what a launch of ``batch`` rows waits for) and, for ``bucket``, the probability that a
row or a batch overflows; also the table bytes allocated and 32-byte sectors touched per row
by each layout (``table_bytes``: the L2 footprint of one call).

    python -m hisparse_triton.compile.insertion [--batches 40] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, Optional

import numpy as np

__all__ = ["KEY_KINDS", "bucket_load", "linear_rounds", "simulate", "table_bytes",
           "topk_host_rows"]

#: The hash multiplier of both schemes (Knuth's 2**32 / golden ratio).
HASH_MUL = 0x9E3779B1
KEY_KINDS = ("deepseek", "contiguous", "random")
_BLOCK = 64
_POOL_BLOCKS = 1_000_000
_SECTOR = 32


def _hash(keys: np.ndarray, log2: int, mul: int = HASH_MUL) -> np.ndarray:
    """The top ``log2`` bits of ``key * mul mod 2**32`` (the kernels' hash)."""
    x = (keys.astype(np.uint64) * np.uint64(mul)) & np.uint64(0xFFFFFFFF)
    return (x >> np.uint64(32 - log2)).astype(np.int64)


def _positions(rng: np.random.Generator, top_k: int, context: int) -> np.ndarray:
    sel = set(range(max(0, context - 128), context)) | set(range(min(16, context)))
    while len(sel) < min(top_k, context):
        start = int(rng.integers(0, context))
        sel.update(range(start, min(context, start + int(rng.geometric(1 / 16)))))
    pos = np.fromiter(sel, dtype=np.int64)
    rng.shuffle(pos)
    return pos[:top_k]


def topk_host_rows(rng: np.random.Generator, kind: str = "deepseek", top_k: int = 2048
                   ) -> np.ndarray:
    """The host rows of one row's top-k columns (``[top_k] int64``; see the module
    docstring for ``kind``)."""
    if kind == "random":
        return rng.choice(1 << 26, top_k, replace=False).astype(np.int64) + _BLOCK
    if kind not in KEY_KINDS:
        raise ValueError(f"topk_host_rows: kind must be one of {KEY_KINDS}, got {kind!r}")
    context = int(rng.integers(8192, 131073))
    pos = _positions(rng, top_k, context)
    pages = context // _BLOCK + 1
    if kind == "contiguous":
        blocks = int(rng.integers(1, _POOL_BLOCKS - pages)) + np.arange(pages)
    else:
        blocks = rng.choice(_POOL_BLOCKS - 1, pages, replace=False) + 1
    return blocks[pos // _BLOCK] * _BLOCK + pos % _BLOCK


def linear_rounds(keys: np.ndarray, log2_t: int, rng: np.random.Generator,
                  max_rounds: int = 64) -> int:
    """Insertion rounds of the earlier kernel for one row's ``keys`` in a table of
    ``2**log2_t`` entries (linear probing, parallel ``atomic_cas`` rounds)."""
    T = 1 << log2_t
    table = np.full(T, -1, dtype=np.int64)
    idx = _hash(keys, log2_t)
    pending = np.arange(len(keys))
    rounds = 0
    while pending.size and rounds < max_rounds:
        rounds += 1
        order = rng.permutation(pending)
        slots = idx[order]
        cur = table[slots]
        free = cur == -1
        # the first free-slot CAS of each entry (in the random order) writes its key
        first = np.zeros(len(order), dtype=bool)
        _, at = np.unique(slots[free], return_index=True)
        first[np.nonzero(free)[0][at]] = True
        table[slots[first]] = keys[order[first]]
        placed = table[slots] == keys[order]
        left = order[~placed]
        idx[left] = (idx[left] + 1) & (T - 1)
        pending = left
    return rounds


def bucket_load(keys: np.ndarray, log2_nb: int) -> int:
    """The fullest bucket of one row (keys per bucket; equal keys counted once each column
    takes a slot, so duplicates count: the kernel gives every column a slot)."""
    return int(np.bincount(_hash(keys, log2_nb), minlength=1 << log2_nb).max())


def table_bytes(keys: np.ndarray, held: np.ndarray, scheme: str, *, top_k: int = 2048,
                rounds: int = 3, probes: int = 8) -> dict[str, int]:
    """Bytes of one row's table: ``allocated`` and ``touched`` (32-byte sectors any access
    of the call reaches: the columns' inserts and reads, the held rows' lookups)."""
    if scheme == "linear":
        T = 16 * top_k
        log2 = T.bit_length() - 1
        words = set()
        for home in _hash(keys, log2):  # key, first, srv of the columns' entries (~home)
            for a in range(3):
                words.add(a * T + int(home))
        for home in _hash(held, log2):  # the lookups' probes of the key array
            for d in range(rounds):
                words.add((int(home) + d) & (T - 1))
        allocated = 3 * T * 4
    else:
        nb = 2 * top_k
        log2 = nb.bit_length() - 1
        words = set()
        cnt = 2 * probes * nb
        for b in _hash(keys, log2):  # count, the bucket's keys, the entry's aux word
            words.update((cnt + int(b), int(b) * 2 * probes, int(b) * 2 * probes + probes))
        for b in _hash(held, log2):  # the lookups scan one bucket's keys
            words.add(int(b) * 2 * probes)
        allocated = (2 * probes + 1) * nb * 4
    return {"allocated": allocated, "touched": len({w * 4 // _SECTOR for w in words}) * _SECTOR}


def _dist(values: np.ndarray) -> dict[str, Any]:
    return {"median": float(np.median(values)), "p90": float(np.percentile(values, 90)),
            "p99": float(np.percentile(values, 99)), "max": int(values.max()),
            "histogram": {str(int(v)): int(n) for v, n in zip(*np.unique(values,
                                                                         return_counts=True))}}


def simulate(batches: int = 40, batch: int = 64, top_k: int = 2048, probes: int = 8,
             kinds: tuple[str, ...] = KEY_KINDS, seed: int = 0) -> dict[str, Any]:
    """``batches`` batches of ``batch`` rows per key kind: the earlier kernel's insertion
    rounds (per row, and the maximum over each batch) and the bucket scheme's fullest
    bucket, overflow rates and table bytes (see the module docstring)."""
    rng = np.random.default_rng(seed)
    log2_t = (16 * top_k).bit_length() - 1
    log2_nb = (2 * top_k).bit_length() - 1
    out: dict[str, Any] = {"batch": batch, "batches": batches, "top_k": top_k,
                           "linear_table_entries": 1 << log2_t, "buckets": 1 << log2_nb,
                           "bucket_slots": probes, "kinds": {}}
    for kind in kinds:
        rounds = np.empty((batches, batch), dtype=np.int64)
        loads = np.empty((batches, batch), dtype=np.int64)
        lin_b, bkt_b = [], []
        for i in range(batches):
            for j in range(batch):
                keys = topk_host_rows(rng, kind, top_k)
                rounds[i, j] = linear_rounds(keys, log2_t, rng)
                loads[i, j] = bucket_load(keys, log2_nb)
                if j == 0 and i < 4:  # the held rows: 4,096 slots, 2,048 of them selected
                    held = np.concatenate([keys, topk_host_rows(rng, kind, top_k)])
                    lin_b.append(table_bytes(keys, held, "linear", top_k=top_k,
                                             rounds=int(rounds[i, j])))
                    bkt_b.append(table_bytes(keys, held, "bucket", top_k=top_k,
                                             probes=probes))
        over = loads > probes
        out["kinds"][kind] = {
            "linear_rounds_per_row": _dist(rounds.ravel()),
            "linear_rounds_slowest_row": _dist(rounds.max(axis=1)),
            "bucket_fullest_per_row": _dist(loads.ravel()),
            "bucket_fullest_per_batch": _dist(loads.max(axis=1)),
            "bucket_overflow_rows": int(over.sum()),
            "bucket_overflow_batches": int(over.any(axis=1).sum()),
            "table_bytes_per_row": {
                "linear": {k: int(np.mean([b[k] for b in lin_b])) for k in lin_b[0]},
                "bucket": {k: int(np.mean([b[k] for b in bkt_b])) for k in bkt_b[0]}},
        }
    out["bucket_overflow_batch_probability_poisson"] = _poisson_overflow(top_k, 1 << log2_nb,
                                                                         probes, batch)
    return out


def _poisson_overflow(keys: int, buckets: int, slots: int, batch: int) -> float:
    """P(some bucket of a batch gets more than ``slots`` of ``keys`` uniformly hashed keys):
    the binomial tail per bucket, over ``buckets x batch`` buckets."""
    from math import comb, exp, log1p

    p = 1 / buckets
    tail = 1.0 - sum(comb(keys, j) * p ** j * (1 - p) ** (keys - j) for j in range(slots + 1))
    tail = max(tail, 0.0)
    return 1.0 - exp(buckets * batch * log1p(-tail)) if tail < 1 else 1.0


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=int, default=40)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--top-k", type=int, default=2048)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, help="write the result here")
    args = parser.parse_args(argv)
    result = simulate(args.batches, args.batch, args.top_k, seed=args.seed)
    text = json.dumps(result, indent=1)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            f.write(text + "\n")
    sys.stdout.write(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
