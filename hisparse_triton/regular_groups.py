"""Which regular (non-HiSparse) layers share a block table: vLLM 0.33's grouping rules.

A *group* is a set of layers with one block table; inside a pool block the group lays its
layers' pages side by side, and every block of the shared pool is as large as the largest
group. Each group also charges every request its own pages at admission, so fewer groups
admit more requests, while one very wide group makes every block large.

:func:`group_regular_layers` applies vLLM 0.33's rules (``get_kv_cache_groups``), the first
that matches:

1. **One spec**: every layer has the same spec -> one group.
2. **One type**: every layer needs the same number of pages per request (the same *type*:
   the same block size and all full attention, or all sliding windows of one size), even if
   their head counts or page sizes differ -> one group of all of them
   (a ``UniformTypeKVCacheSpecs``).
3. **Several page sizes** (the packed grouping): layers of one type form a *bucket*. In a
   bucket that holds one layer of each page size per repetition of the model's layer
   pattern (*balanced*), a group takes whole repetitions; the repetitions per group are
   picked by :func:`least_padding_divisor` over the balanced buckets' repetition counts,
   at least the largest count of a balanced bucket that mixes page sizes (such a bucket
   stays whole). Without any mixed balanced bucket, sliding-window buckets are split so
   that none is wider than the widest other group (``anchor``); every other bucket is one
   group.
4. **One page size** (the equal-count grouping): layers of equal spec form a type; the group
   size is the smallest type's layer count, or the largest one when even that is below
   :data:`REGULAR_GROUP_SIZE_SLACK` (1.5) times the smallest; a type of ``n`` layers makes
   ``k = cdiv(n, size)`` groups, group ``i`` taking every ``k``-th layer from layer ``i``.

No torch here: the planner must import fast.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import zip_longest
from typing import Hashable, Mapping, Sequence

from hisparse_triton.specs import (
    FullAttentionSpec,
    KVCacheGroupSpec,
    KVCacheSpec,
    SlidingWindowSpec,
    UniformTypeKVCacheSpecs,
    cdiv,
)

#: In the equal-count grouping, a largest type below this multiple of the smallest type's
#: layer count sets the group size instead (12 sliding + 13 full: two groups of up to 13,
#: not 12 + 7 + 6). vLLM 0.33's factor.
REGULAR_GROUP_SIZE_SLACK = 1.5


def uniform_type_key(spec: KVCacheSpec) -> Hashable:
    """Layers with equal keys need the same pages per request and may share a block table.

    ``(block_size, "full")`` for full attention, ``(block_size, "sliding", window)`` for a
    sliding window (``extra_retained_tokens`` does not matter), ``(block_size, type name)``
    for any other spec type.
    """
    if isinstance(spec, SlidingWindowSpec):
        return (spec.block_size, "sliding", spec.sliding_window)
    if type(spec) is FullAttentionSpec:
        return (spec.block_size, "full")
    return (spec.block_size, type(spec).__name__)


def least_padding_divisor(values: Sequence[int], lower_bound: int) -> int:
    """The ``d >= lower_bound`` that pads ``values`` least when each is rounded up to a
    multiple of ``d`` (ties: the larger ``d``); ``lower_bound`` itself when it exceeds
    every value. vLLM 0.33's ``_approximate_gcd``."""
    low = max(1, lower_bound)
    high = max(values)
    if low > high:
        return low
    best, best_pad = low, None
    for d in range(low, high + 1):
        pad = sum(-value % d for value in values)
        if best_pad is None or pad <= best_pad:
            best, best_pad = d, pad
    return best


@dataclass(frozen=True)
class _Bucket:
    """The layers of one type, split by page size (page sizes in first-seen order)."""

    layers: tuple[str, ...]
    by_page: dict[int, list[str]]
    sliding: bool

    @property
    def balanced(self) -> bool:
        """Every page size has as many layers: one of each per pattern repetition."""
        return len({len(names) for names in self.by_page.values()}) == 1

    @property
    def repeats(self) -> int:
        """Layers of the most common page size (the pattern's repetitions if balanced)."""
        return max(len(names) for names in self.by_page.values())

    def widest_group_bytes(self, num_groups: int) -> int:
        """Page bytes of the widest of ``num_groups`` groups this bucket splits into."""
        return sum(cdiv(len(names), num_groups) * page for page, names in self.by_page.items())

    def split(self, num_groups: int) -> list[tuple[str, ...]]:
        """``num_groups`` groups, group ``i`` taking every ``num_groups``-th repetition
        from ``i`` (a repetition: one layer of each page size, in page order).

        vLLM pairs the page sizes' layers with ``zip``, which drops layers when a bucket is
        not balanced (and fails when a group is left empty); here the shorter page sizes
        just end early and no layer is lost (such a split only happens to an unbalanced
        sliding-window bucket).
        """
        repetitions = [tuple(name for name in row if name is not None)
                       for row in zip_longest(*self.by_page.values())]
        groups = [tuple(name for row in repetitions[i::num_groups] for name in row)
                  for i in range(num_groups)]
        return [group for group in groups if group]


