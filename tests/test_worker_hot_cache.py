"""``HotCache`` / ``HotState`` and the worker's door to the ops (``hot_cache.py``).

A ``HotCache`` resolve is checked bit-exactly against ``reference.resolve`` run on copies of
the same tables and hot state (rows, new hot state, counters, and the gathered bytes), on
the torch and the Triton backends (the interpreter on CPU).
"""

from __future__ import annotations

import pytest
import torch

from hisparse_triton.ops.resolve import reference
from hisparse_triton.worker import hot_cache
from hisparse_triton.worker.hot_cache import HotState, check_topk
from worker_helpers import BUFFER, L0, TOPK, make_pair, prefill

GEN = torch.Generator().manual_seed(3)


def _offloaded(backend: str):
    """A pair with two offloaded requests ``a`` (30 tokens) and ``b`` (21 tokens)."""
    scheduler, worker = make_pair(backend=backend)
    for rid, n in (("a", 30), ("b", 21)):
        prefill(scheduler, worker, rid, n, GEN)
    return scheduler, worker


def _expected(cache, state_rows, topk):
    """``reference.resolve`` on copies of the cache's tables and hot state."""
    slots, lru = cache.slot_host_rows.clone(), cache.lru.clone()
    result = reference.resolve(topk, state_rows, cache.seq_lens.clone(),
                               cache.resident_table.clone(), cache.host_blocks.clone(),
                               cache.hot_table.clone(), slots, lru, **cache.sizes)
    return result, slots, lru


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_a_resolve_is_the_reference_and_gathers_the_misses(backend):
    scheduler, worker = _offloaded(backend)
    with worker:
        cache = worker._index_group(L0)
        state_rows = torch.from_numpy(scheduler.state_rows(["b", None, "a"]))
        for call in range(3):   # a cold buffer, then partly warm ones
            topk = torch.randint(-2, 34, (3, TOPK), dtype=torch.int32, generator=GEN)
            expected, slots, lru = _expected(cache, state_rows, topk)
            counters = cache.counters.clone() + expected.stats.sum(0)
            rows = cache.resolve(state_rows, topk)
            assert torch.equal(rows, expected.rows), call
            assert torch.equal(cache.slot_host_rows, slots) and torch.equal(cache.lru, lru)
            assert torch.equal(cache.counters, counters)
            for layer in cache.layers:              # every layer's miss rows were gathered
                dev = worker.device_cache(layer).reshape(-1, cache.row_bytes)
                host = worker.host_cache(layer).reshape(-1, cache.row_bytes)
                for r, n in enumerate(expected.miss_count.tolist()):
                    src = expected.miss_src[r, :n].long()
                    dst = expected.miss_dst[r, :n].long()
                    assert torch.equal(dev[dst], host[src]), (layer, r)
        assert cache.counters[1] > 0          # misses were gathered


