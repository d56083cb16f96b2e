"""The per-device tuning cache: location, round trip, and bad files that must not be fatal."""

from __future__ import annotations

import json
import warnings
from dataclasses import dataclass

import pytest

from hisparse_triton import tuning_cache as tc


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path, monkeypatch):
    monkeypatch.delenv(tc.ENV_VAR, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    tc.invalidate()
    yield
    tc.invalidate()


def _entry(kernel="gather", row_bytes=656, num_layers=4, **config):
    return tc.TuningEntry(kernel, row_bytes, num_layers,
                          config=config or {"num_warps": 4, "rows_per_program": 8},
                          metrics={"time_us": 12.5, "gbps": 47.0})


def test_device_slug():
    assert tc.device_slug("NVIDIA H200") == "nvidia-h200"
    assert tc.device_slug("NVIDIA GeForce RTX 4090 (24GB)") == "nvidia-geforce-rtx-4090-24gb"
    assert tc.device_slug("///") == "unknown-device"


def test_default_path_uses_xdg_and_slug(tmp_path):
    assert tc.cache_path("NVIDIA H200") == tmp_path / "xdg" / "hisparse-triton" / \
        "tuning-nvidia-h200.json"


def test_default_path_without_xdg(monkeypatch, tmp_path):
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert tc.cache_path("cpu") == tmp_path / "home" / ".cache" / "hisparse-triton" / \
        "tuning-cpu.json"


def test_env_override_file_and_directory(monkeypatch, tmp_path):
    monkeypatch.setenv(tc.ENV_VAR, str(tmp_path / "my.json"))
    assert tc.cache_path("NVIDIA H100 80GB HBM3") == tmp_path / "my.json"
    monkeypatch.setenv(tc.ENV_VAR, str(tmp_path))
    assert tc.cache_path("NVIDIA H100 80GB HBM3") == tmp_path / "tuning-nvidia-h100-80gb-hbm3.json"
    monkeypatch.setenv(tc.ENV_VAR, str(tmp_path / "new-dir") + "/")
    assert tc.cache_path("x") == tmp_path / "new-dir" / "tuning-x.json"


def test_round_trip(tmp_path):
    path = tc.cache_path("NVIDIA H200")
    cache = tc.TuningCache.load(path, device_name="NVIDIA H200")
    assert cache.entries == {} and cache.problem is None
    cache.put(_entry())
    cache.put(_entry("backup", 132, 1, num_warps=8, vec_bytes=16, flag=True, name="x"))
    assert cache.save() == path
    data = json.loads(path.read_text())
    assert data["schema"] == tc.SCHEMA and data["version"] == tc.VERSION
    assert set(data["entries"]) == {"gather:656:4", "backup:132:1"}

    again = tc.TuningCache.load(path, device_name="NVIDIA H200")
    assert again.device == "NVIDIA H200"
    assert again.entries == cache.entries
    assert again.get("gather", 656, 4).metrics == {"time_us": 12.5, "gbps": 47.0}
    assert again.get("gather", 656, 1) is None

    assert tc.lookup("backup", 132, 1, device_name="NVIDIA H200") == {
        "num_warps": 8, "vec_bytes": 16, "flag": True, "name": "x"}
    # another layer count: the nearest tuned shape of the kernel and row size stands in
    assert tc.lookup("backup", 132, 4, device_name="NVIDIA H200", nearest=False) is None
    assert tc.lookup("backup", 132, 4, device_name="NVIDIA H200") == {
        "num_warps": 8, "vec_bytes": 16, "flag": True, "name": "x"}
    assert tc.lookup("backup", 656, 1, device_name="NVIDIA H200") is None  # other row size
    assert tc.lookup("gather", 656, 4, device_name="another gpu") is None


def test_put_replaces_and_save_invalidates_memo():
    name = "NVIDIA H200"
    assert tc.lookup("gather", 656, 4, device_name=name) is None  # memoised empty cache
    cache = tc.TuningCache.load(device_name=name)
    cache.put(_entry(num_warps=2))
    cache.save()
    assert tc.lookup("gather", 656, 4, device_name=name) == {"num_warps": 2}
    cache.put(_entry(num_warps=16))
    cache.save()
    assert tc.lookup("gather", 656, 4, device_name=name) == {"num_warps": 16}
    assert len(tc.TuningCache.load(device_name=name).entries) == 1


@pytest.mark.parametrize("content, why", [
    ("{not json", "not readable JSON"),
    ("[1, 2]", "is not a"),
    (json.dumps({"schema": "something-else", "version": 1, "entries": {}}), "is not a"),
    (json.dumps({"schema": tc.SCHEMA, "version": 99, "entries": {}}), "version 99"),
    (json.dumps({"schema": tc.SCHEMA, "version": 1, "entries": []}), "'entries'"),
])
def test_corrupt_file_is_reported_and_ignored(content, why):
    name = "NVIDIA H200"
    path = tc.cache_path(name)
    path.parent.mkdir(parents=True)
    path.write_text(content)
    with pytest.warns(tc.TuningCacheWarning, match=why):
        assert tc.lookup("gather", 656, 4, device_name=name) is None
    # Memoised: reported once, not at every launch.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert tc.lookup("gather", 656, 4, device_name=name) is None

    # Tuning again replaces the bad file (kept aside as .bad) and works from then on.
    with pytest.warns(tc.TuningCacheWarning):
        cache = tc.TuningCache.load(path, device_name=name)
    assert cache.problem is not None
    cache.put(_entry())
    cache.save()
    assert path.with_name(path.name + ".bad").read_text() == content
    assert tc.lookup("gather", 656, 4, device_name=name) == {"num_warps": 4,
                                                             "rows_per_program": 8}


def test_bad_entries_are_skipped_good_ones_kept():
    name = "gpu"
    path = tc.cache_path(name)
    path.parent.mkdir(parents=True)
    good = _entry().to_json()
    path.write_text(json.dumps({"schema": tc.SCHEMA, "version": 1, "device": name, "entries": {
        "gather:656:4": good,
        "gather:656:1": good,  # key does not match its fields
        "backup:656:4": {"kernel": "backup", "row_bytes": -1, "num_layers": 4, "config": {}},
        "pages:656:4": {"kernel": "pages", "row_bytes": 656, "num_layers": 4,
                        "config": {"x": [1, 2]}},
        "resolve:0:1": "nonsense",
    }}))
    with pytest.warns(tc.TuningCacheWarning) as record:
        cache = tc.TuningCache.load(path, device_name=name)
    assert len(record) == 4
    assert list(cache.entries) == ["gather:656:4"]


def test_unreadable_file_is_reported_and_ignored():
    path = tc.cache_path("gpu")
    path.mkdir(parents=True)  # a directory where the file should be: reading fails
    with pytest.warns(tc.TuningCacheWarning, match="not readable"):
        assert tc.lookup("gather", 656, 4, device_name="gpu") is None


@dataclass(frozen=True)
class _Config:
    num_warps: int = 4
    block_rows: int = 16

    def __post_init__(self):
        if self.num_warps not in (1, 2, 4, 8, 16, 32):
            raise ValueError(f"num_warps={self.num_warps} is not a power of two <= 32")


def test_config_from_entry():
    assert tc.config_from_entry(_Config, {"num_warps": 8}) == _Config(8, 16)
    with pytest.warns(tc.TuningCacheWarning, match="unknown field"):
        assert tc.config_from_entry(_Config, {"num_warps": 8, "vec": 4}) is None
    with pytest.warns(tc.TuningCacheWarning, match="power of two"):
        assert tc.config_from_entry(_Config, {"num_warps": 3}) is None


def test_lookup_config():
    cache = tc.TuningCache.load(device_name=tc.current_device_name())
    cache.put(tc.TuningEntry("gather", 656, 4, {"block_rows": 32}))
    cache.save()
    assert tc.lookup_config(_Config, "gather", 656, 4) == _Config(4, 32)
    assert tc.lookup_config(_Config, "gather", 656, 2) == _Config(4, 32)  # nearest shape
    assert tc.lookup_config(_Config, "gather", 132, 4) is None


def test_entry_validation():
    with pytest.raises(ValueError, match="row_bytes"):
        tc.TuningEntry("gather", 0, 1, {})
    with pytest.raises(ValueError, match="config"):
        tc.TuningEntry("gather", 656, 1, {"a": {"nested": 1}})


def test_env_off_disables_lookup(monkeypatch):
    cache = tc.TuningCache.load(device_name="gpu")
    cache.put(_entry())
    cache.save()
    assert tc.lookup("gather", 656, 4, device_name="gpu") is not None
    monkeypatch.setenv(tc.ENV_VAR, "off")
    assert tc.disabled()
    assert tc.lookup("gather", 656, 4, device_name="gpu") is None
    assert tc.cache_path("gpu") == cache.path  # `tune` still writes to the default place


def test_tuned_entry_reaches_the_launch_config(tmp_path, monkeypatch):
    """``tuning.default_config`` (what every launcher calls) reads this cache."""
    from hisparse_triton import tuning

    monkeypatch.setenv(tc.ENV_VAR, str(tmp_path / "tuned.json"))
    tuned = {"rows_per_program": 16, "chunk_bytes": 512, "num_warps": 8, "grid_programs": 1056}
    cache = tc.TuningCache.load(device_name=tc.current_device_name())
    cache.put(tc.TuningEntry("gather", 656, 4, tuned, {"gbps": 40.0}))
    cache.save()
    tuning.default_config.cache_clear()
    try:
        assert tuning.default_config("gather", 656, 4) == tuning.CopyConfig(**tuned)
        # the nearest tuned shape (4 layers) serves 1 layer; another row size keeps the default
        assert tuning.default_config("gather", 656, 1) == tuning.CopyConfig(**tuned)
        assert tuning.default_config("gather", 132, 4) == tuning.builtin_config("gather", 132, 4)
        (tmp_path / "tuned.json").write_text("{broken")
        tc.invalidate()
        tuning.default_config.cache_clear()
        with pytest.warns(tc.TuningCacheWarning):
            config = tuning.default_config("gather", 656, 4)
        assert config == tuning.builtin_config("gather", 656, 4)
    finally:
        tuning.default_config.cache_clear()


def test_nearest_shape_by_layer_count():
    cache = tc.TuningCache.load(device_name="gpu")
    for layers, warps in ((1, 1), (4, 2), (64, 4)):
        cache.put(_entry("backup", 656, layers, num_warps=warps))
    cache.put(_entry("gather", 656, 61, num_warps=8))
    cache.save()
    assert cache.nearest("backup", 656, 61).num_layers == 64  # the 61-layer mirror
    assert cache.nearest("backup", 656, 2).num_layers == 4    # log2 tie: the larger count
    assert cache.nearest("backup", 656, 3).num_layers == 4
    assert cache.nearest("backup", 656, 1).num_layers == 1    # exact
    assert cache.nearest("backup", 132, 4) is None
    assert cache.nearest("spill", 656, 4) is None
    assert tc.lookup("backup", 656, 61, device_name="gpu") == {"num_warps": 4}


def test_inexact_lookups_are_logged_once(caplog):
    cache = tc.TuningCache.load(device_name="gpu")
    cache.put(_entry("backup", 656, 4, num_warps=2))
    cache.save()
    with caplog.at_level("DEBUG", logger="hisparse_triton.tuning_cache"):
        for _ in range(3):
            tc.lookup("backup", 656, 61, device_name="gpu")   # nearest: INFO
            tc.lookup("gather", 656, 1, device_name="gpu")    # nothing for gather: WARNING
            tc.lookup("backup", 656, 4, device_name="gpu")    # exact: silent
    records = [(r.levelname, r.getMessage()) for r in caplog.records]
    assert len(records) == 2
    assert records[0][0] == "INFO" and "backup:656:61" in records[0][1] \
        and "backup:656:4" in records[0][1]
    assert records[1][0] == "WARNING" and "gather" in records[1][1] \
        and "built-in default" in records[1][1]
    caplog.clear()
    with caplog.at_level("DEBUG", logger="hisparse_triton.tuning_cache"):
        assert tc.lookup("gather", 656, 1, device_name="no-such-gpu") is None
    assert [r.levelname for r in caplog.records] == ["DEBUG"]  # no cache file at all
