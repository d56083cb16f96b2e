"""The two byte pools of the runtime: ``HostPool`` (pinned host memory) and ``DevicePool``.

Both are ONE ``uint8`` buffer; layers are strided views into it (see ``KVCacheTensor``), so a
transfer kernel addresses any layer by a byte offset into one buffer (``RowTable``).

``HostPool`` holds every source (sparse-MLA) layer's full KV history. On a CUDA machine it is
pinned in place with ``cudaHostRegister`` rather than allocated with ``pin_memory=True``:
torch's caching pinned allocator may round a huge request up (to the next power of two) and
keeps the block cached after release, while registering an exact-size, 4 KiB-aligned buffer
costs exactly the bytes asked for and is unpinned deliberately in ``close()``. Without CUDA
it is plain CPU memory. Both pools check memory before allocating (``memory.check_memory``):
RAM for a host pool or a device pool on the CPU (``MemAvailable``, capped by a container's
cgroup memory limit), free GPU memory for a device pool on CUDA; too little raises
``HostMemoryError`` / ``CapacityError`` instead of an allocator error or an OOM kill later.
``HostPool.memory_requests`` / ``DevicePool.memory_requests`` say what a pool would allocate,
so a caller can check all of its allocations together before making any.

Shared mode (``HostPool(..., shared_name=NAME, create=...)``): the pool is a file
``<dir>/hisparse-NAME`` (``dir`` = ``/dev/shm``, else the system temp dir; see
``hisparse_triton.worker.shared_pool`` for its header) mapped ``MAP_SHARED``, so the
tensor-parallel ranks of one node hold ONE copy of the (identical) MLA KV history:

- the creating rank (tp_rank 0) makes the file exclusively at its exact size, writes a header
  (its pid, the plan ``fingerprint``), maps it read-write and is the only process that ever
  unlinks it: a process forked from it (a data-loader, a ``multiprocessing`` worker) that
  closes or garbage-collects its copy of the pool neither unlinks the file nor unregisters
  the creator's pinned memory;
- the other ranks attach: the file is opened without following symbolic links, its header
  must carry the same size and fingerprint, and its creator must still run (a pool left by a
  killed rank 0 is refused as stale: ``hisparse-triton shm clean`` removes it). They map it
  READ-ONLY (``PROT_READ``): they never write the pool, and a write through their view is a
  bug that kills the process with ``SIGSEGV`` instead of corrupting the other ranks' KV. On
  CUDA the read-only mapping is registered with ``cudaHostRegisterReadOnly`` (the GPU only
  reads it too); where the device does not support that flag
  (``cudaDevAttrHostRegisterReadOnlySupported`` = 0) the rank logs a warning and maps the
  file read-write instead (``HostPool.writable`` says which).
"""

from __future__ import annotations

import ctypes
import errno
import logging
import mmap
import os
import tempfile  # noqa: F401 - shared_pool.pool_dir() falls back to tempfile.gettempdir()
import warnings
from typing import Optional

import torch

from hisparse_triton.worker import shared_pool
from hisparse_triton.compat import check_versions
from hisparse_triton.errors import HostMemoryError, RuntimeClosedError, SharedHostPoolError
from hisparse_triton.memory import (  # noqa: F401 - re-exported: the pools' RAM helpers
    MemoryRequest,
    available_ram_bytes,
    cgroup_available_bytes,
    check_fraction,
    check_memory,
)

check_versions()

logger = logging.getLogger(__name__)

#: Alignment of the host pool's first byte (one page; what DMA engines like).
HOST_ALIGNMENT = 4096

#: ``cudaHostRegisterPortable | cudaHostRegisterMapped``: pinned for every CUDA context and
#: mapped into the device address space, so the transfer kernels can dereference it (Triton's
#: launcher translates the host pointer with ``cuPointerGetAttribute``; with unified
#: addressing both are equal).
_REGISTER_FLAGS = 1 | 2
#: ``cudaHostRegisterReadOnly``: the device only reads the memory (needed to register a
#: ``PROT_READ`` mapping).
_REGISTER_READ_ONLY = 8
_CPU = torch.device("cpu")


def shared_host_pool_dir() -> str:
    """Folder of shared host pools: ``/dev/shm`` (RAM-backed), else the system temp dir."""
    return shared_pool.pool_dir()


