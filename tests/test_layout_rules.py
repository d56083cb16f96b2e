"""The planner's second revision (vLLM 0.33 parity): row-aligned blocks, in-flight and
sliding-window admission, equal-sized regular groups, the hot-buffer warning."""

import dataclasses
import warnings

import pytest

from hisparse_triton.config import ACTIVE_TAIL_PAGES, GIB, EngineConfig, HiSparseConfig
from hisparse_triton.layout import (
    DeviceRowLayout,
    HiSparsePlanWarning,
    admission_blocks_per_request,
    device_bytes_per_block,
    device_row_layout,
    get_all_gpu_bytes_per_request,
    get_hisparse_concurrency,
    get_hisparse_kv_cache_config,
    get_hisparse_kv_cache_groups,
    group_kind,
    group_regular_layers,
    row_alignment_bytes,
    steady_blocks_per_request,
)
from hisparse_triton.presets import build_kv_cache_spec
from hisparse_triton.specs import (
    FullAttentionSpec,
    HiSparseResidentSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    SlidingWindowSpec,
    cdiv,
)

DSV32 = "model.layers.{i}.self_attn.attn"


def plan(preset="deepseek-v3.2-fp8", max_model_len=163_840, row_aligned=False, extra=None,
         gpu=80 * GIB, host_gib=256, **engine):
    config = EngineConfig(max_model_len, HiSparseConfig(host_pool_gib=host_gib), **engine)
    spec = {**build_kv_cache_spec(preset), **(extra or {})}
    groups = get_hisparse_kv_cache_groups(config, spec)
    kv = get_hisparse_kv_cache_config(config, groups, gpu, host_gib * GIB,
                                      row_aligned_blocks=row_aligned)
    return config, spec, groups, kv


# --- row-aligned blocks --------------------------------------------------------------------

def test_row_aligned_deepseek_v32_at_80_gib():
    _, _, groups, plain = plan()
    assert (plain.bytes_per_block, plain.num_blocks) == (515_328, 166_688)
    assert plain.row_aligned_blocks is False
    _, _, _, kv = plan(row_aligned=True)
    assert row_alignment_bytes(groups) == 41_984
    assert kv.bytes_per_block == 545_792 == 13 * 41_984
    assert kv.num_blocks == 157_384 == 80 * GIB // 545_792
    assert kv.row_aligned_blocks is True
    assert all(t.block_stride == 545_792 for t in kv.kv_cache_tensors if not t.host_resident)
    # host pool and groups do not change
    assert kv.kv_cache_groups == plain.kv_cache_groups
    assert kv.hisparse_host_num_blocks == plain.hisparse_host_num_blocks


def test_row_aligned_glm5_indexshare_at_80_gib():
    _, _, groups, plain = plan("glm-5-indexshare", 202_752)
    assert plain.bytes_per_block == 20 * 64 * 132 == 168_960
    _, _, _, kv = plan("glm-5-indexshare", 202_752, row_aligned=True)
    assert kv.bytes_per_block == 209_920 == 5 * 41_984
    assert kv.num_blocks == 409_200
    assert device_bytes_per_block(groups, row_aligned_blocks=True) == 209_920
    assert device_bytes_per_block(groups) == 168_960


def test_row_alignment_is_the_lcm_of_sparse_pages():
    # two hot groups with different pages (each unit larger than the indexer page)
    from hisparse_triton.specs import MLAAttentionSpec, SparseCacheRole
    spec = {"s0": MLAAttentionSpec(64, 656, "uint8", SparseCacheRole.SPARSE, True),
            "s1": MLAAttentionSpec(64, 576, "uint8", SparseCacheRole.SPARSE, True),
            "i0": MLAAttentionSpec(64, 16, "uint8", SparseCacheRole.INDEXER, True)}
    config = EngineConfig(128, HiSparseConfig(host_pool_gib=1))
    groups = get_hisparse_kv_cache_groups(config, spec)
    assert row_alignment_bytes(groups) == 1_511_424  # lcm(41,984, 36,864)
    kv = get_hisparse_kv_cache_config(config, groups, 1 << 24, 1 << 24, row_aligned_blocks=True)
    assert kv.bytes_per_block == 1_511_424
    assert row_alignment_bytes([groups[0], groups[1]]) == 1  # no resident/hot groups


