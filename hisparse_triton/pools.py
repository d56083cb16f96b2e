"""The two byte pools of the runtime: ``HostPool`` (pinned host memory) and ``DevicePool``.

Both are ONE ``uint8`` buffer; layers are strided views into it (see ``KVCacheTensor``), so a
transfer kernel addresses any layer by a byte offset into one buffer (``RowTable``).

``HostPool`` holds every source (sparse-MLA) layer's full KV history. On a CUDA machine it is
pinned in place with ``cudaHostRegister`` rather than allocated with ``pin_memory=True``:
torch's caching pinned allocator may round a huge request up (to the next power of two) and
keeps the block cached after release, while registering an exact-size, 4 KiB-aligned buffer
costs exactly the bytes asked for and is unpinned deliberately in ``close()``. Without CUDA
it is plain CPU memory. Before allocating, it checks the machine's available RAM and refuses
with ``HostMemoryError`` instead of letting the OS kill the process later.
"""

from __future__ import annotations

import os
from typing import Optional

import torch

from hisparse_triton.errors import CapacityError, HostMemoryError, RuntimeClosedError

#: Alignment of the host pool's first byte (one page; what DMA engines like).
HOST_ALIGNMENT = 4096

#: ``cudaHostRegisterPortable | cudaHostRegisterMapped``: pinned for every CUDA context and
#: mapped into the device address space (with unified addressing the device pointer equals
#: the host pointer, which is what the transfer kernels dereference).
_REGISTER_FLAGS = 1 | 2


def available_ram_bytes() -> int:
    """``MemAvailable`` from ``/proc/meminfo`` (bytes); falls back to free physical pages."""
    try:
        with open("/proc/meminfo", encoding="ascii") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):  # pragma: no cover - exotic platforms
        return 1 << 62


