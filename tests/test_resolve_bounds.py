"""Every resolve kernel variant stays inside its buffers: top-k widths swept against hot-buffer
sizes, each tensor the launch touches (inputs, state, ``out``, ``counters``, the outputs and
every scratch table, the one-off buffers as well as a workspace's) placed between guard
regions filled with a sentinel, the guards checked after the call and the results checked
bit for bit against ``reference.resolve``.

The variants are those ``kernels.resolve.resolve_variants`` lists for the shape (``default``,
``hash`` where it applies, ``sorted``), at block sizes 1 and 64, power-of-two and other hot
sizes up to past ``HASH_MAX_SLOTS``. An out-of-bounds store lands in a guard (each guard is
wider than the widest tile, ``MAX_BLOCK_H``), so it fails an assertion rather than corrupt
the heap. Runs under ``TRITON_INTERPRET=1`` on CPU (conftest) and natively on CUDA.
"""

from __future__ import annotations

import pytest
import torch

from hisparse_triton import ops
from hisparse_triton.kernels import resolve as kres
from hisparse_triton.ops import ResolveWorkspace
from hisparse_triton.ops.resolve.contract import ResolveResult
from hisparse_triton.ops.resolve.workspace import HASH_EMPTY, HASH_MAX_SLOTS, ResolveBuffers
from test_resolve_reference import ResolveState, make_state, make_topk, run_reference

#: Guard elements on each side of every buffer: wider than any tile a kernel stores
#: (``MAX_BLOCK_H``, ``MAX_SORT_WIDTH``), a multiple of 16 (keeps the views 64-byte aligned).
GUARD = 4096
SENTINEL = {torch.int32: 0x5A5A5A5A, torch.int64: 0x5A5A5A5A5A5A5A5A}
#: The shapes and dtypes of one call's buffers (before a test replaces ``allocate``).
_ALLOCATE = ResolveWorkspace.allocate


class Guarded:
    """Tensors carved from the interior of sentinel-filled allocations."""

    def __init__(self) -> None:
        self.buffers: list[tuple[str, torch.Tensor, int]] = []

    def like(self, name: str, t: torch.Tensor, fill: int | None = None) -> torch.Tensor:
        """A contiguous copy of ``t`` (or a tensor of its shape filled with ``fill``; the
        sentinel by default) with ``GUARD`` sentinel elements on each side."""
        n = t.numel()
        big = torch.full((GUARD + n + GUARD,), SENTINEL[t.dtype], dtype=t.dtype,
                         device=t.device)
        view = big[GUARD:GUARD + n].view(t.shape)
        if fill is None:
            view.copy_(t)
        else:
            view.fill_(fill)
        self.buffers.append((name, big, n))
        return view

    def check(self, what: str) -> None:
        for name, big, n in self.buffers:
            s = SENTINEL[big.dtype]
            for side, guard in (("before", big[:GUARD]), ("after", big[GUARD + n:])):
                bad = (guard != s).nonzero().flatten()
                if bad.numel():
                    raise AssertionError(
                        f"{what}: {bad.numel()} elements written {side} {name} (first at "
                        f"guard offset {int(bad[0])} of {GUARD})")


def guarded_buffers(guards: Guarded, R: int, K: int, H: int, device: torch.device,
                    table_fill: int | None) -> ResolveBuffers:
    """The buffers of one call shape (shapes and dtypes of ``ResolveWorkspace.allocate``),
    each guarded; scratch filled with the sentinel (garbage), the hash table with
    ``table_fill`` (``HASH_EMPTY`` for a workspace, which keeps it clean; the sentinel for a
    one-off table, which the kernel clears itself)."""
    plain = _ALLOCATE(R, K, H, device)
    return ResolveBuffers(**{
        name: guards.like(name, t, table_fill if name == "table" else SENTINEL[t.dtype])
        for name, t in zip(ResolveBuffers._fields, plain)})


