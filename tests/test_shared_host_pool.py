"""A host pool shared by the tensor-parallel ranks of one node.

``HostPool(shared_name=..., create=...)`` maps one ``/dev/shm`` file; ``HiSparseRuntime`` with a
``hisparse_shared_host_pool`` plan needs ``host_pool_name``: rank 0 creates the pool and is the
only one that mirrors device -> host, rank 1 attaches and must still resolve exact rows.
Two ranks live in one process here (driven SPMD-style with the same calls), plus one spawned
process that attaches to a parent's pool.
"""

import dataclasses
import faulthandler
import json
import multiprocessing
import os
import signal
import subprocess
import uuid

import pytest
import torch

from hisparse_triton import HiSparseRuntime, HostMemoryError, cli, memory
from hisparse_triton.errors import ReadOnlyViewError, SharedHostPoolError
from hisparse_triton.layout import (
    get_hisparse_kv_cache_config,
    get_hisparse_kv_cache_groups,
)
from hisparse_triton.oracle import DenseOracle, OracleMismatch
from hisparse_triton.presets import build_kv_cache_spec
from hisparse_triton.specs import cdiv
from hisparse_triton.worker import pools
from hisparse_triton.worker.pools import HostPool, shared_host_pool_path
from hisparse_triton.worker.shared_pool import HEADER_BYTES, PoolHeader, creator_alive, read_header
from hisparse_triton.workload import plan_for_workload

B, TOPK, BUFFER = 4, 8, 16
L0 = "model.layers.0.self_attn.attn"
PREFIX = f"test-{os.getpid()}-"  # per process: /dev/shm is shared by every test run
SECRET = "00112233445566778899aabbccddeeff"  # the run secret every rank of these tests uses


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


def make_rank(kvc, config, rank, name, backend="torch", **kwargs):
    return HiSparseRuntime(kvc, config, max_num_seqs=2, device="cpu", backend=backend,
                           offload_threshold_pages=1, free_block_watermark=1.0,
                           tp_rank=rank, host_pool_name=name,
                           host_pool_secret=SECRET if name is not None else None, **kwargs)


def prefill_and_resolve_on_both(ranks, length, *, seed, device="cpu", barrier=None):
    """Rank 0 and rank 1 prefill request "a" with the same calls and bytes and commit; after
    ``barrier()``, rank 1 reads rank 0's mirror from the shared pool, and both resolve the
    first ``TOPK`` positions exactly (checked against the dense oracle)."""
    oracles = [DenseOracle(rt, seed=seed) for rt in ranks]
    for rt, oracle in zip(ranks, oracles):
        rt.add_request("a", length, 4)
        oracle.add("a")
        oracle.write("a", rt.append_slots("a", length))
        rt.commit()
    if barrier is not None:
        barrier()
    oracles[1].check_host("a", length)
    topk = torch.arange(TOPK, device=device, dtype=torch.int32).view(1, TOPK)
    for rt, oracle in zip(ranks, oracles):
        oracle.check_resolve(L0, ["a"], topk, rt.resolve(L0, ["a"], topk))


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
        # Rank 1 never writes the pool: its view is mapped read-only.
        assert rank0.worker.host_pool.writable and not rank1.worker.host_pool.writable
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
            assert rt.scheduler.unpinned_pages("a") > 0 and rt.scheduler.is_offloaded("a")
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


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                    reason="runs the Triton kernels on CPU tensors (the interpreter)")
def test_an_attached_rank_gathers_from_its_read_only_view_with_the_triton_kernels():
    """The interpreter copies every tensor argument back after a launch: a read-only host
    pool must survive that (torch skips a copy of a storage onto itself)."""
    kvc, config = shared_plan()
    name = unique_name()
    ranks = [make_rank(kvc, config, rank, name, backend="triton") for rank in (0, 1)]
    try:
        assert not ranks[1].worker.host_pool.writable
        prefill_and_resolve_on_both(ranks, 29, seed=3)
        assert ranks[1].stats().misses > 0
    finally:
        for rt in reversed(ranks):
            rt.close()


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
        assert rt.mirrors_to_host and rt.worker.host_pool.path is None


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
                             tp_rank=rank, host_pool_name=name, host_pool_secret=SECRET)
             for rank in (0, 1)]
    try:
        assert all(rt.worker.host_pool.pinned for rt in ranks)
        # The "barrier": rank 0's mirror has landed.
        prefill_and_resolve_on_both(ranks, 33, seed=2, device="cuda",
                                    barrier=torch.cuda.synchronize)
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
    creator = HostPool(5000, shared_name=name, create=True, secret=SECRET)
    # The pool's 8192 B follow a 4 KiB header page, so they stay page aligned.
    assert creator.size_bytes == 8192 and os.path.getsize(path) == HEADER_BYTES + 8192
    assert creator.creator and creator.path == path and creator.data_ptr % 4096 == 0
    assert creator.writable
    with HostPool(5000, shared_name=name, create=False, secret=SECRET) as other:
        assert not other.creator and not other.writable   # attached ranks only read
        assert other.data_ptr % 4096 == 0
        creator.tensor[100] = 42
        creator.tensor[8191] = 7
        assert int(other.tensor[100]) == 42 and int(other.tensor[8191]) == 7
    assert other.closed and os.path.exists(path)       # an attacher never unlinks
    with pytest.raises(SharedHostPoolError, match="holds 8192 B but this rank's plan needs "
                                                  "12288 B"):
        HostPool(12000, shared_name=name, create=False, secret=SECRET)
    creator.close()
    assert creator.closed and not os.path.exists(path)
    creator.close()                                      # idempotent
    with pytest.raises(SharedHostPoolError, match="does not exist"):
        HostPool(5000, shared_name=name, create=False, secret=SECRET)


