"""The decode path's launch budget: one ``ops.resolve`` (counters included) and the
``ops.copy_rows`` of its miss plan make at most 3 device launches in total for every
supported shape (today: 3 where the hash kernel applies, which launches its fallback launch
behind it, else 2), and no torch op runs on device tensors between them.

Launches are counted by wrapping Triton's launch path (``KernelInterface.run`` of the
interpreter or the JIT); torch ops are recorded by a ``TorchDispatchMode`` (the ops' eager
path is forced, as a dispatch mode would otherwise route them through the registered op).
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from hisparse_triton import ops
from hisparse_triton.kernels.resolve import hash_applies
from hisparse_triton.ops import backends
from lab.launches import record_launches
from hisparse_triton.row_table import RowTable
from test_resolve_reference import make_state, make_topk

BUDGET = 3
#: Ops that only allocate or describe memory (the no-workspace path allocates its outputs).
ALLOCATING = {"empty.memory_format", "empty_strided.default", "view.default", "slice.Tensor",
              "as_strided.default", "_unsafe_view.default"}


class _OpLog(TorchDispatchMode):
    """Records every aten op that runs outside a kernel launch."""

    def __init__(self):
        super().__init__()
        self.ops: list[str] = []
        self.inside_launch = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.inside_launch:
            self.ops.append(str(func.overloadpacket.__name__) + "." + func._overloadname)
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def counted(monkeypatch, log: _OpLog):
    """Count real launches (interpreter or JIT); ops inside a launch are not logged."""
    from triton.runtime import interpreter, jit

    launches = []
    for cls in (interpreter.InterpretedFunction, jit.JITFunction):
        real = cls.run

        def run(self, *args, _real=real, **kwargs):
            launches.append(self)
            log.inside_launch += 1
            try:
                return _real(self, *args, **kwargs)
            finally:
                log.inside_launch -= 1

        monkeypatch.setattr(cls, "run", run)
    monkeypatch.setattr(backends, "_current_dispatch_mode", lambda: None)  # keep the eager path
    yield launches


def _tables(layers: int, row_bytes: int, device) -> tuple[RowTable, RowTable]:
    B, blocks = 4, 64
    page = B * row_bytes
    host = RowTable.build(torch.randint(0, 256, (layers * blocks * page,), dtype=torch.uint8),
                          [layer * blocks * page for layer in range(layers)],
                          row_bytes=row_bytes, block_size=B, block_stride=page,
                          num_rows=blocks * B, device=device)
    dev = RowTable.build(torch.zeros(blocks * layers * page, dtype=torch.uint8, device=device),
                         [layer * page for layer in range(layers)], row_bytes=row_bytes,
                         block_size=B, block_stride=layers * page, num_rows=blocks * B)
    return dev, host


def _decode_call(state, topk, state_rows, dev_table, host_table, **extra):
    result = ops.resolve(topk, state_rows, *state.args(), **state.kwargs(), backend="triton",
                         **extra)
    ops.copy_rows(dev_table, host_table, result.miss_src, result.miss_dst, result.miss_count,
                  backend="triton")
    return result


@pytest.mark.parametrize("topk_dtype", (torch.int32, torch.int64))
def test_real_decode_call_is_three_launches_and_no_torch_op(monkeypatch, kernel_device,
                                                            topk_dtype):
    """A real call (the interpreter on CPU): the hash resolve, its fallback launch and the
    gather = 3 launches, and with a warm workspace, ``out`` and ``counters`` not a single
    aten op runs outside the kernels."""
    state = make_state(num_states=4, pages=8, hot_slots=24, block_size=4, seed=1,
                       prefill=True).to(kernel_device)
    names = [2, 0, -1, 2]
    topk = make_topk(state.to("cpu"), names, 16, seed=2).to(topk_dtype).to(kernel_device)
    state_rows = torch.tensor(names, dtype=torch.int32, device=kernel_device)
    dev_table, host_table = _tables(2, 144, kernel_device)
    extra = dict(workspace=ops.ResolveWorkspace(kernel_device),
                 out=torch.empty(4, 16, dtype=torch.int32, device=kernel_device),
                 counters=torch.zeros(3, dtype=torch.int64, device=kernel_device))
    _decode_call(state, topk, state_rows, dev_table, host_table, **extra)  # warm-up
    log = _OpLog()
    with counted(monkeypatch, log) as launches, log:
        result = _decode_call(state, topk, state_rows, dev_table, host_table, **extra)
    assert len(launches) == 3 <= BUDGET
    assert [k.fn.__name__ for k in launches[:2]] == ["_resolve_hash_kernel", "_resolve_kernel"]
    assert log.ops == [], f"torch ops outside the kernels: {log.ops}"
    assert int(extra["counters"].sum()) == 2 * 2 * 16  # two calls of two resolved rows
    assert result.rows is extra["out"]


# Every width the config accepts (up to device_buffer_size = 32768), hot buffers up to
# 32768 slots, 1 and 64 rows, 1 and 61 layers; the kernels are recorded, not run.
SHAPES = [(R, K, H) for R in (1, 64) for K, H in (
    (1, 16), (16, 16), (2048, 2048), (2048, 4096), (2048, 32768), (4096, 8192),
    (8192, 8192), (16384, 32768), (32768, 32768))]


@pytest.mark.parametrize("layers", (1, 61))
@pytest.mark.parametrize("R, K, H", SHAPES, ids=lambda v: str(v))
def test_every_shape_fits_the_budget(R, K, H, layers):
    B = 64
    S, P = R + 2, 16
    i32 = torch.int32
    state = type("State", (), {})()
    tensors = (torch.zeros(S, dtype=i32), torch.zeros(S, P, dtype=i32),
               torch.zeros(S, P, dtype=i32), torch.zeros(S, -(-H // B), dtype=i32),
               torch.zeros(S, H, dtype=i32), torch.zeros(S, H, dtype=i32))
    state.args = lambda: tensors
    state.kwargs = lambda: dict(block_size=B, num_device_blocks=1 << 16,
                                num_host_blocks=1 << 20)
    topk = torch.zeros(R, K, dtype=torch.int64)
    state_rows = torch.arange(R, dtype=i32)
    dev_table, host_table = _tables(layers, 656, "cpu")
    extra = dict(workspace=ops.ResolveWorkspace("cpu"), out=torch.empty(R, K, dtype=i32),
                 counters=torch.zeros(3, dtype=torch.int64))
    expect = 3 if hash_applies(K, H, B, 1 << 20) else 2  # hash: its fallback launch too
    with record_launches() as launched, pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRITON_INTERPRET", "1")
        _decode_call(state, topk, state_rows, dev_table, host_table, **extra)  # warm-up
        launched.clear()
        mp.setattr(backends, "_current_dispatch_mode", lambda: None)
        with _OpLog() as log:
            _decode_call(state, topk, state_rows, dev_table, host_table, **extra)
        assert log.ops == [], f"torch ops outside the kernels: {log.ops}"
        assert len(launched) == expect <= BUDGET, [launch.kernel for launch in launched]
        # Without a workspace the outputs are allocated, still no compute op, same launches.
        launched.clear()
        with _OpLog() as log:
            _decode_call(state, topk, state_rows, dev_table, host_table)
        assert log.ops and set(log.ops) <= ALLOCATING, log.ops  # (the log does see ops)
        assert len(launched) == expect


def test_host_cost_benchmark_runs_the_decode_call():
    """The host-cost micro-benchmark (``lab.host_cost``) times the three-launch call (the
    hash resolve, its fallback launch, the gather)."""
    from lab.host_cost import resolve_host_cost

    cost = resolve_host_cost(batch=2, top_k=16, hot_slots=32, iters=3, repeats=2)
    assert cost["launches_per_call"] == 3 and cost["api"] == "workspace"
    assert 0 < cost["best_us"] <= cost["us_per_call"]
