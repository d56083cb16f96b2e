"""The torch / Triton versions hisparse-triton supports, checked with a clear message.

``SUPPORTED`` is the range ``pyproject.toml`` declares (torch >= 2.6; triton >= 3.6, < 3.10).
``check_versions()`` reads the installed versions from the package metadata (no import of
torch or triton, so it is cheap and runs before either is loaded) and raises
``UnsupportedVersionError`` naming the package, the version found and the supported range.
The package runs it before the first use of a torch-side name (``HiSparseRuntime``,
``ops``, ...); the planner (``EngineConfig``, ``hisparse_triton.layout``) needs neither
package and is never checked. ``HISPARSE_TRITON_SKIP_VERSION_CHECK=1`` turns the error into
a logged warning (to try a version outside the range at your own risk).

``INTERPRETER_NUMPY`` bounds NumPy for Triton's CPU interpreter (``TRITON_INTERPRET=1``) only;
``check_interpreter()`` checks it when ``hisparse_triton.kernels`` is imported under the
interpreter. The bound cannot be declared in ``pyproject.toml`` (a requirement cannot depend
on the installed Triton), and compiled kernels do not need it.
"""

from __future__ import annotations

import importlib.metadata
import logging
import os
import re
from typing import Mapping, Optional

from hisparse_triton.errors import UnsupportedVersionError

__all__ = ["INTERPRETER_NUMPY", "SKIP_ENV_VAR", "SUPPORTED", "check_interpreter",
           "check_versions", "installed_version", "parse_version"]

logger = logging.getLogger(__name__)

#: Environment variable that turns a failed check into a warning.
SKIP_ENV_VAR = "HISPARSE_TRITON_SKIP_VERSION_CHECK"

#: package -> (minimum, exclusive maximum or None), as (major, minor) pairs.
SUPPORTED: dict[str, tuple[tuple[int, int], Optional[tuple[int, int]]]] = {
    "torch": ((2, 6), None),
    "triton": ((3, 6), (3, 10)),
}

#: Triton (major, minor) -> the exclusive NumPy maximum its interpreter needs. Triton 3.6's
#: interpreter turns a runtime loop bound (a one-element array) into an int with ``int()``,
#: which NumPy 2.4 refuses (Triton 3.7 squeezes the array first).
INTERPRETER_NUMPY: dict[tuple[int, int], tuple[int, int]] = {(3, 6): (2, 4)}

#: Distributions that provide the package (PyTorch nightlies ship Triton as
#: ``pytorch-triton``).
_DISTRIBUTIONS = {"torch": ("torch",), "triton": ("triton", "pytorch-triton")}

#: How to install a supported version of each package.
_INSTALL = {
    "torch": "pip install 'torch>=2.6'; without a GPU: pip install torch --index-url "
             "https://download.pytorch.org/whl/cpu",
    "triton": "pip install 'triton>=3.6,<3.10', or the Triton your CUDA build of torch brings",
}

_VERSION = re.compile(r"\s*v?(\d+)\.(\d+)(?:\.(\d+))?")


def parse_version(version: str) -> tuple[int, int, int]:
    """``(major, minor, patch)`` of a version string (``"2.13.0+cpu"`` -> ``(2, 13, 0)``;
    pre-release and local suffixes are ignored); ``ValueError`` if it has no ``X.Y``."""
    match = _VERSION.match(version)
    if match is None:
        raise ValueError(f"not a version number: {version!r}.")
    return int(match.group(1)), int(match.group(2)), int(match.group(3) or 0)


def installed_version(package: str) -> Optional[str]:
    """The installed version of ``package`` (``"torch"`` or ``"triton"``) from its
    distribution's metadata, ``None`` when it is not installed."""
    for dist in _DISTRIBUTIONS.get(package, (package,)):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def _range_text(package: str) -> str:
    (lo_major, lo_minor), high = SUPPORTED[package]
    text = f"{package} >= {lo_major}.{lo_minor}"
    return text + (f", < {high[0]}.{high[1]}" if high else "")


def _problem(package: str, found: Optional[str]) -> Optional[str]:
    wanted = _range_text(package)
    if found is None:
        return f"{package} is not installed; hisparse-triton needs {wanted}."
    try:
        major, minor, _ = parse_version(found)
    except ValueError:
        return None  # an unparseable (e.g. source-build) version: trust the user
    low, high = SUPPORTED[package]
    if (major, minor) < low or (high is not None and (major, minor) >= high):
        return f"{package} {found} is installed; hisparse-triton supports {wanted}."
    return None


def check_versions(versions: Optional[Mapping[str, Optional[str]]] = None) -> None:
    """Raise ``UnsupportedVersionError`` unless torch and Triton are in ``SUPPORTED``.

    ``versions``: ``{package: version or None}`` to check instead of the installed ones
    (missing keys are read from the metadata). With ``$HISPARSE_TRITON_SKIP_VERSION_CHECK``
    set to ``1`` a problem is logged as a warning instead."""
    versions = dict(versions or {})
    for package in SUPPORTED:
        found = versions[package] if package in versions else installed_version(package)
        problem = _problem(package, found)
        if problem is None:
            continue
        advice = (f"Install a supported version ({_INSTALL[package]}), or set "
                  f"{SKIP_ENV_VAR}=1 to try this one at your own risk.")
        if os.environ.get(SKIP_ENV_VAR) == "1":
            logger.warning("%s %s is set: continuing anyway.", problem, SKIP_ENV_VAR)
            continue
        raise UnsupportedVersionError(f"{problem} {advice}", package, found,
                                      _range_text(package))


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def check_interpreter(versions: Optional[Mapping[str, Optional[str]]] = None) -> None:
    """Under ``TRITON_INTERPRET=1``, raise ``UnsupportedVersionError`` (package ``"numpy"``)
    when the installed Triton's interpreter needs an older NumPy than the installed one
    (``INTERPRETER_NUMPY``); nothing without the interpreter. ``versions``: ``{"triton": ...,
    "numpy": ...}`` to check instead of the installed ones; ``$HISPARSE_TRITON_SKIP_VERSION_
    CHECK=1`` logs the problem as a warning instead."""
    if not _interpreting():
        return
    versions = dict(versions or {})
    found = {package: versions[package] if package in versions else installed_version(package)
             for package in ("triton", "numpy")}
    try:
        triton = parse_version(found["triton"] or "")[:2]
        numpy = parse_version(found["numpy"] or "")[:2]
    except ValueError:
        return  # not installed (check_versions says so) or an unparseable build: trust it
    high = INTERPRETER_NUMPY.get(triton)
    if high is None or numpy < high:
        return
    wanted = f"numpy < {high[0]}.{high[1]}"
    problem = (f"numpy {found['numpy']} is installed; the interpreter of Triton "
               f"{found['triton']} (TRITON_INTERPRET=1) needs {wanted}.")
    advice = (f"Install 'numpy<{high[0]}.{high[1]}' or Triton >= {triton[0]}.{triton[1] + 1}, "
              f"or set {SKIP_ENV_VAR}=1 to try this one at your own risk.")
    if os.environ.get(SKIP_ENV_VAR) == "1":
        logger.warning("%s %s is set: continuing anyway.", problem, SKIP_ENV_VAR)
        return
    raise UnsupportedVersionError(f"{problem} {advice}", "numpy", found["numpy"], wanted)
