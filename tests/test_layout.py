"""The planner: every rule and error sentence, and the DeepSeek-V3.2 worked example."""

import re

import pytest

from hisparse_triton.config import ACTIVE_TAIL_PAGES, GIB, EngineConfig, HiSparseConfig
from hisparse_triton.layout import (
    HISPARSE_HOT_SUFFIX,
    HISPARSE_RESIDENT_SUFFIX,
    HiSparseLayout,
    HiSparsePlanWarning,
    create_hisparse_layout,
    get_all_gpu_baseline_concurrency,
    get_all_gpu_bytes_per_request,
    get_hisparse_concurrency,
    get_hisparse_kv_cache_config,
    get_hisparse_kv_cache_groups,
    get_hisparse_steady_state_concurrency,
    group_kind,
    split_index_groups,
    steady_blocks_per_request,
    underlying_layer_name,
)
from hisparse_triton.presets import build_kv_cache_spec
from hisparse_triton.specs import (
    FullAttentionSpec,
    HiSparseHotSpec,
    HiSparseResidentSpec,
    KVCacheConfig,
    KVCacheGroupRole,
    MLAAttentionSpec,
    SlidingWindowSpec,
    SparseCacheRole,
    UniformTypeKVCacheSpecs,
)

SPARSE = SparseCacheRole.SPARSE
INDEXER = SparseCacheRole.INDEXER


def sparse(row=656, block=64, leader=True, dtype="uint8"):
    return MLAAttentionSpec(block, row, dtype, SPARSE, is_index_group_leader=leader)


def indexer(row=132, block=64):
    return MLAAttentionSpec(block, row, "uint8", INDEXER, is_index_group_leader=True)


def engine(max_model_len=163_840, host_pool_gib=64.0, tp=1, shared=None, override=None,
           device_buffer_size=None, index_topk=2048):
    return EngineConfig(max_model_len, HiSparseConfig(
        index_topk=index_topk, host_pool_gib=host_pool_gib, shared_host_pool=shared,
        device_buffer_size=device_buffer_size), num_gpu_blocks_override=override,
        tensor_parallel_size=tp)


def dsv32(**kwargs):
    config = engine(**kwargs)
    spec = build_kv_cache_spec("deepseek-v3.2-fp8")
    return config, spec, get_hisparse_kv_cache_groups(config, spec)


def kinds(groups):
    return [group_kind(g) for g in groups]


# --- the worked example -------------------------------------------------------------------

def test_worked_example_deepseek_v32_fp8():
    config, spec, groups = dsv32()
    source, idx = groups[0], groups[1]
    assert source.layer_page_size_bytes == 64 * 656 == 41_984
    assert idx.page_size_bytes == 61 * 64 * 132 == 515_328
    assert kinds(groups) == ["source", "indexer"] + ["resident"] * 6 + ["hot"] * 6
    resident, hot = groups[2:8], groups[8:14]
    assert [len(g.layer_names) for g in resident] == [12, 12, 12, 12, 12, 1]
    assert [len(g.layer_names) for g in hot] == [12, 12, 12, 12, 12, 1]
    layout = create_hisparse_layout(config, groups, 64 * GIB)
    assert layout.host_block_stride == 61 * 41_984 == 2_561_024
    assert layout.host_num_blocks == 26_832
    assert not layout.shared_host_pool
    shared = create_hisparse_layout(engine(tp=8), groups, 64 * GIB)
    assert shared.shared_host_pool and shared.host_block_stride == 2_564_096
    assert shared.host_num_blocks == 64 * GIB // 2_564_096
    # max_model_len 163,840 needs 2,562 host blocks: 2,561 are too few, 2,562 are enough
    with pytest.raises(ValueError, match="has 2561 blocks .* needs 2562"):
        create_hisparse_layout(config, groups, 2561 * 2_561_024)
    assert create_hisparse_layout(config, groups, 2562 * 2_561_024).host_num_blocks == 2562


def test_worked_example_derived_bytes_per_token():
    _, spec, groups = dsv32()
    assert groups[0].page_size_bytes // 64 == 40_016
    assert groups[1].page_size_bytes // 64 == 8052


