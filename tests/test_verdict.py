"""The live verdict's model: ``advisor``'s miss curves (a trace's, or an observed one) and
``metrics.verdict.live_verdict`` (advise fed with an observed miss rate, no formula of its
own). Pure Python: no runtime here (``test_metrics.py`` and ``test_simulate_verdict.py``
feed it from real runs)."""

from __future__ import annotations

import json

import pytest

from hisparse_triton import advisor
from hisparse_triton.advisor import (
    AdviseSettings,
    ObservedMissCurve,
    StepModel,
    TraceMissCurve,
    run_advise,
)
from hisparse_triton.metrics import verdict as verdict_module
from hisparse_triton.metrics.verdict import (
    Deployment,
    Observation,
    VerdictSettings,
    live_verdict,
    sweep_buffers,
)

#: A tiny-preset deployment: block 16, the default 2 x top-k buffer, 512-token requests.
TINY = Deployment(block_size=16, device_buffer_size=64, top_k=32, mtp=1, max_model_len=512,
                  device_pool_bytes=10 << 20, host_pool_bytes=20 << 20)
MODEL = dict(link_gbps=0.2, step=StepModel(((1, 1.0), (64, 2.0)), "given"))


class Table:
    """A miss curve from a table (``source`` and ``miss_rate`` only)."""

    source = "a table"

    def __init__(self, rates):
        self.rates = rates

    def miss_rate(self, buffer, block_size):
        return self.rates[buffer]


# ----------------------------------------------------------------------------- miss curves
def test_an_observed_curve_keeps_its_points_and_carries_the_reference_shape():
    ref = Table({32: 0.3, 64: 0.15, 128: 0.05, 256: 0.0})
    curve = ObservedMissCurve(((64, 16, 0.12),), ref, "live")
    assert curve.miss_rate(64, 16) == 0.12                        # observed: as it is
    assert curve.miss_rate(32, 16) == pytest.approx(0.12 * 0.3 / 0.15)
    assert curve.miss_rate(128, 16) == pytest.approx(0.12 * 0.05 / 0.15)
    assert curve.miss_rate(256, 16) == 0.0
    assert ObservedMissCurve(((64, 16, 0.9),), ref, "x").miss_rate(32, 16) == 1.0   # capped
    assert ObservedMissCurve(((64, 16, 0.0),), ref, "x").miss_rate(32, 16) == 0.0
    flat = Table({32: 0.2, 64: 0.0, 128: 0.0})
    assert ObservedMissCurve(((64, 16, 0.1),), flat, "x").miss_rate(32, 16) == 0.1
    two = ObservedMissCurve(((32, 16, 0.25), (128, 16, 0.04)), ref, "x")
    assert two.miss_rate(32, 16) == 0.25 and two.miss_rate(128, 16) == 0.04
    assert two.miss_rate(256, 16) == 0.0          # nearest observed point: 128


@pytest.mark.parametrize("points, match", [
    ((), "at least one"),
    (((0, 16, 0.1),), "buffer >= 1"),
    (((64, 16, 1.5),), r"miss rate in \[0, 1\]"),
])
def test_bad_observed_points_are_refused(points, match):
    with pytest.raises(ValueError, match=match):
        ObservedMissCurve(points, Table({}), "x")


def test_a_trace_curve_replays_each_setting_once(monkeypatch):
    calls = []
    monkeypatch.setattr(advisor, "steady_miss_rate",
                        lambda streams, capacity, block, warmup: calls.append(capacity) or 0.5)
    curve = TraceMissCurve([], 3, "none")
    assert curve.miss_rate(64, 16) == curve.miss_rate(64, 16) == 0.5
    assert curve.miss_rate(128, 16) == 0.5 and calls == [64, 128]


def test_advise_takes_a_miss_curve_instead_of_a_trace():
    settings = AdviseSettings(preset="tiny", gpu_memory_gib=0.01, host_pool_gib=1.0,
                              buffers=(32, 64, 128), block_sizes=(16,), steps=16, streams=1,
                              warmup=4, **MODEL)
    traced = run_advise(settings)
    table = Table({r["device_buffer_size"]: r["miss_rate"] for r in traced["settings"]})
    fed = run_advise(settings, miss_curve=table)
    assert fed["trace"] == "a table"
    assert fed["settings"] == traced["settings"] and fed["recommended"] == traced["recommended"]
    halved = run_advise(settings, miss_curve=Table({k: v / 2 for k, v in table.rates.items()}))
    for a, b in zip(halved["settings"], traced["settings"]):
        assert a["miss_rate"] == pytest.approx(b["miss_rate"] / 2)
        assert a["bytes_per_step"] == pytest.approx(b["bytes_per_step"] / 2)
        assert a["tokens_per_s"] > b["tokens_per_s"]
    with pytest.raises(ValueError, match="from a trace or from a given miss curve"):
        run_advise(AdviseSettings(preset="tiny", trace="x.npz"), miss_curve=table)


# ----------------------------------------------------------------------------- the verdict
def observed(rate: float, columns: int = 10_000) -> Observation:
    misses = round(rate * columns)
    return Observation(hits=columns - misses, misses=misses, seconds=1.0, samples=9,
                       since_start=False)


