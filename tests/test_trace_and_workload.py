"""Top-k traces: the calibrated generator reproduces the published LRU miss curve; the
``.npz`` trace format round-trips and replays through ``simulate`` exactly."""

from __future__ import annotations

import json
import os
import stat

import numpy as np
import pytest
import torch

from hisparse_triton import trace as tr
from hisparse_triton import workload
from hisparse_triton.cli import main


@pytest.fixture(autouse=True)
def _restore_threads():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def test_calibrated_miss_rates_match_the_published_curve():
    """LRU at buffer = k, 2k, 4k (k = 2048, 32K-token history): within 2 points of the
    published GLM-5.1 curve (30% / 13.4% / 6.7%)."""
    rates = workload.calibration_rates()
    assert set(rates) == set(workload.PUBLISHED_MISS_RATES) == {1, 2, 4}
    for factor, published in workload.PUBLISHED_MISS_RATES.items():
        assert abs(rates[factor] - published) <= 0.02, (factor, rates[factor], published)
    assert rates[1] > rates[2] > rates[4]


def test_calibrated_selections_are_valid():
    gen = workload.CalibratedTrace(64, seed=3)
    short = gen.next(("r", 0), 40)  # shorter than k: the whole history, -1 padding
    assert sorted(short[:40].tolist()) == list(range(40)) and (short[40:] == -1).all()
    for seq in range(1000, 1010):
        sel = gen.next(("r", 0), seq)
        assert sel.dtype == np.int32 and sel.shape == (64,)
        assert np.unique(sel).size == 64 and sel.min() >= 0 and sel.max() < seq
        assert {0, seq - 1} <= set(sel.tolist())  # an attention sink and the newest token
    # a pure function of the seed and the call sequence
    assert np.array_equal(_first_long(3), _first_long(3))
    assert not np.array_equal(_first_long(3), _first_long(4))


def _first_long(seed):
    gen = workload.CalibratedTrace(64, seed=seed)
    gen.next(("r", 0), 40)
    return gen.next(("r", 0), 1000)


def test_generator_bad_input():
    with pytest.raises(ValueError, match="topk"):
        workload.CalibratedTrace(0)
    with pytest.raises(ValueError, match="drift"):
        workload.CalibratedParams(drift=1.5)
    with pytest.raises(ValueError, match="unknown workload"):
        workload.make_trace("zipf", 8)


# ------------------------------------------------------------------------- the file format
def _small_trace() -> tr.TopkTraceFile:
    rec = tr.TraceRecorder(4, 2, metadata={"by": "test"})
    rec.add_request(0, 10, 3)
    rec.add_request(1, 6, 2)
    rng = np.random.default_rng(0)
    rec.add(0, [0, 1], [11, 7], rng.integers(-1, 11, (2, 2, 4)))
    rec.add(1, [0, 1], [12, 8], rng.integers(-1, 11, (2, 2, 4)))
    rec.add(2, [0], [13], rng.integers(-1, 11, (1, 2, 4)))
    return rec.build()


def test_save_load_round_trip(tmp_path):
    trace = _small_trace()
    path = str(tmp_path / "t.npz")
    tr.save_trace(trace, path)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o666 & ~_umask()
    back = tr.load_trace(path)
    for name in ("prompt_len", "output_len", "step", "request", "seq_len", "positions"):
        assert np.array_equal(getattr(back, name), getattr(trace, name)), name
    assert back.top_k == 4 and back.num_layers == 2 and back.metadata == {"by": "test"}
    assert back.max_live() == 2 and back.max_len == 13
    with np.load(path) as data:  # the documented keys
        assert str(data["format"]) == tr.TRACE_FORMAT and int(data["version"]) == 1
        assert data["positions"].dtype == np.int32


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


@pytest.mark.parametrize("change, message", [
    (lambda a: a.update(version=np.asarray(2)), "version 2 trace"),
    (lambda a: a.update(format=np.asarray("other")), "is not a 'hisparse-triton/topk-trace'"),
    (lambda a: a.pop("seq_len"), "lacks seq_len"),
    (lambda a: a.update(seq_len=a["seq_len"][::-1].copy()), "seq_len"),
    (lambda a: a.update(positions=a["positions"][:, :, :3]), "positions must be"),
    (lambda a: a.update(request=np.full_like(a["request"], 5)), "request ids must lie in"),
])
def test_invalid_files_are_refused(tmp_path, change, message):
    path = str(tmp_path / "t.npz")
    tr.save_trace(_small_trace(), path)
    with np.load(path) as data:
        arrays = {k: data[k] for k in data.files}
    change(arrays)
    np.savez(path, **arrays)
    with pytest.raises(tr.TraceFormatError, match=message):
        tr.load_trace(path)


def test_not_an_npz(tmp_path):
    path = tmp_path / "x.npz"
    path.write_text("hello")
    with pytest.raises(tr.TraceFormatError, match="not a readable .npz"):
        tr.load_trace(str(path))


