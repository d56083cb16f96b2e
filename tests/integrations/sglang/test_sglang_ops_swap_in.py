"""SGLang's ``load_cache_to_device_buffer_mla`` and ``copy_cache_planned_mla``: the torch model
of SGLang 0.5.23's semantics checked against a scalar walk of SGLang's CUDA kernel and against
hand-built cases of every convention; the Triton kernels (in the interpreter here) checked
against the torch model bit for bit, over many drifting steps. SGLang itself is not needed.
"""

from __future__ import annotations

import pytest
import torch

from hisparse_triton.integrations import sglang_reference as ref
from sglang_op_cases import (POISON, ROW_FORMATS, assert_same, bits, call, cuda_walk,
                             make_state, new_case, row_bytes, run, top_k_for)


def _kernel(**kw):
    from hisparse_triton.kernels import sglang_swap_in

    def launch(*args, **kwargs):
        return sglang_swap_in.load_cache_to_device_buffer_mla(*args, **kwargs, **kw)
    return launch


def _copy_kernel():
    from hisparse_triton.kernels import sglang_swap_in

    return sglang_swap_in.copy_cache_planned_mla


def _step_inputs(state: dict, rpi: list, seq_lens: list, K: int, g: torch.Generator,
                 last: dict, newest_every: int = 3, step: int = 0) -> torch.Tensor:
    """A top-k row per request: half near the request's last top-k, sometimes the newest."""
    rows = []
    for r, (rid, n) in enumerate(zip(rpi, seq_lens)):
        row = top_k_for(n, K, g, near=last.get(rid))
        if n > K and (step + r) % newest_every == 0 and (n - 1) not in row.tolist():
            row[int(torch.randint(0, K, (1,), generator=g))] = n - 1
        last[rid] = [p for p in row.tolist() if p >= 0]
        rows.append(row)
    return torch.stack(rows)


def _check_rows(case, result, K: int) -> None:
    """Every column points at the row its position names: the newest position at slot H's
    device row, every other valid position at a device row equal to its host row."""
    dev = row_bytes(result.state["device_buffer"])
    host = row_bytes(result.state["host_cache"])
    for b in range(case.top_k_tokens.shape[0]):
        if case.num_real is not None and b >= case.num_real:
            assert (result.out[b] == -1).all()
            continue
        rid, n = int(case.req_pool_indices[b]), int(case.seq_lens[b])
        for i, t in enumerate(case.top_k_tokens[b, :K].tolist()):
            loc = int(result.out[b, i])
            if n <= case.hot:
                want = int(case.device_buffer_locs[rid, t]) if 0 <= t and i < n else -1
                assert loc == want
            elif t == n - 1:
                assert loc == int(case.device_buffer_locs[rid, case.hot])
            elif t >= 0:
                assert torch.equal(dev[loc], host[int(case.host_cache_locs[rid, t])]), (b, i)


# --------------------------------------------------- the torch model against SGLang's kernel


@pytest.mark.parametrize("seed", range(4))
def test_reference_matches_sglang_kernel_walk(seed):
    """The torch model equals a thread-by-thread walk of SGLang's CUDA kernel (hash table,
    compacted slot array, LRU write-back formula) over 12 drifting steps of 4 requests with
    short and long rows, the newest position, CUDA-graph padding rows and the miss plan."""
    g = torch.Generator().manual_seed(seed)
    K, H, P, ctx = 8, 16, 4, 80
    state = make_state(6, H, P, ctx, "fp8", seed=seed)
    rpi, lens, last = [4, 1, 2, 5], [12, 30, 17, 50], {}
    for step in range(12):
        top_k = _step_inputs(state, rpi, lens, K, g, last, step=step)
        padded = torch.cat([top_k, top_k[:1]])
        case = new_case(state, padded, rpi + [0], lens + [9], K, H, num_real=len(rpi))
        want = cuda_walk(case)
        got = run(ref.load_cache_to_device_buffer_mla, case)
        assert_same(want, got, K)
        _check_rows(case, got, K)
        state = got.state
        lens = [n + 1 for n in lens]


