"""The hash resolve kernel (``kernels/resolve_hash.py``) vs ``reference.resolve``: bit-exact
outputs and state, its forced-collision and overflow (sorted fallback) paths, the clean-table
invariant and the shape dispatch.

Runs under ``TRITON_INTERPRET=1`` on CPU (conftest) and natively on CUDA.
"""

from __future__ import annotations

import random

import pytest
import torch

from hisparse_triton.kernels import resolve as kres
from hisparse_triton.ops import ResolveWorkspace
from hisparse_triton.ops.resolve.workspace import HASH_EMPTY, hash_table_words
from test_resolve_kernel import pair, run_both
from test_resolve_reference import (
    INT32_MAX,
    INT32_MIN,
    drift_topk,
    make_state,
    make_topk,
    run_reference,
)

HASH = dict(variant="hash")


@pytest.mark.parametrize("top_k, hot_mult", [(1, 1), (1, 5), (31, 1), (32, 2), (33, 5),
                                             (64, 1), (65, 2), (128, 3)])
def test_hash_matches_reference(top_k: int, hot_mult: int, kernel_device: torch.device
                                ) -> None:
    H = top_k * hot_mult
    state = make_state(num_states=3, pages=(3 * top_k) // 8 + 2, hot_slots=H, block_size=8,
                       seed=top_k + hot_mult, resident_frac=0.25, null_frac=0.1, prefill=True)
    state_rows = [2, -1, 0]
    topk = make_topk(state, state_rows, top_k, top_k, invalid_frac=0.1, dup_frac=0.2)
    k, r = pair(state, kernel_device)
    srows = torch.tensor(state_rows, dtype=torch.int32)
    for step in range(3):
        run_both(topk, srows, k, r, what=f"hash k={top_k} H={H} step {step}", **HASH)
        topk = drift_topk(topk, state, state_rows, 50 + step, keep=0.5)


def test_hash_is_the_default_where_it_applies() -> None:
    assert kres._launch(2048, 4096, 64, 1_000_000, True).variant == "hash"
    assert kres._launch(4096, 4096, 64, 1_000_000, True).variant == "sorted"    # wide
    assert kres._launch(2048, 8192, 64, 1_000_000, True).variant == "sorted"    # many slots
    assert kres._launch(2048, 4096, 64, 2**26, True).variant == "sorted"        # int64 rows
    assert kres._launch(32, 48, 4, 100, False, block_h=16).variant == "sorted"  # knob
    assert kres._launch(32, 48, 4, 100, False, variant="sorted").variant == "sorted"
    with pytest.raises(ValueError, match="variant 'hash'"):
        kres._launch(4096, 4096, 64, 100, True, variant="hash")
    with pytest.raises(ValueError, match="variant must be"):
        kres._launch(32, 48, 4, 100, True, variant="bitonic")
    with pytest.raises(ValueError, match="probes"):
        kres._launch(32, 48, 4, 100, True, probes=0)
    assert set(kres.resolve_variants(2048, 4096, 64, 1_000_000)) == {"default", "hash",
                                                                      "sorted"}
    assert set(kres.resolve_variants(8192, 8192, 64, 1_000_000)) == {"default", "sorted"}


def test_drifting_trace_with_repeated_state_rows(kernel_device: torch.device) -> None:
    """Repeated state rows (later ones are padding), a padding row, full state each step."""
    state = make_state(num_states=4, pages=8, hot_slots=29, block_size=4, seed=9,
                       resident_frac=0.2, null_frac=0.05, shuffle_lru=True)
    k, r = pair(state, kernel_device)
    state_rows = [1, 2, 1, -1, 3, 2]
    srows = torch.tensor(state_rows, dtype=torch.int32)
    topk = make_topk(state, state_rows, 12, 0, invalid_frac=0.05, dup_frac=0.1)
    total = torch.zeros(3, dtype=torch.int64)
    for step in range(12):
        out = run_both(topk, srows, k, r, what=f"step {step}", **HASH)
        assert out.rows[2].eq(-1).all() and out.stats[5].eq(0).all()
        total += out.stats.cpu().sum(0)
        topk = drift_topk(topk, state, state_rows, 300 + step, keep=0.6)
    assert total[0] > 0 and total[1] > 0


