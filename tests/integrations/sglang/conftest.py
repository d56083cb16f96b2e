"""Set-up for the tests of the SGLang plugin (``hisparse_triton.integrations.sglang``).

The op-level tests (``test_sglang_ops*.py``) need no SGLang. The tests marked
``needs_sglang`` drive SGLang 0.5.23's own classes; SGLang is not a dependency of this
project, and its Python sources import on a CPU machine from the separate venv that
``.ci/sglang_venv.sh`` makes. Elsewhere they skip, with the command that makes the venv;
``HISPARSE_TRITON_REQUIRE_SGLANG=1`` (set by ``.ci/run``) turns that skip into a failure, so CI
never passes them by skipping.

Where SGLang is importable, the packages its modules import at load time but whose code
these tests never run are stubbed first (``sglang_stubs``: ``sgl_kernel``, ``torchvision``,
``sentencepiece``, ``compressed_tensors``, ``gguf``), as SGLang's own CPU tests stub
``sgl_kernel``. The stubs live here only, never in the product.
"""

from __future__ import annotations

import importlib.util
import os

import pytest

REQUIRE_SGLANG_ENV = "HISPARSE_TRITON_REQUIRE_SGLANG"
SGLANG_VERSION = "0.5.23"
MAKE_VENV = ("make the CPU venv with `bash .ci/sglang_venv.sh`, then run "
             "`.venv-sglang/bin/python -m pytest tests/integrations/sglang`")


def _sglang_version() -> str | None:
    if importlib.util.find_spec("sglang") is None:
        return None
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version("sglang")
    except PackageNotFoundError:
        return None


if _sglang_version() is not None:
    import sglang_stubs

    sglang_stubs.install()


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", f"needs_sglang: drives SGLang {SGLANG_VERSION}'s own classes (skipped "
                   "without it)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    found = _sglang_version()
    if found == SGLANG_VERSION:
        return
    why = (f"SGLang {SGLANG_VERSION} is not importable here (found: {found or 'none'}); "
           f"{MAKE_VENV}")
    needing = [item for item in items if item.get_closest_marker("needs_sglang") is not None]
    if needing and os.environ.get(REQUIRE_SGLANG_ENV) == "1":
        raise pytest.UsageError(f"{REQUIRE_SGLANG_ENV}=1 but {why}")
    for item in needing:
        item.add_marker(pytest.mark.skip(reason=why))
