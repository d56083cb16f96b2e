"""Planner invariants over random valid geometries (hypothesis)."""

import dataclasses
from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hisparse_triton.config import EngineConfig, HiSparseConfig
from hisparse_triton.layout import (
    admission_blocks_per_request,
    build_hisparse_topology,
    create_hisparse_layout,
    device_bytes_per_block,
    device_row_layout,
    get_hisparse_concurrency,
    get_hisparse_kv_cache_config,
    get_hisparse_kv_cache_groups,
    get_hisparse_steady_state_concurrency,
    group_kind,
    split_index_groups,
    underlying_layer_name,
)
from hisparse_triton.specs import (
    FullAttentionSpec,
    KVCacheSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
    SparseCacheRole,
    cdiv,
)

# random hot-buffer sizes are rarely whole pages: that warning is tested in test_layout.py
pytestmark = pytest.mark.filterwarnings("ignore::hisparse_triton.layout.HiSparsePlanWarning")

SETTINGS = settings(max_examples=60, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])


@dataclass
class Case:
    config: EngineConfig
    spec: dict[str, KVCacheSpec]
    host_budget: int
    sparse_names: list[str]


@st.composite
def cases(draw) -> Case:
    block = draw(st.sampled_from([16, 32, 64]))
    num_sparse = draw(st.integers(1, 40))
    leaders = draw(st.lists(st.booleans(), min_size=num_sparse, max_size=num_sparse))
    row = 16 * draw(st.integers(1, 80))
    spec: dict[str, KVCacheSpec] = {}
    sparse_names = []
    for i, lead in enumerate(leaders):
        name = f"model.layers.{i}.self_attn.attn"
        spec[name] = MLAAttentionSpec(block, row, "uint8", SparseCacheRole.SPARSE,
                                      is_index_group_leader=lead)
        sparse_names.append(name)
    indexer_row = draw(st.integers(4, 300))
    for i in range(draw(st.integers(1, 12))):
        spec[f"model.layers.{i}.self_attn.indexer"] = MLAAttentionSpec(
            block, indexer_row, "uint8", SparseCacheRole.INDEXER, is_index_group_leader=True)
    for i in range(draw(st.integers(0, 4))):
        regular_block = draw(st.sampled_from([16, 64]))
        if draw(st.booleans()):
            spec[f"dense.{i}"] = FullAttentionSpec(regular_block, draw(st.integers(1, 2)), 64,
                                                   "bfloat16")
        else:
            spec[f"window.{i}"] = SlidingWindowSpec(regular_block, 1, 64, "bfloat16",
                                                    sliding_window=draw(st.integers(1, 512)))
    topk = draw(st.integers(1, 64))
    query_len = draw(st.integers(1, 3))
    buffer = draw(st.integers(query_len * topk, (query_len + 2) * topk))
    pp, nodes = draw(st.sampled_from([1, 2])), draw(st.sampled_from([1, 2]))
    shared = draw(st.sampled_from([None, False] + ([True] if pp == nodes == 1 else [])))
    hisparse = HiSparseConfig(index_topk=topk, device_buffer_size=buffer, host_pool_gib=1,
                              max_decode_query_len=query_len, shared_host_pool=shared)
    config = EngineConfig(max_model_len=draw(st.integers(1, 5000)), hisparse=hisparse,
                          tensor_parallel_size=draw(st.sampled_from([1, 2, 8])),
                          pipeline_parallel_size=pp, num_nodes=nodes,
                          max_num_batched_tokens=draw(st.none() | st.integers(1, 6000)))
    stride = len(sparse_names) * block * row
    if config.shared_host_pool:
        stride = cdiv(stride, 4096) * 4096
    needed = cdiv(config.max_model_len, block) + 2
    host_budget = (needed + draw(st.integers(0, 500))) * stride + draw(st.integers(0, stride - 1))
    return Case(config, spec, host_budget, sparse_names)


def _groups(case: Case):
    groups = get_hisparse_kv_cache_groups(case.config, case.spec)
    assert groups is not None
    return groups


@SETTINGS
@given(cases())
def test_groups_partition_the_layers(case):
    groups = _groups(case)
    by_kind: dict[str, list] = {}
    for group in groups:
        by_kind.setdefault(group_kind(group), []).append(group)
    assert [group_kind(g) for g in groups[:2]] == ["source", "indexer"]
    assert len(by_kind["source"]) == len(by_kind["indexer"]) == 1
    assert len(by_kind["resident"]) == len(by_kind["hot"]) >= 1
    order = [group_kind(g) for g in groups]
    assert order == sorted(order, key=["source", "indexer", "resident", "hot", "regular"].index)
    source = by_kind["source"][0]
    assert list(source.layer_names) == case.sparse_names and source.host_resident
    # every sparse layer sits in exactly one resident and one hot group, in model order
    for kind in ("resident", "hot"):
        names = [underlying_layer_name(n) for g in by_kind[kind] for n in g.layer_names]
        assert names == case.sparse_names
    for resident, hot in zip(by_kind["resident"], by_kind["hot"]):
        assert [underlying_layer_name(n) for n in resident.layer_names] == \
            [underlying_layer_name(n) for n in hot.layer_names]
    # source + indexer + regular cover every input layer exactly once
    plain = [n for g in groups if group_kind(g) in ("source", "indexer", "regular")
             for n in g.layer_names]
    assert sorted(plain) == sorted(case.spec)


