"""Spec value types: page-size arithmetic, validation, group and config helpers."""

import pytest
import torch

from hisparse_triton.config import EngineConfig
from hisparse_triton.specs import (
    FullAttentionSpec,
    HiSparseHotSpec,
    HiSparseResidentSpec,
    KVCacheConfig,
    KVCacheGroupRole,
    KVCacheGroupSpec,
    KVCacheTensor,
    MLAAttentionSpec,
    SlidingWindowSpec,
    SparseCacheRole,
    UniformTypeKVCacheSpecs,
    cdiv,
    normalize_dtype,
    round_up,
)

SPARSE = SparseCacheRole.SPARSE
INDEXER = SparseCacheRole.INDEXER


def test_cdiv_and_round_up():
    assert [cdiv(a, 4) for a in (0, 1, 4, 5, 8)] == [0, 1, 1, 2, 2]
    assert round_up(2_561_024, 4096) == 2_564_096
    assert round_up(4096, 4096) == 4096


def test_mla_page_sizes_from_design_geometry():
    fp8 = MLAAttentionSpec(64, 656, "uint8", SPARSE)
    bf16 = MLAAttentionSpec(64, 576, "bfloat16", SPARSE)
    idx = MLAAttentionSpec(64, 132, "uint8", INDEXER)
    assert (fp8.row_bytes, fp8.page_size_bytes) == (656, 41_984)
    assert (bf16.row_bytes, bf16.page_size_bytes) == (1152, 73_728)
    assert (idx.row_bytes, idx.page_size_bytes) == (132, 8448)
    assert MLAAttentionSpec(16, 8, "float32", SPARSE, num_kv_heads=2).page_size_bytes == 1024


def test_mla_accepts_torch_dtype_and_stores_its_name():
    spec = MLAAttentionSpec(64, 576, torch.bfloat16, SPARSE)
    assert spec.dtype == "bfloat16"
    assert spec == MLAAttentionSpec(64, 576, "bfloat16", SPARSE)
    assert normalize_dtype("X", torch.float8_e4m3fn) == "float8_e4m3fn"


@pytest.mark.parametrize("kwargs, match", [
    (dict(block_size=0), r"MLAAttentionSpec\.block_size must be a positive int, got 0"),
    (dict(head_size=-1), r"MLAAttentionSpec\.head_size must be a positive int, got -1"),
    (dict(num_kv_heads=True), r"num_kv_heads must be a positive int, got True"),
    (dict(dtype="int4"), r"MLAAttentionSpec\.dtype 'int4' is not supported"),
])
def test_mla_rejects_bad_fields(kwargs, match):
    args = dict(block_size=64, head_size=656, dtype="uint8", cache_role=SPARSE)
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        MLAAttentionSpec(**args)


def test_mla_rejects_non_enum_role():
    with pytest.raises(TypeError, match="cache_role must be a SparseCacheRole"):
        MLAAttentionSpec(64, 656, "uint8", "sparse")


def test_full_and_sliding_window_usage():
    config = EngineConfig(max_model_len=1000)
    full = FullAttentionSpec(16, 2, 64, "float16")
    assert full.page_size_bytes == 2 * 16 * 2 * 64 * 2
    assert full.max_memory_usage_bytes(config) == cdiv(1000, 16) * full.page_size_bytes
    window = SlidingWindowSpec(16, 2, 64, "float16", sliding_window=100)
    assert window.page_size_bytes == full.page_size_bytes
    # a whole prompt may be in flight: min(100 - 1 + 1000, 1000) tokens + the straddled page
    assert window.max_memory_usage_bytes(config) == (cdiv(1000, 16) + 1) * full.page_size_bytes
    # with a step budget of 200 tokens: the last 99 computed tokens + 200 in flight
    batched = EngineConfig(max_model_len=1000, max_num_batched_tokens=200)
    assert window.max_memory_usage_bytes(batched) == (cdiv(299, 16) + 1) * full.page_size_bytes
    one = EngineConfig(max_model_len=1000, max_num_batched_tokens=1)
    assert window.max_memory_usage_bytes(one) == (cdiv(100, 16) + 1) * full.page_size_bytes
    wide = SlidingWindowSpec(16, 2, 64, "float16", sliding_window=4096)
    assert wide.max_memory_usage_bytes(config) == (cdiv(1000, 16) + 1) * full.page_size_bytes
    assert wide.max_memory_usage_bytes(batched) == (cdiv(1000, 16) + 1) * full.page_size_bytes
    with pytest.raises(ValueError, match="sliding_window must be a positive int"):
        SlidingWindowSpec(16, 2, 64, "float16")


