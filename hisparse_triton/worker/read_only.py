"""``ReadOnlyTensor``: views of memory this process must never write (an attached rank's
shared host pool), whose writes raise ``ReadOnlyViewError`` instead of crashing the process.

A tensor rank >= 1 of a shared host pool hands out (``HiSparseWorker.host_cache``,
``HostPool.tensor``) is one of these. Every torch call on it goes through
``__torch_function__``, which refuses, before anything runs:

- in-place methods (``add_``, ``copy_``, ``fill_``, ``index_put_``, ... every name ending in
  ``_``), item assignment (``t[i] = x``) and augmented assignment (``t += x``);
- any call whose ``out=`` is a read-only view;

and hands back every result that shares the view's memory (slices, ``view``, ``reshape``,
``as_strided``, ...) as a ``ReadOnlyTensor`` too, while results in new memory (``clone``,
arithmetic, ``.to(...)``) are ordinary tensors. ``numpy()`` returns a non-writable array.
Reading works as for any tensor. The kernels never see these views: they address the pool
through its raw buffer, so the decode path pays nothing for the check.
"""

from __future__ import annotations

from typing import Any

import torch

from hisparse_triton.errors import ReadOnlyViewError

__all__ = ["ReadOnlyTensor", "read_only"]

#: Augmented assignments (``t += x`` calls these on the tensor).
_AUGMENTED = frozenset(f"__i{op}__" for op in (
    "add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "matmul", "and", "or", "xor",
    "lshift", "rshift"))


def _mutates(name: str) -> bool:
    """Whether the torch call ``name`` writes its first argument."""
    if name == "__setitem__" or name in _AUGMENTED:
        return True
    return name.endswith("_") and not name.startswith("__")


def _storage(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage().data_ptr()


class ReadOnlyTensor(torch.Tensor):
    """A tensor whose writes raise ``ReadOnlyViewError`` (see the module docstring)."""

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (),
                           kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        target = args[0] if args else None
        outs = kwargs.get("out")
        outs = outs if isinstance(outs, (tuple, list)) else (outs,)
        if ((_mutates(name) and isinstance(target, ReadOnlyTensor))
                or any(isinstance(out, ReadOnlyTensor) for out in outs)):
            raise ReadOnlyViewError(
                f"{name}: this tensor is a read-only view of a shared host pool (an attached "
                f"rank's; only the creating rank, tp_rank 0, writes the pool). Clone it to "
                f"get a writable copy.")
        with torch._C.DisableTorchFunctionSubclass():
            result = func(*args, **kwargs)
            if name == "numpy":
                result.flags.writeable = False
                return result
            sources = {_storage(a) for a in args if isinstance(a, ReadOnlyTensor)}
            return _wrap_aliases(result, sources)


def _wrap_aliases(result: Any, sources: set[int]) -> Any:
    """``result`` with every tensor that shares memory with ``sources`` made read-only
    (called with torch functions of subclasses disabled)."""
    if isinstance(result, torch.Tensor) and not isinstance(result, ReadOnlyTensor):
        if result.layout == torch.strided and _storage(result) in sources:
            return result.as_subclass(ReadOnlyTensor)
        return result
    if isinstance(result, (tuple, list)):
        return type(result)(_wrap_aliases(r, sources) for r in result)
    return result


def read_only(tensor: torch.Tensor) -> ReadOnlyTensor:
    """A ``ReadOnlyTensor`` view of ``tensor`` (same memory, no copy)."""
    return tensor.as_subclass(ReadOnlyTensor)
