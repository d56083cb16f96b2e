"""The import rules between the runtime's halves, read from the source (AST), not by running it.

- The scheduler half (``hisparse_triton/scheduler/``, or ``scheduler.py`` with its block pool,
  journal and prefix cache) imports no torch or Triton, no part of the worker and not the
  in-process facade (``runtime.py``), directly or through any module it imports.
- The worker half (``hisparse_triton/worker/``) imports no part of the scheduler and not the
  facade, directly or indirectly; its direct imports are the shared modules below; only
  ``worker/hot_cache.py`` imports the ops (``hisparse_triton.ops``) and the kernels.

A half's own modules may not name a forbidden module anywhere (also inside a function); the
modules they import are followed by what runs when they are imported (their function bodies
are not). Nothing under ``if TYPE_CHECKING:`` counts; importing ``a.b.c`` runs ``a`` and
``a.b`` too, so parent packages are followed.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Iterator, Optional

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "hisparse_triton"
WORKER = "hisparse_triton.worker"
#: What the worker's modules may import directly, besides their own package.
WORKER_MAY_IMPORT = frozenset({
    "hisparse_triton", "hisparse_triton.layout", "hisparse_triton.groups",
    "hisparse_triton.step_plan", "hisparse_triton.specs", "hisparse_triton.config",
    "hisparse_triton.memory", "hisparse_triton.row_table", "hisparse_triton.errors",
    "hisparse_triton.staging",      # the prefill staging region both halves derive
    "hisparse_triton.compat",       # the supported torch / Triton range, checked by the pools
    "hisparse_triton.tuning_cache",  # where the kernels' launch configs come from (a log line)
})
#: The one worker module that reaches the ops and kernels.
KERNEL_DOOR = "hisparse_triton.worker.hot_cache"
SCHEDULER_SIDE_FILES = ("scheduler.py", "block_pool.py", "journal.py", "prefix_cache.py")


def module_file(name: str) -> Optional[Path]:
    """The source file of an internal module name (``kernels/`` is installed as
    ``hisparse_triton.kernels``), or None for an external or missing one."""
    parts = name.split(".")
    if parts[0] != "hisparse_triton":
        return None
    base, rest = (ROOT / "kernels", parts[2:]) if parts[1:2] == ["kernels"] \
        else (PACKAGE, parts[1:])
    path = base.joinpath(*rest)
    if (path / "__init__.py").is_file():
        return path / "__init__.py"
    return path.with_suffix(".py") if path.with_suffix(".py").is_file() else None


def module_name(path: Path) -> str:
    """Inverse of ``module_file``."""
    if path.is_relative_to(ROOT / "kernels"):
        parts = ["hisparse_triton", "kernels", *path.relative_to(ROOT / "kernels").parts]
    else:
        parts = ["hisparse_triton", *path.relative_to(PACKAGE).parts]
    parts[-1] = parts[-1].removesuffix(".py")
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


_FUNCTIONS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)


def _statements(tree: ast.AST, import_time: bool) -> Iterator[ast.AST]:
    """Every node of ``tree`` except those under ``if TYPE_CHECKING:`` (and, with
    ``import_time``, those inside functions: they run when called, not when imported)."""
    for node in ast.iter_child_nodes(tree):
        if import_time and isinstance(node, _FUNCTIONS):
            continue
        test = node.test if isinstance(node, ast.If) else None
        if test is not None and "TYPE_CHECKING" in ast.unparse(test):
            for other in node.orelse:
                yield other
                yield from _statements(other, import_time)
            continue
        yield node
        yield from _statements(node, import_time)


def direct_imports(name: str, *, import_time: bool = False) -> set[str]:
    """Modules the source of ``name`` imports (internal ones resolved to modules, external
    ones by their top-level name), with the parent packages of each; ``import_time``: only
    those its import runs."""
    path = module_file(name)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    for node in _statements(tree, import_time):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names
                         if module_file(f"{base}.{alias.name}"))
    names = set()
    for imported in found:
        parts = imported.split(".")
        if parts[0] != "hisparse_triton":
            names.add(parts[0])
            continue
        names.update(".".join(parts[:i]) for i in range(1, len(parts) + 1)
                     if module_file(".".join(parts[:i])))
    return names


def closure(roots: set[str]) -> dict[str, str]:
    """Every module reached from ``roots`` (every import of a root, the import-time ones of
    the rest): ``{module: the module that first imports it}``."""
    reached, todo = {root: root for root in roots}, list(roots)
    while todo:
        current = todo.pop()
        for imported in direct_imports(current, import_time=current not in roots):
            if imported not in reached:
                reached[imported] = current
                if module_file(imported):
                    todo.append(imported)
    return reached


def chain(reached: dict[str, str], name: str) -> str:
    path = [name]
    while reached[path[-1]] != path[-1]:
        path.append(reached[path[-1]])
    return " <- ".join(path)


def _modules_under(folder: Path) -> set[str]:
    return {module_name(p) for p in sorted(folder.rglob("*.py"))}


def scheduler_modules() -> set[str]:
    folder = PACKAGE / "scheduler"
    if folder.is_dir():
        return _modules_under(folder)
    return {module_name(PACKAGE / f) for f in SCHEDULER_SIDE_FILES if (PACKAGE / f).is_file()}


def worker_modules() -> set[str]:
    return _modules_under(PACKAGE / "worker")


def _is_scheduler_side(name: str) -> bool:
    return any(name == m or name.startswith(m + ".") for m in scheduler_modules())


def test_the_halves_are_found():
    assert "hisparse_triton.worker.worker" in worker_modules()
    assert any(m.split(".")[-1] == "scheduler" for m in scheduler_modules())


def test_the_scheduler_half_imports_no_torch_no_worker_and_no_facade():
    reached = closure(scheduler_modules())
    bad = sorted(m for m in reached if m in ("torch", "triton", "hisparse_triton.runtime")
                 or m == WORKER or m.startswith(WORKER + "."))
    assert not bad, "\n".join(chain(reached, m) for m in bad)


def test_the_worker_half_imports_no_scheduler_and_no_facade():
    reached = closure(worker_modules())
    bad = sorted(m for m in reached
                 if _is_scheduler_side(m) or m == "hisparse_triton.runtime")
    assert not bad, "\n".join(chain(reached, m) for m in bad)


@pytest.mark.parametrize("module", sorted(worker_modules()))
def test_the_worker_imports_only_the_shared_modules(module):
    internal = {m for m in direct_imports(module) if m.startswith("hisparse_triton")}
    reaching = {m for m in internal
                if m.startswith(("hisparse_triton.ops", "hisparse_triton.kernels"))}
    if module == KERNEL_DOOR:
        assert reaching, "the hot cache is where the worker calls the ops and kernels"
        internal -= reaching
    else:
        assert not reaching, f"{module} imports {sorted(reaching)}: only {KERNEL_DOOR} may"
    foreign = sorted(m for m in internal if m not in WORKER_MAY_IMPORT
                     and m != WORKER and not m.startswith(WORKER + "."))
    assert not foreign, f"{module} imports {foreign}"


def test_the_rules_see_a_violation():
    """The reader resolves relative, aliased and in-function imports and parent packages."""
    assert "hisparse_triton.ops" in direct_imports(KERNEL_DOOR)
    assert {"hisparse_triton", "hisparse_triton.worker",
            "hisparse_triton.worker.pools"} <= direct_imports("hisparse_triton.worker.worker")
    reached = closure({"hisparse_triton.worker.hot_cache"})
    assert "torch" in reached and "hisparse_triton.kernels.resolve" in reached
    assert chain(reached, "hisparse_triton.kernels.resolve") == (
        "hisparse_triton.kernels.resolve <- hisparse_triton.worker.hot_cache")
    # a function-level import counts in the module itself, not in a module it imports
    assert "torch" in direct_imports("hisparse_triton.tuning_cache")
    assert "torch" not in direct_imports("hisparse_triton.tuning_cache", import_time=True)
