"""Triton ``resolve`` vs ``reference.resolve``: bit-exact outputs and state after every step.

Runs under ``TRITON_INTERPRET=1`` on CPU (conftest) and natively on CUDA. The interpreter is
slow (``tl.sort`` dominates), so shapes are small and the top-k x hot-size matrix is not a
full cross product for the larger top-k.
"""

from __future__ import annotations

import random

import pytest
import torch

from hisparse_triton.kernels import resolve as kres
from test_resolve_reference import (
    INT32_MAX,
    INT32_MIN,
    ResolveState,
    assert_result_equal,
    drift_topk,
    make_state,
    make_topk,
    run_reference,
)

HAS_CUDA = torch.cuda.is_available()
NEEDS_CUDA = pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")


def run_both(topk: torch.Tensor, state_rows: torch.Tensor, kstate: ResolveState,
             rstate: ResolveState, *, what: str = "", **knobs):
    """Kernel on ``kstate`` (its device, launch ``knobs``: ``block_h``, ``sort_width``,
    ``num_warps``), reference on ``rstate`` (CPU); compare everything."""
    dev = kstate.lru.device
    got = kres._resolve(topk.to(dev), state_rows.to(dev), *kstate.args(), **kstate.kwargs(),
                        **knobs)
    want = run_reference(topk.cpu(), state_rows.cpu(), rstate)
    assert_result_equal(got, want, what)
    assert torch.equal(kstate.slot_host_rows.cpu(), rstate.slot_host_rows), f"{what} slot rows"
    assert torch.equal(kstate.lru.cpu(), rstate.lru), f"{what} lru"
    return got


def pair(state: ResolveState, device: torch.device) -> tuple[ResolveState, ResolveState]:
    return state.clone().to(device), state.clone()


# top_k x hot-size multiple: the full cross product for small top-k, a spread for large.
MATRIX = ([(k, m) for k in (1, 31, 32, 33) for m in (1, 2, 5)]
          + [(64, 1), (64, 5), (65, 2), (128, 1), (128, 5)])


@pytest.mark.parametrize("top_k, hot_mult", MATRIX)
def test_matches_reference_over_topk_and_hot_sizes(top_k: int, hot_mult: int,
                                                   kernel_device: torch.device) -> None:
    H = top_k * hot_mult
    B = 8
    seed = top_k * 10 + hot_mult
    state = make_state(num_states=3, pages=(3 * top_k) // B + 2, hot_slots=H, block_size=B,
                       seed=seed, resident_frac=0.25, null_frac=0.1, prefill=True)
    # Half the cases split the LRU into ~4 chunks per row to exercise the cross-chunk ranks.
    block_h = max(16, 1 << max(0, (H - 1).bit_length() - 2)) if seed % 2 else None
    state_rows = [2, -1, 0] if hot_mult == 2 else [2, 0]  # a padding row in some cases
    topk = make_topk(state, state_rows, top_k, seed)
    k, r = pair(state, kernel_device)
    run_both(topk, torch.tensor(state_rows, dtype=torch.int32), k, r, block_h=block_h,
             what=f"k={top_k} H={H}")


# A 20-step trace with two LRU chunks per row, and a shorter one where H == K (every step
# recycles the whole buffer).
@pytest.mark.parametrize("top_k, hot, block_h, steps", [(12, 29, 16, 20), (8, 8, None, 8)])
def test_drifting_trace_full_state_each_step(top_k: int, hot: int, block_h: int | None,
                                             steps: int, kernel_device: torch.device) -> None:
    """LRU order only shows through later evictions: compare the whole state every step."""
    state = make_state(num_states=3, pages=6, hot_slots=hot, block_size=4, seed=hot,
                       resident_frac=0.2, null_frac=0.05, shuffle_lru=True)
    k, r = pair(state, kernel_device)
    state_rows = [1, 2]
    srows = torch.tensor(state_rows, dtype=torch.int32)
    topk = make_topk(state, state_rows, top_k, 0, invalid_frac=0.05, dup_frac=0.05)
    total = torch.zeros(3, dtype=torch.int64)
    for step in range(steps):
        out = run_both(topk, srows, k, r, block_h=block_h, what=f"step {step}")
        total += out.stats.cpu().sum(0)
        topk = drift_topk(topk, state, state_rows, 1000 + step, keep=0.6)
    assert total[0] > 0 and total[1] > 0  # the trace did exercise hits and misses