# --- get_hisparse_kv_cache_groups ---------------------------------------------------------

def test_none_without_hisparse_config():
    spec = build_kv_cache_spec("tiny")
    assert get_hisparse_kv_cache_groups(EngineConfig(1024), spec) is None


def test_none_without_mla_specs():
    spec = {"a": FullAttentionSpec(16, 2, 64, "float16"),
            "b.hisparse_hot": HiSparseHotSpec(16, 64, 4)}
    assert get_hisparse_kv_cache_groups(engine(1024), spec) is None
    assert get_hisparse_kv_cache_groups(engine(1024), {}) is None


def test_missing_indexer_layers_is_an_error():
    spec = {"s0": sparse(), "s1": sparse()}
    with pytest.raises(ValueError, match=re.escape(
            "HiSparse needs both SPARSE and INDEXER MLA layers, but the MLA group has no "
            "INDEXER layers (only 2 SPARSE layers).")):
        get_hisparse_kv_cache_groups(engine(), spec)


def test_missing_sparse_layers_is_an_error():
    with pytest.raises(ValueError, match="has no SPARSE layers \\(only 1 INDEXER layers\\)"):
        get_hisparse_kv_cache_groups(engine(), {"i0": indexer()})


def test_mixed_block_sizes_is_an_error():
    spec = {"s0": sparse(block=64), "i0": indexer(block=32)}
    with pytest.raises(ValueError, match=re.escape(
            "HiSparse MLA layers must share one block size, got block sizes [32, 64].")):
        get_hisparse_kv_cache_groups(engine(), spec)


def test_mixed_page_sizes_in_one_hot_group_is_an_error():
    spec = {"s0": sparse(656), "s1": sparse(576), "i0": indexer(1400)}  # 89,600 B page
    with pytest.raises(ValueError, match=re.escape(
            "HiSparse hot-group layers must share one page size, but layers 's0'..'s1' have "
            "page sizes [36864, 41984] B.")):
        get_hisparse_kv_cache_groups(engine(), spec)


def test_mixed_page_sizes_in_different_hot_groups_are_allowed():
    # each unit is larger than the indexer page, so every layer stands alone
    spec = {"s0": sparse(656), "s1": sparse(576), "i0": indexer(16)}
    groups = get_hisparse_kv_cache_groups(engine(), spec)
    resident = [g for g in groups if group_kind(g) == "resident"]
    assert [g.kv_cache_spec.page_size for g in resident] == [41_984, 36_864]


def test_source_and_indexer_groups():
    spec = {"s0": sparse(), "i0": indexer(), "s1": sparse(leader=False), "s2": sparse(),
            "i2": indexer()}
    groups = get_hisparse_kv_cache_groups(engine(), spec)
    source, idx = groups[0], groups[1]
    assert source.layer_names == ("s0", "s1", "s2")
    assert source.role is KVCacheGroupRole.HISPARSE_SOURCE and source.host_resident
    assert isinstance(source.kv_cache_spec, UniformTypeKVCacheSpecs)
    assert source.kv_cache_spec.kv_cache_specs == {"s0": sparse(), "s1": sparse(leader=False),
                                                   "s2": sparse()}
    assert source.page_size_bytes == 3 * 41_984
    assert idx.layer_names == ("i0", "i2")
    assert idx.role is KVCacheGroupRole.HISPARSE_INDEXER and not idx.host_resident
    assert isinstance(idx.kv_cache_spec, UniformTypeKVCacheSpecs)
    assert idx.page_size_bytes == 2 * 8448


