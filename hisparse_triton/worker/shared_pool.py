"""The on-disk side of a shared host pool (no torch import): names, header, liveness, cleanup.

A shared host pool ``NAME`` is the file ``<dir>/hisparse-NAME`` (``dir`` = ``/dev/shm``, else
the system temp dir). Its first ``HEADER_BYTES`` (one 4 KiB page) are a header; the pool's
bytes follow, so they stay page aligned. The header (little endian):

=========  ======  ===========================================================
offset     type    field
=========  ======  ===========================================================
0          8 B     magic ``b"HISPARSE"``
8          u32     format version (``FORMAT_VERSION``)
12         u32     header bytes (``HEADER_BYTES``)
16         u64     pool bytes (the data after the header)
24         i64     creator pid
32         u64     creator start time (clock ticks after boot, ``/proc/PID/stat``; 0 unknown)
40         u64     creation time (ns since the epoch)
48         u64     the creator's pid namespace (inode of ``/proc/self/ns/pid``; 0 unknown)
56         16 B    the run's secret (random unless the creator was given one)
72         u32     fingerprint length ``n`` (<= ``MAX_FINGERPRINT_BYTES``)
76         n B     fingerprint (UTF-8): the plan the creator was built for
=========  ======  ===========================================================

The creator makes the file exclusively with mode 0600 (or 0640 and the group it is given),
writes the header once, right after sizing the file; attaching ranks check, before mapping
anything, that the file is owned by their own user with no access for anyone else
(``check_access``; with a group: that group, no write access for it and none for others),
then the magic, the version, the run's secret (which every rank gets from rank 0, e.g. with
the plan broadcast: a file created by anyone else is refused even when it carries the right
plan), the size and the fingerprint. A pool is *stale*
when its creator process is gone (its pid is free, belongs to a zombie, or was reused by a
process that started later): rank 0 was killed and could not unlink it. ``list_pools`` and
``remove_pool`` (the ``hisparse-triton shm`` command) find and remove such pools. Liveness can
only be judged from the creator's pid namespace (e.g. the same container); from another one
it is unknown.
"""

from __future__ import annotations

import errno
import grp
import hmac
import os
import pwd
import re
import secrets
import stat
import struct
import tempfile
import time
from dataclasses import dataclass, field
from typing import Optional

from hisparse_triton.errors import SharedHostPoolError

__all__ = ["FILE_PREFIX", "FORMAT_VERSION", "HEADER_BYTES", "MAGIC", "MAX_FINGERPRINT_BYTES",
           "SECRET_BYTES", "check_access", "check_fingerprint", "check_name", "check_secret",
           "creation_mode", "group_id", "new_secret", "same_secret",
           "PoolHeader", "PoolInfo", "creator_alive", "inspect_pool", "list_pools", "open_pool_file",
           "pid_namespace", "pool_dir", "pool_path", "process_start_ticks", "read_header",
           "remove_pool"]

MAGIC = b"HISPARSE"
FORMAT_VERSION = 2
#: Bytes before the pool's data: one page, so the data stays 4 KiB aligned.
HEADER_BYTES = 4096
MAX_FINGERPRINT_BYTES = 2048
#: Bytes of a run's secret (given as 2 * SECRET_BYTES hex digits).
SECRET_BYTES = 16
FILE_PREFIX = "hisparse-"
_FIXED = struct.Struct("<8sIIQqQQQ16sI")
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,200}")


def pool_dir() -> str:
    """Folder of shared host pools: ``/dev/shm`` (RAM-backed), else the system temp dir."""
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


def check_name(name: object) -> str:
    """``name`` if it is 1-201 characters of ``[A-Za-z0-9._-]`` starting with a letter or
    digit (one plain file name), else ``ValueError``."""
    if not isinstance(name, str) or _NAME.fullmatch(name) is None:
        raise ValueError(f"a shared host pool name must be 1-201 characters of "
                         f"[A-Za-z0-9._-] starting with a letter or digit, got {name!r}.")
    return name


def pool_path(name: str) -> str:
    """The backing file of the shared host pool ``name``: ``<dir>/hisparse-<name>``."""
    return os.path.join(pool_dir(), FILE_PREFIX + check_name(name))


def process_start_ticks(pid: int) -> Optional[int]:
    """Start time of process ``pid`` in clock ticks after boot (``/proc/PID/stat`` field
    22), or ``None`` when it cannot be read (no such process, no ``/proc``)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as file:
            text = file.read()
        # Field 2 (the command) may hold spaces and parentheses: split after its last ')'.
        return int(text[text.rindex(")") + 2:].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def pid_namespace() -> int:
    """Inode of this process's pid namespace (``/proc/self/ns/pid``), 0 when unknown."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def _process_state(pid: int) -> Optional[str]:
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as file:
            text = file.read()
        return text[text.rindex(")") + 2:].split()[0]
    except (OSError, ValueError, IndexError):
        return None


