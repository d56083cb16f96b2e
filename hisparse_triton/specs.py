"""KV-cache spec value types and their page-size arithmetic.

Every spec is a frozen dataclass. ``page_size_bytes`` is the bytes one layer of the spec
needs for one block of ``block_size`` tokens; ``max_memory_usage_bytes(config)`` is what one
request at ``config.max_model_len`` tokens needs for that layer.

Group and tensor types describe where the planner put things:

- ``KVCacheGroupSpec``: layers that share one block table. A group lays its layers one page
  apart inside a pool block, so it occupies ``group.page_size_bytes`` bytes of every block
  (``len(layers) * spec.page_size_bytes``; for ``UniformTypeKVCacheSpecs`` the spec's page
  already is the sum over its layers).
- ``KVCacheTensor``: the bytes of one underlying layer, see its docstring.
- ``KVCacheConfig``: the planner's answer: device blocks, tensors, groups, host pool size,
  and (for a HiSparse plan) its ``HiSparseTopology``.
- ``HiSparseTopology`` / ``HiSparseIndexGroup``: which group plays which part, which hot group
  pairs with which resident group, and which sparse layers share an indexer. The planner
  writes it; a runtime reads it instead of re-deriving anything from layer names.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Mapping, Optional, Union

if TYPE_CHECKING:  # pragma: no cover
    from hisparse_triton.config import EngineConfig


def cdiv(a: int, b: int) -> int:
    """Ceiling division of non-negative ``a`` by positive ``b``."""
    return -(-a // b)


def round_up(a: int, multiple: int) -> int:
    """``a`` rounded up to a multiple of ``multiple``."""
    return cdiv(a, multiple) * multiple


class SparseCacheRole(enum.Enum):
    """Which cache of a sparse-attention (DSA) layer an ``MLAAttentionSpec`` describes."""

    SPARSE = "sparse"  # the latent MLA KV the attention reads at top-k rows
    INDEXER = "indexer"  # the indexer's K cache, scored over the whole history


class KVCacheGroupRole(enum.Enum):
    """The part a group plays in a HiSparse layout."""

    DEFAULT = "default"
    HISPARSE_SOURCE = "hisparse_source"
    HISPARSE_INDEXER = "hisparse_indexer"


class GroupKind(str, enum.Enum):
    """What a group of a HiSparse plan holds: the one spelling of a group kind, shared by
    the planner (``layout.group_kind``, ``HiSparseTopology.kind_of``), the device group
    classes and the scheduler's managers. A ``str``: a member equals, prints and
    serialises as its value (the name ``plan`` prints)."""

    SOURCE = "source"  # host-resident sparse-MLA history (the source of truth)
    INDEXER = "indexer"  # the indexer K cache, on the GPU at full length
    RESIDENT = "resident"  # GPU pages new sparse KV is written to (a cache of the host)
    HOT = "hot"  # per-request hot-buffer pages of the same layers
    REGULAR = "regular"  # any other attention layer (full, sliding window)

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)


def _check_positive(owner: str, **values: int) -> None:
    for name, value in values.items():
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ValueError(f"{owner}.{name} must be a positive int, got {value!r}.")


#: Bytes per element of the dtypes a KV cache uses. Specs name dtypes by these strings so
#: the planner (and ``hisparse-triton plan``) never needs to import torch.
DTYPE_ITEMSIZE: dict[str, int] = {
    "uint8": 1, "int8": 1, "float8_e4m3fn": 1, "float8_e5m2": 1,
    "bfloat16": 2, "float16": 2, "float32": 4,
}


def normalize_dtype(owner: str, dtype: Any) -> str:
    """A dtype name from ``DTYPE_ITEMSIZE``; accepts the name or a ``torch.dtype``."""
    name = dtype if isinstance(dtype, str) else str(dtype).removeprefix("torch.")
    if name not in DTYPE_ITEMSIZE:
        raise ValueError(f"{owner}.dtype {dtype!r} is not supported; use one of "
                         f"{sorted(DTYPE_ITEMSIZE)}.")
    return name


@dataclass(frozen=True)
class KVCacheSpec:
    """Base of all per-layer specs: ``block_size`` tokens per page."""

    block_size: int

    @property
    def page_size_bytes(self) -> int:  # pragma: no cover - abstract
        raise NotImplementedError

    def max_memory_usage_bytes(self, config: "EngineConfig") -> int:
        """Bytes one request at ``config.max_model_len`` tokens needs for one layer."""
        return cdiv(config.max_model_len, self.block_size) * self.page_size_bytes


@dataclass(frozen=True)
class MLAAttentionSpec(KVCacheSpec):
    """One latent-KV (SPARSE) or indexer-K (INDEXER) layer of a sparse-attention model.

    ``head_size`` is counted in elements of ``dtype`` (a name from ``DTYPE_ITEMSIZE`` or a
    ``torch.dtype``, stored as the name): a 656 B fp8_ds_mla row is
    ``head_size=656, dtype="uint8"``; a bf16 row is ``head_size=576, dtype="bfloat16"``.
    """

    head_size: int
    dtype: str
    cache_role: SparseCacheRole
    is_index_group_leader: bool = False
    num_kv_heads: int = 1

    def __post_init__(self) -> None:
        _check_positive(type(self).__name__, block_size=self.block_size,
                        head_size=self.head_size, num_kv_heads=self.num_kv_heads)
        object.__setattr__(self, "dtype", normalize_dtype(type(self).__name__, self.dtype))
        if not isinstance(self.cache_role, SparseCacheRole):
            raise TypeError(f"MLAAttentionSpec.cache_role must be a SparseCacheRole, "
                            f"got {self.cache_role!r}.")

    @property
    def row_bytes(self) -> int:
        """Bytes of one token's row (``num_kv_heads * head_size * itemsize``)."""
        return self.num_kv_heads * self.head_size * DTYPE_ITEMSIZE[self.dtype]

    @property
    def page_size_bytes(self) -> int:
        return self.block_size * self.row_bytes


