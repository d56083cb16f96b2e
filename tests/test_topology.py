"""The planner-written topology: group parts, resident/hot pairing, index groups."""

import dataclasses

import pytest

from hisparse_triton.config import GIB, EngineConfig, HiSparseConfig
from hisparse_triton.layout import (
    build_hisparse_topology,
    get_hisparse_kv_cache_config,
    get_hisparse_kv_cache_groups,
    group_kind,
    underlying_layer_name,
)
from hisparse_triton.presets import build_kv_cache_spec
from hisparse_triton.specs import (
    FullAttentionSpec,
    GroupKind,
    HiSparseIndexGroup,
    HiSparseTopology,
    KVCacheConfig,
)

L = "model.layers.{i}.self_attn.attn"


def plan(preset, max_model_len, extra=None, index_topk=2048):
    config = EngineConfig(max_model_len, HiSparseConfig(index_topk=index_topk, host_pool_gib=64))
    spec = {**build_kv_cache_spec(preset), **(extra or {})}
    groups = get_hisparse_kv_cache_groups(config, spec)
    return groups, get_hisparse_kv_cache_config(config, groups, 80 * GIB, 64 * GIB)


def test_deepseek_v32_topology():
    groups, kv = plan("deepseek-v3.2-fp8", 163_840)
    topo = kv.hisparse_topology
    assert topo == build_hisparse_topology(groups)
    assert (topo.source_group, topo.indexer_group) == (0, 1)
    assert topo.resident_groups == (2, 3, 4, 5, 6, 7)
    assert topo.hot_groups == (8, 9, 10, 11, 12, 13)
    assert topo.regular_groups == ()
    assert len(topo.index_groups) == 61
    assert all(g.layers == (g.leader,) for g in topo.index_groups)  # every layer a leader
    assert topo.sparse_layers == tuple(L.format(i=i) for i in range(61))
    assert topo.leaders == topo.sparse_layers
    # layers 12..23 sit in the second resident group and its hot partner
    assert topo.resident_group_of(L.format(i=13)) == 3
    assert topo.hot_group_of(L.format(i=13)) == 9
    assert topo.resident_group_of(L.format(i=60)) == 7
    assert [topo.kind_of(i) for i in (0, 1, 2, 8)] == [GroupKind.SOURCE, GroupKind.INDEXER,
                                                        GroupKind.RESIDENT, GroupKind.HOT]


def test_index_sharing_topology_glm5():
    groups, kv = plan("glm-5-indexshare", 202_752)
    topo = kv.hisparse_topology
    assert topo.resident_groups == tuple(range(2, 22))
    assert topo.hot_groups == tuple(range(22, 42))
    assert len(topo.index_groups) == 20
    assert topo.leaders == tuple(L.format(i=i) for i in range(0, 78, 4))
    first, last = topo.index_groups[0], topo.index_groups[-1]
    assert first == HiSparseIndexGroup(leader=L.format(i=0),
                                       layers=tuple(L.format(i=i) for i in range(4)),
                                       resident_group=2, hot_group=22)
    assert last.layers == (L.format(i=76), L.format(i=77))
    assert (last.resident_group, last.hot_group) == (21, 41)
    for group in topo.index_groups:
        resident = [underlying_layer_name(n)
                    for n in kv.kv_cache_groups[group.resident_group].layer_names]
        hot = [underlying_layer_name(n) for n in kv.kv_cache_groups[group.hot_group].layer_names]
        assert list(group.layers) == resident == hot  # one index group per resident group here
        assert all(topo.index_group_of(layer) is group for layer in group.layers)


def test_tiny_topology_packs_two_index_groups_per_pair():
    _, kv = plan("tiny", 1024, index_topk=32)
    topo = kv.hisparse_topology
    assert topo.resident_groups == (2, 3) and topo.hot_groups == (4, 5)
    assert [g.layers for g in topo.index_groups] == [
        (L.format(i=0), L.format(i=1)), (L.format(i=2), L.format(i=3)),
        (L.format(i=4), L.format(i=5)), (L.format(i=6), L.format(i=7))]
    assert [(g.resident_group, g.hot_group) for g in topo.index_groups] == [
        (2, 4), (2, 4), (3, 5), (3, 5)]