@dataclass(frozen=True)
class PoolHeader:
    """The header of a shared host pool file (see the module docstring)."""

    data_bytes: int
    creator_pid: int
    creator_start_ticks: int
    created_ns: int
    fingerprint: str
    pid_namespace: int = 0
    version: int = FORMAT_VERSION
    secret: bytes = field(default=b"", repr=False)

    @classmethod
    def for_this_process(cls, data_bytes: int, fingerprint: Optional[str],
                         secret: bytes = b"") -> "PoolHeader":
        """The header a pool created now by this process carries."""
        pid = os.getpid()
        return cls(data_bytes=data_bytes, creator_pid=pid,
                   creator_start_ticks=process_start_ticks(pid) or 0,
                   created_ns=time.time_ns(), fingerprint=fingerprint or "",
                   pid_namespace=pid_namespace(), secret=secret)

    def pack(self) -> bytes:
        """The ``HEADER_BYTES`` bytes to write at offset 0."""
        text = self.fingerprint.encode("utf-8")
        fixed = _FIXED.pack(MAGIC, self.version, HEADER_BYTES, self.data_bytes,
                            self.creator_pid, self.creator_start_ticks, self.created_ns,
                            self.pid_namespace, self.secret, len(text))
        return (fixed + text).ljust(HEADER_BYTES, b"\0")


def check_fingerprint(fingerprint: object) -> Optional[str]:
    """``fingerprint`` (``None`` or a str of at most ``MAX_FINGERPRINT_BYTES`` UTF-8 bytes)."""
    if fingerprint is None:
        return None
    if not isinstance(fingerprint, str):
        raise ValueError(f"a shared host pool fingerprint must be a str or None, got "
                         f"{fingerprint!r}.")
    if len(fingerprint.encode("utf-8")) > MAX_FINGERPRINT_BYTES:
        raise ValueError(f"a shared host pool fingerprint must be at most "
                         f"{MAX_FINGERPRINT_BYTES} UTF-8 bytes, got "
                         f"{len(fingerprint.encode('utf-8'))}.")
    return fingerprint


def new_secret() -> str:
    """A fresh random secret for one run: ``2 * SECRET_BYTES`` hex digits."""
    return secrets.token_hex(SECRET_BYTES)


def check_secret(secret: object) -> bytes:
    """The ``SECRET_BYTES`` bytes of ``secret`` (``2 * SECRET_BYTES`` hex digits, or that
    many raw bytes); ``ValueError`` otherwise."""
    if isinstance(secret, (bytes, bytearray)) and len(secret) == SECRET_BYTES:
        return bytes(secret)
    if isinstance(secret, str) and len(secret) == 2 * SECRET_BYTES:
        try:
            return bytes.fromhex(secret)
        except ValueError:
            pass
    raise ValueError(f"a shared host pool secret is {2 * SECRET_BYTES} hex digits (the "
                     f"creating rank's host_pool_secret), got "
                     f"{type(secret).__name__} {secret!r:.60}.")


def same_secret(header: PoolHeader, secret: bytes) -> bool:
    """Whether the pool's header carries ``secret`` (compared in constant time)."""
    return hmac.compare_digest(header.secret, secret)


def group_id(group: object) -> Optional[int]:
    """The gid of ``group`` (a group name or a gid; ``None`` stays ``None``);
    ``ValueError`` for an unknown name or a bad value."""
    if group is None:
        return None
    if isinstance(group, int) and not isinstance(group, bool) and group >= 0:
        return group
    if isinstance(group, str) and group:
        try:
            return grp.getgrnam(group).gr_gid
        except KeyError:
            raise ValueError(f"shared host pool group {group!r} is not a group of this "
                             f"machine.") from None
    raise ValueError(f"a shared host pool group is a group name or a gid >= 0, got "
                     f"{group!r}.")


def creation_mode(gid: Optional[int]) -> int:
    """The permission bits a new pool file gets: 0600, or 0640 with a group (its members
    may attach: they only read the pool)."""
    return 0o600 if gid is None else 0o640


