"""A host pool shared by the tensor-parallel ranks of one node.

``HostPool(shared_name=..., create=...)`` maps one ``/dev/shm`` file; ``HiSparseRuntime`` with a
``hisparse_shared_host_pool`` plan needs ``host_pool_name``: rank 0 creates the pool and is the
only one that mirrors device -> host, rank 1 attaches and must still resolve exact rows.
Two ranks live in one process here (driven SPMD-style with the same calls), plus one spawned
process that attaches to a parent's pool.
"""

import dataclasses
import multiprocessing
import os
import uuid

import pytest
import torch

from hisparse_triton import HiSparseRuntime, HostMemoryError, pools
from hisparse_triton.errors import SharedHostPoolError
from hisparse_triton.layout import (
    get_hisparse_kv_cache_config,
    get_hisparse_kv_cache_groups,
)
from hisparse_triton.oracle import DenseOracle, OracleMismatch
from hisparse_triton.pools import HostPool, shared_host_pool_path
from hisparse_triton.presets import build_kv_cache_spec
from hisparse_triton.specs import cdiv
from hisparse_triton.workload import plan_for_workload

B, TOPK, BUFFER = 4, 8, 16
L0 = "model.layers.0.self_attn.attn"
PREFIX = "test-hs-"


def unique_name() -> str:
    return f"{PREFIX}{uuid.uuid4().hex}"


@pytest.fixture(autouse=True)
def no_pool_file_left_behind():
    folder = pools.shared_host_pool_dir()
    before = {f for f in os.listdir(folder) if f.startswith("hisparse-" + PREFIX)}
    yield
    after = {f for f in os.listdir(folder) if f.startswith("hisparse-" + PREFIX)}
    leaked = after - before
    for name in leaked:  # clean up, then fail
        os.unlink(os.path.join(folder, name))
    assert not leaked, f"shared host pool files left behind: {sorted(leaked)}"


def shared_plan(*, shared=True, tp=2, max_num_seqs=2, max_model_len=64):
    """A planner config for the ``tiny`` preset (4 sparse layers) with the host pool shared."""
    spec = dict(build_kv_cache_spec("tiny", num_layers=4, block_size=B))
    base = plan_for_workload(spec, max_model_len=max_model_len, num_requests=max_num_seqs,
                             topk=TOPK, device_buffer_size=BUFFER)
    config = dataclasses.replace(
        base.config, tensor_parallel_size=tp,
        hisparse=dataclasses.replace(base.config.hisparse, shared_host_pool=shared))
    groups = get_hisparse_kv_cache_groups(config, spec)
    stride = cdiv(groups[0].page_size_bytes, 4096) * 4096
    kvc = get_hisparse_kv_cache_config(
        config, groups, 0, base.kv_cache_config.hisparse_host_num_blocks * stride)
    assert kvc.hisparse_shared_host_pool is shared
    assert kvc.hisparse_host_block_stride % 4096 == 0 or not shared
    return kvc, config


def make_rank(kvc, config, rank, name, **kwargs):
    return HiSparseRuntime(kvc, config, max_num_seqs=2, device="cpu", backend="torch",
                           offload_threshold_pages=1, free_block_watermark=1.0,
                           tp_rank=rank, host_pool_name=name,
                           **kwargs)


def bookkeeping(rt):
    """Every piece of a runtime's state except the d2h byte counter."""
    state = rt._debug_snapshot()
    misc = list(state.pop("misc"))
    del misc[2]  # d2h bytes
    state["misc"] = misc
    return state