@dataclass(frozen=True)
class FullAttentionSpec(KVCacheSpec):
    """A regular attention layer holding K and V for every token."""

    num_kv_heads: int
    head_size: int
    dtype: str

    def __post_init__(self) -> None:
        _check_positive(type(self).__name__, block_size=self.block_size,
                        num_kv_heads=self.num_kv_heads, head_size=self.head_size)
        object.__setattr__(self, "dtype", normalize_dtype(type(self).__name__, self.dtype))

    @property
    def page_size_bytes(self) -> int:
        return (2 * self.block_size * self.num_kv_heads * self.head_size
                * DTYPE_ITEMSIZE[self.dtype])


@dataclass(frozen=True)
class SlidingWindowSpec(FullAttentionSpec):
    """A regular attention layer that only keeps the last ``sliding_window`` tokens.

    ``extra_retained_tokens`` (default 0) keeps that many more tokens alive below the
    window (read by no query, but not released yet): a drafter with several speculative
    modules may re-prefill the last few tokens, so their window must still be there. vLLM
    sets it on every sliding-window layer to ``num_prefill_lookahead_tokens - 1`` (the
    number of multi-token-prediction modules minus one; 0 without them).
    """

    sliding_window: int = 0
    extra_retained_tokens: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_positive(type(self).__name__, sliding_window=self.sliding_window)
        extra = self.extra_retained_tokens
        if not isinstance(extra, int) or isinstance(extra, bool) or extra < 0:
            raise ValueError(f"{type(self).__name__}.extra_retained_tokens must be an int "
                             f">= 0, got {extra!r}.")

    @property
    def num_retained_tokens(self) -> int:
        """Tokens below a request's next position it keeps: ``window - 1 + extra_retained``."""
        return self.sliding_window - 1 + self.extra_retained_tokens

    def max_memory_usage_bytes(self, config: "EngineConfig") -> int:
        """The pages a request can hold at once, plus one page a window straddles.

        While steps are in flight a request keeps the last ``num_retained_tokens``
        (``window - 1 + extra_retained_tokens``) computed tokens and the scheduled ones
        (``config.in_flight_tokens``: ``max_concurrent_batches * max_num_batched_tokens``,
        a whole prompt when that is unset), never more than ``max_model_len``:
        ``cdiv(min(retained + in_flight, max_model_len), B) + 1`` pages.
        """
        tokens = min(self.num_retained_tokens + config.in_flight_tokens, config.max_model_len)
        return (cdiv(tokens, self.block_size) + 1) * self.page_size_bytes


