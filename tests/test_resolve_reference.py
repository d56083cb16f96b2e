"""``reference.resolve`` against a slow, obviously-correct pure-Python model of the rules.

The case generators here (``make_state``, ``make_topk``, ``drift_topk``, ``oracle_resolve``)
are also used by ``test_resolve_kernel.py``.
"""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from hisparse_triton.ops.resolve.reference import ResolveResult, resolve

INT32_MIN = -(2**31)
INT32_MAX = 2**31 - 1


@dataclasses.dataclass
class ResolveState:
    """Everything ``resolve`` needs besides ``topk`` / ``state_rows`` (int32 tensors)."""

    seq_lens: torch.Tensor  # [S]
    resident_blocks: torch.Tensor  # [S, P]
    host_blocks: torch.Tensor  # [S, P]
    hot_blocks: torch.Tensor  # [S, HB]
    slot_host_rows: torch.Tensor  # [S, H]
    lru: torch.Tensor  # [S, H]
    block_size: int
    num_device_blocks: int
    num_host_blocks: int

    @property
    def hot_slots(self) -> int:
        return self.lru.shape[1]

    def clone(self) -> "ResolveState":
        return dataclasses.replace(self, **{
            f.name: getattr(self, f.name).clone()
            for f in dataclasses.fields(self) if isinstance(getattr(self, f.name), torch.Tensor)})

    def to(self, device: torch.device | str) -> "ResolveState":
        return dataclasses.replace(self, **{
            f.name: getattr(self, f.name).to(device)
            for f in dataclasses.fields(self) if isinstance(getattr(self, f.name), torch.Tensor)})

    def args(self) -> tuple[torch.Tensor, ...]:
        return (self.seq_lens, self.resident_blocks, self.host_blocks, self.hot_blocks,
                self.slot_host_rows, self.lru)

    def kwargs(self) -> dict[str, int]:
        return dict(block_size=self.block_size, num_device_blocks=self.num_device_blocks,
                    num_host_blocks=self.num_host_blocks)


