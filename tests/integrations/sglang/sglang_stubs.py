"""Import stand-ins for the compiled or heavy packages SGLang 0.5.23's modules import at load
time but whose code the CPU tests never run: ``sgl_kernel`` (SGLang's CUDA kernel wheel),
``torchvision``, ``sentencepiece``, ``compressed_tensors`` and ``gguf``. Test-only: installed by
this folder's conftest, and only in an environment where SGLang itself is importable and the
package is not (so a real install always wins).

A stubbed module (and any submodule) yields, for any attribute, a class whose instances and
calls yield more of the same. Code that actually used one would get such a placeholder and
fail its own checks, never a plausible value.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types

STUBBED = ("sgl_kernel", "torchvision", "sentencepiece", "compressed_tensors", "gguf")


class _Meta(type):
    def __getattr__(cls, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Meta(name, (_Placeholder,), {})


class _Placeholder(metaclass=_Meta):
    def __init__(self, *args, **kwargs) -> None:
        pass

    def __call__(self, *args, **kwargs) -> "_Placeholder":
        return _Placeholder()

    def __getattr__(self, name: str) -> "_Placeholder":
        if name.startswith("__"):
            raise AttributeError(name)
        return _Placeholder()


class _StubModule(types.ModuleType):
    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        value = _Meta(name, (_Placeholder,), {"__module__": self.__name__})
        setattr(self, name, value)
        return value


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, names: tuple[str, ...]) -> None:
        self.names = names

    def find_spec(self, fullname, path=None, target=None):
        if fullname.split(".")[0] in self.names:
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _StubModule(spec.name)
        module.__path__ = []
        module.__version__ = "0.0.0+stub"
        return module

    def exec_module(self, module) -> None:
        return None


_INSTALLED: list[_Finder] = []


def install() -> tuple[str, ...]:
    """Stub every package of ``STUBBED`` that is not installed; returns the stubbed names."""
    if _INSTALLED:
        return _INSTALLED[0].names
    missing = tuple(name for name in STUBBED if importlib.util.find_spec(name) is None)
    finder = _Finder(missing)
    sys.meta_path.insert(0, finder)
    _INSTALLED.append(finder)
    return missing