def test_host_pool_shared_ram_check_only_for_the_creator(monkeypatch):
    name = unique_name()
    monkeypatch.setattr(memory, "available_ram_bytes", lambda: 4096)
    with pytest.raises(HostMemoryError, match="available RAM"):
        HostPool(8192, shared_name=name, create=True, secret=SECRET)
    assert not os.path.exists(shared_host_pool_path(name))
    monkeypatch.undo()
    with HostPool(8192, shared_name=name, create=True, secret=SECRET):
        monkeypatch.setattr(memory, "available_ram_bytes", lambda: 4096)
        with HostPool(8192, shared_name=name, create=False, secret=SECRET) as attached:
            assert attached.size_bytes == 8192


def test_host_pool_shared_refuses_a_full_shm(monkeypatch):
    name = unique_name()

    class Tiny:
        f_bavail, f_frsize = 1, 4096

    monkeypatch.setattr(pools.os, "statvfs", lambda folder: Tiny())
    with pytest.raises(HostMemoryError, match="--shm-size"):
        HostPool(8192, shared_name=name, create=True, secret=SECRET)
    assert not os.path.exists(shared_host_pool_path(name))


def test_host_pool_shared_falls_back_to_the_temp_dir(monkeypatch, tmp_path):
    real_isdir = os.path.isdir
    monkeypatch.setattr(pools.os.path, "isdir",
                        lambda p: False if p == "/dev/shm" else real_isdir(p))
    monkeypatch.setattr(pools.tempfile, "gettempdir", lambda: str(tmp_path))
    name = unique_name()
    with HostPool(4096, shared_name=name, create=True, secret=SECRET) as pool:
        assert pool.path == str(tmp_path / f"hisparse-{name}")
        assert os.path.getsize(pool.path) == HEADER_BYTES + 4096
    assert not os.listdir(tmp_path)


@pytest.mark.parametrize("bad", ["", "a/b", "..", ".hidden", "x" * 300, 7])
def test_host_pool_shared_bad_names(bad):
    with pytest.raises(ValueError, match="shared host pool name"):
        HostPool(4096, shared_name=bad, create=True, secret=SECRET)


def test_host_pool_create_must_be_a_bool():
    with pytest.raises(ValueError, match="create must be True or False"):
        HostPool(4096, shared_name=unique_name(), create="yes", secret=SECRET)


def _child_attach_and_read(name: str, size: int) -> None:
    with HostPool(size, shared_name=name, create=False, secret=SECRET, pin=False) as pool:
        assert int(pool.tensor[10]) == 99       # the parent's byte
        assert not pool.writable


def test_another_process_attaches():
    name = unique_name()
    with HostPool(4096, shared_name=name, create=True, secret=SECRET) as pool:
        pool.tensor[10] = 99
        child = multiprocessing.get_context("spawn").Process(
            target=_child_attach_and_read, args=(name, 4096))
        child.start()
        child.join(60)
        assert child.exitcode == 0
        assert os.path.exists(pool.path)


# ----------------------------------------------------------------------------- hardening
def _in_child(action) -> int:
    """Run ``action()`` in a forked child and return its exit status (negative: killed by
    that signal; 0 when ``action`` returned, 1 when it raised)."""
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            action()
            code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def test_a_forked_child_never_unlinks_the_creators_pool():
    name = unique_name()
    with HostPool(4096, shared_name=name, create=True, secret=SECRET) as pool:
        pool.tensor[0] = 5
        assert _in_child(pool.close) == 0         # the child closes its copy of the pool
        assert os.path.exists(pool.path)            # the child did not delete the live pool
        assert int(pool.tensor[0]) == 5 and not pool.closed
        with HostPool(4096, shared_name=name, create=False, secret=SECRET) as attached:
            assert int(attached.tensor[0]) == 5
    assert not os.path.exists(shared_host_pool_path(name))