def test_row_aligned_with_block_override():
    config = EngineConfig(163_840, HiSparseConfig(host_pool_gib=64), num_gpu_blocks_override=100)
    groups = get_hisparse_kv_cache_groups(config, build_kv_cache_spec("deepseek-v3.2-fp8"))
    kv = get_hisparse_kv_cache_config(config, groups, 0, 64 * GIB, row_aligned_blocks=True)
    assert (kv.num_blocks, kv.bytes_per_block) == (100, 545_792)
    with pytest.raises(ValueError, match="row_aligned_blocks must be a bool, got 1"):
        get_hisparse_kv_cache_config(config, groups, 0, 64 * GIB, row_aligned_blocks=1)


def test_device_row_layout_maps_runtime_rows_to_flat_rows():
    _, _, _, kv = plan(row_aligned=True)
    layer = DSV32.format(i=5)  # 6th layer of the first resident group
    view = device_row_layout(kv, layer)
    assert view == DeviceRowLayout(offset_bytes=5 * 41_984, row_bytes=656, rows_per_block=832,
                                   num_rows=(157_384 - 1) * 832 + 64, block_size=64)
    tensor = next(t for t in kv.kv_cache_tensors if layer + ".hisparse_resident" in t.layers)
    for block, slot in ((0, 0), (1, 0), (7, 63), (157_383, 63)):
        row_id = block * 64 + slot
        per_layer = tensor.offset + block * tensor.block_stride + slot * 656
        assert view.offset_bytes + view.flat_row(row_id) * view.row_bytes == per_layer
        assert view.flat_row(row_id) == block * 832 + slot
    # the flat view ends inside the pool
    assert view.offset_bytes + view.num_rows * view.row_bytes <= kv.num_blocks * kv.bytes_per_block
    # resident and hot names share the bytes, so they give the same view
    assert device_row_layout(kv, layer + ".hisparse_hot") == view
    assert device_row_layout(kv, layer + ".hisparse_resident") == view


def test_device_row_layout_errors():
    _, _, _, plain = plan()
    with pytest.raises(ValueError, match=r"the plan is not row-aligned \(bytes_per_block 515328 "
                                         r"B\); plan with .*row_aligned_blocks=True"):
        device_row_layout(plain, DSV32.format(i=0))
    dense = FullAttentionSpec(64, 1, 64, "bfloat16")
    _, _, _, kv = plan(row_aligned=True, extra={"dense.0": dense})
    for name in ("model.layers.0.self_attn.indexer", "dense.0", "nope", "nope.hisparse_hot"):
        with pytest.raises(ValueError, match=f"{name!r} is not a sparse layer of this plan"):
            device_row_layout(kv, name)
    with pytest.raises(ValueError, match="needs a HiSparse plan"):
        device_row_layout(KVCacheConfig(4, (), ()), DSV32.format(i=0))


