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

import copy
import os
from typing import Any, Optional, Sequence

import torch

__all__ = ["DirectLaunch", "DirectPair", "direct_launch_enabled"]

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


_data_ptr = torch.Tensor.data_ptr


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
        self._launcher: tuple = ()                # (compiled.run, function, packed metadata)
        self._forward: Optional[tuple] = None     # ``_forwarding``'s answer for the launcher
        self._args: Optional[tuple] = None        # the values as a tuple (None: rebuild)
        self._addresses: Optional[tuple] = None   # the dynamic tensors' addresses in _values
        #: every alignment pattern bound: alignment -> (compiled, values, launcher, forward)
        self._bindings: dict[tuple[bool, ...], tuple] = {}
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
        self._forward = _forwarding(compiled.run, self.grid3, compiled.function,
                                    compiled.packed_metadata, values)
        self._addresses = tuple(self._values[i] for i in self._value_index)
        self._args = None
        self._bindings[self._alignment] = (compiled, values, self._launcher, self._forward)

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
        if self._compiled is None or _hooks_registered(self._runtime) \
                or (tensors and not self._place(tensors)):
            self._normal(tensors)
            return
        active = self._driver.active
        self._send(active.get_current_stream(active.get_current_device()))
        self.direct_calls += 1

    __call__ = launch

    def _place(self, tensors: Sequence[torch.Tensor]) -> bool:
        """Put the addresses of ``tensors`` (the dynamic arguments) into the bound values,
        switching to the binding of their alignment pattern; False when that pattern has no
        binding yet (the call must take the normal path, which binds it). Addresses equal
        to the last call's change nothing (the common case: persistent buffers)."""
        addresses = tuple(map(_data_ptr, tensors))
        if addresses == self._addresses:
            return True
        alignment = tuple(address % _ALIGNMENT == 0 for address in addresses)
        if alignment != self._alignment and not self._switch(alignment):
            return False
        values = self._values
        for index, address in zip(self._value_index, addresses):
            values[index] = address
        self._addresses, self._args = addresses, None
        return True

    def _send(self, stream: Any) -> None:
        """Hand the bound values to the compiled launcher on ``stream``: straight to the
        launch its Python ``__call__`` forwards to where that was captured at binding
        (``_forwarding``; the values as one tuple, rebuilt only after an address changed),
        else through ``__call__``."""
        forward = self._forward
        if forward is None:
            run, function, metadata = self._launcher
            g0, g1, g2 = self.grid3
            run(g0, g1, g2, stream, function, metadata, None, None, None, *self._values)
            return
        args = self._args
        if args is None:
            args = self._args = tuple(self._values)
        launch, head, tail = forward
        launch(*head, stream, *tail, args)

    @property
    def bound(self) -> bool:
        """Whether calls go to the compiled launcher (after a first normal launch, unless
        direct launches are off or the kernel is interpreted)."""
        return self._compiled is not None

    @property
    def forwarded(self) -> bool:
        """Whether calls skip the launcher's Python ``__call__`` (``_forwarding``)."""
        return self._compiled is not None and self._forward is not None

    def _switch(self, alignment: tuple[bool, ...]) -> bool:
        """Make the binding of the alignment pattern ``alignment`` the current one, if
        bound."""
        bound = self._bindings.get(alignment)
        if bound is None:
            return False
        self._compiled, self._values, self._launcher, self._forward = bound
        self._alignment = alignment
        self._addresses, self._args = None, None
        return True


#: The stream ``_forwarding`` passes while it watches a launcher forward a call.
_STREAM_MARK = object()


def _forwarding(launcher: Any, grid3: tuple, function: Any, metadata: Any,
                values: list) -> Optional[tuple]:
    """``(launch, head, tail)`` when ``launcher``'s Python ``__call__`` only forwards the call
    to its ``launch`` attribute (Triton 3.7+'s ``CudaLauncher``: the C launch, given the
    kernel arguments as one tuple): ``launch(*head, stream, *tail, args)`` then does what
    ``launcher(*grid3, stream, function, metadata, None, None, None, *args)`` does. Found by
    watching one such call of a copy of ``launcher`` whose ``launch`` is a recorder (nothing
    is launched, the launcher itself is not touched):
    ``head`` must be the grid, the stream must come next, ``function`` after it and the
    arguments last, as one sequence of the very values; the launcher must allocate no
    per-launch scratch (its sizes 0). None for any other launcher (the call then goes
    through ``__call__``)."""
    if "launch" not in vars(launcher) or getattr(launcher, "global_scratch_size", 1) != 0 \
            or getattr(launcher, "profile_scratch_size", 1) != 0:
        return None
    forward = launcher.launch
    seen: list[tuple] = []
    try:
        # A shallow copy watched, so that the shared launcher (every binding of this
        # compiled kernel, in any thread) never launches into the recorder.
        probe = copy.copy(launcher)
        probe.launch = lambda *args: seen.append(args)
        probe(*grid3, _STREAM_MARK, function, metadata, None, None, None, *values)
    except Exception:
        return None
    if len(seen) != 1:
        return None
    call = seen[0]
    sent = call[-1] if call else None
    if len(call) < 6 or tuple(call[:3]) != tuple(grid3) or call[3] is not _STREAM_MARK \
            or call[4] is not function or any(a is _STREAM_MARK for a in call[4:]) \
            or not isinstance(sent, (tuple, list)) or len(sent) != len(values) \
            or any(a is not b for a, b in zip(sent, values)):
        return None
    return forward, tuple(call[:3]), tuple(call[4:-1])


def _hooks_registered(runtime: Any) -> bool:
    """Whether a launch hook would run (``knobs.runtime``'s enter / exit hooks): Triton 3.6+
    keeps them in a HookChain (its ``calls`` list, empty by default); older versions hold
    None or the hook itself."""
    enter, exit_ = runtime.launch_enter_hook, runtime.launch_exit_hook
    return bool(getattr(enter, "calls", enter) or getattr(exit_, "calls", exit_))


class DirectPair:
    """Two bound launches made back to back on the current stream: ``first`` with its
    dynamic tensors, then ``second`` (which has none), e.g. the decode path's resolve and the
    gather of its miss plan. ``pair(*tensors)`` does what ``first(*tensors); second()`` does,
    with one hook check and one stream lookup for both; whenever either launch would not go
    straight to its compiled launcher (not bound yet, a hook registered, an alignment not
    bound) it makes exactly those two calls instead.

    ``stage`` says how far the last call got (0: nothing launched, 1: ``first`` launched,
    2: both), so a caller whose ``second`` raised knows ``first`` ran.
    """

    def __init__(self, first: DirectLaunch, second: DirectLaunch) -> None:
        if second.dynamic:
            raise ValueError("the second launch of a DirectPair takes no dynamic tensors.")
        self.first, self.second = first, second
        self.stage = 0

    def __call__(self, *tensors: torch.Tensor) -> None:
        first, second = self.first, self.second
        self.stage = 0
        if first._compiled is None or second._compiled is None \
                or _hooks_registered(first._runtime) or not first._place(tensors):
            self._one_by_one(tensors)
            return
        active = first._driver.active
        stream = active.get_current_stream(active.get_current_device())
        first._send(stream)
        first.direct_calls += 1
        self.stage = 1
        second._send(stream)
        second.direct_calls += 1
        self.stage = 2

    def _one_by_one(self, tensors: tuple) -> None:
        self.first.launch(*tensors)
        self.stage = 1
        self.second.launch()
        self.stage = 2


def _has_default(param: Any) -> bool:
    import inspect

    return param.default is not inspect.Parameter.empty