def _owner_name(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


def _group_name(gid: int) -> str:
    try:
        return grp.getgrgid(gid).gr_name
    except KeyError:
        return str(gid)


def check_access(fd: int, path: str, *, gid: Optional[int] = None) -> None:
    """``SharedHostPoolError`` naming ``path`` unless the open pool file ``fd`` was made by
    a rank of this run's user: owned by this process's effective user and readable by nobody
    else (no group or other permission bits); with ``gid``: owned by group ``gid``, with no
    write permission for the group and none at all for others (its owner may then be another
    user of the group)."""
    info = os.fstat(fd)
    mode, uid = stat.S_IMODE(info.st_mode), os.geteuid()
    owner = f"owner {_owner_name(info.st_uid)} (uid {info.st_uid}), mode {mode:04o}"
    if gid is None:
        if info.st_uid != uid:
            raise SharedHostPoolError(
                f"refusing the shared host pool {path}: its {owner} is not this process's "
                f"user {_owner_name(uid)} (uid {uid}); a pool is attached only when the "
                f"creating rank runs as the same user (or pass the group it was created "
                f"for).", path)
        if mode & 0o077:
            raise SharedHostPoolError(
                f"refusing the shared host pool {path}: {owner} lets other users read or "
                f"write it (a pool is created 0600); remove it (`hisparse-triton shm clean "
                f"--force`) and start again.", path)
        return
    if info.st_gid != gid:
        raise SharedHostPoolError(
            f"refusing the shared host pool {path}: its group is {_group_name(info.st_gid)} "
            f"(gid {info.st_gid}), not {_group_name(gid)} (gid {gid}).", path)
    if mode & 0o027:
        raise SharedHostPoolError(
            f"refusing the shared host pool {path}: {owner} gives the group write access or "
            f"others any access (a group pool is created 0640).", path)


def read_header(fd: int, path: str) -> PoolHeader:
    """The header of the open pool file ``fd``; ``SharedHostPoolError`` naming ``path`` if
    the file is too short, has no hisparse magic or another format version."""
    raw = os.pread(fd, HEADER_BYTES, 0)
    if len(raw) < _FIXED.size or raw[:len(MAGIC)] != MAGIC:
        raise SharedHostPoolError(
            f"{path} is not a hisparse-triton shared host pool (no valid header: another "
            f"program's file, a pool of an older hisparse-triton, or a creator that died "
            f"while creating it); `hisparse-triton shm list` shows it, `hisparse-triton shm "
            f"clean --name NAME --force` removes it.", path)
    (_, version, header_bytes, data_bytes, pid, ticks, created, pid_ns, secret,
     n) = _FIXED.unpack_from(raw)
    if version != FORMAT_VERSION or header_bytes != HEADER_BYTES:
        raise SharedHostPoolError(
            f"{path} is a shared host pool of format version {version} ({header_bytes} B "
            f"header); this hisparse-triton reads version {FORMAT_VERSION} ({HEADER_BYTES} B): "
            f"every rank must run the same hisparse-triton version.", path)
    if n > MAX_FINGERPRINT_BYTES or _FIXED.size + n > len(raw):
        raise SharedHostPoolError(f"{path} has a corrupt header (fingerprint of {n} B).", path)
    text = raw[_FIXED.size:_FIXED.size + n].decode("utf-8", errors="replace")
    return PoolHeader(data_bytes=data_bytes, creator_pid=pid, creator_start_ticks=ticks,
                      created_ns=created, fingerprint=text, pid_namespace=pid_ns,
                      version=version, secret=secret)


def open_pool_file(path: str, *, writable: bool, missing: str = "") -> int:
    """Open an existing pool file without following a symbolic link; returns the fd.

    ``SharedHostPoolError`` (naming ``path``) when it is missing (``missing`` is appended
    to that message), a symbolic link, not a regular file, or this user may not open it."""
    flags = (os.O_RDWR if writable else os.O_RDONLY) | os.O_NOFOLLOW | os.O_NONBLOCK
    flags |= getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags)
    except FileNotFoundError:
        raise SharedHostPoolError(f"shared host pool file {path} does not exist{missing}.",
                                  path) from None
    except PermissionError:
        raise SharedHostPoolError(
            f"permission denied opening the shared host pool {path} "
            f"({'read-write' if writable else 'read-only'}): every rank must run as the user "
            f"that created it (the file is mode 0600).", path) from None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise SharedHostPoolError(f"{path} is a symbolic link; a shared host pool is "
                                      f"never opened through one.", path) from None
        raise SharedHostPoolError(f"cannot open the shared host pool {path}: "
                                  f"{exc.strerror}.", path) from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise SharedHostPoolError(f"{path} is not a regular file.", path)
    except BaseException:
        os.close(fd)
        raise
    return fd


def creator_alive(header: PoolHeader) -> Optional[bool]:
    """Whether the process that created the pool still runs; ``None`` (unknown) when it
    was created in another pid namespace (see the module docstring)."""
    pid = header.creator_pid
    if header.pid_namespace and pid_namespace() and header.pid_namespace != pid_namespace():
        return None
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # exists, owned by another user
    if _process_state(pid) in ("Z", "X"):
        return False
    ticks = process_start_ticks(pid)
    return not (header.creator_start_ticks and ticks is not None
                and ticks != header.creator_start_ticks)