def test_bytes_per_block_is_a_stored_field():
    host = KVCacheGroupSpec(("s",), HiSparseResidentSpec(64, 9000), host_resident=True)
    small = KVCacheGroupSpec(("a", "b"), HiSparseResidentSpec(64, 1000))
    assert KVCacheConfig(4, (), (host, small)).bytes_per_block == 2000  # derived default
    stored = KVCacheConfig(4, (), (host, small), bytes_per_block=3000)
    assert stored.bytes_per_block == 3000 and stored.row_aligned_blocks is False
    assert dataclasses.replace(stored, num_blocks=5).bytes_per_block == 3000
    with pytest.raises(ValueError, match=r"bytes_per_block must be an int >= the largest device "
                                         r"group page \(2000 B\), got 1999"):
        KVCacheConfig(4, (), (host, small), bytes_per_block=1999)
    with pytest.raises(ValueError, match="bytes_per_block=3500 is not a multiple of the 1000 B "
                                         "page of layer 'a', but row_aligned_blocks is set"):
        KVCacheConfig(4, (), (host, small), bytes_per_block=3500, row_aligned_blocks=True)
    assert KVCacheConfig(4, (), (host, small), bytes_per_block=3000,
                         row_aligned_blocks=True).row_aligned_blocks


# --- in-flight admission -------------------------------------------------------------------

def test_in_flight_admission_of_resident_groups():
    config, _, groups, kv = plan(max_num_batched_tokens=8192)
    resident, hot, indexer = groups[2], groups[8], groups[1]
    assert group_kind(resident) == "resident" and group_kind(hot) == "hot"
    assert admission_blocks_per_request(config, resident) == cdiv(8192, 64) == 128
    assert admission_blocks_per_request(config, indexer) == 2560  # the indexer keeps it all
    assert admission_blocks_per_request(config, hot) == 64
    assert admission_blocks_per_request(config, groups[0]) == 2560  # host blocks
    conc = get_hisparse_concurrency(config, kv)
    assert conc.admission_blocks == 2560 + 6 * 128 + 6 * 64 == 3712
    assert conc.steady_blocks == 2560 + 6 * ACTIVE_TAIL_PAGES + 6 * 64
    assert conc.gpu == pytest.approx(1 + (kv.num_blocks - 3712) / conc.steady_blocks)
    # unset: a whole prompt in one step, the whole request
    whole = dataclasses.replace(config, max_num_batched_tokens=None)
    assert admission_blocks_per_request(whole, resident) == 2560
    # a budget larger than the request is capped at max_model_len
    big = dataclasses.replace(config, max_num_batched_tokens=1 << 20)
    assert admission_blocks_per_request(big, resident) == 2560
    # a budget of one token: one page
    one = dataclasses.replace(config, max_num_batched_tokens=1)
    assert admission_blocks_per_request(one, resident) == 1
    assert steady_blocks_per_request(one, resident) == ACTIVE_TAIL_PAGES


def test_in_flight_admission_raises_gpu_concurrency():
    values = []
    for tokens in (64, 2048, 8192, 65_536, None):
        config, _, _, kv = plan(max_num_batched_tokens=tokens)
        values.append(get_hisparse_concurrency(config, kv).gpu)
    assert values == sorted(values, reverse=True) and values[0] > values[-1]


# --- sliding-window admission --------------------------------------------------------------

def test_sliding_window_admission_counts_the_in_flight_tokens():
    window = SlidingWindowSpec(64, 1, 128, "bfloat16", sliding_window=4096)
    extra = {"w0": window, "w1": window}
    config, spec, groups, _ = plan(extra=extra, max_num_batched_tokens=8192)
    regular = [g for g in groups if group_kind(g) == "regular"]
    assert len(regular) == 1
    # cdiv(min(4096 - 1 + 8192, 163,840), 64) + 1 = 192 + 1
    assert admission_blocks_per_request(config, regular[0]) == 193
    assert steady_blocks_per_request(config, regular[0]) == 193
    whole = dataclasses.replace(config, max_num_batched_tokens=None)
    # a whole prompt in flight: min(4095 + 163,840, 163,840) tokens -> 2560 + 1
    assert admission_blocks_per_request(whole, regular[0]) == 2561
    # the all-GPU baseline uses the same rule
    without = get_all_gpu_bytes_per_request(config, build_kv_cache_spec("deepseek-v3.2-fp8"))
    assert get_all_gpu_bytes_per_request(config, spec) - without == \
        2 * 193 * window.page_size_bytes


