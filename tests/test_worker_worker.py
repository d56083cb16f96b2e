"""``HiSparseWorker``'s public API over its parts: revert, the read accessors, the package's
exports, the constructor checks (``options``) and input placement (``placement``)."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import numpy as np
import pytest
import torch

from hisparse_triton.errors import RuntimeClosedError
from hisparse_triton.worker import HiSparseWorker
from hisparse_triton.worker.options import check_options, parse_device
from hisparse_triton.worker.placement import array_on_device, on_device
from worker_helpers import L0, TOPK, make_pair, make_plan, prefill

GEN = torch.Generator().manual_seed(5)


def test_revert_undoes_the_last_apply_and_the_plan_applies_again():
    scheduler, worker = make_pair()
    with worker:
        prefill(scheduler, worker, "a", 9, GEN)
        state_rows = torch.from_numpy(scheduler.state_rows(["a"]))
        worker.resolve_rows(L0, state_rows, torch.arange(TOPK, dtype=torch.int32)[None])
        scheduler.free_request("a")                 # a reset of a warm row ...
        scheduler.add_request("b", 6, 4)
        scheduler.append_slots("b", 6)              # ... and writes
        plan = scheduler.step()
        before = worker._debug_snapshot()
        worker.apply(plan)
        assert worker._debug_snapshot() != before
        worker.revert(plan)
        assert worker._debug_snapshot() == before
        with pytest.raises(ValueError, match=f"StepPlan {plan.step} is not the last plan"):
            worker.revert(plan)
        worker.apply(plan)
        worker.mirror(plan)
        assert worker.stats().plans == plan.step
    with pytest.raises(RuntimeClosedError):
        worker.revert(plan)


def test_read_accessors_are_live_views():
    scheduler, worker = make_pair()
    with worker:
        prefill(scheduler, worker, "a", 9, GEN)
        row = scheduler.state_row("a")
        assert int(worker.seq_lens[row]) == 9
        assert worker.host_table[row, 0] == scheduler.host_block_table("a")[0]
        assert len(worker.tables) == len(worker.groups.groups)
        order = worker.hot_order(L0)
        assert order.shape == worker.hot_slots(L0).shape == (2, 16)
        topk = torch.arange(TOPK, dtype=torch.int32)[None] + 1
        worker.resolve_rows(L0, torch.tensor([row], dtype=torch.int32), topk)
        assert sorted(order[row].tolist()) == list(range(16))     # still a permutation
        assert order[row].tolist() != list(range(16))              # filled slots moved
        assert worker.hot_slots(L0)[row].ge(0).sum() == worker.stats().misses > 0
        assert worker.host_pool.size_bytes > 0 and worker.device_pool.size_bytes > 0
    assert worker.host_pool.closed and worker.device_pool.closed
    for call in (lambda: worker.hot_order(L0), lambda: worker.index_group(L0)):
        with pytest.raises(RuntimeClosedError):
            call()


def test_the_package_exports_without_importing_torch_first():
    code = ("import sys\n"
            "import hisparse_triton.worker as w\n"
            "assert 'torch' not in sys.modules\n"
            "names = ['BACKENDS', 'GroupCounts', 'HiSparseWorker', 'HostEvent',\n"
            "         'SplitGather', 'StatsSnapshot', 'StreamRows', 'WorkerStats',\n"
            "         'parse_device', 'plan_fingerprint']\n"
            "assert sorted(w.__all__) == sorted(names), w.__all__\n"
            "assert all(getattr(w, n) is not None for n in names)\n"
            "try:\n"
            "    w.nothing\n"
            "except AttributeError as exc:\n"
            "    assert 'nothing' in str(exc)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize("change, match", [
    (dict(max_num_seqs=0), "max_num_seqs must be an int >= 1"),
    (dict(max_num_seqs=True), "max_num_seqs must be an int >= 1"),
    (dict(tp_rank=-1), "tp_rank must be an int >= 0"),
    (dict(tp_rank=1), "tp_rank 1 must be < tensor_parallel_size=1"),
    (dict(host_pool_name="x"), "host_pool_name='x' was given but"),
    (dict(backend="cuda"), "backend must be one of"),
    (dict(host_ram_fraction=0), r"host_ram_fraction must be in \(0, 1\]"),
    (dict(config=None), "needs an EngineConfig with hisparse set"),
])
def test_constructor_options_are_checked_first(change, match):
    plan = make_plan()
    args = dict(kv_cache_config=plan.kv_cache_config, config=plan.config, max_num_seqs=2,
                backend="torch", tp_rank=0, host_pool_name=None, host_ram_fraction=0.9)
    with pytest.raises(ValueError, match=match):
        check_options(**{**args, **change})
    kwargs = {k: v for k, v in {**args, **change}.items()
              if k not in ("kv_cache_config", "config")}
    with pytest.raises(ValueError, match=match):
        HiSparseWorker(plan.kv_cache_config, change.get("config", plan.config), device="cpu",
                       **kwargs)


def test_a_shared_plan_needs_a_pool_name_and_a_host_pool_two_blocks():
    plan = make_plan()
    shared = dataclasses.replace(plan.kv_cache_config, hisparse_shared_host_pool=True)
    with pytest.raises(ValueError, match="pass host_pool_name"):
        HiSparseWorker(shared, plan.config, max_num_seqs=2, device="cpu")
    tiny = dataclasses.replace(plan.kv_cache_config, hisparse_host_num_blocks=1)
    with pytest.raises(ValueError, match="the host pool needs at least 2 blocks"):
        HiSparseWorker(tiny, plan.config, max_num_seqs=2, device="cpu")


def test_parse_device():
    assert parse_device("cpu") == torch.device("cpu")
    assert parse_device(None).type == ("cuda" if torch.cuda.is_available() else "cpu")
    with pytest.raises(ValueError, match="'meta': the runtime runs on a cpu or cuda device"):
        parse_device("meta")
    with pytest.raises(ValueError, match="is not a torch device"):
        parse_device(3.5)


def test_placement_keeps_tensors_on_their_device_and_refuses_unreadable_ones():
    cpu = torch.device("cpu")
    t = torch.arange(3)
    assert on_device(t, cpu) is t
    with pytest.raises(ValueError, match="topk is on meta; this worker runs on cpu"):
        on_device(torch.zeros(2, device="meta"), cpu, "topk")
    with torch.inference_mode():
        made = array_on_device(np.array([1, 2]), torch.int32, cpu)
    assert made.dtype == torch.int32 and made.tolist() == [1, 2] and not made.is_inference()