class GuardedWorkspace(ResolveWorkspace):
    """A workspace whose buffers are guarded (one call shape at a time)."""

    def __init__(self, device: torch.device, guards: Guarded) -> None:
        super().__init__(device)
        self._guards = guards
        self._shape: tuple[int, int, int] | None = None
        self._bufs: ResolveBuffers | None = None

    def buffers(self, rows: int, width: int, slots: int) -> ResolveBuffers:
        if self._shape != (rows, width, slots):
            self._shape = (rows, width, slots)
            self._bufs = guarded_buffers(self._guards, rows, width, slots, self.device,
                                         HASH_EMPTY)
        return self._bufs


def _state(K: int, H: int, B: int, host_blocks: int | None, seed: int) -> ResolveState:
    state = make_state(num_states=2, pages=(3 * K) // B + 2, hot_slots=H, block_size=B,
                       seed=seed, resident_frac=0.2, null_frac=0.05, prefill=True)
    if host_blocks is not None:  # a huge host pool (int64 host rows / sort keys)
        state.num_host_blocks = host_blocks
    return state


def run_guarded(device: torch.device, K: int, H: int, B: int, knobs: dict, *,
                workspace: bool, host_blocks: int | None = None, public: bool = False,
                seed: int = 0) -> None:
    """One call of shape ``(K, H, B)`` on ``device`` with every buffer guarded; compare with
    the reference. ``public``: through ``ops.resolve(backend="triton")`` (no knobs)."""
    state = _state(K, H, B, host_blocks, seed + K + H + B)
    state_rows = [1, -1, 0]  # a padding row between two resolved rows
    topk = make_topk(state, state_rows, K, seed + 7, invalid_frac=0.1, dup_frac=0.2)
    srows = torch.tensor(state_rows, dtype=torch.int32)
    ref = state.clone()
    want = run_reference(topk, srows, ref)
    guards = Guarded()
    kstate = ResolveState(*(guards.like(n, t.to(device)) for n, t in zip(
        ("seq_lens", "resident_blocks", "host_blocks", "hot_blocks", "slot_host_rows", "lru"),
        state.args())), B, state.num_device_blocks, state.num_host_blocks)
    inputs = [t.clone() for t in kstate.args()[:4]]
    g_topk = guards.like("topk", topk.to(device))
    g_rows = guards.like("state_rows", srows.to(device))
    out = guards.like("out", torch.empty(len(state_rows), K, dtype=torch.int32,
                                         device=device), fill=-7)
    counters = guards.like("counters", torch.zeros(3, dtype=torch.int64, device=device))
    ws = GuardedWorkspace(device, guards) if workspace else None
    what = f"K={K} H={H} B={B} {knobs or 'default'} workspace={workspace}"
    ResolveWorkspace.allocate = staticmethod(  # type: ignore[method-assign]
        lambda R, K_, H_, dev: guarded_buffers(guards, R, K_, H_, dev, None))
    try:
        call = ops.resolve if public else kres._resolve
        extra = dict(backend="triton") if public else knobs
        got = call(g_topk, g_rows, *kstate.args(), **kstate.kwargs(), counters=counters,
                   out=out, workspace=ws, **extra)
    finally:
        ResolveWorkspace.allocate = _ALLOCATE  # type: ignore[method-assign]
    guards.check(what)
    for name, a, b in zip(ResolveResult._fields, got, want):
        assert torch.equal(a.cpu(), b), f"{what}: {name} differs from the reference"
    assert torch.equal(kstate.slot_host_rows.cpu(), ref.slot_host_rows), f"{what}: slot rows"
    assert torch.equal(kstate.lru.cpu(), ref.lru), f"{what}: lru"
    assert torch.equal(counters.cpu(), want.stats.sum(0).to(torch.int64)), f"{what}: counters"
    for before, after in zip(inputs, kstate.args()[:4]):
        assert torch.equal(before, after), f"{what}: a read-only input was written"
    assert torch.equal(g_topk.cpu(), topk) and torch.equal(g_rows.cpu(), srows)
    if ws is not None and ws._bufs is not None:
        assert ws._bufs.table.eq(HASH_EMPTY).all(), f"{what}: hash table left dirty"


# (top-k, hot slots): small top-k against large hot buffers (the shapes that overran), equal
# sizes, non-power-of-two sizes, the hash kernel's limit and one past it (two H tiles).
SHAPES = [(1, 1), (16, 16), (16, 100), (16, 1024), (16, 1100), (33, 1024), (64, 2048),
          (100, 2049), (17, HASH_MAX_SLOTS), (16, HASH_MAX_SLOTS + 1)]


