"""Differential test: our planner against vLLM 0.33.0's own planner on random geometries.

Both planners get the same inputs (our specs translated to vLLM's spec classes, a stand-in for
``VllmConfig`` that carries exactly the settings the planner reads) and must agree on every
number: the groups (kind, layers, page bytes, blocks per request), the host pool (blocks,
stride), the device pool (blocks, bytes per block), every layer's byte offset and strides in
both pools, and the steady-state concurrency. vLLM always rounds the block up to whole sparse
pages, so ours plans with ``row_aligned_blocks=True``; ``max_concurrent_batches`` 2 stands
for vLLM's async scheduling. Two families of geometries: one sparse row for every layer, and
mixed sparse pages in the host source group (rows drawn per index group: 41,984 B and
81,920 B pages at block 64, equal pages from different dtypes), where the host regions'
order (vLLM's: by equal spec, specs in first-seen order) is what can differ.

Runs only where vLLM 0.33.0 imports (its source on ``sys.path`` plus the pure-Python
packages its config and KV-cache modules import: pydantic, packaging, regex, numpy, cbor2,
psutil, pyzmq, urllib3, requests, transformers, aiohttp, openai, openai-harmony, pillow,
pybase64, cachetools, msgspec, cloudpickle, uvloop, py-cpuinfo, prometheus_client,
xgrammar, fastapi, partial_json_parser, llguidance; torch); skipped with the reason
otherwise. The fixed-number tests in ``test_layout_vllm_rules.py`` always run.
"""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest

try:
    import torch
    import vllm
    from vllm.config import VllmConfig
    from vllm.v1 import kv_cache_interface as vki
    from vllm.v1.hisparse import layout as vllm_layout
    from vllm.v1.kv_cache_layout import KVCacheLayout
except Exception as exc:  # ImportError, or a vLLM module failing on a missing dependency
    pytest.skip(f"vLLM 0.33.0 does not import here ({type(exc).__name__}: {exc}); the "
                f"differential planner test needs vLLM's source and its pure-Python "
                f"dependencies (see this module's docstring)", allow_module_level=True)

if not vllm.__version__.startswith("0.33.0"):  # pragma: no cover - depends on the venv
    pytest.skip(f"the differential planner test compares with vLLM 0.33.0, found "
                f"{vllm.__version__}", allow_module_level=True)

from hisparse_triton.config import EngineConfig, HiSparseConfig  # noqa: E402
from hisparse_triton.layout import (  # noqa: E402
    admission_blocks_per_request,
    get_hisparse_concurrency,
    get_hisparse_kv_cache_config,
    get_hisparse_kv_cache_groups,
    group_kind,
)
from hisparse_triton.specs import (  # noqa: E402
    FullAttentionSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
    SparseCacheRole,
    cdiv,
)

NUM_GEOMETRIES = 300
NUM_MIXED = 200
SEED = 20_330

TORCH_DTYPES = {"uint8": torch.uint8, "float8_e4m3fn": torch.float8_e4m3fn,
                "bfloat16": torch.bfloat16, "float16": torch.float16,
                "float32": torch.float32}


