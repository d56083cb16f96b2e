"""The ``prefill`` op family: ``plan_prefill``'s reference against a per-column loop, the
Triton kernels bit-exact against the reference (rows, staging plan, counts), the staged
bytes of ``stage_prefill`` on both backends, the custom op, and the argument rules.

The kernels run under ``TRITON_INTERPRET=1`` on CPU (conftest) and natively on CUDA.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from hisparse_triton import ops
from hisparse_triton.kernels import prefill as kprefill
from hisparse_triton.ops.prefill import reference
from hisparse_triton.ops.prefill.workspace import RANK_TILE, ROW_MARK, PrefillWorkspace
from hisparse_triton.row_table import RowTable

HAS_CUDA = torch.cuda.is_available()


@dataclass
class Chunk:
    """A prefill chunk over random request tables (``S`` requests of ``P`` pages)."""

    topk: torch.Tensor
    state_rows: torch.Tensor
    seq_lens: torch.Tensor
    resident: torch.Tensor
    host: torch.Tensor
    block_size: int
    num_device_blocks: int
    num_host_blocks: int

    def args(self, device: torch.device | str = "cpu") -> tuple:
        return tuple(t.to(device) for t in (self.topk, self.state_rows, self.seq_lens,
                                            self.resident, self.host))

    def sizes(self, first_row: int, capacity: int) -> dict:
        return dict(block_size=self.block_size, num_device_blocks=self.num_device_blocks,
                    num_host_blocks=self.num_host_blocks, staging_first_row=first_row,
                    staging_rows=capacity)


def make_chunk(seed: int, *, S: int = 3, P: int = 6, B: int = 4, T: int = 7, K: int = 9,
               num_device_blocks: int = 64, num_host_blocks: int = 40,
               resident_frac: float = 0.3, shared_pages: int = 2, corrupt: bool = False,
               dtype: torch.dtype = torch.int64) -> Chunk:
    """Random tables: some pages resident, the rest on the host; requests 0 and 1 share
    their first ``shared_pages`` host blocks (a shared prefix); ``corrupt`` puts
    out-of-range block ids in the tables. ``topk`` has positions in and out of range."""
    g = torch.Generator().manual_seed(seed)
    seq = torch.randint(1, P * B + 1, (S,), generator=g, dtype=torch.int32)
    host = torch.randint(1, num_host_blocks, (S, P), generator=g, dtype=torch.int32)
    resident = torch.randint(1, num_device_blocks, (S, P), generator=g, dtype=torch.int32)
    resident *= (torch.rand(S, P, generator=g) < resident_frac)
    if S > 1 and shared_pages:
        host[1, :shared_pages] = host[0, :shared_pages]
        resident[1, :shared_pages] = 0
    if corrupt:
        host[0, 0] = num_host_blocks + 3
        host[-1, -1] = -5
        resident[0, 1] = num_device_blocks + 1
        resident[-1, 0] = -2
    state_rows = torch.randint(-1, S + 1, (T,), generator=g, dtype=torch.int32)
    low = -3 if dtype.is_signed else 0
    high = min(P * B + 4, torch.iinfo(dtype).max)
    topk = torch.randint(low, high, (T, K), generator=g).to(dtype)
    return Chunk(topk, state_rows, seq, resident, host, B, num_device_blocks, num_host_blocks)


def loop_plan(chunk: Chunk, first_row: int, capacity: int):
    """``plan_prefill`` column by column, written from its docstring."""
    B = chunk.block_size
    S, P = chunk.resident.shape
    kinds = []
    for t, st in enumerate(chunk.state_rows.tolist()):
        row = []
        for pos in chunk.topk[t].tolist():
            if not 0 <= st < S or pos < 0 or pos >= int(chunk.seq_lens[st]) or pos // B >= P:
                row.append(("masked", None))
                continue
            page, off = divmod(pos, B)
            rb, hb = int(chunk.resident[st, page]), int(chunk.host[st, page])
            if 1 <= rb < chunk.num_device_blocks:
                row.append(("resident", rb * B + off))
            elif 1 <= hb < chunk.num_host_blocks:
                row.append(("host", hb * B + off))
            else:
                row.append(("masked", None))
        kinds.append(row)
    distinct = sorted({v for row in kinds for kind, v in row if kind == "host"})
    rank = {g: r for r, g in enumerate(distinct)}
    rows = [[v if kind == "resident" else
             (first_row + rank[v] if kind == "host" and rank[v] < capacity else -1)
             for kind, v in row] for row in kinds]
    return rows, distinct


def assert_plans_equal(got, want, what: str = "") -> None:
    for name, g, w in zip(got._fields, got, want):
        assert torch.equal(g.cpu(), w.cpu()), f"{what} {name}: {g} != {w}"


# ---------------------------------------------------------------------- the reference


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("capacity", (0, 5, 200))
def test_reference_matches_the_column_loop(seed: int, capacity: int) -> None:
    chunk = make_chunk(seed, corrupt=seed % 2 == 1)
    first = 40 * chunk.block_size
    plan = reference.plan_prefill(*chunk.args(), **chunk.sizes(first, min(capacity, 96)))
    capacity = min(capacity, 96)
    rows, distinct = loop_plan(chunk, first, capacity)
    assert plan.rows.tolist() == rows
    staged = min(len(distinct), capacity)
    assert plan.needed.tolist() == [len(distinct)] and plan.staged.tolist() == [staged]
    assert plan.src_rows.tolist() == [distinct[:staged] + [-1] * (capacity - staged)]
    assert plan.dst_rows.tolist() == [list(range(first, first + capacity))]


def test_a_host_row_two_requests_share_is_staged_once() -> None:
    B = 4
    host = torch.tensor([[5, 6], [5, 7]], dtype=torch.int32)
    chunk = Chunk(topk=torch.tensor([[0, 1, 5], [0, 1, 5]]), state_rows=torch.tensor(
        [0, 1], dtype=torch.int32), seq_lens=torch.tensor([8, 8], dtype=torch.int32),
        resident=torch.zeros(2, 2, dtype=torch.int32), host=host, block_size=B,
        num_device_blocks=16, num_host_blocks=8)
    plan = reference.plan_prefill(*chunk.args(), **chunk.sizes(48, 8))
    # host rows 20, 21 (shared page 5), 25 (request 0's page 6), 29 (request 1's page 7)
    assert plan.src_rows[0, :4].tolist() == [20, 21, 25, 29]
    assert plan.rows.tolist() == [[48, 49, 50], [48, 49, 51]]
    assert plan.needed.tolist() == [4]


def test_overflowing_columns_are_masked_and_counted() -> None:
    chunk = make_chunk(3, resident_frac=0.0, shared_pages=0)
    full = reference.plan_prefill(*chunk.args(), **chunk.sizes(0, 256))
    needed = int(full.needed)
    assert needed > 4
    small = reference.plan_prefill(*chunk.args(), **chunk.sizes(0, 4))
    assert small.needed.tolist() == [needed] and small.staged.tolist() == [4]
    kept = (full.rows >= 0) & (full.rows < 4)
    assert torch.equal(small.rows[kept], full.rows[kept])
    assert bool((small.rows[(full.rows >= 4)] == -1).all())


# ---------------------------------------------------------------------- the kernels


def _kernel_vs_reference(chunk: Chunk, device, first: int, capacity: int,
                         workspace: PrefillWorkspace | None = None, what: str = ""):
    want = reference.plan_prefill(*chunk.args(), **chunk.sizes(first, capacity))
    got = kprefill.plan_prefill(*chunk.args(device), **chunk.sizes(first, capacity),
                                workspace=workspace)
    assert_plans_equal(got, want, what)
    return got


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("capacity", (0, 7, 160))
def test_kernels_match_the_reference(seed: int, capacity: int, kernel_device) -> None:
    chunk = make_chunk(seed, corrupt=seed == 3)
    _kernel_vs_reference(chunk, kernel_device, 20 * chunk.block_size, capacity)


@pytest.mark.parametrize("dtype", (torch.int8, torch.uint8, torch.int16, torch.int32,
                                   torch.uint32, torch.uint64))
def test_kernels_accept_every_integer_dtype(dtype: torch.dtype, kernel_device) -> None:
    chunk = make_chunk(11, dtype=dtype)
    if dtype in (torch.int64, torch.uint64):
        chunk.topk[0, :2] = torch.tensor([2**40, 2**63 - 1]).to(dtype)
    _kernel_vs_reference(chunk, kernel_device, 0, 64, what=str(dtype))


def test_a_reused_workspace_stays_exact_across_chunks(kernel_device) -> None:
    """Ranks of earlier calls stay in the row table: later chunks must never see them."""
    chunk0 = make_chunk(20)
    ws = PrefillWorkspace(kernel_device, num_host_rows=chunk0.num_host_blocks * 4,
                          capacity_rows=24, first_row=120)
    for i in range(5):
        chunk = make_chunk(20 + i, T=3 + i, K=5 + 2 * i)
        got = _kernel_vs_reference(chunk, kernel_device, 120, 24, ws, what=f"chunk {i}")
        assert got.rows.data_ptr() == ws.rows(3 + i, 5 + 2 * i).data_ptr()
        assert not bool((ws.row_rank == ROW_MARK).any())


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("capacity", (0, 6, 40))
def test_a_staging_map_places_staged_rows_anywhere(seed: int, capacity: int,
                                                   kernel_device) -> None:
    """With ``map_staging`` staging row ``i`` is device row ``map[i]`` (blocks borrowed
    from the pool, in any order): the kernels match the reference bit for bit, and both
    equal the consecutive-region plan with every staged row sent through the map."""
    chunk = make_chunk(30 + seed)
    g = torch.Generator().manual_seed(seed)
    mapping = (torch.randperm(chunk.num_device_blocks * chunk.block_size, generator=g)
               [:capacity].to(torch.int32))
    plans = []
    for device in ("cpu", kernel_device):
        ws = PrefillWorkspace(device, num_host_rows=chunk.num_host_blocks * 4,
                              capacity_rows=3, first_row=8)
        ws.map_staging(mapping.to(device))
        assert ws.mapped and (ws.capacity_rows, ws.first_row) == (capacity, 0)
        run = reference.plan_prefill if device == "cpu" else kprefill.plan_prefill
        plans.append(run(*chunk.args(device), **chunk.sizes(0, capacity), workspace=ws))
    assert_plans_equal(plans[1], plans[0], "mapped")
    # The staged columns are those whose row moves with the region's first row.
    at_0 = reference.plan_prefill(*chunk.args(), **chunk.sizes(0, capacity)).rows
    at_c = reference.plan_prefill(*chunk.args(), **chunk.sizes(capacity, capacity)).rows
    staged = at_0 != at_c
    assert bool(staged.any()) == bool(capacity)
    expect = at_0.clone()
    expect[staged] = mapping[at_0[staged].long()]
    assert torch.equal(plans[0].rows, expect)
    assert plans[0].dst_rows.tolist() == [mapping.tolist()]


def test_a_host_pool_of_several_scan_tiles(kernel_device) -> None:
    B = 16
    blocks = -(-2 * RANK_TILE // B) + 40         # > 2 tiles of host rows
    chunk = make_chunk(7, S=2, P=(blocks - 2) // 2, B=B, T=4, K=40, num_host_blocks=blocks,
                       num_device_blocks=8, resident_frac=0.0, shared_pages=0)
    # spread the selections over the whole history so every tile holds marked rows
    chunk.seq_lens[:] = chunk.resident.shape[1] * B
    g = torch.Generator().manual_seed(1)
    chunk.topk = torch.randint(0, chunk.resident.shape[1] * B, (4, 40), generator=g)
    chunk.host = torch.arange(1, blocks - 1, dtype=torch.int32)[
        torch.randperm(blocks - 2, generator=g)[:chunk.host.numel()]].view(chunk.host.shape)
    _kernel_vs_reference(chunk, kernel_device, 0, 100)


def test_wide_rows_and_strided_topk(kernel_device) -> None:
    chunk = make_chunk(5, T=2, K=kprefill.MAX_BLOCK_K + 7, P=300, num_host_blocks=400,
                       num_device_blocks=400)
    wide = chunk.topk
    chunk.topk = torch.zeros(wide.shape[1], wide.shape[0], dtype=wide.dtype).t()
    chunk.topk.copy_(wide)                      # column-major strides
    assert not chunk.topk.is_contiguous()
    _kernel_vs_reference(chunk, kernel_device, 0, 300)


def test_an_empty_chunk_writes_zero_counts(kernel_device) -> None:
    chunk = make_chunk(1, T=0)
    got = _kernel_vs_reference(chunk, kernel_device, 0, 8)
    assert got.rows.shape == (0, 9) and got.needed.tolist() == [0]


def test_a_failed_launch_leaves_no_marks(monkeypatch) -> None:
    chunk = make_chunk(2)
    ws = PrefillWorkspace("cpu", num_host_rows=chunk.num_host_blocks * 4, capacity_rows=8,
                          first_row=0)

    def broken(*args, **kwargs):
        raise RuntimeError("launch failed")

    class Broken:
        def __getitem__(self, grid):
            return broken

    monkeypatch.setattr(kprefill, "_prefill_rank_kernel", Broken())
    with pytest.raises(RuntimeError, match="launch failed"):
        kprefill.plan_prefill(*chunk.args(), **chunk.sizes(0, 8), workspace=ws)
    assert not bool((ws.row_rank == ROW_MARK).any())


# ---------------------------------------------------------------------- staged bytes


def _pools(num_device_blocks: int, num_host_blocks: int, B: int, row_bytes: int,
           layers: int, device):
    """A device table of ``layers`` layers interleaved in blocks, a contiguous host table."""
    g = torch.Generator().manual_seed(9)
    block_stride = layers * B * row_bytes + 16
    device_pool = torch.randint(0, 256, (num_device_blocks * block_stride,), generator=g,
                                dtype=torch.uint8).to(device)
    host_pool = torch.randint(0, 256, (layers * num_host_blocks * B * row_bytes,), generator=g,
                              dtype=torch.uint8)
    dev_table = RowTable.build(device_pool, [l * B * row_bytes for l in range(layers)],
                               row_bytes=row_bytes, block_size=B, block_stride=block_stride,
                               num_rows=num_device_blocks * B, device=device)
    host_table = RowTable.build(host_pool, [l * num_host_blocks * B * row_bytes
                                            for l in range(layers)], row_bytes=row_bytes,
                                block_size=B, block_stride=B * row_bytes,
                                num_rows=num_host_blocks * B, device=device)
    return dev_table, host_table


@pytest.mark.parametrize("backend", ("torch", "triton"))
def test_stage_prefill_reads_every_column_right_for_every_layer(backend,
                                                                kernel_device) -> None:
    chunk = make_chunk(4, num_device_blocks=64)
    B, first, capacity = chunk.block_size, 48 * 4, 64
    device = kernel_device if backend == "triton" else torch.device("cpu")
    dev_table, host_table = _pools(64, chunk.num_host_blocks, B, 16, 3, device)
    before = dev_table.pool.clone()
    plan = ops.stage_prefill(dev_table, host_table, *chunk.args(device),
                             **chunk.sizes(first, capacity), backend=backend)
    rows, _ = loop_plan(chunk, first, capacity)
    kinds = loop_plan(chunk, -10**6, 10**6)[0]        # staged columns show as negative
    for t, row in enumerate(rows):
        for j, r in enumerate(row):
            assert int(plan.rows[t, j]) == r
            if r < 0:
                continue
            for layer in range(3):
                got = dev_table.row_view(layer).reshape(-1, 16)[r].cpu()
                if kinds[t][j] < 0:   # staged: the host row's bytes
                    src = int(plan.src_rows[0, r - first])
                    want = host_table.row_view(layer).reshape(-1, 16)[src]
                else:                 # in place: untouched
                    want = before[dev_table.offsets[layer] + (r // B) * dev_table.block_stride
                                  + (r % B) * 16:][:16].cpu()
                assert torch.equal(got, want), (t, j, layer)
    # only staging rows were written
    staged_bytes = torch.zeros_like(before, dtype=torch.bool)
    for layer in range(3):
        for i in range(int(plan.staged)):
            r = first + i
            at = dev_table.offsets[layer] + (r // B) * dev_table.block_stride + (r % B) * 16
            staged_bytes[at:at + 16] = True
    untouched = ~staged_bytes.cpu()
    assert torch.equal(dev_table.pool.cpu()[untouched], before.cpu()[untouched])


def test_stage_prefill_pools_agree_on_both_backends(kernel_device) -> None:
    chunk = make_chunk(8, num_device_blocks=64)
    results = []
    for backend, device in (("torch", torch.device("cpu")), ("triton", kernel_device)):
        dev_table, host_table = _pools(64, chunk.num_host_blocks, 4, 16, 2, device)
        ops.stage_prefill(dev_table, host_table, *chunk.args(device), **chunk.sizes(160, 80),
                          backend=backend)
        results.append(dev_table.pool.cpu())
    assert torch.equal(*results)


# ---------------------------------------------------------------------- op layer


def test_plan_prefill_op_passes_opcheck() -> None:
    chunk = make_chunk(6)
    sizes = chunk.sizes(40, 12)
    torch.library.opcheck(torch.ops.hisparse_triton.plan_prefill.default,
                          (*chunk.args(), *sizes.values()))


@pytest.mark.parametrize("backend", ("auto", "torch", "triton"))
def test_plan_prefill_matches_reference_on_every_backend(backend, kernel_device) -> None:
    chunk = make_chunk(9)
    want = reference.plan_prefill(*chunk.args(), **chunk.sizes(32, 10))
    got = ops.plan_prefill(*chunk.args(kernel_device), **chunk.sizes(32, 10), backend=backend)
    assert_plans_equal(got, want)


def test_plan_prefill_compiles_without_graph_breaks() -> None:
    chunk = make_chunk(10)
    sizes = chunk.sizes(32, 10)

    def step(topk, state_rows, seq_lens, resident, host):
        plan = ops.plan_prefill(topk, state_rows, seq_lens, resident, host, **sizes)
        return plan.rows, plan.needed

    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    rows, needed = compiled(*chunk.args())
    want = reference.plan_prefill(*chunk.args(), **sizes)
    assert torch.equal(rows, want.rows) and torch.equal(needed, want.needed)


def test_the_launcher_reads_no_tensor_values(monkeypatch) -> None:
    from lab.launches import record_launches
    from test_ops import _SYNCING

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    chunk = make_chunk(12)
    ws = PrefillWorkspace("cpu", num_host_rows=chunk.num_host_blocks * 4, capacity_rows=16,
                          first_row=0)
    with record_launches() as launched:
        ops.plan_prefill(*chunk.args(), **chunk.sizes(0, 16), workspace=ws, backend="triton")

        def refuse(self, *args, **kwargs):
            raise AssertionError("the launcher read a tensor value on the host")

        for name in _SYNCING:
            monkeypatch.setattr(torch.Tensor, name, refuse)
        monkeypatch.setattr(torch, "nonzero", refuse)
        launched.clear()
        ops.plan_prefill(*chunk.args(), **chunk.sizes(0, 16), workspace=ws, backend="triton")
    assert len(launched) == 4   # columns, count, rank, map


# ---------------------------------------------------------------------- argument rules


@pytest.mark.parametrize("mutate, match", [
    (lambda a, s: a.__setitem__(0, a[0].float()), "topk must be an integer tensor"),
    (lambda a, s: a.__setitem__(1, a[1].long()), "state_rows must be int32"),
    (lambda a, s: a.__setitem__(1, a[1][:-1]), r"state_rows has shape \(6,\)"),
    (lambda a, s: a.__setitem__(4, a[4][:, :-1]), "host_blocks has shape"),
    (lambda a, s: a.__setitem__(0, a[0][:, :0]), "at least one column"),
    (lambda a, s: s.__setitem__("staging_rows", 10**6), "lie outside the 256 device rows"),
    (lambda a, s: s.__setitem__("staging_first_row", -1), "staging_first_row must be"),
    (lambda a, s: s.__setitem__("block_size", 0), "block_size must be"),
])
def test_bad_arguments_are_refused_by_both_implementations(mutate, match) -> None:
    chunk = make_chunk(0)
    for plan_prefill in (reference.plan_prefill, kprefill.plan_prefill):
        args, sizes = list(chunk.args()), chunk.sizes(0, 8)
        mutate(args, sizes)
        with pytest.raises((TypeError, ValueError), match=match):
            plan_prefill(*args, **sizes)


def test_a_workspace_of_another_plan_is_refused() -> None:
    chunk = make_chunk(0)
    ws = PrefillWorkspace("cpu", num_host_rows=chunk.num_host_blocks * 4, capacity_rows=9,
                          first_row=0)
    for plan_prefill in (reference.plan_prefill, kprefill.plan_prefill):
        with pytest.raises(ValueError, match="was not built for"):
            plan_prefill(*chunk.args(), **chunk.sizes(0, 8), workspace=ws)


@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_plan_prefill_captures_in_a_cuda_graph() -> None:
    chunk = make_chunk(13)
    dev = torch.device("cuda")
    args = chunk.args(dev)
    ws = PrefillWorkspace(dev, num_host_rows=chunk.num_host_blocks * 4, capacity_rows=32,
                          first_row=0)
    kprefill.plan_prefill(*args, **chunk.sizes(0, 32), workspace=ws)   # compile first
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        plan = kprefill.plan_prefill(*args, **chunk.sizes(0, 32), workspace=ws)
    graph.replay()
    want = reference.plan_prefill(*chunk.args(), **chunk.sizes(0, 32))
    assert_plans_equal(plan, want)
