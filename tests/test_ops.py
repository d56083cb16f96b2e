"""hisparse_triton.ops: backend selection, dispatch, custom-op registration (opcheck, compile)."""

from __future__ import annotations

import pytest
import torch

from hisparse_triton import ops
from hisparse_triton.ops.copy import op as copy_op
from hisparse_triton.ops.resolve import op as resolve_op
from hisparse_triton.ops.resolve import reference as ref
from hisparse_triton.row_table import RowTable
from hisparse_triton.kernels import backup, gather
from test_copy_reference import make_table, random_plan, run_copy, run_reference, with_pool

HAS_CUDA = torch.cuda.is_available()
CPU, CUDA = torch.device("cpu"), torch.device("cuda")


@pytest.fixture(autouse=True)
def _no_backend_env(monkeypatch):
    monkeypatch.delenv(ops.ENV_VAR, raising=False)


@pytest.fixture
def launches(monkeypatch):
    """Counts calls of the Triton copy launchers (the real ones still run)."""
    calls: list[str] = []
    for module, name in ((gather, "gather_rows"), (gather, "restore_pages"),
                         (backup, "backup_rows"), (backup, "spill_pages")):
        real = getattr(module, name)

        def spy(*args, _real=real, _name=name, **kwargs):
            calls.append(_name)
            return _real(*args, **kwargs)

        monkeypatch.setattr(module, name, spy)
    return calls


def _case(pages: bool = False, mode: str = "per_layer", device=CPU):
    src = make_table(2, 132, 5, layout="host", seed=1, device=device)
    dst = make_table(2, 132, 4, layout="device", seed=2, device=device)
    lim_s, lim_d = (src.num_blocks, dst.num_blocks) if pages else (src.num_rows, dst.num_rows)
    s, d, c = random_plan(2, 2, 3, lim_s, lim_d, mode=mode, seed=3, device=device)
    return dst, src, s, d, c


# ---------------------------------------------------------------------- backend selection


@pytest.mark.parametrize("backend,device,interp,want", [
    ("auto", CPU, "1", "torch"), ("auto", CUDA, "0", "triton"), ("torch", CPU, "1", "torch"),
    ("torch", CUDA, "0", "torch"), ("triton", CPU, "1", "triton"), ("triton", CUDA, "0", "triton"),
    (None, CPU, "0", "torch"), (None, CUDA, "0", "triton"),
])
def test_select_backend(monkeypatch, backend, device, interp, want):
    monkeypatch.setenv("TRITON_INTERPRET", interp)
    assert ops.select_backend(backend, device) == want


