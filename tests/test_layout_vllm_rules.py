"""The planner's third pass: vLLM 0.33's regular-layer grouping, the in-flight window of
``max_concurrent_batches`` steps, vLLM's host-pool layer order, ``extra_retained_tokens``.

Every expected number here is what vLLM 0.33.0's own planner returns for the same inputs
(``test_layout_vllm_parity.py`` compares the two on random geometries where vLLM imports).
"""

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hisparse_triton.config import GIB, EngineConfig, HiSparseConfig
from hisparse_triton.layout import (
    admission_blocks_per_request,
    get_hisparse_concurrency,
    get_hisparse_kv_cache_config,
    get_hisparse_kv_cache_groups,
    group_kind,
)
from hisparse_triton.presets import build_kv_cache_spec
from hisparse_triton.regular_groups import (
    REGULAR_GROUP_SIZE_SLACK,
    group_regular_layers,
    least_padding_divisor,
    regular_kv_cache_groups,
    uniform_type_key,
)
from hisparse_triton.specs import (
    FullAttentionSpec,
    SlidingWindowSpec,
    UniformTypeKVCacheSpecs,
)

DSV32 = build_kv_cache_spec("deepseek-v3.2-fp8")


def full(heads, head_size=64, dtype="bfloat16", block=64):
    return FullAttentionSpec(block, heads, head_size, dtype)


def window(heads, size, head_size=64, block=64, extra=0):
    return SlidingWindowSpec(block, heads, head_size, "bfloat16", sliding_window=size,
                             extra_retained_tokens=extra)


def plan(extra=None, spec=DSV32, max_model_len=163_840, gpu=80 * GIB, **engine):
    """DeepSeek-V3.2 fp8 (plus ``extra`` layers) with vLLM's block rounding."""
    config = EngineConfig(max_model_len, HiSparseConfig(host_pool_gib=256), **engine)
    groups = get_hisparse_kv_cache_groups(config, {**spec, **(extra or {})})
    kv = get_hisparse_kv_cache_config(config, groups, gpu, 256 * GIB, row_aligned_blocks=True)
    return config, kv, get_hisparse_concurrency(config, kv)


def regular_of(kv):
    return [g for g in kv.kv_cache_groups if group_kind(g) == "regular"]


# --- the three grouping rules -------------------------------------------------------------

def test_one_attention_type_with_different_specs_is_one_group():
    # full 8x128 + full 4x64 heads: both full attention, block 64 -> one group
    extra = {"fa": full(8, 128), "fb": full(4, 64)}
    assert group_regular_layers(extra) == [("fa", "fb")]
    config, kv, conc = plan(extra, max_num_batched_tokens=8192)
    (group,) = regular_of(kv)
    assert isinstance(group.kv_cache_spec, UniformTypeKVCacheSpecs)
    assert group.page_size_bytes == 262_144 + 65_536
    assert admission_blocks_per_request(config, group) == 2560  # one block table, not two
    assert (kv.num_blocks, kv.bytes_per_block) == (157_384, 545_792)
    # vLLM 0.33: 28.395 requests (splitting the two specs gave 19.39)
    assert conc.gpu == pytest.approx(28.395213923132705, rel=1e-12)


def test_several_page_sizes_use_the_packed_grouping():
    # 2 full 1x64 (16 KiB pages) + 1 sliding 1x128 (32 KiB): buckets by type, not by spec
    extra = {"f0": full(1), "f1": full(1), "w0": window(1, 128, head_size=128)}
    assert group_regular_layers(extra) == [("f0", "f1"), ("w0",)]
    _, kv, conc = plan(extra, max_num_batched_tokens=8192)
    assert [g.layer_names for g in regular_of(kv)] == [("f0", "f1"), ("w0",)]
    assert conc.gpu == pytest.approx(27.736497255179742, rel=1e-12)


def test_equal_pages_use_the_equal_count_grouping_with_slack_1_5():
    # 4 full + 5 sliding layers of one page size: 5 < 1.5 x 4, so the group size is 5
    extra = {**{f"f{i}": full(1) for i in range(4)}, **{f"w{i}": window(1, 128) for i in range(5)}}
    assert REGULAR_GROUP_SIZE_SLACK == 1.5
    assert group_regular_layers(extra) == [("f0", "f1", "f2", "f3"),
                                           ("w0", "w1", "w2", "w3", "w4")]
    _, kv, conc = plan(extra, max_num_batched_tokens=8192)
    assert [type(g.kv_cache_spec) for g in regular_of(kv)] == [FullAttentionSpec,
                                                              SlidingWindowSpec]
    assert conc.gpu == pytest.approx(27.736497255179742, rel=1e-12)


