"""What the wheel holds and what its parts may import, read from the source (AST).

- The wheel is the product: nothing under ``hisparse_triton/`` or ``kernels/`` imports the lab
  in ``bench/`` (``bench``, ``lab``), and no lab module (stand-in driver, launch recorder,
  host cost, instruction counts, decode checks) lives there; ``pyproject.toml`` lists every
  package of the source tree.
- The decode path (the worker, the ops, the kernels) imports nothing from the compile report
  (``hisparse_triton.compile``), directly or through what it imports.
- ``kernels/`` holds ``@triton.jit`` kernels and their launchers (``launch_config`` is their
  shared launch-shape checks): every other module there defines a kernel or launches one
  (``backup``: launchers over the copy kernel), and the kernels
  import nothing above the op contracts (their family's ``contract`` / ``workspace``, an
  integration's ``*_checks``, the row tables and launch configs).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from test_import_rules import (
    PACKAGE,
    ROOT,
    _modules_under,
    chain,
    closure,
    direct_imports,
    module_file,
)

KERNELS = ROOT / "kernels"
LAB = ROOT / "bench" / "lab"
#: Modules of the lab (``bench/lab/``): none of these names may come back into the wheel.
LAB_MODULES = ("standin_driver", "launches", "host_cost", "instructions", "step_cost",
               "decode_checks", "split_bench", "vllm_ops")
#: A launch: ``kernel[grid](...)``, a described ``KernelLaunch``, or the copy launcher.
LAUNCHES = re.compile(r"\w\[[^\]\n]+\]\(|KernelLaunch\(|launch_copy\(")
#: What a kernel module may import of the package besides ``hisparse_triton.kernels.*``
#: (``compat``: the import-time check that the installed Triton's interpreter can run them).
KERNEL_MAY_IMPORT = re.compile(
    r"hisparse_triton\.(ops\.\w+\.(contract|workspace)|integrations\.\w+_checks"
    r"|row_table|tuning|errors|compat)$")


def _shipped_files() -> list[Path]:
    return sorted([*PACKAGE.rglob("*.py"), *KERNELS.rglob("*.py")])


def _imports_anywhere(path: Path) -> set[str]:
    """Top-level names of every module ``path`` imports (anywhere in the file), and the
    modules ``python -m`` or ``import_module`` strings name."""
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            names.add(node.module.split(".")[0])
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) \
                and re.fullmatch(r"(bench|lab)(\.\w+)+", node.value):
            names.add(node.value.split(".")[0])
    return names


def test_the_lab_is_found():
    assert {p.stem for p in LAB.glob("*.py")} >= set(LAB_MODULES)


@pytest.mark.parametrize("path", _shipped_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_nothing_shipped_imports_the_lab(path):
    assert not _imports_anywhere(path) & {"bench", "lab"}


def test_no_lab_module_is_shipped():
    shipped = {p.stem for p in _shipped_files()}
    assert not shipped & set(LAB_MODULES), sorted(shipped & set(LAB_MODULES))


def test_the_rule_sees_an_import_of_the_lab(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text("def f():\n    from lab.launches import record_launches\n"
                     "CMD = ['-m', 'lab.decode_checks']\n")
    assert _imports_anywhere(probe) == {"lab"}


def test_pyproject_lists_every_package():
    text = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    listed = set(re.findall(r'"(hisparse_triton[\w.]*)"',
                            text.split("packages =")[1].split("]")[0]))
    found = {"hisparse_triton." + ".".join(p.parent.relative_to(PACKAGE).parts)
             for p in PACKAGE.rglob("__init__.py")} | {"hisparse_triton.kernels"}
    found = {name.rstrip(".") for name in found}
    assert listed == found


def _decode_path() -> set[str]:
    return (_modules_under(PACKAGE / "worker") | _modules_under(PACKAGE / "ops")
            | _modules_under(KERNELS))


def test_the_decode_path_imports_nothing_of_the_compile_report():
    reached = closure(_decode_path())
    bad = sorted(m for m in reached if m == "hisparse_triton.compile"
                 or m.startswith("hisparse_triton.compile."))
    assert not bad, "\n".join(chain(reached, m) for m in bad)
    assert "hisparse_triton.kernels.resolve" in reached   # (the closure does see the path)


@pytest.mark.parametrize("module", sorted(_modules_under(KERNELS)))
def test_kernels_are_kernels_and_launchers(module):
    path = module_file(module)
    text = path.read_text(encoding="utf-8")
    if path.stem not in ("__init__", "launch_config"):   # a kernel, or launchers over one
        assert "@triton.jit" in text or LAUNCHES.search(text), \
            f"{path.name} defines no kernel and launches none: it belongs elsewhere"
    imported = {m for m in direct_imports(module) if m.startswith("hisparse_triton")}
    packages = {m for m in imported if module_file(m).name == "__init__.py"
                and any(other.startswith(m + ".") for other in imported)}
    above = sorted(m for m in imported - packages
                   if not m.startswith("hisparse_triton.kernels")
                   and not KERNEL_MAY_IMPORT.match(m))
    assert not above, f"{module} imports {above} (above the op contracts)"
