"""Launch configs that know the target: warp size, workgroup limit, memory-model mode.

The launchers (``resolve``, the copy kernels) call ``check_launch`` once per launch shape (it
is memoised with the shape, never per call):

- the warp size comes from the Triton target of the launch's device (32 on NVIDIA, 64 on
  CDNA AMD GPUs); it is never assumed to be 32;
- ``num_warps * warp_size`` above ``MAX_WORKGROUP_LANES`` (1,024: CUDA's most threads per
  block and HIP's most lanes per workgroup) is refused with a ``ValueError`` naming both
  numbers (e.g. ``num_warps=32`` on a wave64 target is 2,048 lanes, which HIP cannot launch);
- a threadgroup-split AMD target (``tgsplit``: a workgroup's waves may run on different CUs)
  is refused (``check_memory_model``): resolve's phase hand-offs through global scratch rely
  on the waves of a workgroup sharing one CU's vector L1 (docs/kernels.md, "Memory model").

``resolve_num_warps`` is resolve's default per warp size (docs/kernels.md, "AMD GPUs").
Under ``TRITON_INTERPRET=1`` or without a GPU there is no target and nothing is checked (the
interpreter has no warps), unless a test or the compile report passes the target.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any, Iterator, Mapping, NamedTuple, Optional

__all__ = ["MAX_WORKGROUP_LANES", "KernelLaunch", "ThreadgroupSplitError", "check_launch",
           "check_memory_model", "check_workgroup", "current_target", "resolve_launch_warps",
           "resolve_num_warps", "target_override"]


class KernelLaunch(NamedTuple):
    """One kernel launch as a launcher would make it: ``kernel[grid](*args, **kwargs)``
    (``kwargs``: the constexprs and launch options). What ``resolve_launch`` and
    ``copy_launch`` return without launching (the compile report compiles these)."""

    kernel: Any
    grid: tuple
    args: tuple
    kwargs: dict

    def __call__(self) -> None:
        """Launch it (on the current stream)."""
        self.kernel[self.grid](*self.args, **self.kwargs)

#: Most threads (lanes) one CTA / workgroup may have, on CUDA and on HIP.
MAX_WORKGROUP_LANES = 1024


class ThreadgroupSplitError(ValueError):
    """The AMD target runs in threadgroup-split mode, which the kernels do not support."""


def check_workgroup(num_warps: int, warp_size: int, kernel: str = "kernel",
                    target: str = "") -> None:
    """Refuse ``num_warps * warp_size > MAX_WORKGROUP_LANES`` (``ValueError`` naming both)."""
    lanes = num_warps * warp_size
    if lanes > MAX_WORKGROUP_LANES:
        where = f" on {target}" if target else ""
        raise ValueError(
            f"{kernel}: num_warps={num_warps} x warp size {warp_size} = {lanes} lanes per "
            f"workgroup{where}, more than the {MAX_WORKGROUP_LANES} a GPU can launch; use "
            f"num_warps <= {MAX_WORKGROUP_LANES // warp_size}.")


def check_memory_model(arch: str, env: Optional[Mapping[str, str]] = None) -> None:
    """Refuse a threadgroup-split AMD target: ``arch`` (a target ID such as
    ``gfx942:sramecc+:xnack-``, or an LLVM feature list) or ``TRITON_OVERRIDE_ARCH`` in
    ``env`` enabling ``tgsplit`` raises ``ThreadgroupSplitError``."""
    env = os.environ if env is None else env
    for where, text in (("the target", arch), ("TRITON_OVERRIDE_ARCH",
                                               env.get("TRITON_OVERRIDE_ARCH", ""))):
        features = [f.strip() for f in str(text or "").replace(",", ":").split(":")[1:]]
        if any(f in ("tgsplit+", "+tgsplit", "tgsplit") for f in features):
            raise ThreadgroupSplitError(
                f"{where} {text!r} enables threadgroup-split mode (tgsplit): the waves of one "
                f"workgroup may then run on different CUs, and resolve's hand-offs through "
                f"global scratch (a bare s_barrier, no cache invalidation) are not ordered "
                f"there. Use the target without tgsplit (docs/kernels.md, 'Memory model').")


_TARGETS: dict[Any, Any] = {}
_OVERRIDE: list[Any] = []


@contextlib.contextmanager
def target_override(target: Any) -> Iterator[None]:
    """Within the block every launcher plans for ``target`` (a ``GPUTarget``), whatever the
    tensors' device: the compile report records an AMD target's launches on CPU this way, and
    tests check the refusals. Resolve's memoised launch shapes are dropped on entry and exit."""
    from hisparse_triton.kernels import resolve

    _OVERRIDE.append(target)
    resolve._LAUNCHES.clear()
    try:
        yield
    finally:
        _OVERRIDE.pop()
        resolve._LAUNCHES.clear()


