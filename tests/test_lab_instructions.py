"""``lab.instructions``: instruction counts of the decode step by callgrind, the
difference of two repeat counts per unit (the counted runs replaced by a fake here; one real
run under valgrind is marked slow)."""

from __future__ import annotations

import shutil

import pytest

from lab import instructions
from lab.instructions import _collected, count_instructions


def _fake_runner(per_call: int, fixed: int, groups: int = 3):
    jobs = []

    def run(job, env, timeout):
        jobs.append((job, env))
        return fixed + per_call * job["repeats"], {"groups": groups}
    return run, jobs


def test_the_count_is_the_difference_of_two_repeat_counts_per_unit():
    run, jobs = _fake_runner(per_call=9_000, fixed=123_456)
    step = count_instructions("step", repeats=(2, 5), runner=run, batch=4, layers=3)
    assert step["instructions"] == 9_000 and step["collected"] == [141_456, 168_456]
    resolves, _ = _fake_runner(per_call=9_000, fixed=5)
    per_call = count_instructions("resolve_rows", repeats=(1, 4), runner=resolves)
    assert per_call["instructions"] == 3_000      # one resolves() call covers 3 groups
    job, env = jobs[0]
    assert job["callable"] == "split_step" and job["step"]["launches"] == "standin"
    assert job["step"]["steps"] == 7 and job["step"]["batch"] == 4
    assert "TRITON_INTERPRET" not in env
    off, jobs = _fake_runner(per_call=1, fixed=0)
    count_instructions("bookkeeping", runner=off, launches="stubbed")
    assert jobs[0][0]["callable"] == "bookkeeping"


@pytest.mark.parametrize("kwargs, match", [
    (dict(unit="steps"), "unit must be one of"),
    (dict(repeats=(3, 3)), "repeats must be"),
    (dict(repeats=(-1, 2)), "repeats must be"),
])
def test_bad_arguments_are_named(kwargs, match):
    run, jobs = _fake_runner(1, 0)
    with pytest.raises(ValueError, match=match):
        count_instructions(runner=run, **kwargs)
    assert not jobs


def test_callgrinds_count_is_read_and_its_absence_is_an_error():
    assert _collected("==1== Events    : Ir\n==1== Collected : 30,756,005\n") == 30_756_005
    with pytest.raises(RuntimeError, match="no count"):
        _collected("==1== something else\n")


def test_missing_valgrind_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(instructions, "instructions_available", lambda: False)
    with pytest.raises(RuntimeError, match="valgrind"):
        count_instructions("step")


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("valgrind") is None or shutil.which("callgrind_control")
                    is None, reason="needs valgrind and callgrind_control")
def test_a_real_count_of_a_small_step(request):
    markexpr = request.config.getoption("markexpr") or ""
    if "slow" not in markexpr or "not slow" in markexpr:
        pytest.skip("about a minute under valgrind; select it with -m slow")
    small = dict(batch=2, layers=2, top_k=64, device_buffer_size=128, prompt_len=64)
    out = count_instructions("resolve_rows", repeats=(1, 2), launches="stubbed", **small)
    assert out["index_groups"] == 2 and out["instructions"] > 1_000


def test_bench_host_reports_the_counts(monkeypatch, tmp_path, capsys):
    """``bench/host_cost.py --instructions``: a line and a JSON entry per unit (counts faked;
    a failing count is reported, the times still stand)."""
    import json

    from host_cost import main

    def fake(unit, *, launches, **sizes):
        if launches == "standin_bare":
            raise RuntimeError("valgrind is gone")
        return {"unit": unit, "instructions": {"step": 6_000_000, "resolve_rows": 80_000,
                                               "bookkeeping": 1_000_000}[unit]}
    monkeypatch.setattr(instructions, "count_instructions", fake)
    out = tmp_path / "host.json"
    code = main(["--quick", "--no-launch-path", "--instructions", "--batch", "4", "--top-k",
                 "64", "--hot-slots", "128", "--json", str(out)])
    assert code == 0
    report = capsys.readouterr()
    text = report.out + report.err
    assert "6,000,000 instructions per step" in text and "80,000" in text
    assert "step_bare: failed: valgrind is gone" in text
    doc = json.loads(out.read_text())
    counts = doc["instructions"]
    assert counts["bookkeeping"]["instructions"] == 1_000_000
    assert "error" in counts["step_bare"]
