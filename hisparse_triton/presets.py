"""Built-in model geometries and the ``kv_cache_spec`` dicts they produce.

A preset is data: one frozen :class:`ModelGeometry` record. :func:`build_kv_cache_spec` turns
any record into ``{layer_name: MLAAttentionSpec}``, two entries per sparse-attention layer
``i``:

- ``model.layers.{i}.self_attn.attn``: the SPARSE latent-KV cache (every layer);
- ``model.layers.{i}.self_attn.indexer``: the INDEXER K cache, only on index-group leaders
  (layers ``i % index_share == 0``); followers share their leader's indexer and have none.

Presets (``list_presets()``):

| name | layers | MLA row | indexer row | index share | block | top-k | max context |
| --- | --- | --- | --- | --- | --- | --- | --- |
| ``deepseek-v3.2-fp8`` (default) | 61 | 656 B uint8 | 132 B | 1 | 64 | 2048 | 163,840 |
| ``deepseek-v3.2-bf16`` | 61 | 576 x bfloat16 = 1152 B | 132 B | 1 | 64 | 2048 | 163,840 |
| ``glm-5`` | 78 | 656 B uint8 | 132 B | 1 | 64 | 2048 | 202,752 |
| ``glm-5-indexshare`` | 78 | 656 B uint8 | 132 B | 4 | 64 | 2048 | 202,752 |
| ``tiny`` | 8 | 64 B uint8 | 64 B | 2 | 16 | 32 | 1,024 |

``tiny`` is for tests and ``simulate`` on a CPU: small rows, small pages, four index groups of
two layers, packed two index groups per resident/hot group (2 + 2 groups).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

from hisparse_triton.specs import DTYPE_ITEMSIZE, MLAAttentionSpec, SparseCacheRole

#: Name pattern of a layer's SPARSE (latent KV) cache.
SPARSE_LAYER_NAME = "model.layers.{i}.self_attn.attn"
#: Name pattern of a layer's INDEXER cache.
INDEXER_LAYER_NAME = "model.layers.{i}.self_attn.indexer"


@dataclass(frozen=True)
class ModelGeometry:
    """The KV-cache geometry of one sparse-attention model.

    - ``num_layers``: sparse-MLA layers.
    - ``mla_head_size`` x ``mla_dtype``: one token's latent-KV row (656 x uint8 for
      fp8_ds_mla, 576 x bfloat16 for bf16).
    - ``indexer_head_size`` x ``indexer_dtype``: one token's indexer-K row (132 x uint8).
    - ``index_share``: sparse layers per indexer; leaders are layers ``i % index_share == 0``.
    - ``block_size``: tokens per page; ``index_topk``: rows selected per query;
      ``max_model_len``: the model's maximum context.
    """

    name: str
    description: str
    num_layers: int
    mla_head_size: int
    mla_dtype: str
    max_model_len: int
    indexer_head_size: int = 132
    indexer_dtype: str = "uint8"
    index_share: int = 1
    block_size: int = 64
    index_topk: int = 2048

    def __post_init__(self) -> None:
        for field_name in ("num_layers", "mla_head_size", "max_model_len", "indexer_head_size",
                           "index_share", "block_size", "index_topk"):
            value = getattr(self, field_name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"ModelGeometry.{field_name} must be a positive int, "
                                 f"got {value!r}.")
        for field_name in ("mla_dtype", "indexer_dtype"):
            if getattr(self, field_name) not in DTYPE_ITEMSIZE:
                raise ValueError(f"ModelGeometry.{field_name} {getattr(self, field_name)!r} "
                                 f"is not one of {sorted(DTYPE_ITEMSIZE)}.")

    @property
    def mla_row_bytes(self) -> int:
        return self.mla_head_size * DTYPE_ITEMSIZE[self.mla_dtype]

    @property
    def indexer_row_bytes(self) -> int:
        return self.indexer_head_size * DTYPE_ITEMSIZE[self.indexer_dtype]

    @property
    def num_indexer_layers(self) -> int:
        """Index-group leaders: one indexer per ``index_share`` sparse layers."""
        return -(-self.num_layers // self.index_share)


_GEOMETRIES = (
    ModelGeometry(
        name="deepseek-v3.2-fp8",
        description="DeepSeek-V3.2, fp8_ds_mla KV (656 B rows), every layer a leader",
        num_layers=61, mla_head_size=656, mla_dtype="uint8", max_model_len=163_840),
    ModelGeometry(
        name="deepseek-v3.2-bf16",
        description="DeepSeek-V3.2, bf16 KV (576 x bfloat16 = 1152 B rows)",
        num_layers=61, mla_head_size=576, mla_dtype="bfloat16", max_model_len=163_840),
    ModelGeometry(
        name="glm-5",
        description="GLM-5, fp8_ds_mla KV (656 B rows), every layer a leader",
        num_layers=78, mla_head_size=656, mla_dtype="uint8", max_model_len=202_752),
    ModelGeometry(
        name="glm-5-indexshare",
        description="GLM-5 with IndexShare: one indexer per 4 sparse layers",
        num_layers=78, mla_head_size=656, mla_dtype="uint8", max_model_len=202_752,
        index_share=4),
    ModelGeometry(
        name="tiny",
        description="test geometry: 8 layers, 64 B rows, block 16, top-k 32, index share 2",
        num_layers=8, mla_head_size=64, mla_dtype="uint8", max_model_len=1024,
        indexer_head_size=64, index_share=2, block_size=16, index_topk=32),
)

#: Built-in geometries by name.
PRESETS: dict[str, ModelGeometry] = {g.name: g for g in _GEOMETRIES}

#: The preset ``hisparse-triton plan`` uses by default.
DEFAULT_PRESET = "deepseek-v3.2-fp8"


def list_presets() -> list[str]:
    """Names of the built-in presets, in table order."""
    return list(PRESETS)


def get_preset(name: str) -> ModelGeometry:
    """The preset called ``name``; ``ValueError`` naming the known presets otherwise."""
    try:
        return PRESETS[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown preset {name!r}; choose one of "
                         f"{', '.join(list_presets())}.") from None


def build_kv_cache_spec(preset: Union[str, ModelGeometry], *, num_layers: Optional[int] = None,
                        block_size: Optional[int] = None) -> dict[str, MLAAttentionSpec]:
    """``{layer_name: MLAAttentionSpec}`` for a preset (a name or a ``ModelGeometry``).

    ``num_layers`` / ``block_size`` override the preset's values (e.g. a few layers for a
    test). Layers come in model order, each SPARSE entry followed by its INDEXER entry on
    leaders.
    """
    geometry = get_preset(preset) if isinstance(preset, str) else preset
    if not isinstance(geometry, ModelGeometry):
        raise ValueError(f"preset must be a preset name or a ModelGeometry, got {preset!r}.")
    layers = geometry.num_layers if num_layers is None else num_layers
    block = geometry.block_size if block_size is None else block_size
    for name, value in (("num_layers", layers), ("block_size", block)):
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ValueError(f"{name} must be a positive int, got {value!r}.")
    specs: dict[str, MLAAttentionSpec] = {}
    for i in range(layers):
        leader = i % geometry.index_share == 0
        specs[SPARSE_LAYER_NAME.format(i=i)] = MLAAttentionSpec(
            block_size=block, head_size=geometry.mla_head_size, dtype=geometry.mla_dtype,
            cache_role=SparseCacheRole.SPARSE, is_index_group_leader=leader)
        if leader:
            specs[INDEXER_LAYER_NAME.format(i=i)] = MLAAttentionSpec(
                block_size=block, head_size=geometry.indexer_head_size,
                dtype=geometry.indexer_dtype, cache_role=SparseCacheRole.INDEXER,
                is_index_group_leader=True)
    return specs


__all__ = [
    "DEFAULT_PRESET",
    "INDEXER_LAYER_NAME",
    "PRESETS",
    "SPARSE_LAYER_NAME",
    "ModelGeometry",
    "build_kv_cache_spec",
    "get_preset",
    "list_presets",
]
