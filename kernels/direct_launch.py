"""Direct launches: call a Triton kernel's compiled launcher without ``JITFunction.run``.

A ``kernel[grid](*args, **constexprs)`` call runs Triton's whole Python launch path every
time: binding the arguments, specialising each one (dtype, 16-byte alignment, ints equal to 1),
building the cache key, looking the compiled kernel up, then calling its launcher. On the
decode path the same launch repeats with the same shapes, strides and ints; only a few tensors
(the step's top-k, its outputs) change, and only their addresses. ``DirectLaunch`` runs the
normal path once, keeps the ``CompiledKernel`` it returned, and from then on calls
``compiled.run(grid, stream, function, metadata, ..., *args)`` itself: the launcher of the
already compiled specialisation, with the arguments in the order the binder produces
(every parameter, constexprs included, as Triton 3.6 to 3.9 pass them). Pointers go to the
launcher as addresses (ints), which its C code takes as they are: for a tensor it would call
``data_ptr()`` and query the driver about the pointer, per tensor argument per launch. The
bound tensors stay referenced (``args``), and the first launch of every binding took the
normal path, which checked each of them.

What a direct call must keep true, and how it is checked per call:

- the specialisation: every argument except the ``dynamic`` tensors is the object bound the
  first time (the caller guarantees it: a bound launch is made per shape); a dynamic tensor
  may change its address, and its 16-byte alignment (Triton's only pointer specialisation) is
  compared with the bound one: an alignment not seen before goes through the normal path
  once and is bound too (one compiled specialisation per alignment pattern, kept, so plans
  whose addresses alternate between aligned and unaligned both stay direct);
- launch hooks (profilers, ``knobs.runtime.launch_enter_hook``): when one is registered,
  the call takes the normal path, which builds the launch metadata the hook expects (with no
  hook registered the direct call passes no metadata and no hook, which the launcher skips);
- the interpreter (``TRITON_INTERPRET=1``) has no compiled kernel: every call takes the
  normal path.

``DirectLaunch.direct_calls`` / ``fallback_calls`` count which path ran (tests and the
host-cost benchmark read them). Correctness never depends on the direct path: every reason
not to take it falls back to ``kernel[grid](...)``.
"""

from __future__ import annotations

import os
from typing import Any, Optional, Sequence

import torch

__all__ = ["DirectLaunch", "direct_launch_enabled"]

#: Environment variable that turns direct launches off (``0``): every call then takes
#: Triton's normal launch path.
ENV_VAR = "HISPARSE_TRITON_DIRECT_LAUNCH"
_ALIGNMENT = 16  # bytes: the pointer divisibility Triton specialises on


def direct_launch_enabled() -> bool:
    """Whether direct launches are allowed (``$HISPARSE_TRITON_DIRECT_LAUNCH`` is not ``0``
    and the kernels are compiled, not interpreted)."""
    return (os.environ.get(ENV_VAR, "1") != "0"
            and os.environ.get("TRITON_INTERPRET") != "1")


def _aligned(tensor: torch.Tensor) -> bool:
    return tensor.data_ptr() % _ALIGNMENT == 0


