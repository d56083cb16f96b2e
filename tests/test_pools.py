"""HostPool / DevicePool: alignment, RAM check, pinning, views, close()."""

import pytest
import torch

from hisparse_triton import memory
from hisparse_triton.errors import CapacityError, HostMemoryError, RuntimeClosedError
from hisparse_triton.worker.pools import HOST_ALIGNMENT, DevicePool, HostPool

HAS_CUDA = torch.cuda.is_available()


def test_host_pool_is_aligned_and_rounded():
    with HostPool(10_000, pin=False) as pool:
        assert pool.size_bytes == 12_288
        assert pool.tensor.numel() == 12_288 and pool.tensor.dtype == torch.uint8
        assert pool.data_ptr % HOST_ALIGNMENT == 0
        assert not pool.pinned
    assert pool.closed


def test_host_pool_refuses_more_than_available_ram(monkeypatch):
    monkeypatch.setattr(memory, "available_ram_bytes", lambda: 1 << 20)
    with pytest.raises(HostMemoryError, match=r"exceeds 90% of the available RAM \(1048576 B") \
            as info:
        HostPool(1 << 20, pin=False)
    assert isinstance(info.value, CapacityError)
    assert info.value.needed == 1 << 20 and info.value.available == 1 << 20
    HostPool(900_000, pin=False, max_ram_fraction=0.9).close()


def test_host_pool_close_is_idempotent_and_blocks_use():
    pool = HostPool(4096, pin=False)
    pool.close()
    pool.close()
    with pytest.raises(RuntimeClosedError):
        _ = pool.tensor


def test_host_pool_views_are_layer_major():
    with HostPool(2 * 3 * 4 * 8, pin=False) as pool:
        # two layers of 3 blocks x 4 rows x 8 B, layer-major
        region = 3 * 4 * 8
        v0 = pool.view(0, 3, 4, 8, 32)
        v1 = pool.view(region, 3, 4, 8, 32)
        v1.fill_(7)
        v0.fill_(1)
        assert pool.tensor[:region].eq(1).all() and pool.tensor[region:2 * region].eq(7).all()
        with pytest.raises(ValueError, match="does not fit"):
            pool.view(pool.size_bytes - 95, 3, 4, 8, 32)


@pytest.mark.parametrize("bad", [0, -1, 1.5])
def test_host_pool_bad_size(bad):
    with pytest.raises(ValueError):
        HostPool(bad, pin=False)


@pytest.mark.skipif(HAS_CUDA, reason="checks the no-CUDA path")
def test_host_pool_pin_without_cuda_raises():
    with pytest.raises(RuntimeError, match=r"needs a GPU runtime \(CUDA or ROCm\)"):
        HostPool(4096, pin=True)
    assert not HostPool(4096).pinned  # default: no pinning without CUDA


@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_host_pool_pins_in_place_and_unpins():
    pool = HostPool(1 << 20)
    assert pool.pinned and pool.tensor.is_pinned()
    assert pool.data_ptr % HOST_ALIGNMENT == 0
    dev = torch.arange(256, dtype=torch.uint8, device="cuda").repeat(16)
    pool.tensor[:4096].copy_(dev, non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(pool.tensor[:4096], dev.cpu())
    pool.close()
    assert not pool.pinned and pool.closed
    pool.close()


def test_device_pool_views_share_bytes():
    pool = DevicePool(4, 256, "cpu")
    assert pool.tensor.numel() == 1024 and pool.tensor.eq(0).all()
    a = pool.view(0, 4, 16)        # 64 B page at offset 0
    b = pool.view(64, 4, 32)       # 128 B page at offset 64
    again = pool.view(64, 4, 32)
    b[2, 1].fill_(9)
    assert again[2, 1].eq(9).all()
    assert pool.tensor[2 * 256 + 64 + 32: 2 * 256 + 64 + 64].eq(9).all()
    assert a.eq(0).all()
    assert a.shape == (4, 4, 16) and a.stride() == (256, 16, 1)
    with pytest.raises(ValueError, match="does not fit"):
        pool.view(200, 4, 16)
    pool.close()
    pool.close()
    with pytest.raises(RuntimeClosedError):
        pool.view(0, 4, 16)


@pytest.mark.parametrize("args", [(0, 16), (4, 0), (4, -1)])
def test_device_pool_bad_sizes(args):
    with pytest.raises(ValueError):
        DevicePool(*args)


class _CudaError:
    """Stands in for the pybind ``cudaError`` enum ``torch.cuda.cudart()`` returns."""

    def __init__(self, code):
        self.code = code

    def __int__(self):
        return self.code


class _FakeCudart:
    """Records the calls ``HostPool`` makes through ``torch.cuda.cudart()``."""

    def __init__(self, log, fail=0):
        self.log, self.fail, self.registered = log, fail, {}

    def cudaHostRegister(self, ptr, size, flags):  # noqa: N802 - the CUDA name
        self.log.append(("register", ptr, size, flags))
        if self.fail:
            return _CudaError(self.fail)
        self.registered[ptr] = size
        return _CudaError(0)

    def cudaHostUnregister(self, ptr):  # noqa: N802
        self.log.append(("unregister", ptr))
        return _CudaError(0 if self.registered.pop(ptr, None) else 713)

    def cudaGetErrorString(self, err):  # noqa: N802
        return f"error {int(err)}"


@pytest.fixture
def fake_cuda(monkeypatch):
    """A CUDA runtime that records calls (the pinning logic without a GPU)."""
    log = []
    state = {"cudart": _FakeCudart(log)}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: state["cudart"])
    monkeypatch.setattr(torch.cuda, "synchronize",
                        lambda device=None: log.append(("synchronize", device)))
    return log, state


def test_host_pool_registers_exact_aligned_bytes_and_unpins_before_release(fake_cuda):
    log, state = fake_cuda
    pool = HostPool(10_000, device="cuda:1")
    ptr = pool.data_ptr
    assert pool.pinned and ptr % HOST_ALIGNMENT == 0
    # cudaHostRegister(ptr, size, cudaHostRegisterPortable | cudaHostRegisterMapped)
    assert log == [("register", ptr, 12_288, 3)]
    pool.close()
    assert log[1:] == [("synchronize", torch.device("cuda", 1)), ("unregister", ptr)]
    assert pool.closed and not pool.pinned and not state["cudart"].registered
    pool.close()
    del pool
    assert len(log) == 3                           # idempotent: nothing unregistered twice


def test_host_pool_register_failure_is_a_clear_error(fake_cuda):
    log, state = fake_cuda
    state["cudart"] = _FakeCudart(log, fail=2)
    with pytest.raises(HostMemoryError, match=r"cudaHostRegister of the 8192 B .* failed with "
                                              r"cudaError 2 \(error 2\); .*ulimit -l") as info:
        HostPool(8192)
    assert info.value.needed == 8192 and isinstance(info.value, CapacityError)
    assert [call[0] for call in log] == ["register"]   # nothing to unregister, nothing leaked


def test_host_pool_unpinned_pool_never_calls_cuda(fake_cuda):
    log, _ = fake_cuda
    with HostPool(4096, pin=False) as pool:
        assert not pool.pinned
    assert log == []


@pytest.mark.parametrize("fraction", [0, -0.5, 1.5, True, "0.5"])
def test_host_pool_bad_ram_fraction(fraction):
    with pytest.raises(ValueError, match="max_ram_fraction"):
        HostPool(4096, pin=False, max_ram_fraction=fraction)