def test_regular_groups_and_kinds_agree_with_group_kind():
    dense = FullAttentionSpec(16, 1, 32, "bfloat16")
    groups, kv = plan("tiny", 1024, extra={"dense.0": dense, "dense.1": dense}, index_topk=32)
    topo = kv.hisparse_topology
    assert topo.regular_groups == (6,)
    assert [topo.kind_of(i).value for i in range(len(groups))] == [group_kind(g) for g in groups]
    with pytest.raises(ValueError, match="group index 7 is not part of this HiSparse topology"):
        topo.kind_of(7)


def test_unknown_layers_are_errors():
    _, kv = plan("tiny", 1024, index_topk=32)
    topo = kv.hisparse_topology
    for name in ("model.layers.0.self_attn.indexer", "model.layers.0.self_attn.attn.hisparse_hot",
                 "dense.0"):
        with pytest.raises(ValueError, match=f"{name!r} is not a sparse layer of this HiSparse "
                                             f"plan"):
            topo.resident_group_of(name)


def test_topology_is_frozen_and_hashable():
    _, kv = plan("tiny", 1024, index_topk=32)
    topo = kv.hisparse_topology
    with pytest.raises(dataclasses.FrozenInstanceError):
        topo.source_group = 3
    assert hash(topo) == hash(build_hisparse_topology(kv.kv_cache_groups))
    assert dataclasses.replace(topo) == topo


def _index_group(leader="a", layers=("a", "b"), resident=2, hot=3):
    return HiSparseIndexGroup(leader=leader, layers=layers, resident_group=resident,
                              hot_group=hot)


def _topology(**overrides):
    fields = dict(source_group=0, indexer_group=1, resident_groups=(2,), hot_groups=(3,),
                  regular_groups=(), index_groups=(_index_group(),))
    fields.update(overrides)
    return HiSparseTopology(**fields)


@pytest.mark.parametrize("overrides, match", [
    (dict(hot_groups=()), "one hot group per resident group"),
    (dict(resident_groups=(), hot_groups=()), "one hot group per resident group"),
    (dict(regular_groups=(2,)), "assigns a group index to two parts"),
    (dict(index_groups=(_index_group(hot=4),)), "are not a pair of this topology"),
    (dict(index_groups=(_index_group(), _index_group("c", ("c", "b")))),
     "layer 'b' is in two index groups"),
    (dict(index_groups=()), "at least one index group"),
    (dict(source_group=-1), r"source_group must be a group index \(an int >= 0\), got -1"),
])
def test_topology_validation(overrides, match):
    with pytest.raises(ValueError, match=match):
        _topology(**overrides)


def test_index_group_validation():
    with pytest.raises(ValueError, match="must start with the leader 'a'"):
        _index_group(layers=("b", "a"))
    with pytest.raises(ValueError, match="repeats a layer"):
        _index_group(layers=("a", "a"))
    with pytest.raises(TypeError, match="must hold HiSparseIndexGroup values"):
        _topology(index_groups=(("a",),))


def test_kv_cache_config_checks_its_topology():
    groups, kv = plan("tiny", 1024, index_topk=32)
    assert KVCacheConfig(4, (), ()).hisparse_topology is None
    with pytest.raises(ValueError, match=r"names groups \[0, 1, 2, 3, 4, 5\], but the config has "
                                         r"groups 0..4"):
        dataclasses.replace(kv, kv_cache_groups=kv.kv_cache_groups[:5])
    swapped = dataclasses.replace(kv.hisparse_topology, source_group=1, indexer_group=0)
    with pytest.raises(ValueError, match="source group 1 is not host-resident"):
        dataclasses.replace(kv, hisparse_topology=swapped)
    with pytest.raises(TypeError, match="must be a HiSparseTopology or None"):
        dataclasses.replace(kv, hisparse_topology={"source_group": 0})


def test_build_topology_rejects_groups_that_are_not_a_plan():
    groups, _ = plan("tiny", 1024, index_topk=32)
    with pytest.raises(ValueError, match="exactly one source group, got 0"):
        build_hisparse_topology(groups[1:])
    with pytest.raises(ValueError, match="2 resident and 1 hot groups"):
        build_hisparse_topology(groups[:5])
    with pytest.raises(ValueError, match="resident group 2 and hot group 4 do not hold the same"):
        build_hisparse_topology([*groups[:4], groups[5], groups[4]])
