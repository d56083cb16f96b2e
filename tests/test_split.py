"""The scheduler / worker split: the StepPlan contract, plan ordering, all-or-nothing calls.

``HiSparseScheduler`` (CPU only, no torch) decides and emits ``StepPlan``s;
``HiSparseWorker`` applies them in order. ``HiSparseRuntime`` is the in-process facade; these
tests drive the halves directly and check the facade's all-or-nothing rule when torch itself
fails. Geometry: ``tests/test_runtime.py``'s (``tiny`` cut to 4 layers, block 4, top-k 8).
"""

import pickle
import subprocess
import sys

import numpy as np
import pytest
import torch

import hisparse_triton.worker.worker as worker_module
import hisparse_triton.worker.pool_open as pool_open
from hisparse_triton import CapacityError, HiSparseRuntime, HostMemoryError
from hisparse_triton.errors import ReservationExceededError
from hisparse_triton.oracle import DenseOracle, SplitView
from hisparse_triton.scheduler import HiSparseScheduler
from hisparse_triton.step_plan import StepPlan, TableLayout
from hisparse_triton.worker import HiSparseWorker
from test_runtime import B, L0, L2, TOPK, make_runtime, write_random

GEN = torch.Generator().manual_seed(0)


def halves(rt: HiSparseRuntime, **kwargs):
    """A fresh scheduler + worker pair built from a facade's plan."""
    scheduler = HiSparseScheduler(rt.kv_cache_config, rt.config, max_num_seqs=rt.max_num_seqs,
                                  offload_threshold_pages=rt.offload_threshold_pages,
                                  free_block_watermark=rt.scheduler.free_block_watermark)
    worker = HiSparseWorker(rt.kv_cache_config, rt.config, max_num_seqs=rt.max_num_seqs,
                            device="cpu", backend="torch", **kwargs)
    return scheduler, worker


def run_plan(scheduler, worker):
    """One plan through the worker: apply, (the forward), mirror."""
    plan = scheduler.step()
    worker.apply(plan)
    worker.mirror(plan)
    return plan