def test_env_var_picks_the_backend(monkeypatch):
    monkeypatch.setenv(ops.ENV_VAR, "torch")
    assert ops.select_backend(None, CUDA) == "torch"
    monkeypatch.setenv(ops.ENV_VAR, "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert ops.select_backend(None, CPU) == "triton"
    assert ops.select_backend("auto", CPU) == "torch"  # an explicit argument wins
    monkeypatch.setenv(ops.ENV_VAR, "cuda")
    with pytest.raises(ValueError, match=r"\$HISPARSE_TRITON_BACKEND='cuda'"):
        ops.select_backend(None, CPU)


def test_unknown_backend_is_refused():
    with pytest.raises(ValueError, match="'fast' is not a backend"):
        ops.select_backend("fast", CPU)


def test_triton_without_cuda_or_interpreter_raises_and_copies_nothing(monkeypatch, launches):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    dst, src, s, d, c = _case()
    before = dst.pool.clone()
    with pytest.raises(ops.BackendUnavailableError, match="TRITON_INTERPRET=1"):
        ops.copy_rows(dst, src, s, d, c, backend="triton")
    monkeypatch.setenv(ops.ENV_VAR, "triton")
    with pytest.raises(ops.BackendUnavailableError):
        ops.copy_pages(dst, src, s, d, c)
    assert torch.equal(dst.pool, before) and launches == []


# ---------------------------------------------------------------------- dispatch


@pytest.mark.parametrize("pages", (False, True))
@pytest.mark.parametrize("backend", ("auto", "torch", "triton", None))
def test_copy_ops_match_reference_on_every_backend(kernel_device, launches, pages, backend):
    dst, src, s, d, c = _case(pages, device=kernel_device)
    out = run_copy(ops.copy_pages if pages else ops.copy_rows, dst, src, s, d, c,
                   backend=backend)
    assert torch.equal(out, run_reference(dst, src, s, d, c, pages=pages))
    ran_triton = kernel_device.type == "cuda" and backend != "torch" or backend == "triton"
    assert launches == ([("restore_pages" if pages else "gather_rows")] if ran_triton else [])


def test_env_var_routes_to_the_interpreted_kernel(monkeypatch, launches):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv(ops.ENV_VAR, "triton")
    dst, src, s, d, c = _case()
    out = run_copy(ops.copy_rows, dst, src, s, d, c)
    assert torch.equal(out, run_reference(dst, src, s, d, c, pages=False))
    assert launches == ["gather_rows"]


def test_validate_table_reports_alignment_and_refuses_a_bad_table():
    table = make_table(2, 132, 3, lead=4, gap=16)
    assert ops.validate_table(table) == 4
    with pytest.raises(ValueError, match="layer 1"):  # refused when built, by value
        RowTable(table.pool, torch.tensor([0, table.pool.numel()]), 132, 4, 528, 12)


# ---------------------------------------------------------------------- custom ops


@pytest.mark.parametrize("pages", (False, True))
@pytest.mark.parametrize("mode,with_counts", [("shared", True), ("per_layer", False)])
def test_copy_ops_pass_opcheck(pages, mode, with_counts):
    dst, src, s, d, c = _case(pages, mode)
    op = torch.ops.hisparse_triton.copy_pages if pages else torch.ops.hisparse_triton.copy_rows
    args = (*ops._flat(dst), *ops._flat(src), s, d, c if with_counts else None)
    torch.library.opcheck(op.default, args)


def test_copy_rows_compiles_without_graph_breaks():
    dst, src, s, d, c = _case()

    def step(pool, s, d, c):
        ops.copy_rows(with_pool(dst, pool), src, s, d, c)
        return pool

    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    out = compiled(dst.pool.clone(), s, d, c)
    assert torch.equal(out, run_reference(dst, src, s, d, c, pages=False))


def _resolve_case():
    from test_resolve_reference import make_state, make_topk

    state = make_state(num_states=3, pages=4, hot_slots=8, block_size=4, seed=5)
    state_rows = [2, -1, 0]
    topk = make_topk(state, state_rows, 5, seed=6)
    return topk, torch.tensor(state_rows, dtype=torch.int32), state


def test_resolve_op_passes_opcheck():
    topk, state_rows, state = _resolve_case()
    torch.library.opcheck(torch.ops.hisparse_triton.resolve.default,
                          (topk, state_rows, *state.args()), state.kwargs())


@pytest.mark.parametrize("backend", ("auto", "torch", "triton"))
def test_resolve_matches_reference_on_every_backend(kernel_device, monkeypatch, backend):
    topk, state_rows, state = _resolve_case()
    want_state = state.clone()
    want = ref.resolve(topk, state_rows, *want_state.args(), **want_state.kwargs())
    import hisparse_triton.kernels.resolve as kres

    calls = []
    real = kres.resolve
    monkeypatch.setattr(kres, "resolve", lambda *a, **k: calls.append(1) or real(*a, **k))
    dev_state = state.to(kernel_device)
    got = ops.resolve(topk.to(kernel_device), state_rows.to(kernel_device), *dev_state.args(),
                      **dev_state.kwargs(), backend=backend)
    assert isinstance(got, ref.ResolveResult)
    for name, g, w in zip(got._fields, got, want):
        assert torch.equal(g.cpu(), w), name
    assert torch.equal(dev_state.slot_host_rows.cpu(), want_state.slot_host_rows)
    assert torch.equal(dev_state.lru.cpu(), want_state.lru)
    ran_triton = backend == "triton" or (backend == "auto" and kernel_device.type == "cuda")
    assert calls == ([1] if ran_triton else [])


# ---------------------------------------------------------------------- host cost / graphs


_SYNCING = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "nonzero",
            "cpu", "numpy")


