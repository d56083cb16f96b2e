"""``hisparse-triton tune``: refusal without a GPU, the candidate listing (``--dry-run``), bad
flags, an interrupted search and, on a GPU, a real tuning run (the search itself:
``test_tuner.py``)."""

from __future__ import annotations

import json
from dataclasses import fields

import pytest
import torch

from hisparse_triton import tuning, tuning_cache
from hisparse_triton.cli import main
from hisparse_triton.benchmarks import registry
from hisparse_triton.benchmarks import tuner as search
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
    for kernel in registry.TUNABLE_OPS:
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
    assert [s["kernel"] for s in data["spaces"]] == list(registry.TUNABLE_OPS)
    names = {f.name for f in fields(tuning.CopyConfig)}
    for space in data["spaces"]:
        span = space["span_bytes"]
        if space["kernel"] == "gather":
            assert {c["access_bytes"] for c in space["stage1"]} == {4}
        assert span == (132 * 64 if space["kernel"] in registry.PAGE_OPS else 132)
        configs = [tuning.CopyConfig(**c) for c in space["stage1"]]  # all valid
        assert len(set(configs)) == len(configs)
        assert tuning.CopyConfig(**space["default"]) in configs
        for c in configs:
            assert c.chunk_bytes <= max(16, tuning.next_pow2(span))
            assert c.access_bytes <= tuning.pow2_alignment(span)  # 4 for 132 B rows
            assert c.layers_per_program <= 2
        assert set(space["stage2"]) <= names
        assert all(s in names for s in space["fixed"])


def test_bad_tune_flags(capsys):
    assert main(["tune", "--kernel", "nope", "--dry-run"]) == 2
    assert "nope" in capsys.readouterr().err
    assert main(["tune", "--rows", "16", "--kernel", "restore", "--dry-run"]) == 1
    assert "one page" in capsys.readouterr().err
    assert main(["tune", "--dry-run", "--json", "/nonexistent-dir/t.json"]) == 2
    err = capsys.readouterr().err
    assert "argument --json: directory" in err and len(err.strip().splitlines()) == 1


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

    class Constant:  # every candidate equally fast
        units, bytes = 4096, 4096 * 656

        class plans:  # noqa: N801 - mimics RowPlans.shape
            shape = (2, 2048)

        def trial(self, config, stage):
            return search.Trial(config, stage, time_us=10.0, gbps=1.0)

    def tune_one(space, args, progress, tuner=None):
        if space.num_layers == 4:
            raise KeyboardInterrupt
        return real_tune_one(space, args, False, tuner=Constant())

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