# ----------------------------------------------------------------------------- runtime
def test_two_ranks_share_one_pool_and_only_rank0_mirrors():
    kvc, config = shared_plan()
    name = unique_name()
    rank0 = make_rank(kvc, config, 0, name)
    rank1 = make_rank(kvc, config, 1, name)
    ranks = (rank0, rank1)
    try:
        assert os.path.exists(shared_host_pool_path(name))
        assert (rank0.mirrors_to_host, rank1.mirrors_to_host) == (True, False)
        host0, host1 = rank0.host_cache(L0), rank1.host_cache(L0)
        assert host0.data_ptr() % 4096 == 0 and host1.data_ptr() % 4096 == 0
        # Same seed, same calls: every rank writes the same KV bytes to its own device pool.
        oracles = [DenseOracle(rt, seed=11) for rt in ranks]
        for rt, oracle in zip(ranks, oracles):
            for rid, n in (("a", 29), ("b", 18)):
                rt.add_request(rid, n, 12)
                oracle.add(rid)
                oracle.write(rid, rt.append_slots(rid, n))
        # Rank 1 commits first: it copies nothing, so the shared pool lacks its rows ...
        rank1.commit()
        with pytest.raises(OracleMismatch):
            oracles[1].check_host("a", 29)
        # ... until rank 0 mirrors them (the "barrier" after commit is trivially met here).
        rank0.commit()
        for rid, n in (("a", 29), ("b", 18)):
            oracles[1].check_host(rid, n)
        assert rank1.stats().d2h_bytes == 0 and rank0.stats().d2h_bytes > 0
        for rt in ranks:  # history left the GPU: later misses read the shared pool
            assert rt._requests["a"].released_pages > 0 and rt._requests["a"].hot is not None
        gen = torch.Generator().manual_seed(5)
        for step in range(4):
            for rt, oracle in zip(ranks, oracles):
                for rid in ("a", "b"):
                    oracle.write(rid, rt.append_slots(rid, 1))
                rt.commit()
            for leader in rank0.leaders:
                topk = torch.randint(-1, 34, (2, TOPK), dtype=torch.int32, generator=gen)
                for rt, oracle in zip(ranks, oracles):
                    oracle.check_resolve(leader, ["a", "b"], topk, rt.resolve(leader, ["a", "b"],
                                                                              topk))
            assert bookkeeping(rank0) == bookkeeping(rank1)
        stats0, stats1 = rank0.stats(), rank1.stats()
        assert stats1.misses > 0 and stats1.misses == stats0.misses
        assert stats1.d2h_bytes == 0 and stats0.d2h_bytes > 0
        # Request turnover keeps the ranks in lockstep.
        for rt, oracle in zip(ranks, oracles):
            rt.free_request("a")
            oracle.free("a")
            rt.add_request("c", 9, 3)
            oracle.add("c")
            oracle.write("c", rt.append_slots("c", 9))
            rt.commit()
        assert bookkeeping(rank0) == bookkeeping(rank1)
        oracles[1].check_host("c", 9)
        topk = torch.arange(TOPK, dtype=torch.int32).view(1, TOPK)
        for rt, oracle in zip(ranks, oracles):
            oracle.check_resolve(L0, ["c"], topk, rt.resolve(L0, ["c"], topk))
    finally:
        rank1.close()
        rank0.close()
    assert not os.path.exists(shared_host_pool_path(name))


def test_rank0_close_unlinks_while_rank1_keeps_its_mapping():
    kvc, config = shared_plan()
    name = unique_name()
    rank0 = make_rank(kvc, config, 0, name)
    rank1 = make_rank(kvc, config, 1, name)
    rank0.host_cache(L0)[1, 0, :4] = torch.tensor([1, 2, 3, 4], dtype=torch.uint8)
    rank0.close()
    assert not os.path.exists(shared_host_pool_path(name))
    assert rank1.host_cache(L0)[1, 0, :4].tolist() == [1, 2, 3, 4]
    rank1.close()
    rank0.close()  # idempotent


def test_shared_flag_and_name_must_agree():
    kvc, config = shared_plan()
    with pytest.raises(ValueError, match="hisparse_shared_host_pool.*host_pool_name"):
        make_rank(kvc, config, 0, None)
    private_kvc, private_config = shared_plan(shared=False, tp=1)
    with pytest.raises(ValueError, match="host_pool_name=.*hisparse_shared_host_pool is False"):
        make_rank(private_kvc, private_config, 0, unique_name())
    with pytest.raises(ValueError, match="tp_rank 2 must be < tensor_parallel_size=2"):
        make_rank(kvc, config, 2, unique_name())
    with pytest.raises(ValueError, match="tp_rank must be an int >= 0"):
        make_rank(kvc, config, -1, unique_name())
    with pytest.raises(ValueError, match="shared host pool name"):
        make_rank(kvc, config, 0, "../etc/passwd")
    # The private plan still works without a name, on any rank.
    with make_rank(private_kvc, private_config, 0, None) as rt:
        assert rt.mirrors_to_host and rt._host_pool.path is None


def test_attach_to_a_missing_pool_and_create_an_existing_one():
    kvc, config = shared_plan()
    name = unique_name()
    with pytest.raises(SharedHostPoolError, match=r"does not exist.*\(tp_rank 0\) first"):
        make_rank(kvc, config, 1, name)
    with make_rank(kvc, config, 0, name):
        with pytest.raises(SharedHostPoolError, match="already exists") as info:
            make_rank(kvc, config, 0, name)
        assert isinstance(info.value, OSError)
        assert info.value.path == shared_host_pool_path(name)
        assert os.path.exists(shared_host_pool_path(name))  # the failed creator left it alone
        with make_rank(kvc, config, 1, name) as rank1:
            assert rank1.stats().host_blocks_total > 0
    assert not os.path.exists(shared_host_pool_path(name))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_two_cuda_ranks_pin_one_shared_pool():
    kvc, config = shared_plan()
    name = unique_name()
    ranks = [HiSparseRuntime(kvc, config, max_num_seqs=2, device="cuda",
                             offload_threshold_pages=1, free_block_watermark=1.0,
                             tp_rank=rank, host_pool_name=name)
             for rank in (0, 1)]
    try:
        assert all(rt._host_pool.pinned for rt in ranks)
        oracles = [DenseOracle(rt, seed=2) for rt in ranks]
        for rt, oracle in zip(ranks, oracles):
            rt.add_request("a", 33, 4)
            oracle.add("a")
            oracle.write("a", rt.append_slots("a", 33))
            rt.commit()
        torch.cuda.synchronize()  # the "barrier": rank 0's mirror has landed
        oracles[1].check_host("a", 33)
        topk = torch.arange(TOPK, device="cuda", dtype=torch.int32).view(1, TOPK)
        for rt, oracle in zip(ranks, oracles):
            oracle.check_resolve(L0, ["a"], topk, rt.resolve(L0, ["a"], topk))
        assert ranks[1].stats().d2h_bytes == 0 and ranks[1].stats().misses > 0
    finally:
        for rt in reversed(ranks):
            rt.close()
    assert not os.path.exists(shared_host_pool_path(name))