def test_triton_launchers_read_no_tensor_values(monkeypatch):
    """After a table's first use, the copy launcher and the resolve launcher never read a
    tensor value on the host (no ``.item()``, ``.tolist()``, ``bool(tensor)``, ``nonzero``,
    ...): on CUDA they neither synchronise nor break a CUDA-graph capture."""
    from lab.launches import record_launches

    monkeypatch.setenv("TRITON_INTERPRET", "1")  # CPU tensors stand in for CUDA ones
    dst, src, s, d, c = _case()
    topk, state_rows, state = _resolve_case()
    workspace = ops.ResolveWorkspace("cpu")
    counters = torch.zeros(3, dtype=torch.int64)
    with record_launches() as launched:
        ops.copy_rows(dst, src, s, d, c, backend="triton")  # first use of the tables
        ops.resolve(topk, state_rows, *state.args(), **state.kwargs(), backend="triton",
                    workspace=workspace, counters=counters)  # first use of the workspace

        def refuse(self, *args, **kwargs):
            raise AssertionError("a launcher read a tensor value on the host")

        for name in _SYNCING:
            monkeypatch.setattr(torch.Tensor, name, refuse)
        monkeypatch.setattr(torch, "nonzero", refuse)
        launched.clear()
        ops.copy_rows(dst, src, s, d, c, backend="triton")
        ops.copy_pages(dst, src, s.clamp(max=1), d.clamp(max=1), c, backend="triton")
        ops.resolve(topk, state_rows, *state.args(), **state.kwargs(), backend="triton")
        ops.resolve(topk.long(), state_rows, *state.args(), **state.kwargs(), backend="triton",
                    workspace=workspace, counters=counters)
    assert len(launched) == 1 + 1 + 2 + 2  # each hash resolve: its fallback launch too


def test_eager_calls_skip_the_custom_op_layer(monkeypatch):
    """Eager calls run the implementation directly (the torch.library layer costs tens of
    microseconds of host time per call); traced calls still go through the registered op."""
    def refuse(*args, **kwargs):
        raise AssertionError("eager call went through torch.library")

    dst, src, s, d, c = _case()
    expected = run_reference(dst, src, s, d, c, pages=False)
    with monkeypatch.context() as m:
        m.setattr(copy_op, "copy_rows_op", refuse)
        m.setattr(resolve_op, "resolve_op", refuse)
        out = run_copy(ops.copy_rows, dst, src, s, d, c)
        topk, state_rows, state = _resolve_case()
        ops.resolve(topk, state_rows, *state.args(), **state.kwargs())
    assert torch.equal(out, expected)
    assert ops._eager((s, d, None)) and not ops._eager((s, torch.nn.Parameter(d.float())))
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        fake = mode.from_tensor(s)
        assert not ops._eager((fake, d))


# ---------------------------------------------------------------------- CUDA only


@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("pages", (False, True))
def test_cuda_op_picks_the_direction(launches, pages):
    """Pinned host pool + CUDA device pool: H2D runs gather/restore, D2H backup/spill."""
    host = make_table(2, 656, 6, layout="host", seed=7, offsets_device="cuda")
    host = with_pool(host, host.pool.pin_memory())
    dev = make_table(2, 656, 5, layout="device", seed=8, device="cuda")
    for src, dst, name in ((host, dev, "restore_pages" if pages else "gather_rows"),
                           (dev, host, "spill_pages" if pages else "backup_rows")):
        lim_s = src.num_blocks if pages else src.num_rows
        lim_d = dst.num_blocks if pages else dst.num_rows
        s, d, c = random_plan(2, 2, 3, lim_s, lim_d, seed=9, device="cuda")
        expected = run_reference(dst, src, s, d, c, pages=pages)
        out = dst.pool.clone()
        out = out.pin_memory() if out.device.type == "cpu" else out
        launches.clear()
        (ops.copy_pages if pages else ops.copy_rows)(with_pool(dst, out), src, s, d, c)
        torch.cuda.synchronize()
        assert torch.equal(out, expected) and launches == [name]