def test_the_verdict_is_advise_fed_with_the_observed_rate(monkeypatch):
    """With the reference curve = a trace's curve and the observed rate = that curve's rate
    at the deployment's setting, every row of the verdict's sweep is advise's on the trace:
    the verdict has no formula of its own."""
    settings = VerdictSettings(preset="tiny", gpu_memory_gib=0.01, host_pool_gib=1.0, **MODEL)
    adv = verdict_module.advise_settings(TINY, settings)
    adv = AdviseSettings(**{**adv.__dict__, "steps": 16, "streams": 1, "warmup": 4})
    traced = run_advise(adv)
    trace_curve = advisor.trace_miss_curve(adv, 32, 512)
    monkeypatch.setattr(verdict_module, "reference_curve", lambda *a: trace_curve)
    rate = trace_curve.miss_rate(64, 16)
    v = live_verdict(observed(rate, columns=1 << 20), TINY, settings)
    for mine, theirs in zip(v.advice["settings"], traced["settings"]):
        assert mine["miss_rate"] == pytest.approx(theirs["miss_rate"], rel=1e-5)
        assert mine["tokens_per_s"] == pytest.approx(theirs["tokens_per_s"], rel=1e-4)
    assert v.recommended["device_buffer_size"] == traced["recommended"]["device_buffer_size"]
    row = next(r for r in traced["settings"] if r["device_buffer_size"] == 64)
    assert v.tokens_per_s == pytest.approx(row["tokens_per_s"], rel=1e-4)
    assert v.batch == row["batch"] and v.all_gpu_batch == traced["all_gpu"]["batch"]
    assert v.speedup_vs_all_gpu == pytest.approx(
        row["tokens_per_s"] / traced["all_gpu"]["tokens_per_s"], rel=1e-4)
    json.dumps(v.as_dict())                       # JSON-ready


def test_a_higher_observed_miss_rate_lowers_the_estimate():
    settings = VerdictSettings(preset="tiny", gpu_memory_gib=0.01, host_pool_gib=1.0, **MODEL)
    low, high = (live_verdict(observed(r), TINY, settings) for r in (0.05, 0.30))
    assert high.tokens_per_s < low.tokens_per_s
    assert high.all_gpu_tokens_per_s == low.all_gpu_tokens_per_s     # no gathers there
    assert low.miss_rate == 0.05 and high.columns == 10_000
    # Every buffer's rate moves with the observation (the shape stays the reference's).
    for a, b in zip(low.advice["settings"], high.advice["settings"]):
        assert b["miss_rate"] == pytest.approx(min(1.0, a["miss_rate"] * 6))


def test_the_text_says_what_to_do():
    fast = VerdictSettings(preset="tiny", gpu_memory_gib=0.01, host_pool_gib=1.0,
                           link_gbps=1.0, step=MODEL["step"])
    v = live_verdict(observed(0.12), TINY, fast)
    assert v.text.startswith("HiSparse verdict: miss rate 12.0% (live, 10,000 top-k columns) "
                             "at block 16 x buffer 64 -> about ")
    assert f"{v.speedup_vs_all_gpu:.2f}x all-GPU" in v.text and "[tiny, 0.01 GiB GPU" in v.text
    assert v.recommended["mode"] == "hisparse"
    slow = VerdictSettings(preset="tiny", gpu_memory_gib=0.01, host_pool_gib=1.0,
                           link_gbps=0.001, step=MODEL["step"])
    v = live_verdict(observed(0.12), TINY, slow)
    assert v.recommended["mode"] == "all-gpu" and v.recommended_speedup_vs_all_gpu == 1.0
    assert "advise would pick all-GPU (no HiSparse)" in v.text and v.speedup_vs_all_gpu < 1


def test_a_setting_that_does_not_fit_is_said():
    tight = VerdictSettings(preset="tiny", gpu_memory_gib=0.0001, host_pool_gib=1.0, **MODEL)
    v = live_verdict(observed(0.1), TINY, tight)
    assert v.tokens_per_s is None and v.speedup_vs_all_gpu is None and v.batch == 0
    assert v.setting_error and "does not fit the budget" in v.text


def test_defaults_come_from_the_deployment():
    adv = verdict_module.advise_settings(TINY, VerdictSettings(preset="tiny"))
    assert adv.gpu_memory_gib == pytest.approx(10 / 1024) and adv.context_len == 512
    assert adv.host_pool_gib == pytest.approx(20 / 1024) and adv.block_sizes == (16,)
    assert adv.top_k == 32 and adv.mtp == 1 and adv.trace is None
    assert sweep_buffers(TINY, VerdictSettings(preset="tiny")) == (32, 64, 128, 256)
    odd = Deployment(**{**TINY.__dict__, "device_buffer_size": 96})
    assert sweep_buffers(odd, VerdictSettings(preset="tiny")) == (32, 64, 96, 128, 256)
    assert sweep_buffers(TINY, VerdictSettings(preset="tiny", buffers=(128,))) == (64, 128)


@pytest.mark.parametrize("kwargs, match", [
    (dict(preset="tiny", overlap=2.0), r"overlap must be in \[0, 1\]"),
    (dict(preset="tiny", gpu_memory_gib=0.0), "gpu_memory_gib must be positive"),
    (dict(preset="tiny", link_gbps=0.0), "link_gbps must be positive"),
])
def test_bad_settings_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        VerdictSettings(**kwargs)


def test_nothing_to_judge_and_no_preset_are_errors():
    with pytest.raises(ValueError, match="nothing to judge"):
        live_verdict(Observation(0, 0, 0.0, 1, True), TINY, VerdictSettings(preset="tiny"))
    with pytest.raises(ValueError, match="preset is not set"):
        live_verdict(observed(0.1), TINY, VerdictSettings(preset=None))