class DirectLaunch:
    """One kernel launch of fixed shape, replayed through its compiled launcher.

    - ``kernel``: the ``@triton.jit`` function; ``grid``: a tuple of up to 3 ints.
    - ``args``: the positional arguments of the kernel call; ``constexprs``: its keyword
      arguments (constexpr parameters and launch options such as ``num_warps``).
    - ``dynamic``: positions in ``args`` of tensors that ``__call__`` replaces (their address
      may change between calls, nothing else about them: dtype, shape, strides and device are
      the caller's to keep).

    ``launch(*tensors)`` launches with ``tensors`` at the ``dynamic`` positions.
    """

    def __init__(self, kernel: Any, grid: Sequence[int], args: Sequence[Any],
                 constexprs: dict, dynamic: Sequence[int] = ()) -> None:
        self.kernel = kernel
        self.grid = tuple(int(g) for g in grid)
        if not 1 <= len(self.grid) <= 3:
            raise ValueError(f"grid must have 1 to 3 dimensions, got {grid!r}.")
        self.grid3 = (*self.grid, 1, 1)[:3]
        self.args = list(args)
        self.constexprs = dict(constexprs)
        self.dynamic = tuple(dynamic)
        for position in self.dynamic:
            if not isinstance(self.args[position], torch.Tensor):
                raise ValueError(f"dynamic argument {position} is not a tensor.")
        self.direct_calls = 0
        self.fallback_calls = 0
        self._compiled: Any = None
        self._values: Optional[list] = None      # every parameter's value, in kernel order
        self._value_index: tuple[int, ...] = ()  # where each dynamic arg sits in _values
        self._alignment: tuple[bool, ...] = ()
        #: other alignment patterns bound before: alignment -> (compiled, values)
        self._bindings: dict[tuple[bool, ...], tuple[Any, list]] = {}
        self._enabled = direct_launch_enabled()

    # ------------------------------------------------------------------ binding
    def _bind(self, compiled: Any) -> None:
        """Keep ``compiled`` and the parameter values the binder would pass to it."""
        params = getattr(self.kernel, "params", None)
        if compiled is None or params is None or not hasattr(compiled, "run"):
            self._compiled = None
            return
        values, index_of_arg = [], {}
        for i, param in enumerate(params):
            if i < len(self.args):
                index_of_arg[i] = len(values)
                values.append(self.args[i])
            elif param.name in self.constexprs:
                values.append(self.constexprs[param.name])
            elif _has_default(param):
                values.append(param.default)
            else:  # a parameter we cannot name: never launch directly
                self._compiled = None
                return
        from triton import knobs
        from triton.runtime.driver import driver

        self._runtime, self._driver = knobs.runtime, driver
        # Pointers as addresses: the launcher reads an int as the address itself, while a
        # tensor costs it a ``data_ptr()`` call and a driver query per argument per launch.
        # ``self.args`` keeps every bound tensor alive.
        values = [v.data_ptr() if isinstance(v, torch.Tensor) else v for v in values]
        self._values = values
        self._value_index = tuple(index_of_arg[p] for p in self.dynamic)
        self._alignment = tuple(_aligned(self.args[p]) for p in self.dynamic)
        # The launcher, its function handle and packed metadata (loaded by the normal
        # launch that compiled it): ``compiled.run`` per call would be a property lookup.
        self._compiled = compiled
        self._launcher = (compiled.run, compiled.function, compiled.packed_metadata)
        self._bindings[self._alignment] = (compiled, values, self._launcher)

    def _normal(self, tensors: Sequence[torch.Tensor]) -> None:
        for position, tensor in zip(self.dynamic, tensors):
            self.args[position] = tensor
        self.fallback_calls += 1
        compiled = self.kernel[self.grid](*self.args, **self.constexprs)
        if self._enabled:
            self._bind(compiled)

    # ------------------------------------------------------------------ launching
    def launch(self, *tensors: torch.Tensor) -> None:
        """Launch with ``tensors`` at the dynamic positions (see the class docstring)."""
        compiled = self._compiled
        if compiled is None:
            self._normal(tensors)
            return
        runtime = self._runtime
        # A hook would run: Triton 3.6+ keeps hooks in a HookChain (its ``calls`` list, empty
        # by default); older versions hold None or the hook itself.
        if getattr(runtime.launch_enter_hook, "calls", runtime.launch_enter_hook) \
                or getattr(runtime.launch_exit_hook, "calls", runtime.launch_exit_hook):
            self._normal(tensors)
            return
        values = self._values
        for index, tensor, aligned in zip(self._value_index, tensors, self._alignment):
            address = tensor.data_ptr()
            if (address % _ALIGNMENT == 0) is not aligned:
                if not self._switch(tensors):
                    self._normal(tensors)
                    return
                values = self._values
                for index2, tensor2 in zip(self._value_index, tensors):
                    values[index2] = tensor2.data_ptr()
                break
            values[index] = address
        run, function, metadata = self._launcher
        active = self._driver.active
        stream = active.get_current_stream(active.get_current_device())
        g0, g1, g2 = self.grid3
        run(g0, g1, g2, stream, function, metadata, None, None, None, *values)
        self.direct_calls += 1

    __call__ = launch

    @property
    def bound(self) -> bool:
        """Whether calls go to the compiled launcher (after a first normal launch, unless
        direct launches are off or the kernel is interpreted)."""
        return self._compiled is not None

    def _switch(self, tensors: Sequence[torch.Tensor]) -> bool:
        """Make the binding of ``tensors``' alignment pattern the current one, if bound."""
        alignment = tuple(_aligned(t) for t in tensors)
        bound = self._bindings.get(alignment)
        if bound is None:
            return False
        self._compiled, self._values, self._launcher = bound
        self._alignment = alignment
        return True


def _has_default(param: Any) -> bool:
    import inspect

    return param.default is not inspect.Parameter.empty
