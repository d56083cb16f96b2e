"""Built-in geometries: the published model facts and the kv_cache_spec dicts they build."""

import dataclasses

import pytest

from hisparse_triton.config import EngineConfig, HiSparseConfig
from hisparse_triton.layout import get_hisparse_kv_cache_groups, group_kind
from hisparse_triton.presets import (
    DEFAULT_PRESET,
    PRESETS,
    ModelGeometry,
    build_kv_cache_spec,
    get_preset,
    list_presets,
)
from hisparse_triton.specs import MLAAttentionSpec, SparseCacheRole

SPARSE = SparseCacheRole.SPARSE
INDEXER = SparseCacheRole.INDEXER


def test_preset_names_and_default():
    assert list_presets() == ["deepseek-v3.2-fp8", "deepseek-v3.2-bf16", "glm-5",
                              "glm-5-indexshare", "tiny"]
    assert DEFAULT_PRESET == "deepseek-v3.2-fp8" and DEFAULT_PRESET in PRESETS
    assert all(isinstance(g, ModelGeometry) and g.name == n for n, g in PRESETS.items())
    with pytest.raises(dataclasses.FrozenInstanceError):
        PRESETS["glm-5"].num_layers = 1


@pytest.mark.parametrize("name, layers, row, max_len, share", [
    ("deepseek-v3.2-fp8", 61, 656, 163_840, 1),
    ("deepseek-v3.2-bf16", 61, 1152, 163_840, 1),
    ("glm-5", 78, 656, 202_752, 1),
    ("glm-5-indexshare", 78, 656, 202_752, 4),
])
def test_design_geometry(name, layers, row, max_len, share):
    g = get_preset(name)
    assert (g.num_layers, g.mla_row_bytes, g.max_model_len, g.index_share) == \
        (layers, row, max_len, share)
    assert g.mla_row_bytes % 16 == 0
    assert (g.indexer_row_bytes, g.indexer_dtype, g.block_size, g.index_topk) == \
        (132, "uint8", 64, 2048)


def test_dsv32_fp8_spec_dict():
    spec = build_kv_cache_spec("deepseek-v3.2-fp8")
    assert len(spec) == 122
    names = list(spec)
    assert names[:4] == ["model.layers.0.self_attn.attn", "model.layers.0.self_attn.indexer",
                         "model.layers.1.self_attn.attn", "model.layers.1.self_attn.indexer"]
    sparse = spec["model.layers.60.self_attn.attn"]
    assert sparse == MLAAttentionSpec(64, 656, "uint8", SPARSE, is_index_group_leader=True)
    indexer = spec["model.layers.60.self_attn.indexer"]
    assert indexer.cache_role is INDEXER and indexer.page_size_bytes == 64 * 132
    per_token = sum(s.row_bytes for s in spec.values())
    assert per_token == 40_016 + 8052


def test_bf16_rows_are_576_bfloat16():
    spec = build_kv_cache_spec("deepseek-v3.2-bf16")["model.layers.0.self_attn.attn"]
    assert (spec.head_size, spec.dtype, spec.row_bytes) == (576, "bfloat16", 1152)


def test_index_share_leaders_and_followers():
    spec = build_kv_cache_spec("glm-5-indexshare")
    sparse = {n: s for n, s in spec.items() if s.cache_role is SPARSE}
    indexers = [n for n, s in spec.items() if s.cache_role is INDEXER]
    assert len(sparse) == 78 and len(indexers) == 20
    leaders = [i for i in range(78) if sparse[f"model.layers.{i}.self_attn.attn"]
               .is_index_group_leader]
    assert leaders == list(range(0, 78, 4))
    assert indexers == [f"model.layers.{i}.self_attn.indexer" for i in leaders]


def test_tiny_is_small_and_exercises_packing():
    g = get_preset("tiny")
    assert g.num_layers <= 8 and g.block_size == 16 and g.mla_row_bytes == 64
    config = EngineConfig(g.max_model_len, HiSparseConfig(index_topk=g.index_topk,
                                                           host_pool_gib=0.01))
    groups = get_hisparse_kv_cache_groups(config, build_kv_cache_spec("tiny"))
    kinds = [group_kind(x) for x in groups]
    assert kinds == ["source", "indexer", "resident", "resident", "hot", "hot"]
    assert [len(x.layer_names) for x in groups[2:]] == [4, 4, 4, 4]
    assert groups[4].kv_cache_spec.blocks_per_request == 2 * 32 // 16


def test_overrides_and_geometry_objects():
    spec = build_kv_cache_spec("glm-5-indexshare", num_layers=6, block_size=16)
    assert len(spec) == 6 + 2 and all(s.block_size == 16 for s in spec.values())
    custom = dataclasses.replace(get_preset("tiny"), num_layers=3, index_share=3)
    assert list(build_kv_cache_spec(custom)) == [
        "model.layers.0.self_attn.attn", "model.layers.0.self_attn.indexer",
        "model.layers.1.self_attn.attn", "model.layers.2.self_attn.attn"]


def test_bad_inputs():
    with pytest.raises(ValueError, match="unknown preset 'llama'; choose one of deepseek-v3.2-fp8"):
        build_kv_cache_spec("llama")
    with pytest.raises(ValueError, match="num_layers must be a positive int, got 0"):
        build_kv_cache_spec("tiny", num_layers=0)
    with pytest.raises(ValueError, match="block_size must be a positive int"):
        build_kv_cache_spec("tiny", block_size=-16)
    with pytest.raises(ValueError, match="ModelGeometry.index_share must be a positive int"):
        dataclasses.replace(get_preset("tiny"), index_share=0)
    with pytest.raises(ValueError, match="ModelGeometry.mla_dtype 'fp4'"):
        dataclasses.replace(get_preset("tiny"), mla_dtype="fp4")
    with pytest.raises(ValueError, match="preset must be a preset name or a ModelGeometry"):
        build_kv_cache_spec(42)