class VllmConfigStandIn:
    """The settings of a ``VllmConfig`` that vLLM's planner reads, from our ``EngineConfig``.

    ``max_concurrent_batches`` / ``max_in_flight_tokens`` are vLLM's own property code.
    """

    max_concurrent_batches = VllmConfig.max_concurrent_batches
    max_in_flight_tokens = VllmConfig.max_in_flight_tokens

    def __init__(self, config: EngineConfig, index_topk: int) -> None:
        assert config.hisparse is not None and config.max_concurrent_batches in (1, 2)
        batched = config.max_num_batched_tokens
        self.attention_config = SimpleNamespace(hisparse_config=SimpleNamespace(
            device_buffer_size=config.hisparse.device_buffer_size, eager_host_mirror=True))
        self.scheduler_config = SimpleNamespace(
            disable_hybrid_kv_cache_manager=False,
            max_num_batched_tokens=config.max_model_len if batched is None else batched,
            async_scheduling=config.max_concurrent_batches == 2)
        self.use_v2_model_runner = False
        self.cache_config = SimpleNamespace(
            get_resolved_kv_cache_layout=lambda: KVCacheLayout.BLHNC,
            num_gpu_blocks_override=config.num_gpu_blocks_override,
            prefix_cache_retention_interval=0)
        self.model_config = SimpleNamespace(max_model_len=config.max_model_len,
                                            hf_config=SimpleNamespace(index_topk=index_topk))
        self.parallel_config = SimpleNamespace(
            tensor_parallel_size=config.tensor_parallel_size, pipeline_parallel_size=1,
            decode_context_parallel_size=1, prefill_context_parallel_size=1,
            world_size=config.tensor_parallel_size, distributed_executor_backend="mp",
            nnodes_within_dp=1)
        self.speculative_config = None
        self.kv_transfer_config = None


def vllm_spec(spec, index_topk: int):
    """Our spec as the vLLM 0.33 spec with the same pages."""
    dtype = TORCH_DTYPES[spec.dtype]
    if isinstance(spec, MLAAttentionSpec):
        return vki.MLAAttentionSpec(
            block_size=spec.block_size, num_kv_heads=spec.num_kv_heads,
            head_size=spec.head_size, dtype=dtype,
            cache_role=vki.SparseCacheRole(spec.cache_role.value),
            is_index_group_leader=spec.is_index_group_leader, topk_buffer_width=index_topk)
    if isinstance(spec, SlidingWindowSpec):
        return vki.SlidingWindowSpec(
            block_size=spec.block_size, num_kv_heads=spec.num_kv_heads,
            head_size=spec.head_size, dtype=dtype, sliding_window=spec.sliding_window,
            extra_retained_tokens=spec.extra_retained_tokens)
    assert type(spec) is FullAttentionSpec
    return vki.FullAttentionSpec(block_size=spec.block_size, num_kv_heads=spec.num_kv_heads,
                                 head_size=spec.head_size, dtype=dtype)


# --- random geometries ----------------------------------------------------------------------

def random_geometry(rng: random.Random):
    """``(config, kv_cache_spec, available_memory, host_budget, index_topk)``."""
    block = rng.choice((16, 32, 64, 64, 64))
    num_sparse = rng.randint(1, 64)
    share = rng.choice((1, 1, 2, 4))
    mla_row = rng.choice(((656, "uint8"), (576, "bfloat16"), (64, "uint8"), (160, "uint8")))
    index_row = rng.choice((132, 132, 64, 16))
    specs: dict = {}
    for i in range(num_sparse):
        leader = i % share == 0
        specs[f"model.layers.{i}.attn"] = MLAAttentionSpec(
            block, mla_row[0], mla_row[1], SparseCacheRole.SPARSE, leader)
        if leader:
            specs[f"model.layers.{i}.indexer"] = MLAAttentionSpec(
                block, index_row, "uint8", SparseCacheRole.INDEXER, True)
    regular = []
    for t in range(rng.choice((0, 1, 2, 2, 3, 3))):
        reg_block = block if rng.random() < 0.8 else rng.choice((16, 32, 128))
        heads, head_size = rng.choice((1, 2, 4, 8)), rng.choice((32, 64, 128))
        dtype = rng.choice(("bfloat16", "float8_e4m3fn", "float32"))
        if rng.random() < 0.5:
            spec = FullAttentionSpec(reg_block, heads, head_size, dtype)
        else:
            spec = SlidingWindowSpec(reg_block, heads, head_size, dtype,
                                     sliding_window=rng.choice((32, 128, 512, 4096)),
                                     extra_retained_tokens=rng.choice((0, 0, 0, 1, 3)))
        regular += [(f"regular.{t}.{j}", spec) for j in range(rng.randint(1, 8))]
    rng.shuffle(regular)
    specs.update(regular)
    max_model_len = rng.choice((1024, 4096, 32_768, 163_840)) + rng.choice((0, 0, 1, 17))
    top_k = rng.choice((64, 512, 2048))
    buffer = rng.choice((None, None, top_k, 2 * top_k + rng.choice((0, 1, block))))
    tp = rng.choice((1, 1, 2, 8))
    hisparse = HiSparseConfig(index_topk=top_k, device_buffer_size=buffer, host_pool_gib=1,
                              shared_host_pool=tp > 1 and rng.random() < 0.7)
    batched = rng.choice((None, 64, 1000, 8192, 1 << 20))
    config = EngineConfig(max_model_len, hisparse, tensor_parallel_size=tp,
                          max_num_batched_tokens=batched,
                          max_concurrent_batches=rng.choice((1, 2)),
                          num_gpu_blocks_override=rng.choice((None,) * 5 + (5000,)))
    sparse_page = block * mla_row[0] * (2 if mla_row[1] == "bfloat16" else 1)
    host_blocks = (cdiv(max_model_len, block) + 2) * rng.choice((1, 2, 7))
    host_budget = host_blocks * (num_sparse * sparse_page + 4096) + rng.randrange(4096)
    available = rng.choice((1, 4, 80)) << 30
    return config, specs, available, host_budget, top_k