def test_rules_apply_in_vllms_order():
    # one spec beats everything; one type beats the page-size rules
    assert group_regular_layers({"a": full(2), "b": full(2)}) == [("a", "b")]
    assert group_regular_layers({"a": window(1, 64), "b": window(4, 64, extra=3)}) == \
        [("a", "b")]
    # windows of different sizes are different types; here with one page size
    assert group_regular_layers({"a": window(1, 64), "b": window(1, 128)}) == [("a",), ("b",)]
    # block sizes differ: different types even with equal specs otherwise
    assert group_regular_layers({"a": full(1, block=16), "b": full(1, block=32),
                                 "c": full(1, block=32)}) == [("a",), ("b", "c")]
    assert group_regular_layers({}) == []


def test_packed_grouping_splits_sliding_windows_to_the_widest_group():
    # a 32 KiB full page sets the anchor: the 8 KiB window layers go 4 to a group
    extra = {"f0": full(4), **{f"w{i}": window(1, 256) for i in range(8)}}
    assert group_regular_layers(extra) == [("f0",), ("w0", "w2", "w4", "w6"),
                                           ("w1", "w3", "w5", "w7")]
    _, kv, conc = plan(extra, max_num_batched_tokens=8192)
    assert conc.gpu == pytest.approx(27.088896575579383, rel=1e-12)


def test_packed_grouping_keeps_a_mixed_pattern_whole():
    # full layers alternate two page sizes (4 repetitions): that bucket stays one group and
    # fixes 4 repetitions per group, so the 8 window layers make two groups of 4
    extra = {}
    for i in range(4):
        extra.update({f"fa{i}": full(8), f"fb{i}": full(4)})
    extra.update({f"w{i}": window(2, 256) for i in range(8)})
    assert group_regular_layers(extra) == [
        ("fa0", "fb0", "fa1", "fb1", "fa2", "fb2", "fa3", "fb3"),
        ("w0", "w2", "w4", "w6"), ("w1", "w3", "w5", "w7")]
    _, kv, conc = plan(extra, max_num_batched_tokens=8192)
    assert (kv.num_blocks, kv.bytes_per_block) == (107_684, 797_696)  # 19 x 41,984
    assert conc.gpu == pytest.approx(18.49325492909028, rel=1e-12)
    # in-block placement: each spec's layers together, in first-seen order
    fa1 = next(t for t in kv.kv_cache_tensors if "fa1" in t.layers)
    fb0 = next(t for t in kv.kv_cache_tensors if "fb0" in t.layers)
    assert (fa1.offset, fb0.offset) == (131_072, 4 * 131_072)


def test_packed_split_keeps_every_layer_of_an_unbalanced_window_bucket():
    # one window size, two page sizes, 3:1 layers, split in two by a narrower anchor: vLLM
    # pairs the page sizes with zip, which keeps only (w0, w3) and leaves the second group
    # empty (its planner fails with StopIteration); here every layer keeps a group
    extra = {"f0": full(2), "w0": window(1, 64), "w1": window(1, 64), "w2": window(1, 64),
             "w3": window(2, 64)}
    groups = group_regular_layers(extra)
    assert groups == [("f0",), ("w0", "w3", "w2"), ("w1",)]
    assert sorted(n for g in groups for n in g) == sorted(extra)


def test_least_padding_divisor():
    assert least_padding_divisor([4, 8], 4) == 4
    assert least_padding_divisor([3, 4], 3) == 4  # pads 3 -> 4 by one layer
    assert least_padding_divisor([6], 2) == 6  # ties go to the larger divisor
    assert least_padding_divisor([2, 3], 5) == 5


def test_uniform_type_key():
    assert uniform_type_key(full(1)) == uniform_type_key(full(8, 128, "float32"))
    assert uniform_type_key(window(1, 64)) == uniform_type_key(window(2, 64, extra=2))
    assert uniform_type_key(window(1, 64)) != uniform_type_key(window(1, 65))
    assert uniform_type_key(window(1, 64)) != uniform_type_key(full(1))
    assert uniform_type_key(full(1, block=16)) != uniform_type_key(full(1))


def test_regular_group_spec_is_plain_when_the_layers_agree():
    groups = regular_kv_cache_groups({"f0": full(1), "f1": full(1), "w0": window(1, 128, 128)})
    assert [type(g.kv_cache_spec) for g in groups] == [FullAttentionSpec, SlidingWindowSpec]
    mixed = regular_kv_cache_groups({"a": full(8, 128), "b": full(4)})
    assert isinstance(mixed[0].kv_cache_spec, UniformTypeKVCacheSpecs)


