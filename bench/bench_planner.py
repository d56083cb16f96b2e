"""pytest-benchmark: CPU cost of the layout planner (what ``hisparse-triton plan`` and an
engine's start-up pay). Run: ``pytest bench/bench_planner.py --benchmark-only``.

The planner imports no torch; these numbers are pure Python.
"""

from __future__ import annotations

import pytest

from hisparse_triton.commands.plan import build_plan
from hisparse_triton.config import GIB, EngineConfig, HiSparseConfig
from hisparse_triton.layout import (
    build_hisparse_topology,
    create_hisparse_layout,
    get_hisparse_kv_cache_config,
    get_hisparse_kv_cache_groups,
    get_hisparse_steady_state_concurrency,
)
from hisparse_triton.presets import build_kv_cache_spec, get_preset

PRESETS = ("deepseek-v3.2-fp8", "glm-5", "glm-5-indexshare")
GPU_BYTES = 80 * GIB
HOST_BYTES = 512 * GIB


def _config(preset: str) -> tuple[EngineConfig, dict]:
    geometry = get_preset(preset)
    hisparse = HiSparseConfig(index_topk=geometry.index_topk, host_pool_gib=HOST_BYTES / GIB)
    config = EngineConfig(max_model_len=geometry.max_model_len, hisparse=hisparse)
    return config, build_kv_cache_spec(geometry)


@pytest.mark.parametrize("preset", PRESETS)
def test_build_kv_cache_spec(benchmark, preset):
    spec = benchmark(build_kv_cache_spec, preset)
    assert len(spec) >= get_preset(preset).num_layers


@pytest.mark.parametrize("preset", PRESETS)
def test_get_hisparse_kv_cache_groups(benchmark, preset):
    config, spec = _config(preset)
    groups = benchmark(get_hisparse_kv_cache_groups, config, spec)
    assert groups is not None and groups[0].host_resident


@pytest.mark.parametrize("preset", PRESETS)
def test_create_hisparse_layout(benchmark, preset):
    config, spec = _config(preset)
    groups = get_hisparse_kv_cache_groups(config, spec)
    layout = benchmark(create_hisparse_layout, config, groups, HOST_BYTES)
    assert layout.host_num_blocks > 0


@pytest.mark.parametrize("row_aligned", [False, True], ids=["plain", "row-aligned"])
@pytest.mark.parametrize("preset", PRESETS)
def test_full_plan(benchmark, preset, row_aligned):
    """Spec -> groups -> KVCacheConfig (with its topology) -> steady-state concurrency: an
    engine's start-up."""
    config, spec = _config(preset)

    def plan():
        groups = get_hisparse_kv_cache_groups(config, spec)
        kv = get_hisparse_kv_cache_config(config, groups, GPU_BYTES, HOST_BYTES,
                                          row_aligned_blocks=row_aligned)
        return get_hisparse_steady_state_concurrency(config, kv)

    assert benchmark(plan) > 0


@pytest.mark.parametrize("preset", PRESETS)
def test_build_hisparse_topology(benchmark, preset):
    config, spec = _config(preset)
    groups = get_hisparse_kv_cache_groups(config, spec)
    topology = benchmark(build_hisparse_topology, groups)
    assert len(topology.index_groups) == get_preset(preset).num_indexer_layers


@pytest.mark.parametrize("preset", PRESETS)
def test_plan_report(benchmark, preset):
    """What ``hisparse-triton plan --row-aligned-blocks --max-num-batched-tokens 8192``
    computes after start-up (the report, without printing)."""
    report = benchmark(build_plan, preset, row_aligned_blocks=True,
                       max_num_batched_tokens=8192)
    assert report["row_aligned_blocks"] and report["steady_state_concurrency"] > 0
