"""The worker's constructor and memory checks: devices, numpy numbers, fractions, and the
plan's block counts checked against RAM and GPU memory before anything is built."""

from __future__ import annotations

import dataclasses
import time

import numpy as np
import pytest
import torch

from hisparse_triton.errors import HostMemoryError
from hisparse_triton.memory import check_memory, format_fraction
from hisparse_triton.worker import HiSparseWorker, parse_device
from tests.worker_helpers import make_plan


def test_a_cpu_device_has_no_index_but_0():
    assert parse_device("cpu:0") == torch.device("cpu")
    with pytest.raises(ValueError, match=r"device 'cpu:3': there is one CPU device"):
        parse_device("cpu:3")
    plan = make_plan()
    with pytest.raises(ValueError, match="there is one CPU device"):
        HiSparseWorker(plan.kv_cache_config, plan.config, max_num_seqs=2, device="cpu:3")


def test_numpy_numbers_are_accepted_like_python_ones():
    plan = make_plan()
    with HiSparseWorker(plan.kv_cache_config, plan.config, max_num_seqs=np.int64(2),
                        device="cpu", backend="torch", tp_rank=np.int32(0),
                        host_ram_fraction=np.float32(0.9)) as worker:
        assert type(worker.max_num_seqs) is int and type(worker.tp_rank) is int
        assert worker.max_num_seqs == 2
    with pytest.raises(ValueError, match="max_num_seqs must be an int >= 1, got np.True_|"
                                         "got True"):
        HiSparseWorker(plan.kv_cache_config, plan.config, max_num_seqs=np.bool_(True),
                       device="cpu")


def test_a_tiny_ram_fraction_is_named_as_it_is():
    assert format_fraction(0.9) == "90%" and format_fraction(0.995) == "99.5%"
    assert format_fraction(1e-300) == "1e-298%"
    plan = make_plan()
    with pytest.raises(HostMemoryError, match=r"exceeds 1e-298% of the available RAM"):
        HiSparseWorker(plan.kv_cache_config, plan.config, max_num_seqs=2, device="cpu",
                       host_ram_fraction=1e-300)


def test_huge_block_counts_are_refused_before_anything_is_built(monkeypatch):
    """A plan whose pools cannot fit: one clear error naming each item, in no time (nothing
    per block is built first), and nothing allocated."""
    plan = make_plan()
    huge = dataclasses.replace(plan.kv_cache_config, num_blocks=2**26)
    allocations = []
    real_zeros = torch.zeros
    monkeypatch.setattr(torch, "zeros", lambda *a, **k: allocations.append(a) or
                        real_zeros(*a, **k))
    monkeypatch.setattr("hisparse_triton.memory.available_ram_bytes", lambda: 1 << 30)
    start = time.perf_counter()
    with pytest.raises(HostMemoryError, match=r"device pool \(67108864 blocks x \d+ B\) "
                                              r".* exceeds 90% of the available RAM"):
        HiSparseWorker(huge, plan.config, max_num_seqs=2, device="cpu")
    assert time.perf_counter() - start < 1.0 and allocations == []
    requests = HiSparseWorker.memory_requests(huge, plan.config, max_num_seqs=2, device="cpu")
    assert [r.what.split(" (")[0] for r in requests] == [
        "host pool", "device pool", "per-request tables and hot state"]
    with pytest.raises(HostMemoryError):
        check_memory(requests)
    too_many_rows = dataclasses.replace(plan.kv_cache_config, num_blocks=2**30)
    with pytest.raises(ValueError, match=r"the device pool's 1073741824 blocks x 4 rows exceed "
                                         r"the 2147483647 row ids"):
        HiSparseWorker(too_many_rows, plan.config, max_num_seqs=2, device="cpu")


def test_the_bookkeeping_does_not_grow_with_the_pools():
    plan = make_plan()
    small = HiSparseWorker.memory_requests(plan.kv_cache_config, plan.config, max_num_seqs=2)
    big = HiSparseWorker.memory_requests(
        dataclasses.replace(plan.kv_cache_config, num_blocks=10 * plan.kv_cache_config.num_blocks,
                            hisparse_host_num_blocks=7), plan.config, max_num_seqs=2)
    assert small[-1].nbytes == big[-1].nbytes
    given = HiSparseWorker.memory_requests(plan.kv_cache_config, plan.config, max_num_seqs=2,
                                           device_pool_given=True, host_pool_given=True)
    assert [r.what for r in given] == ["per-request tables and hot state"]


def test_the_documented_row_accessor_works_on_the_strided_device_views():
    plan = make_plan()
    with HiSparseWorker(plan.kv_cache_config, plan.config, max_num_seqs=2, device="cpu",
                        backend="torch") as worker:
        pool = worker.device_pool.tensor
        strided = 0
        for layer in worker.groups.device_layers:
            view = worker.device_cache(layer)
            B, row_bytes = view.shape[1], view.shape[2]
            r = 3 * B + 1
            view[r // B, r % B] = 7                    # the docstring's accessor
            offset = view.storage_offset() - pool.storage_offset()
            start = offset + (r // B) * worker.bytes_per_block + (r % B) * row_bytes
            assert bool((pool[start:start + row_bytes] == 7).all()), layer
            view[r // B, r % B] = 0
            if not view.is_contiguous():
                strided += 1
                with pytest.raises(RuntimeError):
                    view.view(-1, row_bytes)           # why the docstring does not flatten
        assert strided