@dataclass(frozen=True)
class PoolInfo:
    """One pool file found by ``list_pools``.

    ``state``: ``"alive"`` (its creator runs), ``"stale"`` (its creator is gone) or
    ``"unknown"`` (no readable header: ``error`` says why). ``header`` is ``None`` unless the
    header was read."""

    name: str
    path: str
    file_bytes: int
    state: str
    header: Optional[PoolHeader] = None
    error: str = ""
    file_id: tuple[int, int] = (0, 0)   # (st_dev, st_ino): the very file inspected
    owner_uid: int = -1                 # the file's owner and group ids, -1 unknown
    group_gid: int = -1
    mode: int = 0                       # its permission bits

    @property
    def owner(self) -> str:
        """The owner's user name (its uid when it has none; ``"?"`` unknown)."""
        return "?" if self.owner_uid < 0 else _owner_name(self.owner_uid)

    @property
    def group(self) -> str:
        """The file's group name (its gid when it has none; ``"?"`` unknown)."""
        return "?" if self.group_gid < 0 else _group_name(self.group_gid)


def inspect_pool(name: str, folder: Optional[str] = None) -> Optional[PoolInfo]:
    """What the pool file ``name`` in ``folder`` (default ``pool_dir()``) is, or ``None``
    when there is no such file."""
    folder = pool_dir() if folder is None else folder
    path = os.path.join(folder, FILE_PREFIX + check_name(name))
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return None
    file_id = (info.st_dev, info.st_ino)
    ids = dict(owner_uid=info.st_uid, group_gid=info.st_gid, mode=stat.S_IMODE(info.st_mode))
    if not stat.S_ISREG(info.st_mode):
        return PoolInfo(name, path, 0, "unknown", error="not a regular file", file_id=file_id,
                        **ids)
    try:
        fd = open_pool_file(path, writable=False)
    except SharedHostPoolError as exc:
        return PoolInfo(name, path, info.st_size, "unknown", error=str(exc), file_id=file_id,
                        **ids)
    try:
        opened = os.fstat(fd)
        file_id = (opened.st_dev, opened.st_ino)
        ids = dict(owner_uid=opened.st_uid, group_gid=opened.st_gid,
                   mode=stat.S_IMODE(opened.st_mode))
        header = read_header(fd, path)
    except SharedHostPoolError as exc:
        return PoolInfo(name, path, info.st_size, "unknown", error=str(exc), file_id=file_id,
                        **ids)
    finally:
        os.close(fd)
    alive = creator_alive(header)
    if alive is None:
        return PoolInfo(name, path, info.st_size, "unknown", header,
                        error="created in another pid namespace", file_id=file_id, **ids)
    return PoolInfo(name, path, info.st_size, "alive" if alive else "stale", header,
                    file_id=file_id, **ids)


def list_pools(folder: Optional[str] = None) -> list[PoolInfo]:
    """Every ``hisparse-NAME`` file in ``folder`` (default ``pool_dir()``), sorted by name."""
    folder = pool_dir() if folder is None else folder
    found = []
    for entry in sorted(os.listdir(folder)):
        name = entry[len(FILE_PREFIX):]
        if not entry.startswith(FILE_PREFIX) or _NAME.fullmatch(name) is None:
            continue
        info = inspect_pool(name, folder)
        if info is not None:
            found.append(info)
    return found


def remove_pool(name: str, *, force: bool = False, folder: Optional[str] = None) -> PoolInfo:
    """Unlink the pool file ``name`` and return what it was.

    Refuses (``SharedHostPoolError``) a pool whose creator is alive, or whose state is
    unknown, unless ``force``; ``SharedHostPoolError`` too if there is no such pool.
    Processes that still map it keep their memory until they unmap it."""
    folder = pool_dir() if folder is None else folder
    path = os.path.join(folder, FILE_PREFIX + check_name(name))
    info = inspect_pool(name, folder)
    if info is None:
        raise SharedHostPoolError(f"there is no shared host pool {name!r} ({path}).", path)
    if info.state != "stale" and not force:
        why = (f"its creator (pid {info.header.creator_pid}) is alive"
               if info.state == "alive" else f"its state is unknown ({info.error})")
        raise SharedHostPoolError(f"refusing to remove the shared host pool {name!r} ({path}): "
                                  f"{why}; force (--force) removes it anyway.", path)
    try:
        current = os.lstat(path)
    except FileNotFoundError:
        return info                      # someone else removed it meanwhile
    if (current.st_dev, current.st_ino) != info.file_id:
        raise SharedHostPoolError(f"the shared host pool {name!r} ({path}) was replaced while "
                                  f"being removed; left alone.", path)
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    return info
