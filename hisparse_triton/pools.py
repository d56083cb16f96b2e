"""The two byte pools of the runtime: ``HostPool`` (pinned host memory) and ``DevicePool``.

Both are ONE ``uint8`` buffer; layers are strided views into it (see ``KVCacheTensor``), so a
transfer kernel addresses any layer by a byte offset into one buffer (``RowTable``).

``HostPool`` holds every source (sparse-MLA) layer's full KV history. On a CUDA machine it is
pinned in place with ``cudaHostRegister`` rather than allocated with ``pin_memory=True``:
torch's caching pinned allocator may round a huge request up (to the next power of two) and
keeps the block cached after release, while registering an exact-size, 4 KiB-aligned buffer
costs exactly the bytes asked for and is unpinned deliberately in ``close()``. Without CUDA
it is plain CPU memory. Before allocating, it checks the available RAM (``MemAvailable``,
capped by a container's cgroup memory limit) and refuses with ``HostMemoryError`` instead of
letting the OS kill the process later.

Shared mode (``HostPool(..., shared_name=NAME, create=...)``): the pool is a file
``<dir>/hisparse-NAME`` (``dir`` = ``/dev/shm``, else the system temp dir) mapped with
``MAP_SHARED`` (``torch.from_file(shared=True)``), so the tensor-parallel ranks of one node
hold ONE copy of the (identical) MLA KV history. The creating rank makes the file
exclusively at its exact size and unlinks it in ``close()``; the other ranks attach to it.
"""

from __future__ import annotations

import ctypes
import errno
import os
import re
import tempfile
from typing import Optional

import torch

from hisparse_triton.errors import (
    CapacityError,
    HostMemoryError,
    RuntimeClosedError,
    SharedHostPoolError,
)

#: Alignment of the host pool's first byte (one page; what DMA engines like).
HOST_ALIGNMENT = 4096

#: ``cudaHostRegisterPortable | cudaHostRegisterMapped``: pinned for every CUDA context and
#: mapped into the device address space, so the transfer kernels can dereference it (Triton's
#: launcher translates the host pointer with ``cuPointerGetAttribute``; with unified
#: addressing both are equal).
_REGISTER_FLAGS = 1 | 2


def _meminfo_available() -> int:
    """``MemAvailable`` from ``/proc/meminfo`` (bytes); falls back to free physical pages."""
    try:
        with open("/proc/meminfo", encoding="ascii") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):  # pragma: no cover - exotic platforms
        return 1 << 62


def _read_int(path: str) -> Optional[int]:
    try:
        with open(path, encoding="ascii") as file:
            text = file.read().strip()
        return int(text) if text != "max" else None
    except (OSError, ValueError):
        return None


def _stat_field(path: str, key: str) -> int:
    try:
        with open(path, encoding="ascii") as file:
            for line in file:
                name, _, value = line.partition(" ")
                if name == key:
                    return int(value)
    except (OSError, ValueError):
        pass
    return 0


#: Per cgroup version: the memory controller's folder under the mount, then the files holding
#: the limit, the usage and (in ``memory.stat``) the reclaimable inactive page cache.
_CGROUP_FILES = {
    2: ("", "memory.max", "memory.current", "inactive_file"),
    1: ("memory", "memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file"),
}


def cgroup_available_bytes(proc_cgroup: str = "/proc/self/cgroup",
                           root: str = "/sys/fs/cgroup") -> Optional[int]:
    """Bytes this process may still use under its cgroup memory limits (v1 or v2), or
    ``None`` when no limit applies.

    A container's memory limit is invisible in ``/proc/meminfo`` (which shows the whole
    machine) but is what the OOM killer enforces. For the process's cgroup and each ancestor
    with a limit: ``limit - usage + inactive page cache`` (reclaimable); the smallest wins.
    """
    try:
        with open(proc_cgroup, encoding="ascii") as file:
            entries = [line.strip().split(":", 2) for line in file if line.strip()]
    except OSError:
        return None
    best: Optional[int] = None
    for entry in entries:
        if len(entry) != 3:
            continue
        _, controllers, path = entry
        if controllers == "":
            version = 2
        elif "memory" in controllers.split(","):
            version = 1
        else:
            continue
        folder, limit_file, usage_file, inactive_key = _CGROUP_FILES[version]
        base = os.path.join(root, folder) if folder else root
        parts = [part for part in path.split("/") if part]
        for depth in range(len(parts), -1, -1):  # the cgroup, then its ancestors
            directory = os.path.join(base, *parts[:depth])
            limit = _read_int(os.path.join(directory, limit_file))
            if limit is None or limit >= 1 << 60:   # "max" / v1's "unlimited"
                continue
            usage = _read_int(os.path.join(directory, usage_file)) or 0
            inactive = _stat_field(os.path.join(directory, "memory.stat"), inactive_key)
            available = max(0, limit - usage + inactive)
            best = available if best is None else min(best, available)
    return best