@pytest.mark.parametrize("seed", range(4))
def test_corrupted_states_match_reference(seed: int, kernel_device: torch.device) -> None:
    """Out-of-range / duplicated held rows and lru entries, bad hot and resident blocks: the
    documented rules, through the hash kernel."""
    rnd = random.Random(2000 + seed)
    K, B = rnd.choice([4, 9, 16]), rnd.choice([2, 4])
    H = K * 2
    state = make_state(num_states=3, pages=6, hot_slots=H, block_size=B, seed=seed,
                       resident_frac=0.2, prefill=True)
    state_rows = [0, 1, 2]
    topk = make_topk(state, state_rows, K, seed)
    srows = torch.tensor(state_rows, dtype=torch.int32)
    shr = state.slot_host_rows
    nh = state.num_host_blocks * B
    for _ in range(6):
        s, h = rnd.randrange(3), rnd.randrange(H)
        shr[s, h] = rnd.choice([nh, nh + 5, INT32_MAX, INT32_MIN, -7,
                                int(shr[s, rnd.randrange(H)])])
    for _ in range(4):
        s, p = rnd.randrange(3), rnd.randrange(H)
        state.lru[s, p] = rnd.choice([H, -1, INT32_MAX, INT32_MIN,
                                      int(state.lru[s, rnd.randrange(H)])])
    hb = state.hot_blocks
    hb[rnd.randrange(3), rnd.randrange(hb.shape[1])] = rnd.choice(
        [0, -3, state.num_device_blocks])
    state.resident_blocks[rnd.randrange(3), rnd.randrange(6)] = state.num_device_blocks + 9
    k, r = pair(state, kernel_device)
    for step in range(3):
        run_both(topk, srows, k, r, what=f"corrupt {seed} step {step}", **HASH)
        topk = drift_topk(topk, state, state_rows, seed + step, keep=0.5)


def test_one_slot_named_everywhere_runs_out_of_evictable_slots(kernel_device: torch.device
                                                               ) -> None:
    state = make_state(num_states=1, pages=8, hot_slots=6, block_size=2, seed=3,
                       resident_frac=0.0, null_frac=0.0)
    state.lru[0] = torch.tensor([4, 4, 4, 99, 4, -2], dtype=torch.int32)
    k, r = pair(state, kernel_device)
    topk = torch.tensor([[0, 2, 4, 6]], dtype=torch.int32)
    out = run_both(topk, torch.tensor([0], dtype=torch.int32), k, r, what="lru dup", **HASH)
    assert out.miss_count.tolist() == [1] and out.stats.tolist() == [[0, 1, 3]]


def _table_clean(ws: ResolveWorkspace) -> bool:
    return bool(ws._table.eq(HASH_EMPTY).all())


@pytest.mark.parametrize("case", ["collisions", "overflow", "overflow_full_bucket"])
def test_forced_collisions_and_overflow_stay_exact(case: str, kernel_device: torch.device
                                                   ) -> None:
    """``hash_mul=0`` sends every host row to bucket 0: with few distinct rows they share it;
    with more distinct rows than the bucket's ``probes`` slots the row overflows, is flagged
    and resolved by the fallback launch (the sorted kernel, ``FLAGGED``). Exact either way,
    counters included, and the table is left clean."""
    knobs = {"collisions": dict(hash_mul=0),                 # <= 6 distinct rows per row
             "overflow": dict(hash_mul=0, probes=2),
             "overflow_full_bucket": dict(hash_mul=0)}[case]
    K = 24
    state = make_state(num_states=3, pages=12, hot_slots=40, block_size=4, seed=17,
                       resident_frac=0.1, null_frac=0.05, prefill=True)
    state_rows = [0, 2, 1]
    g = torch.Generator().manual_seed(5)
    if case == "collisions":  # 6 distinct positions per row, repeated
        base = torch.stack([torch.randperm(int(state.seq_lens[s]), generator=g)[:6]
                            for s in state_rows])
        topk = base.repeat(1, 4).to(torch.int32)
    else:  # distinct positions: > probes distinct host rows
        topk = torch.stack([torch.randperm(int(state.seq_lens[s]), generator=g)[:K]
                            for s in state_rows]).to(torch.int32)
    k, r = pair(state, kernel_device)
    srows = torch.tensor(state_rows, dtype=torch.int32)
    ws = ResolveWorkspace(kernel_device)
    counters = torch.zeros(3, dtype=torch.int64, device=kernel_device)
    total = torch.zeros(3, dtype=torch.int64)
    for step in range(3):
        got = kres._resolve(topk.to(kernel_device), srows.to(kernel_device), *k.args(),
                            **k.kwargs(), workspace=ws, counters=counters, variant="hash",
                            **knobs)
        want = run_reference(topk, srows, r)
        for name, a, b in zip(got._fields, got, want):
            assert torch.equal(a.cpu(), b), f"{case} step {step}: {name}"
        assert torch.equal(k.lru.cpu(), r.lru) and torch.equal(k.slot_host_rows.cpu(),
                                                               r.slot_host_rows)
        assert _table_clean(ws), f"{case} step {step}: table left dirty"
        if case != "collisions":  # > 8 distinct host rows in one bucket: every row flagged
            assert ws.last.fallback.tolist() == [1, 1, 1], f"{case} step {step}"
        total += want.stats.sum(0).to(torch.int64)
        topk = drift_topk(topk, state, state_rows, 70 + step, keep=0.5)
    assert torch.equal(counters.cpu(), total)