def test_walk_and_model_fill_an_empty_buffer_in_lru_order():
    """SGLang's direct admission of a long request empties every slot: each top-k column is a
    miss, miss i takes LRU position i, the LRU rotates by top-k (filled slots move to just
    before the hits, here after the stale ones)."""
    K, H, P, ctx = 4, 8, 2, 40
    state = make_state(2, H, P, ctx, "bf16", seed=3)
    state["device_buffer_tokens"][:, :H] = -1
    state["lru_slots"][:] = torch.arange(H, dtype=torch.int16)
    top_k = torch.tensor([[30, 2, 17, 9]], dtype=torch.int32)
    case = new_case(state, top_k, [1], [35], K, H)
    got = run(ref.load_cache_to_device_buffer_mla, case)
    assert_same(cuda_walk(case), got, K)
    locs = state["device_buffer_locs"][1]
    assert got.out[0].tolist() == locs[:4].tolist()
    assert got.state["lru_slots"][1].tolist() == [4, 5, 6, 7, 0, 1, 2, 3]
    assert got.state["device_buffer_tokens"][1, :4].tolist() == [30, 2, 17, 9]
    assert got.plan[2].tolist() == [4]
    assert got.plan[0][0].tolist() == state["host_cache_locs"][1, [30, 2, 17, 9]].tolist()
    assert got.plan[1][0].tolist() == locs[:4].tolist()
    # The same top-k again hits everything: a fixed point (hits keep their LRU order).
    again = run(ref.load_cache_to_device_buffer_mla,
                new_case(got.state, top_k, [1], [35], K, H))
    assert torch.equal(again.out, got.out)
    assert again.plan[2].tolist() == [0]
    assert torch.equal(again.state["lru_slots"], got.state["lru_slots"])


def test_hits_move_to_the_mru_end_misses_before_them():
    """New LRU order = stale evictables (old order) + filled slots (miss order) + hits (old
    order), written out by hand for one row."""
    H, P = 6, 2
    state = make_state(1, H, P, 50, "fp8", seed=5)
    state["device_buffer_tokens"][0, :H] = torch.tensor([10, 11, 12, 13, 14, 15])
    state["lru_slots"][0] = torch.tensor([3, 0, 5, 1, 4, 2], dtype=torch.int16)
    # Slots 0 (pos 10) and 4 (pos 14) hit; 40 and 41 miss and take LRU positions 0 and 2.
    top_k = torch.tensor([[40, 14, 41, 10]], dtype=torch.int32)
    case = new_case(state, top_k, [0], [45], 4, H)
    got = run(ref.load_cache_to_device_buffer_mla, case)
    assert_same(cuda_walk(case), got, 4)
    locs = state["device_buffer_locs"][0].tolist()
    assert got.out[0].tolist() == [locs[3], locs[4], locs[5], locs[0]]
    assert got.state["lru_slots"][0].tolist() == [1, 2, 3, 5, 0, 4]
    assert got.state["device_buffer_tokens"][0, :H].tolist() == [10, 11, 12, 40, 14, 41]


def test_fast_path_reads_positions_and_leaves_state():
    """``seq_len <= H``: slot p holds position p; columns past ``seq_len`` (and -1 columns)
    give -1; the LRU, the slots and the device pool are untouched; the miss count is 0."""
    K, H, P = 8, 16, 4
    state = make_state(3, H, P, 40, "bf16", seed=7)
    top_k = torch.tensor([[3, 0, 5, -1, 2, 1, 4, 9], [15, 2, 7, 0, 11, 3, 9, 14]],
                         dtype=torch.int32)
    case = new_case(state, top_k, [2, 0], [6, 16], K, H)
    got = run(ref.load_cache_to_device_buffer_mla, case)
    assert_same(cuda_walk(case), got, K)
    locs = state["device_buffer_locs"]
    assert got.out[0].tolist() == [int(locs[2, t]) if t >= 0 and i < 6 else -1
                                   for i, t in enumerate(top_k[0].tolist())]
    assert got.out[1].tolist() == locs[0, top_k[1].long()].tolist()
    for name in ("lru_slots", "device_buffer_tokens", "device_buffer"):
        assert torch.equal(bits(got.state[name]), bits(state[name])), name
    assert got.plan[2].tolist() == [0, 0]


