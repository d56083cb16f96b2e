"""Device group kinds as types, and the group structure of a HiSparse plan (no torch).

A HiSparse ``KVCacheConfig`` holds one host-resident source group and several device groups.
Each device group is handled by one small class chosen from ``GROUP_KIND_BY_SPEC`` by the type
of its spec (the indexer group by its role), and each class owns its rules:

| kind | class | block-table width | pages it holds | released |
| --- | --- | --- | --- | --- |
| indexer | ``IndexerGroup`` | ``cdiv(max_model_len, B)`` | every page of the request | at free |
| regular | ``RegularGroup`` | ``cdiv(max_model_len, B)`` | every page | at free |
| sliding window | ``SlidingWindowGroup`` | ``cdiv(max_model_len, B)`` | pages a future query can see | once out of every future window, and at free |
| resident | ``ResidentGroup`` | ``cdiv(max_model_len, B)`` | the GPU copy of sparse-MLA pages (a cache of the host pool) | by the residency rules of the scheduler |
| hot | ``HotGroup`` | ``blocks_per_request`` | the request's hot region (fixed size) | at free |

``PlanGroups.from_config`` reads the plan once: the groups in config order, the resident <->
hot pairing and the index groups (leader first) from the planner's topology
(``kv_cache_config.hisparse_topology``; nothing is derived from layer names). Both halves of the runtime (``HiSparseScheduler`` and ``HiSparseWorker``) build
it from the same ``KVCacheConfig``, so they agree on every position without talking.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Mapping, Optional

from hisparse_triton.config import EngineConfig
from hisparse_triton.layout import (
    HISPARSE_HOT_SUFFIX,
    HISPARSE_RESIDENT_SUFFIX,
    underlying_layer_name,
)
from hisparse_triton.specs import (
    FullAttentionSpec,
    GroupKind,
    HiSparseHotSpec,
    HiSparseResidentSpec,
    HiSparseTopology,
    KVCacheConfig,
    KVCacheGroupRole,
    KVCacheGroupSpec,
    KVCacheSpec,
    KVCacheTensor,
    SlidingWindowSpec,
    UniformTypeKVCacheSpecs,
    cdiv,
)


@dataclass(frozen=True)
class DeviceGroup:
    """One device group of the plan.

    - ``position``: index among the device groups (config order, the source group left out).
    - ``config_index``: index in ``kv_cache_config.kv_cache_groups``.
    - ``width``: block-table columns per request.
    """

    #: What the group holds (the one vocabulary of group kinds, shared with the planner).
    kind: ClassVar[GroupKind]
    #: Whether the group holds one block per page of the request (its table grows with it).
    paged: ClassVar[bool] = True

    position: int
    config_index: int
    spec: KVCacheGroupSpec
    block_size: int
    width: int

    @property
    def layer_names(self) -> tuple[str, ...]:
        """The group's layer names as the planner wrote them."""
        return self.spec.layer_names

    @property
    def model_layer_names(self) -> tuple[str, ...]:
        """The model layer names the caller writes KV for (suffixes stripped)."""
        return tuple(underlying_layer_name(name) for name in self.spec.layer_names)

    def pages(self, num_tokens: int) -> int:
        """Pages ``num_tokens`` tokens occupy in this group."""
        return cdiv(num_tokens, self.block_size)

    def new_pages(self, old_len: int, new_len: int) -> int:
        """Blocks growing a request from ``old_len`` to ``new_len`` tokens takes."""
        return self.pages(new_len) - self.pages(old_len) if self.paged else 0

    def releasable_pages(self, committed_len: int) -> int:
        """Leading pages no future query of a request with ``committed_len`` committed tokens
        reads (released before the request ends); 0 for groups that keep every page."""
        return 0


class IndexerGroup(DeviceGroup):
    """The indexer layers' K cache: the whole history stays on the GPU (it scores all of it)."""

    kind = GroupKind.INDEXER


class RegularGroup(DeviceGroup):
    """A full-attention group (no HiSparse): every page stays on the GPU until the request ends."""

    kind = GroupKind.REGULAR


class SlidingWindowGroup(RegularGroup):
    """A sliding-window group: pages that left every future query's window are released."""

    @property
    def window_spec(self) -> SlidingWindowSpec:
        """The group's ``SlidingWindowSpec`` (a ``UniformTypeKVCacheSpecs``' first spec)."""
        spec = self.spec.kv_cache_spec
        if isinstance(spec, UniformTypeKVCacheSpecs):
            spec = spec.first_spec
        assert isinstance(spec, SlidingWindowSpec)
        return spec

    @property
    def window(self) -> int:
        return self.window_spec.sliding_window

    def releasable_pages(self, committed_len: int) -> int:
        # Future queries start at position committed_len and see the last `window` tokens
        # (committed_len - window + 1 on); the spec keeps extra_retained_tokens more.
        retained = self.window_spec.num_retained_tokens
        return max(0, committed_len - retained) // self.block_size


