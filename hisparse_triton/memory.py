"""Memory checks made BEFORE allocating: one clear error instead of an allocator error or an
OOM kill.

``check_memory(requests, max_ram_fraction=...)`` takes every allocation a component is about
to make (``MemoryRequest(what, nbytes, device)``) and sums them per place they land in:

- host RAM: every CPU request (plain CPU tensors, pinned memory, a shared-memory file), all
  together against ``max_ram_fraction`` of the RAM this process can still get
  (``available_ram_bytes``: ``MemAvailable`` capped by the container's cgroup memory limit);
- each CUDA device: its requests together against the free bytes
  ``torch.cuda.mem_get_info`` reports.

Either sum too large raises (``HostMemoryError`` for RAM, ``CapacityError`` for a GPU) with a
message naming every item and the amount available; nothing is allocated by the check.
Requests on other device types (``meta``, ``mps``, ...) are not checked.
"""

from __future__ import annotations

import numbers
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional, Sequence

import numpy as np

from hisparse_triton.errors import CapacityError, HostMemoryError

if TYPE_CHECKING:  # pragma: no cover
    import torch
# torch is imported where a device is handled, so the torch-free scheduler can use the RAM
# probe (``available_ram_bytes``) without importing it.

__all__ = ["MemoryRequest", "available_ram_bytes", "cgroup_available_bytes", "check_fraction",
           "check_memory", "format_bytes", "format_fraction"]


@dataclass(frozen=True)
class MemoryRequest:
    """One allocation about to be made.

    - ``what``: what it is, as the error message should name it (``"host pool"``).
    - ``nbytes``: its size in bytes (an int >= 0).
    - ``device``: where it lands; ``cpu`` (pinned or not) means host RAM.
    - ``hint``: what the user can lower to shrink it (``"host_pool_gib"``); optional.
    """

    what: str
    nbytes: int
    device: torch.device
    hint: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.what, str) or not self.what:
            raise ValueError(f"MemoryRequest.what must be a non-empty str, got {self.what!r}.")
        if (not isinstance(self.nbytes, numbers.Integral)
                or isinstance(self.nbytes, (bool, np.bool_)) or self.nbytes < 0):
            raise ValueError(f"MemoryRequest.nbytes of {self.what!r} must be an int >= 0, "
                             f"got {self.nbytes!r}.")
        object.__setattr__(self, "nbytes", int(self.nbytes))
        import torch

        try:
            device = torch.device(self.device)
        except (RuntimeError, TypeError) as exc:
            raise ValueError(f"MemoryRequest.device of {self.what!r} is not a device: "
                             f"{self.device!r} ({exc}).") from None
        object.__setattr__(self, "device", device)


def format_bytes(nbytes: int) -> str:
    """``"12884901888 B (12.00 GiB)"``: exact bytes and a readable size."""
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if nbytes >= 1 << shift:
            return f"{nbytes} B ({nbytes / (1 << shift):.2f} {unit})"
    return f"{nbytes} B"


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


def check_fraction(max_ram_fraction: float, name: str = "max_ram_fraction") -> None:
    """``ValueError`` naming ``name`` unless ``max_ram_fraction`` is a real number in
    ``(0, 1]`` (numpy floats and integers too)."""
    if (isinstance(max_ram_fraction, (bool, np.bool_))
            or not isinstance(max_ram_fraction, numbers.Real)
            or not 0 < max_ram_fraction <= 1):
        raise ValueError(f"{name} must be in (0, 1], got {max_ram_fraction!r}.")


def format_fraction(fraction: float) -> str:
    """``fraction`` as a percentage that never rounds to 0: ``"90%"``, ``"99.5%"``,
    ``"1e-298%"``."""
    return f"{100 * float(fraction):.3g}%"


def _itemize(requests: Sequence[MemoryRequest]) -> tuple[str, str]:
    """``("host pool 8192 B + device pool 1024 B", "lower host_pool_gib or ...")``."""
    items = " + ".join(f"{r.what} {format_bytes(r.nbytes)}" for r in requests)
    hints = list(dict.fromkeys(r.hint for r in requests if r.hint))
    advice = f"lower {' or '.join(hints)}" if hints else "allocate less"
    return items, advice


def _cuda_device(device: torch.device) -> torch.device:
    import torch

    if not torch.cuda.is_available():
        raise ValueError(f"memory requested on {device}, but CUDA is not available on this "
                         f"machine.")
    index = device.index if device.index is not None else torch.cuda.current_device()
    if not 0 <= index < torch.cuda.device_count():
        raise ValueError(f"memory requested on {device}: this machine has "
                         f"{torch.cuda.device_count()} CUDA device(s).")
    return torch.device("cuda", index)


def check_memory(requests: Sequence[MemoryRequest], *, max_ram_fraction: float = 0.9) -> None:
    """Raise unless every request fits at once; allocates nothing and changes nothing.

    Host RAM: the CPU requests together must not exceed ``max_ram_fraction`` (in ``(0, 1]``)
    of ``available_ram_bytes()``, else ``HostMemoryError``. Each CUDA device: its requests
    together must not exceed the free bytes of ``torch.cuda.mem_get_info``, else
    ``CapacityError``. Both errors name every item, its size and the amount available
    (``needed`` / ``available`` attributes: the sum and the available bytes).
    """
    check_fraction(max_ram_fraction)
    requests = list(requests)
    for request in requests:
        if not isinstance(request, MemoryRequest):
            raise ValueError(f"check_memory takes MemoryRequest items, got {request!r}.")
    host = [r for r in requests if r.device.type == "cpu"]
    by_gpu: dict[torch.device, list[MemoryRequest]] = {}
    for request in requests:
        if request.device.type == "cuda":
            by_gpu.setdefault(_cuda_device(request.device), []).append(request)
    if host:
        needed = sum(r.nbytes for r in host)
        available = available_ram_bytes()
        if needed > max_ram_fraction * available:
            items, advice = _itemize(host)
            total = f" = {format_bytes(needed)}" if len(host) > 1 else ""
            raise HostMemoryError(
                f"{items}{total} exceeds {format_fraction(max_ram_fraction)} of the "
                f"available RAM ({format_bytes(available)}: MemAvailable, capped by the cgroup "
                f"memory limit); {advice}.", resource="host RAM bytes", needed=needed,
                available=available)
    for device, on_device in by_gpu.items():
        needed = sum(r.nbytes for r in on_device)
        import torch

        free, _ = torch.cuda.mem_get_info(device)
        if needed > free:
            items, advice = _itemize(on_device)
            total = f" = {format_bytes(needed)}" if len(on_device) > 1 else ""
            raise CapacityError(
                f"{items}{total} does not fit the {format_bytes(free)} free on {device}; "
                f"{advice}.", resource="device bytes", needed=needed, available=free)
