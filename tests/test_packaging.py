"""Packaging and library hygiene: license, typing marker, one version, the supported
torch/Triton range and its check, the torch-free planner import, no print() in the library,
every environment variable documented."""

from __future__ import annotations

import ast
import importlib.metadata
import logging
import re
import subprocess
import sys
from pathlib import Path

import pytest

import hisparse_triton
from hisparse_triton import cli, compat
from hisparse_triton.errors import HiSparseError, UnsupportedVersionError

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "hisparse_triton"


@pytest.fixture(scope="module")
def pyproject():
    tomllib = pytest.importorskip("tomllib", reason="tomllib is in the standard library "
                                                    "from Python 3.11")
    return tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))


def test_license_file_matches_the_metadata(pyproject):
    project = pyproject["project"]
    assert project["license"] == "Apache-2.0" and project["license-files"] == ["LICENSE"]
    text = (ROOT / "LICENSE").read_text(encoding="utf-8")
    assert text.split()[:4] == ["Apache", "License", "Version", "2.0,"]
    for clause in ("TERMS AND CONDITIONS FOR USE, REPRODUCTION, AND DISTRIBUTION",
                   "9. Accepting Warranty or Additional Liability.",
                   "END OF TERMS AND CONDITIONS", "APPENDIX: How to apply the Apache License"):
        assert clause in text
    assert not any(c.startswith("License ::") for c in project["classifiers"])  # SPDX instead


def test_typing_marker_ships(pyproject):
    assert (PACKAGE / "py.typed").is_file()
    assert "py.typed" in pyproject["tool"]["setuptools"]["package-data"]["hisparse_triton"]
    assert "Typing :: Typed" in pyproject["project"]["classifiers"]


def test_one_version_source(pyproject, capsys):
    version = pyproject["project"]["version"]
    assert hisparse_triton.__version__ == version
    assert importlib.metadata.version("hisparse-triton") == version   # the installed metadata
    assert cli.main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"hisparse-triton {version}"


def test_version_from_a_source_tree_that_is_not_installed(monkeypatch, pyproject):
    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", missing)
    assert hisparse_triton._version() == pyproject["project"]["version"]


def test_the_declared_range_is_the_checked_range(pyproject):
    deps = {re.match(r"[A-Za-z0-9_.-]+", dep).group(0): dep
            for dep in pyproject["project"]["dependencies"]}
    assert deps["torch"] == "torch>=2.6" and deps["triton"] == "triton>=3.6,<3.10"
    assert compat.SUPPORTED == {"torch": ((2, 6), None), "triton": ((3, 6), (3, 10))}


def _ci_tritons() -> set[str]:
    """The Triton versions .ci/run installs: ``triton==X.Y.Z`` and its ``for triton in`` list."""
    text = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    found = set(re.findall(r"triton==(\d+\.\d+\.\d+)\b", text))
    for listed in re.findall(r"^for triton in ([\d. ]+); do", text, re.M):
        found.update(listed.split())
    return found


def test_every_declared_triton_is_tested_and_stated():
    """What is declared is tested: CI installs one version of every Triton minor in the range
    ``compat.SUPPORTED`` (the one ``pyproject.toml`` declares), and the README's matrix
    names each of them."""
    (major, low), high = compat.SUPPORTED["triton"]
    assert high is not None and high[0] == major  # a range within one major version
    tested = _ci_tritons()
    assert {tuple(map(int, v.split(".")[:2])) for v in tested} == \
        {(major, minor) for minor in range(low, high[1])}, tested
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    for version in tested:
        assert re.search(rf"\| [^|\n]*\b{re.escape(version)}\b[^|\n]* \|", readme), version


def test_installed_versions_pass():
    compat.check_versions()
    assert compat.installed_version("torch") is not None
    assert compat.installed_version("no-such-package-here") is None