class ResidentGroup(DeviceGroup):
    """GPU pages of a set of sparse-MLA layers: where new KV is written, a cache of host."""

    kind = GroupKind.RESIDENT


class HotGroup(DeviceGroup):
    """Per-request hot-buffer pages of the same layers as its resident group (fixed size)."""

    kind = GroupKind.HOT
    paged = False


#: The kinds a device group can have (every kind but the host-resident source), in the order
#: occupancy is reported.
DEVICE_KINDS: tuple[GroupKind, ...] = (GroupKind.INDEXER, GroupKind.RESIDENT, GroupKind.HOT,
                                       GroupKind.REGULAR)

#: Device group class by spec type (the indexer group is picked by its role first).
GROUP_KIND_BY_SPEC: dict[type[KVCacheSpec], type[DeviceGroup]] = {
    HiSparseResidentSpec: ResidentGroup,
    HiSparseHotSpec: HotGroup,
    SlidingWindowSpec: SlidingWindowGroup,
    FullAttentionSpec: RegularGroup,
    UniformTypeKVCacheSpecs: RegularGroup,
}


def group_class(spec: KVCacheGroupSpec) -> type[DeviceGroup]:
    """The ``DeviceGroup`` class that handles ``spec`` (``ValueError`` for an unknown type)."""
    if spec.role is KVCacheGroupRole.HISPARSE_INDEXER:
        return IndexerGroup
    kv_spec = spec.kv_cache_spec
    if isinstance(kv_spec, UniformTypeKVCacheSpecs) \
            and isinstance(kv_spec.first_spec, SlidingWindowSpec):
        kv_spec = kv_spec.first_spec     # its layers share one kind: windows of one size
    for klass in type(kv_spec).__mro__:
        if klass in GROUP_KIND_BY_SPEC:
            return GROUP_KIND_BY_SPEC[klass]
    raise ValueError(f"no device group kind handles spec type "
                     f"{type(spec.kv_cache_spec).__name__} (layers {spec.layer_names[:3]}).")


@dataclass(frozen=True)
class IndexGroup:
    """A leader sparse layer and the followers sharing its indexer (one resolve for all).

    ``resident`` / ``hot``: positions (among the device groups) of the groups holding their
    pages; ``number``: the index group's rank in model order.
    """

    number: int
    leader: str
    layers: tuple[str, ...]
    resident: int
    hot: int