def test_padding_rows_write_minus_one_and_nothing_else():
    """Rows at or past ``num_real_reqs[0]`` (CUDA-graph padding) get -1 in every column and
    leave their miss count, the state and the pool alone, however their inputs look."""
    K, H, P = 4, 8, 2
    state = make_state(3, H, P, 30, "fp8", seed=9)
    top_k = torch.tensor([[20, 3, 7, 1], [25, 2, 6, 0], [28, 1, 5, 9]], dtype=torch.int32)
    case = new_case(state, top_k, [1, 1, 2], [29, 29, 29], K, H, num_real=1)
    got = run(ref.load_cache_to_device_buffer_mla, case)
    assert_same(cuda_walk(case), got, K)
    assert (got.out[1:] == -1).all()
    assert got.plan[2][1:].tolist() == [POISON, POISON]
    assert torch.equal(got.state["lru_slots"][2], state["lru_slots"][2])


def test_model_rules_where_sglang_races_or_reads_out_of_bounds():
    """The rules chosen where SGLang's kernel is undefined: a repeated position's later
    columns miss (the first column is the canonical one), two slots holding one position serve
    from the least recently used, columns below -1 or past the host table are left as they
    were, a request row outside the tables is padding with count 0, and misses beyond the
    evictable slots give -1 unplanned."""
    K, H, P, ctx = 4, 4, 2, 20
    state = make_state(2, H, P, ctx, "fp8", seed=11)
    state["device_buffer_tokens"][0, :H] = torch.tensor([5, 7, 5, 8])
    state["lru_slots"][0] = torch.tensor([1, 2, 0, 3], dtype=torch.int16)
    state["device_buffer_tokens"][1, :H] = torch.tensor([0, 1, 2, 3])
    top_k = torch.tensor([[5, 12, 5, -3], [3, 4, 5, 6], [25, 9, 9, -1]], dtype=torch.int32)
    case = new_case(state, top_k, [0, 7, 1], [19, 19, 19], K, H)
    out = torch.full((3, K), 55, dtype=torch.int32)
    got = run(ref.load_cache_to_device_buffer_mla, case, out=out)
    locs = state["device_buffer_locs"]
    # Row 0: 5 is held by slots 2 (LRU position 1) and 0 (position 2): slot 2 serves column
    # 0; column 2 repeats 5 and misses; 12 misses; -3 is left as it was. Evictable: slots 1
    # and 3 (positions 0 and 3): 12 -> slot 1, the repeated 5 -> slot 3.
    assert got.out[0].tolist() == [int(locs[0, 2]), int(locs[0, 1]), int(locs[0, 3]), 55]
    assert got.state["device_buffer_tokens"][0, :H].tolist() == [5, 12, 5, 5]
    assert got.state["lru_slots"][0].tolist() == [1, 3, 2, 0]
    assert got.plan[2][:1].tolist() == [2]
    # Row 1: request row 7 does not exist.
    assert got.out[1].tolist() == [-1] * K and int(got.plan[2][1]) == 0
    # Row 2: 25 is past the host table (left as it was), 9 twice: two misses.
    assert got.out[2, 0] == 55 and got.out[2, 3] == 55
    assert int(got.plan[2][2]) == 2
    # More misses than evictable slots: H = K, every slot hit but one, three misses.
    state2 = make_state(1, 4, 2, ctx, "fp8", seed=12)
    state2["device_buffer_tokens"][0, :4] = torch.tensor([1, 2, 2, 3])
    case2 = new_case(state2, torch.tensor([[2, 10, 11, 12]], dtype=torch.int32), [0], [19], 4, 4)
    got2 = run(ref.load_cache_to_device_buffer_mla, case2)
    assert int(got2.plan[2][0]) == 2
    assert int(got2.out[0, 3]) == -1


# ------------------------------------------------------ the Triton kernels against the model


BACKENDS = ["torch", "triton"]


def _impl(backend: str, **kw):
    return ref.load_cache_to_device_buffer_mla if backend == "torch" else _kernel(**kw)