@dataclass(frozen=True)
class HiSparseResidentSpec(KVCacheSpec):
    """GPU pages of sparse-MLA layers: where new KV is written; a cache of the host pool.

    ``page_size`` is the page of ONE layer (all layers of a resident group share it).
    """

    page_size: int

    def __post_init__(self) -> None:
        _check_positive(type(self).__name__, block_size=self.block_size,
                        page_size=self.page_size)

    @property
    def page_size_bytes(self) -> int:
        return self.page_size


@dataclass(frozen=True)
class HiSparseHotSpec(KVCacheSpec):
    """Per-request hot-buffer pages of sparse-MLA layers (``blocks_per_request`` each)."""

    page_size: int
    blocks_per_request: int

    def __post_init__(self) -> None:
        _check_positive(type(self).__name__, block_size=self.block_size,
                        page_size=self.page_size, blocks_per_request=self.blocks_per_request)

    @property
    def page_size_bytes(self) -> int:
        return self.page_size

    def max_memory_usage_bytes(self, config: "EngineConfig") -> int:
        return self.blocks_per_request * self.page_size


@dataclass(frozen=True)
class UniformTypeKVCacheSpecs(KVCacheSpec):
    """Several layers with one block size whose pages sit side by side in one block.

    The layers share one block table, so they need the same number of pages per request
    (all full attention, or all sliding windows of one size; their head counts and page
    sizes may differ). ``page_size_bytes`` is the sum of the layers' pages.
    """

    kv_cache_specs: Mapping[str, KVCacheSpec] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.kv_cache_specs:
            raise ValueError("UniformTypeKVCacheSpecs needs at least one layer spec.")
        sizes = {name: spec.block_size for name, spec in self.kv_cache_specs.items()}
        if any(size != self.block_size for size in sizes.values()):
            raise ValueError(f"UniformTypeKVCacheSpecs needs one block size, got {sizes}.")
        object.__setattr__(self, "kv_cache_specs", dict(self.kv_cache_specs))

    @classmethod
    def from_specs(cls, specs: Mapping[str, KVCacheSpec]) -> "UniformTypeKVCacheSpecs":
        """Combine layer specs; ``ValueError`` if they are empty or mix block sizes."""
        if not specs:
            raise ValueError("UniformTypeKVCacheSpecs needs at least one layer spec.")
        return cls(block_size=next(iter(specs.values())).block_size, kv_cache_specs=specs)

    @property
    def first_spec(self) -> KVCacheSpec:
        """The spec of the first layer (it names the kind of all of them)."""
        return next(iter(self.kv_cache_specs.values()))

    @property
    def page_size_bytes(self) -> int:
        return sum(spec.page_size_bytes for spec in self.kv_cache_specs.values())

    def max_memory_usage_bytes(self, config: "EngineConfig") -> int:
        """The most pages any layer needs, times the summed page: the layers share one block
        table, so every layer gets as many pages as the one that needs the most."""
        pages = max(cdiv(spec.max_memory_usage_bytes(config), spec.page_size_bytes)
                    for spec in self.kv_cache_specs.values())
        return pages * self.page_size_bytes

    def __hash__(self) -> int:
        return hash((self.block_size, tuple(sorted(self.kv_cache_specs.items(),
                                                   key=lambda item: item[0]))))


AnySpec = Union[MLAAttentionSpec, FullAttentionSpec, SlidingWindowSpec, HiSparseResidentSpec,
                HiSparseHotSpec, UniformTypeKVCacheSpecs]


