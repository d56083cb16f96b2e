"""The HiSparse layout planner (DESIGN.md section 5).

Given an ``EngineConfig`` and a model's ``kv_cache_spec`` (layer name -> spec), the planner

1. splits the layers into KV-cache groups (:func:`get_hisparse_kv_cache_groups`): the
   host-resident *source* group (every sparse-MLA layer), the GPU *indexer* group, pairs of
   GPU *resident* / *hot* groups over packed index groups, and *regular* groups;
2. sizes the host pool (:func:`create_hisparse_layout`);
3. sizes the shared device pool and places every layer's bytes in it
   (:func:`get_hisparse_kv_cache_config`);
4. reports how many max-length requests fit (:func:`get_hisparse_steady_state_concurrency`,
   against :func:`get_all_gpu_baseline_concurrency`).

This module imports no torch: ``hisparse-triton plan`` must start fast.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Optional, Sequence

from hisparse_triton.config import ACTIVE_TAIL_PAGES, EngineConfig
from hisparse_triton.specs import (
    HiSparseHotSpec,
    HiSparseResidentSpec,
    KVCacheConfig,
    KVCacheGroupRole,
    KVCacheGroupSpec,
    KVCacheSpec,
    KVCacheTensor,
    MLAAttentionSpec,
    SparseCacheRole,
    UniformTypeKVCacheSpecs,
    cdiv,
    round_up,
)

#: Suffix of a sparse layer's name in its resident group (the GPU write target).
HISPARSE_RESIDENT_SUFFIX = ".hisparse_resident"
#: Suffix of a sparse layer's name in its hot group (the per-request hot buffer).
HISPARSE_HOT_SUFFIX = ".hisparse_hot"
#: Every suffix the planner appends to an underlying layer name.
HISPARSE_SUFFIXES = (HISPARSE_RESIDENT_SUFFIX, HISPARSE_HOT_SUFFIX)

#: Host block strides are rounded up to this when the host pool is shared by TP ranks.
SHARED_HOST_POOL_ALIGNMENT = 4096

#: Group kinds reported by :func:`group_kind`.
GROUP_KINDS = ("source", "indexer", "resident", "hot", "regular")


def underlying_layer_name(group_layer_name: str) -> str:
    """The model layer behind a group-layer name (strips ``.hisparse_resident``/``_hot``)."""
    for suffix in HISPARSE_SUFFIXES:
        if group_layer_name.endswith(suffix):
            return group_layer_name[: -len(suffix)]
    return group_layer_name


def group_kind(group: KVCacheGroupSpec) -> str:
    """One of ``GROUP_KINDS``: what a group of a HiSparse layout holds."""
    if group.role is KVCacheGroupRole.HISPARSE_SOURCE:
        return "source"
    if group.role is KVCacheGroupRole.HISPARSE_INDEXER:
        return "indexer"
    if isinstance(group.kv_cache_spec, HiSparseResidentSpec):
        return "resident"
    if isinstance(group.kv_cache_spec, HiSparseHotSpec):
        return "hot"
    return "regular"


def _is_derived(spec: KVCacheSpec) -> bool:
    return isinstance(spec, (HiSparseResidentSpec, HiSparseHotSpec))


def split_index_groups(sparse_specs: Mapping[str, MLAAttentionSpec]) -> list[tuple[str, ...]]:
    """Index groups (hot units) of the SPARSE layers, in order.

    A new group starts at every index-group leader; the first SPARSE layer always starts one.
    Returns tuples of layer names, leader first.
    """
    units: list[list[str]] = []
    for name, spec in sparse_specs.items():
        if spec.is_index_group_leader or not units:
            units.append([])
        units[-1].append(name)
    return [tuple(unit) for unit in units]


def _pack_units(units: Sequence[tuple[str, ...]], unit_bytes: Sequence[int],
                limit: int) -> list[list[str]]:
    """Greedy packing of consecutive units into groups of summed bytes ``<= limit``.

    A unit larger than ``limit`` stands alone.
    """
    packed: list[list[str]] = []
    current: list[str] = []
    current_bytes = 0
    for unit, size in zip(units, unit_bytes):
        if current and current_bytes + size > limit:
            packed.append(current)
            current, current_bytes = [], 0
        current.extend(unit)
        current_bytes += size
    if current:
        packed.append(current)
    return packed


def get_hisparse_kv_cache_groups(
    config: EngineConfig, kv_cache_spec: Mapping[str, KVCacheSpec]
) -> Optional[list[KVCacheGroupSpec]]:
    """Split ``kv_cache_spec`` into HiSparse groups, or ``None`` when HiSparse does not apply.

    Order: ``[source, indexer, *resident, *hot, *regular]``. ``None`` when
    ``config.hisparse`` is None or no layer has an ``MLAAttentionSpec``. Derived
    ``HiSparseResidentSpec``/``HiSparseHotSpec`` entries of the input are ignored.
    ``ValueError`` when the MLA layers lack SPARSE or INDEXER specs, mix block sizes, or a
    packed hot group mixes page sizes.
    """
    if config.hisparse is None:
        return None
    specs = {name: spec for name, spec in kv_cache_spec.items() if not _is_derived(spec)}
    mla = {name: spec for name, spec in specs.items() if isinstance(spec, MLAAttentionSpec)}
    if not mla:
        return None
    sparse = {n: s for n, s in mla.items() if s.cache_role is SparseCacheRole.SPARSE}
    indexer = {n: s for n, s in mla.items() if s.cache_role is SparseCacheRole.INDEXER}
    if not sparse or not indexer:
        missing, present = ("SPARSE", "INDEXER") if not sparse else ("INDEXER", "SPARSE")
        raise ValueError(f"HiSparse needs both SPARSE and INDEXER MLA layers, but the MLA "
                         f"group has no {missing} layers (only {len(mla)} {present} layers).")
    block_sizes = sorted({spec.block_size for spec in mla.values()})
    if len(block_sizes) != 1:
        raise ValueError(f"HiSparse MLA layers must share one block size, got block sizes "
                         f"{block_sizes}.")
    block_size = block_sizes[0]

    source_group = KVCacheGroupSpec(
        tuple(sparse), UniformTypeKVCacheSpecs.from_specs(sparse),
        role=KVCacheGroupRole.HISPARSE_SOURCE, host_resident=True)
    indexer_group = KVCacheGroupSpec(
        tuple(indexer), UniformTypeKVCacheSpecs.from_specs(indexer),
        role=KVCacheGroupRole.HISPARSE_INDEXER)

    indexer_page = indexer_group.page_size_bytes
    units = split_index_groups(sparse)
    unit_bytes = [sum(sparse[name].page_size_bytes for name in unit) for unit in units]
    hot_blocks = cdiv(config.hisparse.device_buffer_size, block_size)
    resident_groups: list[KVCacheGroupSpec] = []
    hot_groups: list[KVCacheGroupSpec] = []
    for layers in _pack_units(units, unit_bytes, indexer_page):
        pages = {sparse[name].page_size_bytes for name in layers}
        if len(pages) != 1:
            raise ValueError(f"HiSparse hot-group layers must share one page size, but "
                             f"layers {layers[0]!r}..{layers[-1]!r} have page sizes "
                             f"{sorted(pages)} B.")
        page = pages.pop()
        resident_groups.append(KVCacheGroupSpec(
            tuple(name + HISPARSE_RESIDENT_SUFFIX for name in layers),
            HiSparseResidentSpec(block_size=block_size, page_size=page),
            enable_kv_transfer=False))
        hot_groups.append(KVCacheGroupSpec(
            tuple(name + HISPARSE_HOT_SUFFIX for name in layers),
            HiSparseHotSpec(block_size=block_size, page_size=page,
                            blocks_per_request=hot_blocks),
            enable_kv_transfer=False))

    regular: dict[KVCacheSpec, list[str]] = {}
    for name, spec in specs.items():
        if name not in mla:
            regular.setdefault(spec, []).append(name)
    regular_groups = [KVCacheGroupSpec(tuple(names), spec) for spec, names in regular.items()]
    return [source_group, indexer_group, *resident_groups, *hot_groups, *regular_groups]


@dataclass(frozen=True)
class HiSparseLayout:
    """Where the groups live and how big the host pool is.

    - ``source_group``: the host-resident sparse-MLA group.
    - ``device_groups``: every other group, in planner order.
    - ``host_num_blocks``: host pool blocks (block 0 is the null block).
    - ``host_block_stride``: host bytes per block over all source layers (4096-aligned when
      shared).
    - ``shared_host_pool``: one host pool serves all TP ranks of the node.
    """

    source_group: KVCacheGroupSpec
    device_groups: tuple[KVCacheGroupSpec, ...]
    host_num_blocks: int
    host_block_stride: int
    shared_host_pool: bool

    def __post_init__(self) -> None:
        object.__setattr__(self, "device_groups", tuple(self.device_groups))

    def groups_of_kind(self, kind: str) -> tuple[KVCacheGroupSpec, ...]:
        """Device groups of one kind (``"indexer"``, ``"resident"``, ``"hot"``, ``"regular"``)."""
        if kind not in GROUP_KINDS:
            raise ValueError(f"unknown group kind {kind!r}; use one of {GROUP_KINDS}.")
        return tuple(g for g in self.device_groups if group_kind(g) == kind)

    @property
    def index_groups(self) -> list[tuple[str, ...]]:
        """Index groups of the source layers (leader first), see :func:`split_index_groups`."""
        spec = self.source_group.kv_cache_spec
        assert isinstance(spec, UniformTypeKVCacheSpecs)
        return split_index_groups(spec.kv_cache_specs)  # type: ignore[arg-type]

    @property
    def host_pool_bytes(self) -> int:
        """Bytes the host pool needs: ``host_num_blocks * host_block_stride``."""
        return self.host_num_blocks * self.host_block_stride


def _check_nonnegative_int(name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{name} must be an int >= 0 (bytes), got {value!r}.")


def create_hisparse_layout(config: EngineConfig, groups: Sequence[KVCacheGroupSpec],
                           host_budget: int) -> HiSparseLayout:
    """Size the host pool for ``groups`` (from :func:`get_hisparse_kv_cache_groups`).

    ``host_budget``: bytes of host memory for the pool. ``ValueError`` unless exactly one
    group is host-resident, when no host block fits, or when fewer blocks fit than one
    request at ``max_model_len`` needs (plus the null block and a copy-on-write tail).
    """
    _check_nonnegative_int("host_budget", host_budget)
    if groups is None:
        raise ValueError("HiSparse layout needs KV-cache groups, got None (HiSparse is not "
                         "enabled or the model has no MLA layers).")
    host_groups = [g for g in groups if g.host_resident]
    if len(host_groups) != 1:
        raise ValueError(f"HiSparse layout needs exactly one host-resident group, got "
                         f"{len(host_groups)}.")
    source = host_groups[0]
    shared = config.shared_host_pool
    stride = source.page_size_bytes
    if shared:
        stride = round_up(stride, SHARED_HOST_POOL_ALIGNMENT)
    host_num_blocks = host_budget // stride
    if host_num_blocks <= 0:
        raise ValueError("HiSparse has no allocatable host blocks.")
    needed = cdiv(config.max_model_len, source.block_size) + 2
    if host_num_blocks < needed:
        raise ValueError(
            f"HiSparse host pool has {host_num_blocks} blocks but one request at "
            f"max_model_len={config.max_model_len} needs {needed} (including the null block "
            f"and a copy-on-write tail); increase host_pool_gib.")
    return HiSparseLayout(
        source_group=source,
        device_groups=tuple(g for g in groups if not g.host_resident),
        host_num_blocks=host_num_blocks,
        host_block_stride=stride,
        shared_host_pool=shared,
    )


def _layer_pages(group: KVCacheGroupSpec) -> list[tuple[str, int]]:
    """``(group-layer name, page bytes)`` of a group, in in-block order."""
    spec = group.kv_cache_spec
    if isinstance(spec, UniformTypeKVCacheSpecs):
        return [(name, spec.kv_cache_specs[name].page_size_bytes) for name in group.layer_names]
    return [(name, spec.page_size_bytes) for name in group.layer_names]


def _device_tensors(groups: Sequence[KVCacheGroupSpec], num_blocks: int,
                    bytes_per_block: int) -> list[KVCacheTensor]:
    """One tensor per underlying device layer.

    Every group lays its layers one page apart from offset 0 of each block it owns (a
    block belongs to one group at a time), so a sparse layer sits at the same offset in its
    resident and its hot group and both names share one tensor.
    """
    placed: dict[str, tuple[int, int]] = {}  # underlying layer -> (offset, page)
    names: dict[str, list[str]] = {}
    for group in groups:
        derived = group_kind(group) in ("resident", "hot")
        offset = 0
        for name, page in _layer_pages(group):
            layer = underlying_layer_name(name) if derived else name
            if layer in placed and placed[layer] != (offset, page):
                raise ValueError(f"layer {layer!r} would sit at byte {offset} ({page} B pages) "
                                 f"in one group and at byte {placed[layer][0]} "
                                 f"({placed[layer][1]} B pages) in another.")
            placed[layer] = (offset, page)
            names.setdefault(layer, []).append(name)
            offset += page
    return [KVCacheTensor(size=num_blocks * page, layers=tuple(names[layer]), layer_stride=page,
                          block_stride=bytes_per_block, offset=offset, host_resident=False)
            for layer, (offset, page) in placed.items()]


def _host_tensors(source: KVCacheGroupSpec, host_num_blocks: int) -> list[KVCacheTensor]:
    """One layer-major tensor per source layer: ``[host_num_blocks * block_size, row]``."""
    tensors = []
    offset = 0
    for name, page in _layer_pages(source):
        region = host_num_blocks * page
        tensors.append(KVCacheTensor(size=region, layers=(name,), layer_stride=region,
                                     block_stride=page, offset=offset, host_resident=True))
        offset += region
    return tensors


def get_hisparse_kv_cache_config(config: EngineConfig, groups: Sequence[KVCacheGroupSpec],
                                 available_memory: int, host_budget: int) -> KVCacheConfig:
    """Plan both pools: the shared device pool of ``available_memory`` bytes and the host pool.

    ``bytes_per_block`` is the largest device group page; ``num_blocks =
    available_memory // bytes_per_block`` unless ``config.num_gpu_blocks_override`` is set.
    ``ValueError`` when the host pool is too small (see :func:`create_hisparse_layout`) or
    fewer than two device blocks (the null block and one usable block) fit.
    """
    _check_nonnegative_int("available_memory", available_memory)
    layout = create_hisparse_layout(config, groups, host_budget)
    bytes_per_block = max(g.page_size_bytes for g in layout.device_groups)
    if config.num_gpu_blocks_override is not None:
        num_blocks = config.num_gpu_blocks_override
    else:
        num_blocks = available_memory // bytes_per_block
    if num_blocks < 2:
        raise ValueError(
            f"HiSparse has {num_blocks} device blocks of {bytes_per_block} B (available "
            f"memory {available_memory} B); it needs at least 2 (the null block and one "
            f"usable block).")
    tensors = [*_host_tensors(layout.source_group, layout.host_num_blocks),
               *_device_tensors(layout.device_groups, num_blocks, bytes_per_block)]
    return KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=tuple(tensors),
        kv_cache_groups=(layout.source_group, *layout.device_groups),
        hisparse_host_num_blocks=layout.host_num_blocks,
        hisparse_host_block_stride=layout.host_block_stride,
        hisparse_shared_host_pool=layout.shared_host_pool,
    )


@dataclass(frozen=True)
class HiSparseConcurrency:
    """How many requests at ``max_model_len`` a HiSparse plan holds, and why.

    - ``admission_blocks``: device blocks one request needs when admitted (every device
      group's full ``blocks_per_request``).
    - ``steady_blocks``: device blocks it pins at steady state (resident groups keep only
      ``ACTIVE_TAIL_PAGES`` pages).
    - ``host_blocks_per_request``: source-group blocks of one request.
    - ``gpu``, ``host``: the device-side and host-side limits; ``steady_state`` their min.
    """

    admission_blocks: int
    steady_blocks: int
    host_blocks_per_request: int
    gpu: float
    host: float

    @property
    def steady_state(self) -> float:
        return min(self.gpu, self.host)

    @property
    def limited_by(self) -> str:
        """``"host"`` or ``"gpu"``: which pool caps the steady-state concurrency."""
        return "host" if self.host < self.gpu else "gpu"


def steady_blocks_per_request(config: EngineConfig, group: KVCacheGroupSpec) -> int:
    """Device blocks a request at ``max_model_len`` pins in ``group`` at steady state.

    A resident group keeps only its last ``ACTIVE_TAIL_PAGES`` pages; every other group
    keeps what admission gave it (``group.blocks_per_request``).
    """
    blocks = group.blocks_per_request(config)
    if isinstance(group.kv_cache_spec, HiSparseResidentSpec):
        return min(blocks, ACTIVE_TAIL_PAGES)
    return blocks


def get_hisparse_concurrency(config: EngineConfig,
                             kv_cache_config: KVCacheConfig) -> HiSparseConcurrency:
    """The breakdown behind :func:`get_hisparse_steady_state_concurrency`."""
    sources = [g for g in kv_cache_config.kv_cache_groups if g.host_resident]
    if len(sources) != 1:
        raise ValueError(f"a HiSparse KVCacheConfig has exactly one host-resident group, got "
                         f"{len(sources)}.")
    admission = 0
    steady = 0
    for group in kv_cache_config.kv_cache_groups:
        if group.host_resident:
            continue
        admission += group.blocks_per_request(config)
        steady += steady_blocks_per_request(config, group)
    num_blocks = kv_cache_config.num_blocks
    if admission == 0:
        gpu = float("inf")
    elif num_blocks < admission:
        gpu = num_blocks / admission
    else:
        gpu = 1 + (num_blocks - admission) / steady
    host_per_request = sources[0].blocks_per_request(config)
    host = kv_cache_config.hisparse_host_num_blocks / host_per_request
    return HiSparseConcurrency(admission_blocks=admission, steady_blocks=steady,
                               host_blocks_per_request=host_per_request, gpu=gpu, host=host)


def get_hisparse_steady_state_concurrency(config: EngineConfig,
                                          kv_cache_config: KVCacheConfig) -> float:
    """Requests at ``max_model_len`` the plan holds at steady state.

    ``min(gpu, host_num_blocks / host_blocks_per_request)`` where ``gpu =
    num_blocks / admission`` if ``num_blocks < admission`` else
    ``1 + (num_blocks - admission) / steady`` (DESIGN.md section 5).
    """
    return get_hisparse_concurrency(config, kv_cache_config).steady_state


def get_all_gpu_bytes_per_request(config: EngineConfig,
                                  kv_cache_spec: Mapping[str, KVCacheSpec]) -> int:
    """GPU bytes one request at ``max_model_len`` needs when every layer stays on the GPU.

    Sums ``max_memory_usage_bytes`` over the model's layers (sparse MLA, indexer, regular);
    derived HiSparse specs in the input are ignored.
    """
    total = sum(spec.max_memory_usage_bytes(config)
                for spec in kv_cache_spec.values() if not _is_derived(spec))
    if total <= 0:
        raise ValueError("kv_cache_spec has no layers to place.")
    return total


def get_all_gpu_baseline_concurrency(config: EngineConfig,
                                     kv_cache_spec: Mapping[str, KVCacheSpec],
                                     available_memory: int) -> float:
    """Requests at ``max_model_len`` that fit ``available_memory`` GPU bytes without HiSparse.

    The baseline the HiSparse figure is compared with: every layer's full history (the
    sparse-MLA KV included) on the GPU, ``available_memory / bytes_per_request``.
    """
    _check_nonnegative_int("available_memory", available_memory)
    return available_memory / get_all_gpu_bytes_per_request(config, kv_cache_spec)


__all__ = [
    "GROUP_KINDS",
    "HISPARSE_HOT_SUFFIX",
    "HISPARSE_RESIDENT_SUFFIX",
    "HISPARSE_SUFFIXES",
    "SHARED_HOST_POOL_ALIGNMENT",
    "HiSparseConcurrency",
    "HiSparseLayout",
    "create_hisparse_layout",
    "get_all_gpu_baseline_concurrency",
    "get_all_gpu_bytes_per_request",
    "get_hisparse_concurrency",
    "get_hisparse_kv_cache_config",
    "get_hisparse_kv_cache_groups",
    "get_hisparse_steady_state_concurrency",
    "group_kind",
    "split_index_groups",
    "steady_blocks_per_request",
    "underlying_layer_name",
]