@pytest.mark.parametrize("fmt", sorted(ROW_FORMATS))
def test_kernel_matches_model_over_drifting_steps(fmt):
    """20 steps of 4 requests (long and short rows growing by one position a step, the newest
    position, padding rows, the miss plan), LRU tiles smaller than the buffer: the Triton
    kernels and the torch model keep bit-identical tables, pools, outputs and plans, and every
    column points at its position's row."""
    g = torch.Generator().manual_seed(1)
    K, H, P, ctx = 16, 32, 4, 120
    state = make_state(5, H, P, ctx, fmt, seed=2)
    rpi, lens, last = [3, 0, 4, 1], [20, 31, 45, 60], {}
    kernel = _kernel(block_h=16)
    for step in range(20):
        top_k = _step_inputs(state, rpi, lens, K, g, last, step=step)
        case = new_case(state, torch.cat([top_k, top_k[:2]]), rpi + [2, 2], lens + [7, 7], K,
                        H, num_real=4)
        want = run(ref.load_cache_to_device_buffer_mla, case)
        got = run(kernel, case)
        assert_same(want, got, K)
        _check_rows(case, got, K)
        state = got.state
        lens = [n + 1 for n in lens]


@pytest.mark.parametrize("backend", BACKENDS)
def test_rules_cases_match_on_both_backends(backend):
    """The hand-built cases above (duplicates, out-of-range positions and rows, more misses
    than evictable slots) give the torch model's results on the Triton kernel too."""
    K, H, P, ctx = 4, 4, 2, 20
    state = make_state(2, H, P, ctx, "fp8", seed=11)
    state["device_buffer_tokens"][0, :H] = torch.tensor([5, 7, 5, 8])
    state["lru_slots"][0] = torch.tensor([1, 2, 0, 3], dtype=torch.int16)
    top_k = torch.tensor([[5, 12, 5, -3], [3, 4, 5, 6], [25, 9, 9, -1]], dtype=torch.int32)
    case = new_case(state, top_k, [0, 7, 1], [19, 19, 19], K, H)
    out = torch.full((3, K), 55, dtype=torch.int32)
    assert_same(run(ref.load_cache_to_device_buffer_mla, case, out=out.clone()),
                run(_impl(backend), case, out=out.clone()), K)
    state2 = make_state(1, 4, 2, ctx, "fp8", seed=12)
    state2["device_buffer_tokens"][0, :4] = torch.tensor([1, 2, 2, 3])
    state2["lru_slots"][0, 3] = 9          # an LRU entry past the slot columns
    case2 = new_case(state2, torch.tensor([[2, 10, 11, 12]], dtype=torch.int32), [0], [19], 4, 4)
    assert_same(run(ref.load_cache_to_device_buffer_mla, case2), run(_impl(backend), case2), 4)


@pytest.mark.parametrize("backend", BACKENDS)
def test_strided_inputs_int32_indices_and_no_real_count(backend):
    """A column-strided view of a wider top-k tensor, a strided output view, int32
    ``req_pool_indices`` / ``seq_lens``, no ``num_real_reqs`` and no plan: same result as
    contiguous inputs."""
    g = torch.Generator().manual_seed(4)
    K, H, P = 8, 16, 4
    state = make_state(3, H, P, 60, "bf16", seed=4)
    top_k = torch.stack([top_k_for(n, K, g) for n in (40, 12, 55)])
    wide = torch.full((3, 3 * K), 99, dtype=torch.int32)
    wide[:, 1::3] = top_k
    strided = new_case(state, wide[:, 1::3], [2, 0, 1], [40, 12, 55], K, H,
                       index_dtype=torch.int32)
    assert strided.top_k_tokens.stride() == (3 * K, 3)
    out_wide = torch.full((3, 2 * K), POISON, dtype=torch.int32)
    got = run(_impl(backend), strided, plan=False, out=out_wide[:, ::2])
    want = run(ref.load_cache_to_device_buffer_mla,
               new_case(state, top_k, [2, 0, 1], [40, 12, 55], K, H), plan=False)
    assert_same(want, got, K)
    assert (out_wide[:, 1::2] == POISON).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_skip_io_moves_no_bytes_but_plans(backend):
    """``skip_io``: the same tables, outputs and plan as a full call; the device pool keeps
    its bytes."""
    g = torch.Generator().manual_seed(6)
    K, H, P = 8, 16, 4
    state = make_state(2, H, P, 50, "fp8", seed=6)
    top_k = torch.stack([top_k_for(n, K, g) for n in (40, 45)])
    case = new_case(state, top_k, [1, 0], [40, 45], K, H)
    full = run(ref.load_cache_to_device_buffer_mla, case)
    probe = run(_impl(backend), case, skip_io=True)
    assert torch.equal(bits(probe.state["device_buffer"]), bits(state["device_buffer"]))
    assert int(full.plan[2].sum()) > 0
    probe.state["device_buffer"] = full.state["device_buffer"]
    assert_same(full, probe, K)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fmt", sorted(ROW_FORMATS))