@dataclass(frozen=True)
class KVCacheGroupSpec:
    """Layers that share one block table.

    ``host_resident`` groups live in the host pool; ``enable_kv_transfer`` says whether a
    KV connector may move the group's blocks (derived HiSparse groups may not).
    """

    layer_names: tuple[str, ...]
    kv_cache_spec: KVCacheSpec
    role: KVCacheGroupRole = KVCacheGroupRole.DEFAULT
    host_resident: bool = False
    enable_kv_transfer: bool = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "layer_names", tuple(self.layer_names))
        if not self.layer_names:
            raise ValueError("KVCacheGroupSpec needs at least one layer.")

    @property
    def block_size(self) -> int:
        return self.kv_cache_spec.block_size

    @property
    def layer_page_size_bytes(self) -> int:
        """The page of one layer of this group (the spec's page for per-layer specs)."""
        spec = self.kv_cache_spec
        if isinstance(spec, UniformTypeKVCacheSpecs):
            pages = {s.page_size_bytes for s in spec.kv_cache_specs.values()}
            if len(pages) != 1:
                raise ValueError(f"group layers have different pages: {sorted(pages)}")
            return pages.pop()
        return spec.page_size_bytes

    @property
    def page_size_bytes(self) -> int:
        """Bytes the group occupies in one pool block (all its layers side by side)."""
        spec = self.kv_cache_spec
        if isinstance(spec, UniformTypeKVCacheSpecs):
            return spec.page_size_bytes
        return len(self.layer_names) * spec.page_size_bytes

    def blocks_per_request(self, config: "EngineConfig") -> int:
        """Blocks one request at ``config.max_model_len`` tokens needs in this group."""
        spec = self.kv_cache_spec
        return cdiv(spec.max_memory_usage_bytes(config), spec.page_size_bytes)


@dataclass(frozen=True)
class KVCacheTensor:
    """The bytes of one underlying layer inside a pool.

    Device tensors (``host_resident=False``) all view ONE block-outermost backing buffer of
    ``num_blocks * block_stride`` bytes; host tensors view one host allocation, layer-major.

    - ``layers``: every group-layer name that views these bytes (a sparse layer's
      ``<name>.hisparse_resident`` and ``<name>.hisparse_hot`` share them).
    - ``offset``: byte offset of the layer's page inside block 0 (device), or of the layer's
      contiguous region (host).
    - ``block_stride``: bytes from one block to the next (device: the pool's bytes per
      block; host: the layer's page bytes, blocks are contiguous).
    - ``layer_stride``: bytes from this layer to the next layer of the same group (device:
      the page size; host: one layer region, ``host_num_blocks * page``).
    - ``size``: bytes this ONE layer's view covers (``num_blocks * page`` on the device,
      ``host_num_blocks * page`` on the host), so ``size // num_blocks`` is its page.
      vLLM's ``KVCacheTensor`` differs here: it describes a run of same-spec layers of one
      group (``layers`` in order, ``layer_stride`` apart) and its ``size`` is the whole
      backing allocation (``num_blocks * bytes_per_block`` on the device, every source
      layer's region together on the host). The offsets agree: ours for layer ``l`` equals
      vLLM's ``offset + index(l) * layer_stride``.

    Row ``r`` of the layer (``block * block_size + slot``) starts at byte
    ``offset + (r // block_size) * block_stride + (r % block_size) * row_bytes``.
    """

    size: int
    layers: tuple[str, ...]
    layer_stride: int
    block_stride: int
    offset: int
    host_resident: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "layers", tuple(self.layers))


