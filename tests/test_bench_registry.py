"""The benchmark op registry (``hisparse_triton.benchmarks.registry``): one table that
``bench``, ``tune``, ``bench/gpu_check.py`` and the pytest-benchmark suites read."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

from hisparse_triton import tuning
from hisparse_triton.benchmarks import registry
from hisparse_triton.benchmarks.settings import BenchSettings
from hisparse_triton.cli import build_parser

ROOT = Path(__file__).resolve().parent.parent


def test_the_table_and_its_derived_lists():
    assert registry.ALL_OPS == tuple(registry.BENCH_OPS)
    assert registry.TRANSFER_OPS == registry.ROW_OPS + registry.PAGE_OPS
    assert set(registry.ALL_OPS) == set(registry.TRANSFER_OPS) | {"resolve"}
    assert set(registry.DIRECTION) == set(registry.TRANSFER_OPS)
    assert set(registry.DIRECTION.values()) == {"h2d", "d2h"}
    assert registry.op_names(kinds=("resolve",)) == ("resolve",)
    assert registry.op_names(tunable=False) == ("resolve",)
    with pytest.raises(ValueError, match="unknown op kind"):
        registry.op_names(kinds=("nope",))
    with pytest.raises(ValueError, match="unknown op 'nope'"):
        registry.get_op("nope")


def test_tunable_ops_are_the_kernels_with_launch_configs():
    assert set(registry.TUNABLE_OPS) == set(tuning.ROW_KERNELS + tuning.PAGE_KERNELS)
    assert set(registry.ROW_OPS) == set(tuning.ROW_KERNELS)
    assert set(registry.PAGE_OPS) == set(tuning.PAGE_KERNELS)
    for name in registry.TUNABLE_OPS:
        assert callable(registry.launcher(name))
    with pytest.raises(ValueError, match="no tunable launcher"):
        registry.launcher("resolve")


def test_groups_expand_in_order_without_repeats():
    assert registry.expand_ops(["rows"], registry.ALL_OPS) == registry.ROW_OPS
    assert registry.expand_ops(["resolve", "transfers", "gather"], registry.ALL_OPS) == \
        ("resolve", *registry.TRANSFER_OPS)
    assert registry.expand_ops(["all"], registry.TUNABLE_OPS) == registry.TUNABLE_OPS
    with pytest.raises(ValueError, match="unknown 'resolve'"):
        registry.expand_ops(["resolve"], registry.TUNABLE_OPS)


def _choices(command: str, dest: str) -> tuple[str, ...]:
    parser = build_parser()
    sub = parser._subparsers._group_actions[0].choices[command]
    action = next(a for a in sub._actions if a.dest == dest)
    return action.type("all")


def test_the_cli_lists_come_from_the_registry():
    assert _choices("bench", "ops") == registry.ALL_OPS
    assert _choices("tune", "kernel") == registry.TUNABLE_OPS
    assert BenchSettings.__dataclass_fields__["ops"].default == registry.ALL_OPS


def test_gpu_check_names_only_registered_ops(monkeypatch):
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "bench" / "gpu_check.py")
    gpu_check = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "gpu_check", gpu_check)  # its dataclasses look it up
    spec.loader.exec_module(gpu_check)
    flag_sets = [s.flags for s in gpu_check.STEPS] + [s.quick_flags for s in gpu_check.STEPS
                                                      if s.quick_flags]
    flag_sets += list(gpu_check.DRY_RUN_FLAGS.values())
    seen = 0
    for flags in flag_sets:
        for flag, allowed in (("--ops", registry.ALL_OPS), ("--kernel", registry.TUNABLE_OPS)):
            if flag in flags:
                value = flags[flags.index(flag) + 1]
                assert registry.expand_ops(value.split(","), allowed), (flag, value)
                seen += 1
    assert seen >= 8


def test_no_other_module_spells_a_list_of_op_names():
    """Op-name tuples live in the registry only (a new op is one entry there)."""
    pattern = re.compile(r"""\(\s*["'](gather|backup|restore|spill)["']\s*,\s*["']"""
                         r"""(gather|backup|restore|spill|resolve)["']""")
    files = [*(ROOT / "hisparse_triton" / "benchmarks").glob("*.py"),
             *(ROOT / "hisparse_triton" / "commands").glob("*.py"),
             *(ROOT / "bench").glob("*.py")]
    offenders = [str(f.relative_to(ROOT)) for f in files if f.name != "registry.py"
                 and pattern.search(f.read_text(encoding="utf-8"))]
    assert offenders == []


def test_the_registry_imports_no_torch():
    code = ("import sys; import hisparse_triton.benchmarks.registry, "
            "hisparse_triton.benchmarks.settings, hisparse_triton.commands.bench; "
            "print(sorted(m for m in ('torch', 'triton') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, check=True).stdout.strip()
    assert out == "[]"
