"""HostPool / DevicePool: alignment, RAM check, pinning, views, close()."""

import pytest
import torch

from hisparse_triton import pools
from hisparse_triton.errors import CapacityError, HostMemoryError, RuntimeClosedError
from hisparse_triton.pools import HOST_ALIGNMENT, DevicePool, HostPool

HAS_CUDA = torch.cuda.is_available()


def test_host_pool_is_aligned_and_rounded():
    with HostPool(10_000, pin=False) as pool:
        assert pool.size_bytes == 12_288
        assert pool.tensor.numel() == 12_288 and pool.tensor.dtype == torch.uint8
        assert pool.data_ptr % HOST_ALIGNMENT == 0
        assert not pool.pinned
    assert pool.closed


def test_host_pool_refuses_more_than_available_ram(monkeypatch):
    monkeypatch.setattr(pools, "available_ram_bytes", lambda: 1 << 20)
    with pytest.raises(HostMemoryError, match=r"exceeds 90% of the available RAM \(1048576 B") \
            as info:
        HostPool(1 << 20, pin=False)
    assert isinstance(info.value, CapacityError)
    assert info.value.needed == 1 << 20 and info.value.available == 1 << 20
    HostPool(900_000, pin=False, max_ram_fraction=0.9).close()


def test_available_ram_is_positive():
    assert pools.available_ram_bytes() > 0


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
    with pytest.raises(RuntimeError, match="needs CUDA"):
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