def test_scheduler_runs_without_importing_torch():
    code = (
        "import sys\n"
        "from hisparse_triton import EngineConfig, HiSparseConfig, HiSparseScheduler, StepPlan\n"
        "from hisparse_triton.presets import build_kv_cache_spec\n"
        "from hisparse_triton.workload import plan_for_workload\n"
        "plan = plan_for_workload(build_kv_cache_spec('tiny', num_layers=4, block_size=4),\n"
        "    max_model_len=64, num_requests=2, topk=8, device_buffer_size=16)\n"
        "s = HiSparseScheduler(plan.kv_cache_config, plan.config, max_num_seqs=2)\n"
        "s.add_request('a', 20, 4)\n"
        "rows = s.append_slots('a', 20)\n"
        "p = s.step()\n"
        "assert isinstance(p, StepPlan) and p.num_mirror == 20, p\n"
        "assert StepPlan.from_bytes(p.to_bytes()) == p\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_plan_round_trips_and_has_a_stable_size_per_decode_step():
    with make_runtime(max_num_seqs=2, regular=False) as rt:
        scheduler, worker = halves(rt)
        with worker:
            for rid in ("a", "b"):
                scheduler.add_request(rid, 10, 60)
                scheduler.append_slots(rid, 10)
            first = scheduler.step()
            assert first.num_resets == 2 and first.num_mirror == 20
            sizes = []
            for step in range(40):
                for rid in ("a", "b"):
                    scheduler.append_slots(rid, 1)
                plan = scheduler.step()
                for copy in (pickle.loads(pickle.dumps(plan)), StepPlan.from_bytes(plan.to_bytes())):
                    assert copy == plan and copy.step == plan.step
                    assert np.array_equal(copy.data, plan.data)
                    assert np.array_equal(copy.mirror_device_rows, plan.mirror_device_rows)
                sizes.append(plan.nbytes)
                assert plan.num_mirror == 2 and plan.num_resets == 0
            # a decode step costs the same few hundred bytes whatever the context length:
            # seq_len writes, two mirror rows, and a page's block ids every B steps
            assert max(sizes) < 1024 and len(set(sizes)) <= 4, sizes
            assert "a" not in repr(plan.data.tolist())  # only numbers cross


def test_worker_refuses_plans_out_of_order_and_changes_nothing():
    with make_runtime(max_num_seqs=2, regular=False) as rt:
        scheduler, worker = halves(rt)
        with worker:
            scheduler.add_request("a", 8, 8)
            scheduler.append_slots("a", 8)
            p1 = scheduler.step()
            scheduler.append_slots("a", 1)
            p2 = scheduler.step()
            before = worker._debug_snapshot()
            with pytest.raises(ValueError, match=r"StepPlan 2 is out of order \(skipped ahead\)"):
                worker.apply(p2)
            assert worker._debug_snapshot() == before
            worker.apply(p1)
            with pytest.raises(ValueError, match="never mirrored"):
                worker.apply(p2)
            with pytest.raises(ValueError, match="takes the last plan applied"):
                worker.mirror(p2)
            worker.mirror(p1)
            worker.mirror(p1)  # already mirrored: nothing to do
            with pytest.raises(ValueError, match=r"StepPlan 1 is out of order \(repeated\)"):
                worker.apply(p1)
            worker.apply(p2)
            worker.mirror(p2)
            assert int(worker.seq_lens[scheduler.state_row("a")]) == 9


def test_worker_refuses_foreign_and_corrupt_plans():
    with make_runtime(max_num_seqs=2, regular=False) as rt:
        scheduler, worker = halves(rt)
        other = make_runtime(max_num_seqs=3, regular=False)
        other_scheduler = other.scheduler
        with worker, other:
            other_scheduler.add_request("x", 4, 4)
            with pytest.raises(ValueError, match="different plans"):
                worker.apply(other_scheduler.step())
            scheduler.add_request("a", 4, 4)
            plan = scheduler.step()
            before = worker._debug_snapshot()
            data = plan.data.copy()
            data[0] = 7  # a reset of state row 7: there are 2
            bad = StepPlan(step=plan.step, layout=plan.layout, commit=plan.commit,
                           num_resets=plan.num_resets, num_writes=plan.num_writes,
                           num_mirror=plan.num_mirror, num_resident=plan.num_resident,
                           num_lost=plan.num_lost, data=data)
            with pytest.raises(ValueError, match=r"reset_rows holds 7, outside \[0, 2\)"):
                worker.apply(bad)
            with pytest.raises(ValueError, match="apply takes a StepPlan"):
                worker.apply(plan.to_bytes())
            assert worker._debug_snapshot() == before
            worker.apply(plan)
    with pytest.raises(ValueError, match="truncated"):
        StepPlan.from_bytes(b"\x00" * 10)


def test_halves_driven_as_a_serving_stack_are_exact():
    """A scheduler + worker pair driven as a serving stack drives them (one default
    ``step()`` per model step: apply, write KV, resolve, mirror) is exact against the dense
    oracle, with offloads, hot-buffer misses and requests coming and going."""
    with make_runtime(max_num_seqs=3, threshold=1, regular=True) as rt:
        scheduler, worker = halves(rt)
        with worker:
            oracle = DenseOracle(SplitView(scheduler, worker), seed=1)
            gen = torch.Generator().manual_seed(5)
            lengths = {"a": 37, "b": 22, "c": 9}
            live = {}
            for step in range(30):
                if step % 10 == 0:  # a request comes (and an old one goes)
                    rid = f"r{step}"
                    if len(live) == 3:
                        old = min(live)
                        scheduler.free_request(old)
                        oracle.free(old)
                        del live[old]
                    n = list(lengths.values())[step // 10]
                    scheduler.add_request(rid, n, 40)
                    oracle.add(rid)
                    live[rid] = scheduler.append_slots(rid, n)
                for rid in live:
                    if live[rid] is None:
                        live[rid] = scheduler.append_slots(rid, 1)
                plan = scheduler.step()
                worker.apply(plan)
                for rid, rows in live.items():   # the forward writes KV ...
                    oracle.write(rid, rows)
                    live[rid] = None
                ids = sorted(live) + [None]
                state_rows = torch.from_numpy(scheduler.state_rows(ids))
                for leader in scheduler.leaders:  # ... and resolves
                    topk = torch.randint(-2, 48, (len(ids), TOPK), dtype=torch.int32,
                                         generator=gen)
                    oracle.check_resolve(leader, ids, topk,
                                         worker.resolve_rows(leader, state_rows, topk))
                worker.mirror(plan)               # after the forward
            for rid in live:
                oracle.check_pages(rid)
            stats = worker.stats()
            assert stats.misses > 0 and stats.hits > 0
            assert scheduler.stats().unpinned_pages > 0


def test_everything_a_worker_allocates_is_checked_first(monkeypatch):
    """Host pool, device pool and per-request tables are checked together before any is
    allocated: a clear error, never an allocator error half-way."""
    import hisparse_triton.memory as memory

    monkeypatch.setattr(memory, "available_ram_bytes", lambda: 100_000)
    made = []

    class RecordingHostPool(worker_module.HostPool):
        def __init__(self, *args, **kwargs):
            made.append(self)
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(pool_open, "HostPool", RecordingHostPool)
    with pytest.raises(HostMemoryError, match="per-request tables and hot state"):
        make_runtime(max_num_seqs=3)
    assert not made  # nothing was allocated


def test_state_row_of_a_freed_request_is_reset_before_reuse():
    with make_runtime(max_num_seqs=1, regular=False) as rt:
        scheduler, worker = halves(rt)
        with worker:
            scheduler.add_request("a", 30, 4)
            scheduler.append_slots("a", 30)
            run_plan(scheduler, worker)
            scheduler.free_request("a")
            scheduler.add_request("b", 4, 4)
            plan = scheduler.step()
            assert plan.reset_rows.tolist() == [0]
            worker.apply(plan)
            row = worker._arena[0]
            layout = scheduler.layout
            assert int(row[TableLayout.SEQ_LEN_COL]) == 0
            # b's one host page is written, a's other host pages are gone
            host = row[layout.host_col:layout.host_col + layout.host_width]
            assert int((host != 0).sum()) == 2
            assert all(int(t[0].count_nonzero()) == 0 for t in worker.tables)


def test_failed_construction_releases_the_host_pool(monkeypatch):
    made = []

    class RecordingHostPool(worker_module.HostPool):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(self)

    class NoDevicePool(worker_module.DevicePool):
        def __init__(self, *args, **kwargs):
            raise CapacityError("device pool does not fit", resource="device bytes")

    monkeypatch.setattr(pool_open, "HostPool", RecordingHostPool)
    monkeypatch.setattr(pool_open, "DevicePool", NoDevicePool)
    with pytest.raises(CapacityError, match="device pool does not fit"):
        make_runtime()
    assert len(made) == 1 and made[0].closed


# ------------------------------------------------------------------ torch failing mid-call
class _FailingSetitem:
    """Makes ``Tensor.__setitem__`` raise when it writes ``target`` (a worker tensor)."""

    def __init__(self, monkeypatch, target: torch.Tensor) -> None:
        original = torch.Tensor.__setitem__

        def setitem(tensor, index, value):
            if tensor.data_ptr() == target.data_ptr():
                raise RuntimeError("injected torch failure")
            return original(tensor, index, value)

        monkeypatch.setattr(torch.Tensor, "__setitem__", setitem)


def test_worker_apply_is_atomic_when_torch_raises_part_way(monkeypatch):
    with make_runtime(max_num_seqs=2, regular=False) as rt:
        scheduler, worker = halves(rt)
        with worker:
            scheduler.add_request("a", 12, 4)
            scheduler.append_slots("a", 12)
            run_plan(scheduler, worker)
            scheduler.free_request("a")                  # a reset ...
            scheduler.add_request("b", 9, 4)
            scheduler.append_slots("b", 9)               # ... and writes
            plan = scheduler.step()
            before = worker._debug_snapshot()
            with monkeypatch.context() as patch:
                _FailingSetitem(patch, worker._lru)       # resets and arena already written
                with pytest.raises(RuntimeError, match="injected"):
                    worker.apply(plan)
            assert worker._debug_snapshot() == before
            worker.apply(plan)


@pytest.mark.parametrize("where", ["append_slots", "flush", "commit-mirror", "commit-apply",
                                   "commit-durable"])
def test_facade_calls_are_all_or_nothing_when_torch_raises(monkeypatch, where):
    rt = make_runtime(max_num_seqs=2, threshold=1)
    with rt:
        oracle = DenseOracle(rt, seed=2)
        rt.add_request("a", 30, 20)
        oracle.add("a")
        write_random(rt, oracle, "a", 30)
        rt.commit()
        rt.add_request("b", 5, 20)
        oracle.add("b")
        before = rt._debug_snapshot()
        worker = rt.worker
        with monkeypatch.context() as patch:
            if where == "append_slots":
                def fail(*args, **kwargs):
                    raise RuntimeError("injected torch failure")
                patch.setattr(worker, "to_device", fail)
                call = lambda: rt.append_slots("b", 5)  # noqa: E731
            elif where == "flush":
                oracle.write("b", rt.append_slots("b", 5))  # pending writes, then a resolve
                before = None
                _FailingSetitem(patch, worker._arena)
                call = lambda: rt.resolve(L0, ["a"], torch.zeros(1, TOPK, dtype=torch.int32))  # noqa: E731
            elif where == "commit-mirror":
                def fail_mirror(plan=None, **kwargs):
                    raise RuntimeError("injected torch failure")
                patch.setattr(worker, "mirror", fail_mirror)
                call = rt.commit
            elif where == "commit-apply":
                calls = []
                original = worker.apply

                def apply_fails(plan):   # the plan commit hands over (b's admission)
                    calls.append(plan)
                    if len(calls) == 1:
                        raise RuntimeError("injected torch failure")
                    return original(plan)
                patch.setattr(worker, "apply", apply_fails)
                call = rt.commit
            if where == "commit-durable":       # after the plan was applied: it is reverted
                def fail_durable():
                    raise RuntimeError("injected torch failure")
                patch.setattr(rt.scheduler, "commit_mirrors", fail_durable)
                call = rt.commit
            if before is None:
                snapshot = (rt.scheduler._debug_snapshot(), worker._debug_snapshot())
            with pytest.raises(RuntimeError, match="injected"):
                call()
            if before is None:
                assert (rt.scheduler._debug_snapshot(), worker._debug_snapshot()) == snapshot
        if before is not None:
            assert rt._debug_snapshot() == before
        # and the runtime keeps working, exactly
        write_random(rt, oracle, "b", 5)
        rt.commit()
        for leader in rt.leaders:
            topk = torch.randint(-1, 35, (2, TOPK), dtype=torch.int32, generator=GEN)
            oracle.check_resolve(leader, ["a", "b"], topk, rt.resolve(leader, ["a", "b"], topk))


@pytest.mark.parametrize("built_in_inference", [True, False])
def test_runtime_works_across_inference_mode(built_in_inference):
    """Tensors the runtime owns are ordinary tensors whatever mode it was built in, so every
    call works inside and outside ``torch.inference_mode()``."""
    if built_in_inference:
        with torch.inference_mode():
            rt = make_runtime(max_num_seqs=2, threshold=1)
    else:
        rt = make_runtime(max_num_seqs=2, threshold=1)
    with rt:
        oracle = DenseOracle(rt, seed=4)
        for rid, n in (("a", 30), ("b", 13)):
            rt.add_request(rid, n, 20)
            oracle.add(rid)
        for inference in (not built_in_inference, built_in_inference,
                          not built_in_inference):
            with torch.inference_mode(inference):
                for rid, n in (("a", 3), ("b", 9)):
                    oracle.write(rid, rt.append_slots(rid, n))
                rt.commit()
                for leader in rt.leaders:
                    topk = torch.randint(-1, 40, (2, TOPK), dtype=torch.int32, generator=GEN)
                    oracle.check_resolve(leader, ["a", "b"], topk,
                                         rt.resolve(leader, ["a", "b"], topk))
        with torch.inference_mode(not built_in_inference):
            rt.free_request("a")
            rt.add_request("c", 4, 4)
        assert rt.stats().misses > 0


def test_request_ids_must_be_a_sequence_and_not_nan():
    with make_runtime() as rt:
        rt.add_request("a", 4, 4)
        topk = torch.zeros(1, TOPK, dtype=torch.int32)
        for ids in ({"a"}, {"a": 0}, "a"):
            with pytest.raises(ValueError, match="list or tuple"):
                rt.resolve(L0, ids, topk)
        with pytest.raises(ValueError, match="NaN"):
            rt.add_request(float("nan"), 4, 4)
        assert rt.resolve(L2, ("a",), topk).shape == (1, TOPK)
        assert B == 4


def test_stats_async_matches_stats():
    with make_runtime(max_num_seqs=2, threshold=1) as rt:
        oracle = DenseOracle(rt, seed=6)
        rt.add_request("a", 30, 4)
        oracle.add("a")
        write_random(rt, oracle, "a", 30)
        rt.commit()
        topk = torch.arange(TOPK, dtype=torch.int32).view(1, -1)
        rt.resolve(L0, ["a"], topk)
        snapshot = rt.stats_async()
        rt.resolve(L2, ["a"], topk)          # after the snapshot: not in it
        first = snapshot.result()
        assert snapshot.ready() and first.misses > 0
        assert rt.stats().misses > first.misses


def test_append_decode_equals_append_slots_per_request():
    with make_runtime(max_num_seqs=3, regular=True) as rt:
        one, batch = halves(rt)[0], halves(rt)[0]
        for scheduler in (one, batch):
            for rid, n in (("a", 5), ("b", 8), ("c", 13)):
                scheduler.add_request(rid, n, 20)
                scheduler.append_slots(rid, n)
            scheduler.step()
        ids = ["c", "a", "b"]
        for step in range(20):
            expected = [one.append_slots(rid, 1) for rid in ids]
            got = batch.append_decode(ids)
            for r, rows in enumerate(expected):
                for layer, row in rows.items():
                    assert int(got[layer][r]) == int(row[0]), (step, layer)
            assert one.step() == batch.step()
        before = batch._debug_snapshot()
        with pytest.raises(ReservationExceededError):   # a's reservation ends first
            batch.append_decode(["b", "c", "a"] * 1 + ["a"])
        assert batch._debug_snapshot() == before


def test_every_call_after_close_raises_runtime_closed_error():
    import inspect

    from hisparse_triton.errors import RuntimeClosedError

    rt = make_runtime()
    rt.add_request("a", 4, 4)
    rt.close()
    args = {"request_id": "a", "prompt_len": 4, "max_new_tokens": 4, "num_tokens": 1,
            "layer_name": L0, "leader_layer": L0, "request_ids": ["a"],
            "topk": torch.zeros(1, TOPK, dtype=torch.int32),
            "state_rows": torch.zeros(1, dtype=torch.int32), "new_len": 1, "num_accepted": 0}
    called = 0
    for name, fn in inspect.getmembers(type(rt), inspect.isfunction):
        if name.startswith("_") or name == "close":
            continue
        params = list(inspect.signature(fn).parameters)[1:]
        with pytest.raises(RuntimeClosedError):
            getattr(rt, name)(**{p: args[p] for p in params if p in args})
        called += 1
    assert called >= 15
    rt.close()  # idempotent


def test_tensors_on_a_device_the_worker_cannot_read_are_refused():
    with make_runtime() as rt:
        rt.add_request("a", 4, 4)
        meta = torch.zeros(1, TOPK, dtype=torch.int32, device="meta")
        with pytest.raises(ValueError, match="topk is on meta"):
            rt.resolve(L0, ["a"], meta)
        with pytest.raises(ValueError, match="state_rows is on meta"):
            rt.resolve_rows(L0, torch.zeros(1, dtype=torch.int32, device="meta"),
                            torch.zeros(1, TOPK, dtype=torch.int32))


def test_device_rows_of_a_row_aligned_plan_are_the_same_bytes():
    from hisparse_triton.layout import (
        device_row_layout,
        get_hisparse_kv_cache_config,
        get_hisparse_kv_cache_groups,
    )
    from hisparse_triton.presets import build_kv_cache_spec

    from hisparse_triton import EngineConfig, HiSparseConfig

    spec = build_kv_cache_spec("deepseek-v3.2-fp8", num_layers=13)   # 12 + 1 per hot group
    config = EngineConfig(max_model_len=256, num_gpu_blocks_override=40, hisparse=HiSparseConfig(
        index_topk=64, device_buffer_size=128, host_pool_gib=0.02))
    groups = get_hisparse_kv_cache_groups(config, spec)
    kvc = get_hisparse_kv_cache_config(config, groups, 0, config.hisparse.host_pool_bytes,
                                       row_aligned_blocks=True)
    rt = HiSparseRuntime(kvc, config, max_num_seqs=2, device="cpu", backend="torch")
    with rt:
        rt.add_request("a", 130, 4)
        rows = rt.append_slots("a", 130)
        gen = torch.Generator().manual_seed(0)
        for layer in ("model.layers.0.self_attn.attn", "model.layers.12.self_attn.attn"):
            cache, flat = rt.device_cache(layer), rt.device_rows(layer)
            layout = device_row_layout(kvc, layer)
            r = rows[layer]
            data = torch.randint(0, 256, (r.numel(), cache.shape[2]), dtype=torch.uint8,
                                 generator=gen)
            cache[r // cache.shape[1], r % cache.shape[1]] = data
            flat_ids = torch.tensor([layout.flat_row(int(x)) for x in r])
            assert torch.equal(flat[flat_ids], data)
            assert flat.shape == (layout.num_rows, 656)
    with make_runtime() as rt:
        with pytest.raises(ValueError, match="not row-aligned"):
            rt.device_rows(L0)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_a_failed_gather_leaves_the_hot_state_as_it_was(monkeypatch, backend):
    """resolve updates slot ownership and LRU in place, then gathers: when the gather
    raises, the hot state is restored, so later calls never return another position's
    bytes."""
    with make_runtime(max_num_seqs=2, threshold=1, backend=backend) as rt:
        oracle = DenseOracle(rt, seed=8)
        rt.add_request("a", 36, 4)
        oracle.add("a")
        write_random(rt, oracle, "a", 36)
        rt.commit()
        topk = torch.arange(TOPK, dtype=torch.int32).view(1, -1)
        rt.resolve(L0, ["a"], topk)                      # a warm hot buffer
        before = rt._debug_snapshot()
        ops = rt.worker._ops

        def failing_copy(*args, **kwargs):
            raise RuntimeError("injected gather failure")

        with monkeypatch.context() as patch:
            patch.setattr(ops, "copy_rows", failing_copy)
            for state in rt.worker._index_groups.values():   # the bound Triton gather too
                if state.bound_gather is not None:
                    patch.setattr(state, "bound_gather", failing_copy)
            with pytest.raises(RuntimeError, match="injected gather failure"):
                rt.resolve(L0, ["a"], topk + 8)          # all misses, then the gather fails
        assert rt._debug_snapshot() == before
        for shift in (8, 0, 16):
            oracle.check_resolve(L0, ["a"], topk + shift, rt.resolve(L0, ["a"], topk + shift))


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_a_state_row_named_twice_resolves_once(backend):
    """resolve_rows with one state row twice: the first batch row resolves it, the second
    is padding (-1, no state touched), the same on both backends; later calls stay exact."""
    with make_runtime(max_num_seqs=2, threshold=1, backend=backend) as rt:
        oracle = DenseOracle(rt, seed=9)
        rt.add_request("a", 36, 4)
        oracle.add("a")
        write_random(rt, oracle, "a", 36)
        rt.commit()
        row = rt.state_row("a")
        topk = torch.stack([torch.arange(TOPK), torch.arange(8, 8 + TOPK)]).to(torch.int32)
        rows = rt.resolve_rows(L0, torch.tensor([row, row], dtype=torch.int32), topk)
        oracle.check_resolve(L0, ["a"], topk[:1], rows[:1])
        assert rows[1].eq(-1).all()
        for _ in range(2):
            oracle.check_resolve(L0, ["a"], topk[1:], rt.resolve(L0, ["a"], topk[1:]))


@pytest.mark.parametrize("q", [1, 2])
def test_resolve_rows_is_at_most_three_launches_and_no_torch_op(q):
    """The decode call of one index group: resolve + gather (+ counters, in the resolve
    kernel) in <= 3 kernel launches, no torch operation before, between or after them."""
    import dataclasses as dc
    import os

    from torch.utils._python_dispatch import TorchDispatchMode

    from lab.launches import record_launches

    metadata_only = {"view", "_unsafe_view", "reshape", "as_strided", "alias", "expand",
                     "slice", "select", "unsqueeze", "squeeze"}   # no device work

    class Ops(TorchDispatchMode):
        count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket.__name__ not in metadata_only:
                Ops.count += 1
            return func(*args, **(kwargs or {}))

    if not os.environ.get("TRITON_INTERPRET") == "1" and not torch.cuda.is_available():
        pytest.skip("needs CUDA or TRITON_INTERPRET=1")
    base = make_runtime(max_num_seqs=2)
    config = dc.replace(base.config, hisparse=dc.replace(base.config.hisparse,
                                                         max_decode_query_len=q))
    rt = HiSparseRuntime(base.kv_cache_config, config, max_num_seqs=2, device="cpu",
                         backend="triton", free_block_watermark=1.0)
    base.close()
    with rt:
        rt.add_request("a", 36, 8)
        rt.append_slots("a", 36)
        rt.commit()
        state_rows = rt.state_rows(["a", None])
        shape = (2, q, TOPK // q) if q > 1 else (2, TOPK)
        topk = torch.randint(0, 36, shape, dtype=torch.int64)   # int64: converted in-kernel
        with record_launches(store=False) as launches:
            rt.resolve_rows(L0, state_rows, topk)                # warm: shapes, buffers
            launches.clear()
            Ops.count = 0
            with Ops():
                rows = rt.worker.resolve_rows(L0, state_rows, topk)
        assert len(launches) <= 3 and len(launches) == 3  # hash resolve, its fallback, gather
        assert Ops.count == 0
        assert rows.shape == shape