def _buckets(specs: Mapping[str, KVCacheSpec]) -> list[_Bucket]:
    by_type: dict[Hashable, list[str]] = {}
    for name, spec in specs.items():
        by_type.setdefault(uniform_type_key(spec), []).append(name)
    buckets = []
    for names in by_type.values():
        by_page: dict[int, list[str]] = {}
        for name in names:
            by_page.setdefault(specs[name].page_size_bytes, []).append(name)
        buckets.append(_Bucket(tuple(names), by_page,
                               isinstance(specs[names[0]], SlidingWindowSpec)))
    return buckets


def _packed_groups(specs: Mapping[str, KVCacheSpec]) -> list[tuple[str, ...]]:
    """Rule 3 (several page sizes), see the module docstring."""
    buckets = _buckets(specs)
    floor = max((b.repeats for b in buckets if b.balanced and len(b.by_page) > 1), default=0)
    per_group = (least_padding_divisor([b.repeats for b in buckets if b.balanced], floor)
                 if floor else None)

    def num_groups(bucket: _Bucket) -> int:
        if bucket.balanced and per_group is not None:
            return cdiv(bucket.repeats, per_group)
        return 1

    def splits_freely(bucket: _Bucket) -> bool:
        # a sliding-window bucket can go down to one layer per group when no repeating
        # pattern fixes the split
        return per_group is None and bucket.sliding

    anchor = max(b.widest_group_bytes(len(b.layers) if splits_freely(b) else num_groups(b))
                 for b in buckets)
    groups: list[tuple[str, ...]] = []
    for bucket in buckets:
        count = num_groups(bucket)
        if splits_freely(bucket):
            per_block = max(anchor // specs[bucket.layers[0]].page_size_bytes, 1)
            count = max(count, cdiv(len(bucket.layers), per_block))
        if count == 1:
            groups.append(bucket.layers)
        else:
            groups.extend(bucket.split(count))
    return groups


def _equal_count_groups(specs: Mapping[str, KVCacheSpec]) -> list[tuple[str, ...]]:
    """Rule 4 (one page size), see the module docstring."""
    types: dict[KVCacheSpec, list[str]] = {}
    for name, spec in specs.items():
        types.setdefault(spec, []).append(name)
    counts = [len(layers) for layers in types.values()]
    size = min(counts)
    if max(counts) < size * REGULAR_GROUP_SIZE_SLACK:
        size = max(counts)
    groups: list[tuple[str, ...]] = []
    for layers in types.values():
        num_groups = cdiv(len(layers), size)
        groups.extend(tuple(layers[i::num_groups]) for i in range(num_groups))
    return groups


def group_regular_layers(specs: Mapping[str, KVCacheSpec]) -> list[tuple[str, ...]]:
    """The groups of ``specs`` (layer name -> spec, model order) by vLLM 0.33's rules.

    Returns the groups' layer names, in order; every layer lands in exactly one group.
    Examples: full 8x128 + full 4x64 heads -> ``[(fa, fb)]`` (one type); 2 full 1x64 + 1
    sliding 1x128 -> ``[(f0, f1), (w0,)]`` (packed); 4 full + 5 sliding layers of equal
    pages -> ``[(f0..f3), (w0..w4)]`` (5 < 1.5 x 4, so the group size is 5).
    """
    if not specs:
        return []
    if len(set(specs.values())) == 1 or len({uniform_type_key(s) for s in specs.values()}) == 1:
        return [tuple(specs)]
    if len({spec.page_size_bytes for spec in specs.values()}) > 1:
        return _packed_groups(specs)
    return _equal_count_groups(specs)


def regular_group_spec(specs: Mapping[str, KVCacheSpec], layers: Sequence[str]) -> KVCacheSpec:
    """The spec of a group of ``layers``: their common spec when all are equal, else a
    ``UniformTypeKVCacheSpecs`` of them (vLLM uses the latter for every one-type or packed
    group; the pages and blocks per request are the same either way, and a plain sliding-
    window spec lets the runtime release the pages that left the window)."""
    layer_specs = {name: specs[name] for name in layers}
    distinct = set(layer_specs.values())
    if len(distinct) == 1:
        return distinct.pop()
    return UniformTypeKVCacheSpecs.from_specs(layer_specs)


def regular_kv_cache_groups(specs: Mapping[str, KVCacheSpec]) -> list[KVCacheGroupSpec]:
    """:func:`group_regular_layers` as ``KVCacheGroupSpec`` values (see
    :func:`regular_group_spec`)."""
    return [KVCacheGroupSpec(layers, regular_group_spec(specs, layers))
            for layers in group_regular_layers(specs)]


__all__ = [
    "REGULAR_GROUP_SIZE_SLACK",
    "group_regular_layers",
    "least_padding_divisor",
    "regular_group_spec",
    "regular_kv_cache_groups",
    "uniform_type_key",
]