@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_registered_cuda_kernels_take_mixed_devices():
    """torch.ops.hisparse_triton.* with a pinned CPU host pool, a CUDA device pool and CUDA
    plans dispatch to the CUDA (Triton) kernels: the CUDA tensors pick the dispatch key."""
    from test_resolve_reference import make_state, make_topk

    host = make_table(2, 656, 6, layout="host", seed=11, offsets_device="cuda")
    host = with_pool(host, host.pool.pin_memory())
    dev = make_table(2, 656, 5, layout="device", seed=12, device="cuda")
    s, d, c = random_plan(2, 2, 3, host.num_rows, dev.num_rows, seed=13, device="cuda")
    expected = run_reference(dev, host, s, d, c, pages=False)
    out = dev.pool.clone()
    torch.ops.hisparse_triton.copy_rows(*ops._flat(with_pool(dev, out)), *ops._flat(host),
                                        s, d, c)
    assert torch.equal(out, expected)

    state = make_state(num_states=3, pages=4, hot_slots=8, block_size=4, seed=14)
    topk = make_topk(state, [2, -1, 0], 5, seed=15)
    rows = torch.tensor([2, -1, 0], dtype=torch.int32)
    want_state = state.clone()
    want = ref.resolve(topk, rows, *want_state.args(), **want_state.kwargs())
    got_state = state.to("cuda")
    got = torch.ops.hisparse_triton.resolve(topk.cuda(), rows.cuda(), *got_state.args(),
                                            *got_state.kwargs().values())
    for name, g, w in zip(ref.ResolveResult._fields, got, want):
        assert torch.equal(g.cpu(), w), name
    assert torch.equal(got_state.lru.cpu(), want_state.lru)


@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_torch_backend_with_cpu_plans_over_a_cuda_pool(launches):
    """backend='torch' (and 'auto' with CPU plans) runs the reference even when a pool is on
    CUDA, where the registered op would dispatch to its CUDA (Triton) kernel."""
    host = make_table(2, 656, 6, layout="host", seed=16)
    dev = make_table(2, 656, 5, layout="device", seed=17, device="cuda")
    s, d, c = random_plan(2, 2, 3, host.num_rows, dev.num_rows, seed=18)
    expected = run_reference(dev, host, s, d, c, pages=False)
    for backend in ("auto", "torch"):
        out = dev.pool.clone()
        ops.copy_rows(with_pool(dev, out), host, s, d, c, backend=backend)
        assert torch.equal(out, expected) and launches == []


@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_unpinned_host_pool_is_refused_by_the_ops():
    host = make_table(1, 656, 4, seed=19, offsets_device="cuda")
    dev = make_table(1, 656, 4, layout="device", seed=20, device="cuda")
    plan = torch.zeros(1, 1, dtype=torch.int32, device="cuda")
    before = dev.pool.clone()
    with pytest.raises(ValueError, match="not pinned"):
        ops.copy_rows(dev, host, plan, plan)
    with pytest.raises(ValueError, match="not pinned"):
        ops.validate_table(host, "cuda")
    assert torch.equal(dev.pool, before)


@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_copy_rows_captures_in_a_cuda_graph():
    """After the tables' first use the Triton copy path records into a CUDA graph (no host
    sync, fixed launch shape) and every replay copies what the plan says at replay time."""
    host = make_table(2, 656, 6, layout="host", seed=21, offsets_device="cuda")
    host = with_pool(host, host.pool.pin_memory())
    dev = make_table(2, 656, 5, layout="device", seed=22, device="cuda")
    s, d, c = random_plan(2, 2, 3, host.num_rows, dev.num_rows, seed=23, device="cuda")
    out = dev.pool.clone()
    table = with_pool(dev, out)
    ops.validate_table(table, "cuda")
    ops.validate_table(host, "cuda")
    ops.copy_rows(table, host, s, d, c)  # warm-up: compile outside the capture
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), torch.cuda.graph(graph):
        ops.copy_rows(table, host, s, d, c)
    torch.cuda.current_stream().wait_stream(stream)
    for seed in (24, 25):
        s2, d2, c2 = random_plan(2, 2, 3, host.num_rows, dev.num_rows, seed=seed,
                                 device="cuda")
        s.copy_(s2), d.copy_(d2), c.copy_(c2)
        out.copy_(dev.pool)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, run_reference(dev, host, s, d, c, pages=False))
