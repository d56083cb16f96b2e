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
- ``KVCacheConfig``: the planner's answer: device blocks, tensors, groups, host pool size.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Mapping, Union

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
    """A regular attention layer that only keeps the last ``sliding_window`` tokens."""

    sliding_window: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_positive(type(self).__name__, sliding_window=self.sliding_window)

    def max_memory_usage_bytes(self, config: "EngineConfig") -> int:
        """The window's pages plus one page that a window straddles."""
        tokens = min(self.sliding_window, config.max_model_len)
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

    ``page_size_bytes`` is the sum of the layers' pages.
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
    def page_size_bytes(self) -> int:
        return sum(spec.page_size_bytes for spec in self.kv_cache_specs.values())

    def max_memory_usage_bytes(self, config: "EngineConfig") -> int:
        return sum(spec.max_memory_usage_bytes(config) for spec in self.kv_cache_specs.values())

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
    - ``size``: bytes this layer's view covers (``num_blocks * page`` on the device,
      ``host_num_blocks * page`` on the host).

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


@dataclass(frozen=True)
class KVCacheConfig:
    """The planner's answer: the shared device pool, its tensors, the groups, the host pool."""

    num_blocks: int
    kv_cache_tensors: tuple[KVCacheTensor, ...]
    kv_cache_groups: tuple[KVCacheGroupSpec, ...]
    hisparse_host_num_blocks: int = 0
    hisparse_host_block_stride: int = 0
    hisparse_shared_host_pool: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "kv_cache_tensors", tuple(self.kv_cache_tensors))
        object.__setattr__(self, "kv_cache_groups", tuple(self.kv_cache_groups))

    @property
    def bytes_per_block(self) -> int:
        """Bytes of one device pool block: the largest device group page."""
        return max((g.page_size_bytes for g in self.kv_cache_groups if not g.host_resident),
                   default=0)
