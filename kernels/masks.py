"""Masks built so that they are booleans on every supported Triton (3.6 to 3.9), compiled or
interpreted.

A scalar condition (``row_ok = (st >= 0) & (st < S)``) joins a block mask through ``_lanes``,
never as ``block & row_ok``: Triton 3.9's interpreter splats a scalar comparison into an
int32 block, so the ``&`` gives an int32 mask that ``tl.load`` / ``tl.store`` refuse
(``mask has unsupported dtype``). Compiled, ``_lanes(flag, like)`` is the plain splat of
``flag`` (the multiply by zero folds away).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _lanes(flag, like):
    """``flag`` (a scalar condition) as a ``bool`` block shaped like ``like`` (an integer
    block, e.g. ``tl.arange``): every lane is ``flag``."""
    return (like * 0 + flag.to(tl.int32)) != 0
