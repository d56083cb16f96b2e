"""Hot-buffer policies: the LRU model equals the runtime's misses, Belady is the optimum."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hisparse_triton import policies
from hisparse_triton.presets import build_kv_cache_spec
from hisparse_triton.runtime import HiSparseRuntime
from hisparse_triton.workload import plan_for_workload


def test_step_keys_first_occurrence_order():
    assert policies.step_keys(np.array([5, 3, 5, 9, 3, 1])).tolist() == [5, 3, 9, 1]
    assert policies.step_keys(np.array([], dtype=np.int32)).size == 0


def test_lru_rule_by_hand():
    """The runtime's order: unused evictables, then misses (miss order), then hits (old
    order); empty slots are the oldest."""
    stream = [np.array([1, 2]), np.array([3, 1]), np.array([4, 5])]
    # capacity 3: [1 2] -> order e,1,2 ; [3 1]: 3 fills the empty slot, order 2,3,1
    # [4 5]: evict 2 then 3 -> 2 misses
    assert policies.stream_misses("lru", stream, 3).tolist() == [2, 1, 2]
    # FIFO keeps fill order on a hit: [4 5] evicts 1 (filled first) and 2
    assert policies.stream_misses("fifo", stream, 3).tolist() == [2, 1, 2]
    stream = [np.array([1, 2, 3]), np.array([1]), np.array([4]), np.array([2])]
    # LRU after step 1: 1,2,3 ; step 2 hit 1 -> 2,3,1 ; step 3 evicts 2 -> miss at step 4
    assert policies.stream_misses("lru", stream, 3).tolist() == [3, 0, 1, 1]
    # FIFO evicts 1 (oldest fill) at step 3 -> 2 still held at step 4
    assert policies.stream_misses("fifo", stream, 3).tolist() == [3, 0, 1, 0]
    # Belady evicts the one never used again (1 or 3), keeps 2
    assert policies.stream_misses("belady", stream, 3).tolist() == [3, 0, 1, 0]


def test_bad_input():
    with pytest.raises(ValueError, match="capacity"):
        policies.lru_misses([np.array([1])], 0)
    with pytest.raises(ValueError, match="a step must fit the buffer"):
        policies.lru_misses([np.array([1, 2, 3])], 2)
    with pytest.raises(ValueError, match="unknown policy"):
        policies.policy_misses("mru", [], 4)
    with pytest.raises(ValueError, match=">= 0"):
        policies.fifo_misses([np.array([-1])], 4)


def _runtime_vs_model(seed: int, *, threshold: int, duplicates: bool) -> tuple[int, int]:
    """Drive a tiny runtime (torch backend) with random top-k rows, some columns invalid or
    repeated; feed the columns that reach the hot buffer (valid, page not resident, read
    with ``block_table``) to the LRU model. Returns (runtime misses, model misses)."""
    rng = np.random.default_rng(seed)
    spec = build_kv_cache_spec("tiny", num_layers=4)
    topk, prompt, out = 8, 96, 12
    plan = plan_for_workload(spec, max_model_len=prompt + out, num_requests=3, topk=topk,
                             device_buffer_size=16, prompt_len=prompt)
    B = plan.block_size
    streams: dict = {}
    with HiSparseRuntime(plan.kv_cache_config, plan.config, max_num_seqs=3, device="cpu",
                         backend="torch", offload_threshold_pages=threshold) as rt:
        for rid in range(3):
            rt.add_request(rid, prompt - 8 * rid, out)
            rt.append_slots(rid, prompt - 8 * rid)
            rt.commit()
        for _ in range(out):
            for rid in range(3):
                rt.append_slots(rid, 1)
            for leader in rt.leaders:
                rows = []
                for rid in range(3):
                    seq = rt.seq_len(rid)
                    near = rng.integers(max(0, seq - 40), seq, topk)  # locality: reuse
                    row = np.where(rng.random(topk) < 0.1, rng.integers(-3, seq + 5, topk), near)
                    if not duplicates:
                        row = rng.permutation(seq)[:topk]
                    rows.append(row.astype(np.int32))
                    valid = row[(row >= 0) & (row < seq)].astype(np.int64)
                    resident = np.asarray(rt.block_table(rid, leader), dtype=np.int64)
                    streams.setdefault((rid, leader), []).append(
                        valid[resident[valid // B] == 0])
                rt.resolve(leader, [0, 1, 2], torch.from_numpy(np.stack(rows)))
            rt.commit()
        misses = rt.stats().misses
    return misses, policies.policy_misses("lru", streams.values(), 16)


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("threshold, duplicates", [(1, True), (4, True), (1, False)])
def test_lru_model_equals_the_runtime(seed, threshold, duplicates):
    runtime_misses, model_misses = _runtime_vs_model(seed, threshold=threshold,
                                                     duplicates=duplicates)
    assert runtime_misses > 0
    assert model_misses == runtime_misses


def _random_stream(draw, capacity):
    steps = draw(st.integers(1, 12))
    universe = draw(st.integers(1, 3 * capacity))
    out = []
    for _ in range(steps):
        n = draw(st.integers(0, capacity))
        out.append(np.array(draw(st.lists(st.integers(0, universe - 1), min_size=n,
                                          max_size=n)), dtype=np.int64))
    return out


@st.composite
def streams_and_capacity(draw):
    capacity = draw(st.integers(1, 6))
    stream = [s for s in _random_stream(draw, capacity)
              if policies.step_keys(s).size <= capacity]
    return stream, capacity


@settings(max_examples=150, deadline=None)
@given(streams_and_capacity())
def test_belady_is_never_worse(case):
    stream, capacity = case
    belady = policies.belady_misses(stream, capacity)
    assert belady <= policies.lru_misses(stream, capacity)
    assert belady <= policies.fifo_misses(stream, capacity)
    # every policy misses at least each distinct position once
    distinct = np.unique(np.concatenate(stream)).size if stream else 0
    assert belady >= distinct


def _optimum(stream, capacity):
    """Exhaustive search over every eviction choice (tiny cases only)."""
    steps = [set(policies.step_keys(s).tolist()) for s in stream]
    best = [None]

    def go(i, held, misses):
        if best[0] is not None and misses >= best[0]:
            return
        if i == len(steps):
            best[0] = misses
            return
        need = steps[i] - held
        free = capacity - len(held)
        evict = max(0, len(need) - free)
        for victims in itertools.combinations(sorted(held - steps[i]), evict):
            go(i + 1, (held - set(victims)) | need, misses + len(need))

    go(0, frozenset(), 0)
    return best[0]


@settings(max_examples=60, deadline=None)
@given(streams_and_capacity())
def test_belady_is_the_optimum(case):
    stream, capacity = case
    stream = stream[:7]
    assert policies.belady_misses(stream, capacity) == _optimum(stream, capacity)


def test_compare_policies():
    rng = np.random.default_rng(0)
    streams = {i: [rng.integers(0, 40, 8) for _ in range(30)] for i in range(3)}
    out = policies.compare_policies(streams, 16)
    assert list(out) == list(policies.POLICIES)
    lookups = sum(policies.step_keys(s).size for st_ in streams.values() for s in st_)
    for v in out.values():
        assert v["miss_rate"] == pytest.approx(v["misses"] / lookups)
    assert out["belady"]["misses"] <= out["lru"]["misses"]