@pytest.mark.parametrize("versions, package, message", [
    ({"torch": "2.5.1"}, "torch", r"torch 2\.5\.1 is installed; hisparse-triton supports "
                                  r"torch >= 2\.6\. Install .*download\.pytorch\.org/whl/cpu"),
    ({"triton": "3.10.0"}, "triton", r"triton 3\.10\.0 is installed; .*triton >= 3\.6, < 3\.10"),
    ({"triton": "3.5.1"}, "triton", r"triton 3\.5\.1 is installed"),
    ({"triton": None}, "triton", r"triton is not installed; hisparse-triton needs triton >= 3\.6"),
    ({"torch": None}, "torch", r"torch is not installed"),
])
def test_unsupported_versions_are_clear_errors(versions, package, message):
    with pytest.raises(UnsupportedVersionError, match=message) as info:
        compat.check_versions({"torch": "2.13.0+cpu", "triton": "3.7.1", **versions})
    assert info.value.package == package and info.value.found == versions[package]
    assert isinstance(info.value, ImportError) and isinstance(info.value, HiSparseError)
    assert "HISPARSE_TRITON_SKIP_VERSION_CHECK=1" in str(info.value)


@pytest.mark.parametrize("versions", [{"torch": "2.6.0"}, {"torch": "2.13.0a0+git1234"},
                                      {"triton": "3.6.0"}, {"triton": "3.9.9"},
                                      {"triton": "weird-build"}])
def test_supported_versions_pass(versions):
    compat.check_versions({"torch": "2.13.0+cpu", "triton": "3.7.1", **versions})


def test_the_check_can_be_turned_into_a_warning(monkeypatch, caplog):
    monkeypatch.setenv(compat.SKIP_ENV_VAR, "1")
    with caplog.at_level(logging.WARNING, logger="hisparse_triton.compat"):
        compat.check_versions({"torch": "2.4.0", "triton": "3.7.1"})
    assert "torch 2.4.0 is installed" in caplog.text


@pytest.mark.parametrize("triton, numpy, ok", [
    ("3.6.0", "2.4.0", False), ("3.6.1", "2.5.1", False), ("3.6.0", "2.3.5", True),
    ("3.7.1", "2.4.6", True), ("3.9.0", "2.4.6", True), ("3.6.0", None, True),
    (None, "2.4.0", True),
])
def test_the_interpreter_numpy_bound(monkeypatch, triton, numpy, ok):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    versions = {"triton": triton, "numpy": numpy}
    if ok:
        compat.check_interpreter(versions)
        return
    with pytest.raises(UnsupportedVersionError,
                       match=rf"numpy {numpy} is installed; the interpreter of Triton {triton} "
                             r"\(TRITON_INTERPRET=1\) needs numpy < 2\.4\. Install 'numpy<2\.4'"
                             r" or Triton >= 3\.7") as info:
        compat.check_interpreter(versions)
    assert info.value.package == "numpy" and info.value.found == numpy
    assert info.value.supported == "numpy < 2.4"


def test_the_numpy_bound_is_the_interpreters_only(monkeypatch, caplog):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    compat.check_interpreter({"triton": "3.6.0", "numpy": "2.4.0"})  # compiled: no bound
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv(compat.SKIP_ENV_VAR, "1")
    with caplog.at_level(logging.WARNING, logger="hisparse_triton.compat"):
        compat.check_interpreter({"triton": "3.6.0", "numpy": "2.4.0"})
    assert "numpy 2.4.0 is installed" in caplog.text


def test_the_kernels_check_the_interpreter_on_import(monkeypatch):
    import importlib

    import hisparse_triton.kernels as kernels

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(compat, "installed_version",
                        {"triton": "3.6.0", "numpy": "2.4.0"}.get)
    with pytest.raises(UnsupportedVersionError, match="numpy 2.4.0 is installed"):
        importlib.reload(kernels)
    monkeypatch.undo()
    importlib.reload(kernels)


def test_parse_version():
    assert compat.parse_version("2.13.0+cpu") == (2, 13, 0)
    assert compat.parse_version("3.7") == (3, 7, 0)
    with pytest.raises(ValueError, match="not a version number: 'x'"):
        compat.parse_version("x")