@pytest.mark.parametrize("B", [1, 64])
@pytest.mark.parametrize("K, H", SHAPES)
def test_every_variant_stays_in_bounds(K: int, H: int, B: int, kernel_device: torch.device
                                       ) -> None:
    state = _state(K, H, B, None, 0)
    variants = kres.resolve_variants(K, H, B, state.num_host_blocks)
    assert ("hash" in variants) == (H <= HASH_MAX_SLOTS)
    # "default" is the launch of one of the others (the shape's dispatch): run each once
    default = kres._launch(K, H, B, state.num_host_blocks, True)
    assert default == kres._launch(K, H, B, state.num_host_blocks, True, variant=default.variant)
    for name, knobs in variants.items():
        if name == "default":
            continue
        for workspace in (False, True):
            run_guarded(kernel_device, K, H, B, knobs, workspace=workspace)


@pytest.mark.parametrize("K, H", [(16, 1024), (16, 1100), (64, 2048)])
def test_public_op_small_topk_large_hot_buffer(K: int, H: int, kernel_device: torch.device
                                               ) -> None:
    """The reported calls: ``ops.resolve`` on the triton backend, block size 1, no workspace."""
    run_guarded(kernel_device, K, H, 1, {}, workspace=False, public=True)


@pytest.mark.parametrize("K, H, B", [(16, 1100, 1), (33, 200, 64)])
def test_knobbed_paths_stay_in_bounds(K: int, H: int, B: int, kernel_device: torch.device
                                      ) -> None:
    """Paths a shape reaches only with another host pool or a knob, under guards: the sorted
    kernel's int64 keys (a host pool whose sort keys pass int32), its merge passes
    (``sort_width`` below the top-k width), and the hash kernel's in-launch sorted fallback
    (``hash_mul=0``: every key collides; ``probes=2``: the rows overflow)."""
    host_blocks = 2**30 // B
    assert kres._launch(K, H, B, host_blocks, True, variant="sorted").key64
    for workspace in (False, True):
        run_guarded(kernel_device, K, H, B, dict(variant="sorted"), workspace=workspace,
                    host_blocks=host_blocks)
        run_guarded(kernel_device, K, H, B, dict(sort_width=16), workspace=workspace)
        run_guarded(kernel_device, K, H, B, dict(variant="hash", hash_mul=0, probes=2),
                    workspace=workspace)


def test_dispatch_rule_as_documented() -> None:
    """docs/resolve.md and the ``kernels/resolve.py`` docstring state the rule: ``hash`` when
    ``K <= 2048 and H <= 4096 and num_host_blocks * block_size < 2**31 - 1``, else
    ``sorted``; int64 sort keys when ``(host rows + 1) * W > 2**31``; registers when
    ``W <= 2048``; ``min(next_pow2(max(H, 16)), 4096)`` positions per step."""
    for K in (1, 16, 2047, 2048, 2049, 4096):
        for H in (K, 4095, 4096, 4097, 9000):
            if H < K:
                continue
            for B, nhb in ((1, 100), (64, 1000), (1, 2**31 - 2), (1, 2**31 - 1),
                           (64, (2**31 - 1) // 64), (2, 2**30 - 1)):
                rule = K <= 2048 and H <= 4096 and nhb * B < 2**31 - 1
                launch = kres._launch(K, H, B, nhb, True)
                what = f"K={K} H={H} B={B} host blocks {nhb}"
                assert launch.variant == ("hash" if rule else "sorted"), what
                assert ("hash" in kres.resolve_variants(K, H, B, nhb)) == rule, what
                W = max(16, 1 << (K - 1).bit_length())
                assert launch.block_k == W and launch.key64 == ((nhb * B + 1) * W > 2**31)
                assert launch.in_regs == (W <= 2048), what
                assert launch.block_h == min(max(16, 1 << (H - 1).bit_length()), 4096), what
                assert kres._launch(K, H, B, nhb, True, block_h=16).variant == "sorted"