def available_ram_bytes() -> int:
    """RAM this process can still get (bytes): ``MemAvailable`` from ``/proc/meminfo``,
    capped by the cgroup (container) memory limit when there is one."""
    available = _meminfo_available()
    limited = cgroup_available_bytes()
    return available if limited is None else min(available, limited)


_SHARED_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,200}")


def shared_host_pool_dir() -> str:
    """Folder of shared host pools: ``/dev/shm`` (RAM-backed), else the system temp dir."""
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


def shared_host_pool_path(name: str) -> str:
    """The backing file of the shared host pool ``name``: ``<dir>/hisparse-<name>``.

    ``ValueError`` unless ``name`` is 1-201 characters of ``[A-Za-z0-9._-]`` starting with
    a letter or digit (so it is one plain file name)."""
    if not isinstance(name, str) or _SHARED_NAME.fullmatch(name) is None:
        raise ValueError(f"a shared host pool name must be 1-201 characters of "
                         f"[A-Za-z0-9._-] starting with a letter or digit, got {name!r}.")
    return os.path.join(shared_host_pool_dir(), f"hisparse-{name}")


def _map_file(fd: int, path: str, size: int) -> torch.Tensor:
    """``[size] uint8`` ``MAP_SHARED`` mapping of the open file ``fd`` (page aligned).

    Maps through ``/proc/self/fd/N`` where it exists, so the mapping is of the very file
    checked through ``fd`` even if the name was replaced or unlinked meanwhile."""
    proc = f"/proc/self/fd/{fd}"
    source = proc if os.path.exists(proc) else path
    return torch.from_file(source, shared=True, size=size, dtype=torch.uint8)


def _clear_cuda_last_error() -> None:
    """Best effort: reset the CUDA runtime's per-thread "last error" after a failed
    ``cudaHostRegister``; otherwise torch's next kernel-launch check (``cudaGetLastError``)
    would report that stale error against an unrelated kernel. ``torch.cuda.cudart()`` does
    not bind ``cudaGetLastError``, so this calls the ``libcudart`` torch already loaded."""
    try:
        with open("/proc/self/maps", encoding="ascii", errors="replace") as maps:
            paths = {line.split()[-1] for line in maps if "libcudart" in line}
        for path in paths:
            ctypes.CDLL(path).cudaGetLastError()
    except Exception:  # noqa: BLE001 - only a nicer error later; never fail here
        pass


class _Buffer:
    """A pool's backing buffer that ``close()`` drops; using it afterwards raises."""

    _kind = "pool"
    _tensor: Optional[torch.Tensor] = None

    @property
    def closed(self) -> bool:
        return self._tensor is None

    @property
    def tensor(self) -> torch.Tensor:
        """The ``[size] uint8`` backing buffer; ``RuntimeClosedError`` after ``close()``."""
        if self._tensor is None:
            raise RuntimeClosedError(f"the {self._kind} is closed.")
        return self._tensor