# ----------------------------------------------------------------------------- HostPool
def test_host_pool_shared_create_attach_close():
    name = unique_name()
    path = shared_host_pool_path(name)
    assert os.path.dirname(path) == pools.shared_host_pool_dir()
    creator = HostPool(5000, shared_name=name, create=True)
    assert creator.size_bytes == 8192 and os.path.getsize(path) == 8192
    assert creator.creator and creator.path == path and creator.data_ptr % 4096 == 0
    with HostPool(5000, shared_name=name, create=False) as other:
        assert not other.creator
        creator.tensor[100] = 42
        assert int(other.tensor[100]) == 42
        other.tensor[8191] = 7
        assert int(creator.tensor[8191]) == 7
    assert other.closed and os.path.exists(path)       # an attacher never unlinks
    with pytest.raises(SharedHostPoolError, match="holds 8192 B but this rank's plan needs "
                                                  "12288 B"):
        HostPool(12000, shared_name=name, create=False)
    creator.close()
    assert creator.closed and not os.path.exists(path)
    creator.close()                                      # idempotent
    with pytest.raises(SharedHostPoolError, match="does not exist"):
        HostPool(5000, shared_name=name, create=False)


def test_host_pool_shared_ram_check_only_for_the_creator(monkeypatch):
    name = unique_name()
    monkeypatch.setattr(pools, "available_ram_bytes", lambda: 4096)
    with pytest.raises(HostMemoryError, match="available RAM"):
        HostPool(8192, shared_name=name, create=True)
    assert not os.path.exists(shared_host_pool_path(name))
    monkeypatch.undo()
    with HostPool(8192, shared_name=name, create=True):
        monkeypatch.setattr(pools, "available_ram_bytes", lambda: 4096)
        with HostPool(8192, shared_name=name, create=False) as attached:
            assert attached.size_bytes == 8192


def test_host_pool_shared_refuses_a_full_shm(monkeypatch):
    name = unique_name()

    class Tiny:
        f_bavail, f_frsize = 1, 4096

    monkeypatch.setattr(pools.os, "statvfs", lambda folder: Tiny())
    with pytest.raises(HostMemoryError, match="--shm-size"):
        HostPool(8192, shared_name=name, create=True)
    assert not os.path.exists(shared_host_pool_path(name))


def test_host_pool_shared_falls_back_to_the_temp_dir(monkeypatch, tmp_path):
    real_isdir = os.path.isdir
    monkeypatch.setattr(pools.os.path, "isdir",
                        lambda p: False if p == "/dev/shm" else real_isdir(p))
    monkeypatch.setattr(pools.tempfile, "gettempdir", lambda: str(tmp_path))
    name = unique_name()
    with HostPool(4096, shared_name=name, create=True) as pool:
        assert pool.path == str(tmp_path / f"hisparse-{name}")
        assert os.path.getsize(pool.path) == 4096
    assert not os.listdir(tmp_path)


@pytest.mark.parametrize("bad", ["", "a/b", "..", ".hidden", "x" * 300, 7])
def test_host_pool_shared_bad_names(bad):
    with pytest.raises(ValueError, match="shared host pool name"):
        HostPool(4096, shared_name=bad, create=True)


def test_host_pool_create_must_be_a_bool():
    with pytest.raises(ValueError, match="create must be True or False"):
        HostPool(4096, shared_name=unique_name(), create="yes")


def _child_attach_and_write(name: str, size: int) -> None:
    with HostPool(size, shared_name=name, create=False, pin=False) as pool:
        assert int(pool.tensor[10]) == 99       # the parent's byte
        pool.tensor[11] = 123


def test_another_process_attaches():
    name = unique_name()
    with HostPool(4096, shared_name=name, create=True) as pool:
        pool.tensor[10] = 99
        child = multiprocessing.get_context("spawn").Process(
            target=_child_attach_and_write, args=(name, 4096))
        child.start()
        child.join(60)
        assert child.exitcode == 0
        assert int(pool.tensor[11]) == 123