# --- regular groups ------------------------------------------------------------------------

def test_two_full_and_four_sliding_window_layers_make_three_groups_of_two():
    full = FullAttentionSpec(64, 8, 128, "bfloat16")  # 256 KiB pages
    window = SlidingWindowSpec(64, 8, 128, "bfloat16", sliding_window=1024)
    assert full.page_size_bytes == window.page_size_bytes == 262_144
    extra = {"f0": full, "w0": window, "w1": window, "f1": full, "w2": window, "w3": window}
    _, _, groups, kv = plan(extra=extra)
    regular = [g.layer_names for g in groups if group_kind(g) == "regular"]
    assert regular == [("f0", "f1"), ("w0", "w2"), ("w1", "w3")]
    # one group of 4 window layers would make the block 1 MiB and halve the block count
    assert kv.bytes_per_block == 2 * 262_144
    assert kv.num_blocks == 80 * GIB // (2 * 262_144) == 2 * (80 * GIB // (4 * 262_144))


@pytest.mark.parametrize("counts, expected", [
    # n:1 patterns: the smaller type's count is the group size
    ({"f": 1, "w": 5}, [1, 1, 1, 1, 1, 1]),
    ({"f": 10, "w": 20}, [10, 10, 10]),
    # 20 + 30: group size 20, the window type splits into two groups of 15
    ({"f": 20, "w": 30}, [20, 15, 15]),
    # 12 + 13 are close (13 < 1.5 x 12): one group per type, of up to 13 layers
    ({"w": 12, "f": 13}, [12, 13]),
    # 4 + 5 are close too (vLLM's factor is 1.5): group size 5
    ({"w": 4, "f": 5}, [4, 5]),
    # 4 + 6 is exactly 1.5: not close enough, group size 4
    ({"w": 4, "f": 6}, [4, 3, 3]),
    ({"f": 3}, [3]),
])
def test_group_regular_layers_sizes(counts, expected):
    specs = {}
    for kind, count in counts.items():
        spec = (FullAttentionSpec(16, 1, 8, "float16") if kind == "f"
                else SlidingWindowSpec(16, 1, 8, "float16", sliding_window=32))
        specs.update({f"{kind}{i}": spec for i in range(count)})
    groups = group_regular_layers(specs)
    assert [len(g) for g in groups] == expected
    assert sorted(n for g in groups for n in g) == sorted(specs)


def test_group_regular_layers_strides_layers_over_groups():
    spec = SlidingWindowSpec(16, 1, 8, "float16", sliding_window=32)
    specs = {"f0": FullAttentionSpec(16, 1, 8, "float16"),
             "f1": FullAttentionSpec(16, 1, 8, "float16"),
             **{f"w{i}": spec for i in range(5)}}
    assert group_regular_layers(specs) == [("f0", "f1"), ("w0", "w3"), ("w1", "w4"), ("w2",)]
    assert group_regular_layers({}) == []


# --- the hot-buffer warning ----------------------------------------------------------------

def test_device_buffer_size_not_a_multiple_of_block_size_warns():
    spec = build_kv_cache_spec("deepseek-v3.2-fp8")
    config = EngineConfig(163_840, HiSparseConfig(host_pool_gib=1, device_buffer_size=4100))
    with pytest.warns(HiSparsePlanWarning, match=(
            r"^device_buffer_size=4100 is not a multiple of block_size=64: each request's hot "
            r"buffer takes 65 x 64 = 4160 rows per sparse layer and 60 of them are never used; "
            r"use a multiple of 64\.$")):
        groups = get_hisparse_kv_cache_groups(config, spec)
    assert groups[-1].kv_cache_spec.blocks_per_request == 65
    whole = EngineConfig(163_840, HiSparseConfig(host_pool_gib=1, device_buffer_size=4096))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        get_hisparse_kv_cache_groups(whole, spec)