def test_resident_and_hot_groups_names_specs_and_flags():
    config = engine(device_buffer_size=4100)
    with pytest.warns(HiSparsePlanWarning, match="device_buffer_size=4100 is not a multiple"):
        groups = get_hisparse_kv_cache_groups(config, {"s0": sparse(), "s1": sparse(),
                                                       "i0": indexer(1400)})
    assert kinds(groups) == ["source", "indexer", "resident", "hot"]
    resident, hot = groups[2], groups[3]
    assert resident.layer_names == ("s0.hisparse_resident", "s1.hisparse_resident")
    assert hot.layer_names == ("s0.hisparse_hot", "s1.hisparse_hot")
    assert resident.kv_cache_spec == HiSparseResidentSpec(block_size=64, page_size=41_984)
    assert hot.kv_cache_spec == HiSparseHotSpec(64, 41_984, blocks_per_request=65)  # cdiv(4100, 64)
    for group in (resident, hot):
        assert not group.enable_kv_transfer and not group.host_resident
        assert group.role is KVCacheGroupRole.DEFAULT
        assert group.page_size_bytes == 2 * 41_984


def test_suffix_helpers():
    assert HISPARSE_RESIDENT_SUFFIX == ".hisparse_resident"
    assert HISPARSE_HOT_SUFFIX == ".hisparse_hot"
    assert underlying_layer_name("m.l.3.attn.hisparse_resident") == "m.l.3.attn"
    assert underlying_layer_name("m.l.3.attn.hisparse_hot") == "m.l.3.attn"
    assert underlying_layer_name("m.l.3.attn") == "m.l.3.attn"


def test_derived_input_specs_are_ignored():
    base = {"s0": sparse(), "i0": indexer()}
    noisy = {**base, "s0.hisparse_resident": HiSparseResidentSpec(64, 1),
             "s0.hisparse_hot": HiSparseHotSpec(64, 1, 1)}
    assert get_hisparse_kv_cache_groups(engine(), noisy) == \
        get_hisparse_kv_cache_groups(engine(), base)


def test_regular_groups_share_equal_specs_in_first_seen_order():
    # 3 full + 2 window layers: group size 2 (the smaller type), the 3 full layers split
    # into cdiv(3, 2) = 2 strided groups; types in first-seen order
    full = FullAttentionSpec(64, 1, 128, "bfloat16")
    window = SlidingWindowSpec(64, 1, 128, "bfloat16", sliding_window=128)
    spec = {"f0": full, "s0": sparse(), "w0": window, "i0": indexer(), "f1": full, "w1": window,
            "f2": FullAttentionSpec(64, 1, 128, "bfloat16")}
    groups = get_hisparse_kv_cache_groups(engine(), spec)
    assert kinds(groups) == ["source", "indexer", "resident", "hot"] + ["regular"] * 3
    assert groups[4].layer_names == ("f0", "f2") and groups[4].kv_cache_spec == full
    assert groups[5].layer_names == ("f1",) and groups[5].kv_cache_spec == full
    assert groups[6].layer_names == ("w0", "w1") and groups[6].kv_cache_spec == window
    assert groups[4].role is KVCacheGroupRole.DEFAULT and groups[4].enable_kv_transfer


def test_units_start_at_leaders_and_pack_greedily():
    # indexer page 2 * 64 * 132 = 16,896 B; sparse page 64 * 64 = 4,096 B -> at most 4 layers
    spec = {}
    leaders = [True, False, True, False, False, True, True, False, False, False, False]
    for i, lead in enumerate(leaders):
        spec[f"s{i}"] = sparse(64, leader=lead)
    spec["i0"], spec["i1"] = indexer(), indexer()
    groups = get_hisparse_kv_cache_groups(engine(), spec)
    units = split_index_groups({n: s for n, s in spec.items() if n.startswith("s")})
    assert units == [("s0", "s1"), ("s2", "s3", "s4"), ("s5",), ("s6", "s7", "s8", "s9", "s10")]
    resident = [[underlying_layer_name(n) for n in g.layer_names]
                for g in groups if group_kind(g) == "resident"]
    # (2) + (3) > 4 -> alone; (3) + (1) = 4 fits; the 5-layer unit exceeds the limit: alone
    assert resident == [["s0", "s1"], ["s2", "s3", "s4", "s5"], ["s6", "s7", "s8", "s9", "s10"]]
    hot = [[underlying_layer_name(n) for n in g.layer_names]
           for g in groups if group_kind(g) == "hot"]
    assert hot == resident