# --- DeepSeek-V3.2 with two extra full-attention specs --------------------------------------

def test_deepseek_v32_with_two_extra_full_attention_specs():
    # one 4x128 fp8 layer + two 8x128 bf16 layers: vLLM makes one 589,824 B group (the
    # block rounds up to 15 x 41,984); the earlier rule made three one-layer groups
    extra = {"fa0": full(4, 128, "float8_e4m3fn"), "fb0": full(8, 128), "fb1": full(8, 128)}
    config, kv, conc = plan(extra, max_num_batched_tokens=8192)
    (group,) = regular_of(kv)
    assert group.layer_names == ("fa0", "fb0", "fb1") and group.page_size_bytes == 589_824
    assert (kv.num_blocks, kv.bytes_per_block) == (136_400, 629_760)
    assert conc.gpu == pytest.approx(24.591007976794778, rel=1e-12)  # was 14.73
    _, _, unset = plan(extra)
    assert unset.gpu == pytest.approx(21.945612762871647, rel=1e-12)


# --- the in-flight window of max_concurrent_batches steps -----------------------------------

def test_async_scheduling_doubles_the_admission_window():
    sync, kv, one = plan(max_num_batched_tokens=8192, num_gpu_blocks_override=5000)
    _, _, two = plan(max_num_batched_tokens=8192, num_gpu_blocks_override=5000,
                     max_concurrent_batches=2)
    assert (one.admission_blocks, two.admission_blocks) == (3712, 4480)  # 6 x 128 more
    assert one.steady_blocks == two.steady_blocks == 2956
    assert one.gpu == pytest.approx(1.4357239512855209, rel=1e-12)
    assert two.gpu == pytest.approx(1.175913396481732, rel=1e-12)
    assert round(one.gpu, 4) == 1.4357 and round(two.gpu, 4) == 1.1759
    resident = next(g for g in kv.kv_cache_groups if group_kind(g) == "resident")
    async_config = dataclasses.replace(sync, max_concurrent_batches=2)
    assert admission_blocks_per_request(async_config, resident) == 2 * 8192 // 64


def test_in_flight_window_is_capped_at_max_model_len():
    config = EngineConfig(10_000, max_num_batched_tokens=6000, max_concurrent_batches=2)
    assert config.in_flight_tokens == 10_000
    assert EngineConfig(10_000, max_num_batched_tokens=3000,
                        max_concurrent_batches=3).in_flight_tokens == 9000
    # unset: a whole prompt per step, whatever the number of steps in flight
    assert EngineConfig(10_000, max_concurrent_batches=4).in_flight_tokens == 10_000


def test_sliding_window_admission_counts_every_batch_in_flight():
    extra = {"w0": window(1, 4096, 128)}
    config, kv, _ = plan(extra, max_num_batched_tokens=8192, max_concurrent_batches=2)
    (group,) = regular_of(kv)
    # cdiv(min(4095 + 2 x 8192, 163,840), 64) + 1
    assert admission_blocks_per_request(config, group) == 321


# --- extra_retained_tokens ------------------------------------------------------------------

def test_extra_retained_tokens_extend_the_window():
    config = EngineConfig(163_840, max_num_batched_tokens=8192)
    plain, kept = window(1, 4096, 128), window(1, 4096, 128, extra=2)
    assert kept.num_retained_tokens == 4097
    assert plain.max_memory_usage_bytes(config) == 193 * plain.page_size_bytes
    # cdiv(min(4095 + 2 + 8192, 163,840), 64) + 1
    assert kept.max_memory_usage_bytes(config) == 194 * kept.page_size_bytes
    # one type (the window size matters, the retained tokens do not): one block table,
    # as many pages as the layer that needs the most
    _, kv, conc = plan({"w0": kept, "w1": plain}, max_num_batched_tokens=8192)
    (group,) = regular_of(kv)
    assert group.blocks_per_request(config) == 194
    assert conc.limited_by == "host"  # vLLM's figure is the smaller of the two limits
    assert conc.steady_state == pytest.approx(41.926171875, rel=1e-12)


@pytest.mark.parametrize("bad", [-1, 1.5, True, "2"])
def test_extra_retained_tokens_validation(bad):
    with pytest.raises(ValueError, match=f"extra_retained_tokens must be an int >= 0, got "
                                         f"{bad!r}"):
        window(1, 64, extra=bad)


