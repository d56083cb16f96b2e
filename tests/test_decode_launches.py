"""The decode path's launches under Triton's real launch path (the stand-in sm_90 driver:
real compiles, launches recorded instead of run): a repeated ``resolve_rows`` is two direct
launches (resolve, then the gather of its miss plan) that hand the launcher addresses only,
with the arguments of the bound calls they stand for; a gather that raises there undoes the
resolve; a launch recorder that replaces the kernels gets the launches. Runs in a
subprocess without ``TRITON_INTERPRET`` (the kernels must compile)."""

from __future__ import annotations

import sys
import textwrap

import pytest

from compiled_run import run_compiled

_SCRIPT = textwrap.dedent('''
    import json, sys, torch
    sys.path.insert(0, sys.argv[1])
    from hisparse_triton.benchmarks.step_cost import _standin_launches
    from worker_helpers import L0, TOPK, make_pair, prefill

    out = {}
    gen = torch.Generator().manual_seed(5)
    with _standin_launches() as counted:
        launch = counted._launch                       # the stand-in's recorder
        launch.record = True
        scheduler, worker = make_pair(backend="triton")
        with worker:
            for rid, n in (("a", 30), ("b", 21)):
                prefill(scheduler, worker, rid, n, gen)
            cache = worker._index_group(L0)
            state_rows = torch.from_numpy(scheduler.state_rows(["a", "b"]))
            topk = torch.randint(0, 30, (2, TOPK), dtype=torch.int32, generator=gen)
            worker.resolve_rows(L0, state_rows, topk)      # checked: binds both launches
            worker.resolve_rows(L0, state_rows, topk)      # the repeat: direct pair
            first = len(launch.calls)
            worker.resolve_rows(L0, state_rows, topk)
            pair = launch.calls[first:]
            out["pair_launches"] = len(pair)
            out["pair_addresses_only"] = all(
                not any(isinstance(a, torch.Tensor) for a in c.args) for c in pair)
            out["pair_taken"] = cache._direct_launches(cache._fast[1]) is not None
            # the same two launches through the bound calls the pair stands for
            first = len(launch.calls)
            result = cache.bound.run(cache._fast[1], topk, state_rows)
            cache.bound_gather(result.miss_src, result.miss_dst, result.miss_count)
            slow = launch.calls[first:]
            out["same_args"] = len(slow) == 2 and all(
                a.grid == b.grid and a.args == b.args for a, b in zip(pair, slow))
            out["same_rows"] = worker.resolve_rows(L0, state_rows, topk) is cache.rows_view

            # a launch recorder replacing the kernels is seen at once, and left behind
            from hisparse_triton.kernels.launches import record_launches
            before = launch.count
            with record_launches() as recorded:
                worker.resolve_rows(L0, state_rows, topk)
            out["recorded"] = [len(recorded), launch.count - before]
            for _ in range(2):   # the real kernels bound again (normal path), then the pair
                worker.resolve_rows(L0, state_rows, topk)
            out["pair_after_recorder"] = cache._direct_launches(cache._fast[1]) is not None

            # a gather that raises on the pair path: the resolve is undone with its result
            gather_launch = cache._direct_launches(cache._fast[1]).pair.second
            undone = []
            cache._undo = lambda rows, res, saved: undone.append(res is not None)

            def failing(*args):
                raise RuntimeError("injected gather failure")

            gather_launch._send = failing
            try:
                worker.resolve_rows(L0, state_rows, topk)
                out["raised"] = False
            except RuntimeError as exc:
                out["raised"] = "injected" in str(exc)
            out["undone_with_result"] = undone
    print(json.dumps(out))
''')


@pytest.mark.skipif(sys.platform != "linux", reason="the stand-in compiles with Triton's ptxas")
def test_a_repeated_resolve_is_two_direct_launches_of_addresses():
    out = run_compiled(_SCRIPT)
    assert out["pair_launches"] == 2 and out["pair_taken"]
    assert out["pair_addresses_only"]
    assert out["same_args"] and out["same_rows"]
    assert out["recorded"] == [2, 0]            # both launches went to the recorder
    assert out["pair_after_recorder"]
    assert out["raised"] and out["undone_with_result"] == [True]