def test_a_forked_child_never_unregisters_the_creators_pinned_pool(fake_cuda):
    log = fake_cuda
    pool = HostPool(4096)                            # private, pinned through the fake CUDA
    assert pool.pinned and [c[0] for c in log] == ["register"]

    def close_and_check():
        pool.close()
        assert [c[0] for c in log] == ["register"]   # the child called no CUDA function

    assert _in_child(close_and_check) == 0
    pool.close()
    assert [c[0] for c in log] == ["register", "synchronize", "unregister"]


def test_an_attached_rank_cannot_write_the_pool():
    """Its view refuses every write with a clear error (no crash), and the mapping under it
    is read-only as well."""
    name = unique_name()
    with HostPool(4096, shared_name=name, create=True, secret=SECRET, pin=False) as pool:
        pool.tensor[7] = 42
        with HostPool(4096, shared_name=name, create=False, secret=SECRET,
                      pin=False) as other:
            assert other.read_only and not other.writable and not pool.read_only
            view = other.view(0, 2, 4, 8, 32)
            for write in (lambda: other.tensor.__setitem__(7, 1), lambda: view.fill_(0),
                          lambda: view[1].copy_(torch.ones(4, 8, dtype=torch.uint8)),
                          lambda: torch.add(view, 1, out=view),
                          lambda: view.view(-1).__iadd__(1)):
                with pytest.raises(ReadOnlyViewError, match="read-only view of a shared host"):
                    write()
            assert int(other.tensor[7]) == 42 and int(view.reshape(-1)[7]) == 42
            copy = other.tensor.clone()                 # a copy is an ordinary tensor
            copy[7] = 1
            assert not other.tensor.numpy().flags.writeable
        assert int(pool.tensor[7]) == 42

        def attach_and_write_raw():
            other = HostPool(4096, shared_name=name, create=False, secret=SECRET, pin=False)
            if int(other.raw[7]) == 42:
                faulthandler.disable()         # no traceback dump for the expected fault
                other.raw[7] = 1               # PROT_READ: the kernel stops this write

        assert _in_child(attach_and_write_raw) in (-signal.SIGSEGV, -signal.SIGBUS)
        assert int(pool.tensor[7]) == 42


def test_attach_follows_no_symlink_and_opens_only_regular_files():
    target, link = unique_name(), unique_name()
    with HostPool(4096, shared_name=target, create=True, secret=SECRET):
        os.symlink(shared_host_pool_path(target), shared_host_pool_path(link))
        try:
            with pytest.raises(SharedHostPoolError, match="symbolic link"):
                HostPool(4096, shared_name=link, create=False, secret=SECRET)
            with pytest.raises(SharedHostPoolError, match="already exists"):
                HostPool(4096, shared_name=link, create=True, secret=SECRET)   # O_EXCL: never through it
        finally:
            os.unlink(shared_host_pool_path(link))
    fifo = unique_name()
    os.mkfifo(shared_host_pool_path(fifo), 0o600)
    try:  # a FIFO would block a plain open(); this one must fail at once
        with pytest.raises(SharedHostPoolError, match="not a regular file"):
            HostPool(4096, shared_name=fifo, create=False, secret=SECRET)
    finally:
        os.unlink(shared_host_pool_path(fifo))