def test_hisparse_derived_specs():
    config = EngineConfig(max_model_len=163_840)
    resident = HiSparseResidentSpec(64, 41_984)
    hot = HiSparseHotSpec(64, 41_984, blocks_per_request=64)
    assert resident.page_size_bytes == hot.page_size_bytes == 41_984
    assert resident.max_memory_usage_bytes(config) == 2560 * 41_984
    assert hot.max_memory_usage_bytes(config) == 64 * 41_984
    with pytest.raises(ValueError, match="blocks_per_request must be a positive int, got 0"):
        HiSparseHotSpec(64, 41_984, blocks_per_request=0)
    with pytest.raises(ValueError, match="page_size must be a positive int"):
        HiSparseResidentSpec(64, 0)


def test_uniform_type_specs_sum_pages_and_check_block_sizes():
    a = MLAAttentionSpec(64, 132, "uint8", INDEXER)
    b = MLAAttentionSpec(64, 656, "uint8", SPARSE)
    uniform = UniformTypeKVCacheSpecs.from_specs({"a": a, "b": b})
    assert uniform.block_size == 64
    assert uniform.page_size_bytes == 8448 + 41_984
    config = EngineConfig(max_model_len=100)
    assert uniform.max_memory_usage_bytes(config) == 2 * (8448 + 41_984)
    assert hash(uniform) == hash(UniformTypeKVCacheSpecs.from_specs({"a": a, "b": b}))
    with pytest.raises(ValueError, match="needs one block size"):
        UniformTypeKVCacheSpecs.from_specs({"a": a, "c": MLAAttentionSpec(16, 8, "uint8", SPARSE)})
    with pytest.raises(ValueError, match="at least one layer spec"):
        UniformTypeKVCacheSpecs.from_specs({})
    assert uniform.first_spec is a


def test_uniform_type_specs_give_every_layer_the_most_pages():
    # one block table for all layers: each gets as many pages as the layer needing the most
    config = EngineConfig(max_model_len=1000, max_num_batched_tokens=100)
    short = SlidingWindowSpec(16, 1, 8, "float16", sliding_window=32)
    kept = SlidingWindowSpec(16, 2, 8, "float16", sliding_window=32, extra_retained_tokens=20)
    assert (cdiv(short.max_memory_usage_bytes(config), short.page_size_bytes),
            cdiv(kept.max_memory_usage_bytes(config), kept.page_size_bytes)) == (10, 11)
    uniform = UniformTypeKVCacheSpecs.from_specs({"s": short, "k": kept})
    assert uniform.max_memory_usage_bytes(config) == 11 * (512 + 1024)


def test_group_page_sizes_and_blocks_per_request():
    config = EngineConfig(max_model_len=130)
    per_layer = KVCacheGroupSpec(("x", "y", "z"), HiSparseResidentSpec(64, 1000))
    assert per_layer.page_size_bytes == 3000
    assert per_layer.layer_page_size_bytes == 1000
    assert per_layer.blocks_per_request(config) == 3
    assert per_layer.role is KVCacheGroupRole.DEFAULT and per_layer.enable_kv_transfer
    uniform = KVCacheGroupSpec(["p", "q"], UniformTypeKVCacheSpecs.from_specs({
        "p": MLAAttentionSpec(64, 132, "uint8", INDEXER),
        "q": MLAAttentionSpec(64, 132, "uint8", INDEXER)}))
    assert uniform.layer_names == ("p", "q")
    assert uniform.page_size_bytes == 2 * 8448 and uniform.layer_page_size_bytes == 8448
    assert uniform.blocks_per_request(config) == 3
    hot = KVCacheGroupSpec(("h",), HiSparseHotSpec(64, 1000, blocks_per_request=7))
    assert hot.blocks_per_request(config) == 7
    with pytest.raises(ValueError, match="at least one layer"):
        KVCacheGroupSpec((), HiSparseResidentSpec(64, 1000))


def test_kv_cache_config_bytes_per_block_ignores_host_groups():
    host = KVCacheGroupSpec(("s",), HiSparseResidentSpec(64, 9000), host_resident=True)
    small = KVCacheGroupSpec(("a", "b"), HiSparseResidentSpec(64, 1000))
    big = KVCacheGroupSpec(("c",), HiSparseResidentSpec(64, 3000))
    config = KVCacheConfig(num_blocks=4, kv_cache_tensors=[KVCacheTensor(1, ["a"], 1, 1, 0)],
                           kv_cache_groups=[host, small, big])
    assert config.bytes_per_block == 3000
    assert isinstance(config.kv_cache_tensors, tuple)
    assert config.kv_cache_tensors[0].layers == ("a",)
    assert KVCacheConfig(1, (), ()).bytes_per_block == 0