#: Sparse rows the mixed family draws from: fp8_ds_mla (656 B), its bf16 twin of the same
#: page (328 bf16), 1,280 B rows (uint8 or bf16: 81,920 B pages at block 64), a bf16 MLA row.
MIXED_ROWS = ((656, "uint8"), (328, "bfloat16"), (1280, "uint8"), (640, "bfloat16"),
              (576, "bfloat16"))


def random_mixed_geometry(rng: random.Random):
    """``random_geometry`` with the sparse rows drawn again per index group (a new row at
    half of the leaders), so the source group mixes page sizes and specs; the host budget is
    sized for the new pages."""
    config, specs, available, _, top_k = random_geometry(rng)
    row, mixed = None, {}
    for name, spec in specs.items():
        if isinstance(spec, MLAAttentionSpec) and spec.cache_role is SparseCacheRole.SPARSE:
            if row is None or (spec.is_index_group_leader and rng.random() < 0.5):
                row = rng.choice(MIXED_ROWS)
            spec = MLAAttentionSpec(spec.block_size, row[0], row[1], spec.cache_role,
                                    spec.is_index_group_leader)
        mixed[name] = spec
    source = sum(s.page_size_bytes for s in mixed.values()
                 if isinstance(s, MLAAttentionSpec) and s.cache_role is SparseCacheRole.SPARSE)
    block = next(iter(mixed.values())).block_size
    host_blocks = (cdiv(config.max_model_len, block) + 2) * rng.choice((1, 2, 7))
    host_budget = host_blocks * (source + 4096) + rng.randrange(4096)
    return config, mixed, available, host_budget, top_k


# --- both plans as comparable numbers -------------------------------------------------------

def _vllm_kind(group) -> str:
    if group.role is vki.KVCacheGroupRole.HISPARSE_SOURCE:
        return "source"
    if group.role is vki.KVCacheGroupRole.HISPARSE_INDEXER:
        return "indexer"
    if isinstance(group.kv_cache_spec, vki.HiSparseResidentSpec):
        return "resident"
    if isinstance(group.kv_cache_spec, vki.HiSparseHotSpec):
        return "hot"
    return "regular"


def _vllm_layer_page(group, name) -> int:
    spec = group.kv_cache_spec
    if isinstance(spec, vki.UniformTypeKVCacheSpecs):
        return spec.kv_cache_specs[name].page_size_bytes
    return spec.page_size_bytes


