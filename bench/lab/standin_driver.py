"""A stand-in CUDA driver for Triton: real compiles and Triton's real Python launch path,
without a GPU (host-cost measurements and launch tests on CPU).

``standin_cuda_driver(arch=90)`` makes Triton believe an NVIDIA GPU of that architecture is
the active device: ``kernel[grid](...)`` binds and specialises its arguments, builds the cache
key, compiles the kernel for ``sm_<arch>`` with the ``ptxas`` Triton ships (once; Triton's
disk cache keeps it), loads it through the stand-in's ``load_binary`` and calls the launcher.
The launcher is Triton's own Python launcher class of the installed version (``CudaLauncher``:
its Python ``__call__`` runs as on a GPU) where it can be built without the CUDA toolkit's
compiled helpers: their C ``launch`` is replaced by ``StandInLaunch``, and the few names its
constructor takes from them (``PyKernelArg``, the ``ARG_*`` kinds,
``build_signature_metadata``) by plain Python stand-ins for the block; else a Python launcher
with the same call signature. Either way ``StandInLaunch`` reads every pointer argument's
address (as the C launcher does) and records the call instead of launching anything.
Tensors are CPU tensors standing in for CUDA ones. Everything is restored on exit.

What it measures: Triton's Python cost per launch (binding, specialisation, cache lookup,
the launcher's Python wrapper) and the arguments a launch passes. What it does not: the C
launch (``cuLaunchKernel`` and its argument packing, a few microseconds on a real driver) and
anything on the device.
"""

from __future__ import annotations

import contextlib
from operator import itemgetter
from typing import Any, Callable, Iterator, NamedTuple, Optional

import torch

__all__ = ["LaunchCall", "StandInLaunch", "standin_cuda_driver"]

#: Device properties the stand-in reports (an H200 SXM: 132 SMs, 227 KB of shared memory
#: per block).
_PROPERTIES = {"max_shared_mem": 232448, "multiprocessor_count": 132, "max_num_regs": 65536,
               "warpSize": 32, "sm_clock_rate": 1980000, "mem_clock_rate": 2619000,
               "mem_bus_width": 6144}


class LaunchCall(NamedTuple):
    """One launch the stand-in received: its grid and the kernel arguments (values as the
    launcher got them: tensors, ints, constexpr values)."""

    grid: tuple[int, int, int]
    args: tuple


_TENSOR = torch.Tensor
_PLAIN = frozenset({int, float, bool, str, type(None)})


def _no_arguments(args: tuple) -> tuple:
    return ()


def _pointer_picker(annotations: object, signature: object) -> Optional[Callable[[tuple], tuple]]:
    """A C-level picker of the pointer arguments from a launch's argument tuple, built from
    Triton's ``CudaLauncher`` annotations (one per argument: constexpr, kernel argument or
    tuple) and kernel signature (the kernel arguments' types, ``"*i32"`` for a pointer); None
    where they do not have that form (tuple arguments, another Triton): read every one."""
    if not isinstance(annotations, (list, tuple)) or not isinstance(signature, (list, tuple)):
        return None
    kinds = [getattr(a, "type", None) for a in annotations]
    constexpr, kernel = _HELPER_NAMES["ARG_CONSTEXPR"], _HELPER_NAMES["ARG_KERNEL"]
    if any(k not in (constexpr, kernel) for k in kinds) \
            or kinds.count(kernel) != len(signature) \
            or not all(isinstance(t, str) for t in signature):
        return None
    types = iter(signature)
    positions = [i for i, k in enumerate(kinds) if k == kernel and next(types).startswith("*")]
    if not positions:
        return _no_arguments
    if len(positions) == 1:
        return lambda args, _i=positions[0]: (args[_i],)
    return itemgetter(*positions)


#: Most all-scalar argument tuples ``StandInLaunch`` remembers (then it starts again).
_KEPT_TUPLES = 4096


