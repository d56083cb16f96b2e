"""The HiSparse layout planner.

Given an ``EngineConfig`` and a model's ``kv_cache_spec`` (layer name -> spec), the planner

1. splits the layers into KV-cache groups (:func:`get_hisparse_kv_cache_groups`): the
   host-resident *source* group (every sparse-MLA layer), the GPU *indexer* group, pairs of
   GPU *resident* / *hot* groups over packed index groups, and *regular* groups (vLLM 0.33's
   rules, :func:`~hisparse_triton.regular_groups.group_regular_layers`);
2. sizes the host pool (:func:`create_hisparse_layout`);
3. sizes the shared device pool, places every layer's bytes in it and records the plan's
   topology (:func:`get_hisparse_kv_cache_config`, :func:`build_hisparse_topology`);
   optionally with row-aligned blocks (:func:`device_row_layout`);
4. reports how many max-length requests fit (:func:`get_hisparse_steady_state_concurrency`,
   against :func:`get_all_gpu_baseline_concurrency`), charging each group
   :func:`admission_blocks_per_request` at admission.

This module imports no torch: ``hisparse-triton plan`` must start fast.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Mapping, Optional, Sequence

from hisparse_triton.config import ACTIVE_TAIL_PAGES, EngineConfig
from hisparse_triton.regular_groups import (
    REGULAR_GROUP_SIZE_SLACK,
    group_regular_layers,
    regular_kv_cache_groups,
)
from hisparse_triton.specs import (
    GroupKind,
    HiSparseHotSpec,
    HiSparseIndexGroup,
    HiSparseResidentSpec,
    HiSparseTopology,
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

#: Group kinds reported by :func:`group_kind` (the values of :class:`GroupKind`).
GROUP_KINDS = tuple(kind.value for kind in GroupKind)

class HiSparsePlanWarning(UserWarning):
    """A plan that works but wastes memory (e.g. a hot buffer that is not whole pages)."""


def underlying_layer_name(group_layer_name: str) -> str:
    """The model layer behind a group-layer name (strips ``.hisparse_resident``/``_hot``)."""
    for suffix in HISPARSE_SUFFIXES:
        if group_layer_name.endswith(suffix):
            return group_layer_name[: -len(suffix)]
    return group_layer_name


def group_kind(group: KVCacheGroupSpec) -> GroupKind:
    """What a group of a HiSparse layout holds: a ``GroupKind`` (a ``str`` equal to one of
    ``GROUP_KINDS``).

    Read from the group's role and spec type; in a planned ``KVCacheConfig`` the
    ``hisparse_topology`` (``kind_of``) says the same and is the source of truth.
    """
    if group.role is KVCacheGroupRole.HISPARSE_SOURCE:
        return GroupKind.SOURCE
    if group.role is KVCacheGroupRole.HISPARSE_INDEXER:
        return GroupKind.INDEXER
    if isinstance(group.kv_cache_spec, HiSparseResidentSpec):
        return GroupKind.RESIDENT
    if isinstance(group.kv_cache_spec, HiSparseHotSpec):
        return GroupKind.HOT
    return GroupKind.REGULAR


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


def _device_buffer_warning(config: EngineConfig, block_size: int) -> Optional[str]:
    """The warning for a hot buffer that is not whole pages, or ``None``."""
    assert config.hisparse is not None
    size = config.hisparse.device_buffer_size
    if size % block_size == 0:
        return None
    blocks = cdiv(size, block_size)
    return (f"device_buffer_size={size} is not a multiple of block_size={block_size}: each "
            f"request's hot buffer takes {blocks} x {block_size} = {blocks * block_size} rows "
            f"per sparse layer and {blocks * block_size - size} of them are never used; use "
            f"a multiple of {block_size}.")


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
    packed hot group mixes page sizes. Regular layers are grouped by vLLM 0.33's rules
    (:func:`~hisparse_triton.regular_groups.group_regular_layers`). Warns (:class:`HiSparsePlanWarning`) when
    ``device_buffer_size`` is not a multiple of the block size.
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
    message = _device_buffer_warning(config, block_size)
    if message is not None:
        warnings.warn(message, HiSparsePlanWarning, stacklevel=2)

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

    regular = {name: spec for name, spec in specs.items() if name not in mla}
    regular_groups = regular_kv_cache_groups(regular)
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
    """``(group-layer name, page bytes)`` of a group, in placement order.

    Placement order is vLLM 0.33's: the group's layers gathered by equal spec, specs in
    first-seen order, each spec's layers in group order. A group with one spec keeps its
    layer order; with index sharing the source group places every leader first, then every
    follower (their specs differ in ``is_index_group_leader``).
    """
    spec = group.kv_cache_spec
    if not isinstance(spec, UniformTypeKVCacheSpecs):
        return [(name, spec.page_size_bytes) for name in group.layer_names]
    by_spec: dict[KVCacheSpec, list[str]] = {}
    for name in group.layer_names:
        by_spec.setdefault(spec.kv_cache_specs[name], []).append(name)
    return [(name, layer_spec.page_size_bytes)
            for layer_spec, names in by_spec.items() for name in names]


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
    """One layer-major tensor per source layer: ``[host_num_blocks * block_size, row]``,
    the regions in placement order (:func:`_layer_pages`, as vLLM 0.33 lays them out)."""
    tensors = []
    offset = 0
    for name, page in _layer_pages(source):
        region = host_num_blocks * page
        tensors.append(KVCacheTensor(size=region, layers=(name,), layer_stride=region,
                                     block_stride=page, offset=offset, host_resident=True))
        offset += region
    return tensors


def build_hisparse_topology(groups: Sequence[KVCacheGroupSpec]) -> HiSparseTopology:
    """The topology of planned ``groups`` (indices into ``groups``, in their order).

    ``groups`` is what :func:`get_hisparse_kv_cache_groups` returned (or a plan's
    ``kv_cache_groups``): one source group, one indexer group, resident and hot groups in
    matching order (``hot[i]`` holds the same layers as ``resident[i]``), regular groups.
    Index groups come from the source layers' leaders (:func:`split_index_groups`).
    ``ValueError`` when the groups are not such a plan.
    """
    by_kind: dict[str, list[int]] = {kind: [] for kind in GROUP_KINDS}
    for index, group in enumerate(groups):
        by_kind[group_kind(group)].append(index)
    for kind in ("source", "indexer"):
        if len(by_kind[kind]) != 1:
            raise ValueError(f"a HiSparse plan has exactly one {kind} group, got "
                             f"{len(by_kind[kind])}.")
    resident, hot = by_kind["resident"], by_kind["hot"]
    if len(resident) != len(hot):
        raise ValueError(f"a HiSparse plan pairs every resident group with a hot group, got "
                         f"{len(resident)} resident and {len(hot)} hot groups.")
    group_of: dict[str, tuple[int, int]] = {}
    for r, h in zip(resident, hot):
        layers = [underlying_layer_name(n) for n in groups[r].layer_names]
        if layers != [underlying_layer_name(n) for n in groups[h].layer_names]:
            raise ValueError(f"resident group {r} and hot group {h} do not hold the same "
                             f"layers in the same order.")
        for layer in layers:
            group_of[layer] = (r, h)
    source = groups[by_kind["source"][0]]
    spec = source.kv_cache_spec
    if not isinstance(spec, UniformTypeKVCacheSpecs):
        raise ValueError("the HiSparse source group must hold a UniformTypeKVCacheSpecs.")
    sparse = {name: spec.kv_cache_specs[name] for name in source.layer_names}
    index_groups = []
    for layers in split_index_groups(sparse):  # type: ignore[arg-type]
        places = {group_of.get(layer) for layer in layers}
        if len(places) != 1 or None in places:
            raise ValueError(f"the index group of {layers[0]!r} is not held by exactly one "
                             f"resident/hot pair.")
        r, h = places.pop()  # type: ignore[misc]
        index_groups.append(HiSparseIndexGroup(leader=layers[0], layers=layers,
                                               resident_group=r, hot_group=h))
    if len(group_of) != len(sparse):
        raise ValueError(f"the resident groups hold {len(group_of)} sparse layers, the source "
                         f"group {len(sparse)}.")
    return HiSparseTopology(
        source_group=by_kind["source"][0], indexer_group=by_kind["indexer"][0],
        resident_groups=tuple(resident), hot_groups=tuple(hot),
        regular_groups=tuple(by_kind["regular"]), index_groups=tuple(index_groups))


def row_alignment_bytes(groups: Sequence[KVCacheGroupSpec]) -> int:
    """The least common multiple of the resident/hot groups' per-layer page sizes (1 if none).

    A block stride that is a multiple of it makes every sparse layer's device cache a flat
    row array (see :func:`device_row_layout`).
    """
    pages = {g.layer_page_size_bytes for g in groups if group_kind(g) in ("resident", "hot")}
    return math.lcm(*pages) if pages else 1


def device_bytes_per_block(groups: Sequence[KVCacheGroupSpec], *,
                           row_aligned_blocks: bool = False) -> int:
    """Bytes of one device pool block for ``groups``: the largest device group page, rounded
    up to :func:`row_alignment_bytes` when ``row_aligned_blocks``."""
    device = [g for g in groups if not g.host_resident]
    if not device:
        raise ValueError("the plan has no device groups.")
    largest = max(g.page_size_bytes for g in device)
    return round_up(largest, row_alignment_bytes(device)) if row_aligned_blocks else largest


def get_hisparse_kv_cache_config(config: EngineConfig, groups: Sequence[KVCacheGroupSpec],
                                 available_memory: int, host_budget: int, *,
                                 row_aligned_blocks: bool = False) -> KVCacheConfig:
    """Plan both pools: the shared device pool of ``available_memory`` bytes and the host pool.

    ``bytes_per_block`` is the largest device group page, rounded up to the least common
    multiple of the resident/hot per-layer pages when ``row_aligned_blocks`` (so that
    :func:`device_row_layout` can view each sparse layer as a flat row array; it costs the
    rounding in every block). ``num_blocks = available_memory // bytes_per_block`` unless
    ``config.num_gpu_blocks_override`` is set. The result records ``bytes_per_block``,
    ``row_aligned_blocks`` and the ``hisparse_topology`` (:func:`build_hisparse_topology`).
    ``ValueError`` when the host pool is too small (see :func:`create_hisparse_layout`) or
    fewer than two device blocks (the null block and one usable block) fit.
    """
    _check_nonnegative_int("available_memory", available_memory)
    if not isinstance(row_aligned_blocks, bool):
        raise ValueError(f"row_aligned_blocks must be a bool, got {row_aligned_blocks!r}.")
    layout = create_hisparse_layout(config, groups, host_budget)
    kv_cache_groups = (layout.source_group, *layout.device_groups)
    topology = build_hisparse_topology(kv_cache_groups)
    bytes_per_block = device_bytes_per_block(layout.device_groups,
                                             row_aligned_blocks=row_aligned_blocks)
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
        kv_cache_groups=kv_cache_groups,
        hisparse_host_num_blocks=layout.host_num_blocks,
        hisparse_host_block_stride=layout.host_block_stride,
        hisparse_shared_host_pool=layout.shared_host_pool,
        bytes_per_block=bytes_per_block,
        row_aligned_blocks=row_aligned_blocks,
        hisparse_topology=topology,
    )


@dataclass(frozen=True)
class DeviceRowLayout:
    """One sparse layer's device cache as a flat ``[num_rows, row_bytes]`` uint8 array.

    The array starts ``offset_bytes`` into the device pool (the layer's byte offset inside
    block 0). Row ``slot`` of pool block ``block`` is flat row
    ``block * rows_per_block + slot``; ``rows_per_block = bytes_per_block // row_bytes``.
    ``num_rows = (num_blocks - 1) * rows_per_block + block_size`` covers every block's rows
    and ends inside the pool. Rows of the flat array between one block's ``block_size``
    rows and the next block's belong to other layers or groups: index only real row ids.
    """

    offset_bytes: int
    row_bytes: int
    rows_per_block: int
    num_rows: int
    block_size: int

    def flat_row(self, row_id: int) -> int:
        """The flat row of a per-layer row id ``block * block_size + slot``."""
        block, slot = divmod(row_id, self.block_size)
        return block * self.rows_per_block + slot


def device_row_layout(kv_cache_config: KVCacheConfig, layer_name: str) -> DeviceRowLayout:
    """The flat row view of one sparse layer of a row-aligned plan.

    ``layer_name``: an underlying sparse layer (``model.layers.3.self_attn.attn``; its
    resident and hot names share the bytes and are accepted too). ``ValueError`` when the
    plan is not a HiSparse plan, was not planned with ``row_aligned_blocks=True``, or the
    layer is not one of its sparse layers.
    """
    topology = kv_cache_config.hisparse_topology
    if topology is None:
        raise ValueError("device_row_layout needs a HiSparse plan (hisparse_topology is None).")
    if not kv_cache_config.row_aligned_blocks:
        raise ValueError(f"the plan is not row-aligned (bytes_per_block "
                         f"{kv_cache_config.bytes_per_block} B); plan with "
                         f"get_hisparse_kv_cache_config(..., row_aligned_blocks=True) to view "
                         f"sparse layers as flat row arrays.")
    layer = underlying_layer_name(layer_name) if isinstance(layer_name, str) else layer_name
    try:
        group = kv_cache_config.kv_cache_groups[topology.resident_group_of(layer)]
    except ValueError:
        raise ValueError(f"{layer_name!r} is not a sparse layer of this plan; only sparse "
                         f"layers (resident/hot groups) have a flat row view.") from None
    resident_name = layer + HISPARSE_RESIDENT_SUFFIX
    tensor = next(t for t in kv_cache_config.kv_cache_tensors
                  if not t.host_resident and resident_name in t.layers)
    block_size = group.block_size
    row_bytes = group.layer_page_size_bytes // block_size
    bytes_per_block = kv_cache_config.bytes_per_block
    if bytes_per_block % group.layer_page_size_bytes:  # pragma: no cover - KVCacheConfig checks
        raise ValueError(f"bytes_per_block {bytes_per_block} is not a multiple of "
                         f"{layer!r}'s page.")
    rows_per_block = bytes_per_block // row_bytes
    return DeviceRowLayout(
        offset_bytes=tensor.offset, row_bytes=row_bytes, rows_per_block=rows_per_block,
        num_rows=(kv_cache_config.num_blocks - 1) * rows_per_block + block_size,
        block_size=block_size)


@dataclass(frozen=True)
class HiSparseConcurrency:
    """How many requests at ``max_model_len`` a HiSparse plan holds, and why.

    - ``admission_blocks``: device blocks one request needs when admitted (every device
      group's :func:`admission_blocks_per_request`).
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


def admission_blocks_per_request(config: EngineConfig, group: KVCacheGroupSpec) -> int:
    """Blocks ``group`` charges a request at ``max_model_len`` when it is admitted.

    A resident group holds only what one step writes before its pages are mirrored to the
    host and released: ``cdiv(config.in_flight_tokens, block_size)`` pages, i.e.
    ``cdiv(min(max_num_batched_tokens, max_model_len), block_size)`` (the whole request
    when ``max_num_batched_tokens`` is unset). Every other group charges its
    ``blocks_per_request``: the whole history (indexer, full attention), the window plus
    the in-flight tokens (sliding window), the hot buffer (hot), host blocks (source).
    """
    if isinstance(group.kv_cache_spec, HiSparseResidentSpec):
        return cdiv(config.in_flight_tokens, group.block_size)
    return group.blocks_per_request(config)


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
        admission += admission_blocks_per_request(config, group)
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
    ``1 + (num_blocks - admission) / steady``: a request must first be admitted (every
    group's :func:`admission_blocks_per_request`), then pins only ``steady`` blocks once its
    sparse history has moved to the host.
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
    "REGULAR_GROUP_SIZE_SLACK",
    "SHARED_HOST_POOL_ALIGNMENT",
    "DeviceRowLayout",
    "GroupKind",
    "HiSparseConcurrency",
    "HiSparseIndexGroup",
    "HiSparseLayout",
    "HiSparsePlanWarning",
    "HiSparseTopology",
    "admission_blocks_per_request",
    "build_hisparse_topology",
    "create_hisparse_layout",
    "device_bytes_per_block",
    "device_row_layout",
    "get_all_gpu_baseline_concurrency",
    "get_all_gpu_bytes_per_request",
    "get_hisparse_concurrency",
    "get_hisparse_kv_cache_config",
    "get_hisparse_kv_cache_groups",
    "get_hisparse_steady_state_concurrency",
    "group_kind",
    "group_regular_layers",
    "row_alignment_bytes",
    "split_index_groups",
    "steady_blocks_per_request",
    "underlying_layer_name",
]
