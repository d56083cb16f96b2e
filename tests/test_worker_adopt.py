"""A worker over tensors the caller allocated: the planner's sizes, exact results, and a
``close()`` that never frees what the worker did not allocate."""

from __future__ import annotations

import pytest
import torch

from hisparse_triton.errors import HostMemoryError
from hisparse_triton.worker import HiSparseWorker
from hisparse_triton.worker.pools import HostPool
from tests.test_pools import _FakeCudart
from tests.worker_helpers import L0, TOPK, make_pair, make_plan, prefill


def caller_tensors(plan, *, dtype=torch.uint8, extra=0):
    device_bytes, host_bytes = HiSparseWorker.pool_bytes(plan.kv_cache_config)
    size = torch.tensor([], dtype=dtype).element_size()
    device = torch.full((-(-(device_bytes + extra) // size),), 0, dtype=dtype)
    host = torch.full((-(-(host_bytes + extra) // size),), 0, dtype=dtype)
    return device, host


def run_steps(worker_kwargs, backend="torch"):
    """A prefill and a resolve; returns the rows and their bytes."""
    scheduler, worker = make_pair(max_num_seqs=2, backend=backend, **worker_kwargs)
    gen = torch.Generator().manual_seed(4)
    with worker:
        prefill(scheduler, worker, "a", 20, gen)
        state_rows = torch.tensor([scheduler.state_row("a")], dtype=torch.int32)
        topk = torch.arange(0, 2 * TOPK, 2, dtype=torch.int32).view(1, TOPK)
        rows = worker.resolve_rows(L0, state_rows, topk).clone()
        flat = worker.device_cache(L0).reshape(-1, worker.device_cache(L0).shape[2])
        data = flat[rows[0].long()].clone()
        views = (worker.device_cache(L0), worker.host_cache(L0))
        owns = (worker.device_pool.owns_memory, worker.host_pool.owns_memory)
    return rows, data, views, owns


@pytest.mark.parametrize("dtype", [torch.uint8, torch.bfloat16])
def test_a_worker_over_caller_tensors_is_exact_and_uses_their_memory(dtype):
    plan = make_plan()
    device, host = caller_tensors(plan, dtype=dtype, extra=100)
    own_rows, own_data, _, owns = run_steps({})
    assert owns == (True, True)
    rows, data, (device_view, host_view), owns = run_steps(
        dict(device_pool_tensor=device, host_pool_tensor=host))
    assert owns == (False, False)
    assert torch.equal(rows, own_rows) and torch.equal(data, own_data)
    start, end = device.data_ptr(), device.data_ptr() + device.numel() * device.element_size()
    assert start <= device_view.data_ptr() < end
    assert host.data_ptr() <= host_view.data_ptr() < host.data_ptr() + host.numel() * 2
    # The worker is closed: the caller's tensors are untouched and still usable.
    assert device.view(torch.uint8).any() and host.view(torch.uint8).any()
    device.zero_()
    host.zero_()


def test_only_one_of_the_pools_may_be_handed_in():
    plan = make_plan()
    device, _ = caller_tensors(plan)
    rows, data, _, owns = run_steps(dict(device_pool_tensor=device))
    assert owns == (False, True) and rows.numel() == TOPK


@pytest.mark.parametrize("make, match", [
    (lambda d, h: dict(device_pool_tensor=d[:-1]), r"the device pool tensor holds \d+ B; "
                                                   r"the plan needs at least \d+ B"),
    (lambda d, h: dict(host_pool_tensor=h[:10]), "the host pool tensor holds 10 B"),
    (lambda d, h: dict(device_pool_tensor=d.view(2, -1).t()), "must be one contiguous buffer"),
    (lambda d, h: dict(device_pool_tensor=d.float().requires_grad_()), "requires grad"),
    (lambda d, h: dict(host_pool_tensor=torch.zeros(h.numel(), device="meta",
                                                   dtype=torch.uint8)),
     "the host pool tensor is on meta; it must be on cpu"),
    (lambda d, h: dict(device_pool_tensor=list(d)), "must be a torch.Tensor, got list"),
])
def test_bad_caller_tensors_are_refused(make, match):
    plan = make_plan()
    device, host = caller_tensors(plan)
    with pytest.raises(ValueError, match=match):
        HiSparseWorker(plan.kv_cache_config, plan.config, max_num_seqs=2, device="cpu",
                       **make(device, host))


def test_an_inference_tensor_is_refused():
    plan = make_plan()
    device_bytes, _ = HiSparseWorker.pool_bytes(plan.kv_cache_config)
    with torch.inference_mode():
        device = torch.zeros(device_bytes, dtype=torch.uint8)
    with pytest.raises(ValueError, match="is an inference tensor"):
        HiSparseWorker(plan.kv_cache_config, plan.config, max_num_seqs=2, device="cpu",
                       device_pool_tensor=device)


@pytest.fixture
def fake_gpu(monkeypatch):
    log = []
    cudart = _FakeCudart(log)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: cudart)
    monkeypatch.setattr(torch.cuda, "synchronize",
                        lambda device=None: log.append(("synchronize", device)))
    return log


def test_an_unpinned_host_tensor_is_registered_and_unregistered_by_the_pool(fake_gpu,
                                                                            monkeypatch):
    log = fake_gpu
    buffer = torch.zeros(3 * 4096, dtype=torch.uint8)
    window = buffer[100:100 + 8000]                   # need not start on a page
    monkeypatch.setattr(torch.Tensor, "is_pinned", lambda self: False)
    pool = HostPool.adopt(window, 8000, device="cuda:0")
    assert pool.pinned and not pool.owns_memory and pool.raw.data_ptr() == window.data_ptr()
    ((call, ptr, length, flags),) = log
    assert call == "register" and ptr % 4096 == 0 and flags == 3
    assert ptr <= window.data_ptr() and window.data_ptr() + 8000 <= ptr + length
    pool.close()
    assert log[-1] == ("unregister", ptr) and pool.closed
    window[0] = 5                                     # the caller's memory lives on
    with pytest.raises(HostMemoryError, match="is not pinned .* and register=False"):
        HostPool.adopt(window, 8000, register=False)


def test_a_pinned_host_tensor_is_used_as_is(fake_gpu, monkeypatch):
    log = fake_gpu
    monkeypatch.setattr(torch.Tensor, "is_pinned", lambda self: True)
    with HostPool.adopt(torch.zeros(4096, dtype=torch.uint8), 4096) as pool:
        assert pool.pinned
    assert log == []                                  # nothing registered, nothing undone


def test_a_shared_pool_plan_takes_no_host_tensor():
    import dataclasses

    plan = make_plan()
    shared = dataclasses.replace(plan.kv_cache_config, hisparse_shared_host_pool=True)
    with pytest.raises(ValueError, match="host_pool_tensor cannot be used with a shared"):
        HiSparseWorker(shared, plan.config, max_num_seqs=2, device="cpu",
                       host_pool_name="x", host_pool_tensor=torch.zeros(8))


def _range(t, nbytes):
    return f"[{t.data_ptr():#x}, {t.data_ptr() + nbytes:#x})"


def _refused_before_anything(monkeypatch, plan, **pools):
    """Build a worker over ``pools``: it must raise the overlap error before it opens (or
    registers, or allocates) any pool; returns the error's message."""
    import hisparse_triton.worker.worker as worker_module

    def opened(*args, **kwargs):
        raise AssertionError("a pool was opened before the overlap was refused")

    monkeypatch.setattr(worker_module, "open_host_pool", opened)
    monkeypatch.setattr(worker_module, "open_device_pool", opened)
    monkeypatch.setattr(worker_module, "check_memory", opened)
    before = [t.clone() for t in pools.values()]
    with pytest.raises(ValueError, match="overlap") as err:
        HiSparseWorker(plan.kv_cache_config, plan.config, max_num_seqs=2, device="cpu",
                       **pools)
    assert all(torch.equal(b, t) for b, t in zip(before, pools.values()))
    return str(err.value)


def test_one_tensor_as_both_pools_is_refused_naming_both_ranges(monkeypatch):
    plan = make_plan()
    device_bytes, host_bytes = HiSparseWorker.pool_bytes(plan.kv_cache_config)
    buf = torch.zeros(max(device_bytes, host_bytes), dtype=torch.uint8)
    msg = _refused_before_anything(monkeypatch, plan, device_pool_tensor=buf,
                                   host_pool_tensor=buf)
    assert f"the device pool tensor bytes {_range(buf, device_bytes)}" in msg
    assert f"the host pool tensor bytes {_range(buf, host_bytes)}" in msg
    assert f"({min(device_bytes, host_bytes)} B in common)" in msg


@pytest.mark.parametrize("dtype", [torch.uint8, torch.bfloat16])
def test_overlapping_views_of_one_storage_are_refused(monkeypatch, dtype):
    plan = make_plan()
    device_bytes, host_bytes = HiSparseWorker.pool_bytes(plan.kv_cache_config)
    size = torch.tensor([], dtype=dtype).element_size()
    storage = torch.zeros(-(-(device_bytes + host_bytes) // size), dtype=dtype)
    device = storage[:-(-device_bytes // size)]
    host = storage[device.numel() - 1:]                    # one element in common
    msg = _refused_before_anything(monkeypatch, plan, device_pool_tensor=device,
                                   host_pool_tensor=host)
    assert f"the device pool tensor bytes {_range(device, device_bytes)}" in msg
    assert f"the host pool tensor bytes {_range(host, host_bytes)}" in msg
    common = device.data_ptr() + device_bytes - host.data_ptr()
    assert f"({common} B in common)" in msg and 0 < common <= size


def test_disjoint_views_of_one_storage_are_accepted_and_exact():
    plan = make_plan()
    device_bytes, host_bytes = HiSparseWorker.pool_bytes(plan.kv_cache_config)
    storage = torch.zeros(device_bytes + 64 + host_bytes, dtype=torch.uint8)
    device, host = storage[:device_bytes], storage[device_bytes + 64:]
    own_rows, own_data, _, _ = run_steps({})
    rows, data, (device_view, host_view), owns = run_steps(
        dict(device_pool_tensor=device, host_pool_tensor=host))
    assert owns == (False, False)
    assert torch.equal(rows, own_rows) and torch.equal(data, own_data)
    assert device_view.data_ptr() == device.data_ptr()
    assert host.data_ptr() <= host_view.data_ptr() < host.data_ptr() + host_bytes
    # Touching views: the device pool's last used byte right before the host pool's first.
    storage = torch.zeros(device_bytes + host_bytes, dtype=torch.uint8)
    run_steps(dict(device_pool_tensor=storage, host_pool_tensor=storage[device_bytes:]))