def test_first_layer_starts_a_unit_even_when_not_a_leader():
    spec = {"s0": sparse(leader=False), "s1": sparse(leader=False), "i0": indexer()}
    assert split_index_groups({k: v for k, v in spec.items() if k != "i0"}) == [("s0", "s1")]
    groups = get_hisparse_kv_cache_groups(engine(), spec)
    # one 2-layer unit (83,968 B) larger than the indexer page (8,448 B) stands alone
    assert kinds(groups) == ["source", "indexer", "resident", "hot"]


def test_exact_fit_packs_and_one_byte_more_splits():
    # indexer page 8448 = 2 * 4224; sparse row 66 B -> page 4224
    spec = {"s0": sparse(66), "s1": sparse(66), "i0": indexer()}
    assert len(get_hisparse_kv_cache_groups(engine(), spec)) == 4
    spec = {"s0": sparse(67), "s1": sparse(67), "i0": indexer()}
    assert len(get_hisparse_kv_cache_groups(engine(), spec)) == 6


def test_index_share_preset_groups():
    config = engine(max_model_len=202_752)
    groups = get_hisparse_kv_cache_groups(config, build_kv_cache_spec("glm-5-indexshare"))
    assert groups[1].page_size_bytes == 20 * 8448
    resident = [g for g in groups if group_kind(g) == "resident"]
    assert [len(g.layer_names) for g in resident] == [4] * 19 + [2]
    assert resident[0].layer_names[0] == "model.layers.0.self_attn.attn.hisparse_resident"


# --- create_hisparse_layout ---------------------------------------------------------------

def test_layout_fields_and_helpers():
    config, _, groups = dsv32()
    layout = create_hisparse_layout(config, groups, 64 * GIB)
    assert isinstance(layout, HiSparseLayout)
    assert layout.source_group is groups[0]
    assert layout.device_groups == tuple(groups[1:])
    assert len(layout.groups_of_kind("resident")) == 6 and len(layout.groups_of_kind("hot")) == 6
    assert layout.groups_of_kind("indexer") == (groups[1],)
    assert len(layout.index_groups) == 61
    assert layout.host_pool_bytes == 26_832 * 2_561_024 <= 64 * GIB
    with pytest.raises(ValueError, match="unknown group kind 'cold'"):
        layout.groups_of_kind("cold")
    with pytest.raises(Exception):
        layout.host_num_blocks = 1  # frozen


@pytest.mark.parametrize("flag, tp, stride", [
    (None, 1, 2_561_024), (None, 2, 2_564_096), (True, 1, 2_564_096), (False, 4, 2_561_024)])
def test_host_stride_rounds_up_only_when_shared(flag, tp, stride):
    config, _, groups = dsv32(tp=tp, shared=flag)
    layout = create_hisparse_layout(config, groups, 64 * GIB)
    assert layout.host_block_stride == stride
    assert layout.host_num_blocks == 64 * GIB // stride


def test_shared_stride_already_aligned_stays():
    spec = {"s0": sparse(64), "i0": indexer()}  # page 4096
    config = engine(max_model_len=64, tp=2)
    layout = create_hisparse_layout(config, get_hisparse_kv_cache_groups(config, spec), 10 * 4096)
    assert layout.host_block_stride == 4096 and layout.host_num_blocks == 10


def test_no_allocatable_host_blocks():
    config, _, groups = dsv32()
    for budget in (0, 2_561_023):
        with pytest.raises(ValueError, match=r"^HiSparse has no allocatable host blocks\.$"):
            create_hisparse_layout(config, groups, budget)


def test_too_few_host_blocks_names_both_numbers_and_the_fix():
    config, _, groups = dsv32()
    with pytest.raises(ValueError) as info:
        create_hisparse_layout(config, groups, GIB)
    message = str(info.value)
    assert "419" in message and "2562" in message and "increase host_pool_gib" in message


def test_exactly_one_host_resident_group():
    config, _, groups = dsv32()
    with pytest.raises(ValueError, match="exactly one host-resident group, got 0"):
        create_hisparse_layout(config, groups[1:], 64 * GIB)
    with pytest.raises(ValueError, match="exactly one host-resident group, got 2"):
        create_hisparse_layout(config, [groups[0], *groups], 64 * GIB)
    with pytest.raises(ValueError, match="needs KV-cache groups, got None"):
        create_hisparse_layout(config, None, 64 * GIB)