@pytest.mark.parametrize("mix", ["all_miss", "all_resident", "null_pages", "mixed"])
def test_residency_mixes(mix: str, kernel_device: torch.device) -> None:
    kw = {"all_miss": dict(resident_frac=0.0, null_frac=0.0, prefill=False),
          "all_resident": dict(resident_frac=1.0, null_frac=0.0, prefill=True),
          "null_pages": dict(resident_frac=0.0, null_frac=0.5, prefill=True),
          "mixed": dict(resident_frac=0.4, null_frac=0.1, prefill=True)}[mix]
    state = make_state(num_states=2, pages=8, hot_slots=40, block_size=4, seed=7, **kw)
    k, r = pair(state, kernel_device)
    state_rows = [0, 1]
    srows = torch.tensor(state_rows, dtype=torch.int32)
    g = torch.Generator().manual_seed(7)  # distinct valid positions per row
    topk = torch.stack([torch.randperm(int(state.seq_lens[s]), generator=g)[:16]
                        for s in state_rows]).to(torch.int32)
    out = run_both(topk, srows, k, r, block_h=16, what=mix)
    if mix == "all_miss":
        assert out.stats[:, 0].eq(0).all() and out.stats[:, 2].eq(0).all()
        assert out.miss_count.eq(16).all()
    if mix == "all_resident":
        assert out.miss_count.eq(0).all() and out.stats[:, 0].eq(16).all()
        assert torch.equal(k.lru.cpu(), state.lru)  # untouched
    topk = drift_topk(topk, state, state_rows, 8)
    run_both(topk, srows, k, r, block_h=16, what=f"{mix} step 2")


def test_duplicates_and_out_of_range_positions(kernel_device: torch.device) -> None:
    state = make_state(num_states=2, pages=5, hot_slots=20, block_size=4, seed=3, prefill=True)
    k, r = pair(state, kernel_device)
    topk = make_topk(state, [1, 0], 20, 3, invalid_frac=0.3, dup_frac=0.4)
    topk[0, :6] = torch.tensor([INT32_MAX, INT32_MIN, -1, 2**30, int(state.seq_lens[1]), 0])
    topk[1, 5:] = topk[1, 4]  # one position repeated 15 times
    srows = torch.tensor([1, 0], dtype=torch.int32)
    run_both(topk, srows, k, r, what="dups/oob")
    run_both(topk.flip(1), srows, k, r, what="dups/oob reversed")


def test_warm_replay_is_all_hits_with_empty_plan(kernel_device: torch.device) -> None:
    state = make_state(num_states=2, pages=10, hot_slots=64, block_size=4, seed=11,
                       resident_frac=0.2, null_frac=0.0)
    k, r = pair(state, kernel_device)
    srows = torch.tensor([1, 0], dtype=torch.int32)
    topk = make_topk(state, [1, 0], 32, 11, invalid_frac=0.0, dup_frac=0.1)
    first = run_both(topk, srows, k, r, what="cold")
    assert first.miss_count.gt(0).all()
    second = run_both(topk, srows, k, r, what="warm")
    assert second.miss_count.eq(0).all()
    assert second.miss_src.eq(-1).all() and second.miss_dst.eq(-1).all()
    assert torch.equal(second.rows, first.rows)
    assert second.stats[:, 1].eq(0).all()