@SETTINGS
@given(cases())
def test_hot_groups_fit_the_indexer_page_unless_a_single_unit(case):
    groups = _groups(case)
    indexer_page = groups[1].page_size_bytes
    units = split_index_groups({n: case.spec[n] for n in case.sparse_names})
    unit_of = {name: k for k, unit in enumerate(units) for name in unit}
    packed = []
    for group in groups:
        if group_kind(group) in ("resident", "hot"):
            layers = [underlying_layer_name(n) for n in group.layer_names]
            group_units = {unit_of[n] for n in layers}
            # an index group is never split across two groups
            assert all(set(units[u]) <= set(layers) for u in group_units)
            if group.page_size_bytes > indexer_page:
                assert len(group_units) == 1
            if group_kind(group) == "resident":
                packed.append(sorted(group_units))
    # greedy: the next group's first unit would not have fit in the previous group
    for prev, nxt in zip(packed, packed[1:]):
        prev_bytes = sum(len(units[u]) for u in prev) * case.spec[case.sparse_names[0]].page_size_bytes
        first = len(units[nxt[0]]) * case.spec[case.sparse_names[0]].page_size_bytes
        assert prev_bytes + first > indexer_page


@SETTINGS
@given(cases(), st.integers(2, 3000), st.booleans(), st.data())
def test_tensors_do_not_overlap_and_lie_inside_the_pools(case, blocks, aligned, data):
    groups = _groups(case)
    bytes_per_block = device_bytes_per_block(groups, row_aligned_blocks=aligned)
    memory = blocks * bytes_per_block + data.draw(st.integers(0, bytes_per_block - 1))
    kv = get_hisparse_kv_cache_config(case.config, groups, memory, case.host_budget,
                                      row_aligned_blocks=aligned)
    assert kv.bytes_per_block == bytes_per_block and kv.num_blocks == blocks
    assert kv.row_aligned_blocks is aligned
    pool = kv.num_blocks * kv.bytes_per_block
    device = [t for t in kv.kv_cache_tensors if not t.host_resident]
    owner = {}
    for tensor in device:
        assert tensor.block_stride == kv.bytes_per_block
        assert tensor.size == kv.num_blocks * tensor.layer_stride
        assert 0 <= tensor.offset and tensor.offset + tensor.layer_stride <= kv.bytes_per_block
        last_byte = tensor.offset + (kv.num_blocks - 1) * tensor.block_stride + tensor.layer_stride
        assert last_byte <= pool
        assert len({underlying_layer_name(n) for n in tensor.layers}) == 1
        for name in tensor.layers:
            assert name not in owner
            owner[name] = tensor
    device_names = {n for g in kv.kv_cache_groups if not g.host_resident for n in g.layer_names}
    assert set(owner) == device_names
    # a block belongs to one group at a time: inside it, no two layers of the group overlap
    for group in kv.kv_cache_groups:
        if group.host_resident:
            continue
        spans = sorted((owner[n].offset, owner[n].offset + owner[n].layer_stride)
                       for n in group.layer_names)
        assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))
        assert spans[-1][1] <= kv.bytes_per_block
    host = sorted((t.offset, t.offset + t.size) for t in kv.kv_cache_tensors if t.host_resident)
    assert len(host) == len(case.sparse_names)
    assert all(a[1] <= b[0] for a, b in zip(host, host[1:]))
    assert host[0][0] == 0
    assert host[-1][1] <= kv.hisparse_host_num_blocks * kv.hisparse_host_block_stride


@SETTINGS
@given(cases())
def test_host_pool_fits_the_budget(case):
    layout = create_hisparse_layout(case.config, _groups(case), case.host_budget)
    stride = layout.host_block_stride
    assert layout.host_num_blocks * stride <= case.host_budget < (layout.host_num_blocks + 1) * stride
    assert stride >= layout.source_group.page_size_bytes
    if layout.shared_host_pool:
        assert stride % 4096 == 0 and stride - layout.source_group.page_size_bytes < 4096
    else:
        assert stride == layout.source_group.page_size_bytes
    assert layout.host_num_blocks >= cdiv(case.config.max_model_len,
                                          layout.source_group.block_size) + 2


