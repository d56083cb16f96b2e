"""Fault injection at every point of a call: ``sys.settrace`` raises ``InjectedFault`` at
the k-th line the call runs inside the package's own files, for k = 1, 2, ... until a run
completes (so every line the call actually runs is a fault point once).

A line-level fault stands in for torch (or anything else) raising at that point: each line
runs whole or not at all, so it is where an exception inside it would surface.
"""

from __future__ import annotations

import sys
from typing import Any, Callable

#: Frames whose file path contains one of these are fault points (the package, not its
#: kernels: ``@triton.jit`` bodies run as Python under the interpreter).
PACKAGE = ("/hisparse_triton/",)


class InjectedFault(RuntimeError):
    """The exception a fault point raises."""


def call_with_fault(call: Callable[[], Any], k: int,
                    where: tuple[str, ...] = PACKAGE) -> str:
    """Run ``call`` raising ``InjectedFault`` at its k-th line inside a file whose path
    contains one of ``where``; returns
    where the fault fired (``file:line``), or ``""`` when the call ran fewer lines."""
    seen = 0

    def local(frame, event, arg):
        nonlocal seen
        if event == "line":
            seen += 1
            if seen == k:
                raise InjectedFault(f"fault point {k} ({frame.f_code.co_filename}:"
                                    f"{frame.f_lineno})")
        return local

    def tracer(frame, event, arg):
        name = frame.f_code.co_filename
        return local if any(part in name for part in where) else None

    previous = sys.gettrace()
    sys.settrace(tracer)
    try:
        call()
    except InjectedFault as fault:
        return str(fault)
    finally:
        sys.settrace(previous)
    return ""


def sweep(call: Callable[[], Any], snapshot: Callable[[], Any], *,
          where: tuple[str, ...] = PACKAGE, limit: int = 100_000) -> int:
    """Fault ``call`` at every line point in turn; after each fault the state
    (``snapshot()``) must equal the state before. The last run completes. Returns the number
    of fault points."""
    before = snapshot()
    for k in range(1, limit):
        fired = call_with_fault(call, k, where)
        if not fired:
            return k - 1
        assert snapshot() == before, f"{fired} changed the state"
    raise AssertionError(f"more than {limit} fault points")
