"""``hisparse-triton tune``: refusal without a GPU, the candidate space (``--dry-run``), the
candidate check (under the Triton interpreter on CPU) and, on a GPU, a real tuning run."""

from __future__ import annotations

import json
from dataclasses import fields

import pytest
import torch

from hisparse_triton import tuning, tuning_cache
from hisparse_triton.cli import main
from hisparse_triton.commands import tune

HAS_CUDA = torch.cuda.is_available()


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path, monkeypatch):
    monkeypatch.setenv(tuning_cache.ENV_VAR, str(tmp_path / "cache") + "/")
    tuning_cache.invalidate()
    yield
    tuning_cache.invalidate()


def test_refuses_cleanly_without_cuda(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    rc = main(["tune", "--kernel", "gather", "--layers", "1"])
    captured = capsys.readouterr()
    assert rc != 0
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1, captured.err
    assert "CUDA" in lines[0] and "--dry-run" in lines[0]
    assert captured.out == ""
    assert not (tmp_path / "cache").exists()  # nothing written


def test_dry_run_lists_candidates(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    rc = main(["tune", "--dry-run", "--row-bytes", "656", "--layers", "1,4"])
    out = capsys.readouterr().out
    assert rc == 0
    for kernel in tune.KERNELS:
        assert f"\n{kernel}, " in out
    assert "gather, 656 B spans, 1 layer:" in out
    assert "restore, 41984 B spans, 4 layers:" in out  # pages are 64 rows
    assert "default: rows_per_program=" in out and "stage 2: grid_programs in" in out
    numbered = [line for line in out.splitlines() if line.strip()[:1].isdigit()]
    assert len(numbered) >= 8 * 10


def test_dry_run_json_candidates_are_valid_unique_and_normalised(capsys):
    rc = main(["tune", "--dry-run", "--row-bytes", "132", "--layers", "2", "--json", "-"])
    captured = capsys.readouterr()
    assert rc == 0
    data = json.loads(captured.out)
    assert data["dry_run"] is True and data["row_bytes"] == 132
    assert [s["kernel"] for s in data["spaces"]] == list(tune.KERNELS)
    names = {f.name for f in fields(tuning.CopyConfig)}
    for space in data["spaces"]:
        span = space["span_bytes"]
        if space["kernel"] == "gather":
            assert {c["access_bytes"] for c in space["stage1"]} == {4}
        assert span == (132 * 64 if space["kernel"] in tune.PAGE_KERNELS else 132)
        configs = [tuning.CopyConfig(**c) for c in space["stage1"]]  # all valid
        assert len(set(configs)) == len(configs)
        assert tuning.CopyConfig(**space["default"]) in configs
        for c in configs:
            assert c.chunk_bytes <= max(16, tuning.next_pow2(span))
            assert c.access_bytes <= tuning.pow2_alignment(span)  # 4 for 132 B rows
            assert c.layers_per_program <= 2
        assert set(space["stage2"]) <= names
        assert all(s in names for s in space["fixed"])


def test_default_is_the_builtin_config():
    space = tune.candidate_space("backup", 656, 61)
    builtin = tuning.builtin_config("backup", 656, 61)
    assert space.default == tune.normalise(builtin, 656, 61)
    assert space.stage1[0] == space.default or space.default in space.stage1
    quick = tune.candidate_space("backup", 656, 61, quick=True)
    assert len(quick.stage1) < len(space.stage1)
    variations = tune.stage2_candidates(space, space.default)
    assert space.default not in variations
    for cand in variations:  # one field changed at a time
        changed = [f.name for f in fields(cand)
                   if getattr(cand, f.name) != getattr(space.default, f.name)]
        assert len(changed) == 1 and changed[0] in tune.STAGE2


def test_bad_tune_flags(capsys):
    assert main(["tune", "--kernel", "nope", "--dry-run"]) == 2
    assert "nope" in capsys.readouterr().err
    assert main(["tune", "--rows", "16", "--kernel", "restore", "--dry-run"]) == 1
    assert "one page" in capsys.readouterr().err
    assert main(["tune", "--dry-run", "--json", "/nonexistent-dir/t.json"]) == 2
    err = capsys.readouterr().err
    assert "argument --json: directory" in err and len(err.strip().splitlines()) == 1


@pytest.mark.skipif(HAS_CUDA, reason="interpreter check; the GPU test below covers CUDA")
@pytest.mark.parametrize("kernel", ["gather", "spill"])
def test_candidate_check_accepts_kernel_and_rejects_wrong_results(kernel, monkeypatch):
    import os

    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs TRITON_INTERPRET=1 (set by conftest without CUDA)")
    tuner = tune.Tuner(kernel, 16, 2, rows=64, top_k=8, warmup_ms=1, rep_ms=1,
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


@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_tune_saves_best_config_to_the_cache(tmp_path, capsys):
    path = tmp_path / "t.json"
    rc = main(["tune", "--kernel", "gather", "--layers", "1", "--rows", "4096", "--quick",
               "--rep-ms", "5", "--warmup-ms", "2", "--cache", str(path), "--no-progress",
               "--json", str(tmp_path / "r.json")])
    assert rc == 0, capsys.readouterr().err
    cache = tuning_cache.TuningCache.load(path)
    entry = cache.get("gather", 656, 1)
    assert entry is not None and entry.metrics["gbps"] > 0
    assert tuning.CopyConfig(**entry.config)
    report = json.loads((tmp_path / "r.json").read_text())
    (result,) = report["results"]
    assert result["best"]["config"] == entry.config
    assert result["default"] is not None and result["rejected"] < result["candidates"]


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
            return tune.Trial(config, stage, rejected="result differs from the reference")
        t = 100.0 / config.rows_per_program + 50.0 / config.num_warps + 1000.0 / config.chunk_bytes
        t += 0 if config.grid_programs == 1024 else 5
        t += 0 if config.access_bytes == 16 else 7
        return tune.Trial(config, stage, time_us=t, gbps=self.bytes / t / 1e3)


def test_search_finds_the_known_best_and_saves_it(tmp_path):
    import argparse

    space = tune.candidate_space("gather", 656, 1, sm_count=None)
    args = argparse.Namespace(row_bytes=656)
    fake = _FakeTuner()
    record = tune.tune_one(space, args, False, tuner=fake)
    best = tuning.CopyConfig(**record["best"]["config"])
    top_rows = max(space.values["rows_per_program"])
    assert best.rows_per_program == top_rows and best.num_warps == 8
    assert best.chunk_bytes == 1024 and best.grid_programs == 1024
    assert best.access_bytes == 16 and best.num_stages == 1
    assert record["default"]["config"] == tune.asdict(space.default)
    assert record["speedup_vs_default"] > 1
    assert record["rejected"] == 1  # the num_stages=2 variation
    assert record["candidates"] == len(fake.seen) == len(set(fake.seen))
    assert all("rejected" in t or t["time_us"] > 0 for t in record["trials"])

    path = tmp_path / "c.json"
    tune.save_records([record], path, "NVIDIA Test", {"torch": "x", "triton": "y"})
    entry = tuning_cache.TuningCache.load(path).get("gather", 656, 1)
    assert tuning.CopyConfig(**entry.config) == best
    assert entry.metrics["speedup_vs_default"] == record["speedup_vs_default"]
    assert entry.metrics["row_size"] == 656


def test_default_kept_when_nothing_is_clearly_faster():
    import argparse

    class Flat(_FakeTuner):
        def trial(self, config, stage):
            # every candidate within 0.5% of the default
            t = 10.0 if config == space.default else 9.96
            return tune.Trial(config, stage, time_us=t, gbps=1.0)

    space = tune.candidate_space("backup", 656, 4)
    record = tune.tune_one(space, argparse.Namespace(row_bytes=656), False, tuner=Flat())
    assert record["best"]["config"] == tune.asdict(space.default)
    assert record["speedup_vs_default"] == 1.0


def test_interrupted_tune_keeps_the_finished_searches(monkeypatch, tmp_path, capsys):
    """Ctrl-C (or gpu_check's SIGINT at a step's limit) after the first (kernel, layers)
    search: that search is in the cache and the JSON, the exit code is 130."""
    from types import SimpleNamespace

    from hisparse_triton import benchmarks

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda i: SimpleNamespace(multi_processor_count=132))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=None: "NVIDIA Test")
    monkeypatch.setattr(benchmarks, "environment", lambda: {"torch": "t", "triton": "x"})
    real_tune_one = tune.tune_one

    def tune_one(space, args, progress, tuner=None):
        if space.num_layers == 4:
            raise KeyboardInterrupt
        return real_tune_one(space, args, False, tuner=_FakeTuner())

    monkeypatch.setattr(tune, "tune_one", tune_one)
    path = tmp_path / "c.json"
    rc = main(["tune", "--kernel", "gather", "--layers", "1,4", "--cache", str(path),
               "--no-progress", "--json", str(tmp_path / "r.json")])
    captured = capsys.readouterr()
    assert rc == 130 and "interrupted after 1 of 2" in captured.err
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["interrupted"] is True and len(report["results"]) == 1
    cache = tuning_cache.TuningCache.load(path)
    assert cache.get("gather", 656, 1) is not None and cache.get("gather", 656, 4) is None


def test_preset_tunes_the_model_shapes(capsys):
    rc = main(["tune", "--dry-run", "--preset", "deepseek-v3.2-fp8", "--kernel", "gather,backup",
               "--quick", "--json", "-"])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    data = json.loads(captured.out)
    assert data["schema"] == "hisparse-triton/tune" and data["schema_version"] == tune.SCHEMA_VERSION
    assert data["preset"] == "deepseek-v3.2-fp8" and data["row_bytes"] == 656
    assert {(s["kernel"], s["num_layers"]) for s in data["spaces"]} == {
        ("gather", 1), ("gather", 61), ("backup", 1), ("backup", 61)}
    assert "backup, 656 B spans, 61 layers" in captured.err  # the listing went to stderr