class StandInLaunch:
    """Replaces the driver's C ``launch``: reads each tensor argument's address and records
    the call (``calls``; ``record=False`` only counts, the cheapest for timing).

    The address reads emulate what the C launcher calls back into Python for: it skips
    constexprs and converts scalars in C, and for a pointer parameter takes an int as the
    address itself but calls any other object's ``data_ptr()``. So the stand-in calls
    ``data_ptr()`` for the tensors among the pointer parameters (picked by Triton's kernel
    signature with one C-level ``itemgetter``, ``_pointer_picker``; every argument where
    there is no signature), and charges nothing for the scalars: an argument tuple that
    holds only plain scalars (ints, floats, bools, strings, None) is checked once and then
    remembered by identity (a tuple of scalars never comes to hold a tensor; a caller that
    launches with addresses may pass the same tuple every call). The
    check of a new tuple, and the reads, are as cheap as Python allows (a C-level type
    scan; ``isinstance`` only for what is not a plain tensor: it costs about 0.1 us through
    torch's metaclass, which the C launcher never pays). Like ``cuLaunchKernel``, the C
    launcher's own per-argument conversions are not counted (``docs/benchmarking.md``
    compares this with the per-argument loop of the figures recorded before 2026-12-04).
    ``read_addresses=False`` leaves the reads out: what is left is Triton's own Python
    launch path alone."""

    def __init__(self, record: bool = True, read_addresses: bool = True) -> None:
        self.record = record
        self.read_addresses = read_addresses
        self.calls: list[LaunchCall] = []
        self.count = 0
        self._scalars: dict[int, tuple] = {}   # id -> a tuple of plain scalars seen
        self._pickers: dict[int, tuple] = {}   # id(annotations) -> (annotations, picker)

    def __call__(self, grid: tuple[int, int, int], args: tuple, annotations: object = None,
                 signature: object = None) -> None:
        """One launch: ``args`` the kernel arguments (a tuple); ``annotations`` and
        ``signature`` Triton's ``CudaLauncher``'s, which tell the pointer parameters."""
        if self.read_addresses and self._scalars.get(id(args)) is not args:
            self._read(args, annotations, signature)
        self.count += 1
        if self.record:
            self.calls.append(LaunchCall(grid, args))

    def _read(self, args: tuple, annotations: object, signature: object) -> None:
        if _PLAIN.issuperset(map(type, args)):   # nothing to read, now or ever
            if len(self._scalars) >= _KEPT_TUPLES:
                self._scalars.clear()
            self._scalars[id(args)] = args
            return
        kept = self._pickers.get(id(annotations))
        if kept is None or kept[0] is not annotations:
            kept = self._pickers[id(annotations)] = (
                annotations, _pointer_picker(annotations, signature))
        for arg in (args if kept[1] is None else kept[1](args)):
            cls = arg.__class__
            if cls is _TENSOR or (cls not in _PLAIN and isinstance(arg, _TENSOR)):
                arg.data_ptr()


class _Utils:
    def __init__(self, launch: StandInLaunch) -> None:
        self._launch = launch

    def load_binary(self, name, kernel, shared, device):
        # (module, function, n_regs, n_spills, n_max_threads)
        return 1, 1, 0, 0, 1024

    def get_device_properties(self, device):
        return dict(_PROPERTIES)

    def launch(self, gridX, gridY, gridZ, stream, function, *rest):
        # Triton's Python launcher passes the kernel arguments last (one tuple), after its
        # annotations and kernel signature (Triton 3.7's CudaLauncher).
        if len(rest) >= 3:
            self._launch((gridX, gridY, gridZ), tuple(rest[-1]), rest[-3], rest[-2])
        else:
            self._launch((gridX, gridY, gridZ), tuple(rest[-1]))

    @staticmethod
    def build_signature_metadata(kernel_signature):
        # (the C helper packs the signature for its launch; the stand-in launch reads none)
        return tuple(kernel_signature)


class _KernelArg(NamedTuple):
    """Stand-in of the C helper's ``PyKernelArg`` (an argument's annotation)."""

    nested_tuple: Any
    type: int


#: What Triton's NVIDIA driver module takes from its compiled helper when the helper is built
#: (``CudaUtils``); the stand-in's values while it is active, where the module has none.
_HELPER_NAMES = {"PyKernelArg": _KernelArg, "ARG_CONSTEXPR": 0, "ARG_KERNEL": 1,
                 "ARG_TUPLE": 2}


