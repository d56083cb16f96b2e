"""The decode path as a CUDA graph replays it, checked on CPU: the serving loop of
``tests/test_cuda_graph.py`` (a new plan applied before each step, the forward at a fixed,
padded batch, requests leaving and joining, misses, followers) run without a capture,
byte for byte against the eager loop; and a repeated ``resolve_rows`` that runs no torch
operation and allocates nothing (so it can be captured: fixed shapes, persistent outputs).
"""

from __future__ import annotations

import os

import pytest
import torch

from test_cuda_graph import decode_fixed_against_eager
from test_launch_budget import _OpLog
from worker_helpers import L0, TOPK, make_pair, prefill

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
needs_interpreter = pytest.mark.skipif(
    not INTERPRET, reason="runs the Triton kernels on CPU tensors under TRITON_INTERPRET=1 "
                          "(with CUDA, tests/test_cuda_graph.py captures the same loop)")


@pytest.mark.parametrize("backend", [
    "torch", pytest.param("triton", marks=needs_interpreter)])
def test_the_fixed_shape_loop_is_the_eager_loop(backend):
    (eager, fixed), step = decode_fixed_against_eager(torch.device("cpu"), backend, steps=6,
                                                      capture=False)
    assert eager == fixed and eager.misses > 0 and step.graph is None


@needs_interpreter
def test_a_repeated_resolve_rows_runs_no_torch_op_and_allocates_nothing(monkeypatch):
    """What a capture needs of the call: after the first call of a shape, ``resolve_rows``
    is three kernel launches (the hash resolve, its fallback launch, the gather) on persistent
    tensors, no torch op outside them
    (no allocation, no copy, no host sync), and it returns the same output tensor."""
    from lab.launches import record_launches

    from hisparse_triton.ops import backends

    scheduler, worker = make_pair(backend="triton")
    gen = torch.Generator().manual_seed(3)
    with worker:
        for rid, n in (("a", 30), ("b", 21)):
            prefill(scheduler, worker, rid, n, gen)
        state_rows = torch.from_numpy(scheduler.state_rows(["a", "b"]))
        topk = torch.randint(0, 30, (2, TOPK), dtype=torch.int32, generator=gen)
        first = worker.resolve_rows(L0, state_rows, topk)          # binds the shape
        with record_launches() as launched:
            monkeypatch.setattr(backends, "_current_dispatch_mode", lambda: None)
            with _OpLog() as log:
                again = worker.resolve_rows(L0, state_rows, topk)
        assert log.ops == [], f"torch ops outside the kernels: {log.ops}"
        assert [launch.kernel.fn.__name__ for launch in launched] == [
            "_resolve_hash_kernel", "_resolve_kernel", "copy_rows_kernel"]
        assert again is first
