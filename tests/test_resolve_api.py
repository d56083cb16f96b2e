"""``ops.resolve`` keywords (``counters``, ``out``, ``workspace``), wide ``topk`` dtypes,
repeated state rows and ``restore_resolve_state``: one behaviour, bit for bit, on both backends.

``triton`` runs under ``TRITON_INTERPRET=1`` on CPU (conftest) and natively on CUDA.
"""

from __future__ import annotations

import pytest
import torch

from hisparse_triton import ops
from hisparse_triton.ops.resolve import reference as ref
from test_resolve_reference import (
    INT32_MAX,
    ResolveState,
    assert_result_equal,
    drift_topk,
    make_state,
    make_topk,
)

BACKENDS = ("torch", "triton")


def _device(backend: str, kernel_device: torch.device) -> torch.device:
    return kernel_device if backend == "triton" else torch.device("cpu")


def _resolve(state: ResolveState, topk: torch.Tensor, state_rows: torch.Tensor, backend: str,
             **extra) -> ref.ResolveResult:
    dev = state.lru.device
    return ops.resolve(topk.to(dev), state_rows.to(dev), *state.args(), **state.kwargs(),
                       backend=backend, **extra)


def _case(seed: int = 0, K: int = 24, H: int = 40, S: int = 4):
    state = make_state(num_states=S, pages=12, hot_slots=H, block_size=4, seed=seed,
                       resident_frac=0.2, null_frac=0.05, prefill=True)
    return state