def current_target(device: Any = None) -> Any:
    """The Triton ``GPUTarget`` (backend, arch, warp size) of ``device`` (a ``torch.device``;
    default: the current GPU), cached; None under ``TRITON_INTERPRET=1``, for a CPU device or
    when no GPU driver is active. Inside ``target_override`` that target."""
    if _OVERRIDE:
        return _OVERRIDE[-1]
    if os.environ.get("TRITON_INTERPRET") == "1":
        return None
    if device is not None and getattr(device, "type", "cuda") != "cuda":
        return None
    key = getattr(device, "index", None)
    if key in _TARGETS:
        return _TARGETS[key]
    try:
        from triton.runtime.driver import driver

        target = driver.active.get_current_target()
    except Exception:  # noqa: BLE001 - no GPU driver: nothing to check against
        return None
    _TARGETS[key] = target
    return target


def _device_arch_name(device: Any) -> str:
    """The device's full target ID on ROCm (``gcnArchName``: ``gfx942:sramecc+:xnack-``)."""
    try:
        import torch

        if getattr(torch.version, "hip", None):
            index = getattr(device, "index", None)
            return torch.cuda.get_device_properties(
                index if index is not None else torch.cuda.current_device()).gcnArchName
    except Exception:  # noqa: BLE001 - the arch name only adds features to check
        pass
    return ""


def check_launch(kernel: str, num_warps: int, device: Any = None,
                 target: Any = None) -> Any:
    """Check a launch of ``kernel`` with ``num_warps`` against ``target`` (default: the
    device's, ``current_target``): the workgroup limit, and on AMD the memory-model mode.
    Returns the target (None when there is none to check against)."""
    target = target if target is not None else current_target(device)
    if target is None:
        return None
    name = f"{target.backend}:{target.arch}"
    if target.backend == "hip":
        check_memory_model(("" if _OVERRIDE else _device_arch_name(device)) or str(target.arch))
    check_workgroup(num_warps, int(target.warp_size), kernel, name)
    return target


def resolve_num_warps(tile: int, warp_size: Optional[int]) -> int:
    """Resolve's default ``num_warps`` for a tile of ``tile`` keys / LRU positions: 16 warps
    for tiles of 2,048 and more, 8 for 1,024, else 4, capped at ``MAX_WORKGROUP_LANES //
    warp_size`` (``None``: the interpreter, no cap). On wave64 that is 16 waves = 1,024 lanes
    for the production tiles, chosen with the gfx942 compile report at top-k 2,048: 87 VGPRs,
    51 SGPR spills (into VGPR lanes), 5,554 instructions at 16 waves; 136 / 93 / 8,930 at 8;
    229 / 167 / 15,942 at 4; one workgroup per CU at 16 and 8 waves (docs/kernels.md, "AMD
    GPUs"). Fewer lanes per row only make each lane walk more of the tile."""
    warps = 16 if tile >= 2048 else 8 if tile >= 1024 else 4
    if warp_size:
        warps = min(warps, max(1, MAX_WORKGROUP_LANES // warp_size))
    return warps


def resolve_launch_warps(tile: int, num_warps: Optional[int] = None, device: Any = None) -> int:
    """Resolve's ``num_warps`` on the current target: ``num_warps``, or by default
    ``resolve_num_warps(tile, warp size)``; checked with ``check_launch``."""
    target = current_target(device)
    warps = num_warps or resolve_num_warps(tile, int(target.warp_size) if target else None)
    check_launch("resolve", warps, device, target)
    return warps