@dataclass(frozen=True)
class PlanGroups:
    """The group structure of one HiSparse ``KVCacheConfig`` (see the module docstring)."""

    block_size: int
    max_model_len: int
    source: KVCacheGroupSpec
    source_layers: tuple[str, ...]
    groups: tuple[DeviceGroup, ...]
    index_groups: tuple[IndexGroup, ...]
    hot_of: Mapping[int, int]                 # resident position -> hot position
    resident_of_layer: Mapping[str, int]      # sparse layer -> resident position
    layer_group: Mapping[str, int]            # group-layer name -> device group position
    resident_layer_name: Mapping[str, str]    # sparse layer -> its resident group-layer name
    host_tensors: Mapping[str, KVCacheTensor]
    device_tensors: Mapping[str, KVCacheTensor]

    @classmethod
    def from_config(cls, kvc: KVCacheConfig, config: EngineConfig) -> "PlanGroups":
        """Read ``kvc`` once; ``ValueError`` naming what a HiSparse plan lacks."""
        sources = [g for g in kvc.kv_cache_groups if g.host_resident]
        if len(sources) != 1:
            raise ValueError(f"a HiSparse KVCacheConfig has exactly one host-resident group, "
                             f"got {len(sources)}.")
        source = sources[0]
        src_spec = source.kv_cache_spec
        if not isinstance(src_spec, UniformTypeKVCacheSpecs):
            raise ValueError("the source group's spec must be UniformTypeKVCacheSpecs (one "
                             "MLAAttentionSpec per sparse layer, as the planner makes it).")
        host_tensors: dict[str, KVCacheTensor] = {}
        device_tensors: dict[str, KVCacheTensor] = {}
        for tensor in kvc.kv_cache_tensors:
            target = host_tensors if tensor.host_resident else device_tensors
            for name in tensor.layers:
                target[name] = tensor
        source_layers = tuple(source.layer_names)
        for layer in source_layers:
            if layer not in host_tensors:
                raise ValueError(f"source layer {layer!r} has no host KVCacheTensor.")

        groups: list[DeviceGroup] = []
        config_index: dict[int, int] = {}  # kv_cache_groups index -> device position
        layer_group: dict[str, int] = {}
        for index, spec in enumerate(kvc.kv_cache_groups):
            if spec.host_resident:
                continue
            klass = group_class(spec)
            B = spec.block_size
            width = (spec.kv_cache_spec.blocks_per_request  # type: ignore[attr-defined]
                     if klass is HotGroup else cdiv(config.max_model_len, B))
            position = len(groups)
            config_index[index] = position
            groups.append(klass(position=position, config_index=index, spec=spec,
                                block_size=B, width=width))
            for name in spec.layer_names:
                if name not in device_tensors:
                    raise ValueError(f"device layer {name!r} has no KVCacheTensor.")
                layer_group[name] = position

        if kvc.hisparse_topology is None:
            raise ValueError("the KVCacheConfig carries no HiSparse topology (resident <-> "
                             "hot pairing, index groups): build it with "
                             "get_hisparse_kv_cache_config.")
        index_groups, hot_of = _from_topology(kvc.hisparse_topology, config_index)
        resident_of_layer = {layer: ig.resident for ig in index_groups for layer in ig.layers}
        missing = [layer for layer in source_layers if layer not in resident_of_layer]
        if missing:
            raise ValueError(f"source layers {missing} belong to no resident group.")
        resident_layer_name = {
            model: name for group in groups if isinstance(group, ResidentGroup)
            for model, name in zip(group.model_layer_names, group.layer_names)}
        return cls(block_size=source.block_size, max_model_len=config.max_model_len,
                   source=source, source_layers=source_layers, groups=tuple(groups),
                   index_groups=tuple(index_groups), hot_of=hot_of,
                   resident_of_layer=resident_of_layer, layer_group=layer_group,
                   resident_layer_name=resident_layer_name,
                   host_tensors=host_tensors, device_tensors=device_tensors)

    # ------------------------------------------------------------------ views
    def of_kind(self, klass: type[DeviceGroup]) -> tuple[DeviceGroup, ...]:
        """Device groups handled by ``klass`` (or a subclass), in config order."""
        return tuple(g for g in self.groups if isinstance(g, klass))

    @property
    def paged(self) -> tuple[DeviceGroup, ...]:
        """Groups whose block table grows with the request (all but hot)."""
        return tuple(g for g in self.groups if g.paged)

    @property
    def resident(self) -> tuple[DeviceGroup, ...]:
        return self.of_kind(ResidentGroup)

    @property
    def hot(self) -> tuple[DeviceGroup, ...]:
        return self.of_kind(HotGroup)

    @property
    def leaders(self) -> tuple[str, ...]:
        return tuple(ig.leader for ig in self.index_groups)

    def index_group_of(self, leader_layer: str) -> Optional[IndexGroup]:
        """The index group led by ``leader_layer`` (suffixes allowed), or None."""
        name = underlying_layer_name(leader_layer)
        for ig in self.index_groups:
            if ig.leader == name:
                return ig
        return None

    def leader_of(self, layer: str) -> Optional[str]:
        """The leader of the index group ``layer`` belongs to, or None."""
        name = underlying_layer_name(layer)
        for ig in self.index_groups:
            if name in ig.layers:
                return ig.leader
        return None

    def device_layer_name(self, layer_name: str) -> str:
        """The group-layer name a device layer is known by: a model sparse layer name maps to
        its resident name; ``KeyError`` for a name that is no device layer."""
        name = layer_name
        if name not in self.layer_group:
            name = self.resident_layer_name.get(name, name)
        if name not in self.layer_group:
            raise KeyError(f"{layer_name!r} is not a device layer of this plan.")
        return name

    @property
    def device_layers(self) -> list[str]:
        """Model layer names ``append_slots`` returns rows for, in group order."""
        names: list[str] = []
        for group in self.paged:
            names.extend(group.model_layer_names if isinstance(group, ResidentGroup)
                         else group.layer_names)
        return names

    @property
    def hot_blocks_per_request(self) -> int:
        """Blocks of one request's hot region in every hot group (the largest)."""
        return max((g.width for g in self.hot), default=0)


def _from_topology(topology: HiSparseTopology, config_index: Mapping[int, int]
                   ) -> tuple[list[IndexGroup], dict[int, int]]:
    """Index groups and the resident -> hot pairing from the planner's topology."""
    pairs = zip(topology.resident_groups, topology.hot_groups)
    hot_of = {config_index[r]: config_index[h] for r, h in pairs}
    index_groups = [
        IndexGroup(number=n, leader=ig.leader, layers=tuple(ig.layers),
                   resident=config_index[ig.resident_group], hot=config_index[ig.hot_group])
        for n, ig in enumerate(topology.index_groups)]
    return index_groups, hot_of


__all__ = [
    "DEVICE_KINDS",
    "GROUP_KIND_BY_SPEC",
    "HISPARSE_HOT_SUFFIX",
    "HISPARSE_RESIDENT_SUFFIX",
    "DeviceGroup",
    "GroupKind",
    "HotGroup",
    "IndexGroup",
    "IndexerGroup",
    "PlanGroups",
    "RegularGroup",
    "ResidentGroup",
    "SlidingWindowGroup",
    "group_class",
]
