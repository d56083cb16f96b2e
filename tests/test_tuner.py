"""The launch-config search of ``tune`` (``hisparse_triton.benchmarks.tuner``): the candidate
space, the candidate check (under the Triton interpreter on CPU), the two-stage search with a
fake timer whose best is known, and the cache entries of the winners."""

from __future__ import annotations

from dataclasses import asdict, fields

import pytest
import torch

from hisparse_triton import tuning, tuning_cache
from hisparse_triton.benchmarks import tuner as search

HAS_CUDA = torch.cuda.is_available()


@pytest.fixture(autouse=True)
def _builtin_configs_only(monkeypatch, request):
    """No tuned config is read (the search starts from the built-in defaults)."""
    monkeypatch.setenv(tuning_cache.ENV_VAR, "off")
    tuning_cache.invalidate()
    request.addfinalizer(tuning_cache.invalidate)


def test_default_is_the_builtin_config():
    space = search.candidate_space("backup", 656, 61)
    builtin = tuning.builtin_config("backup", 656, 61)
    assert space.default == search.normalise(builtin, 656, 61)
    assert space.stage1[0] == space.default or space.default in space.stage1
    quick = search.candidate_space("backup", 656, 61, quick=True)
    assert len(quick.stage1) < len(space.stage1)
    variations = search.stage2_candidates(space, space.default)
    assert space.default not in variations
    for cand in variations:  # one field changed at a time
        changed = [f.name for f in fields(cand)
                   if getattr(cand, f.name) != getattr(space.default, f.name)]
        assert len(changed) == 1 and changed[0] in search.STAGE2


@pytest.mark.skipif(HAS_CUDA, reason="interpreter check; the GPU test below covers CUDA")
@pytest.mark.parametrize("kernel", ["gather", "spill"])
def test_candidate_check_accepts_kernel_and_rejects_wrong_results(kernel, monkeypatch):
    import os

    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs TRITON_INTERPRET=1 (set by conftest without CUDA)")
    tuner = search.Tuner(kernel, 16, 2, rows=64, top_k=8, warmup_ms=1, rep_ms=1,
                       device=torch.device("cpu"), pool_rows=256)
    config = tuning.CopyConfig(rows_per_program=4, chunk_bytes=16, num_warps=1,
                               grid_programs=8)
    assert tuner.check(config) is None
    # The check plan really moves bytes (so a no-op launcher cannot pass).
    assert not torch.equal(tuner.expected, tuner.dst_before)
    real = tuner.launch
    tuner.launch = lambda *a, **k: None
    assert tuner.check(config) == "result differs from the reference"

    def broken(dst, src, s, d, counts, config):  # drops the last plan column
        real(dst, src, s[:, :-1], d[:, :-1], counts, config=config)

    tuner.launch = broken
    assert tuner.check(config) == "result differs from the reference"

    def raises(*a, **k):
        raise RuntimeError("out of resources")

    tuner.launch = raises
    assert "out of resources" in tuner.check(config)


class _FakeTuner:
    """Times from a formula: larger tiles and 8 warps are faster, grid 1024 is best, and
    num_stages=2 is 'miscompiled' (rejected), so the search has a known answer."""

    units, bytes = 4096, 4096 * 656

    class plans:  # noqa: N801 - mimics RowPlans.shape
        shape = (2, 2048)

    def __init__(self):
        self.seen = []

    def trial(self, config, stage):
        self.seen.append(config)
        if config.num_stages == 2:
            return search.Trial(config, stage, rejected="result differs from the reference")
        t = 100.0 / config.rows_per_program + 50.0 / config.num_warps + 1000.0 / config.chunk_bytes
        t += 0 if config.grid_programs == 1024 else 5
        t += 0 if config.access_bytes == 16 else 7
        return search.Trial(config, stage, time_us=t, gbps=self.bytes / t / 1e3)


def test_search_finds_the_known_best_and_saves_it(tmp_path):
    space = search.candidate_space("gather", 656, 1, sm_count=None)
    fake = _FakeTuner()
    record = search.tune_space(space, fake, row_bytes=656)
    best = tuning.CopyConfig(**record["best"]["config"])
    top_rows = max(space.values["rows_per_program"])
    assert best.rows_per_program == top_rows and best.num_warps == 8
    assert best.chunk_bytes == 1024 and best.grid_programs == 1024
    assert best.access_bytes == 16 and best.num_stages == 1
    assert record["default"]["config"] == asdict(space.default)
    assert record["speedup_vs_default"] > 1
    assert record["rejected"] == 1  # the num_stages=2 variation
    assert record["candidates"] == len(fake.seen) == len(set(fake.seen))
    assert all("rejected" in t or t["time_us"] > 0 for t in record["trials"])

    path = tmp_path / "c.json"
    search.save_records([record], path, "NVIDIA Test", {"torch": "x", "triton": "y"})
    entry = tuning_cache.TuningCache.load(path).get("gather", 656, 1)
    assert tuning.CopyConfig(**entry.config) == best
    assert entry.metrics["speedup_vs_default"] == record["speedup_vs_default"]
    assert entry.metrics["row_size"] == 656


def test_default_kept_when_nothing_is_clearly_faster():
    class Flat(_FakeTuner):
        def trial(self, config, stage):
            # every candidate within 0.5% of the default
            t = 10.0 if config == space.default else 9.96
            return search.Trial(config, stage, time_us=t, gbps=1.0)

    space = search.candidate_space("backup", 656, 4)
    record = search.tune_space(space, Flat(), row_bytes=656)
    assert record["best"]["config"] == asdict(space.default)
    assert record["speedup_vs_default"] == 1.0
