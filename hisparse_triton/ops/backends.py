"""Backend choice and the eager check shared by every op family.

``choose_backend`` maps a ``backend`` argument (or ``$HISPARSE_TRITON_BACKEND``) and the
device of an op's index tensors to ``"triton"`` or ``"torch"``; ``is_eager`` says whether a
call may skip the ``torch.library`` dispatch and run the chosen implementation directly.
The rules are in the ``hisparse_triton.ops`` docstring.
"""

from __future__ import annotations

import os
from typing import Optional

import torch
from torch import Tensor

__all__ = ["BACKENDS", "ENV_VAR", "BackendUnavailableError", "all_on_cpu", "choose_backend",
           "is_eager", "select_backend"]

#: Accepted ``backend`` values.
BACKENDS = ("auto", "triton", "torch")
#: Environment variable read when ``backend`` is None.
ENV_VAR = "HISPARSE_TRITON_BACKEND"


class BackendUnavailableError(RuntimeError):
    """The Triton backend was asked for where it cannot run (CPU tensors, no interpreter)."""


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def select_backend(backend: Optional[str], device: torch.device) -> str:
    """``"triton"`` or ``"torch"``: what ``backend`` (or ``$HISPARSE_TRITON_BACKEND``) means
    for tensors on ``device``; raises ``ValueError`` for an unknown name and
    ``BackendUnavailableError`` for ``"triton"`` on CPU without ``TRITON_INTERPRET=1``."""
    return choose_backend(backend, device.type == "cuda", device)


def choose_backend(backend: Optional[str], on_cuda: bool, device) -> str:
    """``select_backend`` given whether the op's tensors are on CUDA (``device`` only names
    them in the error)."""
    name = backend if backend is not None else os.environ.get(ENV_VAR) or "auto"
    if name == "torch":
        return "torch"
    if name not in BACKENDS:
        source = "backend" if backend is not None else f"${ENV_VAR}"
        raise ValueError(f"{source}={name!r} is not a backend; expected one of "
                         f"{', '.join(BACKENDS)}.")
    if on_cuda:
        return "triton"
    if name == "auto":
        return "torch"
    if _interpreting():
        return "triton"
    raise BackendUnavailableError(
        f"backend 'triton' needs CUDA tensors (got tensors on {device}) or TRITON_INTERPRET=1 "
        f"(the Triton interpreter); use backend='torch' or 'auto' on this machine.")


def is_eager(tensors: tuple[Optional[Tensor], ...]) -> bool:
    """Whether a call on ``tensors`` may bypass the ``torch.library`` dispatch: not being
    traced by ``torch.compile`` / export, only plain tensors (no fake / functional
    subclasses) and no ``TorchDispatchMode`` active. Callers that launch kernels directly
    check this too."""
    if torch.compiler.is_compiling():
        return False
    for t in tensors:
        if t is not None and type(t) is not Tensor:
            return False
    return plain_dispatch()


def plain_dispatch() -> bool:
    """``is_eager`` without its tensor checks (for callers that checked their tensors are
    plain ``torch.Tensor`` already): not traced, no ``TorchDispatchMode`` active."""
    return not torch.compiler.is_compiling() and _current_dispatch_mode() is None


try:
    from torch.utils._python_dispatch import _get_current_dispatch_mode
except ImportError:  # pragma: no cover - very old torch
    def _get_current_dispatch_mode():
        return None


def _current_dispatch_mode():
    """The active ``TorchDispatchMode`` or None (a test replaces it to keep the eager path
    under a recording mode)."""
    return _get_current_dispatch_mode()


def all_on_cpu(tensors: tuple[Optional[Tensor], ...]) -> bool:
    """Whether every tensor of ``tensors`` (None entries ignored) is on the CPU."""
    return all(t is None or t.device.type == "cpu" for t in tensors)