def assert_rows_hold_their_positions(state: ResolveState, topk: torch.Tensor,
                                     state_rows: list[int], rows: torch.Tensor) -> None:
    """Every returned row is what the position needs: -1 for a masked position, the resident
    row for a resident page, else a hot slot (of this request) that now holds its host row."""
    B = state.block_size
    hot_rows = {}
    for st in range(state.lru.shape[0]):
        for s in range(state.hot_slots):
            blk = int(state.hot_blocks[st, s // B])
            if 1 <= blk < state.num_device_blocks:
                hot_rows[(st, blk * B + s % B)] = s
    seen = set()
    for r, st in enumerate(state_rows):
        if not 0 <= st < state.lru.shape[0] or st in seen:
            assert rows[r].eq(-1).all(), f"padding / repeated row {r} has rows"
            continue
        seen.add(st)
        for c in range(topk.shape[1]):
            pos, got = int(topk[r, c]), int(rows[r, c])
            if not 0 <= pos < int(state.seq_lens[st]) or pos // B >= state.host_blocks.shape[1]:
                assert got == -1, (r, c, pos, got)
                continue
            rb = int(state.resident_blocks[st, pos // B])
            if 1 <= rb < state.num_device_blocks:
                assert got == rb * B + pos % B, (r, c)
                continue
            hb = int(state.host_blocks[st, pos // B])
            if not 1 <= hb < state.num_host_blocks:
                assert got == -1, (r, c)
                continue
            slot = hot_rows.get((st, got))
            assert slot is not None, f"row {r} col {c}: {got} is not a hot row of request {st}"
            assert int(state.slot_host_rows[st, slot]) == hb * B + pos % B, (r, c)


@pytest.mark.parametrize("backend", BACKENDS)
def test_keywords_place_results_and_count(backend, kernel_device):
    """``out`` receives the rows, the workspace holds the plan (same values as a plain call),
    ``counters`` accumulates the stats totals over a drifting trace."""
    dev = _device(backend, kernel_device)
    state = _case(1)
    plain = state.clone().to(dev)
    kept = state.clone().to(dev)
    state_rows = torch.tensor([2, -1, 0, 3], dtype=torch.int32)
    topk = make_topk(state, [2, -1, 0, 3], 24, seed=2, dup_frac=0.2)
    workspace = ops.ResolveWorkspace(dev)
    out = torch.full((4, 24), 7, dtype=torch.int32, device=dev)
    counters = torch.zeros(3, dtype=torch.int64, device=dev)
    total = torch.zeros(3, dtype=torch.int64)
    for step in range(3):
        want = _resolve(plain, topk, state_rows, backend)
        got = _resolve(kept, topk, state_rows, backend, out=out, workspace=workspace,
                       counters=counters)
        assert_result_equal(got, want, f"step {step}")
        assert got.rows is out
        bufs = workspace.last
        assert got.miss_src.data_ptr() == bufs.miss_src.data_ptr()
        assert got.stats.data_ptr() == bufs.stats.data_ptr()
        total += want.stats.cpu().sum(0).long()
        assert counters.cpu().tolist() == total.tolist()
        assert torch.equal(kept.lru, plain.lru) and torch.equal(kept.slot_host_rows,
                                                               plain.slot_host_rows)
        topk = drift_topk(topk, state, [2, -1, 0, 3], 10 + step)
    assert total[0] > 0 and total[1] > 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_workspace_is_reused_without_new_buffers(backend, kernel_device):
    dev = _device(backend, kernel_device)
    state = _case(3).to(dev)
    state_rows = torch.tensor([1, 0], dtype=torch.int32)
    topk = make_topk(state.to("cpu"), [1, 0], 24, seed=4)
    workspace = ops.ResolveWorkspace(dev, max_rows=4, width=32, slots=64)
    first = _resolve(state, topk, state_rows, backend, workspace=workspace)
    views = workspace.last
    second = _resolve(state, topk, state_rows, backend, workspace=workspace)
    assert workspace.last is views  # the shape's views were built once
    for a, b in zip(first, second):  # same storage: the first results are overwritten
        assert a.data_ptr() == b.data_ptr()
    assert "shapes=[(2, 24, 40)]" in repr(workspace)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", (torch.int8, torch.uint8, torch.int16, torch.int32,
                                   torch.int64, torch.uint32, torch.uint64))
def test_topk_any_integer_dtype_and_strides(backend, dtype, kernel_device):
    """Positions of any integer dtype and strides resolve in the kernel; values outside
    int32 (or negative) mask: they never wrap onto a valid position."""
    dev = _device(backend, kernel_device)
    state = _case(5)
    state_rows = torch.tensor([1, 3], dtype=torch.int32)
    wide = make_topk(state, [1, 3], 24, seed=6, invalid_frac=0.0).to(torch.int64)
    wide = wide.clamp(max=127 if dtype == torch.int8 else INT32_MAX)
    if dtype in (torch.int64, torch.uint64):  # would alias valid positions if truncated
        wide[0, :4] = torch.tensor([2**32 + 3, 2**32 + int(wide[0, 5]), 2**31, INT32_MAX])
    if dtype == torch.int64:
        wide[1, :3] = torch.tensor([-2**40, -1, 2**62])
    if dtype == torch.uint32:
        wide[0, :3] = torch.tensor([2**31, 2**32 - 1, 2**31 + int(wide[0, 5])])
    # Non-contiguous: every other column of a [R, 2K] buffer.
    buf = torch.zeros(2, 48, dtype=dtype)
    buf[:, ::2] = wide.to(dtype)
    if dtype == torch.uint64:  # beyond int64: reads as negative, masked too
        buf[1, 0] = torch.tensor(-5, dtype=torch.int64).view(torch.uint64)
    topk = buf[:, ::2]
    actual = topk.to(torch.int64)
    saturated = torch.where((actual < 0) | (actual > INT32_MAX), -1, actual).to(torch.int32)
    assert dtype not in (torch.int64, torch.uint64, torch.uint32) or saturated.eq(-1).any()
    want_state = state.clone()
    want = ref.resolve(saturated, state_rows, *want_state.args(), **want_state.kwargs())
    got_state = state.clone().to(dev)
    got = _resolve(got_state, topk, state_rows, backend)
    assert_result_equal(got, want, str(dtype))
    assert torch.equal(got_state.lru.cpu(), want_state.lru)
    assert torch.equal(got_state.slot_host_rows.cpu(), want_state.slot_host_rows)


@pytest.mark.parametrize("backend", BACKENDS)
def test_repeated_state_rows_resolve_once(backend, kernel_device):
    """A state row named by several batch rows is resolved by its first batch row only; the
    later ones are padding. Later correct calls then return rows that hold their positions."""
    dev = _device(backend, kernel_device)
    state = _case(7)
    names = [1, 0, 1, 3, 0, -1]
    as_padding = [1, 0, -1, 3, -1, -1]
    topk = make_topk(state, names, 24, seed=8, dup_frac=0.1)
    topk[2] = topk[0].flip(0)  # the repeated row asks for other columns
    got_state = state.clone().to(dev)
    want_state = state.clone().to(dev)
    got = _resolve(got_state, topk, torch.tensor(names, dtype=torch.int32), backend)
    want = _resolve(want_state, topk, torch.tensor(as_padding, dtype=torch.int32), backend)
    assert_result_equal(got, want, "repeated rows")
    assert got.rows[[2, 4]].eq(-1).all() and got.stats[[2, 4]].eq(0).all()
    assert got.miss_count[[2, 4]].eq(0).all()
    assert torch.equal(got_state.lru, want_state.lru)
    assert torch.equal(got_state.slot_host_rows, want_state.slot_host_rows)
    assert_rows_hold_their_positions(got_state.to("cpu"), topk, names, got.rows.cpu())
    rows = [0, 1, 2, 3]
    for step in range(3):  # later correct calls
        topk = drift_topk(topk[:4], state, rows, 30 + step, keep=0.5)
        out = _resolve(got_state, topk, torch.tensor(rows, dtype=torch.int32), backend)
        assert_rows_hold_their_positions(got_state.to("cpu"), topk, rows, out.rows.cpu())


@pytest.mark.parametrize("backend", BACKENDS)
def test_restore_undoes_a_resolve(backend, kernel_device):
    """resolve (with padding and a repeated state row), then restore: the state is exactly
    what it was; resolving again gives the first call's results (the failure path)."""
    dev = _device(backend, kernel_device)
    state = _case(9).to(dev)
    before = state.clone()
    names = torch.tensor([3, -1, 0, 3, 2], dtype=torch.int32, device=dev)
    topk = make_topk(state.to("cpu"), [3, -1, 0, 3, 2], 24, seed=10, dup_frac=0.1)
    workspace = ops.ResolveWorkspace(dev)
    first = [t.clone() for t in _resolve(state, topk, names, backend, workspace=workspace)]
    assert first[1].ne(-1).any()  # the call did plan misses
    assert not torch.equal(state.lru, before.lru)
    assert workspace.last.touched.cpu().tolist() == [1, 0, 1, 0, 1]
    ops.restore_resolve_state(workspace, names, state.slot_host_rows, state.lru)
    assert torch.equal(state.lru, before.lru)
    assert torch.equal(state.slot_host_rows, before.slot_host_rows)
    again = _resolve(state, topk, names, backend, workspace=workspace)
    for name, a, b in zip(ref.ResolveResult._fields, again, first):
        assert torch.equal(a, b), name


def test_restore_refuses_what_it_cannot_undo():
    state = _case(11)
    workspace = ops.ResolveWorkspace("cpu")
    names = torch.tensor([0, 1], dtype=torch.int32)
    with pytest.raises(ValueError, match="holds no resolve call"):
        ops.restore_resolve_state(workspace, names, state.slot_host_rows, state.lru)
    _resolve(state, make_topk(state, [0, 1], 24, seed=12), names, "torch", workspace=workspace)
    with pytest.raises(ValueError, match=r"state_rows must be the \[2\] tensor"):
        ops.restore_resolve_state(workspace, names[:1], state.slot_host_rows, state.lru)
    with pytest.raises(ValueError, match=r"lru must be int32 \[S, 40\]"):
        ops.restore_resolve_state(workspace, names, state.slot_host_rows, state.lru[:, :8])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("bad, match", [
    (dict(counters=torch.zeros(3, dtype=torch.int32)), "counters must be an int64 tensor"),
    (dict(counters=torch.zeros(4, dtype=torch.int64)), "counters must be an int64 tensor"),
    (dict(out=torch.zeros(2, 23, dtype=torch.int32)), r"out must be an int32 tensor \[2, 24\]"),
    (dict(out=torch.zeros(1, 24, dtype=torch.int32).expand(2, 24)), "stride-0"),
    (dict(workspace="scratch"), "workspace must be a ResolveWorkspace"),
    (dict(workspace=ops.ResolveWorkspace("meta")), "the workspace is on meta"),
])
def test_bad_keywords_raise_and_touch_nothing(backend, bad, match, kernel_device):
    dev = _device(backend, kernel_device)
    state = _case(13).to(dev)
    before = state.clone()
    bad = {k: (v.to(dev) if isinstance(v, torch.Tensor) else v) for k, v in bad.items()}
    topk = make_topk(state.to("cpu"), [0, 1], 24, seed=14)
    with pytest.raises((ValueError, TypeError), match=match):
        _resolve(state, topk, torch.tensor([0, 1], dtype=torch.int32), backend, **bad)
    assert torch.equal(state.lru, before.lru)
    assert torch.equal(state.slot_host_rows, before.slot_host_rows)


def test_traced_path_places_results_like_eager():
    """Under a dispatch mode (how torch.compile traces) ``ops.resolve`` goes through the
    registered op, then places results in ``out`` / the workspace / ``counters`` the same."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Passthrough(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    state = _case(15)
    eager_state, traced_state = state.clone(), state.clone()
    names = torch.tensor([2, 0, 2], dtype=torch.int32)
    topk = make_topk(state, [2, 0, 2], 24, seed=16)
    kws = [dict(workspace=ops.ResolveWorkspace("cpu"), out=torch.zeros(3, 24, dtype=torch.int32),
                counters=torch.zeros(3, dtype=torch.int64)) for _ in range(2)]
    want = _resolve(eager_state, topk, names, "torch", **kws[0])
    with Passthrough():
        assert not ops._eager((topk,))
        got = _resolve(traced_state, topk, names, "torch", **kws[1])
    assert_result_equal(got, want, "traced")
    assert torch.equal(kws[0]["counters"], kws[1]["counters"])
    for field in ("touched", "old_lru", "old_slot_rows"):
        assert torch.equal(getattr(kws[0]["workspace"].last, field)[[0, 1]],
                           getattr(kws[1]["workspace"].last, field)[[0, 1]]), field
    assert torch.equal(traced_state.lru, eager_state.lru)