def test_torch_side_names_check_the_versions_first(monkeypatch):
    monkeypatch.delitem(vars(hisparse_triton), "HiSparseRuntime", raising=False)
    monkeypatch.setattr(compat, "installed_version",
                        lambda package: "2.5.0" if package == "torch" else "3.7.1")
    with pytest.raises(UnsupportedVersionError, match="torch 2.5.0 is installed"):
        hisparse_triton.HiSparseRuntime  # noqa: B018 - the lazy import is the test
    monkeypatch.undo()
    assert hisparse_triton.HiSparseRuntime.__name__ == "HiSparseRuntime"


def test_the_planner_imports_neither_torch_nor_triton():
    code = ("import sys, hisparse_triton\n"
            "hisparse_triton.EngineConfig, hisparse_triton.HiSparseConfig\n"
            "hisparse_triton.get_hisparse_kv_cache_groups, hisparse_triton.CapacityError\n"
            "hisparse_triton.__version__\n"
            "import hisparse_triton.worker.shared_pool, hisparse_triton.commands.shm\n"
            "print(sorted(m for m in ('torch', 'triton') if m in sys.modules))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, check=True)
    assert done.stdout.strip() == "[]"


def _calls_print(path: Path) -> list[int]:
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    return [node.lineno for node in ast.walk(tree) if isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name) and node.func.id == "print"]


def test_no_print_in_the_library():
    """Library code logs (``logging``); only the CLI (``cli.py``, ``commands/``) prints."""
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")) + sorted((ROOT / "kernels").rglob("*.py")):
        relative = path.relative_to(ROOT).as_posix()
        if relative == "hisparse_triton/cli.py" or relative.startswith(
                "hisparse_triton/commands/"):
            continue
        offenders += [f"{relative}:{line}" for line in _calls_print(path)]
    assert not offenders, f"print() outside the CLI: {offenders}"


def _environment_variables() -> set[str]:
    """Every environment variable the package and kernels read: literal names passed to
    ``os.environ`` / ``os.getenv`` and the ``*ENV_VAR`` constants that hold them."""
    names = set()
    for path in sorted(PACKAGE.rglob("*.py")) + sorted((ROOT / "kernels").rglob("*.py")):
        text = path.read_text(encoding="utf-8")
        names.update(re.findall(r"(?:os\.environ(?:\.get|\.setdefault)?[\[(]|os\.getenv\()"
                                r"\s*\"([A-Z][A-Z0-9_]*)\"", text))
        names.update(re.findall(r"^\s*[A-Z_]*ENV_VAR\s*=\s*\"([A-Z][A-Z0-9_]*)\"", text, re.M))
    return names


def test_every_environment_variable_is_in_the_readme_table():
    names = _environment_variables()
    assert {"HISPARSE_TRITON_BACKEND", "HISPARSE_TRITON_TUNING_CACHE", "TRITON_INTERPRET",
            "HISPARSE_TRITON_SKIP_VERSION_CHECK", "XDG_CACHE_HOME"} <= names
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    section = readme.split("## Environment variables", 1)[1].split("\n## ", 1)[0]
    table = set(re.findall(r"^\| `([A-Z][A-Z0-9_]*)` \|", section, re.M))
    assert names <= table, f"not in the README's table: {sorted(names - table)}"


def test_no_shipped_file_points_to_an_internal_brief():
    """The user has no internal design brief: no doc, module, kernel, benchmark or example
    points to one (the docs explain things in their own words)."""
    import subprocess

    tracked = subprocess.run(["git", "ls-files", "*.py", "*.md", "*.toml"], cwd=ROOT,
                             capture_output=True, text=True)
    if tracked.returncode != 0:
        pytest.skip("not a git checkout")
    paths = [ROOT / name for name in tracked.stdout.split() if not name.startswith("tests/")]
    assert len(paths) > 50
    offenders = [str(p.relative_to(ROOT)) for p in paths
                 if "DESIGN" + ".md" in p.read_text(encoding="utf-8")]
    assert not offenders, offenders
