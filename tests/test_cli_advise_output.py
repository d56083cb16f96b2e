"""``advise``'s report as a user reads it: per-step and per-request bytes in a unit that
shows them at every preset, and its own sentence (no raw Python warning) about a swept
setting the planner would warn about."""

from __future__ import annotations

import warnings

import pytest

from hisparse_triton.cli import main
from hisparse_triton.units import byte_unit

FAST = ["--streams", "1", "--steps", "8", "--no-progress"]


def _table(out: str) -> tuple[list[str], list[list[str]]]:
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.lstrip().startswith("block"))
    rows = []
    for line in lines[start + 1:]:
        if not line.strip() or line.startswith("("):
            break
        rows.append(line.split())
    return lines[start].split(), rows


@pytest.mark.parametrize("preset", ["tiny", "deepseek-v3.2-fp8"])
def test_byte_columns_never_read_zero(preset, capsys):
    assert main(["advise", "--preset", preset, *FAST]) == 0
    header, rows = _table(capsys.readouterr().out)
    step_col = next(i for i, name in enumerate(header) if name.endswith("/step")
                    and name != "rows/step")
    assert header[step_col] in ("B/step", "KiB/step", "MiB/step", "GiB/step")
    assert header[step_col + 1] == "GPU" and header[step_col + 2].endswith("/req")
    hisparse = [row for row in rows if row[0].isdigit()]
    assert hisparse
    for row in hisparse:
        for value in (row[step_col], row[step_col + 1]):   # "GPU X/req" is two header words
            assert float(value.replace(",", "")) > 0, f"{header[step_col]} reads 0: {row}"


def test_the_unit_follows_the_smallest_value():
    assert byte_unit([711.0, 4279.0]) == ("B", 1)
    assert byte_unit([160 * 1024.0, 384 * 1024.0]) == ("KiB", 1024)
    assert byte_unit([4.0 * 2**20, 22 * 2**20]) == ("MiB", 2**20)
    assert byte_unit([0.0]) == ("B", 1)


def test_no_raw_warning_but_advises_own_sentence(capsys):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        # block 64 with a buffer of 32 rows: the planner warns (half a page never used)
        assert main(["advise", "--preset", "tiny", "--block-sizes", "16,64",
                     "--buffers", "32,64", *FAST]) == 0
    assert [str(w.message) for w in caught] == []
    out = capsys.readouterr().out
    marked = [line for line in out.splitlines() if line.endswith("(part page)")]
    assert len(marked) == 1 and marked[0].split()[:2] == ["64", "32"]
    assert "note: the settings marked (part page)" in out
    assert "buffer 32 at block 64 takes 64 rows (32 unused)" in out
