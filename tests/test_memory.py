"""Memory checks before allocating: available RAM (cgroup-aware) and ``check_memory``."""

import pytest
import torch

from hisparse_triton import memory
from hisparse_triton.errors import CapacityError, HostMemoryError
from hisparse_triton.memory import MemoryRequest, check_memory
from hisparse_triton.worker.pools import DevicePool, HostPool

CPU = torch.device("cpu")


def test_available_ram_is_positive():
    assert memory.available_ram_bytes() > 0


def _write(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_cgroup_v2_limit_caps_available_ram(tmp_path):
    _write(tmp_path / "proc", "0::/kubepods/pod1/ctr\n")
    root = tmp_path / "cg"
    _write(root / "kubepods/pod1/ctr/memory.max", "max\n")          # no limit of its own
    _write(root / "kubepods/pod1/memory.max", "1000000\n")          # the pod's limit
    _write(root / "kubepods/pod1/memory.current", "600000\n")
    _write(root / "kubepods/pod1/memory.stat", "anon 500000\ninactive_file 100000\n")
    _write(root / "kubepods/memory.max", "5000000\n")
    _write(root / "kubepods/memory.current", "4500000\n")           # 500000 left up here
    assert memory.cgroup_available_bytes(str(tmp_path / "proc"), str(root)) == 500_000


def test_cgroup_v1_limit_and_unlimited(tmp_path):
    _write(tmp_path / "proc", "12:cpu,cpuacct:/x\n4:memory:/docker/abc\n0::/\n")
    root = tmp_path / "cg"
    _write(root / "memory/docker/abc/memory.limit_in_bytes", "2000000\n")
    _write(root / "memory/docker/abc/memory.usage_in_bytes", "1500000\n")
    _write(root / "memory/docker/abc/memory.stat", "cache 1\ntotal_inactive_file 250000\n")
    _write(root / "memory/memory.limit_in_bytes", "9223372036854771712\n")   # unlimited
    assert memory.cgroup_available_bytes(str(tmp_path / "proc"), str(root)) == 750_000
    _write(root / "memory/docker/abc/memory.limit_in_bytes", "9223372036854771712\n")
    assert memory.cgroup_available_bytes(str(tmp_path / "proc"), str(root)) is None
    assert memory.cgroup_available_bytes(str(tmp_path / "missing"), str(root)) is None


def test_available_ram_is_the_smaller_of_meminfo_and_cgroup(monkeypatch):
    monkeypatch.setattr(memory, "_meminfo_available", lambda: 10 << 30)
    monkeypatch.setattr(memory, "cgroup_available_bytes", lambda: 3 << 30)
    assert memory.available_ram_bytes() == 3 << 30
    monkeypatch.setattr(memory, "cgroup_available_bytes", lambda: None)
    assert memory.available_ram_bytes() == 10 << 30


# ----------------------------------------------------------------------------- check_memory
@pytest.fixture
def ram(monkeypatch):
    """Pretend this process can get 1 MiB of RAM."""
    monkeypatch.setattr(memory, "available_ram_bytes", lambda: 1 << 20)
    return 1 << 20


def test_host_items_are_counted_together(ram):
    pool = MemoryRequest("host pool", 500_000, CPU, hint="host_pool_gib")
    device = MemoryRequest("device pool", 300_000, CPU, hint="num_gpu_blocks_override")
    tables = MemoryRequest("request tables", 200_000, torch.device("cpu"), hint="max_num_seqs")
    check_memory([pool, device], max_ram_fraction=0.9)       # 800_000 <= 943_718
    with pytest.raises(HostMemoryError) as info:             # each fits, together they do not
        check_memory([pool, device, tables], max_ram_fraction=0.9)
    message = str(info.value)
    for part in ("host pool 500000 B", "device pool 300000 B", "request tables 200000 B",
                 "= 1000000 B", "exceeds 90% of the available RAM (1048576 B",
                 "lower host_pool_gib or num_gpu_blocks_override or max_num_seqs"):
        assert part in message
    assert info.value.needed == 1_000_000 and info.value.available == ram
    assert isinstance(info.value, CapacityError) and isinstance(info.value, MemoryError)
    check_memory([pool, device, tables], max_ram_fraction=1.0)
    check_memory([], max_ram_fraction=0.5)


def test_unchecked_devices_and_bad_requests(ram):
    check_memory([MemoryRequest("scratch", 1 << 40, torch.device("meta"))],
                 max_ram_fraction=0.9)
    with pytest.raises(ValueError, match="max_ram_fraction must be in"):
        check_memory([], max_ram_fraction=0)
    with pytest.raises(ValueError, match="nbytes of 'x' must be an int >= 0, got -1"):
        MemoryRequest("x", -1, CPU)
    with pytest.raises(ValueError, match="device of 'x' is not a device"):
        MemoryRequest("x", 1, "nowhere")
    with pytest.raises(ValueError, match="MemoryRequest items"):
        check_memory([("host pool", 1, CPU)], max_ram_fraction=0.9)
    assert MemoryRequest("x", 1, "cpu").device == CPU


@pytest.fixture
def two_gpus(monkeypatch):
    """Two fake CUDA devices with 1000 and 5000 free bytes."""
    free = {0: 1000, 1: 5000}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (free[device.index], 8000))
    return free