def _check_group_index(owner: str, name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{owner}.{name} must be a group index (an int >= 0), got {value!r}.")


@dataclass(frozen=True)
class HiSparseIndexGroup:
    """Sparse layers that share one indexer: the leader resolves, followers replay its plan.

    - ``leader``: the underlying sparse layer name whose indexer selects the top-k rows.
    - ``layers``: every underlying sparse layer name of the index group, leader first, in
      model order.
    - ``resident_group`` / ``hot_group``: indices into ``KVCacheConfig.kv_cache_groups`` of
      the resident group and the hot group that hold these layers (an index group is never
      split across groups).
    """

    leader: str
    layers: tuple[str, ...]
    resident_group: int
    hot_group: int

    def __post_init__(self) -> None:
        object.__setattr__(self, "layers", tuple(self.layers))
        if not self.layers or self.layers[0] != self.leader:
            raise ValueError(f"HiSparseIndexGroup.layers must start with the leader "
                             f"{self.leader!r}, got {self.layers!r}.")
        if len(set(self.layers)) != len(self.layers):
            raise ValueError(f"HiSparseIndexGroup.layers repeats a layer: {self.layers!r}.")
        _check_group_index("HiSparseIndexGroup", "resident_group", self.resident_group)
        _check_group_index("HiSparseIndexGroup", "hot_group", self.hot_group)


@dataclass(frozen=True)
class HiSparseTopology:
    """Which group of a HiSparse plan plays which part (indices into ``kv_cache_groups``).

    - ``source_group``: the host-resident sparse-MLA group; ``indexer_group``: the indexer.
    - ``resident_groups`` / ``hot_groups``: ``hot_groups[i]`` holds the hot buffers of the
      same layers, in the same in-block order, as ``resident_groups[i]``.
    - ``regular_groups``: every other (non-HiSparse) group.
    - ``index_groups``: every index group of the sparse layers, in model order.

    The planner writes it (``KVCacheConfig.hisparse_topology``); a runtime reads the pairing
    and the index groups from here and never re-derives them from layer names.
    ``ValueError`` on construction when the parts overlap or the index groups disagree with
    the pairing.
    """

    source_group: int
    indexer_group: int
    resident_groups: tuple[int, ...]
    hot_groups: tuple[int, ...]
    regular_groups: tuple[int, ...]
    index_groups: tuple[HiSparseIndexGroup, ...]
    _by_layer: dict = field(init=False, repr=False, compare=False, hash=False)

    def __post_init__(self) -> None:
        owner = "HiSparseTopology"
        for name in ("resident_groups", "hot_groups", "regular_groups", "index_groups"):
            object.__setattr__(self, name, tuple(getattr(self, name)))
        _check_group_index(owner, "source_group", self.source_group)
        _check_group_index(owner, "indexer_group", self.indexer_group)
        for name in ("resident_groups", "hot_groups", "regular_groups"):
            for value in getattr(self, name):
                _check_group_index(owner, name, value)
        if len(self.resident_groups) != len(self.hot_groups) or not self.resident_groups:
            raise ValueError(f"{owner} needs one hot group per resident group (at least one "
                             f"pair), got resident {self.resident_groups} and hot "
                             f"{self.hot_groups}.")
        every = self.group_indices
        if len(set(every)) != len(every):
            raise ValueError(f"{owner} assigns a group index to two parts: {every}.")
        hot_of = dict(zip(self.resident_groups, self.hot_groups))
        by_layer: dict[str, HiSparseIndexGroup] = {}
        for group in self.index_groups:
            if not isinstance(group, HiSparseIndexGroup):
                raise TypeError(f"{owner}.index_groups must hold HiSparseIndexGroup values, "
                                f"got {type(group).__name__}.")
            if hot_of.get(group.resident_group) != group.hot_group:
                raise ValueError(f"index group of {group.leader!r}: resident group "
                                 f"{group.resident_group} and hot group {group.hot_group} are "
                                 f"not a pair of this topology.")
            for layer in group.layers:
                if layer in by_layer:
                    raise ValueError(f"layer {layer!r} is in two index groups.")
                by_layer[layer] = group
        if not by_layer:
            raise ValueError(f"{owner} needs at least one index group.")
        object.__setattr__(self, "_by_layer", by_layer)

    @property
    def sparse_layers(self) -> tuple[str, ...]:
        """Every underlying sparse layer name, in model order."""
        return tuple(layer for group in self.index_groups for layer in group.layers)

    @property
    def leaders(self) -> tuple[str, ...]:
        """The leader of every index group, in model order."""
        return tuple(group.leader for group in self.index_groups)

    def index_group_of(self, layer: str) -> HiSparseIndexGroup:
        """The index group of an underlying sparse layer; ``ValueError`` for any other name."""
        try:
            return self._by_layer[layer]
        except (KeyError, TypeError):
            raise ValueError(f"{layer!r} is not a sparse layer of this HiSparse plan (its "
                             f"{len(self._by_layer)} sparse layers start with "
                             f"{self.index_groups[0].leader!r}).") from None

    def resident_group_of(self, layer: str) -> int:
        """Index of the resident group holding an underlying sparse layer."""
        return self.index_group_of(layer).resident_group

    def hot_group_of(self, layer: str) -> int:
        """Index of the hot group holding an underlying sparse layer."""
        return self.index_group_of(layer).hot_group

    def kind_of(self, group_index: int) -> GroupKind:
        """What group ``group_index`` of the plan holds; ``ValueError`` if no part has it."""
        if group_index == self.source_group:
            return GroupKind.SOURCE
        if group_index == self.indexer_group:
            return GroupKind.INDEXER
        for kind, indices in ((GroupKind.RESIDENT, self.resident_groups),
                              (GroupKind.HOT, self.hot_groups),
                              (GroupKind.REGULAR, self.regular_groups)):
            if group_index in indices:
                return kind
        raise ValueError(f"group index {group_index!r} is not part of this HiSparse topology.")

    @property
    def group_indices(self) -> tuple[int, ...]:
        """Every group index the topology names: source, indexer, resident, hot, regular."""
        return (self.source_group, self.indexer_group, *self.resident_groups,
                *self.hot_groups, *self.regular_groups)


@dataclass(frozen=True)
class KVCacheConfig:
    """The planner's answer: the shared device pool, its tensors, the groups, the host pool.

    - ``bytes_per_block``: bytes of one device pool block (every device tensor's
      ``block_stride``). ``None`` (the default for a hand-built config) stores the largest
      device group page; an explicit value must be at least that.
    - ``row_aligned_blocks``: ``bytes_per_block`` is a multiple of every resident/hot layer's
      page, so each sparse layer's device cache is also a flat ``[rows, row_bytes]`` array
      (see ``hisparse_triton.layout.device_row_layout``).
    - ``hisparse_topology``: the HiSparse plan's topology; ``None`` for a non-HiSparse config.
    """

    num_blocks: int
    kv_cache_tensors: tuple[KVCacheTensor, ...]
    kv_cache_groups: tuple[KVCacheGroupSpec, ...]
    hisparse_host_num_blocks: int = 0
    hisparse_host_block_stride: int = 0
    hisparse_shared_host_pool: bool = False
    bytes_per_block: Optional[int] = None
    row_aligned_blocks: bool = False
    hisparse_topology: Optional[HiSparseTopology] = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "kv_cache_tensors", tuple(self.kv_cache_tensors))
        object.__setattr__(self, "kv_cache_groups", tuple(self.kv_cache_groups))
        device_pages = [g.page_size_bytes for g in self.kv_cache_groups if not g.host_resident]
        largest = max(device_pages, default=0)
        if self.bytes_per_block is None:
            object.__setattr__(self, "bytes_per_block", largest)
        elif (not isinstance(self.bytes_per_block, int) or isinstance(self.bytes_per_block, bool)
              or self.bytes_per_block < largest):
            raise ValueError(f"KVCacheConfig.bytes_per_block must be an int >= the largest "
                             f"device group page ({largest} B), got {self.bytes_per_block!r}.")
        if not isinstance(self.row_aligned_blocks, bool):
            raise ValueError(f"KVCacheConfig.row_aligned_blocks must be a bool, got "
                             f"{self.row_aligned_blocks!r}.")
        if self.row_aligned_blocks:
            sparse = (HiSparseResidentSpec, HiSparseHotSpec)
            for group in self.kv_cache_groups:
                if not group.host_resident and isinstance(group.kv_cache_spec, sparse) \
                        and self.bytes_per_block % group.kv_cache_spec.page_size:
                    raise ValueError(
                        f"KVCacheConfig.bytes_per_block={self.bytes_per_block} is not a "
                        f"multiple of the {group.kv_cache_spec.page_size} B page of layer "
                        f"{group.layer_names[0]!r}, but row_aligned_blocks is set.")
        topology = self.hisparse_topology
        if topology is not None:
            if not isinstance(topology, HiSparseTopology):
                raise TypeError(f"KVCacheConfig.hisparse_topology must be a HiSparseTopology "
                                f"or None, got {type(topology).__name__}.")
            count = len(self.kv_cache_groups)
            if sorted(topology.group_indices) != list(range(count)):
                raise ValueError(f"KVCacheConfig.hisparse_topology names groups "
                                 f"{sorted(topology.group_indices)}, but the config has "
                                 f"groups 0..{count - 1}.")
            if not self.kv_cache_groups[topology.source_group].host_resident:
                raise ValueError(f"KVCacheConfig.hisparse_topology's source group "
                                 f"{topology.source_group} is not host-resident.")