class HostPool(_Buffer):
    """One host allocation of ``size_bytes`` (rounded up to 4 KiB), 4 KiB aligned.

    - ``pin``: register the buffer with CUDA (default: when CUDA is available):
      ``cudaHostRegister(ptr, size, cudaHostRegisterPortable | cudaHostRegisterMapped)``
      through ``torch.cuda.cudart()``, which returns the ``cudaError_t`` (0 = success).
    - ``max_ram_fraction``: in ``(0, 1]``; refuse (``HostMemoryError``) if the pool needs
      more than this fraction of the currently available RAM (``MemAvailable``).
    - ``device``: the CUDA device whose work ``close()`` waits for before unpinning
      (default: the current device).
    - ``shared_name``: ``None`` (default: private memory of this process) or the name of a
      pool shared by the processes of one node (the TP ranks), backed by the file
      ``shared_host_pool_path(shared_name)`` and mapped ``MAP_SHARED``.
      ``create=True``: make that file exclusively (``SharedHostPoolError`` if it exists),
      at exactly the rounded size (``posix_fallocate``: a too-small ``/dev/shm`` fails here
      with ``HostMemoryError``, not with ``SIGBUS`` later); only the creator checks the RAM.
      ``create=False``: attach to the existing file (``SharedHostPoolError`` if it is
      missing or its size differs). ``close()`` of the creator unlinks the file; ranks still
      attached keep their mapping (the memory lives until the last mapping goes).

    ``tensor`` is the ``[size_bytes] uint8`` buffer (its contents start undefined);
    ``close()`` waits for the device, unregisters the buffer and only then drops it; it is
    idempotent, and ``with HostPool(...)`` closes.
    """

    _kind = "host pool"

    def __init__(self, size_bytes: int, *, pin: Optional[bool] = None,
                 max_ram_fraction: float = 0.9,
                 device: Optional[torch.device | str | int] = None,
                 shared_name: Optional[str] = None, create: bool = True) -> None:
        self._tensor: Optional[torch.Tensor] = None
        self._base: Optional[torch.Tensor] = None
        self.pinned = False
        self.shared_name = shared_name
        self.path: Optional[str] = None       # the backing file (shared mode)
        self.creator = shared_name is None or bool(create)
        self._unlink_path: Optional[str] = None
        if not isinstance(size_bytes, int) or isinstance(size_bytes, bool) or size_bytes <= 0:
            raise ValueError(f"HostPool size must be a positive number of bytes, "
                             f"got {size_bytes!r}.")
        if (isinstance(max_ram_fraction, bool) or not isinstance(max_ram_fraction, (int, float))
                or not 0 < max_ram_fraction <= 1):
            raise ValueError(f"max_ram_fraction must be in (0, 1], got {max_ram_fraction!r}.")
        if not isinstance(create, bool):
            raise ValueError(f"HostPool.create must be True or False, got {create!r}.")
        path = None if shared_name is None else shared_host_pool_path(shared_name)
        size = -(-size_bytes // HOST_ALIGNMENT) * HOST_ALIGNMENT
        available = available_ram_bytes()
        if self.creator and size > max_ram_fraction * available:
            raise HostMemoryError(
                f"host pool of {size} B ({size / (1 << 30):.2f} GiB) exceeds "
                f"{max_ram_fraction:.0%} of the available RAM ({available} B, "
                f"{available / (1 << 30):.2f} GiB: MemAvailable, capped by the cgroup memory "
                f"limit); lower host_pool_gib.",
                resource="host RAM bytes", needed=size, available=available)
        if pin is None:
            pin = torch.cuda.is_available()
        if pin and not torch.cuda.is_available():
            raise RuntimeError("HostPool(pin=True) needs CUDA; this machine has none.")
        self.device: Optional[torch.device] = None
        if pin and device is not None:
            self.device = (torch.device("cuda", device) if isinstance(device, int)
                           else torch.device(device))
        if path is None:
            # Over-allocate by one alignment unit and slice the aligned window out of it.
            base = torch.empty(size + HOST_ALIGNMENT, dtype=torch.uint8)
            shift = (-base.data_ptr()) % HOST_ALIGNMENT
            tensor = base[shift:shift + size]
        elif create:
            base = tensor = self._create_shared(path, size)
        else:
            base = tensor = self._attach_shared(path, size)
        self.size_bytes = size
        if pin:
            cudart = torch.cuda.cudart()
            result = cudart.cudaHostRegister(tensor.data_ptr(), size, _REGISTER_FLAGS)
            err = int(result)
            if err != 0:
                _clear_cuda_last_error()
                self._unlink()
                try:
                    reason = f" ({cudart.cudaGetErrorString(result)})"
                except Exception:  # noqa: BLE001 - the number alone still says it
                    reason = ""
                raise HostMemoryError(
                    f"cudaHostRegister of the {size} B ({size / (1 << 30):.2f} GiB) host pool "
                    f"failed with cudaError {err}{reason}; the OS may limit locked memory "
                    f"(ulimit -l) or the machine has too little RAM to pin it: lower "
                    f"host_pool_gib.", resource="pinned host bytes", needed=size,
                    available=available)
            self.pinned = True
        self._base, self._tensor = base, tensor

    def _create_shared(self, path: str, size: int) -> torch.Tensor:
        folder = os.path.dirname(path)
        try:
            stat = os.statvfs(folder)
            free = stat.f_bavail * stat.f_frsize
        except OSError:  # pragma: no cover - the folder vanished
            free = None
        if free is not None and size > free:
            raise HostMemoryError(
                f"shared host pool of {size} B ({size / (1 << 30):.2f} GiB) does not fit the "
                f"{free} B free in {folder} (a container's /dev/shm is often small: raise "
                f"--shm-size); lower host_pool_gib.", resource="shared memory bytes",
                needed=size, available=free)
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            raise SharedHostPoolError(
                f"shared host pool {self.shared_name!r} already exists ({path}): another "
                f"runtime created it (one creator, tp_rank 0, per name) or a crashed one left "
                f"it behind; remove the file or pick another host_pool_name.", path) from None
        try:
            try:
                os.posix_fallocate(fd, 0, size)
            except OSError as exc:
                if exc.errno in (errno.ENOSPC, errno.ENOMEM):
                    raise HostMemoryError(
                        f"shared host pool of {size} B ({size / (1 << 30):.2f} GiB) could not "
                        f"be allocated in {folder}: {exc.strerror}; lower host_pool_gib.",
                        resource="shared memory bytes", needed=size,
                        available=free or 0) from None
                if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                    raise
                os.ftruncate(fd, size)   # a file system without fallocate
            tensor = _map_file(fd, path, size)
        except BaseException:
            os.close(fd)
            os.unlink(path)
            raise
        os.close(fd)
        self.path = self._unlink_path = path
        return tensor

    def _attach_shared(self, path: str, size: int) -> torch.Tensor:
        try:
            fd = os.open(path, os.O_RDWR)
        except FileNotFoundError:
            raise SharedHostPoolError(
                f"shared host pool {self.shared_name!r} does not exist ({path}): construct "
                f"the creating runtime (tp_rank 0) first, with the same host_pool_name.",
                path) from None
        try:
            actual = os.fstat(fd).st_size
            if actual != size:
                raise SharedHostPoolError(
                    f"shared host pool {self.shared_name!r} ({path}) holds {actual} B but this "
                    f"rank's plan needs {size} B: every rank must use the same KVCacheConfig.",
                    path)
            tensor = _map_file(fd, path, size)
        finally:
            os.close(fd)
        self.path = path
        return tensor

    def _unlink(self) -> None:
        path, self._unlink_path = self._unlink_path, None
        if path is not None:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass

    @property
    def data_ptr(self) -> int:
        return self.tensor.data_ptr()

    def view(self, offset: int, num_blocks: int, block_size: int, row_bytes: int,
             block_stride: int) -> torch.Tensor:
        """``[num_blocks, block_size, row_bytes] uint8`` view of one layer at byte ``offset``."""
        return _strided_view(self.tensor, offset, num_blocks, block_size, row_bytes,
                             block_stride)

    def close(self) -> None:
        """Unpin (after the device finished using the buffer) and release; idempotent.

        Views taken earlier keep the (now unpinned) memory alive until they are dropped.
        A shared pool's creator also unlinks the backing file (attached ranks keep their
        mapping).
        """
        if getattr(self, "_tensor", None) is None:
            if getattr(self, "_unlink_path", None) is not None:
                self._unlink()
            return
        try:
            self._release()
        finally:
            self._unlink()

    def _release(self) -> None:
        if self.pinned:
            torch.cuda.synchronize(self.device)
            err = int(torch.cuda.cudart().cudaHostUnregister(self._tensor.data_ptr()))
            self.pinned = False
            if err != 0:  # pragma: no cover - driver failure
                _clear_cuda_last_error()
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


class DevicePool(_Buffer):
    """The shared device pool: ``num_blocks`` blocks of ``bytes_per_block`` bytes, block-outermost.

    Every device group's layers view the same buffer at their own in-block byte offsets; the
    resident and hot views of a sparse layer are the same bytes. The buffer is zero-filled.
    """

    _kind = "device pool"

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
