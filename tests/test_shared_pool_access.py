"""Who may create, attach to and write a shared host pool.

Created 0600 (0640 and a named group); an attaching rank refuses a file of another owner, one
open to others, one of another group, and one whose run secret differs (a planted file
carrying the right plan); every tensor an attached rank hands out refuses writes; ``shm list``
shows owner and mode; the secret travels from rank 0 with a broadcast.
"""

from __future__ import annotations

import json
import os
import stat

import pytest

from hisparse_triton import cli
from hisparse_triton.errors import ReadOnlyViewError, SharedHostPoolError
from hisparse_triton.worker import shared_pool
from hisparse_triton.worker.pools import HostPool, shared_host_pool_path
from tests.test_shared_host_pool import L0, make_rank, shared_plan, unique_name

SECRET = "ffeeddccbbaa99887766554433221100"
IS_ROOT = os.geteuid() == 0


def mode_of(path: str) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_a_pool_is_created_owner_only_with_a_random_secret_whatever_the_umask():
    name = unique_name()
    old = os.umask(0)
    try:
        with HostPool(4096, shared_name=name, create=True, pin=False) as pool:
            assert mode_of(pool.path) == 0o600 and os.stat(pool.path).st_uid == os.geteuid()
            assert len(pool.secret) == 32 and int(pool.secret, 16) >= 0
            with HostPool(4096, shared_name=unique_name(), create=True, pin=False) as other:
                assert other.secret != pool.secret            # one per run
    finally:
        os.umask(old)


def test_an_attach_needs_the_creators_secret():
    name = unique_name()
    with HostPool(4096, shared_name=name, create=True, pin=False) as pool:
        with pytest.raises(ValueError, match="needs the run's secret"):
            HostPool(4096, shared_name=name, create=False, pin=False)
        with pytest.raises(SharedHostPoolError, match="not created by this run's rank 0: its "
                                                      "secret differs"):
            HostPool(4096, shared_name=name, create=False, pin=False, secret=SECRET)
        with pytest.raises(ValueError, match="32 hex digits"):
            HostPool(4096, shared_name=name, create=False, pin=False, secret="xyz")
        with HostPool(4096, shared_name=name, create=False, pin=False,
                      secret=pool.secret) as attached:
            assert attached.secret == pool.secret
        with HostPool(4096, shared_name=name, create=False, pin=False,
                      secret=bytes.fromhex(pool.secret)):
            pass


def test_a_planted_file_with_the_right_plan_is_refused():
    """Someone else writes a well-formed header with the right size and fingerprint: the
    secret (made by this run's rank 0, never written anywhere else) still differs."""
    name = unique_name()
    path = shared_host_pool_path(name)
    planted = shared_pool.PoolHeader.for_this_process(4096, "plan", bytes(16))
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.write(fd, planted.pack() + bytes(4096))
        os.close(fd)
        with pytest.raises(SharedHostPoolError, match="secret differs"):
            HostPool(4096, shared_name=name, create=False, pin=False, secret=SECRET,
                     fingerprint="plan")
    finally:
        os.unlink(path)


def test_a_file_open_to_others_or_owned_by_someone_else_is_refused():
    name = unique_name()
    with HostPool(4096, shared_name=name, create=True, pin=False, secret=SECRET) as pool:
        os.chmod(pool.path, 0o644)
        with pytest.raises(SharedHostPoolError, match=r"mode 0644 lets other users read or "
                                                      r"write it") as info:
            HostPool(4096, shared_name=name, create=False, pin=False, secret=SECRET)
        assert info.value.path == pool.path and pool.path in str(info.value)
        os.chmod(pool.path, 0o600)
        if IS_ROOT:   # only root can give a file away
            os.chown(pool.path, 65534, -1)
            with pytest.raises(SharedHostPoolError, match=r"owner .*\(uid 65534\).* is not "
                                                          r"this process's user"):
                HostPool(4096, shared_name=name, create=False, pin=False, secret=SECRET)
            os.chown(pool.path, os.geteuid(), -1)
        with HostPool(4096, shared_name=name, create=False, pin=False, secret=SECRET):
            pass


