"""The request table: state rows, id checks, length checks, journaled add / remove."""

import numpy as np
import pytest

from hisparse_triton.errors import (
    DuplicateRequestError,
    ReservationExceededError,
    UncommittedTokensError,
    UnknownRequestError,
)
from hisparse_triton.scheduler.journal import Journal
from hisparse_triton.scheduler.requests import (
    RequestTable,
    check_id_list,
    check_lengths,
    check_request_id,
)


def table(rows=3):
    return RequestTable(rows, Journal())


def test_rows_are_lowest_first_and_reused_after_remove():
    t = table()
    a = t.add("a", 4, 4, [1, 2], [])
    b = t.add("b", 4, 4, [3, 4], [])
    assert (a.row, b.row) == (0, 1) and t.num_free_rows == 1
    t.remove(a)
    c = t.add("c", 4, 4, [5, 6], [])
    assert c.row == 0 and list(t) == ["b", "c"] and t["c"] is c
    assert t.check_invariants(block_size=4) == []


def test_get_and_state_rows_name_bad_ids():
    t = table()
    t.add("a", 4, 4, [1, 2], [])
    t.add(7, 4, 4, [3, 4], [])
    assert t.state_rows(["a", None, 7]).tolist() == [0, -1, 1]
    assert t.state_rows(["a"]).dtype == np.int32
    with pytest.raises(UnknownRequestError, match=r"unknown request 'x' \(resolve\)"):
        t.state_rows(["x"])
    with pytest.raises(DuplicateRequestError, match="appears twice"):
        t.state_rows(["a", "a"])
    with pytest.raises(UnknownRequestError):
        t.get([1], "append_slots")          # unhashable: unknown, not a TypeError
    assert [1] not in t and "a" in t


def test_a_failed_transaction_leaves_the_table_as_it_was():
    journal = Journal()
    t = RequestTable(2, journal)
    t.add("a", 4, 4, [1, 2], [])
    before = t.snapshot()
    with pytest.raises(RuntimeError):
        with journal.transaction():
            t.remove(t["a"])
            t.add("b", 4, 0, [5], [])
            raise RuntimeError("roll back")
    assert t.snapshot() == before


@pytest.mark.parametrize("bad", [None, float("nan"), [1]])
def test_request_ids_must_name_a_request(bad):
    with pytest.raises(ValueError):
        check_request_id(bad)


@pytest.mark.parametrize("bad", ["ab", b"ab", {"a"}, {"a": 1}])
def test_batches_are_sequences(bad):
    with pytest.raises(ValueError, match="list or tuple"):
        check_id_list(bad)


def test_lengths_and_appends_are_checked_with_the_request_named():
    assert check_lengths("r", 4, 0, 8) == (4, 0)
    with pytest.raises(ValueError, match=r"request 'r': prompt_len must be an int >= 1"):
        check_lengths("r", 0, 4, 8)
    with pytest.raises(ValueError, match="= 9 exceeds max_model_len 8"):
        check_lengths("r", 5, 4, 8)
    req = table().add("r", 4, 2, [1, 2], [])
    assert req.check_append(6, None) == 6
    with pytest.raises(ReservationExceededError, match="reservation of 6"):
        req.check_append(7, None)
    with pytest.raises(UncommittedTokensError, match="max_num_batched_tokens=3"):
        req.check_append(4, 3)
    with pytest.raises(ValueError, match="num_tokens"):
        req.check_append(-1, None)


def test_check_invariants_names_broken_rows_and_lengths():
    t = table()
    req = t.add("a", 4, 4, [1, 2], [])
    req.seq_len = 3                          # scheduled and committed stay 0: fine
    assert t.check_invariants(block_size=4) == []
    req.committed_len = 5
    t._free_rows.append(0)
    problems = t.check_invariants(block_size=4)
    assert any("partition" in p for p in problems)
    assert any("lengths out of order" in p for p in problems)
