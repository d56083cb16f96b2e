"""Compile kernel launches for one GPU target, on any machine (no GPU needed).

``TargetCompiler`` specialises a launch the way Triton's launch-time binder does (ints equal
to 1 become constants, pointers and ints divisible by 16 get the divisibility hint), refuses a
workgroup larger than the target allows (``launch_config.check_workgroup`` with the target's
warp size), compiles it with ``triton.compile`` for the target, and caches the result per
specialisation, so identical launches are compiled once. What is read from the compiled
kernel (registers, spills, shared memory, occupancy) is the subclass's ``usage``: the NVIDIA
compiler in ``compile_report``, the AMD one in ``amd_report``. A kernel that does not compile
is a finding (``error`` in its record), not a crash.
"""

from __future__ import annotations

import abc
import time
from typing import Any

__all__ = ["TargetCompiler"]


class TargetCompiler(abc.ABC):
    """Compiles launches for ``target`` (a ``triton.backends.compiler.GPUTarget``);
    identical specialisations once. Subclasses read the compiled kernel in ``usage``."""

    def __init__(self, target: Any) -> None:
        from triton.compiler import make_backend

        self.target = target
        self.backend = make_backend(target)
        self.cache: dict[str, dict[str, Any]] = {}

    def specialise(self, fn: Any, args: tuple, kwargs: dict):
        """``(options, signature, constexprs, attrs)`` of ``fn(*args, **kwargs)`` on the
        target, as Triton's launch-time binder makes them."""
        from triton.runtime.jit import create_function_from_signature

        binder = create_function_from_signature(fn.signature, fn.params, self.backend)
        bound, specialization, options = binder(*args, **kwargs)
        return fn._pack_args(self.backend, options, bound, specialization, options)

    @abc.abstractmethod
    def usage(self, kernel: Any) -> dict[str, Any]:
        """The record of a compiled kernel (``triton.compile``'s result): what the
        target's compiler output says about it (registers, spills, memory, occupancy)."""

    def compile(self, fn: Any, args: tuple, kwargs: dict) -> dict[str, Any]:
        """The record of one launch (``usage`` plus ``error``, ``num_warps``, ``compile_s``),
        compiled once per specialisation."""
        import triton
        from triton.compiler import ASTSource

        from hisparse_triton.kernels.launch_config import check_workgroup

        options, signature, constexprs, attrs = self.specialise(fn, args, kwargs)
        key = repr((fn.fn.__qualname__, sorted(signature.items()), sorted(constexprs.items()),
                    sorted(attrs.items()), sorted(options.__dict__.items())))
        if key in self.cache:
            return self.cache[key]
        start = time.perf_counter()
        try:
            check_workgroup(options.num_warps, self.target.warp_size, fn.fn.__name__)
            kernel = triton.compile(ASTSource(fn, signature, constexprs, attrs),
                                    target=self.target, options=options.__dict__)
            info = self.usage(kernel)
            info["error"] = None
        except Exception as exc:  # a kernel that does not compile is a finding, not a crash
            info = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}",
                    "num_warps": options.num_warps}
        info["compile_s"] = round(time.perf_counter() - start, 2)
        self.cache[key] = info
        return info
