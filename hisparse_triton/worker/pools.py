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
- the other ranks attach: the file is opened without following symbolic links; it must be
  owned by this user with no access for anyone else (mode 0600; or, with a ``group``, owned
  by that group with mode 0640, so ranks running as other users of the group can read it);
  its header must carry the run's ``secret`` (random, made by the creator, ``HostPool.secret``;
  every other rank gets it from rank 0, e.g. with the plan broadcast), the same size and
  fingerprint, and its creator must still run (a pool left by a killed rank 0 is refused as
  stale: ``hisparse-triton shm clean`` removes it). They never write the pool: the tensor
  they get (``tensor``, every ``view`` of it) is a ``ReadOnlyTensor`` whose writes raise
  ``ReadOnlyViewError``, and the mapping itself is read-only (``PROT_READ``) where the GPU
  runtime can register it so (CUDA's ``cudaHostRegisterReadOnly``); elsewhere (a device
  without that flag, ROCm) the rank maps the file read-write, which its read-only tensor
  still never writes (``HostPool.writable`` says which mapping it has).

Pinning goes through ``host_register`` (CUDA or HIP, as the installed torch was built).
"""

from __future__ import annotations

import errno
import logging
import mmap
import numbers
import os
import tempfile  # noqa: F401 - shared_pool.pool_dir() falls back to tempfile.gettempdir()
import warnings
from typing import Optional

import torch

from hisparse_triton.worker import host_register, shared_pool
from hisparse_triton.worker.adopted import caller_bytes
from hisparse_triton.worker.read_only import read_only
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


def _count(what: str, value: object) -> int:
    """``value`` as an int > 0 (numpy integers too); ``ValueError`` naming ``what``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value <= 0:
        raise ValueError(f"{what} must be a positive number of bytes, got {value!r}.")
    return int(value)


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

    - ``pin``: register the buffer with the GPU runtime (default: when CUDA or ROCm is
      available): ``cudaHostRegister`` / ``hipHostRegister`` (portable | mapped) through
      ``torch.cuda.cudart()`` (``host_register``); a torch build without those bindings is a
      ``HostMemoryError``, never an unpinned pool.
    - ``max_ram_fraction``: in ``(0, 1]``; refuse (``HostMemoryError``) if the pool needs
      more than this fraction of the currently available RAM (``check_memory``).
    - ``device``: the GPU whose work ``close()`` waits for before unpinning (default: the
      current device).
    - ``shared_name``: ``None`` (default: private memory of this process) or the name of a
      pool shared by the processes of one node (the TP ranks), backed by the file
      ``shared_host_pool_path(shared_name)`` and mapped ``MAP_SHARED`` (see the module
      docstring).
      ``create=True``: make that file exclusively (``SharedHostPoolError`` if it exists),
      mode 0600 (0640 with ``group``), at exactly the rounded size plus a 4 KiB header
      (``posix_fallocate``: a too-small ``/dev/shm`` fails here with ``HostMemoryError``, not
      with ``SIGBUS`` later); only the creator checks the RAM. ``create=False``: attach to
      the existing file (``SharedHostPoolError`` naming it if it is missing, not a regular
      file, a symbolic link, not accessible, owned by another user or group or open to
      others, of another secret, size or fingerprint, or stale). ``close()`` of the creating
      process unlinks the file; ranks still attached keep their mapping (the memory lives
      until the last mapping goes).
    - ``secret``: the run's secret, ``2 * SECRET_BYTES`` hex digits. The creator records it
      (a new random one when ``None``: ``HostPool.secret``); an attaching rank must pass the
      creator's (required), so a file anyone else made is refused. Ignored for a private
      pool.
    - ``group``: a group name or gid, or ``None``: the creator gives the file that group
      (it must belong to it) and mode 0640; an attaching rank passes the same group and
      then accepts a file of that group owned by another user. ``None``: owner-only files.
    - ``fingerprint``: a string identifying the plan (any text up to 2048 UTF-8 bytes, e.g.
      a hash of the KV-cache config); the creator records it and an attaching rank must pass
      the same one (``None`` counts as the empty string). Ignored for a private pool.

    ``tensor`` is the ``[size_bytes] uint8`` buffer (its contents start undefined); on an
    attached rank (``read_only``) it and every view of it are ``ReadOnlyTensor``s whose writes
    raise ``ReadOnlyViewError``. ``writable`` says whether the mapping itself is writable.
    ``close()`` waits for the device, unregisters the buffer and only then drops it; it is
    idempotent, and ``with HostPool(...)`` closes.
    """

    _kind = "host pool"

    def __init__(self, size_bytes: int, *, pin: Optional[bool] = None,
                 max_ram_fraction: float = 0.9,
                 device: Optional[torch.device | str | int] = None,
                 shared_name: Optional[str] = None, create: bool = True,
                 fingerprint: Optional[str] = None, secret: Optional[str | bytes] = None,
                 group: Optional[str | int] = None) -> None:
        self._init_state(shared_name=shared_name, create=create)
        size_bytes = _count("HostPool size", size_bytes)
        check_fraction(max_ram_fraction)
        if not isinstance(create, bool):
            raise ValueError(f"HostPool.create must be True or False, got {create!r}.")
        self.fingerprint = shared_pool.check_fingerprint(fingerprint)
        path = None if shared_name is None else shared_host_pool_path(shared_name)
        gid = shared_pool.group_id(group)
        raw_secret = b""
        if path is not None:
            if secret is None and not self.creator:
                raise ValueError(
                    f"attaching to the shared host pool {shared_name!r} needs the run's "
                    f"secret: pass the creating rank's host_pool_secret (rank 0 makes it; "
                    f"send it to the other ranks, e.g. with "
                    f"hisparse_triton.distributed.broadcast_host_pool_secret).")
            raw_secret = shared_pool.check_secret(
                shared_pool.new_secret() if secret is None else secret)
            self.secret = raw_secret.hex()
        size = -(-size_bytes // HOST_ALIGNMENT) * HOST_ALIGNMENT
        if self.creator:
            check_memory(self.memory_requests(size, shared=path is not None),
                         max_ram_fraction=max_ram_fraction)
        if pin is None:
            pin = torch.cuda.is_available()
        if pin and not torch.cuda.is_available():
            raise RuntimeError("HostPool(pin=True) needs a GPU runtime (CUDA or ROCm); this "
                               "machine has none.")
        cudart = host_register.require_registration(self._runtime) if pin else None
        if pin and device is not None:
            self.device = (torch.device("cuda", device) if isinstance(device, int)
                           else torch.device(device))
        if path is None:
            # Over-allocate by one alignment unit and slice the aligned window out of it.
            base = torch.empty(size + HOST_ALIGNMENT, dtype=torch.uint8)
            shift = (-base.data_ptr()) % HOST_ALIGNMENT
            tensor = base[shift:shift + size]
        elif create:
            base, tensor = self._create_shared(path, size, raw_secret, gid)
        else:
            # A rank that pins where read-only registration does not exist maps read-write.
            mapped_writable = bool(pin) and not self._runtime.registers_read_only
            base, tensor = self._attach_shared(path, size, raw_secret, gid,
                                               writable=mapped_writable)
        self.size_bytes = size
        if pin:
            try:
                base, tensor = self._pin(cudart, base, tensor, raw_secret, gid)
            except BaseException:
                self._unlink()
                raise
        self._base, self._tensor = base, tensor

    @classmethod
    def adopt(cls, tensor: torch.Tensor, size_bytes: int, *, register: bool = True,
              device: Optional[torch.device | str | int] = None) -> "HostPool":
        """A host pool over the first ``size_bytes`` bytes of a CPU tensor the caller
        allocated (``adopted.caller_bytes`` checks it). On a GPU machine the memory must be
        page-locked: a pinned tensor (``tensor.is_pinned()``, e.g. ``pin_memory()`` or memory
        registered by the caller) is used as is; otherwise, with ``register``, the pool
        registers the pages holding it (portable | mapped) and ``close()`` unregisters them;
        without, ``HostMemoryError``. ``close()`` never frees the caller's memory."""
        size = _count("HostPool.adopt size", size_bytes)
        data = caller_bytes(tensor, what="the host pool tensor", nbytes=size, device=_CPU)
        pool = cls.__new__(cls)
        pool._init_state(shared_name=None, create=True)
        pool.owns_memory = False
        pool.size_bytes = size
        if torch.cuda.is_available():
            pool.device = None if device is None else (
                torch.device("cuda", device) if isinstance(device, int) else torch.device(device))
            if tensor.is_pinned():
                pool.pinned = True
            elif not register:
                raise HostMemoryError(
                    "the host pool tensor is not pinned (tensor.is_pinned() is False) and "
                    "register=False: pin it (pin_memory(), or register it with the GPU "
                    "runtime), or let the worker register it.", resource="pinned host bytes",
                    needed=size)
            else:
                cudart = host_register.require_registration(pool._runtime)
                pool._register_pages(cudart, data)
        pool._base, pool._tensor = tensor, data
        return pool

    def _init_state(self, *, shared_name: Optional[str], create: bool) -> None:
        self._owner_pid = os.getpid()
        self._tensor: Optional[torch.Tensor] = None
        self._base: Optional[torch.Tensor] = None
        self._unlink_path: Optional[str] = None
        self._registered_ptr: Optional[int] = None   # what close() unregisters
        self.owns_memory = True
        self.pinned = False
        self.writable = True
        self.shared_name = shared_name
        self.path: Optional[str] = None       # the backing file (shared mode)
        self.creator = shared_name is None or bool(create)
        self.secret: Optional[str] = None
        self.fingerprint: Optional[str] = None
        self.device: Optional[torch.device] = None
        self._runtime = host_register.current_runtime()

    def _register_pages(self, cudart: object, data: torch.Tensor) -> None:
        """Register the whole pages holding ``data`` (a caller's memory need not start on a
        page); ``HostMemoryError`` when the runtime refuses."""
        start = data.data_ptr() - data.data_ptr() % HOST_ALIGNMENT
        end = data.data_ptr() + data.numel()
        length = -(-(end - start) // HOST_ALIGNMENT) * HOST_ALIGNMENT
        err = int(cudart.cudaHostRegister(start, length, self._runtime.register_flags))
        if err != 0:
            host_register.clear_last_error(self._runtime)
            raise HostMemoryError(
                f"{self._runtime.call('cudaHostRegister')} of the caller's {length} B host "
                f"pool tensor failed with {self._runtime.name.lower()}Error {err}; pin it "
                f"yourself or raise the locked-memory limit (ulimit -l).",
                resource="pinned host bytes", needed=length)
        self.pinned, self._registered_ptr = True, start

    @property
    def read_only(self) -> bool:
        """Whether this process only reads the pool (an attached rank): ``tensor`` and its
        views then refuse writes."""
        return not self.creator

    @property
    def tensor(self) -> torch.Tensor:
        """The ``[size] uint8`` buffer (a ``ReadOnlyTensor`` on an attached rank);
        ``RuntimeClosedError`` after ``close()``."""
        raw = self.raw
        return read_only(raw) if self.read_only else raw

    @property
    def raw(self) -> torch.Tensor:
        """The buffer as a plain tensor, for the runtime's own kernels (which only read an
        attached rank's pool); ``RuntimeClosedError`` after ``close()``."""
        return super().tensor

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

    def _pin(self, cudart: object, base: torch.Tensor, tensor: torch.Tensor,
             secret: bytes, gid: Optional[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Register ``tensor`` with the GPU runtime; returns the (possibly remapped) buffer."""
        runtime, size = self._runtime, self.size_bytes
        register = runtime.call("cudaHostRegister")
        read_only_mapping = not self.writable
        flags = runtime.register_flags | (runtime.read_only_flag if read_only_mapping else 0)
        result = cudart.cudaHostRegister(tensor.data_ptr(), size, flags)
        if int(result) != 0 and read_only_mapping:
            host_register.clear_last_error(runtime)
            logger.warning(
                "%s with cudaHostRegisterReadOnly failed for the shared host pool %s (error "
                "%d; the device may lack cudaDevAttrHostRegisterReadOnlySupported): this "
                "rank maps it read-write instead. Its tensors still refuse writes.",
                register, self.path, int(result))
            base = tensor = None  # drop the read-only mapping before mapping it again
            base, tensor = self._attach_shared(self.path, size, secret, gid, writable=True)
            result = cudart.cudaHostRegister(tensor.data_ptr(), size, runtime.register_flags)
        err = int(result)
        if err != 0:
            host_register.clear_last_error(runtime)
            try:
                reason = f" ({cudart.cudaGetErrorString(result)})"
            except Exception:  # noqa: BLE001 - the number alone still says it
                reason = ""
            available = available_ram_bytes()
            raise HostMemoryError(
                f"{register} of the {size} B ({size / (1 << 30):.2f} GiB) host pool "
                f"failed with {runtime.name.lower()}Error {err}{reason}; the OS may limit "
                f"locked memory "
                f"(ulimit -l) or the machine has too little RAM to pin it: lower "
                f"host_pool_gib.", resource="pinned host bytes", needed=size,
                available=available)
        self.pinned, self._registered_ptr = True, tensor.data_ptr()
        return base, tensor

    def _create_shared(self, path: str, size: int, secret: bytes,
                       gid: Optional[int]) -> tuple[torch.Tensor, torch.Tensor]:
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
            if gid is not None:
                try:
                    os.fchown(fd, -1, gid)
                except PermissionError:
                    raise SharedHostPoolError(
                        f"cannot give the shared host pool {path} the group {gid}: this user "
                        f"is not a member of it.", path) from None
            os.fchmod(fd, shared_pool.creation_mode(gid))   # whatever the umask
            header = shared_pool.PoolHeader.for_this_process(size, self.fingerprint, secret)
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

    def _attach_shared(self, path: str, size: int, secret: bytes, gid: Optional[int], *,
                       writable: bool) -> tuple[torch.Tensor, torch.Tensor]:
        fd = shared_pool.open_pool_file(
            path, writable=writable,
            missing=f": construct the creating runtime (tp_rank 0) first, with the same "
                    f"host_pool_name ({self.shared_name!r})")
        try:
            shared_pool.check_access(fd, path, gid=gid)
            header = shared_pool.read_header(fd, path)
            if not shared_pool.same_secret(header, secret):
                raise SharedHostPoolError(
                    f"shared host pool {self.shared_name!r} ({path}) was not created by this "
                    f"run's rank 0: its secret differs from the host_pool_secret this rank "
                    f"was given (a file left by another run or planted by someone else; "
                    f"`hisparse-triton shm list` shows it).", path)
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
        return self.raw.data_ptr()

    def view(self, offset: int, num_blocks: int, block_size: int, row_bytes: int,
             block_stride: int) -> torch.Tensor:
        """``[num_blocks, block_size, row_bytes] uint8`` view of one layer at byte ``offset``
        (read-only on an attached rank, like ``tensor``)."""
        view = _strided_view(self.raw, offset, num_blocks, block_size, row_bytes,
                             block_stride)
        return read_only(view) if self.read_only else view

    def close(self) -> None:
        """Unpin (after the device finished using the buffer) and release; idempotent.

        Views taken earlier keep the (now unpinned) memory alive until they are dropped.
        A shared pool's creator also unlinks the backing file (attached ranks keep their
        mapping). In a process forked from the owner, ``close()`` only drops this process's
        references: the file, the pinning and the memory belong to the owner.
        """
        if getattr(self, "_owner_pid", None) != os.getpid():
            self._tensor = self._base = None
            self._unlink_path = self._registered_ptr = None
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
        self.pinned = False
        ptr, self._registered_ptr = self._registered_ptr, None
        if ptr is not None:
            torch.cuda.synchronize(self.device)
            err = int(torch.cuda.cudart().cudaHostUnregister(ptr))
            if err != 0:  # pragma: no cover - driver failure
                host_register.clear_last_error(self._runtime)
                self._tensor = self._base = None
                raise RuntimeError(f"{self._runtime.call('cudaHostUnregister')} of the host "
                                   f"pool failed with error {err}.")
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
        self.owns_memory = True
        self._tensor: Optional[torch.Tensor] = torch.zeros(num_blocks * bytes_per_block,
                                                           dtype=torch.uint8, device=device)

    @classmethod
    def adopt(cls, tensor: torch.Tensor, num_blocks: int, bytes_per_block: int,
              device: torch.device | str) -> "DevicePool":
        """A device pool over a tensor the caller allocated on ``device`` (its first
        ``num_blocks * bytes_per_block`` bytes; ``adopted.caller_bytes`` checks it). Its
        contents are left as they are; ``close()`` never frees it."""
        for name, value in (("num_blocks", num_blocks), ("bytes_per_block", bytes_per_block)):
            _count(f"DevicePool.{name}", value)
        device = torch.device(device)
        pool = cls.__new__(cls)
        pool.num_blocks, pool.bytes_per_block, pool.device = num_blocks, bytes_per_block, device
        pool.owns_memory = False
        pool._tensor = caller_bytes(tensor, what="the device pool tensor",
                                    nbytes=num_blocks * bytes_per_block, device=device)
        return pool

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