@pytest.mark.parametrize("budget", [-1, 1.5, True, "64"])
def test_bad_host_budget(budget):
    config, _, groups = dsv32()
    with pytest.raises(ValueError, match="host_budget must be an int >= 0"):
        create_hisparse_layout(config, groups, budget)


# --- get_hisparse_kv_cache_config ---------------------------------------------------------

def test_kv_cache_config_pools():
    config, _, groups = dsv32()
    kv = get_hisparse_kv_cache_config(config, groups, 80 * GIB, 64 * GIB)
    assert isinstance(kv, KVCacheConfig)
    assert kv.kv_cache_groups == tuple(groups)
    assert kv.bytes_per_block == 515_328  # the indexer page is the largest device page
    assert kv.num_blocks == 80 * GIB // 515_328
    assert kv.hisparse_host_num_blocks == 26_832
    assert kv.hisparse_host_block_stride == 2_561_024
    assert kv.hisparse_shared_host_pool is False


def test_num_gpu_blocks_override_wins():
    config, _, groups = dsv32(override=1000)
    kv = get_hisparse_kv_cache_config(config, groups, 80 * GIB, 64 * GIB)
    assert kv.num_blocks == 1000
    assert all(t.size == 1000 * t.layer_stride for t in kv.kv_cache_tensors if not t.host_resident)


def test_too_few_device_blocks():
    config, _, groups = dsv32()
    with pytest.raises(ValueError, match="HiSparse has 1 device blocks of 515328 B .* at least 2"):
        get_hisparse_kv_cache_config(config, groups, 515_328 * 2 - 1, 64 * GIB)
    with pytest.raises(ValueError, match="available_memory must be an int >= 0"):
        get_hisparse_kv_cache_config(config, groups, -5, 64 * GIB)


def test_device_tensors_resident_and_hot_share_bytes():
    config, _, groups = dsv32()
    kv = get_hisparse_kv_cache_config(config, groups, 80 * GIB, 64 * GIB)
    device = [t for t in kv.kv_cache_tensors if not t.host_resident]
    by_name = {name: t for t in device for name in t.layers}
    assert len(device) == 61 + 61  # one tensor per indexer layer and per sparse layer
    for i in range(61):
        name = f"model.layers.{i}.self_attn.attn"
        tensor = by_name[name + ".hisparse_resident"]
        assert tensor is by_name[name + ".hisparse_hot"]
        assert tensor.layers == (name + ".hisparse_resident", name + ".hisparse_hot")
        assert tensor.offset == (i % 12) * 41_984
        assert tensor.layer_stride == 41_984 and tensor.block_stride == 515_328
        assert tensor.size == kv.num_blocks * 41_984
    indexer_tensors = [by_name[f"model.layers.{i}.self_attn.indexer"] for i in range(61)]
    assert [t.offset for t in indexer_tensors] == [i * 8448 for i in range(61)]
    assert all(t.layers == (n,) for t, n in zip(
        indexer_tensors, [f"model.layers.{i}.self_attn.indexer" for i in range(61)]))


def test_device_tensors_of_one_group_do_not_overlap_and_fit_the_block():
    spec = {**build_kv_cache_spec("tiny"),
            "dense.0": FullAttentionSpec(16, 1, 32, "bfloat16"),
            "dense.1": FullAttentionSpec(16, 1, 32, "bfloat16")}
    config = engine(max_model_len=1024, index_topk=32)
    groups = get_hisparse_kv_cache_groups(config, spec)
    kv = get_hisparse_kv_cache_config(config, groups, 1 << 20, 1 << 20)
    tensors = {name: t for t in kv.kv_cache_tensors if not t.host_resident for name in t.layers}
    for group in kv.kv_cache_groups[1:]:
        spans = sorted((tensors[n].offset, tensors[n].offset + tensors[n].layer_stride)
                       for n in group.layer_names)
        assert spans[0][0] == 0 and spans[-1][1] == group.page_size_bytes <= kv.bytes_per_block
        assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))
    assert tensors["dense.1"].offset == 2 * 16 * 32 * 2