@SETTINGS
@given(cases(), st.lists(st.integers(2, 100_000), min_size=2, max_size=5))
def test_concurrency_is_monotone_in_the_gpu_budget(case, block_counts):
    groups = _groups(case)
    bytes_per_block = max(g.page_size_bytes for g in groups if not g.host_resident)
    values = []
    for blocks in sorted(block_counts):
        kv = get_hisparse_kv_cache_config(case.config, groups, blocks * bytes_per_block,
                                          case.host_budget)
        values.append(get_hisparse_steady_state_concurrency(case.config, kv))
    assert all(a <= b for a, b in zip(values, values[1:]))
    assert all(v > 0 for v in values)


@SETTINGS
@given(cases(), st.integers(2, 3000), st.data())
def test_row_aligned_block_stride_is_a_multiple_of_every_sparse_page(case, blocks, data):
    groups = _groups(case)
    plain = device_bytes_per_block(groups)
    aligned = device_bytes_per_block(groups, row_aligned_blocks=True)
    kv = get_hisparse_kv_cache_config(case.config, groups, blocks * aligned, case.host_budget,
                                      row_aligned_blocks=True)
    sparse_pages = {g.layer_page_size_bytes for g in kv.kv_cache_groups
                    if group_kind(g) in ("resident", "hot")}
    assert kv.bytes_per_block == aligned >= plain
    assert all(aligned % page == 0 for page in sparse_pages)
    assert aligned - plain < min(sparse_pages) or len(sparse_pages) > 1
    pool = kv.num_blocks * kv.bytes_per_block
    name = data.draw(st.sampled_from(case.sparse_names))
    view = device_row_layout(kv, name)
    tensor = next(t for t in kv.kv_cache_tensors if name + ".hisparse_resident" in t.layers)
    block_size = kv.kv_cache_groups[0].block_size
    assert view.row_bytes * block_size == tensor.layer_stride
    assert view.rows_per_block * view.row_bytes == kv.bytes_per_block
    assert view.offset_bytes + view.num_rows * view.row_bytes <= pool
    row_id = data.draw(st.integers(0, kv.num_blocks * block_size - 1))
    per_layer = (tensor.offset + (row_id // block_size) * tensor.block_stride
                 + (row_id % block_size) * view.row_bytes)
    assert view.offset_bytes + view.flat_row(row_id) * view.row_bytes == per_layer
    assert view.flat_row(row_id) < view.num_rows


@SETTINGS
@given(cases(), st.lists(st.integers(1, 6000), min_size=1, max_size=5),
       st.integers(2, 100_000))
def test_concurrency_is_monotone_in_max_num_batched_tokens(case, budgets, blocks):
    groups = _groups(case)
    bytes_per_block = device_bytes_per_block(groups)
    values = []
    admissions = []
    # None (a whole prompt in one step) admits the most: it goes last
    for budget in [*sorted(budgets), None]:
        config = dataclasses.replace(case.config, max_num_batched_tokens=budget)
        kv = get_hisparse_kv_cache_config(config, groups, blocks * bytes_per_block,
                                          case.host_budget)
        conc = get_hisparse_concurrency(config, kv)
        values.append(conc.steady_state)
        admissions.append(conc.admission_blocks)
        for group in kv.kv_cache_groups:
            if group_kind(group) == "resident":
                assert admission_blocks_per_request(config, group) == cdiv(
                    min(budget or config.max_model_len, config.max_model_len), group.block_size)
    assert all(a >= b for a, b in zip(values, values[1:]))
    assert all(a <= b for a, b in zip(admissions, admissions[1:]))


@SETTINGS
@given(cases())
def test_topology_is_consistent_with_the_groups(case):
    groups = _groups(case)
    kv = get_hisparse_kv_cache_config(case.config, groups,
                                      4 * device_bytes_per_block(groups), case.host_budget)
    topo = kv.hisparse_topology
    assert topo == build_hisparse_topology(kv.kv_cache_groups)
    assert [topo.kind_of(i).value for i in range(len(groups))] == [group_kind(g) for g in groups]
    assert sorted(topo.group_indices) == list(range(len(groups)))
    assert list(topo.sparse_layers) == case.sparse_names
    units = split_index_groups({n: case.spec[n] for n in case.sparse_names})
    assert [g.layers for g in topo.index_groups] == units
    for resident, hot in zip(topo.resident_groups, topo.hot_groups):
        names = [underlying_layer_name(n) for n in kv.kv_cache_groups[resident].layer_names]
        assert names == [underlying_layer_name(n) for n in kv.kv_cache_groups[hot].layer_names]
        held = [g for g in topo.index_groups if g.resident_group == resident]
        assert [layer for g in held for layer in g.layers] == names
        assert all(g.hot_group == hot for g in held)
    for layer in case.sparse_names:
        group = kv.kv_cache_groups[topo.resident_group_of(layer)]
        assert layer + ".hisparse_resident" in group.layer_names
        assert layer + ".hisparse_hot" in kv.kv_cache_groups[topo.hot_group_of(layer)].layer_names