def test_a_group_pool_is_0640_of_that_group_and_attached_by_its_members():
    gid = os.getegid()
    name = unique_name()
    with HostPool(4096, shared_name=name, create=True, pin=False, secret=SECRET,
                  group=gid) as pool:
        assert mode_of(pool.path) == 0o640 and os.stat(pool.path).st_gid == gid
        with HostPool(4096, shared_name=name, create=False, pin=False, secret=SECRET,
                      group=gid):
            pass
        with pytest.raises(SharedHostPoolError, match="lets other users read"):
            HostPool(4096, shared_name=name, create=False, pin=False, secret=SECRET)
        other_gid = gid + 1
        with pytest.raises(SharedHostPoolError, match=rf"its group is .*\(gid {gid}\), not "
                                                      rf".*\(gid {other_gid}\)"):
            HostPool(4096, shared_name=name, create=False, pin=False, secret=SECRET,
                     group=other_gid)
        os.chmod(pool.path, 0o660)
        with pytest.raises(SharedHostPoolError, match="gives the group write access"):
            HostPool(4096, shared_name=name, create=False, pin=False, secret=SECRET,
                     group=gid)
    with pytest.raises(ValueError, match="is not a group of this machine"):
        HostPool(4096, shared_name=unique_name(), create=True, pin=False,
                 group="no-such-group-hisparse")


def test_shm_list_shows_owner_and_mode(capsys):
    name = unique_name()
    with HostPool(4096, shared_name=name, create=True, pin=False, secret=SECRET):
        assert cli.main(["shm", "list", "--json", "-"]) == 0
        listed = {p["name"]: p for p in json.loads(capsys.readouterr().out)["pools"]}
        assert listed[name]["mode"] == "0600" and listed[name]["owner_uid"] == os.geteuid()
        assert listed[name]["owner"] and SECRET not in json.dumps(listed[name])
        assert cli.main(["shm", "list"]) == 0
        table = capsys.readouterr().out
        assert "OWNER" in table and "MODE" in table
        line = next(row for row in table.splitlines() if name in row)
        assert "0600" in line and SECRET not in table


def test_an_attached_ranks_views_refuse_writes_through_the_worker_and_facade():
    kvc, config = shared_plan()
    name = unique_name()
    rank0 = make_rank(kvc, config, 0, name)
    rank1 = make_rank(kvc, config, 1, name)
    try:
        assert rank0.worker.host_pool_secret == rank1.worker.host_pool_secret
        view = rank1.host_cache(L0)
        with pytest.raises(ReadOnlyViewError):
            view[1, 0] = 7
        with pytest.raises(ReadOnlyViewError):
            rank1.worker.host_pool.tensor.zero_()
        rank0.host_cache(L0)[1, 0] = 7                      # rank 0 writes its pool
        assert bool((view[1, 0] == 7).all())
    finally:
        rank1.close()
        rank0.close()


def test_the_worker_needs_the_secret_on_every_rank_but_0():
    kvc, config = shared_plan()
    from hisparse_triton.worker import HiSparseWorker

    with pytest.raises(ValueError, match="tp_rank 1 attaches to the shared host pool .*pass "
                                         "host_pool_secret"):
        HiSparseWorker(kvc, config, max_num_seqs=2, device="cpu", tp_rank=1,
                       host_pool_name=unique_name())
    with pytest.raises(ValueError, match="32 hex digits"):
        HiSparseWorker(kvc, config, max_num_seqs=2, device="cpu", tp_rank=1,
                       host_pool_name=unique_name(), host_pool_secret="short")
    private_kvc, private_config = shared_plan(shared=False, tp=1)
    with pytest.raises(ValueError, match="host_pool_secret='x' was given but"):
        HiSparseWorker(private_kvc, private_config, max_num_seqs=2, device="cpu",
                       host_pool_secret="x")


def test_the_secret_travels_with_a_broadcast(tmp_path):
    """``broadcast_host_pool_secret`` over a one-rank gloo group returns the secret."""
    import torch.distributed as dist

    from hisparse_triton.distributed import broadcast_host_pool_secret

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0,
                            world_size=1)
    try:
        assert broadcast_host_pool_secret(SECRET) == SECRET
        with pytest.raises(ValueError, match="32 hex digits"):
            broadcast_host_pool_secret("nope")
    finally:
        dist.destroy_process_group()