def shared_host_pool_path(name: str) -> str:
    """The backing file of the shared host pool ``name``: ``<dir>/hisparse-<name>``.

    ``ValueError`` unless ``name`` is 1-201 characters of ``[A-Za-z0-9._-]`` starting with
    a letter or digit (so it is one plain file name)."""
    return shared_pool.pool_path(name)


def _map_fd(fd: int, nbytes: int, *, writable: bool) -> torch.Tensor:
    """``[nbytes] uint8`` ``MAP_SHARED`` mapping of the open file ``fd`` from offset 0 (page
    aligned), read-only unless ``writable``. The tensor keeps the mapping alive: it is
    unmapped when the last view of it is dropped."""
    prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
    mapping = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED, prot=prot)
    with warnings.catch_warnings():  # torch warns that it cannot mark tensors read-only
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        return torch.frombuffer(mapping, dtype=torch.uint8)


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
      more than this fraction of the currently available RAM (``check_memory``).
    - ``device``: the CUDA device whose work ``close()`` waits for before unpinning
      (default: the current device).
    - ``shared_name``: ``None`` (default: private memory of this process) or the name of a
      pool shared by the processes of one node (the TP ranks), backed by the file
      ``shared_host_pool_path(shared_name)`` and mapped ``MAP_SHARED`` (see the module
      docstring).
      ``create=True``: make that file exclusively (``SharedHostPoolError`` if it exists),
      at exactly the rounded size plus a 4 KiB header (``posix_fallocate``: a too-small
      ``/dev/shm`` fails here with ``HostMemoryError``, not with ``SIGBUS`` later); only the
      creator checks the RAM. ``create=False``: attach read-only to the existing file
      (``SharedHostPoolError`` if it is missing, not a regular file, a symbolic link, not
      accessible, of another size or fingerprint, or stale). ``close()`` of the creating
      process unlinks the file; ranks still attached keep their mapping (the memory lives
      until the last mapping goes).
    - ``fingerprint``: a string identifying the plan (any text up to 2048 UTF-8 bytes, e.g.
      a hash of the KV-cache config); the creator records it and an attaching rank must pass
      the same one (``None`` counts as the empty string). Ignored for a private pool.

    ``tensor`` is the ``[size_bytes] uint8`` buffer (its contents start undefined);
    ``writable`` is ``False`` for an attached rank's read-only view. ``close()`` waits for
    the device, unregisters the buffer and only then drops it; it is idempotent, and
    ``with HostPool(...)`` closes.
    """

    _kind = "host pool"

    def __init__(self, size_bytes: int, *, pin: Optional[bool] = None,
                 max_ram_fraction: float = 0.9,
                 device: Optional[torch.device | str | int] = None,
                 shared_name: Optional[str] = None, create: bool = True,
                 fingerprint: Optional[str] = None) -> None:
        self._owner_pid = os.getpid()
        self._tensor: Optional[torch.Tensor] = None
        self._base: Optional[torch.Tensor] = None
        self._unlink_path: Optional[str] = None
        self.pinned = False
        self.writable = True
        self.shared_name = shared_name
        self.path: Optional[str] = None       # the backing file (shared mode)
        self.creator = shared_name is None or bool(create)
        if not isinstance(size_bytes, int) or isinstance(size_bytes, bool) or size_bytes <= 0:
            raise ValueError(f"HostPool size must be a positive number of bytes, "
                             f"got {size_bytes!r}.")
        check_fraction(max_ram_fraction)
        if not isinstance(create, bool):
            raise ValueError(f"HostPool.create must be True or False, got {create!r}.")
        self.fingerprint = shared_pool.check_fingerprint(fingerprint)
        path = None if shared_name is None else shared_host_pool_path(shared_name)
        size = -(-size_bytes // HOST_ALIGNMENT) * HOST_ALIGNMENT
        if self.creator:
            check_memory(self.memory_requests(size, shared=path is not None),
                         max_ram_fraction=max_ram_fraction)
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
            base, tensor = self._create_shared(path, size)
        else:
            base, tensor = self._attach_shared(path, size, writable=False)
        self.size_bytes = size
        if pin:
            try:
                base, tensor = self._pin(base, tensor)
            except BaseException:
                self._unlink()
                raise
        self._base, self._tensor = base, tensor

    @staticmethod
    def memory_requests(size_bytes: int, *, shared: bool = False,
                        create: bool = True) -> list[MemoryRequest]:
        """What a ``HostPool(size_bytes, ...)`` would allocate, for ``check_memory``: the
        rounded size (plus the 4 KiB header of a shared pool) in host RAM, nothing for a rank
        that attaches to a shared pool (``shared=True, create=False``)."""
        if shared and not create:
            return []
        size = -(-size_bytes // HOST_ALIGNMENT) * HOST_ALIGNMENT
        what = "shared host pool" if shared else "host pool"
        extra = shared_pool.HEADER_BYTES if shared else 0
        return [MemoryRequest(what, size + extra, _CPU, hint="host_pool_gib")]

    def _pin(self, base: torch.Tensor, tensor: torch.Tensor) -> tuple[torch.Tensor,
                                                                     torch.Tensor]:
        """Register ``tensor`` with CUDA; returns the (possibly remapped) buffer."""
        cudart = torch.cuda.cudart()
        size = self.size_bytes
        flags = _REGISTER_FLAGS | (0 if self.writable else _REGISTER_READ_ONLY)
        result = cudart.cudaHostRegister(tensor.data_ptr(), size, flags)
        if int(result) != 0 and not self.writable:
            _clear_cuda_last_error()
            logger.warning(
                "cudaHostRegister with cudaHostRegisterReadOnly failed for the shared host "
                "pool %s (cudaError %d; the device may lack "
                "cudaDevAttrHostRegisterReadOnlySupported): this rank maps it read-write "
                "instead. It still never writes it.", self.path, int(result))
            base = tensor = None  # drop the read-only mapping before mapping it again
            base, tensor = self._attach_shared(self.path, size, writable=True)
            result = cudart.cudaHostRegister(tensor.data_ptr(), size, _REGISTER_FLAGS)
        err = int(result)
        if err != 0:
            _clear_cuda_last_error()
            try:
                reason = f" ({cudart.cudaGetErrorString(result)})"
            except Exception:  # noqa: BLE001 - the number alone still says it
                reason = ""
            available = available_ram_bytes()
            raise HostMemoryError(
                f"cudaHostRegister of the {size} B ({size / (1 << 30):.2f} GiB) host pool "
                f"failed with cudaError {err}{reason}; the OS may limit locked memory "
                f"(ulimit -l) or the machine has too little RAM to pin it: lower "
                f"host_pool_gib.", resource="pinned host bytes", needed=size,
                available=available)
        self.pinned = True
        return base, tensor

    def _create_shared(self, path: str, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        folder = os.path.dirname(path)
        total = shared_pool.HEADER_BYTES + size
        try:
            stat = os.statvfs(folder)
            free = stat.f_bavail * stat.f_frsize
        except OSError:  # pragma: no cover - the folder vanished
            free = None
        if free is not None and total > free:
            raise HostMemoryError(
                f"shared host pool of {total} B ({total / (1 << 30):.2f} GiB) does not fit "
                f"the {free} B free in {folder} (a container's /dev/shm is often small: raise "
                f"--shm-size); lower host_pool_gib.", resource="shared memory bytes",
                needed=total, available=free)
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
        try:
            fd = os.open(path, flags, 0o600)
        except FileExistsError:
            raise SharedHostPoolError(self._exists_message(path), path) from None
        except PermissionError:
            raise SharedHostPoolError(
                f"permission denied creating the shared host pool {path}: this user may not "
                f"write to {folder}.", path) from None
        try:
            try:
                os.posix_fallocate(fd, 0, total)
            except OSError as exc:
                if exc.errno in (errno.ENOSPC, errno.ENOMEM):
                    raise HostMemoryError(
                        f"shared host pool of {total} B ({total / (1 << 30):.2f} GiB) could "
                        f"not be allocated in {folder}: {exc.strerror}; lower host_pool_gib.",
                        resource="shared memory bytes", needed=total,
                        available=free or 0) from None
                if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                    raise
                os.ftruncate(fd, total)   # a file system without fallocate
            header = shared_pool.PoolHeader.for_this_process(size, self.fingerprint)
            os.pwrite(fd, header.pack(), 0)
            base = _map_fd(fd, total, writable=True)
        except BaseException:
            os.close(fd)
            os.unlink(path)
            raise
        os.close(fd)
        self.path = self._unlink_path = path
        return base, base[shared_pool.HEADER_BYTES:]

    def _exists_message(self, path: str) -> str:
        info = shared_pool.inspect_pool(self.shared_name, os.path.dirname(path))
        if info is not None and info.state == "stale":
            why = (f"a crashed runtime left it behind (its creator, pid "
                   f"{info.header.creator_pid}, is gone): remove it with `hisparse-triton shm "
                   f"clean --name {self.shared_name}`")
        elif info is not None and info.state == "alive":
            why = (f"another runtime (pid {info.header.creator_pid}) created it and is "
                   f"running: one creator (tp_rank 0) per name; pick another host_pool_name")
        else:
            why = ("another runtime created it or a crashed one left it behind; see "
                   "`hisparse-triton shm list`, or pick another host_pool_name")
        return f"shared host pool {self.shared_name!r} already exists ({path}): {why}."

    def _attach_shared(self, path: str, size: int, *,
                       writable: bool) -> tuple[torch.Tensor, torch.Tensor]:
        fd = shared_pool.open_pool_file(
            path, writable=writable,
            missing=f": construct the creating runtime (tp_rank 0) first, with the same "
                    f"host_pool_name ({self.shared_name!r})")
        try:
            header = shared_pool.read_header(fd, path)
            wanted = self.fingerprint or ""
            if header.fingerprint != wanted:
                raise SharedHostPoolError(
                    f"shared host pool {self.shared_name!r} ({path}) was created for plan "
                    f"fingerprint {header.fingerprint!r} but this rank's plan has fingerprint "
                    f"{wanted!r}: every rank must use the same KVCacheConfig.", path)
            if header.data_bytes != size:
                raise SharedHostPoolError(
                    f"shared host pool {self.shared_name!r} ({path}) holds "
                    f"{header.data_bytes} B but this rank's plan needs {size} B: every rank "
                    f"must use the same KVCacheConfig.", path)
            total = shared_pool.HEADER_BYTES + size
            actual = os.fstat(fd).st_size
            if actual < total:
                raise SharedHostPoolError(
                    f"shared host pool {self.shared_name!r} ({path}) is truncated: {actual} B "
                    f"on disk, its header says {total} B.", path)
            if shared_pool.creator_alive(header) is False:
                raise SharedHostPoolError(
                    f"shared host pool {self.shared_name!r} ({path}) is stale: its creator "
                    f"(pid {header.creator_pid}) is gone, so nothing writes it; remove it with "
                    f"`hisparse-triton shm clean --name {self.shared_name}` and start tp_rank "
                    f"0 first.", path)
            base = _map_fd(fd, total, writable=writable)
        finally:
            os.close(fd)
        self.path = path
        self.writable = writable
        return base, base[shared_pool.HEADER_BYTES:]

    def _unlink(self) -> None:
        path, self._unlink_path = self._unlink_path, None
        if path is not None and os.getpid() == self._owner_pid:
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
        mapping). In a process forked from the owner, ``close()`` only drops this process's
        references: the file, the pinning and the memory belong to the owner.
        """
        if getattr(self, "_owner_pid", None) != os.getpid():
            self._tensor = self._base = None
            self._unlink_path = None
            self.pinned = False
            return
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
    Before allocating it checks the memory (``check_memory``): the free memory of a CUDA
    device, or ``max_ram_fraction`` of the available RAM for a pool on the CPU
    (``CapacityError`` / ``HostMemoryError``).
    """

    _kind = "device pool"

    def __init__(self, num_blocks: int, bytes_per_block: int,
                 device: torch.device | str = "cpu", *, max_ram_fraction: float = 0.9) -> None:
        for name, value in (("num_blocks", num_blocks), ("bytes_per_block", bytes_per_block)):
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"DevicePool.{name} must be a positive int, got {value!r}.")
        device = torch.device(device)
        check_memory(self.memory_requests(num_blocks, bytes_per_block, device),
                     max_ram_fraction=max_ram_fraction)
        self.num_blocks = num_blocks
        self.bytes_per_block = bytes_per_block
        self.device = device
        self._tensor: Optional[torch.Tensor] = torch.zeros(num_blocks * bytes_per_block,
                                                           dtype=torch.uint8, device=device)

    @staticmethod
    def memory_requests(num_blocks: int, bytes_per_block: int,
                        device: torch.device | str) -> list[MemoryRequest]:
        """What a ``DevicePool(num_blocks, bytes_per_block, device)`` would allocate, for
        ``check_memory``."""
        return [MemoryRequest(f"device pool ({num_blocks} blocks x {bytes_per_block} B)",
                              num_blocks * bytes_per_block, torch.device(device),
                              hint="num_gpu_blocks_override or the GPU memory budget")]

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
