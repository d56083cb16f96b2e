"""Page-locking the host pool for the GPU, on CUDA and on ROCm builds of torch.

The host pool is registered in place (``cudaHostRegister`` / ``hipHostRegister``) so the
transfer kernels can read it over the bus. Both runtimes are reached through torch's own
bindings, ``torch.cuda.cudart()``: a ROCm build of torch binds ``hipHostRegister``,
``hipHostUnregister`` and ``hipGetErrorString`` under the CUDA names, so one code path
serves both. What differs per runtime is described by a ``GpuRuntime``:

| | CUDA build | ROCm build |
| --- | --- | --- |
| library torch loaded | ``libcudart`` | ``libamdhip64`` |
| flags (portable, mapped) | 1, 2 | 1, 2 |
| read-only registration | ``cudaHostRegisterReadOnly`` (8), where the device supports it | none (HIP ignores the flag on AMD GPUs, and its value 8 also means coarse-grained there): an attached rank maps the pool read-write and registers it plainly |
| sticky error reset | ``cudaGetLastError`` | ``hipGetLastError`` |

The runtimes keep a per-thread "last error" after a failed registration that torch's next
launch check would report against an unrelated kernel; torch does not bind the reset call,
so ``clear_last_error`` finds the runtime library this process loaded (in
``/proc/self/maps``) and calls it there. A torch build whose bindings lack the registration
calls is a clear ``HostMemoryError`` (``require_registration``), never an unpinned pool.
"""

from __future__ import annotations

import ctypes
import logging
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from hisparse_triton.errors import HostMemoryError

__all__ = ["CUDA", "HIP", "GpuRuntime", "clear_last_error", "current_runtime",
           "find_loaded_library", "require_registration"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class GpuRuntime:
    """What pinning host memory looks like on one GPU runtime (see the module docstring)."""

    name: str                 # "CUDA" or "HIP"
    library: str              # the runtime library's file name stem
    get_last_error: str       # the sticky-error reset function
    register_flags: int       # portable | mapped
    read_only_flag: int       # 0: no read-only registration

    @property
    def registers_read_only(self) -> bool:
        """Whether a read-only mapping can be registered (else it is mapped read-write)."""
        return self.read_only_flag != 0

    def call(self, function: str) -> str:
        """The runtime's own name of a ``cuda*`` call (``cudaHostRegister`` ->
        ``hipHostRegister`` on HIP), for messages."""
        return function if self.name == "CUDA" else "hip" + function[len("cuda"):]


CUDA = GpuRuntime(name="CUDA", library="libcudart", get_last_error="cudaGetLastError",
                  register_flags=1 | 2, read_only_flag=8)
HIP = GpuRuntime(name="HIP", library="libamdhip64", get_last_error="hipGetLastError",
                 register_flags=1 | 2, read_only_flag=0)


def current_runtime() -> GpuRuntime:
    """``HIP`` on a ROCm build of torch (``torch.version.hip`` set), else ``CUDA``."""
    return HIP if getattr(torch.version, "hip", None) else CUDA


def require_registration(runtime: Optional[GpuRuntime] = None) -> Any:
    """``torch.cuda.cudart()`` when it binds host registration; ``HostMemoryError`` naming
    the missing calls otherwise (the pool is then never silently left unpinned)."""
    runtime = runtime or current_runtime()
    try:
        cudart = torch.cuda.cudart()
    except Exception as exc:  # noqa: BLE001 - any failure means no bindings
        raise HostMemoryError(f"this torch build gives no {runtime.name} runtime bindings "
                              f"(torch.cuda.cudart() failed: {exc}); the host pool cannot be "
                              f"pinned.", resource="pinned host bytes") from None
    missing = [name for name in ("cudaHostRegister", "cudaHostUnregister")
               if not callable(getattr(cudart, name, None))]
    if missing:
        calls = ", ".join(runtime.call(name) for name in missing)
        raise HostMemoryError(f"this torch build ({runtime.name}) does not bind {calls} in "
                              f"torch.cuda.cudart(): the host pool cannot be pinned; use a "
                              f"torch build that does, or pin=False (a pool the GPU cannot "
                              f"read over the bus).", resource="pinned host bytes")
    return cudart


def find_loaded_library(stem: str, maps: str = "/proc/self/maps") -> list[str]:
    """Paths of the loaded libraries whose file name starts with ``stem`` (``libcudart``,
    ``libamdhip64``), from the process's memory map ``maps``; empty when none or unreadable."""
    found: dict[str, None] = {}
    try:
        with open(maps, encoding="ascii", errors="replace") as lines:
            for line in lines:
                path = line.split()[-1] if line.strip() else ""
                if path.startswith("/") and path.rsplit("/", 1)[-1].startswith(stem):
                    found[path] = None
    except OSError:
        return []
    return list(found)


def clear_last_error(runtime: Optional[GpuRuntime] = None, *, maps: str = "/proc/self/maps",
                     load: Callable[[str], Any] = ctypes.CDLL) -> bool:
    """Reset the runtime's per-thread last error after a failed call (best effort): calls
    ``runtime.get_last_error`` in every loaded copy of ``runtime.library``. Returns whether
    one was found and called (a warning is logged when none was)."""
    runtime = runtime or current_runtime()
    called = False
    for path in find_loaded_library(runtime.library, maps):
        try:
            getattr(load(path), runtime.get_last_error)()
            called = True
        except (OSError, AttributeError):  # not that library after all
            continue
    if not called:
        logger.warning("could not reset the %s runtime's last error (%s not found among the "
                       "loaded libraries): the next kernel-launch check may report the failed "
                       "host registration.", runtime.name, runtime.library)
    return called