@contextlib.contextmanager
def _helper_names() -> Iterator[None]:
    """Triton's NVIDIA driver module with the stand-in helper names (where it has no compiled
    helper's: the names are None then), restored on exit."""
    try:
        from triton.backends.nvidia import driver as nvidia_driver
    except Exception:  # pragma: no cover - a Triton without the NVIDIA backend
        yield
        return
    saved = {name: getattr(nvidia_driver, name) for name in _HELPER_NAMES
             if hasattr(nvidia_driver, name) and getattr(nvidia_driver, name) is None}
    for name in saved:
        setattr(nvidia_driver, name, _HELPER_NAMES[name])
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(nvidia_driver, name, value)


def _python_launcher(launch: StandInLaunch):
    """A launcher class for Triton versions whose own cannot be built here: the call
    signature of ``CompiledKernel.run``."""

    class _Launcher:
        def __init__(self, src, metadata) -> None:
            pass

        def __call__(self, gridX, gridY, gridZ, stream, function, kernel_metadata,
                     launch_metadata, enter_hook, exit_hook, *args):
            launch((gridX, gridY, gridZ), args)

    return _Launcher


def _make_driver(arch: int, launch: StandInLaunch):
    from triton.backends.compiler import GPUTarget
    from triton.backends.driver import DriverBase

    utils = _Utils(launch)
    fallback = _python_launcher(launch)
    state = {"own": None}

    def launcher_cls(src, metadata):
        # Triton's own Python launcher (its C launch replaced by ours) where it can be built
        # without the CUDA toolkit's C helpers; otherwise a launcher with its call signature.
        if state["own"] is not False:
            try:
                from triton.backends.nvidia import driver as nvidia_driver

                launcher = nvidia_driver.CudaLauncher(src, metadata)
                state["own"] = True
                return launcher
            except Exception:
                state["own"] = False
        return fallback(src, metadata)

    class StandInCudaDriver(DriverBase):
        def __init__(self) -> None:
            self.utils = utils
            self.launcher_cls = launcher_cls
            self.target = GPUTarget("cuda", arch, 32)

        @staticmethod
        def is_active() -> bool:
            return False

        def get_current_target(self):
            return self.target

        def get_current_device(self) -> int:
            return 0

        def set_current_device(self, device: int) -> None:
            pass

        def get_current_stream(self, device: int = 0) -> int:
            return 0

        def get_active_torch_device(self):
            return torch.device("cpu")

        def get_device_interface(self):
            return torch.cuda

        def get_device_capability(self, device: int = 0):
            return divmod(arch, 10)

        def map_python_to_cpp_type(self, ty: str) -> str:
            from triton.backends.nvidia.driver import ty_to_cpp

            return ty_to_cpp(ty)

        def get_benchmarker(self):
            raise RuntimeError("the stand-in driver cannot time kernels")

        def get_empty_cache_for_benchmark(self):
            raise RuntimeError("the stand-in driver cannot time kernels")

        def clear_cache(self, cache) -> None:
            pass

        def assemble_tensormap_to_arg(self, tensormaps_info, args):
            return args

    return StandInCudaDriver()


@contextlib.contextmanager
def standin_cuda_driver(arch: int = 90, *, record: bool = True,
                        read_addresses: bool = True) -> Iterator[StandInLaunch]:
    """Within the block Triton's active driver is a stand-in NVIDIA ``sm_<arch>`` GPU (see
    the module docstring); yields the ``StandInLaunch`` that receives every launch
    (``record``, ``read_addresses``: its options).

    Must run without ``TRITON_INTERPRET=1`` (the interpreter bypasses drivers). Kernels
    compiled inside the block are cached per device by Triton; they are dropped on exit so
    that a later real or interpreted run never sees them.
    """
    import os

    if os.environ.get("TRITON_INTERPRET") == "1":
        raise RuntimeError("the stand-in driver needs compiled kernels: unset "
                           "TRITON_INTERPRET (e.g. run it in a subprocess).")
    from triton.runtime.driver import driver

    launch = StandInLaunch(record=record, read_addresses=read_addresses)
    standin = _make_driver(arch, launch)
    previous = driver._active
    with _helper_names():
        driver.set_active(standin)
        try:
            yield launch
        finally:
            driver._active = previous
            _drop_device_caches()


def _drop_device_caches() -> None:
    """Forget every kernel compiled for the stand-in (Triton keys its caches by device)."""
    from lab.launches import kernel_modules
    from triton.runtime.jit import JITFunction

    for module in kernel_modules():
        for value in vars(module).values():
            if isinstance(value, JITFunction):
                value.device_caches.clear()