def test_table_stays_clean_across_call_shapes(kernel_device: torch.device) -> None:
    """One workspace, calls of three shapes (other layouts of the same table buffer): every
    word is clean after each call, and the results stay exact."""
    ws = ResolveWorkspace(kernel_device)
    for K, H, R in ((16, 32, 3), (40, 64, 2), (8, 8, 4)):
        state = make_state(num_states=R, pages=K // 2 + 4, hot_slots=H, block_size=4,
                           seed=K + H, resident_frac=0.2, null_frac=0.1, prefill=True)
        state_rows = list(range(R))
        topk = make_topk(state, state_rows, K, K, dup_frac=0.2)
        k, r = pair(state, kernel_device)
        srows = torch.tensor(state_rows, dtype=torch.int32)
        got = kres._resolve(topk.to(kernel_device), srows.to(kernel_device), *k.args(),
                            **k.kwargs(), workspace=ws, **HASH)
        want = run_reference(topk, srows, r)
        for name, a, b in zip(got._fields, got, want):
            assert torch.equal(a.cpu(), b), f"K={K} H={H}: {name}"
        assert ws.buffers(R, K, H).table.shape == (R, hash_table_words(K, H))
        assert _table_clean(ws)
        assert ws.last.fallback.tolist() == [0] * R  # the hash path resolved every row


def test_all_masked_and_all_resident_rows(kernel_device: torch.device) -> None:
    state = make_state(num_states=2, pages=6, hot_slots=16, block_size=4, seed=4,
                       resident_frac=1.0, null_frac=0.0, prefill=True)
    k, r = pair(state, kernel_device)
    topk = torch.tensor([[-1, 10**6, -5, INT32_MAX] * 2, [0, 1, 2, 3, 4, 5, 6, 7]],
                        dtype=torch.int32)
    out = run_both(topk, torch.tensor([0, 1], dtype=torch.int32), k, r, what="masked", **HASH)
    assert out.stats[0].tolist() == [0, 0, 8] and out.stats[1].tolist() == [8, 0, 0]
    assert torch.equal(k.lru.cpu(), state.lru)  # untouched: nothing hit, nothing filled


def test_time_resolve_variants_checks_and_times_every_variant(kernel_device: torch.device
                                                              ) -> None:
    """What ``bench/gpu_check.py`` calls on a GPU: every variant of the shape is checked
    against the reference (state restored before each), then handed to the timer."""
    from hisparse_triton import benchmarks as bm
    from hisparse_triton.ops.resolve.variants import time_resolve_variants

    work = bm.ResolveWorkload(2, 16, 32, 256, 0.25, kernel_device)
    timed = []

    def timer(call):
        work.restore()
        call()
        timed.append(call)
        return float(len(timed))

    times = time_resolve_variants(work, timer)
    assert list(times) == ["default", "hash", "sorted"] and len(timed) == 3