def test_follower_replays_the_leader_plan(backend, fmt):
    """A leader layer records its miss plan; ``copy_cache_planned_mla`` replays it into a
    follower layer's pools (other bytes, the same slot table): every column of the leader's
    output then points at the follower's row for its position too. Rows past
    ``num_real_reqs[0]`` are not replayed, whatever their counts say."""
    g = torch.Generator().manual_seed(8)
    K, H, P, ctx = 8, 16, 4, 64
    leader = make_state(3, H, P, ctx, fmt, seed=8)
    follower = make_state(3, H, P, ctx, fmt, seed=80)
    top_k = torch.stack([top_k_for(n, K, g) for n in (50, 60, 33)])
    case = new_case(leader, torch.cat([top_k, top_k[:1]]), [0, 2, 1, 0], [50, 60, 33, 50], K,
                    H, num_real=3)
    led = run(_impl(backend), case)
    src, dst, cnt = led.plan
    cnt[3] = 5                                   # a stale count on the padding row
    copy = ref.copy_cache_planned_mla if backend == "torch" else _copy_kernel()
    dev = follower["device_buffer"].clone()
    copy(miss_src=src, miss_dst=dst, miss_count=cnt,
         num_real_reqs=torch.tensor([3], dtype=torch.int32),
         host_cache=follower["host_cache"], device_buffer=dev, item_size_bytes=case.item,
         num_blocks=4, block_size=1024)
    want = follower["device_buffer"].clone()
    ref.copy_cache_planned_mla(miss_src=src, miss_dst=dst, miss_count=cnt,
                               num_real_reqs=torch.tensor([3], dtype=torch.int32),
                               host_cache=follower["host_cache"], device_buffer=want,
                               item_size_bytes=case.item)
    assert torch.equal(bits(dev), bits(want))
    rows, host = row_bytes(dev), row_bytes(follower["host_cache"])
    replayed = 0
    for b in range(3):
        for m in range(int(cnt[b])):
            assert torch.equal(rows[int(dst[b, m])], host[int(src[b, m])]), (b, m)
            assert int(dst[b, m]) in led.out[b].tolist()
            replayed += 1
    assert replayed > 0
    # skip_io replays nothing.
    before = dev.clone()
    copy(miss_src=src, miss_dst=dst, miss_count=cnt,
         num_real_reqs=torch.tensor([3], dtype=torch.int32), host_cache=follower["host_cache"],
         device_buffer=dev, item_size_bytes=case.item, skip_io=True)
    assert torch.equal(bits(dev), bits(before))