def _canaried(t: torch.Tensor, fill: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``t`` copied into the interior (every other column) of a canary-filled buffer."""
    S, H = t.shape
    big = torch.full((S + 2, 2 * H + 6), fill, dtype=t.dtype, device=t.device)
    view = big[1:-1, 3:3 + 2 * H:2]
    view.copy_(t)
    return big, view


@pytest.mark.parametrize("seed", range(3))
def test_corrupted_state_matches_reference_and_writes_nothing_outside(
        seed: int, kernel_device: torch.device) -> None:
    rnd = random.Random(seed)
    K, B, H, S = 12, 4, 28, 3
    state = make_state(num_states=S, pages=8, hot_slots=H, block_size=B, seed=seed,
                       resident_frac=0.2, prefill=True)
    nh = state.num_host_blocks * B
    for _ in range(8):
        s, h = rnd.randrange(S), rnd.randrange(H)
        state.slot_host_rows[s, h] = rnd.choice(
            [nh, nh + 3, INT32_MAX, INT32_MIN, -9, int(state.slot_host_rows[s, rnd.randrange(H)])])
    for _ in range(6):
        s, p = rnd.randrange(S), rnd.randrange(H)
        dup = int(state.lru[s, rnd.randrange(H)])
        state.lru[s, p] = rnd.choice([H, -1, INT32_MAX, INT32_MIN, dup])
    state.hot_blocks[rnd.randrange(S), rnd.randrange(state.hot_blocks.shape[1])] = rnd.choice(
        [0, -4, state.num_device_blocks, INT32_MAX])
    state.resident_blocks[rnd.randrange(S), rnd.randrange(8)] = INT32_MIN
    state.host_blocks[rnd.randrange(S), rnd.randrange(8)] = state.num_host_blocks + 1
    k, r = pair(state, kernel_device)
    big_rows, k.slot_host_rows = _canaried(k.slot_host_rows, 0x5A5A5A5A)
    big_lru, k.lru = _canaried(k.lru, 0x3C3C3C3C)
    inputs = [t.clone() for t in (k.seq_lens, k.resident_blocks, k.host_blocks, k.hot_blocks)]
    state_rows = [0, 2, 1, 5, -3]
    srows = torch.tensor(state_rows, dtype=torch.int32)
    topk = make_topk(state, state_rows, K, seed, invalid_frac=0.2, dup_frac=0.2)
    for step in range(2):
        run_both(topk, srows, k, r, block_h=16, what=f"corrupt {seed} step {step}")
        topk = drift_topk(topk, state, state_rows, seed + 50)
    mask = torch.ones_like(big_rows, dtype=torch.bool)
    mask[1:-1, 3:3 + 2 * H:2] = False
    assert big_rows[mask].eq(0x5A5A5A5A).all(), "slot_host_rows written outside its view"
    assert big_lru[mask].eq(0x3C3C3C3C).all(), "lru written outside its view"
    for before, after in zip(inputs, (k.seq_lens, k.resident_blocks, k.host_blocks, k.hot_blocks)):
        assert torch.equal(before, after), "a read-only input was modified"


def test_padding_only_zero_rows_and_zero_states(kernel_device: torch.device) -> None:
    state = make_state(num_states=2, pages=4, hot_slots=16, block_size=4, seed=0, prefill=True)
    k, r = pair(state, kernel_device)
    topk = torch.randint(0, 16, (2, 16), dtype=torch.int32)
    out = run_both(topk, torch.tensor([-1, 2], dtype=torch.int32), k, r)
    assert out.rows.eq(-1).all() and out.stats.eq(0).all()
    out = kres.resolve(topk[:0].to(kernel_device), torch.zeros(0, dtype=torch.int32,
                       device=kernel_device), *k.args(), **k.kwargs())
    assert out.rows.shape == (0, 16)
    empty = make_state(num_states=0, pages=4, hot_slots=16, block_size=4, seed=0).to(kernel_device)
    out = kres.resolve(topk.to(kernel_device), torch.zeros(2, dtype=torch.int32,
                       device=kernel_device), *empty.args(), **empty.kwargs())
    assert out.rows.eq(-1).all() and out.miss_count.eq(0).all() and out.stats.eq(0).all()


def test_warp_count_knob_keeps_results(kernel_device: torch.device) -> None:
    """``num_warps`` (the benchmark sweep's knob) changes the launch, not the results."""
    state = make_state(num_states=3, pages=6, hot_slots=40, block_size=4, seed=3, prefill=True)
    k, r = pair(state, kernel_device)
    srows = torch.tensor([1, 0], dtype=torch.int32)
    topk = make_topk(state, [1, 0], 32, seed=4)
    got = kres._resolve(topk.to(kernel_device), srows.to(kernel_device), *k.args(),
                        **k.kwargs(), num_warps=2)
    assert_result_equal(got, run_reference(topk, srows, r), "num_warps=2")
    assert torch.equal(k.lru.cpu(), r.lru)


# Wide rows: keys sorted in tiles of ``sort_width`` and merged in scratch (1 to 3 merge
# passes), with int32 keys (small host pool) and int64 keys (a host pool too large for them).
@pytest.mark.parametrize("top_k, sort_width, hot, block_h", [
    (33, 16, 40, 16), (64, 16, 64, None), (100, 32, 130, 32), (128, 16, 128, 64)])
@pytest.mark.parametrize("key64", (False, True), ids=("key32", "key64"))
def test_merged_sort_tiles_match_reference(top_k: int, sort_width: int, hot: int,
                                           block_h: int | None, key64: bool,
                                           kernel_device: torch.device) -> None:
    state = make_state(num_states=3, pages=(2 * top_k) // 4 + 2, hot_slots=hot, block_size=4,
                       seed=top_k + sort_width, resident_frac=0.2, null_frac=0.05, prefill=True)
    if key64:
        state.num_host_blocks = 2**26  # (2**26 * 4 + 1) * 128 > 2**31: int64 keys
    launch = kres._launch(top_k, hot, 4, state.num_host_blocks, False, sort_width, block_h)
    assert launch.key64 == key64 and launch.sort < launch.block_k
    k, r = pair(state, kernel_device)
    state_rows = [2, -1, 0, 1]
    srows = torch.tensor(state_rows, dtype=torch.int32)
    topk = make_topk(state, state_rows, top_k, seed=top_k, invalid_frac=0.1, dup_frac=0.2)
    for step in range(2):
        run_both(topk, srows, k, r, sort_width=sort_width, block_h=block_h,
                 what=f"k={top_k} sort={sort_width} step {step}")
        topk = drift_topk(topk, state, state_rows, 77 + step, keep=0.5)


@pytest.mark.parametrize("key64", (False, True), ids=("key32", "key64"))
@pytest.mark.parametrize("gather_search", (True, False), ids=("gather", "scratch"))
def test_key_width_and_search_keep_results(key64: bool, gather_search: bool,
                                           kernel_device: torch.device) -> None:
    """int32 keys where the host pool allows them, int64 otherwise; keys searched in
    registers (``tl.gather``) or in the row's scratch: same results."""
    state = make_state(num_states=3, pages=10, hot_slots=48, block_size=4, seed=21,
                       prefill=True)
    if key64:
        state.num_host_blocks = 2**27
    launch = kres._launch(32, 48, 4, state.num_host_blocks, False, gather_search=gather_search)
    assert launch.key64 == key64 and launch.in_regs == gather_search
    k, r = pair(state, kernel_device)
    srows = torch.tensor([0, 2, 1], dtype=torch.int32)
    topk = make_topk(state, [0, 2, 1], 32, seed=22, dup_frac=0.2)
    for step in range(3):
        run_both(topk, srows, k, r, block_h=16, gather_search=gather_search,
                 what=f"key64={key64} step {step}")
        topk = drift_topk(topk, state, [0, 2, 1], 23 + step)


def test_repeated_state_rows_across_scan_blocks(kernel_device: torch.device) -> None:
    """Every program scans the earlier rows' state rows in blocks of ``block_r``: repeats far
    apart (several blocks) are padding like near ones, in the kernel as in the reference."""
    state = make_state(num_states=6, pages=4, hot_slots=16, block_size=4, seed=41, prefill=True)
    names = [(7 * i) % 9 - 2 for i in range(40)]  # -2 .. 6: padding, repeats at any distance
    k, r = pair(state, kernel_device)
    topk = make_topk(state, names, 4, seed=42)
    got = run_both(topk, torch.tensor(names, dtype=torch.int32), k, r, block_r=16,
                   what="repeats")
    first = {st: i for i, st in reversed(list(enumerate(names)))}
    resolved = [i for i, st in enumerate(names) if 0 <= st < 6 and first[st] == i]
    assert len(resolved) == 6 and got.stats[resolved].sum() > 0
    assert got.stats[[i for i in range(40) if i not in resolved]].eq(0).all()


@pytest.mark.parametrize("backend", ("torch", "triton"))
def test_width_limit_is_named(backend: str, kernel_device: torch.device) -> None:
    """Both backends refuse a top-k wider than MAX_RESOLVE_WIDTH, naming the limit."""
    from hisparse_triton import ops
    from hisparse_triton.tuning import MAX_RESOLVE_WIDTH

    assert kres.MAX_RESOLVE_WIDTH == MAX_RESOLVE_WIDTH == 32768
    dev = kernel_device if backend == "triton" else torch.device("cpu")
    K = MAX_RESOLVE_WIDTH + 1
    state = make_state(num_states=1, pages=1, hot_slots=K, block_size=K, seed=0).to(dev)
    with pytest.raises(ValueError, match="MAX_RESOLVE_WIDTH = 32768"):
        ops.resolve(torch.zeros(1, K, dtype=torch.int32, device=dev),
                    torch.zeros(1, dtype=torch.int32, device=dev), *state.args(),
                    **state.kwargs(), backend=backend)


def test_launcher_validates_like_the_reference(kernel_device: torch.device) -> None:
    state = make_state(num_states=2, pages=4, hot_slots=16, block_size=4, seed=0).to(kernel_device)
    topk = torch.zeros(2, 8, dtype=torch.int32, device=kernel_device)
    srows = torch.zeros(2, dtype=torch.int32, device=kernel_device)
    with pytest.raises(TypeError, match="topk must be an integer tensor"):
        kres.resolve(topk.float(), srows, *state.args(), **state.kwargs())
    with pytest.raises(ValueError, match="lru has shape"):
        kres.resolve(topk, srows, *state.args()[:-1], state.lru[:, :4], **state.kwargs())
    with pytest.raises(ValueError, match="block_h"):
        kres._resolve(topk, srows, *state.args(), **state.kwargs(), block_h=24)
    before = state.clone()
    with pytest.raises(ValueError, match="num_warps"):
        kres._resolve(topk, srows, *state.args(), **state.kwargs(), num_warps=3)
    with pytest.raises(ValueError, match="sort_width"):
        kres._resolve(topk, srows, *state.args(), **state.kwargs(), sort_width=48)
    assert torch.equal(state.lru, before.lru)
    assert torch.equal(state.slot_host_rows, before.slot_host_rows)
    with pytest.raises(ValueError, match="all tensors must be on one device"):
        kres.resolve(topk, srows.to("meta"), *state.args(), **state.kwargs())


def test_cpu_tensors_without_interpreter_raise(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        kres._check_backend(torch.device("cpu"))


def test_signature_matches_reference() -> None:
    import inspect

    from hisparse_triton.ops.resolve import reference
    assert inspect.signature(kres.resolve) == inspect.signature(reference.resolve)


# Compiling the resolve kernel for sm_90 at production shapes (top-k 2048 and 8192 x up to
# 32768 slots, and every size 1), with spill and occupancy checks: test_gather_kernel.py
# (test_every_kernel_compiles_for_sm90_without_spills, one compile report for all kernels).


# ------------------------------------------------------------------------------ GPU only


def _production_state(device: torch.device, seed: int = 0, R: int = 64, K: int = 2048,
                      H: int = 4096, B: int = 64) -> tuple[ResolveState, torch.Tensor]:
    state = make_state(num_states=R + 8, pages=96, hot_slots=H, block_size=B, seed=seed,
                       resident_frac=0.05, null_frac=0.01, prefill=True)
    g = torch.Generator().manual_seed(seed)
    topk = torch.stack([torch.randperm(int(state.seq_lens[s]), generator=g)[:K]
                        for s in range(R)]).to(torch.int32)
    return state, topk


@NEEDS_CUDA
@pytest.mark.gpu
def test_production_shape_trace_on_gpu() -> None:
    """64 requests x top-k 2048 x 4096 slots, 6 drifting steps, bit-exact state each step."""
    dev = torch.device("cuda")
    state, topk = _production_state(dev)
    k, r = pair(state, dev)
    state_rows = list(range(63, -1, -1))
    state_rows[5] = -1
    srows = torch.tensor(state_rows, dtype=torch.int32)
    for step in range(6):
        run_both(topk, srows, k, r, what=f"gpu step {step}")
        keep = torch.rand(topk.shape, generator=torch.Generator().manual_seed(step)) < 0.9
        fresh = torch.randint(0, 96 * 64, topk.shape, dtype=torch.int32)
        topk = torch.where(keep, topk, fresh)


@NEEDS_CUDA
@pytest.mark.gpu
def test_cuda_graph_capture_and_replay() -> None:
    """The launcher does no host sync and allocates fixed shapes: it captures in a graph."""
    dev = torch.device("cuda")
    state, topk = _production_state(dev, seed=1, R=8, K=2048, H=4096)
    k, r = pair(state, dev)
    srows = torch.arange(8, dtype=torch.int32, device=dev)
    topk_d = topk.to(dev)
    args = (topk_d, srows, *k.args())
    kres.resolve(*args, **k.kwargs())  # warm-up (compile) outside the capture
    k2 = state.clone().to(dev)
    args = (topk_d, srows, *k2.args())
    graph = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        with torch.cuda.graph(graph):
            out = kres.resolve(*args, **k2.kwargs())
    torch.cuda.current_stream().wait_stream(s)
    # Capture does not run the kernels: the state is still the initial one. Replay = step 1.
    graph.replay()
    want = run_reference(topk, srows.cpu(), r)
    assert_result_equal(out, want, "graph step 1")
    graph.replay()
    want = run_reference(topk, srows.cpu(), r)
    assert_result_equal(out, want, "graph step 2")
    assert torch.equal(k2.lru.cpu(), r.lru) and torch.equal(k2.slot_host_rows.cpu(),
                                                            r.slot_host_rows)


@NEEDS_CUDA
@pytest.mark.gpu
def test_cuda_graph_decode_form_with_workspace() -> None:
    """The decode form (int64 top-k, workspace, ``out``, counters) captures in a CUDA graph:
    no allocation once the workspace is warm, every replay matches the reference and adds
    its stats to the counters on the device."""
    dev = torch.device("cuda")
    state, topk = _production_state(dev, seed=2, R=8, K=2048, H=4096)
    srows = torch.arange(8, dtype=torch.int32, device=dev)
    topk_d = topk.to(dev).long()
    workspace = kres.ResolveWorkspace(dev)
    out = torch.empty(8, 2048, dtype=torch.int32, device=dev)
    counters = torch.zeros(3, dtype=torch.int64, device=dev)
    warm = state.clone().to(dev)
    kres.resolve(topk_d, srows, *warm.args(), **warm.kwargs(), counters=counters, out=out,
                 workspace=workspace)  # compile, build the workspace views
    counters.zero_()
    k, r = pair(state, dev)
    graph = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s), torch.cuda.graph(graph):
        result = kres.resolve(topk_d, srows, *k.args(), **k.kwargs(), counters=counters,
                              out=out, workspace=workspace)
    torch.cuda.current_stream().wait_stream(s)
    total = torch.zeros(3, dtype=torch.int64)
    for step in range(2):
        graph.replay()
        want = run_reference(topk, srows.cpu(), r)
        assert_result_equal(result, want, f"graph step {step}")
        total += want.stats.sum(0)
    torch.cuda.synchronize()
    assert counters.cpu().tolist() == total.tolist()
    assert torch.equal(k.lru.cpu(), r.lru) and torch.equal(k.slot_host_rows.cpu(),
                                                            r.slot_host_rows)
