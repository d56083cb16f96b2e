"""``Journal``: an undo log that makes a sequence of CPU-side mutations all-or-nothing.

The scheduler's public calls (and the runtime facade's calls, which also touch torch) run
inside ``journal.transaction()``. Every mutation of scheduler state goes through a journal
helper (``setattr``, ``setitem``, ``delitem``, ``write``, ...) or records its own inverse with
``record``; when anything inside the transaction raises (a validation error, a full pool,
torch failing in the facade, ``KeyboardInterrupt``), the inverses run newest first and the
state is exactly what it was when the transaction began. Transactions nest: an inner one that
raises rolls back only its own changes (a savepoint). Outside a transaction the helpers just
mutate. No torch here.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Callable, Iterator, MutableMapping, MutableSequence, Optional

import numpy as np

_MISSING = object()


class Journal:
    """An undo log (see the module docstring)."""

    def __init__(self) -> None:
        self._undo: Optional[list[Callable[[], None]]] = None

    @property
    def active(self) -> bool:
        """Whether a transaction is open (mutations are being recorded)."""
        return self._undo is not None

    @contextmanager
    def transaction(self) -> Iterator[None]:
        """All-or-nothing block: on an exception, undo its mutations and re-raise."""
        outermost = self._undo is None
        if outermost:
            self._undo = []
        undo = self._undo
        assert undo is not None
        mark = len(undo)
        try:
            yield
        except BaseException:
            while len(undo) > mark:
                undo.pop()()
            if outermost:
                self._undo = None
            raise
        if outermost:
            self._undo = None

    def record(self, inverse: Callable[[], None]) -> None:
        """Register the inverse of a mutation just made (no-op outside a transaction)."""
        if self._undo is not None:
            self._undo.append(inverse)

    # ------------------------------------------------------------------ helpers
    def setattr(self, obj: Any, name: str, value: Any) -> None:
        """``obj.name = value``, undoable."""
        if self._undo is not None:
            old = getattr(obj, name)
            self._undo.append(lambda: setattr(obj, name, old))
        setattr(obj, name, value)

    def setitem(self, mapping: MutableMapping, key: Any, value: Any) -> None:
        """``mapping[key] = value``, undoable (a new key is removed again)."""
        if self._undo is not None:
            old = mapping.get(key, _MISSING)
            if old is _MISSING:
                self._undo.append(lambda: mapping.pop(key, None))
            else:
                self._undo.append(lambda: mapping.__setitem__(key, old))
        mapping[key] = value

    def delitem(self, mapping: MutableMapping, key: Any) -> Any:
        """``mapping.pop(key)``, undoable; returns the removed value (``KeyError`` if none).

        An ordered dict gets the key back at its old position only when it was the last
        key; use ``restore_order`` for mappings whose order matters.
        """
        value = mapping.pop(key)
        if self._undo is not None:
            self._undo.append(lambda: mapping.__setitem__(key, value))
        return value

    def write(self, array: np.ndarray, index: Any, value: Any) -> None:
        """``array[index] = value`` for a numpy array, undoable."""
        if self._undo is not None:
            old = np.array(array[index], copy=True)
            self._undo.append(lambda: array.__setitem__(index, old))
        array[index] = value

    def append(self, seq: MutableSequence, value: Any) -> None:
        """``seq.append(value)``, undoable."""
        seq.append(value)
        if self._undo is not None:
            self._undo.append(seq.pop)

    def pop(self, seq: MutableSequence) -> Any:
        """``seq.pop()``, undoable."""
        value = seq.pop()
        if self._undo is not None:
            self._undo.append(lambda: seq.append(value))
        return value

    def replace_list(self, seq: list, items: list) -> None:
        """``seq[:] = items``, undoable (copies the old contents)."""
        if self._undo is not None:
            old = list(seq)
            self._undo.append(lambda: seq.__setitem__(slice(None), old))
        seq[:] = items


__all__ = ["Journal"]