class HostPool:
    """One host allocation of ``size_bytes`` (rounded up to 4 KiB), 4 KiB aligned.

    - ``pin``: register the buffer with CUDA (default: when CUDA is available).
    - ``max_ram_fraction``: refuse (``HostMemoryError``) if the pool needs more than this
      fraction of the currently available RAM.

    ``tensor`` is the ``[size_bytes] uint8`` buffer; ``close()`` waits for the device,
    unregisters the buffer and drops it; it is idempotent, and ``with HostPool(...)`` closes.
    """

    def __init__(self, size_bytes: int, *, pin: Optional[bool] = None,
                 max_ram_fraction: float = 0.9) -> None:
        if not isinstance(size_bytes, int) or isinstance(size_bytes, bool) or size_bytes <= 0:
            raise ValueError(f"HostPool size must be a positive number of bytes, "
                             f"got {size_bytes!r}.")
        size = -(-size_bytes // HOST_ALIGNMENT) * HOST_ALIGNMENT
        available = available_ram_bytes()
        if size > max_ram_fraction * available:
            raise HostMemoryError(
                f"host pool of {size} B ({size / (1 << 30):.2f} GiB) exceeds "
                f"{max_ram_fraction:.0%} of the available RAM ({available} B, "
                f"{available / (1 << 30):.2f} GiB); lower host_pool_gib.",
                resource="host RAM bytes", needed=size, available=available)
        if pin is None:
            pin = torch.cuda.is_available()
        if pin and not torch.cuda.is_available():
            raise RuntimeError("HostPool(pin=True) needs CUDA; this machine has none.")
        # Over-allocate by one alignment unit and slice the aligned window out of it.
        self._base: Optional[torch.Tensor] = torch.empty(size + HOST_ALIGNMENT,
                                                         dtype=torch.uint8)
        shift = (-self._base.data_ptr()) % HOST_ALIGNMENT
        self._tensor: Optional[torch.Tensor] = self._base[shift:shift + size]
        self.size_bytes = size
        self.pinned = False
        if pin:
            err = int(torch.cuda.cudart().cudaHostRegister(self._tensor.data_ptr(), size,
                                                           _REGISTER_FLAGS))
            if err != 0:
                self._base = self._tensor = None
                raise HostMemoryError(
                    f"cudaHostRegister of the {size} B host pool failed with cudaError "
                    f"{err}; the OS may limit locked memory (ulimit -l).",
                    resource="pinned host bytes", needed=size, available=available)
            self.pinned = True

    @property
    def closed(self) -> bool:
        return self._tensor is None

    @property
    def tensor(self) -> torch.Tensor:
        if self._tensor is None:
            raise RuntimeClosedError("the host pool is closed.")
        return self._tensor

    @property
    def data_ptr(self) -> int:
        return self.tensor.data_ptr()

    def view(self, offset: int, num_blocks: int, block_size: int, row_bytes: int,
             block_stride: int) -> torch.Tensor:
        """``[num_blocks, block_size, row_bytes] uint8`` view of one layer at byte ``offset``."""
        return _strided_view(self.tensor, offset, num_blocks, block_size, row_bytes,
                             block_stride)

    def close(self) -> None:
        """Unpin (after the device finished using the buffer) and release; idempotent."""
        if self._tensor is None:
            return
        if self.pinned:
            torch.cuda.synchronize()
            err = int(torch.cuda.cudart().cudaHostUnregister(self._tensor.data_ptr()))
            self.pinned = False
            if err != 0:  # pragma: no cover - driver failure
                self._tensor = self._base = None
                raise RuntimeError(f"cudaHostUnregister of the host pool failed with "
                                   f"cudaError {err}.")
        self._tensor = self._base = None

    def __enter__(self) -> "HostPool":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:  # never free registered memory without unregistering it
        try:
            self.close()
        except Exception:  # pragma: no cover - interpreter shutdown
            pass


class DevicePool:
    """The shared device pool: ``num_blocks`` blocks of ``bytes_per_block`` bytes, block-outermost.

    Every device group's layers view the same buffer at their own in-block byte offsets; the
    resident and hot views of a sparse layer are the same bytes. The buffer is zero-filled.
    """

    def __init__(self, num_blocks: int, bytes_per_block: int,
                 device: torch.device | str = "cpu") -> None:
        for name, value in (("num_blocks", num_blocks), ("bytes_per_block", bytes_per_block)):
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"DevicePool.{name} must be a positive int, got {value!r}.")
        device = torch.device(device)
        size = num_blocks * bytes_per_block
        if device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(device)
            if size > free:
                raise CapacityError(
                    f"device pool of {num_blocks} blocks x {bytes_per_block} B = {size} B does "
                    f"not fit the {free} B free on {device}; lower num_gpu_blocks_override or "
                    f"the GPU memory budget.", resource="device bytes", needed=size,
                    available=free)
        self.num_blocks = num_blocks
        self.bytes_per_block = bytes_per_block
        self.device = device
        self._tensor: Optional[torch.Tensor] = torch.zeros(size, dtype=torch.uint8,
                                                           device=device)

    @property
    def closed(self) -> bool:
        return self._tensor is None

    @property
    def tensor(self) -> torch.Tensor:
        if self._tensor is None:
            raise RuntimeClosedError("the device pool is closed.")
        return self._tensor

    @property
    def size_bytes(self) -> int:
        return self.num_blocks * self.bytes_per_block

    def view(self, offset: int, block_size: int, row_bytes: int) -> torch.Tensor:
        """``[num_blocks, block_size, row_bytes] uint8`` view of the layer at in-block ``offset``."""
        if offset < 0 or offset + block_size * row_bytes > self.bytes_per_block:
            raise ValueError(f"a page of {block_size} x {row_bytes} B at in-block offset "
                             f"{offset} does not fit a {self.bytes_per_block} B block.")
        return _strided_view(self.tensor, offset, self.num_blocks, block_size, row_bytes,
                             self.bytes_per_block)

    def close(self) -> None:
        """Drop the buffer (views taken earlier keep their storage alive); idempotent."""
        self._tensor = None


def _strided_view(buffer: torch.Tensor, offset: int, num_blocks: int, block_size: int,
                  row_bytes: int, block_stride: int) -> torch.Tensor:
    end = offset + (num_blocks - 1) * block_stride + block_size * row_bytes
    if offset < 0 or block_stride < block_size * row_bytes or end > buffer.numel():
        raise ValueError(f"a layer view at offset {offset} ({num_blocks} blocks x "
                         f"{block_size} x {row_bytes} B, block stride {block_stride}) does not "
                         f"fit a {buffer.numel()} B pool.")
    return buffer.as_strided((num_blocks, block_size, row_bytes), (block_stride, row_bytes, 1),
                             buffer.storage_offset() + offset)
