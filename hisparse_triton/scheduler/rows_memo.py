"""``RowsMemo``: a value derived from a memoised state-row array, computed once (no torch).

The batch paths hand the same read-only ``[n] int64`` state-row arrays step after step
(``RequestTable.batch`` and ``in_order`` keep theirs while no request comes or goes), and
need values derived from them each step (flat table entries ``row * width``, the plan's
``seq_len`` entries). A ``RowsMemo`` keeps the value of the last such array, recognised by
identity: an array that owns its data and is read-only cannot have changed since (the memo
keeps it alive, so its identity cannot pass to another array). For any other array the
value is computed anew.
"""

from __future__ import annotations

from typing import Callable, Generic, Optional, TypeVar

import numpy as np

T = TypeVar("T")


class RowsMemo(Generic[T]):
    """``compute(rows, param)``, the last value kept for a read-only ``rows`` that owns its
    data (see the module docstring); the caller must not change the value."""

    def __init__(self, compute: Callable[[np.ndarray, int], T]) -> None:
        self._compute = compute
        self._key: Optional[tuple[np.ndarray, int]] = None
        self._value: Optional[T] = None

    def __call__(self, rows: np.ndarray, param: int) -> T:
        key = self._key
        if key is not None and key[0] is rows and key[1] == param:
            return self._value   # type: ignore[return-value]
        value = self._compute(rows, param)
        if rows.base is None and not rows.flags.writeable:
            self._key, self._value = (rows, param), value
        return value


__all__ = ["RowsMemo"]