def test_a_draft_token_resolve_returns_its_own_shape_and_empty_batches_work():
    scheduler, worker = _offloaded("torch")
    with worker:
        cache = worker._index_group(L0)
        state_rows = torch.from_numpy(scheduler.state_rows(["a"]))
        topk = torch.randint(0, 30, (1, 2, TOPK // 2), dtype=torch.int64, generator=GEN)
        expected, _, _ = _expected(cache, state_rows, topk.reshape(1, TOPK))
        rows = cache.resolve(state_rows, topk)
        assert rows.shape == (1, 2, TOPK // 2)
        assert torch.equal(rows.reshape(1, TOPK), expected.rows)
        empty = cache.resolve(torch.zeros(0, dtype=torch.int32),
                              torch.zeros(0, TOPK, dtype=torch.int32))
        assert empty.shape == (0, TOPK)


def test_bad_state_rows_are_refused_before_any_state_changes():
    scheduler, worker = _offloaded("torch")
    with worker:
        cache = worker._index_group(L0)
        before = (cache.slot_host_rows.clone(), cache.lru.clone(), cache.counters.clone())
        topk = torch.zeros(2, TOPK, dtype=torch.int32)
        for bad in (torch.zeros(2, dtype=torch.int64), torch.zeros(3, dtype=torch.int32),
                    [0, 1]):
            with pytest.raises(ValueError, match=r"state_rows must be an int32 tensor \[2\]"):
                cache.resolve(bad, topk)
        with pytest.raises(ValueError, match="state_rows is on meta"):
            cache.resolve(torch.zeros(2, dtype=torch.int32, device="meta"), topk)
        after = (cache.slot_host_rows, cache.lru, cache.counters)
        assert all(torch.equal(x, y) for x, y in zip(before, after))


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_a_failed_gather_restores_the_hot_state_and_the_counters(monkeypatch, backend):
    scheduler, worker = _offloaded(backend)
    with worker:
        cache = worker._index_group(L0)
        state_rows = torch.from_numpy(scheduler.state_rows(["a", "b"]))
        topk = torch.arange(TOPK, dtype=torch.int32).repeat(2, 1)
        cache.resolve(state_rows, topk)                 # a warm buffer
        before = (cache.slot_host_rows.clone(), cache.lru.clone(), cache.counters.clone())

        def failing(*args, **kwargs):
            raise RuntimeError("injected gather failure")

        monkeypatch.setattr(hot_cache.load_ops(), "copy_rows", failing)
        monkeypatch.setattr(cache, "bound_gather", None if backend == "torch" else failing)
        with pytest.raises(RuntimeError, match="injected gather failure"):
            cache.resolve(state_rows, topk + 12)       # misses, then the gather fails
        after = (cache.slot_host_rows, cache.lru, cache.counters)
        assert all(torch.equal(x, y) for x, y in zip(before, after))


def test_the_hot_state_resets_saves_and_restores_rows_of_every_group():
    state = HotState(num_groups=2, max_num_seqs=3, slots=4, device=torch.device("cpu"))
    assert state.slot_host_rows.shape == state.lru.shape == (2, 3, 4)
    assert state.lru[1, 2].tolist() == [0, 1, 2, 3] and state.counters.shape == (2, 3)
    state.slot_host_rows.fill_(5)
    state.lru.copy_(torch.tensor([3, 2, 1, 0], dtype=torch.int32))
    rows = torch.tensor([0, 2])
    saved = state.save_rows(rows)
    state.reset_rows(rows)
    assert state.slot_host_rows[:, 0].eq(-1).all() and state.slot_host_rows[:, 1].eq(5).all()
    assert state.lru[1, 2].tolist() == [0, 1, 2, 3] and state.lru[1, 1].tolist() == [3, 2, 1, 0]
    state.restore_rows(rows, saved)
    assert state.slot_host_rows.eq(5).all() and state.lru[0, 0].tolist() == [3, 2, 1, 0]
    assert HotState.nbytes(2, 3, 4) == 2 * 4 * 2 * 3 * 4 + 4 * 4 + 8 * 3 * 2
    assert set(state.snapshot()) == {"slot_host_rows", "lru", "counters"}


@pytest.mark.parametrize("topk, match", [
    ([[1, 2]], "topk must be a"),
    (torch.zeros(2, dtype=torch.int32), "topk must be a"),
    (torch.zeros(1, 4), "integer positions"),
    (torch.zeros(1, 4, dtype=torch.bool), "integer positions"),
    (torch.zeros(1, 3, 2, dtype=torch.int32), "q=3 query tokens per request"),
    (torch.zeros(1, BUFFER + 1, dtype=torch.int32), r"top-k width 17 \(q x k\)"),
    (torch.zeros(1, 0, dtype=torch.int32), r"top-k width 0 \(q x k\)"),
    (torch.zeros(1, 2, 9, dtype=torch.int32), r"top-k width 18 \(q x k\)"),
])
def test_check_topk_names_what_is_wrong(topk, match):
    with pytest.raises(ValueError, match=match):
        check_topk(topk, device_buffer_size=BUFFER, max_decode_query_len=2)
    check_topk(torch.zeros(3, 2, 8, dtype=torch.int16), device_buffer_size=BUFFER,
               max_decode_query_len=2)


def test_the_kernel_backend_is_refused_where_it_cannot_run(monkeypatch):
    cpu = torch.device("cpu")
    assert hot_cache.kernel_backend("torch", cpu) == "torch"
    assert hot_cache.kernel_backend("auto", cpu) == "torch"
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        hot_cache.kernel_backend("triton", cpu)
    assert hot_cache.launch_config_source("torch", cpu).endswith("not used (reference ops)")
    assert hot_cache.launch_config_source("triton", cpu).endswith("built-in defaults")


# ------------------------------------------------------------------ a call of another shape
@pytest.mark.parametrize("bad", ["float topk", "int64 state rows", "wider topk",
                                 "strided topk"])
def test_a_call_of_another_shape_is_checked_again(bad):
    scheduler, worker = _offloaded("triton")
    with worker:
        state_rows = torch.from_numpy(scheduler.state_rows(["a", "b"]))
        topk = torch.zeros(2, TOPK, dtype=torch.int32)
        worker.resolve_rows(L0, state_rows, topk)
        before = (worker._slot_host_rows.clone(), worker._lru.clone())
        if bad == "float topk":
            args, match = (state_rows, topk.float()), "integer"
        elif bad == "int64 state rows":
            args, match = (state_rows.long(), topk), "state_rows"
        elif bad == "wider topk":
            args, match = (state_rows, torch.zeros(2, BUFFER + 1, dtype=torch.int32)), "top"
        else:   # a new stride is a new bound call: checked, and exact
            wide = torch.zeros(2, 2 * TOPK, dtype=torch.int32)
            rows = worker.resolve_rows(L0, state_rows, wide[:, ::2])
            assert rows.shape == (2, TOPK)
            return
        with pytest.raises(ValueError, match=match):
            worker.resolve_rows(L0, *args)
        assert torch.equal(worker._slot_host_rows, before[0])
        assert torch.equal(worker._lru, before[1])


def test_a_failed_gather_restores_the_state(monkeypatch):
    scheduler, worker = _offloaded("triton")
    with worker:
        cache = worker._index_group(L0)
        state_rows = torch.from_numpy(scheduler.state_rows(["a", "b"]))
        topk = torch.arange(TOPK, dtype=torch.int32).repeat(2, 1)
        worker.resolve_rows(L0, state_rows, topk)        # warm, and the shape is bound
        before = (cache.slot_host_rows.clone(), cache.lru.clone(), cache.counters.clone())

        def failing(*args, **kwargs):
            raise RuntimeError("injected gather failure")

        monkeypatch.setattr(cache, "bound_gather", failing)
        with pytest.raises(RuntimeError, match="injected gather failure"):
            worker.resolve_rows(L0, state_rows, topk + 12)
        after = (cache.slot_host_rows, cache.lru, cache.counters)
        assert all(torch.equal(x, y) for x, y in zip(before, after))


def test_a_new_gather_budget_rebinds_the_gathers_and_stays_exact():
    scheduler, worker = _offloaded("triton")
    with worker:
        cache = worker._index_group(L0)
        state_rows = torch.from_numpy(scheduler.state_rows(["a", "b"]))
        old = cache.bound_gather
        with pytest.raises(ValueError, match="gather_programs_per_sm"):
            worker.set_gather_programs_per_sm(-1)
        assert cache.bound_gather is old                   # a refusal changes nothing
        worker.set_gather_programs_per_sm(1)
        assert cache.bound_gather is not old and cache.bound_gather.programs_per_sm == 1
        assert worker.gather_programs_per_sm == 1
        topk = torch.randint(-2, 34, (2, TOPK), dtype=torch.int32, generator=GEN)
        expected, _, _ = _expected(cache, state_rows, topk)
        assert torch.equal(worker.resolve_rows(L0, state_rows, topk), expected.rows)
        for layer in cache.layers:                         # the misses were gathered
            dev = worker.device_cache(layer).reshape(-1, cache.row_bytes)
            host = worker.host_cache(layer).reshape(-1, cache.row_bytes)
            for r, n in enumerate(expected.miss_count.tolist()):
                src, dst = expected.miss_src[r, :n].long(), expected.miss_dst[r, :n].long()
                assert torch.equal(dev[dst], host[src]), (layer, r)