def make_state(
    *,
    num_states: int,
    pages: int,
    hot_slots: int,
    block_size: int,
    seed: int,
    resident_frac: float = 0.3,
    null_frac: float = 0.05,
    shuffle_lru: bool = True,
    prefill: bool = False,
) -> ResolveState:
    """A random but well-formed hot state: distinct host / device blocks, a valid LRU."""
    g = torch.Generator().manual_seed(seed)
    S, P, H, B = num_states, pages, hot_slots, block_size
    HB = -(-H // B) + 1  # one spare hot block: HB * B >= H with slack
    num_host_blocks = 1 + S * P + 3
    num_device_blocks = 1 + S * P + S * HB + 2
    host = torch.randperm(num_host_blocks - 1, generator=g)[: S * P].add(1).view(S, P)
    host = torch.where(torch.rand(S, P, generator=g) < null_frac, 0, host)
    dev = torch.randperm(num_device_blocks - 1, generator=g).add(1)
    resident = dev[: S * P].view(S, P).clone()
    resident = torch.where(torch.rand(S, P, generator=g) < resident_frac, resident, 0)
    hot = dev[S * P: S * P + S * HB].view(S, HB).clone()
    seq_lens = torch.randint(P * B // 2, P * B + 1, (S,), generator=g)
    if shuffle_lru:
        lru = torch.stack([torch.randperm(H, generator=g) for _ in range(S)] or [torch.arange(0)])
        lru = lru.view(S, H)
    else:
        lru = torch.arange(H).expand(S, H).clone()
    slot_rows = torch.full((S, H), -1, dtype=torch.int64)
    if prefill:  # some slots already hold (possibly resident or foreign) host rows
        rows = host.clamp(min=1).view(S, P, 1) * B + torch.arange(B)
        for s in range(S):
            pick = torch.randperm(P * B, generator=g)[:H]
            take = torch.rand(pick.numel(), generator=g) < 0.6
            slot_rows[s, : pick.numel()] = torch.where(take, rows[s].flatten()[pick], -1)
    i32 = torch.int32
    return ResolveState(seq_lens.to(i32), resident.to(i32), host.to(i32), hot.to(i32),
                        slot_rows.to(i32), lru.to(i32), B, num_device_blocks, num_host_blocks)


def make_topk(state: ResolveState, state_rows: list[int], top_k: int, seed: int, *,
              invalid_frac: float = 0.1, dup_frac: float = 0.05) -> torch.Tensor:
    """``[R, K] int32`` positions: mostly valid, some invalid (negative, >= seq_len, huge),
    some duplicates."""
    rnd = random.Random(seed)
    out = []
    for st in state_rows:
        seq = int(state.seq_lens[st]) if 0 <= st < state.seq_lens.numel() else 16
        row = []
        for _ in range(top_k):
            x = rnd.random()
            if x < invalid_frac:
                row.append(rnd.choice([-1, -rnd.randrange(1, 1000), seq, seq + rnd.randrange(1, 50),
                                       INT32_MAX, INT32_MIN, 2**30]))
            elif x < invalid_frac + dup_frac and row:
                row.append(rnd.choice(row))
            else:
                row.append(rnd.randrange(max(seq, 1)))
        out.append(row)
    return torch.tensor(out, dtype=torch.int32).view(len(state_rows), top_k)


def drift_topk(prev: torch.Tensor, state: ResolveState, state_rows: list[int], seed: int,
               keep: float = 0.7) -> torch.Tensor:
    """The next step's top-k: keep ``keep`` of the columns, redraw the others."""
    fresh = make_topk(state, state_rows, prev.shape[1], seed)
    g = torch.Generator().manual_seed(seed)
    return torch.where(torch.rand(prev.shape, generator=g) < keep, prev, fresh)


def oracle_resolve(topk: torch.Tensor, state_rows: torch.Tensor, st_: ResolveState
                   ) -> tuple[ResolveResult, torch.Tensor, torch.Tensor]:
    """Column-by-column Python model of the documented rules (slow, obviously correct).

    Returns the result plus the new ``slot_host_rows`` and ``lru`` (inputs are not modified).
    """
    B, NDB, NHB = st_.block_size, st_.num_device_blocks, st_.num_host_blocks
    S, P = st_.resident_blocks.shape
    H = st_.hot_slots
    R, K = topk.shape
    held = st_.slot_host_rows.tolist()
    lru = st_.lru.tolist()
    res_b, host_b, hot_b = (st_.resident_blocks.tolist(), st_.host_blocks.tolist(),
                            st_.hot_blocks.tolist())
    rows = [[-1] * K for _ in range(R)]
    src = [[-1] * K for _ in range(R)]
    dst = [[-1] * K for _ in range(R)]
    count = [0] * R
    stats = [[0, 0, 0] for _ in range(R)]
    resolved: set[int] = set()
    for r in range(R):
        st = int(state_rows[r])
        if not 0 <= st < S or st in resolved:  # padding, or a state row named again
            continue
        resolved.add(st)
        order = lru[st]

        def dev_row(slot: int) -> int:
            blk = hot_b[st][slot // B]
            return blk * B + slot % B if 1 <= blk < NDB else -1

        seen: set[int] = set()
        valid = []
        for s in order:
            valid.append(0 <= s < H and s not in seen)
            if 0 <= s < H:
                seen.add(s)
        holder: dict[int, int] = {}  # host row -> earliest valid LRU position holding it
        for p, s in enumerate(order):
            if valid[p]:
                v = held[st][s]
                if 0 <= v < NHB * B and v not in holder:
                    holder[v] = p
        kinds = []  # per column: ("masked",) / ("res", row) / ("host", g)
        for i in range(K):
            pos = int(topk[r, i])
            if pos < 0 or pos >= int(st_.seq_lens[st]) or pos // B >= P:
                kinds.append(("masked",))
                continue
            rb = res_b[st][pos // B]
            if 1 <= rb < NDB:
                kinds.append(("res", rb * B + pos % B))
                continue
            hb = host_b[st][pos // B]
            kinds.append(("host", hb * B + pos % B) if 1 <= hb < NHB else ("masked",))
        host_rows = {k[1] for k in kinds if k[0] == "host"}
        serving = sorted(holder[v] for v in host_rows if v in holder)
        misses: list[int] = []
        for k in kinds:
            if k[0] == "host" and k[1] not in holder and k[1] not in misses:
                misses.append(k[1])
        evictable = [p for p in range(H) if valid[p] and p not in serving]
        n_fill = min(len(misses), len(evictable))
        miss_slot = {misses[m]: order[evictable[m]] for m in range(n_fill)}
        for m in range(n_fill):
            src[r][m] = misses[m]
            dst[r][m] = dev_row(order[evictable[m]])
            held[st][order[evictable[m]]] = misses[m]
        first_done: set[int] = set()
        hits = n_miss_stat = masked = 0
        for i, k in enumerate(kinds):
            if k[0] == "res":
                out = k[1]
            elif k[0] == "host" and k[1] in holder:
                out = dev_row(order[holder[k[1]]])
            elif k[0] == "host" and k[1] in miss_slot:
                out = dev_row(miss_slot[k[1]])
            else:
                out = -1
            rows[r][i] = out
            if out == -1:
                masked += 1
            elif k[0] == "host" and k[1] in miss_slot and k[1] not in first_done:
                n_miss_stat += 1
            else:
                hits += 1
            if k[0] == "host":
                first_done.add(k[1])
        count[r] = n_fill
        stats[r] = [hits, n_miss_stat, masked]
        if serving or n_fill:
            new = ([order[p] for p in evictable[n_fill:]] + [order[p] for p in evictable[:n_fill]]
                   + [order[p] for p in serving] + [order[p] for p in range(H) if not valid[p]])
            lru[st] = new
    i32 = torch.int32
    result = ResolveResult(torch.tensor(rows, dtype=i32).view(R, K),
                           torch.tensor(src, dtype=i32).view(R, K),
                           torch.tensor(dst, dtype=i32).view(R, K),
                           torch.tensor(count, dtype=i32),
                           torch.tensor(stats, dtype=i32).view(R, 3))
    return (result, torch.tensor(held, dtype=i32).view(S, H),
            torch.tensor(lru, dtype=i32).view(S, H))


def run_reference(topk: torch.Tensor, state_rows: torch.Tensor, state: ResolveState
                  ) -> ResolveResult:
    return resolve(topk, state_rows, *state.args(), **state.kwargs())


def assert_result_equal(got: ResolveResult, want: ResolveResult, what: str = "") -> None:
    for name, a, b in zip(ResolveResult._fields, got, want):
        assert a.dtype == torch.int32, f"{what} {name} dtype {a.dtype}"
        assert a.shape == b.shape, f"{what} {name} shape {tuple(a.shape)} != {tuple(b.shape)}"
        if not torch.equal(a.cpu(), b.cpu()):
            bad = (a.cpu() != b.cpu()).nonzero()[:5].tolist()
            raise AssertionError(f"{what} {name} differs at {bad}:\n got {a}\nwant {b}")


def check_against_oracle(topk: torch.Tensor, state_rows: torch.Tensor, state: ResolveState,
                         what: str = "") -> ResolveResult:
    """Run the reference in place on ``state``; assert it equals the oracle."""
    want, want_held, want_lru = oracle_resolve(topk, state_rows, state)
    got = run_reference(topk, state_rows, state)
    assert_result_equal(got, want, what)
    assert torch.equal(state.slot_host_rows, want_held), f"{what} slot_host_rows"
    assert torch.equal(state.lru, want_lru), f"{what} lru"
    return got


# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(12))
def test_random_cases_match_oracle(seed: int) -> None:
    rnd = random.Random(seed)
    B = rnd.choice([1, 2, 4, 8])
    K = rnd.choice([1, 3, 8, 17, 32])
    H = K * rnd.choice([1, 2, 3]) + rnd.randrange(0, 3)
    state = make_state(num_states=4, pages=rnd.choice([2, 5, 12]), hot_slots=H, block_size=B,
                       seed=seed, resident_frac=rnd.choice([0.0, 0.3, 1.0]),
                       null_frac=rnd.choice([0.0, 0.2]), prefill=rnd.random() < 0.5)
    state_rows = [2, -1, 0, 3, 7, -5]
    topk = make_topk(state, state_rows, K, seed, invalid_frac=0.15, dup_frac=0.1)
    srows = torch.tensor(state_rows, dtype=torch.int32)
    for step in range(4):
        check_against_oracle(topk, srows, state, f"seed {seed} step {step}")
        topk = drift_topk(topk, state, state_rows, seed * 100 + step)


def test_first_steps_by_hand() -> None:
    """A tiny case worked out by hand: B=2, H=6, one request with pages 0..2."""
    state = ResolveState(
        seq_lens=torch.tensor([6], dtype=torch.int32),
        resident_blocks=torch.tensor([[0, 0, 7]], dtype=torch.int32),  # page 2 resident
        host_blocks=torch.tensor([[3, 0, 5]], dtype=torch.int32),  # page 1 null
        hot_blocks=torch.tensor([[10, 11, 12]], dtype=torch.int32),  # slot s -> row 20 + s
        slot_host_rows=torch.tensor([[-1, 6, -1, -1, -1, -1]], dtype=torch.int32),  # slot 1: g=6
        lru=torch.tensor([[1, 0, 2, 3, 4, 5]], dtype=torch.int32),
        block_size=2, num_device_blocks=12, num_host_blocks=6)
    # positions: 0 -> g 6 (hit slot 1), 1 -> g 7 (miss), 2 -> null page, 4 -> resident 14,
    # 1 again (duplicate of the miss), 9 -> beyond seq_len.
    topk = torch.tensor([[0, 1, 2, 4, 1, 9]], dtype=torch.int32)
    out = run_reference(topk, torch.tensor([0], dtype=torch.int32), state)
    # evictables in LRU order: slots 0, 2, 3, 4, 5 -> miss g=7 takes slot 0 (row 20).
    assert out.rows.tolist() == [[21, 20, -1, 14, 20, -1]]
    assert out.miss_src[0, :1].tolist() == [7] and out.miss_dst[0, :1].tolist() == [20]
    assert out.miss_src[0, 1:].eq(-1).all() and out.miss_dst[0, 1:].eq(-1).all()
    assert out.miss_count.tolist() == [1]
    assert out.stats.tolist() == [[3, 1, 2]]  # hit, dup, resident / one miss / two masked
    assert state.slot_host_rows.tolist() == [[7, 6, -1, -1, -1, -1]]
    assert state.lru.tolist() == [[2, 3, 4, 5, 0, 1]]  # unused evictables, filled, hit


def test_lru_order_visible_through_later_evictions() -> None:
    """Hits move to the MRU end; the next misses evict the oldest untouched slots first."""
    B, H = 1, 4
    state = ResolveState(
        seq_lens=torch.tensor([8], dtype=torch.int32),
        resident_blocks=torch.zeros(1, 8, dtype=torch.int32),
        host_blocks=torch.arange(1, 9, dtype=torch.int32).view(1, 8),  # g = pos + 1
        hot_blocks=torch.arange(20, 24, dtype=torch.int32).view(1, 4),
        slot_host_rows=torch.full((1, H), -1, dtype=torch.int32),
        lru=torch.arange(H, dtype=torch.int32).view(1, H),
        block_size=B, num_device_blocks=30, num_host_blocks=9)
    sr = torch.tensor([0], dtype=torch.int32)
    steps = [[0, 1], [2, 3], [0, 2], [4, 5]]
    for cols in steps:
        check_against_oracle(torch.tensor([cols], dtype=torch.int32), sr, state)
    # step 1 fills slots 0,1; step 2 fills 2,3; step 3 hits slots 0 (g1) and 2 (g3);
    # step 4's misses evict the two oldest untouched slots: 1 then 3.
    assert state.slot_host_rows.tolist() == [[1, 5, 3, 6]]
    assert state.lru.tolist() == [[0, 2, 1, 3]]


def test_resident_and_masked_rows_leave_state_untouched() -> None:
    state = make_state(num_states=2, pages=4, hot_slots=8, block_size=4, seed=1,
                       resident_frac=1.0, prefill=True)
    before = state.clone()
    topk = torch.tensor([[0, 1, 5, -3, 10_000, 6, 7, 2]], dtype=torch.int32)
    out = check_against_oracle(topk, torch.tensor([1], dtype=torch.int32), state)
    assert out.miss_count.tolist() == [0]
    assert torch.equal(state.lru, before.lru)
    assert torch.equal(state.slot_host_rows, before.slot_host_rows)


def test_padding_rows_output_minus_one_and_touch_nothing() -> None:
    state = make_state(num_states=2, pages=4, hot_slots=8, block_size=4, seed=2)
    before = state.clone()
    topk = torch.randint(0, 16, (3, 8), dtype=torch.int32)
    out = run_reference(topk, torch.tensor([-1, 2, INT32_MIN], dtype=torch.int32), state)
    assert out.rows.eq(-1).all() and out.miss_src.eq(-1).all() and out.miss_dst.eq(-1).all()
    assert out.miss_count.eq(0).all() and out.stats.eq(0).all()
    assert torch.equal(state.lru, before.lru)
    assert torch.equal(state.slot_host_rows, before.slot_host_rows)


@pytest.mark.parametrize("seed", range(8))
def test_corrupted_state_matches_oracle(seed: int) -> None:
    """Out-of-range / duplicated slot rows, lru entries and hot blocks: documented rules."""
    rnd = random.Random(1000 + seed)
    K, B = rnd.choice([4, 9, 16]), rnd.choice([2, 4])
    H = K * 2
    state = make_state(num_states=3, pages=6, hot_slots=H, block_size=B, seed=seed,
                       resident_frac=0.2, prefill=True)
    state_rows = [0, 1, 2]
    topk = make_topk(state, state_rows, K, seed)
    srows = torch.tensor(state_rows, dtype=torch.int32)
    check_against_oracle(topk, srows, state)  # fill some slots first
    S = 3
    shr = state.slot_host_rows
    nh = state.num_host_blocks * B
    for _ in range(6):  # bad and duplicated held rows
        s, h = rnd.randrange(S), rnd.randrange(H)
        dup = int(shr[s, rnd.randrange(H)])
        shr[s, h] = rnd.choice([nh, nh + 5, INT32_MAX, INT32_MIN, -7, dup])
    for _ in range(4):  # bad and duplicated lru entries
        s, p = rnd.randrange(S), rnd.randrange(H)
        dup = int(state.lru[s, rnd.randrange(H)])
        state.lru[s, p] = rnd.choice([H, -1, INT32_MAX, INT32_MIN, dup])
    hb = state.hot_blocks
    hb[rnd.randrange(S), rnd.randrange(hb.shape[1])] = rnd.choice([0, -3, state.num_device_blocks])
    state.resident_blocks[rnd.randrange(S), rnd.randrange(6)] = state.num_device_blocks + 9
    for step in range(3):
        check_against_oracle(topk, srows, state, f"corrupt seed {seed} step {step}")
        topk = drift_topk(topk, state, state_rows, seed + step, keep=0.5)


def test_lru_with_many_duplicates_runs_out_of_evictable_slots() -> None:
    """A corrupted lru naming one slot everywhere: only one miss gets a slot."""
    state = make_state(num_states=1, pages=8, hot_slots=6, block_size=2, seed=3,
                       resident_frac=0.0, null_frac=0.0)
    state.lru[0] = torch.tensor([4, 4, 4, 99, 4, -2], dtype=torch.int32)
    topk = torch.tensor([[0, 2, 4, 6]], dtype=torch.int32)
    out = check_against_oracle(topk, torch.tensor([0], dtype=torch.int32), state)
    assert out.miss_count.tolist() == [1]
    assert out.stats.tolist() == [[0, 1, 3]]
    assert out.rows[0, 1:].eq(-1).all()
    assert state.lru.tolist() == [[4, 4, 4, 99, 4, -2]]  # filled slot 4 first, invalid keep order


def test_warm_replay_is_all_hits() -> None:
    state = make_state(num_states=2, pages=8, hot_slots=24, block_size=4, seed=5,
                       resident_frac=0.25, null_frac=0.0)
    srows = torch.tensor([1, 0], dtype=torch.int32)
    topk = make_topk(state, [1, 0], 12, 5, invalid_frac=0.0, dup_frac=0.0)
    first = check_against_oracle(topk, srows, state)
    second = check_against_oracle(topk, srows, state)
    assert second.miss_count.eq(0).all() and second.miss_src.eq(-1).all()
    assert torch.equal(second.rows, first.rows)
    assert torch.equal(second.stats[:, 0], first.stats[:, 0] + first.stats[:, 1])


def test_non_contiguous_state_views_update_in_place() -> None:
    state = make_state(num_states=3, pages=5, hot_slots=10, block_size=2, seed=9)
    want_state = state.clone()
    wide_lru = torch.full((3, 30), 77, dtype=torch.int32)
    wide_lru[:, ::3] = state.lru
    wide_rows = torch.full((3, 20), 55, dtype=torch.int32)
    wide_rows[:, 1::2] = state.slot_host_rows
    state.lru, state.slot_host_rows = wide_lru[:, ::3], wide_rows[:, 1::2]
    topk = make_topk(state, [2, 0], 7, 9)
    srows = torch.tensor([2, 0], dtype=torch.int32)
    got = run_reference(topk, srows, state)
    want = run_reference(topk, srows, want_state)
    assert_result_equal(got, want)
    assert torch.equal(state.lru, want_state.lru) and torch.equal(state.slot_host_rows,
                                                                   want_state.slot_host_rows)
    assert wide_lru[:, [i for i in range(30) if i % 3]].eq(77).all()
    assert wide_rows[:, 0::2].eq(55).all()


def _valid_args(K: int = 4) -> tuple[tuple, dict]:
    state = make_state(num_states=2, pages=3, hot_slots=8, block_size=4, seed=0)
    topk = torch.zeros(2, K, dtype=torch.int32)
    return (topk, torch.tensor([0, 1], dtype=torch.int32), *state.args()), state.kwargs()


@pytest.mark.parametrize("mutate, error, match", [
    (lambda a, k: a.__setitem__(0, a[0].float()), TypeError, "topk must be an integer tensor"),
    (lambda a, k: a.__setitem__(1, a[1].long()), TypeError, "state_rows must be int32"),
    (lambda a, k: a.__setitem__(1, a[1][:1]), ValueError, "state_rows has shape"),
    (lambda a, k: a.__setitem__(7, a[7][:, :2]), ValueError, "lru has shape"),
    (lambda a, k: a.__setitem__(0, torch.zeros(2, 9, dtype=torch.int32)), ValueError, "H >= K"),
    (lambda a, k: a.__setitem__(5, a[5][:, :1]), ValueError, "hot blocks"),
    (lambda a, k: a.__setitem__(6, a[6][:1].expand(2, 8)), ValueError, "stride-0"),
    (lambda a, k: k.__setitem__("block_size", 0), ValueError, "block_size"),
    (lambda a, k: k.__setitem__("num_host_blocks", 2**30), ValueError, "fit int32"),
    (lambda a, k: a.__setitem__(3, a[3].float()), TypeError, "resident_blocks must be int32"),
    (lambda a, k: a.__setitem__(2, [1, 2]), TypeError, "seq_lens must be a torch.Tensor"),
])
def test_bad_arguments_raise_and_leave_state_alone(mutate, error, match) -> None:
    args, kwargs = _valid_args()
    args = list(args)
    before = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
    mutate(args, kwargs)
    with pytest.raises(error, match=match):
        resolve(*args, **kwargs)
    assert torch.equal(args[6], before[6]) or args[6].shape != before[6].shape
    assert torch.equal(args[7], before[7]) or args[7].shape != before[7].shape


def test_zero_rows_and_zero_states() -> None:
    args, kwargs = _valid_args()
    args = list(args)
    out = resolve(args[0][:0], args[1][:0], *args[2:], **kwargs)
    assert out.rows.shape == (0, 4) and out.stats.shape == (0, 3)
    empty = make_state(num_states=0, pages=3, hot_slots=8, block_size=4, seed=0)
    out = resolve(args[0], torch.tensor([0, -1], dtype=torch.int32), *empty.args(), **kwargs)
    assert out.rows.eq(-1).all() and out.stats.eq(0).all()