# --- host-pool layer order ------------------------------------------------------------------

def test_host_pool_places_leaders_first_with_index_sharing():
    spec = build_kv_cache_spec("glm-5-indexshare")
    config = EngineConfig(202_752, HiSparseConfig(host_pool_gib=256))
    groups = get_hisparse_kv_cache_groups(config, spec)
    kv = get_hisparse_kv_cache_config(config, groups, 80 * GIB, 256 * GIB)
    assert kv.hisparse_host_num_blocks == 83_938
    region = 83_938 * 41_984  # one layer's host region: 3,524,052,992 B
    host = {t.layers[0]: t for t in kv.kv_cache_tensors if t.host_resident}
    name = "model.layers.{}.self_attn.attn".format
    leaders = [i for i in range(78) if i % 4 == 0]
    followers = [i for i in range(78) if i % 4]
    for position, layer in enumerate(leaders + followers):
        assert host[name(layer)].offset == position * region
        assert host[name(layer)].size == region and host[name(layer)].layer_stride == region
    # vLLM's numbers: the followers' run starts at 20 regions
    assert host[name(1)].offset == 70_481_059_840
    # without index sharing every layer leads: model order
    plain = get_hisparse_kv_cache_config(config, get_hisparse_kv_cache_groups(
        config, build_kv_cache_spec("glm-5")), 80 * GIB, 256 * GIB)
    offsets = [t.offset for t in plain.kv_cache_tensors if t.host_resident]
    assert offsets == sorted(offsets)


def test_host_pool_gathers_mixed_page_sizes_by_spec():
    """Source layers of pages [41,984, 81,920, 41,984, 41,984]: vLLM's host regions are
    gathered by equal spec in first-seen order, so layer 1 (the 81,920 B spec) comes after
    layers 0, 2 and 3 (vLLM 0.33.0's own planner gives the same offsets)."""
    from hisparse_triton.specs import MLAAttentionSpec, SparseCacheRole

    spec = {}
    for i, row in enumerate((656, 1280, 656, 656)):
        spec[f"layers.{i}.attn"] = MLAAttentionSpec(64, row, "uint8", SparseCacheRole.SPARSE, True)
        spec[f"layers.{i}.indexer"] = MLAAttentionSpec(64, 16, "uint8",
                                                       SparseCacheRole.INDEXER, True)
    config = EngineConfig(4096, HiSparseConfig(index_topk=64, host_pool_gib=1))
    groups = get_hisparse_kv_cache_groups(config, spec)
    stride = 3 * 41_984 + 81_920
    kv = get_hisparse_kv_cache_config(config, groups, GIB, 100 * stride)
    assert kv.hisparse_host_num_blocks == 100
    host = {t.layers[0]: (t.offset, t.size) for t in kv.kv_cache_tensors if t.host_resident}
    small, large = 100 * 41_984, 100 * 81_920
    assert host == {"layers.0.attn": (0, small), "layers.2.attn": (small, small),
                    "layers.3.attn": (2 * small, small), "layers.1.attn": (3 * small, large)}


# --- properties of the grouping --------------------------------------------------------------

@st.composite
def regular_specs(draw):
    kinds = draw(st.lists(st.tuples(
        st.sampled_from([16, 64]), st.sampled_from([1, 2, 4]), st.sampled_from([None, 64, 256]),
        st.integers(0, 2), st.integers(1, 6)), min_size=1, max_size=4))
    specs = {}
    for t, (block, heads, size, extra, count) in enumerate(kinds):
        spec = full(heads, block=block) if size is None else \
            window(heads, size, block=block, extra=extra)
        specs.update({f"t{t}.{j}": spec for j in range(count)})
    names = draw(st.permutations(sorted(specs)))
    return {name: specs[name] for name in names}


@settings(max_examples=150, deadline=None)
@given(regular_specs())
def test_grouping_covers_every_layer_once_within_one_type(specs):
    groups = group_regular_layers(specs)
    flat = [name for group in groups for name in group]
    assert sorted(flat) == sorted(specs) and all(groups)
    for group in groups:
        assert len({uniform_type_key(specs[name]) for name in group}) == 1
        order = [name for name in specs if name in group]
        by_page = {}
        for name in group:  # within one page size, layers keep model order
            by_page.setdefault(specs[name].page_size_bytes, []).append(name)
        for names in by_page.values():
            assert names == [n for n in order if n in names]
    built = regular_kv_cache_groups(specs)
    assert [g.layer_names for g in built] == groups
