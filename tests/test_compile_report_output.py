"""What ``compile-report`` prints around its tables: a legend for every column (NVIDIA and
AMD) and a one-line verdict at the end (compiling is tested in test_gather_kernel.py and
test_amd_targets.py; here the payloads are made by hand)."""

from __future__ import annotations

import re

import pytest

from hisparse_triton.cli import main
from hisparse_triton.commands.compile_report import verdict
from hisparse_triton.compile import report as compile_report

NVIDIA = {"arch": "sm_90", "vendor": "nvidia", "warp_size": 32, "triton": "3.7.1",
          "launches": [{"variant": "gather 656B L=1", "kernel": "copy_rows_kernel",
                        "grid": [4224, 1], "error": None, "num_warps": 4, "registers": 40,
                        "stack_bytes": 0, "local_bytes": 0, "spills": False,
                        "shared_bytes": 0, "sass_instructions": 300, "ctas_per_sm": 12}]}
AMD_LAUNCH = {"variant": "resolve k=4096", "kernel": "_resolve_kernel", "grid": [64, 1],
              "error": None, "num_warps": 16, "vgprs": 124, "sgprs": 90, "sgpr_spills": 3,
              "vgpr_spills": 0, "scratch_bytes": 0, "lds_bytes": 4096, "instructions": 900,
              "waves_per_simd": 4, "workgroups_per_cu": 1, "limited_by": "vgprs",
              "spills": False}
AMD = {"arch": "gfx942", "vendor": "amd", "warp_size": 64, "triton": "3.7.1",
       "limits": {"product": "MI300X"}, "launches": [AMD_LAUNCH]}


@pytest.mark.parametrize("payload", [NVIDIA, AMD], ids=["nvidia", "amd"])
def test_every_column_has_a_legend(payload):
    text = compile_report.format_report(payload)
    lines = text.splitlines()
    header = next(line for line in lines if line.startswith("variant"))
    legend = " ".join(" ".join(lines[lines.index(header) + 1 + len(payload["launches"]):]).split())
    assert legend.startswith("columns:")
    for column in header.split()[2:]:   # variant and kernel name themselves
        assert re.search(rf"(^|[;:] ){re.escape(column)} = ", legend), \
            f"column {column!r} has no legend: {legend}"
    if payload["vendor"] == "amd":      # a non-zero sspl is not a spill to memory
        assert "not a spill to memory" in legend


def test_verdict_passes_and_names_what_failed():
    assert verdict(NVIDIA) == ([], "check: PASS, 1 launch compiled for sm_90, no spills to "
                                   "memory")
    assert verdict(AMD)[0] == []        # SGPRs spilled into VGPR lanes do not fail
    spilled = dict(AMD_LAUNCH, variant="resolve small host", scratch_bytes=48, vgpr_spills=11,
                   spills=True)
    broken = dict(AMD_LAUNCH, variant="copy", error="CompilationError: x")
    failed, line = verdict(dict(AMD, launches=[AMD_LAUNCH, spilled, broken]))
    assert failed == ["copy: _resolve_kernel: CompilationError: x",
                      "resolve small host: _resolve_kernel: spills to memory"]
    assert line == ("check: FAIL, 2 of 3 launches for gfx942: 1 did not compile, 1 spill to "
                    "memory; first: copy: _resolve_kernel: CompilationError: x (and 1 more)")
    assert verdict(dict(AMD, launches=[]))[1] == "check: FAIL, no launch was recorded for gfx942"


@pytest.mark.parametrize("check", [True, False])
def test_the_report_ends_with_the_verdict(check, monkeypatch, capsys):
    spilled = dict(NVIDIA["launches"][0], stack_bytes=8, spills=True)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)   # no subprocess: the payload below
    monkeypatch.setattr(compile_report, "compile_report",
                        lambda *a, **k: dict(NVIDIA, launches=[spilled]))
    rc = main(["compile-report", "--kernels", "copy", *(["--check"] if check else [])])
    out, err = capsys.readouterr()
    last = out.strip().splitlines()[-1]
    assert last.startswith("check: FAIL, 1 of 1 launch for sm_90: 1 spill to memory")
    assert rc == (1 if check else 0)
    assert last.endswith("(--check would exit 1)") != check
    assert ("compile-report --check: gather 656B L=1" in err) == check