def vllm_numbers(config, specs, available, host_budget, top_k, monkeypatch):
    stand_in = VllmConfigStandIn(config, top_k)
    monkeypatch.setattr(vllm_layout, "use_shared_hisparse_host_pool",
                        lambda _: config.shared_host_pool)
    groups = vllm_layout.get_hisparse_kv_cache_groups(
        stand_in, {name: vllm_spec(spec, top_k) for name, spec in specs.items()})
    kv = vllm_layout.get_hisparse_kv_cache_config(stand_in, groups, available, host_budget)
    device = {t.size for t in kv.kv_cache_tensors if not t.host_resident}
    assert len(device) == 1
    places = {}
    for t in kv.kv_cache_tensors:
        for i, name in enumerate(t.layers):
            places[(t.host_resident, name)] = (t.offset + i * t.layer_stride, t.block_stride,
                                               t.layer_stride)
    return {
        "groups": [(_vllm_kind(g), tuple(g.layer_names),
                    sum(_vllm_layer_page(g, n) for n in g.layer_names),
                    cdiv(g.kv_cache_spec.max_memory_usage_bytes(stand_in),
                         g.kv_cache_spec.page_size_bytes))
                   for g in kv.kv_cache_groups],
        "host": (kv.hisparse_host_num_blocks, kv.hisparse_host_block_stride,
                 kv.hisparse_shared_host_pool),
        "device": (kv.num_blocks, device.pop() // kv.num_blocks),
        "places": places,
        "concurrency": vllm_layout.get_hisparse_steady_state_concurrency(stand_in, kv),
    }


def our_numbers(config, specs, available, host_budget):
    groups = get_hisparse_kv_cache_groups(config, specs)
    kv = get_hisparse_kv_cache_config(config, groups, available, host_budget,
                                      row_aligned_blocks=True)
    places = {(t.host_resident, name): (t.offset, t.block_stride, t.layer_stride)
              for t in kv.kv_cache_tensors for name in t.layers}
    return {
        "groups": [(group_kind(g), g.layer_names, g.page_size_bytes,
                    admission_blocks_per_request(config, g)) for g in kv.kv_cache_groups],
        "host": (kv.hisparse_host_num_blocks, kv.hisparse_host_block_stride,
                 kv.hisparse_shared_host_pool),
        "device": (kv.num_blocks, kv.bytes_per_block),
        "places": places,
        "concurrency": get_hisparse_concurrency(config, kv).steady_state,
    }


def _cases():
    rng = random.Random(SEED)
    uniform = [random_geometry(rng) for _ in range(NUM_GEOMETRIES)]
    return uniform + [random_mixed_geometry(rng) for _ in range(NUM_MIXED)]


CASES = _cases()


def _source_pages(specs) -> list[int]:
    return [s.page_size_bytes for s in specs.values()
            if isinstance(s, MLAAttentionSpec) and s.cache_role is SparseCacheRole.SPARSE]


@pytest.mark.filterwarnings("ignore::hisparse_triton.layout.HiSparsePlanWarning")
@pytest.mark.parametrize("index", range(NUM_GEOMETRIES + NUM_MIXED),
                         ids=[f"{'mixed' if i >= NUM_GEOMETRIES else 'uniform'}-{i}"
                              for i in range(NUM_GEOMETRIES + NUM_MIXED)])
def test_planner_equals_vllm(index, monkeypatch):
    """Every number of both plans is equal (0 differences); the only geometries not
    compared are those both planners reject and those vLLM loses layers of."""
    config, specs, available, host_budget, top_k = CASES[index]
    regular = {name for name, spec in specs.items() if not isinstance(spec, MLAAttentionSpec)}
    try:
        theirs = vllm_numbers(config, specs, available, host_budget, top_k, monkeypatch)
    except (ValueError, AssertionError, NotImplementedError) as exc:
        # vLLM rejects the plan: ours must reject it too
        with pytest.raises(ValueError):
            our_numbers(config, specs, available, host_budget)
        pytest.skip(f"both planners reject this geometry (vLLM: {exc})")
    except StopIteration:
        theirs = None  # vLLM's packed split made an empty group (see below)
    try:
        ours = our_numbers(config, specs, available, host_budget)
    except ValueError as exc:
        if theirs is not None:
            raise
        # vLLM failed in its regular grouping before it reached the sparse layers: without
        # the regular layers, its HiSparse layout must reject them as ours does
        mla = {name: spec for name, spec in specs.items() if name not in regular}
        with pytest.raises((ValueError, AssertionError)):
            vllm_numbers(config, mla, available, host_budget, top_k, monkeypatch)
        pytest.skip(f"both planners reject this geometry's sparse layers (ours: {exc})")
    if theirs is None or not regular <= {n for _, names, _, _ in theirs["groups"] for n in names}:
        # vLLM's packed grouping pairs an unbalanced sliding-window bucket's page sizes with
        # zip when it splits the bucket, which drops layers (or leaves a group empty and
        # fails); ours keeps every layer, so there is nothing to compare
        assert regular <= {n for _, names, _, _ in ours["groups"] for n in names}
        pytest.skip("vLLM loses layers of this geometry; ours plans every layer")
    assert ours["groups"] == theirs["groups"]
    assert ours["host"] == theirs["host"]
    assert ours["device"] == theirs["device"]
    assert ours["places"] == theirs["places"]
    block = next(iter(specs.values())).block_size
    if config.in_flight_tokens <= block:
        # one step writes at most one page: vLLM counts one steady tail page per resident
        # group (its admission charge), though both runtimes keep the last two pages pinned;
        # ours counts the two, so it admits no more than vLLM
        assert ours["concurrency"] <= theirs["concurrency"]
    else:
        assert ours["concurrency"] == pytest.approx(theirs["concurrency"], rel=1e-12)


@pytest.mark.filterwarnings("ignore::hisparse_triton.layout.HiSparsePlanWarning")
def test_the_mixed_geometries_are_planned_with_mixed_source_pages(monkeypatch):
    """The mixed family is not vacuous: vLLM plans many of its geometries, and they put
    pages of different sizes, and equal pages of different specs, in the host source group
    (the layouts whose region order ``test_planner_equals_vllm`` compares)."""
    planned = sizes = specs_per_page = 0
    for config, specs, available, host_budget, top_k in CASES[NUM_GEOMETRIES:]:
        try:
            vllm_numbers(config, specs, available, host_budget, top_k, monkeypatch)
        except Exception:  # noqa: BLE001 - rejected or layers lost: not compared
            continue
        planned += 1
        pages = _source_pages(specs)
        sizes += len(set(pages)) > 1
        sparse = {s for s in specs.values()
                  if isinstance(s, MLAAttentionSpec) and s.cache_role is SparseCacheRole.SPARSE}
        specs_per_page += any(sum(s.page_size_bytes == p for s in sparse) > 1 for p in pages)
    assert planned >= 50 and sizes >= 25 and specs_per_page >= 10, (planned, sizes,
                                                                     specs_per_page)


def test_the_geometries_cover_every_grouping_rule():
    """The random draw exercises each of vLLM's regular-grouping rules at least once."""
    from hisparse_triton.regular_groups import uniform_type_key

    seen = set()
    for _, specs, *_ in CASES:
        regular = {n: s for n, s in specs.items() if not isinstance(s, MLAAttentionSpec)}
        if not regular:
            continue
        if len(set(regular.values())) == 1:
            seen.add("one spec")
        elif len({uniform_type_key(s) for s in regular.values()}) == 1:
            seen.add("one type")
        elif len({s.page_size_bytes for s in regular.values()}) > 1:
            seen.add("packed")
        else:
            seen.add("equal count")
    assert seen == {"one spec", "one type", "packed", "equal count"}