def test_host_tensors_are_layer_major():
    config, _, groups = dsv32()
    kv = get_hisparse_kv_cache_config(config, groups, 80 * GIB, 64 * GIB)
    host = [t for t in kv.kv_cache_tensors if t.host_resident]
    region = 26_832 * 41_984
    assert [t.layers for t in host] == [(f"model.layers.{i}.self_attn.attn",) for i in range(61)]
    assert [t.offset for t in host] == [i * region for i in range(61)]
    assert all(t.size == region and t.block_stride == 41_984 and t.layer_stride == region
               for t in host)
    assert host[-1].offset + host[-1].size == 26_832 * 2_561_024


# --- concurrency ---------------------------------------------------------------------------

def test_steady_state_concurrency_worked_example():
    config, spec, groups = dsv32(host_pool_gib=256)
    kv = get_hisparse_kv_cache_config(config, groups, 80 * GIB, 256 * GIB)
    conc = get_hisparse_concurrency(config, kv)
    # indexer 2560 + 6 resident x 2560 + 6 hot x cdiv(4096, 64)
    assert conc.admission_blocks == 2560 + 6 * 2560 + 6 * 64
    assert conc.steady_blocks == 2560 + 6 * ACTIVE_TAIL_PAGES + 6 * 64
    assert conc.host_blocks_per_request == 2560
    assert conc.gpu == pytest.approx(1 + (kv.num_blocks - 18_304) / 2956)
    assert conc.host == pytest.approx(kv.hisparse_host_num_blocks / 2560)
    assert get_hisparse_steady_state_concurrency(config, kv) == min(conc.gpu, conc.host)
    assert conc.limited_by == "host"
    baseline = get_all_gpu_baseline_concurrency(config, spec, 80 * GIB)
    assert get_all_gpu_bytes_per_request(config, spec) == 2560 * 64 * (40_016 + 8052)
    assert baseline == pytest.approx(80 * GIB / (2560 * 64 * 48_068))
    assert conc.steady_state > 3 * baseline


def test_gpu_concurrency_below_one_admission():
    config, _, groups = dsv32(override=9152)  # half of one admission
    kv = get_hisparse_kv_cache_config(config, groups, 80 * GIB, 64 * GIB)
    assert get_hisparse_steady_state_concurrency(config, kv) == pytest.approx(0.5)
    assert get_hisparse_concurrency(config, kv).limited_by == "gpu"


def test_gpu_concurrency_exactly_one_admission():
    config, _, groups = dsv32(override=18_304)
    kv = get_hisparse_kv_cache_config(config, groups, 80 * GIB, 64 * GIB)
    assert get_hisparse_concurrency(config, kv).gpu == 1.0


def test_steady_blocks_per_request_per_kind():
    config, _, groups = dsv32()
    assert [steady_blocks_per_request(config, g) for g in groups[1:3]] == [2560, 2]
    assert steady_blocks_per_request(config, groups[8]) == 64
    short = engine(max_model_len=10)
    assert steady_blocks_per_request(short, groups[2]) == 1  # one page is all it has


def test_concurrency_needs_one_host_group():
    config, _, groups = dsv32()
    kv = KVCacheConfig(10, (), tuple(groups[1:]))
    with pytest.raises(ValueError, match="exactly one host-resident group, got 0"):
        get_hisparse_steady_state_concurrency(config, kv)


def test_baseline_ignores_derived_specs_and_needs_layers():
    config = engine(max_model_len=128)
    spec = {"s0": sparse(), "s0.hisparse_hot": HiSparseHotSpec(64, 10, 100)}
    assert get_all_gpu_bytes_per_request(config, spec) == 2 * 41_984
    assert get_all_gpu_baseline_concurrency(config, spec, 4 * 41_984) == 2.0
    with pytest.raises(ValueError, match="no layers"):
        get_all_gpu_baseline_concurrency(config, {}, GIB)