def _write_pool_file(path, header: bytes, data_bytes: int = 4096, mode: int = 0o600) -> None:
    """A pool file as this user could write it (mode 0600 unless told otherwise)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    os.fchmod(fd, mode)
    with os.fdopen(fd, "wb") as file:
        file.write(header.ljust(HEADER_BYTES, b"\0") + bytes(data_bytes))


def test_attach_checks_the_header():
    name = unique_name()
    path = shared_host_pool_path(name)
    try:
        _write_pool_file(path, b"")                                  # not ours
        with pytest.raises(SharedHostPoolError, match="not a hisparse-triton shared host pool"):
            HostPool(4096, shared_name=name, create=False, secret=SECRET)
        ours = bytes.fromhex(SECRET)
        newer = dataclasses.replace(PoolHeader.for_this_process(4096, None, ours), version=99)
        _write_pool_file(path, newer.pack())
        with pytest.raises(SharedHostPoolError, match="format version 99.*reads version 2"):
            HostPool(4096, shared_name=name, create=False, secret=SECRET)
        _write_pool_file(path, PoolHeader.for_this_process(8192, None, ours).pack())  # short
        with pytest.raises(SharedHostPoolError, match="truncated"):
            HostPool(8192, shared_name=name, create=False, secret=SECRET)
    finally:
        os.unlink(path)


def test_a_rank_with_another_plan_fingerprint_cannot_attach():
    name = unique_name()
    with HostPool(4096, shared_name=name, create=True, secret=SECRET, fingerprint="plan-a") as pool:
        header_fd = os.open(pool.path, os.O_RDONLY)
        try:
            assert read_header(header_fd, pool.path).fingerprint == "plan-a"
        finally:
            os.close(header_fd)
        with pytest.raises(SharedHostPoolError, match="created for plan fingerprint 'plan-a' "
                                                      "but this rank's plan has fingerprint "
                                                      "'plan-b'"):
            HostPool(4096, shared_name=name, create=False, secret=SECRET, fingerprint="plan-b")
        with pytest.raises(SharedHostPoolError, match="'plan-a'.*fingerprint ''"):
            HostPool(4096, shared_name=name, create=False, secret=SECRET)
        with HostPool(4096, shared_name=name, create=False, secret=SECRET, fingerprint="plan-a") as other:
            assert other.fingerprint == "plan-a"
    with pytest.raises(ValueError, match="fingerprint must be at most 2048"):
        HostPool(4096, shared_name=unique_name(), create=True, secret=SECRET, fingerprint="x" * 2049)


def test_permission_errors_are_shared_host_pool_errors(monkeypatch):
    name = unique_name()
    path = shared_host_pool_path(name)
    real_open = os.open

    def denied(file, flags, *args):
        if file == path:
            raise PermissionError(13, "Permission denied", file)
        return real_open(file, flags, *args)

    monkeypatch.setattr(os, "open", denied)
    with pytest.raises(SharedHostPoolError, match="permission denied creating") as info:
        HostPool(4096, shared_name=name, create=True, secret=SECRET)
    assert info.value.path == path
    monkeypatch.undo()
    with HostPool(4096, shared_name=name, create=True, secret=SECRET):
        monkeypatch.setattr(os, "open", denied)
        with pytest.raises(SharedHostPoolError, match=r"permission denied opening .*read-only"):
            HostPool(4096, shared_name=name, create=False, secret=SECRET)


def test_a_pool_left_by_a_killed_rank0_is_stale_and_shm_clean_removes_it(capsys):
    name = unique_name()
    path = shared_host_pool_path(name)

    def create_and_die():  # a killed rank 0: nothing unlinks the file
        pool = HostPool(4096, shared_name=name, create=True, secret=SECRET, pin=False, fingerprint="p")
        os.kill(os.getpid(), signal.SIGKILL)
        pool.close()  # never reached

    assert _in_child(create_and_die) == -signal.SIGKILL and os.path.exists(path)
    try:
        with pytest.raises(SharedHostPoolError, match=r"is stale: its creator \(pid \d+\) is "
                                                      r"gone.*shm clean --name"):
            HostPool(4096, shared_name=name, create=False, secret=SECRET, fingerprint="p")
        with pytest.raises(SharedHostPoolError, match="already exists.*crashed runtime left it "
                                                      "behind.*shm clean --name"):
            HostPool(4096, shared_name=name, create=True, secret=SECRET)
        assert cli.main(["shm", "list", "--json", "-"]) == 0
        listed = {p["name"]: p for p in json.loads(capsys.readouterr().out)["pools"]}
        assert listed[name]["state"] == "stale" and listed[name]["pool_bytes"] == 4096
        assert listed[name]["creator_pid"] > 0 and listed[name]["fingerprint"] == "p"
        assert cli.main(["shm", "clean", "--name", name]) == 0
        assert f"removed {name} (stale" in capsys.readouterr().out
        assert not os.path.exists(path)
    finally:
        if os.path.exists(path):
            os.unlink(path)
    with HostPool(4096, shared_name=name, create=True, secret=SECRET):   # the name is usable again
        pass


def test_shm_clean_removes_only_stale_pools(tmp_path, capsys):
    dead = _dead_pid()
    _write_pool_file(tmp_path / "hisparse-old", dataclasses.replace(
        PoolHeader.for_this_process(4096, "x"), creator_pid=dead).pack())
    _write_pool_file(tmp_path / "hisparse-live", PoolHeader.for_this_process(4096, "y").pack())
    _write_pool_file(tmp_path / "hisparse-junk", b"not a pool")
    (tmp_path / "unrelated").write_text("left alone")
    folder = str(tmp_path)
    assert cli.main(["shm", "list", "--dir", folder]) == 0
    table = capsys.readouterr().out
    assert f"shared host pools in {folder}:" in table
    for pool_name, state in (("old", "stale"), ("live", "alive"), ("junk", "unknown")):
        line = next(row for row in table.splitlines() if row.startswith(pool_name + " "))
        assert state in line
    assert str(os.getpid()) in table and "4.00 KiB" in table and "unrelated" not in table
    assert cli.main(["shm", "clean", "--dir", folder]) == 0
    out = capsys.readouterr().out
    assert "removed old (stale" in out and "left junk: state unknown" in out
    assert sorted(os.listdir(tmp_path)) == ["hisparse-junk", "hisparse-live", "unrelated"]
    # One pool by name: a live or unknown one only with --force.
    for refused in ("live", "junk"):
        assert cli.main(["shm", "clean", "--dir", folder, "--name", refused]) == 1
        assert "refusing to remove" in capsys.readouterr().err
    assert cli.main(["shm", "clean", "--dir", folder, "--name", "live", "--force",
                     "--json", "-"]) == 0
    document = json.loads(capsys.readouterr().out)
    assert document["schema"] == "hisparse-triton/shm" and document["schema_version"] == 1
    assert [p["name"] for p in document["removed"]] == ["live"]
    assert [p["name"] for p in document["pools"]] == ["junk"]
    assert cli.main(["shm", "clean", "--dir", folder, "--name", "nope"]) == 1
    assert "there is no shared host pool 'nope'" in capsys.readouterr().err
    assert cli.main(["shm", "clean", "--dir", folder, "--force"]) == 1
    assert "--name" in capsys.readouterr().err
    assert cli.main(["shm", "clean", "--dir", folder, "--name", "../x"]) == 1


def _dead_pid() -> int:
    """The pid of a process that has exited and been reaped."""
    child = subprocess.Popen(["true"])
    child.wait()
    return child.pid


def test_liveness_of_the_creator():
    me = PoolHeader.for_this_process(4096, None)
    assert creator_alive(me) is True
    assert creator_alive(dataclasses.replace(me, creator_pid=_dead_pid())) is False
    # The pid now belongs to a process that started at another time: pid reuse.
    assert creator_alive(dataclasses.replace(me, creator_start_ticks=1)) is False
    # Created in another pid namespace: cannot tell.
    assert creator_alive(dataclasses.replace(me, pid_namespace=1)) is None


@pytest.fixture
def fake_cuda(monkeypatch):
    """A CUDA runtime that records ``cudaHostRegister`` calls (``fail_flags``: flags it
    refuses with cudaErrorNotSupported)."""
    log = []

    class Cudart:
        fail_flags = 0
        registered = {}

        def cudaHostRegister(self, ptr, size, flags):  # noqa: N802 - the CUDA name
            log.append(("register", ptr, size, flags))
            if flags & self.fail_flags:
                return 801
            self.registered[ptr] = size
            return 0

        def cudaHostUnregister(self, ptr):  # noqa: N802
            log.append(("unregister", ptr))
            return 0 if self.registered.pop(ptr, None) else 713

        def cudaGetErrorString(self, err):  # noqa: N802
            return f"error {int(err)}"

    cudart = Cudart()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: cudart)
    monkeypatch.setattr(torch.cuda, "synchronize",
                        lambda device=None: log.append(("synchronize", device)))
    return log


def test_an_attached_rank_registers_its_view_read_only(fake_cuda, caplog, monkeypatch):
    log = fake_cuda
    name = unique_name()
    with HostPool(4096, shared_name=name, create=True, secret=SECRET) as pool:
        with HostPool(4096, shared_name=name, create=False, secret=SECRET) as other:
            assert other.pinned and not other.writable
        # cudaHostRegisterPortable | Mapped for the creator, | ReadOnly (8) for the attacher
        assert [(c[0], c[3]) for c in log if c[0] == "register"] == [("register", 3),
                                                                    ("register", 11)]
        # A device without read-only registration: the rank maps the file read-write.
        cudart = torch.cuda.cudart()
        monkeypatch.setattr(type(cudart), "fail_flags", 8)
        del log[:]
        with caplog.at_level("WARNING", logger="hisparse_triton.worker.pools"):
            with HostPool(4096, shared_name=name, create=False, secret=SECRET) as other:
                assert other.pinned and other.writable
                pool.tensor[3] = 9
                assert int(other.tensor[3]) == 9
        assert [c[3] for c in log if c[0] == "register"] == [11, 3]
        assert "cudaHostRegisterReadOnly failed" in caplog.text
