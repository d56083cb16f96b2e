"""``hisparse_triton.compile.insertion``: the simulation behind the hash resolve's model inputs
(how full its buckets get on DeepSeek-V3.2-like rows, and the earlier kernel's rounds)."""

from __future__ import annotations

import numpy as np
import pytest

from hisparse_triton.compile import insertion as ins


def test_bucket_load_counts_keys_per_bucket() -> None:
    keys = np.arange(1, 65, dtype=np.int64)
    assert ins.bucket_load(keys, 0) == 64  # one bucket takes every key
    buckets = ins._hash(keys, 4)
    assert ins.bucket_load(keys, 4) == int(np.bincount(buckets).max())


def test_linear_rounds_one_round_without_collisions_more_with() -> None:
    rng = np.random.default_rng(0)
    keys = np.arange(1, 9, dtype=np.int64)
    # a table as wide as the hash: distinct keys whose hashes differ take one round
    homes = ins._hash(keys, 20)
    assert len(set(homes.tolist())) == 8 and ins.linear_rounds(keys, 20, rng) == 1
    # one entry for all (a 1-entry table cannot hold 2 keys): bounded by max_rounds
    assert ins.linear_rounds(keys[:2], 0, rng, max_rounds=5) == 5
    # 8 keys in an 8-entry table whose hash sends some to one entry: they probe on
    assert ins.linear_rounds(keys, 3, rng) >= 1


@pytest.mark.parametrize("kind", ins.KEY_KINDS)
def test_topk_host_rows_are_distinct_host_rows(kind: str) -> None:
    rows = ins.topk_host_rows(np.random.default_rng(1), kind, 256)
    assert rows.shape == (256,) and len(np.unique(rows)) == 256 and rows.min() >= 1


def test_bad_kind_raises() -> None:
    with pytest.raises(ValueError, match="kind"):
        ins.topk_host_rows(np.random.default_rng(1), "nope")


def test_simulate_reports_the_slowest_row_and_overflows() -> None:
    out = ins.simulate(batches=2, batch=4, top_k=256, kinds=("random",))
    kind = out["kinds"]["random"]
    per_row = kind["linear_rounds_per_row"]
    slowest = kind["linear_rounds_slowest_row"]
    assert slowest["median"] >= per_row["median"] and slowest["max"] == per_row["max"]
    assert sum(kind["bucket_fullest_per_row"]["histogram"].values()) == 8
    assert out["buckets"] == 512 and out["linear_table_entries"] == 4096
    bytes_ = kind["table_bytes_per_row"]
    assert bytes_["bucket"]["allocated"] == (2 * 8 + 1) * 512 * 4
    assert 0 < bytes_["bucket"]["touched"] <= bytes_["bucket"]["allocated"]
    assert 0 <= out["bucket_overflow_batch_probability_poisson"] < 1
