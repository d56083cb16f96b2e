"""The op families' layout: what ``hisparse_triton.ops`` exports, and the import rules (the
kernels and the contracts never import a torch reference or an op's dispatch)."""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

import pytest

from hisparse_triton import ops

ROOT = Path(__file__).resolve().parent.parent
OPS = ROOT / "hisparse_triton" / "ops"
FAMILIES = ("copy", "prefill", "resolve")
#: Modules of ``hisparse_triton.ops`` a kernel may import (everything else is the oracle or
#: the dispatch that calls the kernels).
KERNEL_MAY_IMPORT = {f"hisparse_triton.ops.{family}.{module}"
                     for family in FAMILIES for module in ("contract", "workspace")}


def imported_modules(path: Path) -> set[str]:
    """Every module ``path`` imports (``from a.b import c`` counts ``a.b`` and ``a.b.c``)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def test_every_public_name_is_exported():
    for name in ("BACKENDS", "ENV_VAR", "BackendUnavailableError", "ResolveResult",
                 "ResolveWorkspace", "copy_pages", "copy_rows", "resolve",
                 "restore_resolve_state", "select_backend", "validate_table", "is_eager",
                 "copy_rows_op", "copy_pages_op", "resolve_op", "OP_TABLE", "flat_table"):
        assert hasattr(ops, name), name
    assert set(ops.__all__) <= set(dir(ops))
    assert callable(ops.resolve) and ops.resolve.__module__ == "hisparse_triton.ops.resolve.op"


def test_the_single_file_modules_are_gone():
    for name in ("hisparse_triton.reference", "hisparse_triton.resolve_workspace"):
        assert importlib.util.find_spec(name) is None, name


def test_family_modules_import_with_the_from_form():
    from hisparse_triton.ops.copy import contract as copy_contract
    from hisparse_triton.ops.copy import reference as copy_reference
    from hisparse_triton.ops.resolve import contract, reference, workspace

    assert reference.resolve.__module__ == "hisparse_triton.ops.resolve.reference"
    assert copy_reference.copy_rows.__module__ == "hisparse_triton.ops.copy.reference"
    assert contract.ResolveResult is ops.ResolveResult
    assert workspace.ResolveWorkspace is ops.ResolveWorkspace
    assert callable(copy_contract.check_copy_args)


@pytest.mark.parametrize("path", sorted((ROOT / "kernels").glob("*.py")), ids=lambda p: p.name)
def test_kernels_import_contracts_not_the_oracle(path):
    # "from hisparse_triton.ops.resolve.contract import X" lists the module and "...contract.X".
    banned = sorted(name for name in imported_modules(path)
                    if name.startswith("hisparse_triton.ops") and name not in KERNEL_MAY_IMPORT
                    and not any(name.startswith(f"{ok}.") for ok in KERNEL_MAY_IMPORT))
    assert not banned, f"{path.name} imports {banned}"


@pytest.mark.parametrize("family", FAMILIES)
def test_contracts_import_no_reference_and_no_dispatch(family):
    used = imported_modules(OPS / family / "contract.py")
    banned = {f"hisparse_triton.ops.{f}.{m}" for f in FAMILIES for m in ("reference", "op")}
    assert not used & banned, sorted(used & banned)