@pytest.mark.parametrize("backend", BACKENDS)
def test_plan_rows_out_of_range_zero_fill_or_skip(backend):
    """A plan entry whose host row is outside the host pool zero-fills its device row; one
    whose device row is outside the device pool (or negative) is skipped."""
    item = 656
    host = torch.arange(4 * item, dtype=torch.int64).remainder(251).to(torch.uint8).view(4, item)
    dev = torch.full((3, item), 7, dtype=torch.uint8)
    src = torch.tensor([[2, -1, 9, 1]], dtype=torch.int64)
    dst = torch.tensor([[0, 1, 2, 5]], dtype=torch.int32)
    copy = ref.copy_cache_planned_mla if backend == "torch" else _copy_kernel()
    copy(miss_src=src, miss_dst=dst, miss_count=torch.tensor([4], dtype=torch.int32),
         num_real_reqs=torch.tensor([1], dtype=torch.int32), host_cache=host,
         device_buffer=dev, item_size_bytes=item)
    assert torch.equal(dev[0], host[2])
    assert (dev[1] == 0).all() and (dev[2] == 0).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_long_context_uses_wide_sort_keys(backend):
    """A host table so wide that ``position * W + column`` overflows int32 (int64 keys); the
    table is a broadcast view (one host row per request), so it costs no memory."""
    K, H, P = 8, 16, 4
    ctx = 2**28 + 3
    state = make_state(2, H, P, 40, "fp8", seed=13)
    state["device_buffer_tokens"][1, :H] = -1
    state["device_buffer_tokens"][1, 3] = 2**28
    state["host_cache_locs"] = torch.tensor([[5], [9]], dtype=torch.int64).expand(2, ctx)
    top_k = torch.tensor([[2**28 + 1, 2**28, 7, 1, 12, 30, 2**27, 3]], dtype=torch.int32)
    case = new_case(state, top_k, [1], [2**28 + 3], K, H)
    want = run(ref.load_cache_to_device_buffer_mla, case)
    assert int(want.plan[2][0]) == 7
    assert_same(want, run(_impl(backend), case), K)


@pytest.mark.parametrize("backend", BACKENDS)
def test_bad_input_is_refused_and_changes_nothing(backend):
    """Each bad argument raises an error naming it, before anything is written."""
    K, H, P = 4, 8, 2
    state = make_state(2, H, P, 30, "fp8", seed=14)
    top_k = torch.tensor([[20, 3, 7, 1]], dtype=torch.int32)
    fn = _impl(backend)
    bad = {
        "top_k_tokens": (lambda c: setattr(c, "top_k_tokens", c.top_k_tokens.long()), TypeError),
        "hot_buffer_size": (lambda c: setattr(c, "top_k", 9), ValueError),
        "lru_slots": (lambda c: setattr(c, "lru_slots", c.lru_slots.int()), TypeError),
        "device_buffer_locs": (lambda c: setattr(c, "device_buffer_locs",
                                                 c.device_buffer_locs[:, :H]), ValueError),
        "device_buffer": (lambda c: setattr(c, "device_buffer", c.device_buffer[:, :, ::2]),
                          ValueError),
    }
    for name, (spoil, kind) in bad.items():
        case = new_case(state, top_k, [1], [25], K, H)
        spoil(case)
        before = case.clone()
        with pytest.raises(kind, match=name):
            call(fn, case)
        for field_name in ("device_buffer_tokens", "lru_slots", "device_buffer"):
            assert torch.equal(bits(getattr(before, field_name)),
                               bits(getattr(case, field_name)))
    case = new_case(state, top_k, [1], [25], K, H)
    with pytest.raises(ValueError, match="miss_src, miss_dst and miss_count"):
        fn(case.top_k_tokens, case.device_buffer_tokens, case.host_cache_locs,
           case.device_buffer_locs, case.host_cache, case.device_buffer,
           torch.zeros(1, K, dtype=torch.int32), case.req_pool_indices, case.seq_lens,
           case.lru_slots, case.item, K, H, miss_src=torch.zeros(1, K, dtype=torch.int64))


def test_kernel_refuses_top_k_over_one_sort():
    from hisparse_triton.kernels import sglang_swap_in

    K, H, P = 4096, 4096, 4
    state = make_state(1, 8, P, 30, "fp8", seed=15)
    case = new_case(state, torch.zeros(1, K, dtype=torch.int32), [0], [5], K, H)
    case.device_buffer_tokens = torch.full((1, H + P), -1, dtype=torch.int32)
    case.device_buffer_locs = torch.zeros(1, H + P, dtype=torch.int32)
    case.lru_slots = torch.zeros(1, H, dtype=torch.int16)
    with pytest.raises(ValueError, match="num_top_k=4096"):
        run(sglang_swap_in.load_cache_to_device_buffer_mla, case)
