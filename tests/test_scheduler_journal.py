"""The journal: all-or-nothing transactions that nest as savepoints; direct changes outside."""

import numpy as np
import pytest

from hisparse_triton.scheduler.journal import Journal


class Box:
    value = 0


def test_a_failed_transaction_undoes_every_helper_newest_first():
    j, box, d, seq, arr = Journal(), Box(), {"k": 1}, [1, 2], np.zeros(3, dtype=np.int32)
    with pytest.raises(KeyError):
        with j.transaction():
            j.setattr(box, "value", 5)
            j.setitem(d, "k", 2)
            j.setitem(d, "new", 3)
            j.delitem(d, "k")
            j.append(seq, 3)
            j.pop(seq)
            j.replace_list(seq, [9])
            j.write(arr, slice(0, 2), 7)
            j.delitem(d, "missing")
    assert (box.value, d, seq, arr.tolist()) == (0, {"k": 1}, [1, 2], [0, 0, 0])
    assert not j.active


def test_an_inner_transaction_is_a_savepoint():
    j, d = Journal(), {}
    with j.transaction():
        j.setitem(d, "outer", 1)
        with pytest.raises(RuntimeError):
            with j.transaction():
                j.setitem(d, "inner", 2)
                raise RuntimeError
        assert d == {"outer": 1} and j.active
    assert d == {"outer": 1} and not j.active


def test_outside_a_transaction_the_helpers_just_change():
    j, d = Journal(), {}
    j.setitem(d, "k", 1)
    j.record(lambda: d.clear())              # nothing recorded: no transaction
    with j.transaction():
        pass
    assert d == {"k": 1}
