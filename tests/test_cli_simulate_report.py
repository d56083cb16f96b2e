"""``simulate``'s report names what its figures count: one wall time that covers the
command, and each miss rate with its denominator (top-k columns or buffer lookups)."""

from __future__ import annotations

import json
import re
import time

import pytest
import torch

from hisparse_triton.cli import main

RUN = ["simulate", "--preset", "tiny", "--requests", "3", "--max-running", "2",
       "--prompt-len", "100", "--output-len", "6", "--free-block-watermark", "1",
       "--no-progress"]


@pytest.fixture(autouse=True)
def _restore_threads():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def test_one_wall_time_that_covers_the_command(capsys, tmp_path):
    path = tmp_path / "r.json"
    started = time.perf_counter()
    assert main([*RUN, "--json", str(path)]) == 0
    elapsed = time.perf_counter() - started
    out = capsys.readouterr().out
    walls = re.findall(r"wall time ([\d.]+) s", out)
    assert len(walls) == 1, out
    wall = float(walls[0])
    report = json.loads(path.read_text())
    # the command's time: setup, the decode loop, the policy replays and the checks ...
    assert report["command_seconds"] >= report["wall_seconds"]
    assert wall == pytest.approx(report["command_seconds"], abs=0.006)
    # ... all of the call but the JSON written after the report
    assert elapsed - 0.25 <= wall <= elapsed
    assert f"the decode loop took {report['wall_seconds']:.2f} s of it" in out


def test_each_miss_rate_names_its_denominator(capsys):
    assert main([*RUN, "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert main(RUN) == 0
    out = capsys.readouterr().out
    columns = r["hits"] + r["misses"] + r["masked"]
    whole = re.search(r"\(miss rate ([\d.]+)% of top-k columns, whole run\)", out)
    assert whole and float(whole.group(1)) == pytest.approx(100 * r["misses"] / columns,
                                                            abs=0.05)
    assert re.search(r"steady state: miss rate [\d.]+% of top-k columns", out)
    assert "miss rate here = misses / lookups, not / top-k columns" in out
    lru = re.search(r"^  lru +(\d+) misses +([\d.]+)% of lookups", out, flags=re.M)
    assert lru and int(lru.group(1)) == r["misses"]
    assert float(lru.group(2)) == pytest.approx(100 * r["misses"] / r["buffer_lookups"],
                                                abs=0.05)
    for name in ("fifo", "belady"):
        assert re.search(rf"^  {name} +\d+ misses +[\d.]+% of lookups", out, flags=re.M)
