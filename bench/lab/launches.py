"""Record kernel launches instead of running them (compile report, host-cost benchmark, tests).

``record_launches()`` replaces every Triton kernel of the kernel modules (``resolve``,
``gather``, ``backup``, ``prefill`` and the vLLM plugin's ``vllm_residency``, ``vllm_gather``,
``vllm_fp8``) by a stand-in whose ``kernel[grid](*args, **kwargs)``
appends a ``Launch`` to a list and returns; the launchers' own Python (argument checks, launch shapes,
workspace handling) still runs. With ``cpu_as_cuda=True`` the launchers also accept CPU
tensors without ``TRITON_INTERPRET=1`` (they stand in for CUDA tensors). Everything is
restored on exit.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, NamedTuple

__all__ = ["Launch", "kernel_modules", "record_launches"]


class Launch(NamedTuple):
    """One recorded ``kernel[grid](*args, **kwargs)``; ``tag`` is the recorder's tag then."""

    tag: str
    kernel: Any  # the JITFunction (or InterpretedFunction) that would have run
    grid: Any
    args: tuple
    kwargs: dict


class _Recorder:
    def __init__(self, kernel: Any, launches: list, tag: list[str], store: bool):
        self.kernel, self.launches, self.tag, self.store = kernel, launches, tag, store

    def __getitem__(self, grid):
        if not self.store:
            return self._count

        def record(*args, **kwargs):
            self.launches.append(Launch(self.tag[0], self.kernel, grid, args, kwargs))
        return record

    def _count(self, *args, **kwargs):
        self.launches.append(self.kernel)


def kernel_modules() -> list[Any]:
    """The modules that define the Triton kernels."""
    from hisparse_triton.kernels import (backup, gather, prefill, resolve, sglang_swap_in,
                                         vllm_fp8, vllm_gather, vllm_residency)

    return [resolve, gather, backup, prefill, vllm_residency, vllm_gather, vllm_fp8,
            sglang_swap_in]


@contextlib.contextmanager
def record_launches(*, cpu_as_cuda: bool = True, tag: list[str] | None = None,
                    store: bool = True) -> Iterator[list[Launch]]:
    """Within the block, kernel launches append to the yielded list instead of running.

    ``tag``: a one-element list whose current value labels each launch (change it between
    calls). ``cpu_as_cuda``: launchers accept CPU tensors as if they were CUDA tensors.
    ``store=False``: append only the kernel (the cheapest stand-in: for timing the launchers).
    """
    from triton.runtime.jit import KernelInterface

    launches: list[Launch] = []
    tag = tag if tag is not None else [""]
    saved = []
    for module in kernel_modules():
        for name, value in list(vars(module).items()):
            if isinstance(value, KernelInterface):
                saved.append((module, name, value))
                setattr(module, name, _Recorder(value, launches, tag, store))
        if cpu_as_cuda and hasattr(module, "_check_backend"):
            saved.append((module, "_check_backend", module._check_backend))
            module._check_backend = lambda device: None
    try:
        yield launches
    finally:
        for module, name, value in reversed(saved):
            setattr(module, name, value)