def test_each_gpu_is_counted_on_its_own(two_gpus, ram):
    a = MemoryRequest("device pool", 600, torch.device("cuda", 0))
    b = MemoryRequest("request tables", 600, torch.device("cuda"))   # the current device: 0
    check_memory([a, MemoryRequest("device pool", 4000, torch.device("cuda", 1))],
                 max_ram_fraction=0.9)
    with pytest.raises(CapacityError, match=r"device pool 600 B \+ request tables 600 B = "
                                            r"1200 B .*does not fit the 1000 B free on "
                                            r"cuda:0") as info:
        check_memory([a, b, MemoryRequest("host pool", 1000, CPU)], max_ram_fraction=0.9)
    assert not isinstance(info.value, HostMemoryError)
    assert info.value.needed == 1200 and info.value.available == 1000
    with pytest.raises(ValueError, match="cuda:5: this machine has 2 CUDA device"):
        check_memory([MemoryRequest("x", 1, torch.device("cuda", 5))], max_ram_fraction=0.9)


def test_a_gpu_request_without_cuda_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="CUDA is not available"):
        check_memory([MemoryRequest("x", 1, torch.device("cuda", 0))], max_ram_fraction=0.9)


# ----------------------------------------------------------------------------- the pools
def test_a_device_pool_on_the_cpu_checks_the_ram(ram):
    with pytest.raises(HostMemoryError, match=r"device pool \(4 blocks x 262144 B\) 1048576 B "
                                              r".*exceeds 90% of the available RAM"):
        DevicePool(4, 1 << 18, "cpu")
    DevicePool(4, 1 << 18, "cpu", max_ram_fraction=1.0).close()
    with pytest.raises(ValueError, match="max_ram_fraction"):
        DevicePool(1, 1, "cpu", max_ram_fraction=2)


def test_a_device_pool_on_cuda_checks_the_free_memory_before_allocating(two_gpus, monkeypatch):
    monkeypatch.setattr(torch, "zeros", lambda *a, **k: pytest.fail("allocated"))
    with pytest.raises(CapacityError, match="does not fit the 1000 B free on cuda:0; lower "
                                            "num_gpu_blocks_override or the GPU memory budget"):
        DevicePool(4, 256, "cuda:0")


def test_the_pools_say_what_they_would_allocate():
    assert HostPool.memory_requests(5000) == [
        MemoryRequest("host pool", 8192, CPU, hint="host_pool_gib")]
    assert HostPool.memory_requests(5000, shared=True)[0].nbytes == 8192 + 4096  # + header
    assert HostPool.memory_requests(5000, shared=True, create=False) == []    # attaches
    [request] = DevicePool.memory_requests(3, 100, "cpu")
    assert request.nbytes == 300 and request.device == CPU


def test_a_host_pool_and_a_device_pool_checked_together(ram):
    """What a runtime does before allocating: both pools against the RAM at once."""
    requests = [*HostPool.memory_requests(600_000), *DevicePool.memory_requests(2, 200_000,
                                                                                "cpu")]
    with pytest.raises(HostMemoryError, match=r"host pool 602112 B .* \+ device pool "
                                              r"\(2 blocks x 200000 B\) 400000 B"):
        check_memory(requests, max_ram_fraction=0.9)