SMALL = ["simulate", "--preset", "tiny", "--free-block-watermark", "1", "--requests", "3",
         "--max-running", "2",
         "--prompt-len", "100",
         "--output-len", "6", "--no-verify"]


def test_record_then_replay_is_identical(tmp_path, capsys):
    path = str(tmp_path / "rec.npz")
    assert main([*SMALL, "--record", path, "--json"]) == 0
    recorded = json.loads(capsys.readouterr().out)
    trace = tr.load_trace(path)
    assert trace.num_records == 3 * 6 and trace.num_layers == 4 and trace.top_k == 32
    assert trace.metadata["workload"] == "calibrated"
    assert main(["simulate", "--trace", path, "--free-block-watermark", "1", "--no-verify",
                 "--json"]) == 0
    replayed = json.loads(capsys.readouterr().out)
    for key in ("hits", "misses", "masked", "h2d_bytes", "d2h_bytes", "decode_steps",
                "resolved_rows", "policies"):
        assert replayed[key] == recorded[key], key
    assert replayed["workload"] == "trace" and "calibration" not in replayed


def test_replay_takes_the_preset_and_shape_from_the_trace(tmp_path, capsys):
    """A trace recorded on a large preset replays with just --trace: the preset, the layers
    and the pool settings come from its metadata (the same misses); flags still win."""
    path = str(tmp_path / "ds.npz")
    flags = ["--layers", "2", "--requests", "2", "--max-running", "2", "--prompt-len", "2304",
             "--output-len", "3", "--top-k", "256", "--prefill-chunk", "1024",
             "--device-buffer-size", "768", "--no-verify", "--policies", "none"]
    assert main(["simulate", "--preset", "deepseek-v3.2-fp8", *flags, "--record", path]) == 0
    out = capsys.readouterr().out
    assert f"recorded: 6 top-k selections (2 requests, 3 decode steps, 2 index groups x " \
           f"top-k 256, with the preset and pool settings) to {path}" in out
    assert f"replay it with: hisparse-triton simulate --trace {path}" in out
    meta = tr.load_trace(path).metadata
    assert meta["preset"] == "deepseek-v3.2-fp8"
    assert meta["simulate"]["layers"] == 2 and meta["simulate"]["device_buffer_size"] == 768
    assert main(["simulate", "--preset", "deepseek-v3.2-fp8", *flags, "--json"]) == 0
    direct = json.loads(capsys.readouterr().out)
    assert main(["simulate", "--trace", path, "--no-verify", "--json"]) == 0
    replay = json.loads(capsys.readouterr().out)
    assert replay["preset"] == "deepseek-v3.2-fp8" and replay["preset_source"] == "trace"
    assert set(replay["from_trace"]) >= {"preset", "layers", "device_buffer_size",
                                         "prefill_chunk"}
    for key in ("sparse_layers", "device_buffer_size", "prefill_chunk", "device_pool_blocks",
                "hits", "misses", "h2d_bytes"):
        assert replay[key] == direct[key], key
    assert main(["simulate", "--trace", path, "--device-buffer-size", "512", "--no-verify",
                 "--json"]) == 0
    override = json.loads(capsys.readouterr().out)
    assert override["device_buffer_size"] == 512 and "device_buffer_size" not in \
        override["from_trace"]
    rc = main(["simulate", "--trace", path, "--preset", "tiny"])
    assert rc == 1 and "exceed the tiny preset's max context" in capsys.readouterr().err


def test_a_trace_naming_an_unknown_preset_is_refused(tmp_path, capsys):
    trace = tr.load_trace(tr.sample_trace_path())
    trace.metadata = {**trace.metadata, "preset": "my-model"}
    path = str(tmp_path / "m.npz")
    tr.save_trace(trace, path)
    assert main(["simulate", "--trace", path]) == 1
    err = capsys.readouterr().err
    assert "the trace's metadata names the preset 'my-model'" in err and "--preset" in err
    assert main(["simulate", "--trace", path, "--preset", "tiny", "--no-verify"]) == 0
    capsys.readouterr()


def test_shipped_sample_replays(capsys):
    sample = tr.sample_trace_path()
    assert os.path.getsize(sample) < 16 << 10  # a few KB in the package
    assert main(["simulate", "--trace", sample, "--free-block-watermark", "1", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["verified"] and r["misses"] > 0 and r["lru_matches_runtime"]
    assert r["requests"] == 3 and r["top_k"] == 32


def test_trace_excludes_the_synthetic_flags(capsys):
    rc = main(["simulate", "--trace", tr.sample_trace_path(), "--prompt-len", "10"])
    err = capsys.readouterr().err
    assert rc == 1 and "--prompt-len cannot be combined with --trace" in err
    rc = main(["simulate", "--trace", tr.sample_trace_path(), "--top-k", "16"])
    assert rc == 1 and "differs from the trace's top-k 32" in capsys.readouterr().err
